"""Shared machinery of the megatron roles (actor, ref, critic, reward model), built from the plan alone
(`MegatronEngine.from_plan`: the role's `rlconf.plan.EnginePlan` gives the architecture, the weights folder,
the layout, the engine settings, the batch schedule and the lr table; engines outside a run compile a small
plan first, `rlconf.plan.small_plan`): model + optimizer ownership, batch layout, micro-batching (fixed or
token-budget), DP-correct loss weights, running megatron's forward/backward schedules on this rank's data,
and moving the role's state to host memory while other roles run.

Batch layout (a dict of tensors, one data-parallel rank's share; every TP/PP rank of the same DP rank gets
the same batch): `input_ids`, `attention_mask`, `position_ids` [B, S] hold prompt + response;
`responses`, `response_mask` [B, R]. Each row's valid tokens must be contiguous (left-padded prompt +
right-padded response as in verl, or a fully right-padded row); the response is the last
`response_mask.sum()` valid tokens of the row. Before the forward every row is shifted so that its valid
tokens start at position 0: megatron's RoPE uses positions 0..S-1 regardless of `position_ids`, and a
right-aligned causal batch then needs no attention mask (SDPA's causal fast path).

Engines with an optimizer wrap each model chunk in megatron DDP (contiguous param / grad buffers, the
distributed optimizer shards fp32 state over DP). A frozen engine (the reference policy, `optim=None`) holds
bare chunks: parameters only, no gradient buffers, `requires_grad` off; `init_from` copies another engine's
weights into it (the reference policy is the actor at step 0) without reading the checkpoint again.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from rlconf.seeding import DROPOUT, SHUFFLE, derive_seed
from rltrain.device import device_context, from_host, torch_device
from rltrain.megatron import context_parallel as cp
from rltrain.megatron import fused, packing
from rltrain.megatron import model as mmodel
from rltrain.megatron.hf_weights import load_hf_weights
from rltrain.megatron.moe_experts import cached_expert_stacks
from rltrain.megatron.offload import HostOffloader, storage_bytes, storage_key, unique_storages
from rltrain.megatron.parallel import init_parallel, seed_parallel_rng

if TYPE_CHECKING:
    from rlconf.plan import EnginePlan, TrainerPlan

OFFLOAD_GROUPS = ("params", "grads", "optimizer")

# The setting a model's weights folder comes from (errors about the folder name it); a critic without a
# folder of its own loads the policy's (model.path).
_WEIGHTS_SETTING = {"policy": "model.path", "reward_model": "reward.reward_model.path"}


@dataclass
class MicroBatch:
    """One micro-batch in aligned (padded) or packed layout plus where each response token's prediction
    lives.

    Padded: tokens [b, L], each row's valid tokens left-aligned; gather_index [b, R] positions within a row.
    Packed (`packed` set, rltrain/megatron/packing.py): tokens [1, T], the rows back to back;
    gather_index [b, R] positions in the packed sequence.
    """

    tokens: torch.Tensor  # [b, L] valid tokens left-aligned, zero padded; L a multiple of TP ([1, T] packed)
    position_ids: torch.Tensor  # [b, L] 0..L-1 ([1, T] packed: restarting in every row)
    gather_index: torch.Tensor  # [b, R] position whose logits predict response token j
    data: dict[str, torch.Tensor]  # the original per-row tensors ([b, ...]) of this micro-batch
    rows: torch.Tensor  # [b] indices of these rows in the batch that was split (outputs go back there)
    packed: PackedSeqParams | None = None  # megatron's THD params of a packed micro-batch
    # [N] the valid response tokens' flat indices into [b, R] (row-major), found on the host while the
    # micro-batch was built, so a pass selects them without a device -> host read (a boolean mask would).
    response_index: torch.Tensor | None = None

    def flat_index(self) -> torch.Tensor:
        """[b, R] indices into the output's flattened positions ([b * L] padded, [T] packed) predicting
        each response token (without context parallel)."""
        if self.packed is not None:
            return self.gather_index
        b, length = self.tokens.shape
        return torch.arange(b, device=self.gather_index.device).unsqueeze(1) * length + self.gather_index


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step of an update as the device holds it (`MegatronEngine.optimizer_step_on`)."""

    values: torch.Tensor  # [micro-batches, names] fp64: each micro-batch's metrics (none off the last stage)
    grad_norm: torch.Tensor  # 0-dim: megatron's global gradient norm
    applied: torch.Tensor  # 0-dim bool: whether the divergence guard let the step through


@dataclass(frozen=True)
class StepTotals:
    """An update's optimizer steps read back on the host (`MegatronEngine.read_steps`)."""

    grad_norms: list[float]
    skipped: int  # steps the divergence guard did not apply
    count: int  # micro-batch outputs counted into the metric sums


def _device_of(device: str) -> torch.device:
    return torch_device(device)


