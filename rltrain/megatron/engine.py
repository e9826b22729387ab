"""Shared machinery of the megatron roles (actor, critic): model + optimizer ownership, batch layout,
micro-batching and running megatron's forward/backward schedules on this rank's data.

Batch layout (a dict of tensors, one data-parallel rank's share; every TP/PP rank of the same DP rank gets
the same batch): `input_ids`, `attention_mask`, `position_ids` [B, S] hold prompt + response;
`responses`, `response_mask` [B, R]. Each row's valid tokens must be contiguous (left-padded prompt +
right-padded response as in verl, or a fully right-padded row); the response is the last
`response_mask.sum()` valid tokens of the row. Before the forward every row is shifted so that its valid
tokens start at position 0: megatron's RoPE uses positions 0..S-1 regardless of `position_ids`, and a
right-aligned causal batch then needs no attention mask (SDPA's causal fast path).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from rlconf.config import MegatronConfig, ModelArch, ModelConfig, Optim
from rltrain.megatron import model as mmodel
from rltrain.megatron.cpu_compat import device_context
from rltrain.megatron.hf_weights import arch_from_hf, load_hf_weights
from rltrain.megatron.parallel import init_parallel


@dataclass
class MicroBatch:
    """One micro-batch in aligned layout plus where each response token's prediction lives."""

    tokens: torch.Tensor  # [b, L] valid tokens left-aligned, zero padded; L a multiple of TP
    position_ids: torch.Tensor  # [b, L] 0..L-1
    gather_index: torch.Tensor  # [b, R] position whose logits predict response token j
    data: dict[str, torch.Tensor]  # the original per-row tensors ([b, ...]) of this micro-batch


def _device_of(device: str) -> torch.device:
    return torch.device("cpu") if device == "cpu" else torch.device(device, torch.cuda.current_device())


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
    resp_len = resp_mask.sum(-1)
    prompt_len = valid_len - resp_len
    gather_index = (prompt_len.unsqueeze(1) - 1 + torch.arange(r).unsqueeze(0)).clamp(min=0, max=length - 1)
    positions = cols.unsqueeze(0).expand(b, -1).contiguous()
    return tokens.to(device), positions.to(device), gather_index.to(device)


def split_rows(n: int, micro_batch_size: int) -> list[slice]:
    """Consecutive row slices of at most micro_batch_size rows."""
    return [slice(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)]


