"""Rollout in its own layout: the actor's weights resharded, on the actor's own devices, into a rollout replica
of another tensor-parallel size (no pipeline parallel), which generates its share of the prompts.

Why (issue 20): decoding is faster at a small TP with more data-parallel replicas, while training wants a
larger TP (or PP) to fit; most verl Megatron launch scripts train at TP=4 (or TP=2 x PP=2) and generate
at TP=1 or 2. The plan decides the layout (`TrainerPlan.layout("rollout")`, `TrainerPlan.refit`); this module
carries it out when `refit.mode == "reshard"`. With equal layouts the worker keeps the zero-copy path
(`MegatronActor.generate` on the actor's own weights) and nothing here runs.

Design choice: a second megatron `GPTModel` in the rollout layout (TP = r, PP = 1), built once and kept
between steps (its parameter storage is freed after every generation and allocated again at the next
refit), generating through the same embedded engine (rltrain/megatron/inference.py) as the zero-copy path.
megatron's `parallel_state` is process-global, so the rollout layout gets a parallel state of its own:
`initialize_model_parallel(tp=r, pp=1)` is run once, with the actor's groups set aside, and the two sets
of module globals are swapped in and out (`ParallelStateSwap`) around everything the replica does (build,
generate). The actor's groups are never destroyed (megatron's `destroy_model_parallel` would destroy its
gloo data-parallel groups, so it runs with `destroy_process_group` disabled). Alternatives rejected: a
plain-torch decoder over the gathered weights would be a third copy of the layer composition to keep
equal to megatron's; passing process groups to GPTModel (`pg_collection`) leaves the engine's
`parallel_state` reads (pipeline checks, sampling broadcast) pointing at the actor's layout.

Refit (actor layout -> rollout layout), under the actor's parallel state, with a LoRA actor's adapters merged
into its weights for the duration (the replica is a plain model of the adapted policy), bucketed: this rank's stage
parameters are packed into buckets of at most `bucket_bytes` of full (gathered) tensors; each bucket is
one `all_gather_into_tensor` over the actor's TP group (full tensors = TP shards concatenated on the
partition dim), then with PP > 1 one broadcast over the PP group from the stage that owns it (every rank
needs every layer). Each full tensor is converted to the rollout's TP size (megatron's fused gate/up
layout depends on TP; the vocabulary is padded to 128 x TP) and this rank's rollout shard is copied into
the replica. Extra memory: the replica's weights (params / r) for the generation, plus one bucket in
flight. Every actor rank calls it (collectives); rollout TP may divide or be a multiple of the actor's.

Prompts: the controller dispatches by the actor's data-parallel layout; `generate` exchanges the prompts
over the world (small: token ids), rollout DP rank d generates its contiguous share (rows d*B/D..), the
results are exchanged back and every rank returns its actor DP shard's rows, in the actor's order. Each
rollout DP rank samples from `derive_seed(seed, d, DP_SHARD)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state

from rlconf.seeding import DP_SHARD, derive_seed
from rltrain import device as devices
from rltrain.rollout.weight_sync import SyncStats

_STATE_NAME = re.compile(r"^_[A-Z][A-Z0-9_]*$")


# ------------------------------------------------------------------------------------ parallel state
def _snapshot() -> dict[str, Any]:
    return {k: v for k, v in vars(parallel_state).items() if _STATE_NAME.match(k)}


def _restore(state: dict[str, Any]) -> None:
    for k, v in state.items():
        setattr(parallel_state, k, v)


class ParallelStateSwap:
    """A second megatron parallel state (TP = `tp`, PP = 1) beside the actor's; `active()` swaps it in.

    Built collectively (every rank of the world calls it: megatron creates its groups with new_group).
    """

    def __init__(self, tp: int, timeout_minutes: int = 30) -> None:
        actor = _snapshot()
        real_destroy = torch.distributed.destroy_process_group
        try:
            # Clear megatron's globals so that initialize_model_parallel accepts a second call, without
            # destroying any of the actor's process groups.
            torch.distributed.destroy_process_group = lambda *a, **k: None  # type: ignore[assignment]
            parallel_state.destroy_model_parallel()
        finally:
            torch.distributed.destroy_process_group = real_destroy
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=1,
                distributed_timeout_minutes=timeout_minutes,
                create_gloo_process_groups=False,
            )
            self.state = _snapshot()
        finally:
            _restore(actor)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved = _snapshot()
        _restore(self.state)
        try:
            yield
        finally:
            _restore(saved)


# ------------------------------------------------------------------------------------ weight conversion
def to_rollout_full(name: str, full: torch.Tensor, arch: Any, actor_tp: int, rollout_tp: int,
                    vocab_rows: int) -> torch.Tensor:  # fmt: skip
    """The actor's full (all TP ranks) megatron tensor `name` in the rollout layout's full form.

    Only two layouts depend on TP: linear_fc1 ([gate_r; up_r] per TP shard r) and the vocabulary padding
    (a multiple of 128 x TP); q/k/v are grouped per query group whatever the TP, the rest is plain.
    """
    from rltrain.megatron.hf_weights import fuse_gate_up, split_gate_up

    if name.endswith("mlp.linear_fc1.weight") and actor_tp != rollout_tp:
        return fuse_gate_up(*split_gate_up(full, actor_tp), rollout_tp)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") and full.shape[0] != vocab_rows:
        out = full.new_zeros((vocab_rows, *full.shape[1:]))
        rows = min(arch.vocab_size, vocab_rows)
        out[:rows] = full[:rows]
        return out
    return full


@dataclass(frozen=True)
class _Entry:
    """One actor parameter of a pipeline stage: enough for every rank to size buffers without the tensor."""

    name: str
    local_shape: tuple[int, ...]
    partition_dim: int | None  # None: replicated over TP (norms)

    def full_shape(self, tp: int) -> tuple[int, ...]:
        if self.partition_dim is None:
            return self.local_shape
        s = list(self.local_shape)
        s[self.partition_dim] *= tp
        return tuple(s)


# ------------------------------------------------------------------------------------ the replica
class RolloutReplica:
    """The rollout-layout model of one actor rank, its refit from the actor and its generation.

    Duck-types what the embedded engine reads from an actor (`modules`, `eval`, `_ctx`, `device`,
    `torch_device`, `vocab_size`, `fused_kernels`, `broadcast_from_last_stage`) so `generate_with_kv_cache`
    runs on it.
    """

    def __init__(self, actor: Any, rollout_tp: int, bucket_bytes: int) -> None:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.module import Float16Module

        from rltrain.megatron import model as mmodel
        from rltrain.megatron.hf_weights import global_params

        self.actor = actor
        self.device = actor.device
        self.torch_device = actor.torch_device
        self.arch = actor.arch
        self.vocab_size = actor.arch.vocab_size
        # The actor's kernels: its TransformerConfig (copied below) carries the SwiGLU / RoPE fusions too.
        self.fused_kernels = actor.fused_kernels
        self.bucket_bytes = bucket_bytes
        self.actor_tp = parallel_state.get_tensor_model_parallel_world_size()
        self.actor_pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.rollout_tp = rollout_tp
        self.state = ParallelStateSwap(rollout_tp)
        actor_model = mmodel.unwrap(actor._chunks[0])
        core = type(actor_model.decoder.layers[0].self_attention.core_attention)
        backend = (
            "sdpa"
            if core is mmodel.SdpaAttention
            else "local"
            if core.__name__ == "DotProductAttention"
            else "te"
        )
        with self.state.active(), devices.device_context(self.device):
            # The actor's TransformerConfig in the rollout layout. Weights are initialised (once, at build)
            # although the refit overwrites them: megatron marks a parameter's TP split only while
            # initialising it, and checkpoint / export helpers read those marks.
            config = dataclasses.replace(
                actor_model.config,
                tensor_model_parallel_size=rollout_tp,
                pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None,
                # The actor's uneven pipeline split does not apply to the replica's single stage.
                num_layers_in_first_pipeline_stage=None,
                num_layers_in_last_pipeline_stage=None,
                account_for_embedding_in_pipeline_split=False,
                account_for_loss_in_pipeline_split=False,
                context_parallel_size=1,
                sequence_parallel=False,
            )
            model = GPTModel(
                config=config,
                transformer_layer_spec=mmodel.block_spec(
                    mmodel.layer_specs(backend, self.arch), config, None
                ),
                vocab_size=mmodel.padded_vocab_size(self.arch.vocab_size, rollout_tp),
                max_sequence_length=self.arch.max_position_embeddings,
                pre_process=True,
                post_process=True,
                parallel_output=True,
                share_embeddings_and_output_weights=self.arch.share_embeddings_and_output_weights,
                position_embedding_type="rope",
                rotary_base=self.arch.rotary_base,
            )
            model.rotary_pos_emb.inv_freq = mmodel.rope_inv_freq(self.arch).to(
                model.rotary_pos_emb.inv_freq.device
            )
            if devices.is_accelerator(self.device):
                model.to(self.torch_device)
            if config.bf16 or config.fp16:
                model = Float16Module(config, model)
            model.requires_grad_(False)
            model.eval()
            self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
            self.dp_rank = parallel_state.get_data_parallel_rank()
            self.dp_size = parallel_state.get_data_parallel_world_size()
        self.model = model
        self.gpt = mmodel.unwrap(model)
        self.params = dict(global_params(self.gpt))
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.dtype = next(iter(self.params.values())).dtype
        self.stage_entries = self._exchange_entries()
        self.release()

    # --------------------------------------------------------------------------------- engine interface
    def modules(self) -> list[torch.nn.Module]:
        return [self.gpt]

    def eval(self) -> None:
        self.model.eval()

    def _ctx(self) -> contextlib.AbstractContextManager[None]:
        return devices.device_context(self.device)

    def broadcast_from_last_stage(
        self, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        assert tensor is not None  # no pipeline parallel: this rank is the last stage
        return tensor

    # --------------------------------------------------------------------------------- memory
    def release(self) -> None:
        """Free the replica's weight storage (kept: the module, its shapes and the process groups)."""
        for p in self.params.values():
            p.data = torch.empty(0, dtype=self.dtype, device=self.torch_device)

    def allocated_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    # --------------------------------------------------------------------------------- refit
    def _local_entries(self) -> list[tuple[_Entry, torch.Tensor]]:
        from rltrain.megatron.hf_weights import global_params
        from rltrain.megatron.model import unwrap

        out = []
        for chunk in self.actor.chunks:
            for name, param in global_params(unwrap(chunk)):
                split = getattr(param, "tensor_model_parallel", False) and self.actor_tp > 1
                out.append((_Entry(name, tuple(param.shape), param.partition_dim if split else None), param))
        return out

    def _exchange_entries(self) -> list[list[_Entry]]:
        """Every pipeline stage's parameter list, known on every rank (sizes the PP broadcasts)."""
        mine = [e for e, _ in self._local_entries()]
        if self.actor_pp == 1:
            return [mine]
        stages: list[Any] = [None] * self.actor_pp
        torch.distributed.all_gather_object(
            stages, mine, group=parallel_state.get_pipeline_model_parallel_group()
        )
        return stages

    def _buckets(self, entries: list[_Entry]) -> Iterator[list[_Entry]]:
        elem = torch.empty((), dtype=self.dtype).element_size()
        bucket: list[_Entry] = []
        size = 0
        for e in entries:
            n = torch.Size(e.full_shape(self.actor_tp)).numel() * elem
            if bucket and size + n > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(e)
            size += n
        if bucket:
            yield bucket

    @torch.no_grad()
    def refit(self) -> SyncStats:
        """Write the actor's current weights into the replica (collective over the actor's TP and PP
        groups; every actor rank calls it). Allocates the replica's storage freed by `release`. A LoRA actor's
        adapters are folded into its base weights for the refit (`generation_weights`: each rank merges its
        own shards, W + (alpha / r) B A, so the gathered tensors are the adapted policy's) and restored bit
        for bit after it, so the replica samples from the policy the actor trains."""
        from rltrain.megatron.lora import generation_weights

        with generation_weights(self.actor):
            return self._refit()

    def _refit(self) -> SyncStats:
        stats = SyncStats()
        t0 = time.perf_counter()
        dev = self.torch_device
        for name, p in self.params.items():
            if p.numel() == 0:
                p.data = torch.empty(self.shapes[name], dtype=self.dtype, device=dev)
        local = dict((e.name, t) for e, t in self._local_entries())
        my_stage = parallel_state.get_pipeline_model_parallel_rank()
        tp_group = parallel_state.get_tensor_model_parallel_group()
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp_ranks = torch.distributed.get_process_group_ranks(pp_group) if self.actor_pp > 1 else None
        with devices.device_context(self.device):
            for stage, entries in enumerate(self.stage_entries):
                for bucket in self._buckets(entries):
                    fulls = self._gather_bucket(bucket, local, tp_group) if stage == my_stage else None
                    if self.actor_pp > 1:
                        fulls = self._broadcast_bucket(bucket, fulls, pp_group, pp_ranks[stage])
                    assert fulls is not None
                    for e, full in zip(bucket, fulls, strict=True):
                        self._load(e.name, full)
                        stats.tensors += 1
                        stats.bytes += full.numel() * full.element_size()
                    stats.buckets += 1
        devices.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _gather_bucket(
        self, bucket: list[_Entry], local: dict[str, torch.Tensor], group: Any
    ) -> list[torch.Tensor]:
        """Full tensors of one bucket from this stage's TP shards: one all-gather of the packed shards."""
        shards = [local[e.name].detach() for e in bucket]
        if self.actor_tp == 1:
            return shards
        flat = torch.cat([s.reshape(-1) for s in shards])
        gathered = torch.empty(flat.numel() * self.actor_tp, dtype=flat.dtype, device=flat.device)
        torch.distributed.all_gather_into_tensor(gathered, flat, group=group)
        parts = gathered.view(self.actor_tp, -1)
        fulls, off = [], 0
        for e, s in zip(bucket, shards, strict=True):
            n = s.numel()
            pieces = [parts[r, off : off + n].view(e.local_shape) for r in range(self.actor_tp)]
            fulls.append(pieces[0] if e.partition_dim is None else torch.cat(pieces, dim=e.partition_dim))
            off += n
        return fulls

    def _broadcast_bucket(
        self, bucket: list[_Entry], fulls: list[torch.Tensor] | None, group: Any, src: int
    ) -> list[torch.Tensor]:
        """Give every pipeline stage the full tensors of a bucket owned by stage rank `src`."""
        shapes = [e.full_shape(self.actor_tp) for e in bucket]
        sizes = [torch.Size(s).numel() for s in shapes]
        if fulls is not None:
            flat = torch.cat([f.reshape(-1) for f in fulls])
        else:
            flat = torch.empty(sum(sizes), dtype=self.dtype, device=self.torch_device)
        torch.distributed.broadcast(flat, src=src, group=group)
        return [t.view(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]

    def _load(self, name: str, full: torch.Tensor) -> None:
        param = self.params.get(name)
        if param is None:
            # The last stage's copy of a tied output layer: the rollout replica (PP = 1) reads the embedding.
            if name == "output_layer.weight" and self.arch.share_embeddings_and_output_weights:
                return
            raise KeyError(f"rollout replica has no parameter {name}")
        full = to_rollout_full(name, full, self.arch, self.actor_tp, self.rollout_tp, self.gpt.vocab_size)
        shape = self.shapes[name]
        # The split dimension is the one the rollout shard is narrower in (megatron sets the
        # `partition_dim` attribute only when it initialises the weight, which the replica skips).
        split = [d for d, (f, s) in enumerate(zip(full.shape, shape, strict=True)) if f != s]
        if len(split) == 1 and full.shape[split[0]] == shape[split[0]] * self.rollout_tp:
            full = full.chunk(self.rollout_tp, dim=split[0])[self.tp_rank]
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(
                f"refit {name}: got {tuple(full.shape)}, the rollout layout expects {tuple(param.shape)}"
            )
        param.data.copy_(full)

    # --------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        seed: int,
        actor_dp_rank: int,
        **sampling: Any,
    ) -> dict[str, torch.Tensor]:
        """Refit, generate this rollout DP rank's share of every actor DP shard's prompts, free the
        replica's weights, and return this actor DP shard's rows (in order). Collective over the world."""
        from rltrain.megatron.inference import generate_with_kv_cache

        self.last_refit = self.refit()
        world = torch.distributed.get_world_size()
        shards: list[Any] = [None] * world
        torch.distributed.all_gather_object(shards, (actor_dp_rank, prompt_ids.cpu(), prompt_mask.cpu()))
        by_dp: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for d, ids, mask in shards:
            by_dp.setdefault(d, (ids, mask))
        order = sorted(by_dp)
        counts = [by_dp[d][0].shape[0] for d in order]
        all_ids = torch.cat([by_dp[d][0] for d in order])
        all_mask = torch.cat([by_dp[d][1] for d in order])
        rows = torch.tensor_split(torch.arange(all_ids.shape[0]), self.dp_size)[self.dp_rank]
        try:
            with self.state.active():
                out = generate_with_kv_cache(
                    self, all_ids[rows], all_mask[rows], seed=derive_seed(seed, self.dp_rank, DP_SHARD),
                    **sampling,
                )  # fmt: skip
        finally:
            self.release()
        results: list[Any] = [None] * world
        torch.distributed.all_gather_object(results, (self.dp_rank, out))
        parts: dict[int, dict[str, torch.Tensor]] = {}
        for d, o in results:
            parts.setdefault(d, o)
        full = {k: torch.cat([parts[d][k] for d in sorted(parts)]) for k in out}
        start = sum(counts[: order.index(actor_dp_rank)])
        n = counts[order.index(actor_dp_rank)]
        return {k: v[start : start + n] for k, v in full.items()}


__all__ = ["ParallelStateSwap", "RolloutReplica", "to_rollout_full"]
