"""End to end: the `rltrain` command on real Ray, real megatron-core (gloo) and real files.

Each test runs the CLI in its own process, as a user would; each such run starts a local Ray cluster
(~5 s) and imports megatron in its workers (~4-8 s), so these tests are marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

REQUIRED = ("step", "reward/mean", "actor/loss", "actor/lr", "timing/step_s")


def rltrain(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "rltrain.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_grpo_run_writes_the_run_folder(tmp_path):
    out = tmp_path / "run"
    result = rltrain("tiny-grpo", "--trainer.total_steps", "3", "--trainer.output_dir", str(out),
                     "--profile.tool", "torch", "--profile.steps", "2",
                     "--profile.torch.activities", "cpu")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(row[k] is not None for k in REQUIRED), row
        # The weights change every step and the rollout samples with them (colocated, fp32 on CPU): its
        # log-probs equal the recomputation, so the rollout never used stale weights.
        assert row["actor/grad_norm"] > 0 and row["rollout/logprob_diff_max"] < 1e-4, row
    plan = json.loads((out / "plan.json").read_text())
    table = next(o for o in plan["optim"] if o["role"] == "actor")["table"]
    assert [r["actor/lr"] for r in rows] == pytest.approx([t["lr"] for t in table])
    assert (out / "config.yaml").exists() and (out / "reward_curve.png").stat().st_size > 1000
    # per-role profiles of step 2 only, in the agreed layout
    profile = out / "profile"
    for role in ("generate_sequences", "actor_compute_log_prob", "actor_update", "reward_compute"):
        trace = profile / "step_2" / role / "rank_0" / "trace.json"
        assert trace.exists(), role
        assert role in trace.read_text()
    assert not (profile / "step_1").exists() and not (profile / "step_3").exists()
    assert (profile / "profile_summary.md").exists()


def test_data_parallel_and_tensor_parallel_runs(tmp_path):
    """2 worker processes: DP=2 splits the responses, TP=2 shares them (dispatch follows the rank grid)."""
    for name, flags in (
        ("dp2", ["--actor.ppo_micro_batch_size_per_gpu", "2"]),
        ("tp2", ["--actor.megatron.tensor_model_parallel_size", "2", "--actor.megatron.sequence_parallel", "True",
                 "--rollout.tensor_model_parallel_size", "2"]),
    ):  # fmt: skip
        out = tmp_path / name
        result = rltrain("tiny-grpo", "--cluster.gpus_per_node", "2", "--trainer.total_steps", "2",
                         "--trainer.output_dir", str(out), *flags)  # fmt: skip
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
        assert len(metrics(out)) == 2


def test_reward_rises_on_the_tiny_task(tmp_path):
    """The README's main job learns: mean reward of the last 10 steps well above the first 10."""
    out = tmp_path / "learn"
    result = rltrain("tiny-grpo", "--trainer.total_steps", "80", "--trainer.output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [r["reward/mean"] for r in metrics(out)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first and last > first + 0.1, (first, last)


def test_tiny_ppo_reward_rises(tmp_path):
    """tiny-ppo learns as visibly as tiny-grpo (the README lists both among presets that learn in minutes):
    on 2 cores the last 10 of 60 steps averaged 0.32 against 0.03 for the first 10, and validation rose.
    The same run checks that the critic trains and the KL penalty is in the reward (one run, not two:
    each CLI run costs ~30 s of start-up on 2 cores)."""
    out = tmp_path / "ppo-learn"
    result = rltrain("tiny-ppo", "--trainer.total_steps", "60", "--trainer.test_freq", "30",
                     "--trainer.save_freq", "0", "--trainer.output_dir", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first and last > first + 0.1, (first, last)
    val = [r["val/reward/mean"] for r in rows if "val/reward/mean" in r]
    before = [r["val_before/reward/mean"] for r in rows if "val_before/reward/mean" in r]
    assert before and val and val[-1] > before[0], (before, val)
    # The critic trains and the KL penalty is in the reward at every step; the actor updates after the
    # preset's critic warm-up, and its per-update KL (the plot's k3) is never negative.
    assert all("critic/vf_loss" in r and "actor/reward_kl" in r for r in rows)
    warmup = json.loads((out / "plan.json").read_text())["algorithm"]["critic_warmup"]
    updates = [r["actor/ppo_kl_k3"] for r in rows if r.get("actor/ppo_kl_k3") is not None]
    assert len(updates) == sum(r["step"] > warmup for r in rows) and all(k >= 0 for k in updates), updates


# Wall-clock measurements; every other metric of a step is a function of (seed, step) on one machine.
NOT_REPRODUCIBLE = ("timing/", "perf/")


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NOT_REPRODUCIBLE)}