def split_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy token-budget micro-batches (use_dynamic_bsz): rows in order, each batch's padded size
    (rows x longest row) stays within max_tokens (a single longer row gets its own batch)."""
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        if cur and new_longest * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, new_longest = [], n
        cur.append(i)
        longest = new_longest
    if cur:
        batches.append(cur)
    return batches


class MegatronEngine:
    """One role's megatron model chunks, optimizer and schedule runner on this rank."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        megatron_cfg: MegatronConfig,
        optim: Optim | None,
        device: str,
        total_steps: int,
        value_head: bool = False,
        arch: ModelArch | None = None,
    ) -> None:
        self.model_cfg = model_cfg
        self.megatron_cfg = megatron_cfg
        self.device = device
        if not parallel_state.model_parallel_is_initialized():
            init_parallel(megatron_cfg, device)
        self.torch_device = _device_of(device)
        if arch is None:
            arch = arch_from_hf(model_cfg.path) if model_cfg.path is not None else model_cfg.arch
        self.arch = arch
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        with self._ctx():
            self.chunks = mmodel.build_model_chunks(
                arch, model_cfg, megatron_cfg, device, value_head=value_head
            )
            if model_cfg.path is not None:
                # Before the optimizer: it copies fp32 main params from the model weights.
                load_hf_weights(self.chunks, model_cfg.path, value_head=value_head)
            self.optimizer = None
            self.lr_scheduler = None
            if optim is not None:
                self.optimizer = mmodel.build_optimizer(self.chunks, optim, model_cfg, megatron_cfg)
                self.lr_scheduler = mmodel.build_lr_scheduler(self.optimizer, optim, total_steps)
        self.config = mmodel.unwrap(self.chunks[0]).config
        self.config.finalize_model_grads_func = finalize_model_grads
        no_sync = [c.no_sync for c in self.chunks]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if self.optimizer is not None:
            self.config.grad_scale_func = self.optimizer.scale_loss
        # Sequence parallel splits the sequence over TP ranks: lengths must divide evenly.
        self.seq_multiple = self.tp_size if self.config.sequence_parallel else 1

    # --------------------------------------------------------------------------------- helpers
    def _ctx(self) -> contextlib.AbstractContextManager[None]:
        """Context for every call into megatron: the CUDA->CPU rewrite mode on cpu, nothing on GPU."""
        return device_context(self.device)

    @property
    def is_last_stage(self) -> bool:
        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    def modules(self) -> list[torch.nn.Module]:
        """The bare GPTModel of each chunk (`.sharded_state_dict()` for checkpoints)."""
        return [mmodel.unwrap(c) for c in self.chunks]

    def micro_batches(
        self,
        batch: dict[str, torch.Tensor],
        micro_batch_size: int,
        use_dynamic_bsz: bool = False,
        max_token_len: int = 0,
    ) -> list[MicroBatch]:
        """Split this rank's batch into aligned micro-batches (fixed row count or token budget)."""
        n = batch["input_ids"].shape[0]
        if use_dynamic_bsz:
            lengths = batch["attention_mask"].sum(-1).tolist()
            groups = split_by_tokens([int(x) for x in lengths], max_token_len)
            index_sets = [torch.tensor(g) for g in groups]
        else:
            index_sets = [torch.arange(n)[s] for s in split_rows(n, micro_batch_size)]
        # The interleaved (virtual pipeline) schedule assumes one activation shape for all micro-batches.
        min_length = int(batch["attention_mask"].sum(-1).max()) if len(self.chunks) > 1 else 1
        out = []
        for idx in index_sets:
            data = {k: v[idx] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            tokens, positions, gather_index = align_batch(
                data, self.seq_multiple, self.torch_device, min_length
            )
            data = {k: v.to(self.torch_device) for k, v in data.items()}
            out.append(MicroBatch(tokens, positions, gather_index, data))
        return out

    def run_schedule(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        forward_only: bool,
    ) -> list[dict[str, torch.Tensor]]:
        """Run megatron's forward(/backward) schedule over micro-batches; return the loss_fn outputs
        (non-empty on the last pipeline stage only).

        loss_fn(mb, output [b, L, V/tp or 1]) -> (scalar loss of this micro-batch, detached outputs).
        The loss is multiplied by the number of micro-batches here because megatron divides by it.
        """
        num_mb = len(micro_batches)

        def forward_step(data_iter: Iterator[MicroBatch], model: torch.nn.Module):
            mb = next(data_iter)
            output = model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None)

            def loss_func(out: torch.Tensor):
                loss, extra = loss_fn(mb, out)
                return loss * num_mb, extra

            return output, loss_func

        fb = get_forward_backward_func()
        max_len = max(mb.tokens.shape[1] for mb in micro_batches)
        iters: Any = [iter(micro_batches) for _ in self.chunks]
        if len(self.chunks) == 1:
            iters = iters[0]
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad_ctx:
            return fb(
                forward_step_func=forward_step,
                data_iterator=iters,
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=num_mb,
                seq_length=max_len,
                micro_batch_size=micro_batches[0].tokens.shape[0],
                forward_only=forward_only,
            )

    def broadcast_from_last_stage(
        self, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype
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
        vals = torch.tensor([sums.get(k, 0.0) for k in names] + [float(count)], dtype=torch.float64)
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
        for c in self.chunks:
            c.train()

    def eval(self) -> None:
        for c in self.chunks:
            c.eval()

    def optimizer_step(self) -> tuple[bool, float]:
        """One optimizer step on the accumulated gradients; returns (applied, grad_norm)."""
        assert self.optimizer is not None, "this engine was built without an optimizer"
        ok, grad_norm, _ = self.optimizer.step()
        return bool(ok), float(grad_norm) if grad_norm is not None else float("nan")

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()
        assert self.optimizer is not None
        self.optimizer.zero_grad()

    def current_lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])
