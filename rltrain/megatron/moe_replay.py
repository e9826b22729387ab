"""Router replay for mixture-of-experts models: record the experts the rollout chose for each token, and make
the training forward passes (old log-probs, update) route every token to those experts.

Why: a MoE policy's log-prob is discontinuous in its router's top-k. The rollout engine (KV-cache decode) and
the training forward (whole sequences, other micro-batches, other kernels) round differently, so a token
whose top-k scores nearly tie can go to other experts in training than in rollout, and its log-prob then
differs by far more than rounding: `rollout/logprob_diff_max` shows it, and the PPO ratio of such tokens is
noise. Replaying the rollout's routing removes that part of the mismatch (verl's "R3", megatron-core's
`RouterReplay`).

How: megatron-core's `TopKRouter` calls `router.router_replay.get_replay_topk(scores, topk, ...,
default_compute_topk)` whenever `router_replay` is set (megatron builds one per router only with
`moe_enable_routing_replay`, in a process-global list of every router ever built; we attach our own
per-router object for the duration of one call instead, so an actor, its reference model and test models in
one process never share state). The top-k *indices* are replaced; the probabilities are the current
router's scores gathered at those indices (then megatron's softmax over the k or its pre-softmax scores, as
without replay), so the router still gets gradients from the loss, as in megatron and verl.

Layout of the routing tensor (`routed_experts`, a rollout batch key): [rows, seq, moe_layers, top_k] int16
aligned with `input_ids` (prompt left-padded, response right-padded), MoE layers in global layer order
(`moe_layer_numbers`), -1 where nothing was recorded (padding; the last response token, which no
generation step feeds back): there the training router keeps its own top-k (those positions predict no
response token, so their experts cannot change a trained log-prob).

Recording (`record_routing`) wraps one `MegatronActor.generate` call on the KV-cache engine
(rltrain/megatron/inference.py): it notes the batch rows and cache columns of every
`KVCacheGenerator.forward` call (the only place that knows them; wrapped for the duration of the context,
the generation code is unchanged) and what each router chose in it. The static decode step (CUDA graphs,
MoE layers of rltrain/megatron/moe_decode.py) runs no router Python when it replays: it hands out each
layer's top-k instead (`StaticDecodeStep.routing`), copied after every step. Identical prompts are prefilled once,
so rows without a prefill of their own take their representative's routing. Pipeline stages hold other
layers: their records are merged with a MAX all-reduce over the pipeline group. Generation without the
KV cache (context parallel, `use_cache=False`) re-runs whole sequences and is refused.

Replay (`replay_routing`) takes the micro-batches the engine is about to run and, per router, queues one
target per micro-batch in the order megatron's schedules run them through that router (every schedule
feeds a chunk's micro-batches in order; recomputation in backward, activation checkpointing, re-runs them
in order too and takes a second queue). Each micro-batch's routing is aligned as its tokens are
(valid tokens left-aligned, `engine.align_batch`), split like them over context-parallel ranks, and cut to
this tensor-parallel rank's slice of the sequence with sequence parallel.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state

from rlconf.arch import ModelArch
from rlconf.model_spec import is_moe_layer
from rltrain.megatron import context_parallel as cp

ROUTED_EXPERTS = "routed_experts"
"""The rollout batch key of the recorded routing."""
_DTYPE = torch.int16  # expert ids < 32768; -1 = not recorded


def moe_layer_numbers(arch: ModelArch) -> list[int]:
    """Global (1-based, megatron's `layer_number`) numbers of the MoE layers, the routing tensor's layer order."""
    return [i + 1 for i in range(arch.num_layers) if is_moe_layer(arch, i)]


def routers(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """This rank's TopKRouters, in chunk and layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]


class _LayerReplay:
    """One router's record / replay state; duck-types megatron's `RouterReplay.get_replay_topk`."""

    def __init__(self, router: torch.nn.Module, mode: str) -> None:
        self.router = router
        self.mode = mode  # "record" | "replay"
        self.recorded: list[torch.Tensor] = []  # record: top-k indices [tokens, k] of each forward
        self.targets: deque[torch.Tensor] = deque()  # replay: one target [tokens, k] per micro-batch
        self.recompute: deque[torch.Tensor] = deque()  # targets again, for recomputation in backward

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        values, index = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode == "record":
            self.recorded.append(index.detach())
            return values, index
        # A router run inside autograd's backward is a recomputation (activation checkpointing) of a forward
        # this object already served: it takes that forward's target again.
        in_backward = torch._C._current_graph_task_id() != -1
        queue = self.recompute if in_backward else self.targets
        if not queue:
            raise RuntimeError(
                f"router replay: layer {self.router.layer_number} ran more forwards than micro-batches were "
                "given (a schedule that runs micro-batches out of order is not supported)"
            )
        target = queue.popleft().to(index.device)
        if not in_backward and self.router.training:
            # (Under activation checkpointing this first forward runs without grad; backward re-runs it.)
            self.recompute.append(target)
        if target.shape != index.shape:
            raise RuntimeError(
                f"router replay: layer {self.router.layer_number} routes {index.shape[0]} tokens but the "
                f"recorded routing has {target.shape[0]} (the routing tensor must follow the batch's tokens)"
            )
        index = torch.where(target >= 0, target.to(index.dtype), index)
        # The replayed experts' scores from the current weights: the router keeps its gradient.
        return scores.gather(1, index), index


@contextlib.contextmanager
def _attached(chunks: Sequence[torch.nn.Module], mode: str) -> Iterator[dict[int, _LayerReplay]]:
    """Attach a `_LayerReplay` to every router of `chunks` (keyed by global layer number); detach on exit."""
    states: dict[int, _LayerReplay] = {}
    saved = []
    for router in routers(chunks):
        saved.append((router, router.router_replay))
        states[router.layer_number] = router.router_replay = _LayerReplay(router, mode)
    try:
        yield states
    finally:
        for router, previous in saved:
            router.router_replay = previous


# ------------------------------------------------------------------------------------ recording
class RoutingRecorder:
    """What `record_routing` saw during one generation; `routed_experts(batch)` assembles the tensor."""

    def __init__(self, actor: Any, states: dict[int, _LayerReplay]) -> None:
        self.actor = actor
        self.states = states
        self.calls: list[tuple[int, torch.Tensor, int]] = []  # (first cache column, batch rows, columns)

    def routed_experts(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[rows, seq, moe_layers, top_k] int16 aligned with `batch["input_ids"]` (the generation's output),
        -1 where nothing was recorded; the same tensor on every rank of the model-parallel group."""
        from rltrain.megatron.inference import unique_rows

        layers = moe_layer_numbers(self.actor.arch)
        b, s = batch["input_ids"].shape
        k = self.actor.arch.moe_router_topk
        out = torch.full((b, s, len(layers), k), -1, dtype=_DTYPE)
        if self.states and not self.calls and any(st.recorded for st in self.states.values()):
            raise NotImplementedError(
                "router replay records the routing of the KV-cache rollout engine only (this generation ran "
                "the no-cache path: context parallel or use_cache=False)"
            )
        for number, state in self.states.items():
            if len(state.recorded) != len(self.calls):
                raise RuntimeError(
                    f"router replay: layer {number} routed {len(state.recorded)} times in "
                    f"{len(self.calls)} generation steps"
                )
            m = layers.index(number)
            for (start, rows, cols), index in zip(self.calls, state.recorded, strict=True):
                # The router sees megatron's [s, n] token order flattened.
                out[rows, start : start + cols, m] = (
                    index.view(cols, rows.numel(), k).transpose(0, 1).cpu().to(_DTYPE)
                )
        # Prompts prefilled once for several rows (rollout.n copies): each row takes its representative's.
        p = s - batch["responses"].shape[1]
        first, inverse = unique_rows(batch["input_ids"][:, :p], batch["attention_mask"][:, :p])
        out[:, :p] = out[first[inverse], :p]
        out[~batch["attention_mask"].bool()] = -1
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # Each stage recorded its own layers (-1 elsewhere).
            merged = out.to(self.actor.torch_device)
            torch.distributed.all_reduce(
                merged,
                op=torch.distributed.ReduceOp.MAX,
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
            out = merged.cpu()
        return out


@contextlib.contextmanager
def record_routing(actor: Any) -> Iterator[RoutingRecorder]:
    """Record the experts every router of `actor` chooses during the generation calls inside the context."""
    from rltrain.megatron import inference

    original = inference.KVCacheGenerator.forward
    original_step = inference.StaticDecodeStep.__call__

    with _attached(actor.modules(), "record") as states:
        recorder = RoutingRecorder(actor, states)

        def forward(engine: Any, tokens: torch.Tensor, start: int, rows: torch.Tensor, mask: Any) -> Any:
            recorder.calls.append((start, rows.detach().cpu(), tokens.shape[1]))
            return original(engine, tokens, start, rows, mask)

        def step(decode: Any, tokens: torch.Tensor, start: int, uniform: torch.Tensor) -> Any:
            # The static (CUDA-graph) decode step: its routers record nothing themselves (a replayed graph
            # runs no Python); it hands out each MoE layer's top-k, rewritten by the next replay: copied.
            out = original_step(decode, tokens, start, uniform)
            recorder.calls.append((start, decode.rows_cpu, 1))
            for number, state in states.items():
                state.recorded.append(decode.routing[number].to(_DTYPE))
            return out

        inference.KVCacheGenerator.forward = forward  # type: ignore[method-assign]
        inference.StaticDecodeStep.__call__ = step  # type: ignore[method-assign]
        try:
            yield recorder
        finally:
            inference.KVCacheGenerator.forward = original  # type: ignore[method-assign]
            inference.StaticDecodeStep.__call__ = original_step  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------ replay
def aligned_routing(data: dict[str, torch.Tensor], length: int) -> torch.Tensor:
    """A micro-batch's routing [b, S, M, k] in the aligned token layout [b, length, M, k] of
    `engine.align_batch`: each row's valid tokens from position 0, -1 beyond them."""
    routed = data[ROUTED_EXPERTS]
    mask = data["attention_mask"].bool()
    b, s = mask.shape
    valid_len = mask.sum(-1)
    start = torch.where(mask.any(-1), mask.int().argmax(-1), torch.zeros_like(valid_len))
    cols = torch.arange(length, device=mask.device)
    src = (start.unsqueeze(1) + cols.unsqueeze(0)).clamp(max=s - 1)
    out = routed[torch.arange(b, device=mask.device).unsqueeze(1), src]
    keep = (cols.unsqueeze(0) < valid_len.unsqueeze(1))[:, :, None, None]
    return torch.where(keep, out, torch.full_like(out, -1))


def router_targets(data: dict[str, torch.Tensor], length: int, config: Any) -> torch.Tensor:
    """The routing this rank's routers see for one micro-batch: [s_local x b, M, k] in megatron's token
    order ([s, b] flattened), after the context-parallel split and this rank's sequence-parallel slice."""
    aligned = cp.split_sequence(aligned_routing(data, length))  # [b, s_cp, M, k]
    seq_first = aligned.transpose(0, 1)  # [s_cp, b, M, k]
    if config.sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        seq_first = seq_first.chunk(tp, 0)[parallel_state.get_tensor_model_parallel_rank()]
    return seq_first.reshape(-1, *seq_first.shape[2:])


@contextlib.contextmanager
def replay_routing(
    chunks: Sequence[torch.nn.Module], micro_batches: Sequence[Any], arch: ModelArch, config: Any
) -> Iterator[dict[int, _LayerReplay]]:
    """Route the tokens of `micro_batches` (engine MicroBatches whose data hold `routed_experts`) to the
    recorded experts while the schedule runs them inside the context."""
    layers = moe_layer_numbers(arch)
    if not layers:
        raise ValueError(
            "actor.router_replay is on but the model has no mixture-of-experts layers; set actor.router_replay: false"
        )
    with _attached(chunks, "replay") as states:
        for mb in micro_batches:
            if ROUTED_EXPERTS not in mb.data:
                raise KeyError(
                    f"actor.router_replay is on but the batch has no {ROUTED_EXPERTS!r} (the rollout did not "
                    "record its routing)"
                )
            targets = router_targets(mb.data, mb.tokens.shape[1], config)
            for number, state in states.items():
                state.targets.append(targets[:, layers.index(number)].long())
        yield states


__all__ = [
    "ROUTED_EXPERTS",
    "RoutingRecorder",
    "aligned_routing",
    "moe_layer_numbers",
    "record_routing",
    "replay_routing",
    "router_targets",
    "routers",
]
