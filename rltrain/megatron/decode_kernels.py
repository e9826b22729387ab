"""Handwritten Triton kernels of the CUDA-graph decode step (issue 36: decode speed).

Why: a captured decode step is bound by its kernel count, not its bytes (~500 kernels per step for the dense
1.5B, ~950 for qwen3-moe, each a few microseconds). torch.compile emits the attention inputs of one layer
(`fused.decode_attention_inputs`: split of megatron's unsplit QKV, Qwen3's per-head q/k RMSNorm, RoPE,
cache write) as five to seven Triton kernels; `attention_inputs` here is all of it in one launch.

`fused.decode_attention_inputs` stays the reference (and the CPU path); `KVCacheGenerator` takes this one
only on CUDA with the plan's fused kernels and where `unsupported` names no reason (inference.py). Triton
is imported guarded: CPU machines (no triton package) import this module and get the reason instead.
"""

from __future__ import annotations

import torch

try:  # triton ships with torch's CUDA wheels; CPU installs have none (and must not add it)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Dtypes the kernel stores (the model's params dtype): it computes in fp32 and rounds once per output.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# One program holds one KV group's query heads, key and value ([q_per_group + 2, head_dim], padded to powers
# of two) in registers (Qwen3-MoE's 10 x 128 pads to 2,048): a bound on that, not a measured limit; larger
# groups keep the compiled function.
MAX_TILE = 8192


