"""Grouped-GEMM experts (`model.moe_grouped_gemm`, rltrain/megatron/moe_experts.py) on CPU.

The autograd Function's hand-written backward equals autograd through the plain per-expert math (float64,
gradcheck as well), with an expert that receives no token; in a model, log-probs and one PPO update equal
megatron's SequentialMLP, and the HF export of a grouped-GEMM model is the checkpoint it loaded (same
parameters and names). The CUDA kernel path (torch._grouped_mm, bf16) is timed by bench/moe_experts_gpu.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from rlconf.config import ModelConfig

from ._common import actor_of, assert_export_round_trips
from .test_moe import (
    MOE_CONFIGS,
    MOE_DEPTH,
    _batch,
    _close,
    _layout_cfg,
    _rl_batch,
    make_tiny_moe,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

COUNTS = [3, 0, 5, 2]  # rows per expert, one expert without tokens
H, FF = 8, 6


def _reference(x, w1, w2, probs, counts):
    """megatron's SequentialMLP math, expert by expert, through plain autograd."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        gate, up = (x[start : start + n] @ w1[e].t()).chunk(2, -1)
        outs.append(((F.silu(gate) * up) * probs[start : start + n, None]) @ w2[e].t())
        start += n
    return torch.cat(outs)


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    m = sum(COUNTS)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(m, H), make(len(COUNTS), 2 * FF, H), make(len(COUNTS), H, FF), make(m)


def test_grouped_swiglu_backward_equals_autograd_of_the_per_expert_math():
    from rltrain.megatron.moe_experts import GroupedSwiGLU

    x, w1, w2, p = _inputs()
    dy = torch.randn(sum(COUNTS), H, dtype=torch.float64)
    got = GroupedSwiGLU.apply(x, w1, w2, p, COUNTS)
    grads = torch.autograd.grad(got, (x, w1, w2, p), dy)
    want = _reference(x, w1, w2, p, COUNTS)
    ref_grads = torch.autograd.grad(want, (x, w1, w2, p), dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("x", "w1", "w2", "probs"), grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert bool((grads[1][1] == 0).all()) and bool((grads[2][1] == 0).all())  # the expert without tokens
    assert torch.autograd.gradcheck(lambda *t: GroupedSwiGLU.apply(*t, COUNTS), (x, w1, w2, p))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("grouped") / "hf", "qwen3_moe")


def _actor(path, grouped: bool):

    model = ModelConfig(path=str(path), attention_backend="sdpa", moe_grouped_gemm=grouped)
    return actor_of(model, _layout_cfg(), "cpu", trainable=True, total_steps=4)


def test_grouped_experts_match_sequential_mlp_in_log_probs_and_one_update(mp_world, qwen3_moe, tmp_path):
    from rltrain.megatron.model import unwrap
    from rltrain.megatron.moe_experts import GroupedGemmExperts

    batch = _batch()
    results = {}
    for grouped in (False, True):
        actor = _actor(qwen3_moe, grouped)
        experts = [
            type(layer.mlp.experts)
            for layer in unwrap(actor.chunks[0]).decoder.layers
            if hasattr(layer.mlp, "experts")
        ]
        assert (experts == [GroupedGemmExperts] * 2) == grouped, experts
        if grouped:  # loaded weights export unchanged: same parameters, names and HF mapping
            assert_export_round_trips(actor, qwen3_moe, tmp_path / "export", ("num_experts",),
                                      MOE_CONFIGS["qwen3_moe"][1], "grouped")  # fmt: skip
        old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        metrics = actor.update_policy(_rl_batch(batch, old))
        after = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        results[grouped] = (old, metrics, after)
    _close(results[True][0], results[False][0], "log-probs", depth=MOE_DEPTH)
    assert results[True][1]["actor/grad_norm"] == pytest.approx(
        results[False][1]["actor/grad_norm"], rel=1e-4
    )
    _close(results[True][2], results[False][2], "after one update", depth=MOE_DEPTH + 4)
    # The update moved the weights: the comparison after it is not the one before it again.
    assert not torch.allclose(results[False][2], results[False][0])


def test_plan_carries_the_switch():
    from presets import get_preset
    from rlconf.config import RLConfig
    from rlconf.plan import compile_plan

    cfg: RLConfig = get_preset("tiny-grpo-moe")
    cfg = replace(cfg, model=replace(cfg.model, moe_grouped_gemm=True))
    assert compile_plan(cfg).engine("actor").settings.transformer.moe_grouped_gemm
