"""End to end: `rltrain tiny-grpo` with packed sequences (the default on cpu, model.use_remove_padding null)
and with padded rows (false) runs the same first step: the same rollout, rewards and advantages, and the
update's loss, KL, entropy and grad norm equal to fp32 rounding; plan.json records the layout it chose.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_e2e import metrics, rltrain

from .tolerance import rel_tolerance

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

# The tiny preset's model: hidden 64, MLP 176 (its widest sum), 2 layers; a step is a forward and backward.
UPDATE_REL = rel_tolerance(torch.float32, 176, 3 * (2 * 2 + 2))


def test_packed_and_padded_runs_agree_on_the_first_step(tmp_path):
    rows, layouts = {}, {}
    for setting in ("null", "false"):
        out = tmp_path / setting
        result = rltrain("tiny-grpo", "--trainer.total_steps", "1", "--trainer.save_freq", "0",
                         "--trainer.test_freq", "0", "--trainer.val_before_train", "false",
                         "--model.use_remove_padding", setting, "--trainer.output_dir", str(out))  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        rows[setting] = metrics(out)[0]
        plan = json.loads((out / "plan.json").read_text())
        layouts[setting] = next(e["remove_padding"] for e in plan["engines"] if e["role"] == "actor")
    assert layouts == {"null": True, "false": False}
    packed, padded = rows["null"], rows["false"]
    for key, value in padded.items():
        if key.startswith(("timing/", "perf/")) or not isinstance(value, int | float):
            continue
        if key.startswith("actor/") and key != "actor/lr":  # computed by the update's forward and backward
            assert packed[key] == pytest.approx(value, rel=UPDATE_REL, abs=1e-6), key
        else:  # rollout, rewards, advantages: the update has not run yet
            assert packed[key] == value, key