def unsupported(
    device: torch.device, dtype: torch.dtype, head_dim: int, q_per_group: int, rot: int
) -> str | None:
    """Why `attention_inputs` cannot serve a layer of these shapes (None: it can): rot is the rotary
    dimension (cos / sin's last), at most head_dim and even (megatron's half rotation)."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (the kernel stores {', '.join(str(d) for d in DTYPES)})"
    if not (0 < rot <= head_dim and rot % 2 == 0):
        return f"rotary dimension {rot} with head dimension {head_dim} (needs an even one, at most d)"
    if q_per_group < 1:
        return f"{q_per_group} query heads per KV group"
    tile = next_power_of_2(q_per_group + 2) * next_power_of_2(head_dim)
    if tile > MAX_TILE:
        return f"a group's tile of {tile} elements (at most {MAX_TILE} in one program's registers)"
    if device.type != "cuda":
        return f"device {device.type} (the Triton kernel runs on CUDA)"
    if triton is None:
        return "triton is not installed"
    return None


def next_power_of_2(x: int) -> int:
    """The smallest power of two >= x (triton.next_power_of_2, also where triton is absent)."""
    return 1 << max(x - 1, 0).bit_length()


def attention_inputs(
    mixed: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    col: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """`fused.decode_attention_inputs` (the same arguments and result: the rotated query [n, heads, d], k
    and v written into column `col` of the caches) as one Triton kernel; inference only (no autograd).

    The column is read on the device (a CUDA graph replays it), so nothing here syncs with the host. The
    grid is (row, KV group): each program loads its group's slice of `mixed` ([q_per_group + 2] heads of
    d), norms the query heads and the key (RMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * w, as
    `F.rms_norm`), rotates them (`fused.rotate`: the first rot columns, half rotation, the rest passed
    through) and stores the query heads, the key and the raw value.

    Numerics: fp32 from the loads to the stores, one rounding per output, i.e. within half an ulp of the
    exact math (bench/decode_tail_gpu.py --only-triton-inputs asserts it against fp64). That is what
    torch.compile computes where inductor fuses the ops (it elides the bf16 casts between them); where it
    stores the normed q / k between two kernels it rounds there too. `decode_attention_inputs` run eagerly
    (megatron's modules) rounds after the norm, each RoPE product and their sum, so against it outputs
    differ by about an ulp of the products (more than an ulp of an output that cancels to near zero).
    Values are copied exactly."""
    assert triton is not None, "triton is not installed (decode_kernels.unsupported)"
    n, groups, width = mixed.shape
    d = k_cache.shape[-1]
    per_group = width // d - 2
    rot = cos.shape[-1]
    assert width == (per_group + 2) * d and cos.shape == sin.shape == (n, 1, rot), (mixed.shape, cos.shape)
    assert k_cache.shape[1:] == v_cache.shape[1:] == (n, groups, d), (k_cache.shape, v_cache.shape)
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1, "the caches' head dimension is contiguous"
    # Contiguous along d (free when they are: the QKV projection's output, the step's cos / sin rows).
    mixed, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (mixed, cos, sin))
    query = torch.empty((n, groups * per_group, d), dtype=mixed.dtype, device=mixed.device)
    if n == 0:
        return query
    block_h, block_d = next_power_of_2(per_group + 2), next_power_of_2(d)
    _kernel[(n, groups)](
        mixed, cos, sin, k_cache, v_cache, col,
        # Absent norm weights: any pointer (the kernel's HAS_* switches never read it).
        mixed if q_norm is None else q_norm, mixed if k_norm is None else k_norm, query,
        mixed.stride(0), mixed.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        query.stride(0), float(eps),
        P=per_group, D=d, ROT=rot, BLOCK_H=block_h, BLOCK_D=block_d,
        HAS_QN=q_norm is not None, HAS_KN=k_norm is not None,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )  # fmt: skip
    return query


if triton is not None:

    @triton.jit
    def _kernel(
        mixed_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, col_ptr, qw_ptr, kw_ptr, out_ptr,
        m_row, m_group, c_row, s_row,
        k_col, k_row, k_group, v_col, v_row, v_group,
        o_row, eps,
        P: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_QN: tl.constexpr, HAS_KN: tl.constexpr,
    ):  # fmt: skip
        """One (row, KV group): heads h < P are its queries, h == P its key, h == P + 1 its value."""
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        j = tl.arange(0, BLOCK_D)[None, :]
        half = ROT // 2
        in_d = j < D
        in_rot = j < ROT
        live = (h < P + 2) & in_d
        # rotate's cat((-x2, x1)): column j < rot/2 takes -x[j + rot/2], rot/2 <= j < rot takes x[j - rot/2].
        partner = tl.where(j < half, j + half, tl.where(in_rot, j - half, j))
        sign = tl.where(j < half, -1.0, 1.0)
        src = mixed_ptr + row * m_row + group * m_group + h * D
        x = tl.load(src + j, mask=live, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=live & in_rot, other=0.0).to(tl.float32)
        if HAS_QN or HAS_KN:
            # F.rms_norm: fp32 mean of squares over d (padding loads 0), (x * rstd) * w, one rounding later.
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            if HAS_QN:
                w = tl.load(qw_ptr + j, mask=in_d, other=0.0).to(tl.float32)
                wp = tl.load(qw_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
                x = tl.where(h < P, x * rstd * w, x)
                xp = tl.where(h < P, xp * rstd * wp, xp)
            if HAS_KN:
                w = tl.load(kw_ptr + j, mask=in_d, other=0.0).to(tl.float32)
                wp = tl.load(kw_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
                x = tl.where(h == P, x * rstd * w, x)
                xp = tl.where(h == P, xp * rstd * wp, xp)
        c = tl.load(cos_ptr + row * c_row + j, mask=in_rot, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + row * s_row + j, mask=in_rot, other=0.0).to(tl.float32)
        # rotate: x * cos + cat((-x2, x1)) * sin on the first rot columns, queries and key only.
        y = tl.where(in_rot & (h <= P), x * c + (sign * xp) * s, x)
        col = tl.load(col_ptr)
        # Every lane its own pointer, so the cache stores take the tile's [BLOCK_H, BLOCK_D] shape.
        flat = j + h * 0
        tl.store(
            out_ptr + row * o_row + (group * P + h) * D + j,
            y.to(out_ptr.dtype.element_ty),
            mask=(h < P) & in_d,
        )
        tl.store(
            k_ptr + col * k_col + row * k_row + group * k_group + flat,
            y.to(k_ptr.dtype.element_ty),
            mask=(h == P) & in_d,
        )
        tl.store(
            v_ptr + col * v_col + row * v_row + group * v_group + flat,
            y.to(v_ptr.dtype.element_ty),
            mask=(h == P + 1) & in_d,
        )