def test_resume_with_validation_continues_exactly_and_exports_hf(tmp_path):
    """tiny-grpo with validation on (before training and every 2 steps) and dropout on, checkpoints every 2
    steps (keep 1): stopped after step 2 and again after step 4, then run to step 6. Every metric of every
    step equals the uninterrupted 6-step run's bit for bit (CPU, fp32, one process layout: the same
    operations on the same numbers), although each resumed segment validates once more than the
    uninterrupted run; the HF export loads in transformers."""
    common = ["--trainer.save_freq", "2", "--trainer.test_freq", "2", "--trainer.val_before_train", "true",
              "--trainer.max_ckpt_to_keep", "1", "--logging.val_generations", "3",
              "--logging.rollout_data_dir", "gens/rollout", "--logging.validation_data_dir", "gens/val",
              "--actor.checkpoint.save_contents", "[model, optimizer, extra, hf_model]",
              "--actor.megatron.override_transformer_config.hidden_dropout", "0.1",
              "--actor.megatron.override_transformer_config.attention_dropout", "0.1"]  # fmt: skip
    out, ref = tmp_path / "resumed", tmp_path / "straight"
    first = rltrain("tiny-grpo", "--trainer.total_steps", "2", "--trainer.output_dir", str(out), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpts / "global_step_2" / "COMPLETE").exists()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpts / "global_step_2" / "actor" / "huggingface")
    assert model.config.num_hidden_layers == 2

    for stop, resumed_from in ((4, 2), (6, 4)):
        again = rltrain(
            "tiny-grpo", "--trainer.total_steps", str(stop), "--trainer.output_dir", str(out), *common
        )
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"(step {resumed_from})" in again.stdout and "resumed from" in again.stdout
    assert sorted(p.name for p in ckpts.glob("global_step_*")) == ["global_step_6"]  # retention kept 1
    straight = rltrain("tiny-grpo", "--trainer.total_steps", "6", "--trainer.output_dir", str(ref), *common)
    assert straight.returncode == 0, straight.stderr[-3000:]

    resumed_rows, straight_rows = metrics(out), metrics(ref)
    assert [r["step"] for r in resumed_rows] == [r["step"] for r in straight_rows] == [1, 2, 3, 4, 5, 6]
    for got, want in zip(resumed_rows, straight_rows, strict=True):
        got, want = comparable(got), comparable(want)
        step = want["step"]
        extra = {k: got.pop(k) for k in list(got) if k not in want}
        if step in (3, 5):
            # A resumed segment validates its starting weights: the same pass, with the same sampling
            # stream, as the uninterrupted run's validation after the step before.
            previous = comparable(straight_rows[step - 2])
            assert extra == {f"val_before/{k.removeprefix('val/')}": v for k, v in previous.items()
                             if k.startswith("val/")}, step  # fmt: skip
            assert extra
        else:
            assert not extra, (step, extra)
        assert got == want, step
    assert "val_before/reward/mean" in straight_rows[0] and "val/reward/mean" in straight_rows[5]
    check_generation_records(out, ref, straight_rows)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_generation_records(out: Path, ref: Path, rows: list[dict]) -> None:
    """logging.rollout_data_dir / validation_data_dir / val_generations of the resume test: the resumed
    run's records equal the uninterrupted run's (a redone validation replaces its file and its line), and
    they hold what the metrics measured."""
    for sub in ("gens/rollout", "gens/val"):
        names = sorted(p.name for p in (ref / sub).iterdir())
        assert names == sorted(p.name for p in (out / sub).iterdir()), sub
        for name in names:
            assert (out / sub / name).read_text() == (ref / sub / name).read_text(), (sub, name)
    assert sorted(p.name for p in (ref / "gens/rollout").iterdir()) == [f"{s}.jsonl" for s in range(1, 7)]
    assert sorted(p.name for p in (ref / "gens/val").iterdir()) == [f"{s}.jsonl" for s in (0, 2, 4, 6)]
    for row in rows:
        step = row["step"]
        dump = _jsonl(ref / "gens/rollout" / f"{step}.jsonl")
        assert {d["step"] for d in dump} == {step} and all(
            d["input"] and isinstance(d["output"], str) for d in dump
        )
        assert len(dump) == 64  # tiny-grpo: 8 prompts x 8 responses
        assert sum(d["score"] for d in dump) / len(dump) == pytest.approx(row["reward/mean"], rel=1e-6)
        if "val/reward/mean" in row:
            val = _jsonl(ref / "gens/val" / f"{step}.jsonl")
            assert sum(d["score"] for d in val) / len(val) == pytest.approx(row["val/reward/mean"], rel=1e-6)
    samples = _jsonl(ref / "val_generations.jsonl")
    assert samples == _jsonl(out / "val_generations.jsonl")
    assert [s["step"] for s in samples] == [0, 2, 4, 6]
    chosen = [[x["row"] for x in s["samples"]] for s in samples]
    assert len(set(chosen[0])) == 3 and all(c == chosen[0] for c in chosen)  # the same rows every time
    for s in samples:
        val = _jsonl(ref / "gens/val" / f"{s['step']}.jsonl")
        assert [{**val[x["row"]], "row": x["row"]} for x in s["samples"]] == [
            {**x, "step": s["step"]} for x in s["samples"]
        ]


def test_trainer_seed_seeds_the_run(tmp_path):
    """The same trainer.seed reproduces a run exactly; another seed changes samples, rewards and losses."""
    flags = ["--trainer.total_steps", "2", "--trainer.val_before_train", "false", "--trainer.test_freq", "0",
             "--trainer.save_freq", "0"]  # fmt: skip
    runs = {}
    for name, seed in (("a", "7"), ("again", "7"), ("other", "8")):
        out = tmp_path / name
        result = rltrain("tiny-grpo", "--trainer.seed", seed, "--trainer.output_dir", str(out), *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = [comparable(r) for r in metrics(out)]
    assert runs["a"] == runs["again"]
    for mine, other in zip(runs["a"], runs["other"], strict=True):
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "sample/response"):
            assert mine[key] != other[key], (mine["step"], key)
    # The seeds left unset resolve to trainer.seed once, in the plan the workers read.
    plan = json.loads((tmp_path / "other" / "plan.json").read_text())
    actor = next(e for e in plan["engines"] if e["role"] == "actor")
    assert actor["seed"] == plan["data"]["seed"] == 8
