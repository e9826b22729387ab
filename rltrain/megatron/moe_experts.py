"""Routed experts computed with grouped GEMM (`model.moe_grouped_gemm`): all local experts of a MoE layer in
three grouped matrix products forward and five backward, instead of megatron's SequentialMLP loop of two
linears (and their kernel launches) per expert.

Why our own: megatron's GroupedMLP needs the CUDA-only `grouped_gemm` package and TEGroupedMLP Transformer
Engine, neither of which installs here, while torch ships `torch._grouped_mm` (bf16, CUDA sm90+), which has
no backward we can rely on across the torch versions in use (2.11 on the GPU machine, 2.13 here). An H200
measurement of one Qwen3-MoE-shaped layer put the grouped kernel at 5.1 ms against SequentialMLP's 33.6 ms;
bench/moe_experts_gpu.py times forward + backward of both modules.

Layout: `GroupedGemmExperts` *is* a SequentialMLP (same submodules, parameter names, sharded state dict,
HF mapping, expert marking and offload): only `forward` differs. Each call stacks the local experts' fc1
[2F, H] and fc2 [H, F] weights into [E, 2F, H] / [E, H, F] (a copy of the layer's expert weights, through
autograd, so gradients land in each expert's own parameter as before) and runs `GroupedSwiGLU`. The stack
is the price of keeping the checkpoint layout; it is included in the benchmark.

`GroupedSwiGLU` is one autograd.Function: y_e = ((silu(x_e G_e^T) * x_e U_e^T) * p) W2_e^T for the rows
x_e of expert e (rows sorted by expert, `tokens_per_expert` of them each; [G; U] = fc1 as megatron fuses
it), p the routing probability of each row, multiplied in megatron's order and dtype (`MLP.forward`). The
backward is written out (dx, dW1, dW2, dp). The products go through `grouped_mm` / `grouped_mm_weight`:
`torch._grouped_mm` for bf16 on CUDA, else a per-expert loop of the same products, so the CPU tests run
this Function's forward and backward too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


def _use_grouped_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


Groups = list[int] | torch.Tensor
"""Row groups of a grouped product: a list of row counts, or their cumulative offsets as an int32 tensor on
the rows' device (the last one the row count), which the CUDA kernel takes without any host read."""


def _offsets(groups: Groups, device: torch.device) -> torch.Tensor:
    if isinstance(groups, torch.Tensor):
        return groups
    return torch.tensor(groups, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def _counts(groups: Groups) -> list[int]:
    if isinstance(groups, torch.Tensor):  # (the CPU loop: a host read of the offsets)
        ends = groups.tolist()
        return [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    return groups


def grouped_mm(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Rows of `a` [M, K] in consecutive `groups` (sum M) times their group's `b` [G, K, N]: [M, N]."""
    if _use_grouped_kernel(a):
        return torch._grouped_mm(a, b, offs=_offsets(groups, a.device))
    out = a.new_zeros((a.shape[0], b.shape[2]))
    start = 0
    for g, n in enumerate(_counts(groups)):
        if n:
            out[start : start + n] = a[start : start + n] @ b[g]
        start += n
    return out


def grouped_mm_weight(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Per group g: a[:, rows_g] @ b[rows_g] for `a` [M, K_total], `b` [K_total, N] (rows in consecutive
    `groups`): [G, M, N] (weight gradients; an empty group gives zeros)."""
    if _use_grouped_kernel(a):
        return torch._grouped_mm(a, b, offs=_offsets(groups, a.device))
    counts = _counts(groups)
    out = a.new_zeros((len(counts), a.shape[0], b.shape[1]))
    start = 0
    for g, n in enumerate(counts):
        if n:
            out[g] = a[:, start : start + n] @ b[start : start + n]
        start += n
    return out


class GroupedSwiGLU(torch.autograd.Function):
    """All experts' gated MLP over expert-sorted rows; see the module docstring for the math."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, probs: torch.Tensor, counts: Groups
    ) -> torch.Tensor:
        # w1 [E, 2F, H], w2 [E, H, F]; the transposed views are what the products take (no copy).
        h = grouped_mm(x, w1.transpose(1, 2), counts)  # [M, 2F]
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up
        scaled = (act * probs.unsqueeze(-1)).to(act.dtype)
        ctx.save_for_backward(x, w1, w2, probs, h)
        ctx.counts = counts
        return grouped_mm(scaled, w2.transpose(1, 2), counts)  # [M, H]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w1, w2, probs, h = ctx.saved_tensors
        counts = ctx.counts
        dy = dy.contiguous()
        # Elementwise gradients in at least fp32 (16-bit activations are upcast, float64 stays).
        wide = torch.promote_types(h.dtype, torch.float32)
        gate, up = (t.to(wide) for t in h.chunk(2, dim=-1))
        sig = torch.sigmoid(gate)
        silu = gate * sig
        act = (F.silu(gate.to(h.dtype)) * up.to(h.dtype)).to(wide)  # the forward's activation, its rounding
        scaled = (act * probs.unsqueeze(-1)).to(h.dtype)
        dw2 = grouped_mm_weight(dy.t(), scaled, counts)  # [E, H, F]
        dscaled = grouped_mm(dy, w2, counts).to(wide)  # [M, F]
        dprobs = (dscaled * act).sum(-1).to(probs.dtype)
        dact = dscaled * probs.to(wide).unsqueeze(-1)
        dgate = dact * up * (sig * (1 + gate * (1 - sig)))
        dup = dact * silu
        dh = torch.cat([dgate, dup], dim=-1).to(h.dtype)  # [M, 2F]
        dw1 = grouped_mm_weight(dh.t(), x, counts)  # [E, 2F, H]
        dx = grouped_mm(dh, w1, counts)  # [M, H]
        return dx, dw1, dw2, dprobs, None


class GroupedGemmExperts(SequentialMLP):
    """megatron's SequentialMLP (parameters, checkpoints, HF names unchanged) whose forward runs every local
    expert through `GroupedSwiGLU` (SwiGLU experts without bias, as all families here have)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        if not (cfg.gated_linear_unit and cfg.activation_func is F.silu and not cfg.add_bias_linear):
            raise ValueError("grouped-GEMM experts compute SwiGLU experts without bias")
        if cfg.activation_func_clamp_value is not None or cfg.glu_linear_offset != 0.0:
            raise ValueError("grouped-GEMM experts take no GLU clamp or offset")

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        if self.config.moe_apply_probs_on_input or self.config.fp8 or self.config.fp4:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        groups: Groups
        if _use_grouped_kernel(x) and tokens_per_expert.device == x.device:
            groups = tokens_per_expert.cumsum(0).to(torch.int32)  # the kernel reads them on the device
        else:
            groups = [int(n) for n in tokens_per_expert.tolist()]
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])
        out = GroupedSwiGLU.apply(x.reshape(-1, x.shape[-1]), w1, w2, permuted_probs, groups)
        return out.view(*x.shape[:-1], out.shape[-1]), None


__all__ = ["GroupedGemmExperts", "GroupedSwiGLU", "Groups", "grouped_mm", "grouped_mm_weight"]
