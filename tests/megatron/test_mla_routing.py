"""DeepSeek's routing (megatron-core 0.16.1's `topk_routing_with_score_function` with the fields
rltrain.megatron.mla.deepseek_routing sets) against transformers' DeepseekV3TopkRouter, over the configurations
config.json can hold: wherever rlconf.model_spec.training_gaps names no routing gap, both route every token to
the same experts with the same weights; where they differ, a gap names the key (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlconf.arch import ModelArch
from rlconf.model_spec import training_gaps

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # fmt: skip
ROUTING_GAPS = {"moe_norm_topk_prob", "moe_router_group_topk"}


@st.composite
def routings(draw: st.DrawFn, agreeing: bool = False) -> tuple[int, int, int, int, bool, float, int]:
    """(experts, groups, topk_group, topk, norm_topk_prob, routed_scaling_factor, seed) transformers can build:
    groups of at least 2 experts (it scores a group by its top 2), topk within the chosen groups. `agreeing`:
    only the shapes DeepSeek's files have (topk = 2 x topk_group with groups, renormalised top-k > 1)."""
    groups = draw(st.sampled_from([1, 2, 4]))
    per_group = draw(st.integers(2, 4))
    topk_group = draw(st.integers(1, groups))
    topk = draw(st.integers(1, topk_group * per_group))
    norm = draw(st.booleans())
    if agreeing:
        topk = 2 * topk_group if groups > 1 else max(topk, 2)
        norm = True
    return (groups * per_group, groups, topk_group, topk, norm, draw(st.sampled_from([1.0, 2.5])),
            draw(st.integers(0, 2**16)))  # fmt: skip


def _routes(experts: int, groups: int, topk_group: int, topk: int, norm: bool, scaling: float, seed: int):
    """(transformers' [tokens, experts] routing weights, megatron's, the routing gaps training_gaps names)."""
    import transformers
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from rltrain.megatron.mla import deepseek_routing

    arch = ModelArch(family="deepseek_v3", multi_latent_attention=True, add_qkv_bias=False,
                     num_moe_experts=experts, moe_router_topk=topk, moe_norm_topk_prob=norm,
                     moe_router_num_groups=groups, moe_router_group_topk=topk_group,
                     moe_router_topk_scaling_factor=scaling, moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True, rotary_interleaved=True)  # fmt: skip
    gaps = {f for f, _ in training_gaps(arch, from_folder=True)} & ROUTING_GAPS
    cfg = transformers.DeepseekV3Config(n_routed_experts=experts, num_experts_per_tok=topk, n_group=groups,
                                        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scaling,
                                        hidden_size=8)  # fmt: skip
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 8, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.1)
    hidden = torch.randn(16, 8, generator=g)
    with torch.no_grad():
        logits, weights, index = router(hidden)
    want = torch.zeros(16, experts).scatter(1, index, weights)
    fields = deepseek_routing(arch)
    got, _ = topk_routing_with_score_function(
        logits, topk, use_pre_softmax=False, num_groups=fields["moe_router_num_groups"],
        group_topk=fields["moe_router_group_topk"], scaling_factor=fields["moe_router_topk_scaling_factor"],
        score_function="sigmoid", expert_bias=router.e_score_correction_bias,
    )  # fmt: skip
    return want, got, gaps


@settings(max_examples=60, deadline=None)
@given(routings())
def test_routing_equals_transformers_wherever_no_gap_is_named(case):
    want, got, gaps = _routes(*case)
    if not gaps:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # fp32, sums of <= 16 weights


@settings(max_examples=30, deadline=None)
@given(routings(agreeing=True))
def test_deepseek_shaped_routing_runs_and_equals_transformers(case):
    """The shapes DeepSeek-V3 (8 of 256 experts, 4 of 8 groups) and Moonlight (one group) have: no gap, same
    routing."""
    want, got, gaps = _routes(*case)
    assert gaps == set()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("case", "gap"),
    [((8, 4, 2, 2, True, 2.5, 0), "moe_router_group_topk"),  # a group scored by its top 1, not top 2
     ((8, 1, 1, 3, False, 1.0, 0), "moe_norm_topk_prob"),  # megatron renormalises anyway
     ((8, 1, 1, 1, True, 1.0, 0), "moe_norm_topk_prob")],  # transformers' weight 1, megatron's score
    ids=["group-score-width", "no-renormalisation", "top1-renormalised"],
)  # fmt: skip
def test_where_megatron_routes_otherwise_a_gap_names_it(case, gap):
    want, got, gaps = _routes(*case)
    assert gaps == {gap}
    assert not torch.allclose(got, want)
