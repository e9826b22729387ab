"""megatron's gradient accumulation fusion served by torch's own products: each trained linear's weight
gradient is accumulated into its fp32 `main_grad` by the product itself (C += A B), not written in the
activations' dtype and then added by DDP's hook.

Why: without apex's `fused_weight_gradient_mlp_cuda` megatron writes every weight gradient in bf16 and
DDP's per-parameter hook adds it into the fp32 main_grad: per micro-batch and weight, a bf16 write, a
bf16 read and an fp32 read and write besides the product (~0.6 s of a 1.5B update's 9.6 s of device time
on the H200 were those adds and their conversions, docs/benchmarks.md), and a gradient rounded to bf16
before it is summed. Here megatron's own fused path (`LinearWithGradAccumulationAndAsyncCommunication`,
`grad_added_to_main_grad`, the dummy gradient DDP's hook skips, `zero_out_wgrad` for a tied embedding)
runs with `wgrad_gemm_accum_fp32` = `torch.addmm` into the main_grad with an fp32 result on CUDA.

`use_fused_wgrad(chunks)` turns it on for the linears of DDP-wrapped chunks whose weight has a main_grad:
the flag is set per layer after DDP gave the weights their main_grads (a layer built with the flag but
run without DDP would fail in its backward), so the config's `gradient_accumulation_fusion` stays off.
"""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch


def accumulate_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output [T, out]^T @ total_input [T, in] (apex's `wgrad_gemm_accum_*`):
    one product accumulating into main_grad in its dtype where torch has one (same dtypes, or CUDA's
    `addmm` with an fp32 result), else the product added."""
    a = grad_output.t()
    if a.dtype == main_grad.dtype:
        main_grad.addmm_(a, total_input)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, a, total_input, out_dtype=main_grad.dtype, out=main_grad)
    else:  # CPU has no mixed-dtype addmm
        main_grad.add_(a @ total_input)


SHIM = types.SimpleNamespace(wgrad_gemm_accum_fp32=accumulate_wgrad, wgrad_gemm_accum_fp16=accumulate_wgrad)
"""What megatron's tensor_parallel.layers calls as `fused_weight_gradient_mlp_cuda` (apex's module)."""


def use_fused_wgrad(chunks: Iterable[torch.nn.Module]) -> int:
    """Accumulate the weight gradients of the chunks' megatron linears (Column/RowParallelLinear whose
    weight is trained and has a DDP main_grad) in their products; returns how many layers. Where apex is
    installed its module is kept."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = SHIM
    fused = 0
    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, layers.ColumnParallelLinear | layers.RowParallelLinear):
                continue
            weight = getattr(module, "weight", None)
            if weight is not None and weight.requires_grad and hasattr(weight, "main_grad"):
                module.gradient_accumulation_fusion = True
                fused += 1
    return fused
