"""Context parallel with pipeline parallel: four gloo processes at CP=2 x PP=2 (each stage's CP pair holds
two of the tiny model's four layers; megatron's schedule sends each rank's [L / CP, b, h] activations to its
peer of the next stage; the engine passes the whole sequence length, which megatron divides by CP) and at
CP=2 x PP=2 x VPP=2 (megatron's interleaved schedule, one layer per model chunk) against one process at
CP=1 x PP=1, on rows of uneven length: compute_log_prob (log-probs and entropy) and one PPO update (grad
norm, log-probs after the step) equal CP=1's.

The VPP layout hung on CPU until rltrain.megatron.cpu_compat ordered the pipeline's shape exchange: megatron
batches the shape messages (send_prev, recv_prev, send_next, recv_next) on both ranks, and gloo matches
messages between two ranks in posting order, so at PP=2 with interleaving (both directions between the same
pair) the micro-batches' shapes crossed and the stages ended up waiting for each other.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.megatron._common import spawn

from ._common import (
    UPDATE_DEPTH,
    actor_of,
    assert_tiny_close,
    free_port,
    init_groups,
    run_spawned,
    tiny_model_cfg,
)
from .test_context_parallel import GRAD_NORM_REL, _batch, _cfg, _rl

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


# (name, pp, vpp) at CP=2 in a world of four processes.
LAYOUTS = [("cp2_pp2", 2, None), ("cp2_pp2_vpp2", 2, 2)]


def _layout(cp: int, pp: int, vpp: int | None = None):
    from dataclasses import replace

    cfg = _cfg(cp)
    mcfg = replace(cfg.megatron, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    return replace(cfg, megatron=mcfg)


def _run(hf_path: str, cp: int, pp: int, rl: dict, vpp: int | None = None) -> dict:

    frozen = actor_of(tiny_model_cfg(hf_path), _layout(cp, pp, vpp), "cpu", trainable=False)
    out = dict(frozen.compute_log_prob(rl))
    del frozen
    actor = actor_of(tiny_model_cfg(hf_path), _layout(cp, pp, vpp), "cpu", total_steps=4)
    out["grad_norm"] = actor.update_policy(rl)["actor/grad_norm"]
    out["after"] = actor.compute_log_prob(rl, with_entropy=False)["log_probs"]
    return out


def _worker(rank: int, port: int, hf_path: str, rl: dict, out_dir: str) -> None:
    run_spawned(_cp2_pp2, rank, port, hf_path, rl, out_dir)


def _cp2_pp2(rank: int, port: int, hf_path: str, rl: dict, out_dir: str) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=4, master_port=port)
    results = {}
    for name, pp, vpp in LAYOUTS:
        init_groups(_layout(2, pp, vpp).megatron, "cpu")
        assert parallel_state.get_context_parallel_world_size() == 2
        assert parallel_state.get_pipeline_model_parallel_world_size() == pp
        assert parallel_state.get_data_parallel_world_size() == 1
        results[name] = _run(hf_path, 2, pp, rl, vpp)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_parallel()


def test_cp2_pp2_and_vpp2_match_cp1(mp_world, tiny_hf, tmp_path):

    batch = _batch()
    old = actor_of(tiny_model_cfg(str(tiny_hf)), _layout(1, 1), "cpu", trainable=False).compute_log_prob(
        batch, with_entropy=False
    )["log_probs"]
    rl = _rl(batch, old)
    ref = _run(str(tiny_hf), 1, 1, rl)
    assert float((ref["after"] - ref["log_probs"]).abs().max()) > 1e-4  # the update moved the policy
    spawn(_worker, args=(free_port(), str(tiny_hf), rl, str(tmp_path)), nprocs=4)
    diffs = {}
    for rank in range(4):  # every stage returns the last stage's results
        for name, *_ in LAYOUTS:
            got, where = torch.load(tmp_path / f"rank{rank}.pt")[name], f"rank {rank} {name}"
            assert_tiny_close(got["log_probs"], ref["log_probs"], msg=f"{where}: log-probs")
            assert_tiny_close(got["entropy"], ref["entropy"], msg=f"{where}: entropy")
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=GRAD_NORM_REL), where
            assert_tiny_close(got["after"], ref["after"], msg=f"{where}: after update", depth=UPDATE_DEPTH)
            diffs[where] = {
                k: float((got[k] - ref[k]).abs().max()) for k in ("log_probs", "entropy", "after")
            }
    print(json.dumps(diffs, indent=1))


def test_tiny_grpo_cli_at_cp2_pp2_vpp2(tmp_path):
    """`rltrain tiny-grpo` at CP=2 x PP=2 x VPP=2 over four CPU workers (a 4-layer model: one layer per
    model chunk) trains 2 steps; its one-micro-batch forward passes are split for the interleaved schedule."""
    import subprocess
    import sys

    rltrain = os.path.join(os.path.dirname(sys.executable), "rltrain")
    out = tmp_path / "run"
    cmd = [
        rltrain, "tiny-grpo", "--cluster.gpus_per_node", "4", "--model.arch.num_layers", "4",
        "--actor.megatron.context_parallel_size", "2", "--actor.megatron.pipeline_model_parallel_size", "2",
        "--actor.megatron.virtual_pipeline_model_parallel_size", "2", "--trainer.total_steps", "2",
        "--trainer.output_dir", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    plan = json.loads((out / "plan.json").read_text())
    actor = next(lay for lay in plan["layouts"] if lay["role"] == "actor")
    assert (actor["cp"], actor["pp"], actor["vpp"]) == (2, 2, 2)