def align_batch(
    batch: dict[str, torch.Tensor], seq_multiple: int, device: torch.device, min_length: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-align each row's valid tokens; return (tokens [B, L], position_ids [B, L], gather_index [B, R]).

    gather_index[i, j] is the aligned position whose logits predict response token j of row i (clamped to
    0 where the response is padding; those entries are masked by response_mask downstream).
    """
    input_ids = batch["input_ids"]
    mask = batch["attention_mask"].bool()
    resp_mask = batch["response_mask"]
    b, s = input_ids.shape
    r = resp_mask.shape[1]
    valid_len = mask.sum(-1)
    start = torch.where(mask.any(-1), mask.int().argmax(-1), torch.zeros_like(valid_len))
    length = max(int(valid_len.max().item()) if b else 1, min_length, 1)
    length = math.ceil(length / seq_multiple) * seq_multiple
    cols = torch.arange(length)
    src = (start.unsqueeze(1) + cols.unsqueeze(0)).clamp(max=s - 1)
    tokens = torch.gather(input_ids, 1, src)
    tokens = torch.where(cols.unsqueeze(0) < valid_len.unsqueeze(1), tokens, torch.zeros_like(tokens))
    # The response spans up to its last valid token: a multi-turn response has interior zeros (a tool's
    # observation tokens, attended to but not trained on), so the span is not the count of ones.
    cols_r = torch.arange(1, r + 1)
    resp_len = (resp_mask.bool() * cols_r).max(-1).values if r else resp_mask.sum(-1)
    prompt_len = valid_len - resp_len
    gather_index = (prompt_len.unsqueeze(1) - 1 + torch.arange(r).unsqueeze(0)).clamp(min=0, max=length - 1)
    positions = cols.unsqueeze(0).expand(b, -1).contiguous()
    return from_host(tokens, device), from_host(positions, device), from_host(gather_index, device)


def split_rows(n: int, micro_batch_size: int) -> list[slice]:
    """Consecutive row slices of at most micro_batch_size rows."""
    return [slice(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)]


def split_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Token-budget micro-batches (use_dynamic_bsz): lists of row indices covering every row once.

    Rows are taken longest first (ties by index, so every rank of a DP replica cuts alike) and packed
    greedily while the micro-batch's padded size (rows x its longest row) stays within max_tokens; a row
    longer than the budget gets a micro-batch of its own. Sorting puts rows of similar length together,
    which keeps padding low; outputs go back to the original order through `MicroBatch.rows`.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        # Descending order: the first row of a micro-batch is its longest.
        if cur and longest * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur = []
        if not cur:
            longest = lengths[i]
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _split_for_interleaving(index_sets: list[torch.Tensor], pp: int) -> list[torch.Tensor]:
    """Micro-batch row sets for megatron's interleaved (virtual pipeline) schedule, which runs micro-batches
    in groups of pp per virtual stage and refuses a count that is not a multiple of pp: the largest sets
    are halved until it is. The losses are normalised by the mini-batch's totals, so smaller micro-batches
    give the same update, and a halved set stays within a token budget."""
    sets = list(index_sets)
    while len(sets) % pp:
        big = max(range(len(sets)), key=lambda i: len(sets[i]))
        if len(sets[big]) < 2:
            rows = sum(len(x) for x in sets)
            raise RuntimeError(
                f"virtual pipeline parallel runs a multiple of pp = {pp} micro-batches per pass (megatron's "
                f"interleaved schedule) and this rank's {rows} rows cannot make one; give each data-parallel "
                f"rank at least {pp} rows per mini-batch, or set virtual_pipeline_model_parallel_size: null"
            )
        sets[big : big + 1] = list(torch.tensor_split(sets[big], 2))
    return sets


class MegatronEngine:
    """One role's megatron model chunks, optimizer and schedule runner on this rank.

    `chunks` (DDP-wrapped unless frozen) and `optimizer` are properties: reading them brings back whatever
    was offloaded (parameters for `chunks`; everything for `optimizer`), so code outside the engine (the
    checkpoint manager, HF export) never sees a released storage.
    """

    @classmethod
    def from_plan(
        cls, plan: TrainerPlan, role: str, init_from: MegatronEngine | None = None
    ) -> MegatronEngine:
        """The engine of one role of a compiled plan (`TrainerPlan.engine(role)`)."""
        return cls.from_spec(plan.engine(role), init_from)

    @classmethod
    def from_spec(cls, spec: EnginePlan, init_from: MegatronEngine | None = None) -> MegatronEngine:
        """The engine of one role's `EnginePlan` (a compiled plan's `engine(role)`, possibly `frozen`)."""
        engine = cls.__new__(cls)
        engine._build(spec, init_from)
        return engine

    def _build(self, spec: EnginePlan, init_from: MegatronEngine | None) -> None:
        """Build everything from the plan: TransformerConfig and GPTModel chunks from the role's ModelSpec
        and layout, DDP and the optimizer from its EngineSettings and OptimPlan, the lr of each training
        step from the OptimPlan's table, batch iteration from its BatchPlan."""
        self.spec = spec
        # The base of this engine's per-step dropout and shuffle streams (rlconf.seeding; the plan resolved it).
        self.seed = spec.settings.seed
        self.device = spec.device
        if not parallel_state.model_parallel_is_initialized():
            init_parallel(spec.layout, spec.device, seed=spec.settings.seed)
        self.torch_device = _device_of(spec.device)
        self.arch = spec.model.arch
        self.tp_size = spec.layout.tp
        self.dp_size = spec.layout.dp
        self.trainable = spec.trainable
        # LoRA (actor.lora): base weights frozen, adapters trained; None: full fine-tuning.
        self.lora = spec.lora
        value_head = spec.model.head == "value"
        self._offloader = HostOffloader(self.torch_device)
        with self._ctx():
            # A frozen engine needs no DDP: megatron's DDP allocates a gradient buffer as large as the model.
            self._chunks = mmodel.build_model_chunks(
                self.arch, spec.layout, spec.settings, spec.device, value_head=value_head,
                wrap_ddp=self.trainable, fused=spec.fused_kernels, lora=spec.lora,
            )  # fmt: skip
            # Weights go in before the optimizer is built: it copies fp32 main params from them.
            if init_from is not None:
                self.copy_weights_from(init_from)
            elif spec.model.weights is not None:
                load_hf_weights(self._chunks, spec.model.weights, self.arch, value_head=value_head,
                                config_path=_WEIGHTS_SETTING.get(spec.model.name, "model.path"))  # fmt: skip
            if spec.lora is not None and spec.lora.adapter_path is not None and init_from is None:
                from rltrain.megatron.peft_io import load_peft_adapter

                load_peft_adapter(self._chunks, spec.lora, self.arch, spec.lora.adapter_path)
            if not self.trainable:
                for chunk in self._chunks:
                    chunk.requires_grad_(False)
            self._optimizer = None
            self.lr_scheduler = None
            if spec.optim is not None:
                self._optimizer = mmodel.build_optimizer(
                    self._chunks, spec.optim, spec.settings.transformer.params_dtype, spec.settings.ddp
                )
                self.lr_scheduler = mmodel.PlanLrSchedule(self._optimizer, spec.optim)
        self.config = mmodel.unwrap(self._chunks[0]).config
        self.config.finalize_model_grads_func = finalize_model_grads
        if self.trainable:
            no_sync = [c.no_sync for c in self._chunks]
            self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if self._optimizer is not None:
            self.config.grad_scale_func = self._optimizer.scale_loss
        # Sequence parallel splits the sequence over TP ranks: lengths must divide evenly.
        self.seq_multiple = self.tp_size if spec.layout.sequence_parallel else 1
        # Context parallel cuts each sequence into 2 x CP equal chunks (rltrain/megatron/context_parallel.py).
        self.cp_size = spec.layout.cp
        if self.cp_size > 1:
            self.seq_multiple *= 2 * self.cp_size

    # --------------------------------------------------------------------------------- helpers
    def _ctx(self) -> contextlib.AbstractContextManager[None]:
        """Context for every call into megatron: the CUDA->CPU rewrite mode on cpu, nothing on GPU.

        Every such call needs the parameters, so offloaded parameters come back here first.
        """
        self.reload(params=True, grads=False, optimizer=False)
        return device_context(self.device)

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """This rank's model chunks (parameters reloaded if they were offloaded)."""
        self.reload(params=True, grads=False, optimizer=False)
        return self._chunks

    @property
    def optimizer(self) -> Any:
        """The megatron optimizer or None (everything offloaded is reloaded: its state refers to all of it)."""
        if self._optimizer is not None:
            self.reload()
        return self._optimizer

    @property
    def is_last_stage(self) -> bool:
        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    def modules(self) -> list[torch.nn.Module]:
        """The bare GPTModel of each chunk (`.sharded_state_dict()` for checkpoints)."""
        return [mmodel.unwrap(c) for c in self.chunks]

    @torch.no_grad()
    def copy_weights_from(self, other: MegatronEngine) -> None:
        """Copy another engine's parameters (same architecture and TP/PP layout) into this one (the other
        engine's parameters are reloaded first if they were offloaded)."""
        for mine, theirs in zip(self.modules(), other.modules(), strict=True):
            src = dict(theirs.named_parameters())
            dst = dict(mine.named_parameters())
            if src.keys() != dst.keys():
                raise ValueError(
                    f"copy_weights_from: parameter names differ: {sorted(src.keys() ^ dst.keys())[:5]}"
                )
            for name, p in dst.items():
                if p.shape != src[name].shape:
                    raise ValueError(
                        f"copy_weights_from: {name} is {tuple(src[name].shape)} there, {tuple(p.shape)} here "
                        "(the two engines need the same TP/PP layout)"
                    )
                p.data.copy_(src[name].data)

    # --------------------------------------------------------------------------------- offload
    def _sub_optimizers(self) -> list[Any]:
        opt = self._optimizer
        if opt is None:
            return []
        return [s for s in mmodel.sub_optimizers(opt) if getattr(s, "optimizer", None) is not None]

    def _param_tensors(self) -> list[torch.Tensor]:
        # With the distributed optimizer megatron DDP keeps all params of a buffer in one contiguous
        # `param_data` storage (each param's .data is a view), so this is a handful of storages; without
        # it, one storage per parameter.
        return [p for c in self._chunks for p in c.parameters()]

    def _grad_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for c in self._chunks:
            if isinstance(c, DistributedDataParallel):
                out += [b.grad_data for b in [*c.buffers, *c.expert_parallel_buffers]]
            out += [p.grad for p in c.parameters() if p.grad is not None]
        # fp32 copies of 16-bit grads the optimizer made for its last step. (The distributed optimizer's
        # fp32 shards are non-leaf views of the params; their .grad is a view of grad_data, counted above,
        # and reading .grad of a non-leaf tensor warns.)
        for sub in self._sub_optimizers():
            for group in sub.optimizer.param_groups:
                out += [p.grad for p in group["params"] if p.is_leaf and p.grad is not None]
        return out

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        # fp32 main params (the distributed optimizer's shards or the fp32 copies of 16-bit params) and
        # the per-parameter state (Adam moments, step). fp32 main params that are views of the model's own
        # storage belong to "params" and are excluded here.
        taken = {storage_key(t) for t in self._param_tensors() + self._grad_tensors()}
        out: list[torch.Tensor] = []
        for sub in self._sub_optimizers():
            for group in sub.optimizer.param_groups:
                out += list(group["params"])
            for state in sub.optimizer.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return unique_storages(out, exclude=taken)

    def state_tensors(self, group: str) -> list[torch.Tensor]:
        """Tensors whose storages make up one part of this role's state ("params", "grads", "optimizer");
        what `offload` moves and `device_memory` counts. Parts never share a storage."""
        if group == "params":
            return self._param_tensors()
        if group == "grads":
            return self._grad_tensors()
        if group == "optimizer":
            return self._optimizer_tensors()
        raise ValueError(f"unknown offload group {group!r}; expected one of {OFFLOAD_GROUPS}")

    def offload(self, params: bool = False, grads: bool = False, optimizer: bool = False) -> dict[str, int]:
        """Move the chosen parts of this role's state to host memory; returns bytes moved per part.

        params: the model weights (megatron DDP's contiguous `param_data`, or each parameter's storage, plus
        fp32 optimizer shards that view them). grads: DDP's `grad_data` (every `main_grad`) and any `.grad`
        tensors. optimizer: fp32 main params held apart from the model, Adam moments and step. Each part is
        copied out bit-exactly and its device storage released; `reload` brings it back. Already offloaded
        parts are skipped.

        Intended call points (the worker decides; each engine call reloads what it needs on entry, so a
        missed reload costs time, never correctness):
          * actor, after `update_policy`: `offload_for_other_roles(keep_params=True)` — grads and optimizer
            leave, the weights stay for the rollout on the actor's own weights and `compute_log_prob`;
          * actor, before the reference policy or a colocated critic / inference engine takes the device:
            `offload_for_other_roles()`;
          * ref, after `compute_log_prob`: `offload_for_other_roles()` (parameters only: it has nothing else);
          * critic, after `update_critic` and after `compute_values`: `offload_for_other_roles()`.
        Everything the plan's `OffloadSettings` (megatron.{param,grad,optimizer}_offload) leaves off stays on
        the device.
        """
        wanted = [g for g, on in zip(OFFLOAD_GROUPS, (params, grads, optimizer), strict=True) if on]
        # Gather every group's tensors before releasing anything: the optimizer group excludes storages
        # that belong to params/grads, recognised by identity (which survives a resize).
        tensors = {g: self.state_tensors(g) for g in wanted}
        return {g: self._offloader.offload(g, tensors[g]) for g in wanted}

    def reload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Bring offloaded parts back to the device (bit-identical); returns bytes moved per part."""
        wanted = [g for g, on in zip(OFFLOAD_GROUPS, (params, grads, optimizer), strict=True) if on]
        return {g: self._offloader.reload(g) for g in wanted if self._offloader.is_offloaded(g)}

    def offload_for_other_roles(self, keep_params: bool = False) -> dict[str, int]:
        """Offload what this role's plan asks for (`OffloadSettings`: param_offload, grad_offload,
        optimizer_offload); `keep_params` keeps the weights on the device whatever param_offload says (the
        actor between its update and the rollout that runs on its weights). See `offload` for call points."""
        wanted = self.spec.settings.offload
        return self.offload(
            params=wanted.params and not keep_params,
            grads=wanted.grads,
            optimizer=wanted.optimizer,
        )

    @property
    def fused_kernels(self) -> bool:
        """The plan's choice of torch.compile'd fused kernels for this engine (`EnginePlan.fused_kernels`)."""
        return self.spec.fused_kernels

    def offloaded(self) -> list[str]:
        """Parts currently in host memory."""
        return self._offloader.offloaded_groups()

    def device_memory(self) -> dict[str, int]:
        """Bytes each part of this role's state holds on the device now (distinct storages; 0 when
        offloaded). On CPU the device is the host and host-side copies are not counted."""
        return {g: storage_bytes(self.state_tensors(g), self.torch_device) for g in OFFLOAD_GROUPS}

    # --------------------------------------------------------------------------------- batching
    def micro_batches(
        self,
        batch: dict[str, torch.Tensor],
        micro_batch_size: int,
        use_dynamic_bsz: bool = False,
        max_token_len: int = 0,
        packed: bool = False,
    ) -> list[MicroBatch]:
        """Split this rank's batch into aligned micro-batches: fixed row counts in row order, or a token
        budget (rows regrouped by length; `MicroBatch.rows` says where each row came from). `packed` (the
        plan's `EngineSettings.remove_padding`): each micro-batch's rows packed into one sequence, and the
        token budget counts their real tokens instead of rows x the longest."""
        if packed:
            return self._packed_micro_batches(batch, micro_batch_size, use_dynamic_bsz, max_token_len)
        n = batch["input_ids"].shape[0]
        lengths = batch["attention_mask"].sum(-1)
        # The interleaved (virtual pipeline) schedule assumes one activation shape for all micro-batches.
        min_length = int(lengths.max()) if len(self._chunks) > 1 and n else 1
        if use_dynamic_bsz:
            # The padded length each row would have in its own micro-batch (see align_batch).
            padded = [
                math.ceil(max(int(x), min_length, 1) / self.seq_multiple) * self.seq_multiple
                for x in lengths.tolist()
            ]
            # The budget is per device (verl's ppo_max_token_len_per_gpu): with context parallel a micro-batch
            # packs budget x CP tokens, of which each CP rank holds 1 / CP (what the plan's batch schedule
            # and memory estimate count).
            budget = max_token_len * self.cp_size
            index_sets = [torch.tensor(g, dtype=torch.long) for g in split_by_tokens(padded, budget)]
        else:
            index_sets = [torch.arange(n)[s] for s in split_rows(n, micro_batch_size)]
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if len(self._chunks) > 1 and index_sets:
            index_sets = _split_for_interleaving(index_sets, pp)
        out = []
        for idx in index_sets:
            data = {k: v[idx] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            tokens, positions, gather_index = align_batch(
                data, self.seq_multiple, self.torch_device, min_length
            )
            response_index = self._response_index(data)
            data = {k: from_host(v, self.torch_device) for k, v in data.items()}
            out.append(MicroBatch(tokens, positions, gather_index, data, idx, None, response_index))
        return out

    def _packed_micro_batches(
        self, batch: dict[str, torch.Tensor], micro_batch_size: int, use_dynamic_bsz: bool, max_token_len: int
    ) -> list[MicroBatch]:
        """`micro_batches` in the packed layout (rltrain/megatron/packing.py)."""
        assert self.cp_size == 1 and len(self._chunks) == 1, (
            "packing with CP or virtual PP: the plan refuses it"
        )
        n = batch["input_ids"].shape[0]
        if use_dynamic_bsz:
            lengths = [max(int(x), 1) for x in batch["attention_mask"].sum(-1).tolist()]
            groups = packing.split_packed_by_tokens(lengths, max_token_len, self.seq_multiple)
            index_sets = [torch.tensor(g, dtype=torch.long) for g in groups]
        else:
            index_sets = [torch.arange(n)[s] for s in split_rows(n, micro_batch_size)]
        out = []
        for idx in index_sets:
            data = {k: v[idx] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            rows = packing.pack_rows(data, self.seq_multiple, self.torch_device)
            response_index = self._response_index(data)
            data = {k: from_host(v, self.torch_device) for k, v in data.items()}
            out.append(
                MicroBatch(
                    rows.tokens, rows.position_ids, rows.gather_index, data, idx, rows.params, response_index
                )
            )
        return out

    def _response_index(self, data: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """`MicroBatch.response_index` of a micro-batch's rows as given (on the host, where the batch comes
        from), on this engine's device; None for rows without a response mask."""
        mask = data.get("response_mask")
        if mask is None:
            return None
        return from_host(torch.nonzero(mask.reshape(-1).bool()).squeeze(1), self.torch_device)

    def rows_in_order(
        self,
        micro_batches: list[MicroBatch],
        outputs: list[dict[str, torch.Tensor]],
        key: str,
        row_shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Per-micro-batch outputs `key` ([b_i, *row_shape], last pipeline stage) as one CPU tensor in the
        original row order, on every pipeline stage."""
        n = sum(int(mb.rows.numel()) for mb in micro_batches)
        local = None
        if self.is_last_stage:
            local = torch.empty((n, *row_shape), dtype=dtype, device=self.torch_device)
            rows = torch.cat([mb.rows for mb in micro_batches]).to(self.torch_device)
            local[rows] = torch.cat([o[key].to(dtype) for o in outputs], 0)
        return self.broadcast_from_last_stage(local, (n, *row_shape), dtype).cpu()

    # --------------------------------------------------------------------------------- loss weights
    def check_equal_rows(self, n: int) -> None:
        """Every DP rank must hold the same number of rows: each mini-batch ends in a collective optimizer
        step, so a rank with more mini-batches would wait forever."""
        if self.dp_size == 1:
            return
        t = torch.tensor([n, -n], dtype=torch.float64, device=self.torch_device)
        torch.distributed.all_reduce(
            t, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_data_parallel_group()
        )
        if int(t[0]) != -int(t[1]):
            raise ValueError(
                f"data-parallel ranks hold different numbers of rows ({int(-t[1])}..{int(t[0])}); the "
                "batch must split evenly over the data-parallel ranks"
            )

    def global_loss_totals(self, response_masks: list[torch.Tensor]) -> list[tuple[float, float]]:
        """(valid response tokens, rows) of each mini-batch (its response mask) summed over all data-parallel
        ranks: counted on the host (the batch is the controller's host copy) and, with DP ranks, all-reduced
        in one call for the whole update, so no mini-batch waits for the device to finish the one before."""
        local = [
            # Rows without a valid token are left out of the seq-mean modes (algorithms.agg_loss).
            [float(mask.sum()), float((mask.sum(-1) > 0).sum())]
            for mask in response_masks
        ]
        if self.dp_size > 1 and local:
            t = torch.tensor(local, dtype=torch.float64, device=self.torch_device)
            torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
            local = t.cpu().tolist()
        return [(max(tokens, 1.0), max(rows, 1.0)) for tokens, rows in local]

    def micro_batch_weight(
        self, response_mask: torch.Tensor, loss_agg_mode: str, totals: tuple[float, float]
    ) -> torch.Tensor:
        """Factor (an fp32 scalar tensor on the mask's device: no host read between a micro-batch's forward
        and its backward) that turns a micro-batch's own aggregated loss into its share of the mini-batch
        loss aggregated over all DP ranks at once.

        token-mean: the micro-batch's token-mean x its tokens / all tokens of the mini-batch (every DP
        rank); seq-mean-*: its row mean x its rows / all rows. Times dp: megatron DDP averages gradients
        over the DP ranks, and the global mean is their sum. (run_schedule undoes megatron's division by
        the number of micro-batches.) The mini-batch gradient is then independent of how rows are split
        into micro-batches and over DP ranks, however uneven their token counts.
        """
        tokens, rows = totals
        # Counted in fp64 and rounded once to fp32: the value a Python float weight had inside the product.
        if loss_agg_mode == "token-mean":
            share = response_mask.sum(dtype=torch.float64) / tokens
        else:
            share = (response_mask.sum(-1) > 0).sum(dtype=torch.float64) / rows
        return (share * self.dp_size).float()

    # --------------------------------------------------------------------------------- schedules
    def run_schedule(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        forward_only: bool,
    ) -> list[dict[str, torch.Tensor]]:
        """Run megatron's forward(/backward) schedule over micro-batches; return the loss_fn outputs
        (non-empty on the last pipeline stage only), in micro-batch order.

        loss_fn(mb, output [b, L, V/tp or 1]) -> (scalar loss of this micro-batch, detached outputs).
        The loss is multiplied by the number of micro-batches here because megatron divides by it. With
        context parallel the output is the whole sequence gathered over the CP group, or this rank's own
        [b, L / CP, ...] part for a `context_parallel.CpLocalLoss`.
        """
        num_mb = len(micro_batches)
        chunks = self.chunks
        # Keep a 16-bit model's last-stage output in 16 bits: Float16Module would otherwise upcast the whole
        # [b, L, V/tp] logits to fp32 (2x their memory, and again for their gradient); the log-prob code
        # upcasts chunk by chunk instead.
        extra: dict[str, Any] = {"fp32_output": False} if self.config.bf16 or self.config.fp16 else {}

        moe_padding = mmodel.moe_padding_mask_supported(self.config)
        local_output = isinstance(loss_fn, cp.CpLocalLoss)

        def forward_step(data_iter: Iterator[MicroBatch], model: torch.nn.Module):
            mb = next(data_iter)
            if moe_padding and mb.packed is not None:  # the packed rows' own padding positions
                extra["padding_mask"] = mb.packed.padding_mask
            elif moe_padding:  # MoE routing statistics (load-balancing loss) without the padding columns
                extra["padding_mask"] = mmodel.moe_padding_mask(mb.tokens, mb.data["attention_mask"])
            tokens, positions = cp.split_sequence(mb.tokens), cp.split_sequence(mb.position_ids)
            if "padding_mask" in extra:
                extra["padding_mask"] = cp.split_sequence(extra["padding_mask"])
            # A packed micro-batch (one sequence [1, T]) carries megatron's THD params; a padded one none.
            packed = {} if mb.packed is None else {"packed_seq_params": mb.packed}
            output = model(input_ids=tokens, position_ids=positions, attention_mask=None, **extra, **packed)

            def loss_func(out: torch.Tensor):
                # Context parallel: a CpLocalLoss takes this rank's own chunks and sums its per-token results
                # over the CP group (no rank holds the whole sequence's logits); other losses see the whole
                # sequence, gathered from every CP rank.
                loss, extra = loss_fn(mb, out if local_output else cp.gather_sequence(out))
                return loss * num_mb, extra

            return output, loss_func

        fb = get_forward_backward_func()
        # The whole sequence's length: megatron's pipeline schedules divide it by CP (and by TP with sequence
        # parallel) for the shape of the activations sent between stages.
        max_len = max(mb.tokens.shape[1] for mb in micro_batches)
        iters: Any = [iter(micro_batches) for _ in chunks]
        if len(chunks) == 1:
            iters = iters[0]
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        # A pass stacks each MoE layer's expert weights once for all its micro-batches (a training pass's
        # optimizer step, which changes them, comes after; moe_experts.ExpertUpdate.cache). A forward-only
        # pass too: restacking per micro-batch cost host time the log-prob passes of qwen3-moe were bound by
        # (docs/benchmarks.md); the bench switch `passstacks` times that way.
        per_micro_batch = forward_only and fused.bench_off("passstacks")
        stacks = contextlib.nullcontext() if per_micro_batch else cached_expert_stacks()
        with grad_ctx, stacks:
            return fb(
                forward_step_func=forward_step,
                data_iterator=iters,
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=num_mb,
                seq_length=max_len,
                micro_batch_size=micro_batches[0].tokens.shape[0],
                forward_only=forward_only,
            )

    def broadcast_from_last_stage(
        self, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Give every pipeline stage the tensor computed on the last stage."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            assert tensor is not None
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=self.torch_device)
        tensor = tensor.to(self.torch_device).contiguous()
        torch.distributed.broadcast(
            tensor,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return tensor

    def reduce_metrics(self, sums: dict[str, float], count: int, names: list[str]) -> dict[str, float]:
        """Mean of per-micro-batch metrics: from the last stage to all stages, then across DP ranks."""
        vals = torch.tensor([sums[k] for k in names] + [float(count)], dtype=torch.float64)
        vals = self.broadcast_from_last_stage(
            vals if self.is_last_stage else None, (len(names) + 1,), torch.float64
        ).cpu()
        if self.dp_size > 1:
            group = parallel_state.get_data_parallel_group()
            t = vals.to(self.torch_device)
            torch.distributed.all_reduce(t, group=group)
            vals = t.cpu()
        n = max(vals[-1].item(), 1.0)
        return {k: vals[i].item() / n for i, k in enumerate(names)}

    def train(self) -> None:
        for c in self._chunks:
            c.train()

    def eval(self) -> None:
        for c in self._chunks:
            c.eval()

    def seed_update(self, step: int | None) -> int:
        """Start the random streams of the update of training step `step` and return the step: dropout
        (torch's generator and megatron's model-parallel tracker) is reseeded from (seed, step, "dropout"),
        so a resumed run draws what the uninterrupted run drew whatever ran before it in this process.
        None (engines outside a run): the engine's next update (`PlanLrSchedule.next_update_step`)."""
        if step is None:
            step = self.lr_scheduler.next_update_step()
        seed_parallel_rng(derive_seed(self.seed, step, DROPOUT))
        return step

    def iter_mini_batches(
        self, batch: dict[str, torch.Tensor], shuffle: bool, step: int
    ) -> Iterator[tuple[dict[str, torch.Tensor], list[MicroBatch], tuple[float, float]]]:
        """The mini-batches of one update on this rank, as the plan's BatchPlan schedules them: ppo_epochs
        passes over the rows (a permutation per pass when `shuffle`, from the stream (seed, step,
        "shuffle")), each mini-batch `responses_per_mini_batch_per_rank` rows, cut into micro-batches of
        `micro_batch_size_per_rank` rows or by the `max_token_len_per_micro_batch` budget. Yields
        (mini-batch rows, its micro-batches, its DP-wide loss totals for `micro_batch_weight`)."""
        plan = self.spec.batch
        assert plan is not None, f"{self.spec.role}: an update needs the plan's batch schedule"
        n = batch["input_ids"].shape[0]
        mini = plan.responses_per_mini_batch_per_rank
        gen = torch.Generator().manual_seed(derive_seed(self.seed, step, SHUFFLE))
        schedule = []
        for _ in range(plan.ppo_epochs):
            order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
            schedule += [order[m0 : m0 + mini] for m0 in range(0, n, mini)]
        totals = self.global_loss_totals([batch["response_mask"][rows] for rows in schedule])
        for rows, mini_batch_totals in zip(schedule, totals, strict=True):
            mini_batch = {k: v[rows] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            mbs = self.micro_batches(
                mini_batch,
                plan.micro_batch_size_per_rank or 0,
                plan.use_dynamic_bsz,
                plan.max_token_len_per_micro_batch or 0,
                packed=self.spec.settings.remove_padding,
            )
            yield mini_batch, mbs, mini_batch_totals

    def forward_micro_batches(self, batch: dict[str, torch.Tensor]) -> list[MicroBatch]:
        """Micro-batches of a forward-only pass (log-probs, values, reward scores), as the plan sizes them."""
        s = self.spec
        return self.micro_batches(
            batch,
            s.forward_micro_batch_size,
            s.forward_use_dynamic_bsz,
            s.forward_max_token_len or 0,
            packed=s.remove_padding,
        )

    def begin_update(self, step: int | None) -> tuple[int, float]:
        """Start the update of training step `step` (None outside a run: the engine's next update): seed its
        random streams (`seed_update`) and set the plan's lr of that step on the optimizer. Returns (step,
        lr)."""
        assert self.lr_scheduler is not None, f"{self.spec.role}: this engine was built without an optimizer"
        if step is None:
            step = self.lr_scheduler.next_update_step()
        self.seed_update(step)
        return step, self.lr_scheduler.apply(step)

    def optimizer_step_on(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        names: list[str],
    ) -> StepOutcome:
        """One optimizer step over one mini-batch's micro-batches: forward+backward through the schedule and
        the step (`optimizer_step`: not applied when the loss `names[0]` of a micro-batch or the gradient
        norm is not finite). Nothing is read back to the host here (`read_steps` reads an update's steps
        at once)."""
        outs = self.run_schedule(micro_batches, loss_fn, forward_only=False)
        # Outputs exist on the last pipeline stage only; optimizer_step agrees on them with every rank.
        values = self._metric_values(outs, names)
        loss_finite = torch.isfinite(values[:, 0]).all()
        applied, grad_norm = self.optimizer_step(loss_finite)
        return StepOutcome(values, grad_norm, applied)

    def _metric_values(self, outs: list[dict[str, torch.Tensor]], names: list[str]) -> torch.Tensor:
        """The micro-batches' metrics `names` as one [micro-batches, names] fp64 tensor on the device."""
        device = self.torch_device
        values = [
            torch.as_tensor(o[k]).detach().to(device, torch.float64).reshape(()) for o in outs for k in names
        ]
        if not values:
            return torch.empty(0, len(names), dtype=torch.float64, device=self.torch_device)
        return torch.stack(values).view(len(outs), len(names))

    def read_steps(self, steps: list[StepOutcome], names: list[str], sums: dict[str, float]) -> StepTotals:
        """An update's optimizer steps read back in one copy (a read per step would make the host wait for
        the device at every step): each micro-batch's metrics added into `sums` in order, the steps' gradient
        norms, how many were not applied and how many micro-batch outputs were counted."""
        if not steps:
            return StepTotals([], 0, 0)
        parts = [
            t for s in steps for t in (s.values.reshape(-1), s.grad_norm.reshape(1), s.applied.reshape(1))
        ]
        host = torch.cat([t.to(self.torch_device, torch.float64) for t in parts]).cpu().tolist()
        grad_norms, skipped, count, at = [], 0, 0, 0
        for s in steps:
            rows, width = s.values.shape
            for r in range(rows):
                for k, v in zip(names, host[at + r * width : at + (r + 1) * width], strict=True):
                    sums[k] += v
            at += rows * width
            grad_norms.append(host[at])
            skipped += host[at + 1] == 0.0
            count += rows
            at += 2
        return StepTotals(grad_norms, skipped, count)

    def optimizer_step(self, loss_finite: torch.Tensor | bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on the accumulated gradients; returns (applied, grad_norm) as 0-dim tensors.

        The divergence guard: the step is not applied (the weights and the optimizer state stay as they
        were) when megatron's own check finds inf / NaN in the gradients (`prepare_grads`: the fp16 loss
        scaler's found_inf), when megatron's gradient norm is not finite, or when `loss_finite` is False on
        any rank. megatron's `step()` has no such check for bf16 / fp32 (a NaN norm even slips through
        its clipping, as `clip_coeff < 1` is False for NaN), so the step is ChainedOptimizer.step's body
        with the check between the norm and the update. Every rank of this engine decides together (one
        all-reduce of a flag), so no replica steps while another does not; with torch's fused Adam the
        decision stays on the device (`model.guarded_optimizer_step`)."""
        assert self._optimizer is not None, "this engine was built without an optimizer"
        self.reload()
        flag = torch.as_tensor(loss_finite, device=self.torch_device)
        return mmodel.guarded_optimizer_step(self._optimizer, flag, self.torch_device)

    def weights_finite(self) -> bool:
        """Whether every parameter of this rank is finite (offloaded parameters are brought back first)."""
        with torch.no_grad():
            return all(bool(torch.isfinite(p).all()) for c in self.chunks for p in c.parameters())

    def zero_grad(self) -> None:
        assert self._optimizer is not None, "this engine was built without an optimizer"
        self.reload()
        for c in self._chunks:
            c.zero_grad_buffer()
        self._optimizer.zero_grad()

    def current_lr(self) -> float:
        assert self._optimizer is not None, "this engine was built without an optimizer"
        # param_groups hold python numbers only: no need to reload offloaded state to read them.
        return float(self._optimizer.param_groups[0]["lr"])
