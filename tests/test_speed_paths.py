"""Whole-step speed paths (issue 22): the plan decides which log-prob passes a step runs, the on-policy
update needs no old log-prob pass and updates exactly as if it had one, the ref pass exists only with a
KL term, and the per-step perf metrics (MFU, rollout tokens/s, phase shares, peak memory)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from presets import PRESETS
from rlconf.fields import replace_paths
from rlconf.plan import compile_plan, format_plan, plan_to_dict
from rltrain import device as devices
from rltrain import metrics as metrics_lib

from .megatron._common import (
    TINY_REDUCTION,
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    make_batch,
    tiny_model_cfg,
)
from .tolerance import rel_tolerance

ON_POLICY = {"actor.ppo_mini_batch_size": 8}  # tiny-grpo: 8 prompts per step, so one mini-batch


def plan_of(preset: str, changes: dict[str, object]):
    return compile_plan(replace_paths(PRESETS[preset].build(), changes))


# ------------------------------------------------------------------------------------------ the plan
@pytest.mark.parametrize(
    ("changes", "old", "on_policy"),
    [
        ({}, "recompute", False),  # tiny-grpo: 2 mini-batches
        (ON_POLICY, "update", True),
        ({**ON_POLICY, "actor.ppo_epochs": 2}, "recompute", False),
        ({**ON_POLICY, "algorithm.use_kl_in_reward": True}, "recompute", True),
        ({**ON_POLICY, "algorithm.rollout_correction.rollout_is": "token"}, "recompute", True),
        ({**ON_POLICY, "algorithm.rollout_correction.rollout_rs": "sequence"}, "recompute", True),
        ({**ON_POLICY, "algorithm.rollout_correction.bypass_mode": True}, "rollout", True),
    ],
)
def test_plan_decides_the_old_log_prob_pass(changes, old, on_policy):
    plan = plan_of("tiny-grpo", changes)
    assert plan.passes is not None
    assert (plan.passes.old_log_prob, plan.passes.actor_on_policy) == (old, on_policy)
    # Shown to the user in the plan text and plan.json, with its reason.
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("log-prob passes per step"))
    assert plan.passes.reason in line
    assert plan_to_dict(plan)["passes"]["old_log_prob"] == old


@pytest.mark.parametrize(
    ("changes", "ref", "fused"),
    [
        ({}, False, False),
        ({"actor.use_kl_loss": True}, True, True),
        ({"algorithm.use_kl_in_reward": True}, True, True),
        ({**ON_POLICY, "actor.use_kl_loss": True}, True, False),  # no old pass to join
    ],
)
def test_ref_pass_only_with_a_kl_term(changes, ref, fused):
    plan = plan_of("tiny-grpo", changes)
    assert ("ref" in plan.roles) is ref
    assert plan.passes is not None and (plan.passes.ref_log_prob, plan.passes.fused) == (ref, fused)
    text = format_plan(plan)
    assert ("none (no KL term)" in text) is not ref


# ------------------------------------------------------------------------------ the on-policy update
def _advantage_batch(seed: int) -> dict[str, torch.Tensor]:
    batch = make_batch(b=8, seed=seed)
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
    batch["advantages"] = sign * batch["response_mask"]
    return batch


@pytest.mark.parametrize("use_kl", [False, True])
def test_on_policy_update_equals_the_update_with_an_old_log_prob_pass(world, tmp_path, use_kl):
    """One mini-batch, one epoch: updating with the update's own detached log-probs as the old ones gives
    the weights that a separate old log-prob pass gives (SGD: the step is linear in the gradient, so equal
    gradients mean equal weights), with nothing clipped and no PPO KL."""
    from rlconf.config import MegatronConfig, Optim

    from .megatron._common import make_tiny_qwen2

    hf = make_tiny_qwen2(tmp_path / "tiny")
    # SGD (megatron's distributed optimizer takes Adam only): the step is linear in the gradient.
    cfg = replace(
        actor_cfg(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, optim=Optim(optimizer="sgd", lr=0.5),
                  use_kl_loss=use_kl, kl_loss_coef=0.1),
        megatron=MegatronConfig(use_distributed_optimizer=False),
    )  # fmt: skip
    separate = actor_of(tiny_model_cfg(str(hf)), cfg, "cpu")
    on_policy = actor_of(tiny_model_cfg(str(hf)), cfg, "cpu")
    batch = _advantage_batch(seed=1)
    old = separate.compute_log_prob(batch)
    if use_kl:  # a reference that differs from the policy, so the KL term has a gradient
        batch["ref_log_probs"] = old["log_probs"] + 0.1 * batch["response_mask"]
    # The sampler's log-probs, off by a known amount on one token: the on-policy update reports the gap.
    rollout = old["log_probs"].clone()
    rollout[2, 0] += 0.25
    m_sep = separate.update_policy({**batch, "old_log_probs": old["log_probs"]})
    m_on = on_policy.update_policy({**batch, "rollout_log_probs": rollout}, on_policy=True)

    assert m_on["actor/pg_clipfrac"] == 0.0 and m_on["actor/ppo_kl"] == 0.0
    assert m_on["rollout/logprob_diff_max"] == pytest.approx(0.25, rel=1e-3)
    mask = batch["response_mask"].float()
    assert m_on["actor/entropy_rollout"] == pytest.approx(
        float((old["entropy"] * mask).sum() / mask.sum()), rel=1e-4
    )
    # fp32 through the tiny model's reductions, forward and backward (tests/tolerance.py); the losses are
    # token means of log-prob-sized terms (|log p| ~ log 100 ~ 4.6), so their absolute rounding scales by that.
    rel = rel_tolerance(torch.float32, TINY_REDUCTION, UPDATE_DEPTH)
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm"):
        assert m_on[key] == pytest.approx(m_sep[key], rel=rel, abs=rel * math.log(100)), key
    moved = 0.0
    for a, b, before in zip(
        on_policy.chunks[0].parameters(), separate.chunks[0].parameters(),
        actor_of(tiny_model_cfg(str(hf)), cfg, "cpu").chunks[0].parameters(), strict=True,
    ):  # fmt: skip
        assert_tiny_close(a.detach(), b.detach(), depth=UPDATE_DEPTH)
        moved = max(moved, float((a.detach() - before.detach()).abs().max()))
    # The step moved the weights far beyond the comparison's tolerance: the equality is not vacuous.
    assert moved > 1e3 * torch.finfo(torch.float32).eps * (TINY_REDUCTION * UPDATE_DEPTH) ** 0.5
    after = on_policy.compute_log_prob(batch, with_entropy=False)["log_probs"]
    assert_tiny_close(
        after, separate.compute_log_prob(batch, with_entropy=False)["log_probs"], depth=UPDATE_DEPTH
    )


def test_on_policy_update_refuses_a_schedule_with_several_optimizer_steps(world, tiny_path):

    cfg = actor_cfg(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, ppo_epochs=2)  # 2 optimizer steps
    actor = actor_of(tiny_model_cfg(str(tiny_path)), cfg, "cpu")
    with pytest.raises(AssertionError, match="more than one optimizer step"):
        actor.update_policy(_advantage_batch(seed=0), on_policy=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from .megatron._common import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("hf") / "tiny")


# --------------------------------------------------------------------------------------- perf metrics
def test_flops_and_mfu():
    # 6N + 6·L·h·s per trained token; a forward pass is a third of it.
    assert metrics_lib.flops_per_token(1000, 2, 8, 10.0, training=True) == 6000 + 6 * 2 * 8 * 10
    assert metrics_lib.flops_per_token(1000, 2, 8, 10.0, training=False) == (6000 + 960) / 3
    assert metrics_lib.model_flops_utilization(4e12, 2.0, 1e12, 4) == pytest.approx(0.5)
    # No peak (cpu, a device model not in the table): no number at all rather than a made-up one.
    assert metrics_lib.model_flops_utilization(4e12, 2.0, None, 4) is None
    assert devices.peak_flops("cpu", "bfloat16") is None


def test_mfu_counts_the_active_matmul_flops_of_a_moe_model():
    """qwen3-moe-grpo (untied, head_dim 128 x 16 heads = 2048 over a hidden size of 1024): the FLOPs count
    one token's 8 routed experts of 64, not the input embedding lookup, and attention at heads x head dim."""
    from presets.gpu import QWEN3_MOE_3B, QWEN25_15B
    from rlconf.model_spec import count_parameters

    a = QWEN3_MOE_3B
    total, active = count_parameters(a, "lm")
    matmul = metrics_lib.matmul_params(a, active)
    assert matmul == active - a.vocab_size * a.hidden_size
    expert = 3 * a.hidden_size * a.moe_ffn_hidden_size
    assert total - active == a.num_layers * (a.num_moe_experts - a.moe_router_topk) * expert
    assert metrics_lib.attention_width(a) == 2048
    # Tied (Qwen2.5-1.5B): the one embedding is the output layer's product and stays counted.
    _, dense = count_parameters(QWEN25_15B, "lm")
    assert metrics_lib.matmul_params(QWEN25_15B, dense) == dense
    assert metrics_lib.attention_width(QWEN25_15B) == QWEN25_15B.hidden_size


