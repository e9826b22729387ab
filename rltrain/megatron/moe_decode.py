"""Mixture-of-experts layers with static shapes: no host round trip, so a MoE model's decode step can be
captured in a CUDA graph like a dense one (issue 36 item 1), and training passes skip megatron's token
dispatcher (item 4).

Why: megatron's MoELayer sizes its expert batches from the routing (the token dispatcher copies the token
counts per expert to the host, SequentialMLP / the grouped experts split by a Python list of them): at
least one device -> host sync per MoE layer per decode step, and shapes a graph cannot replay. So the
engine decoded MoE models on its dynamic path, ~2 host syncs and ~100 kernel launches per layer per token.

What runs instead (`moe_forward`), for the layers `unsupported` accepts (routed SwiGLU experts on this rank,
no expert parallel, no expert tensor parallel, no token dropping):

  1. megatron's own router module (`TopKRouter.forward`: gating, score function, top-k, its scaling), so the
     choice of experts is the router's. Its top-k indices are taken through megatron's router-replay hook
     (`_TopkTap`), which forwards to a replay object already attached (`moe_replay.record_routing`), so
     recording keeps working on the dynamic path; inside a captured step the tap records nothing itself and
     the step hands the indices out instead (`StaticDecodeStep.routing`).
  2. The T x k (token, expert) pairs sorted by expert (a stable sort: token order within an expert, as
     megatron's permutation), rows gathered, per-expert counts by a scatter-add (not bincount, which sizes
     its output on the host) and their cumulative offsets *on the device*.
  3. All experts in two grouped matrix products (`torch._grouped_mm` with device offsets, bf16 on CUDA; a
     per-expert loop elsewhere) with megatron's SwiGLU and probability product in between, in the order and
     dtypes of `moe_experts.GroupedSwiGLU` / megatron's `MLP.forward`.
  4. The k outputs of each token put back in token order and summed (a [T, k, H] sum, deterministic, where
     megatron scatter-adds); shared experts, when the model has them, added as megatron does. In training
     both row permutations take their gradients back by gathers through the inverse permutation, not by
     index_select's atomic index_add (deterministic; the index_add took 0.85 s of kernel time in a profiled
     qwen3-moe update on the H200).

Generation (the engine's stacked weights, no autograd) runs steps 2-4 as `DecodeGlue`'s three functions
around the two grouped products (`moe_forward(..., glue=)`, the class switch
`KVCacheGenerator.fuse_moe_glue`), compiled under the plan's fused kernels: the dispatch ranks each pair
within its expert by a scan over an [E, T k] one-hot instead of the argsort, up to RANK_DISPATCH_MAX_PAIRS
pairs (a decode step's; prefills keep the sort), with the sort's integers exactly. Why: a 256-row
qwen3-moe decode step on the H200 spent 0.78 ms in the radix sort and launched ~1,100 small kernels, mostly
this glue; a captured step is bound by their count and latency, not their arithmetic.

Generation's router (`route`, the class switch `KVCacheGenerator.fuse_moe_router`) is the router's gating
GEMM and then one function, compiled under the plan's fused kernels (`fused_route`), that computes
megatron's top-k routing (score function, expert bias, group-limited top-k, normalisation, scaling) up to
the top-k probabilities [T, k] and indices, which the glue's dispatch takes as they are: megatron's router
scatters them into dense [T, E] probabilities and a routing map that the dispatch only gathered back from
(the router's 9 ops per layer become 3, bench/moe_layer_ops.py). It runs only where megatron's router would
route the same and nothing else watches: routers `router_unsupported` accepts, no autograd, no replay
object to see the call (`moe_forward`); elsewhere megatron's router runs as in item 1.

Every shape depends only on T, so the step is graph-capturable. The KV-cache engine stacks the expert
weights once ([E, 2F, H] and [E, H, F], `ExpertWeights`): the copy lives as long as one `generate` call.
Training passes (`GroupedMoELayer`, the MoE layer of `model.moe_grouped_gemm`) run the experts' own
parameters through `moe_experts.expert_swiglu`, as `GroupedGemmExperts` does. Their router is
`train_route` where `train_router_unsupported` accepts it (megatron's routing and load-balancing loss, its
z-loss called as it is, without the dense [T, E] maps; bench switch `router` off); with router replay,
expert bias or sequence / global balancing losses megatron's router runs (item 1), so those are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import group_limited_topk

from rltrain.megatron import fused, moe_experts, triton_gather_sum
from rltrain.megatron.moe_experts import GroupedGemmExperts, GroupedSwiGLU, expert_swiglu


def is_moe(mlp: torch.nn.Module) -> bool:
    return isinstance(mlp, MoELayer)


def unsupported(mlp: torch.nn.Module) -> str | None:
    """Why `moe_forward` cannot run this MoE layer (None: it can; megatron's MoELayer runs otherwise)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    cfg = mlp.config
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        return "expert parallel"
    if parallel_state.get_expert_tensor_parallel_world_size() > 1:
        return "expert tensor parallel"
    if type(mlp.experts) not in (SequentialMLP, GroupedGemmExperts):
        return f"experts module {type(mlp.experts).__name__}"
    if not (cfg.gated_linear_unit and cfg.activation_func is F.silu and not cfg.add_bias_linear):
        return "experts other than SwiGLU without bias"
    if cfg.activation_func_clamp_value is not None or cfg.glu_linear_offset != 0.0:
        return "GLU clamp or offset"
    if cfg.moe_apply_probs_on_input or cfg.fp8 or cfg.fp4:
        return "probabilities on the input, fp8 or fp4"
    if cfg.moe_expert_capacity_factor is not None:
        return "token dropping (moe_expert_capacity_factor)"
    if getattr(cfg, "moe_latent_size", None):
        return "latent projections"
    if mlp.use_shared_expert and mlp.shared_expert_overlap:
        return "overlapped shared experts"
    if mlp.router.routing_type == "sinkhorn" or cfg.moe_router_fusion:
        return "sinkhorn or fused routing"
    return None


class _TopkTap:
    """Stands in for the router's replay object during one call: keeps the top-k indices the router chose
    (`index` [T, k]); forwards to the replay object attached before (`inner`), unless `silent`."""

    def __init__(self, inner: Any, silent: bool) -> None:
        self.inner, self.silent = inner, silent
        self.index: torch.Tensor | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inner is not None and not self.silent:
            values, index = self.inner.get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
        else:
            assert default_compute_topk is not None
            values, index = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.index = index
        return values, index


class ExpertWeights:
    """Each MoE layer's local expert weights stacked once ([E, 2F, H], [E, H, F]), by layer module."""

    def __init__(self) -> None:
        self._stacked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, mlp: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(mlp)
        if key not in self._stacked:
            experts = mlp.experts.local_experts
            self._stacked[key] = (
                torch.stack([e.linear_fc1.weight.detach() for e in experts]),
                torch.stack([e.linear_fc2.weight.detach() for e in experts]),
            )
        return self._stacked[key]


def _summed_rows(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in `dtype`: each token's k rows `index` [T, k] of src [T k, H] summed in fp32, rounded once:
    `triton_gather_sum`'s kernel where it runs (CUDA), else torch's gather, sum and cast (the bench switch
    `gathersum` of fused.TRAIN_KERNELS_OFF_ENV times torch's on CUDA too)."""
    if fused.bench_off("gathersum"):
        return triton_gather_sum.gather_sum_reference(src, index, dtype)
    return triton_gather_sum.gather_sum(src, index, dtype)


class _ExpertRows(torch.autograd.Function):
    """x [T, H] -> its rows in expert order [T k, H] (row j is token `token[j]`, the pair at row j divided
    by k), where `inverse` [T, k] is each (token, slot) pair's row. The backward sums each token's k row
    gradients (`_summed_rows`, in fp32): index_select's own backward is an atomic index_add into [T, H],
    0.85 s of a 10 s qwen3-moe update on the H200 (docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return _summed_rows(grad.contiguous(), inverse, grad.dtype), None, None


class _Combine(torch.autograd.Function):
    """The experts' rows y [T k, H] (expert order) back to tokens: each token's k rows `inverse` [T, k]
    summed in fp32 and cast to `dtype` ([T, H], `_summed_rows`). The backward gives row j the gradient of
    its token `token[j]` (one gather; autograd's path through the sum, cast and permutation wrote the
    gradient out k times over in fp32 and bf16 first)."""

    @staticmethod
    def forward(
        ctx, y: torch.Tensor, inverse: torch.Tensor, token: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(token)
        ctx.y_dtype = y.dtype
        return _summed_rows(y, inverse, dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (token,) = ctx.saved_tensors
        return grad.to(ctx.y_dtype).index_select(0, token), None, None, None


# Generation: where N = T x k (token, slot) pairs are at most this many, the dispatch ranks each pair within
# its expert by a scan along the pairs of an [E, N] one-hot (inner dimension), not by an argsort (a radix sort
# of several kernels per layer, 0.78 ms of a 256-row qwen3-moe decode step on the H200). The one-hot grows
# as E x N, so larger batches (prefills) keep the sort.
RANK_DISPATCH_MAX_PAIRS = 4096


def expert_positions(
    index: torch.Tensor, experts: int, by_rank: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the (token, slot) pairs of `index` [T, k] go in expert-major order: (order [T k]: the pair
    (flat index) at each row, inverse [T, k]: each pair's row, offsets [E] int32: the cumulative row counts
    per expert), token order within an expert (a stable sort's).

    by_rank: a pair's row is its expert's first row (exclusive prefix of the counts) plus the number of
    earlier pairs of the same expert, counted by a cumulative sum along the pairs of the [E, T k] one-hot
    (the inner dimension: a scan over the outer one was 12x slower than the sort on the H200). Otherwise
    the stable argsort. Both give the same integers (tests/megatron/test_moe_decode.py)."""
    flat = index.reshape(-1)
    if by_rank:
        hot = flat.unsqueeze(0) == torch.arange(experts, device=flat.device).unsqueeze(1)  # [E, N]
        seen = hot.cumsum(1, dtype=torch.int32)  # pairs of expert e among the first j + 1
        counts = hot.sum(1, dtype=torch.int32)
        offsets = counts.cumsum(0, dtype=torch.int32)
        # A pair's row: rows before its expert's, then earlier pairs of its expert (seen - 1 at itself).
        before = (offsets - counts).index_select(0, flat)
        rank = seen.gather(0, flat.unsqueeze(0)).squeeze(0) - 1
        inverse = (before + rank).long()
        order = torch.empty_like(inverse).scatter_(0, inverse, torch.arange(flat.numel(), device=flat.device))
        return order, inverse.view(index.shape), offsets
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, inverse.view(index.shape), counts.cumsum(0, dtype=torch.int32)


def dispatch(
    x: torch.Tensor,
    index: torch.Tensor,
    probs: torch.Tensor,
    by_rank: bool = True,
    experts: int | None = None,
    gather: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The generation path's glue from the router to the first grouped GEMM: x [T, H] the tokens, index
    [T, k] the router's top-k experts, probs either megatron's dense probabilities [T, E] (`experts` None:
    gathered at `index` here) or the static router's top-k probabilities [T, k] aligned with `index`
    (`route`; `experts` E, the count a dense tensor would have carried) -> (rows [T k, H]: each pair's
    token in expert-major order, p [T k]: each row's probability, inverse [T, k]: each pair's row, offsets
    [E] int32: the grouped GEMMs' cumulative row counts). The ops of the training path's dispatch
    (`moe_forward` without `glue`), so the same values; `fused_dispatch` compiles it (by rank).

    `experts` says which form `probs` has because the shapes cannot: with k == E both are [T, E].
    `gather` False: the rows' tokens [T k] (x's row of each) in place of rows, for `DecodeGlue.experts`,
    which reads x through them (no [T k, H] copy)."""
    k = index.shape[1]
    dense = experts is None
    order, inverse, offsets = expert_positions(index, probs.shape[1] if dense else experts, by_rank)
    token = order // k
    p = (probs.gather(1, index) if dense else probs).reshape(-1).index_select(0, order)
    return x.index_select(0, token) if gather else token, p, inverse, offsets


def combine(y: torch.Tensor, inverse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """After the second grouped GEMM: each token's k expert outputs (rows `inverse` [T, k] of y [T k, H])
    summed in fp32 (a deterministic sum, where megatron scatter-adds) and cast to `dtype`: [T, H]. The
    training layer's sum (`triton_gather_sum`) in torch's ops, so generation and training add alike."""
    return triton_gather_sum.gather_sum_reference(y, inverse, dtype)


def _fused_dispatch_rows(
    x: torch.Tensor, index: torch.Tensor, probs: torch.Tensor, experts: int | None, gather: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dispatch` by rank over T unbacked rows (the same T for all three)."""
    torch._check(index.shape[0] == x.shape[0])
    torch._check(probs.shape[0] == x.shape[0])
    return dispatch(x, index, probs, True, experts, gather)


def fused_dispatch(
    x: torch.Tensor,
    index: torch.Tensor,
    probs: torch.Tensor,
    by_rank: bool = True,
    experts: int | None = None,
    gather: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dispatch` torch.compile'd (by rank: one-hot, scan, gathers and scatter in a few kernels); the sort
    (`by_rank` False, batches past RANK_DISPATCH_MAX_PAIRS) stays eager: there kernels are not the cost."""
    if not by_rank:
        return dispatch(x, index, probs, False, experts, gather)
    rows = fused.unbacked_rows(x, index, probs)
    compiled = fused.compiled(_fused_dispatch_rows)
    return fused.compiled_or_eager(compiled, _fused_dispatch_rows, *rows, experts, gather)


def fused_combine(y: torch.Tensor, inverse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`combine` compiled: one gather-and-sum kernel."""
    return fused.compiled_or_eager(fused.compiled(combine), combine, *fused.unbacked_rows(y, inverse), dtype)


def router_unsupported(router: torch.nn.Module) -> str | None:
    """Why `route` cannot give this router's choice and weights (None: it can; megatron's
    `TopKRouter.forward` runs otherwise). For routers of layers `unsupported` accepts (no sinkhorn, no fused
    routing, no token dropping). What `route` leaves out must not change an inference call's routing: the
    z-loss, the load-balancing losses and the expert-bias token count act only with autograd on, which
    `moe_forward` checks per call."""
    from megatron.core.transformer.moe.router import TopKRouter

    cfg = router.config
    if type(router) is not TopKRouter:  # a subclass may route otherwise
        return f"router {type(router).__name__}"
    if router.score_function not in ("softmax", "sigmoid"):
        return f"score function {router.score_function}"
    if cfg.moe_input_jitter_eps is not None:  # megatron jitters the input in eval too
        return "input jitter (moe_input_jitter_eps)"
    if cfg.moe_router_force_load_balancing:
        return "random logits (moe_router_force_load_balancing)"
    return None


@dataclass(frozen=True)
class TopkRouting:
    """A TopKRouter's routing constants, as megatron's `TopKRouter.routing` passes them to
    `topk_routing_with_score_function`. Frozen: torch.compile treats an instance as constants (one graph per
    distinct value, not per instance)."""

    topk: int
    score_function: str  # softmax | sigmoid
    pre_softmax: bool
    num_groups: int | None
    group_topk: int | None
    scaling_factor: float | None

    @staticmethod
    def of(router: torch.nn.Module) -> TopkRouting:
        cfg = router.config
        return TopkRouting(router.topk, router.score_function, cfg.moe_router_pre_softmax,
                           cfg.moe_router_num_groups, cfg.moe_router_group_topk,
                           cfg.moe_router_topk_scaling_factor)  # fmt: skip


def route(
    logits: torch.Tensor, expert_bias: torch.Tensor | None, routing: TopkRouting
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core 0.16.1's `topk_routing_with_score_function` (unfused, no replay) on the gating logits
    [T, E], stopped before it scatters into [T, E]: (probs [T, k] in the logits' dtype, index [T, k]), the
    top-k probabilities and experts in its top-k order, where megatron hands out the dense probabilities and
    routing map that the glue gathered back from. The same ops in the same order and dtypes: score function
    (softmax over the k, or over all E before the top k with `pre_softmax`; sigmoid in fp32), the expert
    bias added for the choice only (sigmoid), the top k (group-limited by megatron's own
    `group_limited_topk` when `group_topk`), sigmoid weights renormalised over the k, then the scaling factor.

    Why: megatron's router then builds the dense probabilities and routing map (two zero fills, two
    scatters, a cast) that the decode glue only gathers back from, about half the router's kernels
    (bench/moe_layer_ops.py). `fused_route` compiles it. A megatron upgrade that changes its routing shows
    in tests/megatron/test_moe_router_decode.py, which compares the two bit for bit."""
    tokens, experts = logits.shape

    def topk(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if routing.group_topk:
            return group_limited_topk(
                scores, routing.topk, tokens, experts, routing.num_groups, routing.group_topk
            )
        return torch.topk(scores, k=routing.topk, dim=1)

    if routing.score_function == "softmax":
        if routing.pre_softmax:
            probs, index = topk(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits))
        else:
            scores, index = topk(logits)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, index = topk(scores + expert_bias)
            scores = torch.gather(scores, dim=1, index=index).type_as(logits)
        else:
            scores, index = topk(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if routing.topk > 1 else scores
    if routing.scaling_factor:
        probs = probs * routing.scaling_factor
    return probs, index


def fused_route(
    logits: torch.Tensor, expert_bias: torch.Tensor | None, routing: TopkRouting
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` torch.compile'd, once per routing and dtype (the rows unbacked): the score function,
    normalisation and scaling fused around the top-k."""
    (rows,) = fused.unbacked_rows(logits)
    bias = None if expert_bias is None else expert_bias.detach()
    return fused.compiled_or_eager(fused.compiled(route), route, rows, bias, routing)


def static_routing(
    router: torch.nn.Module, hidden: torch.Tensor, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for `hidden` [s, n, H] without megatron's TopKRouter.forward: (probs [T, k],
    index [T, k]) from its gating GEMM (megatron's `gating`: the router's dtype, its own linear) and `fn`
    (`route` or `fused_route`). For routers `router_unsupported` accepts, without autograd (`moe_forward`
    decides)."""
    router._maintain_float32_expert_bias()  # as TopKRouter.forward: fp32 again after a bf16 module cast
    logits = router.gating(hidden)  # [s, n, E]
    return fn(logits.view(-1, logits.shape[-1]), router.expert_bias, TopkRouting.of(router))


def train_router_unsupported(router: torch.nn.Module) -> str | None:
    """Why `train_route` cannot stand in for this router's forward in a training pass (None: it can;
    megatron's `TopKRouter.forward` runs otherwise, through `_TopkTap`)."""
    why = router_unsupported(router)
    if why is not None:
        return why
    if router.router_replay is not None:  # recording and replaying go through megatron's hook
        return "router replay"
    if router.enable_expert_bias:  # megatron's token count for the bias update stays megatron's
        return "expert bias (moe_router_enable_expert_bias)"
    if router.get_aux_loss_coeff("seq_aux_loss") > 0 or router.get_aux_loss_coeff("global_aux_loss") > 0:
        return "sequence or global load-balancing loss"
    return None


def tokens_per_expert(
    index: torch.Tensor, experts: int, padding: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """[experts] in `dtype`: how many tokens chose each expert, from top-k indices [T, k], padding rows
    ([T] True on padding) left out; the sum over T of megatron's dense routing map, by a scatter-add."""
    if padding is None:
        counted = torch.ones(index.shape, dtype=dtype, device=index.device)
    else:
        counted = (~padding).unsqueeze(1).expand(index.shape).to(dtype)
    total = torch.zeros(experts, dtype=dtype, device=index.device)
    return total.scatter_add_(0, index.reshape(-1), counted.reshape(-1))


# Called by `train_route` with (router, index [T, k], padding [T] or None) for every routing it makes: what
# a forward hook on the router sees of megatron's path (model.MoeRoutingStats registers here too).
ROUTE_OBSERVERS: list[Callable[[torch.nn.Module, torch.Tensor, torch.Tensor | None], None]] = []


def train_route(
    router: torch.nn.Module, hidden: torch.Tensor, padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's `TopKRouter.forward` on `hidden` [s, n, H] for the passes of training engines, without
    its dense [T, E] probabilities and routing maps: (probs [T, k] in the logits' dtype, index [T, k]), the
    load-balancing loss attached to probs as megatron attaches it. For routers `train_router_unsupported`
    accepts; `padding_mask` [s, n] True on padding.

    The same ops in megatron's order and dtypes: its gating, its z-loss (`apply_z_loss`, a no-op unless set),
    `route`, then (training mode, autograd on, coefficient > 0) the switch-transformer loss from the scores
    and top-k choice megatron's `compute_routing_scores_for_aux_loss` makes (fp32 softmax, or normalised
    sigmoid, over all experts; padding rows zeroed), its tokens per expert counted by a scatter-add where
    megatron sums a dense map, reduced over the TP x CP group, then megatron's own
    `switch_load_balancing_loss_func` and `attach_and_log_load_balancing_loss` (the tracker its metrics
    read). Why: megatron's training router is ~35 kernels per MoE layer per micro-batch forward and
    backward, two softmaxes and top-ks and four dense scatters among them, in a qwen3-moe update bound by
    its small kernels (bench/moe_layer_ops.py --train). tests/megatron/test_moe_router_decode.py compares it
    with megatron's router on each router configuration it takes (routing, losses, gradients; TP = 2 too),
    tests/megatron/test_moe_decode.py the whole layer (outputs, every gradient, the routing metrics)."""
    router._maintain_float32_expert_bias()  # as TopKRouter.forward
    logits = router.gating(hidden)
    logits = logits.view(-1, logits.shape[-1])
    padding = None if padding_mask is None else padding_mask.reshape(-1)
    logits = router.apply_z_loss(logits, padding_mask=padding)
    probs, index = route(logits, router.expert_bias, TopkRouting.of(router))
    if router.training and torch.is_grad_enabled() and router.is_aux_loss_enabled():
        probs = _load_balancing_loss(router, logits, probs, padding)
    for observe in ROUTE_OBSERVERS:
        observe(router, index, padding)
    return probs, index


def _load_balancing_loss(
    router: torch.nn.Module, logits: torch.Tensor, probs: torch.Tensor, padding: torch.Tensor | None
) -> torch.Tensor:
    """megatron's `TopKRouter._apply_aux_loss` (with `compute_routing_scores_for_aux_loss`, unfused) on the
    top-k probabilities: the loss attached to `probs` (returned) and recorded in megatron's tracker."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    coeff = router.get_aux_loss_coeff("aux_loss")
    tokens, experts = logits.shape
    k = router.topk
    if router.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    chosen = torch.topk(scores, k=k, dim=1).indices
    if padding is not None:
        scores = scores * (~padding).unsqueeze(-1)
    local = tokens_per_expert(chosen, experts, padding, torch.long)  # megatron's dense map summed: int64
    group = router.tp_cp_group
    per_expert = reduce_from_tensor_model_parallel_region(local, group)
    if padding is None:
        local_tokens: int | torch.Tensor = tokens
        total: int | torch.Tensor = tokens * group.size()
    else:
        local_tokens, total = local.sum() / k, per_expert.sum() / k
    aux = switch_load_balancing_loss_func(
        probs=scores,
        tokens_per_expert=per_expert,
        total_num_tokens=total,
        topk=k,
        num_experts=router.config.num_moe_experts,
        moe_aux_loss_coeff=coeff,
        fused=False,
    )
    return router.attach_and_log_load_balancing_loss(
        probs, coeff, aux, "load_balancing_loss", group, valid_token_count=local_tokens
    )


@dataclass(frozen=True)
class DecodeGlue:
    """The generation path's MoE glue around the grouped GEMMs: `dispatch`, `moe_experts.swiglu_probs`, `combine`
    (EAGER_GLUE) or their compiled versions (FUSED_GLUE, the engine's choice under `fused_kernels`).
    `experts`, where the engine chose one (`decode_kernels.expert_swiglu` on CUDA): both products and the
    SwiGLU between them in one function (x, token, w1, w2, p, offsets) -> [M, H] reading each row's token
    x[token] itself (the dispatch without `gather`), for decode-sized batches (at most
    RANK_DISPATCH_MAX_PAIRS pairs; prefills keep torch._grouped_mm)."""

    dispatch: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    combine: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    experts: Callable[..., torch.Tensor] | None = None


EAGER_GLUE = DecodeGlue(dispatch, moe_experts.swiglu_probs, combine)
FUSED_GLUE = DecodeGlue(fused_dispatch, moe_experts.fused_swiglu_probs, fused_combine)


def moe_forward(
    mlp: torch.nn.Module,
    hidden: torch.Tensor,
    weights: ExpertWeights | None = None,
    silent: bool = False,
    padding_mask: torch.Tensor | None = None,
    glue: DecodeGlue | None = None,
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[tuple[torch.Tensor, None], torch.Tensor]:
    """megatron's MoELayer.forward on `hidden` [s, n, H] with static shapes: ((output, None), the router's
    top-k expert indices [s x n, k] in megatron's token order).

    `weights`: the engine's stacked expert weights (generation); None runs the experts' parameters through
    `moe_experts.expert_swiglu` (training: gradients reach each expert's own parameters, as with
    `GroupedGemmExperts`). `silent`: the router's replay object (recording) does not see this call (a
    captured step hands the indices out itself). `padding_mask` [s, n] True on padding, for the router's
    load-balancing loss (MoELayer.route's argument). `glue` (generation only, with `weights`): the dispatch
    (by rank up to RANK_DISPATCH_MAX_PAIRS pairs), SwiGLU-times-probability and combine as `DecodeGlue`'s
    functions, the grouped GEMMs between them, no autograd Functions; None runs the argsort path below
    (training's, and the engine's with the class switch `KVCacheGenerator.fuse_moe_glue` off).

    Without `glue`, the router is `train_route` where `train_router_unsupported` accepts it (no dense
    [T, E] probabilities), else megatron's.

    `route` (`route` or `fused_route`; taken with `glue` only, the class switch
    `KVCacheGenerator.fuse_moe_router`): the router's gating GEMM, then `route` for the top-k probabilities
    [T, k] the glue takes as they are, instead of megatron's router and its dense [T, E] probabilities.
    Only where megatron's router would give the same routing and nothing else: `router_unsupported`
    accepts the router, autograd is off (no z-loss, load-balancing loss or expert-bias count) and no replay
    object is to see the call (`silent`, or none attached: router replay's recording and replaying go
    through megatron's router, so they are unchanged). The prefill of an engine without a recorder takes it
    too: the same ops, so the same routing."""
    router = mlp.router
    static_route = (
        route is not None
        and glue is not None
        and (silent or router.router_replay is None)
        and not torch.is_grad_enabled()
        and router_unsupported(router) is None
    )
    num_experts = None  # probs: megatron's dense [T, E]; with the static route its [T, k] (`dispatch`)
    if static_route:
        assert route is not None
        probs, index = static_routing(router, hidden, route)
        num_experts = router.num_experts
    elif glue is None and not fused.bench_off("router") and train_router_unsupported(router) is None:
        probs, index = train_route(router, hidden, padding_mask)
        num_experts = router.num_experts
    else:
        saved = router.router_replay
        tap = router.router_replay = _TopkTap(saved, silent)
        try:
            # [T, E] dense probabilities (zero off the top k), the load-balancing loss attached in training.
            probs, _ = router(hidden) if padding_mask is None else router(hidden, padding_mask)
        finally:
            router.router_replay = saved
        assert tap.index is not None
        index = tap.index
    tokens, k = index.shape
    x = hidden.reshape(tokens, -1)
    experts = mlp.experts.local_experts
    if glue is not None:
        assert weights is not None, "the decode glue has no backward: generation only"
        w1, w2 = weights(mlp)
        small = tokens * k <= RANK_DISPATCH_MAX_PAIRS
        kernel = glue.experts is not None and small
        rows, p, inverse, offsets = glue.dispatch(x, index, probs, small, num_experts, not kernel)
        if kernel:  # rows are the pairs' tokens: the kernel reads x through them
            y = glue.experts(x, rows, w1, w2, p, offsets)
        else:
            # GroupedSwiGLU.forward's products and SwiGLU, the products outside the glue (torch._grouped_mm).
            h = moe_experts.grouped_mm(rows, w1.transpose(1, 2), offsets)
            y = moe_experts.grouped_mm(glue.swiglu(h, p), w2.transpose(1, 2), offsets)
        out = glue.combine(y, inverse, hidden.dtype).view_as(hidden)
        if mlp.use_shared_expert:
            out = out + mlp.shared_experts(hidden)
        return (out, None), index
    # Expert-major, token order within an expert (the stable argsort: any batch size, autograd).
    order, inverse, offsets = expert_positions(index, len(experts), by_rank=False)
    token = order // k
    p = (probs if num_experts is not None else probs.gather(1, index)).reshape(-1).index_select(0, order)
    rows = _ExpertRows.apply(x, token, inverse)
    if weights is not None:
        y = GroupedSwiGLU.apply(rows, *weights(mlp), p, offsets)  # [T k, H]
    else:  # training: gradients into each expert's parameters (`moe_experts.ExpertUpdate` picks the way)
        y = expert_swiglu(experts, rows, p, offsets, mlp.config)
    # Each token's k expert outputs summed (fp32), back in the activations' dtype.
    out = _Combine.apply(y, inverse, token, hidden.dtype).view_as(hidden)
    if mlp.use_shared_expert:
        out = out + mlp.shared_experts(hidden)
    return (out, None), index


class GroupedMoELayer(MoELayer):
    """megatron's MoELayer (same submodules, parameters, checkpoints) whose forward is `moe_forward` where
    `unsupported` accepts the layer (`model.moe_grouped_gemm`): no token-count copy to the host, the
    permutation an argsort on the device, all experts in `moe_experts.expert_swiglu` with device offsets.
    megatron's own forward runs otherwise (expert parallel, expert TP, recomputation of the MoE layer, ...) and while
    the class switch `static` is off (benchmarks time megatron's path with it)."""

    static = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> Any:
        if (
            not self.static
            or intermediate_tensors is not None
            or self.moe_layer_recompute
            or self.shared_experts_recompute
            or unsupported(self) is not None
        ):
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()  # [b, s] -> [s, b], as MoELayer.forward
        (out, bias), _ = moe_forward(self, hidden_states, padding_mask=padding_mask)
        return out, bias


__all__ = [
    "EAGER_GLUE",
    "FUSED_GLUE",
    "RANK_DISPATCH_MAX_PAIRS",
    "ROUTE_OBSERVERS",
    "DecodeGlue",
    "ExpertWeights",
    "GroupedMoELayer",
    "TopkRouting",
    "combine",
    "dispatch",
    "expert_positions",
    "fused_combine",
    "fused_dispatch",
    "fused_route",
    "is_moe",
    "moe_forward",
    "route",
    "router_unsupported",
    "static_routing",
    "tokens_per_expert",
    "train_route",
    "train_router_unsupported",
    "unsupported",
]