def test_phase_shares_cover_the_step():
    m = {
        "timing/step_s": 10.0,
        "timing/generate_s": 4.0,
        "timing/reward_s": 1.0,
        "timing/update_actor_s": 5.0,
    }
    shares = metrics_lib.phase_shares(m)
    assert shares == pytest.approx({"perf/share/generate": 0.4, "perf/share/update_actor": 0.5,
                                    "perf/share/other": 0.1})  # fmt: skip
    assert metrics_lib.phase_shares({"timing/generate_s": 1.0}) == {}


def test_memory_metrics_take_the_peak_over_ranks_and_roles():
    out = metrics_lib.memory_metrics(
        [{"actor_update": 3.0, "generate_sequences": 5.0}, {"actor_update": 4.0}]
    )
    assert out == {"perf/max_memory_allocated_gib": 5.0, "perf/max_memory_allocated_gib/actor_update": 4.0,
                   "perf/max_memory_allocated_gib/generate_sequences": 5.0}  # fmt: skip
    assert metrics_lib.memory_metrics([{}, {}]) == {}  # cpu: nothing measured, nothing logged


# ------------------------------------------------------------------------------------------ end to end
def _rltrain(out: Path, *args: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.total_steps", "2", "--trainer.test_freq", "0",
         "--trainer.val_before_train", "false", "--trainer.save_freq", "0", "--trainer.output_dir", str(out), *args],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.multiproc
def test_runs_skip_and_fuse_the_passes_the_plan_says(tmp_path):
    """On-policy with a KL loss: no old log-prob pass, a ref pass; off-policy with a KL loss: both passes
    in one call. Each step logs its phase shares and rollout tokens/s; MFU and memory only on a GPU."""
    on = _rltrain(tmp_path / "on", "--actor.ppo_mini_batch_size", "8", "--actor.use_kl_loss", "true")
    for row in on:
        assert "timing/old_log_prob_s" not in row and row["timing/ref_s"] > 0, row
        assert row["actor/pg_clipfrac"] == 0 and row["actor/ppo_kl"] == 0
        # fp32 on CPU: the sampler and the update's forward agree to rounding.
        assert row["rollout/logprob_diff_max"] < 1e-4 and row["actor/entropy_rollout"] > 0
        assert row["perf/rollout_tokens_per_s"] > 0 and "perf/mfu/actor_update" not in row
        shares = [v for k, v in row.items() if k.startswith("perf/share/")]
        assert sum(shares) == pytest.approx(1.0) and row["perf/share/update_actor"] > 0
    off = _rltrain(tmp_path / "off", "--actor.use_kl_loss", "true")
    for row in off:
        assert row["timing/old_log_prob_s"] > 0 and row["timing/ref_s"] > 0 and "actor/kl_loss" in row
        assert row["rollout/logprob_diff_max"] < 1e-4
