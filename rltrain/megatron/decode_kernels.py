"""Handwritten Triton kernels of the CUDA-graph decode step (issue 36: decode speed).

Why: a captured decode step is bound by its kernel count, not its bytes (~500 kernels per step for the dense
1.5B, ~950 for qwen3-moe, each a few microseconds). torch.compile emits the attention inputs of one layer
(`fused.decode_attention_inputs`: split of megatron's unsplit QKV, Qwen3's per-head q/k RMSNorm, RoPE,
cache write) as five to seven Triton kernels; `attention_inputs` here is all of it in one launch.

`decode_attention` is the step's attention over each row's own cache columns: cuDNN's kernel behind SDPA
reads whole 256-column buckets, prompt pads included, and every bucket the decode reaches costs a graph
capture; this one reads each key and value once per KV group, only up to the column written (~3.9 TB/s at 512
rows), so one captured graph serves a row set's whole decode.

`expert_swiglu` is a MoE layer's experts at decode sizes (fc1 with the SwiGLU in its epilogue, then fc2),
`add_rms_norm` a residual add with the RMSNorm after it.

`fused.decode_attention_inputs` and SDPA stay the references (and the CPU path); `KVCacheGenerator` takes
these kernels only on CUDA with the plan's fused kernels and where `unsupported` / `attention_unsupported`
name no reason (inference.py). Triton comes from triton_runtime, guarded: CPU machines (no triton package)
import this module and get the reason instead.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from rltrain import device as devices
from rltrain.megatron.triton_runtime import tl, triton

# Dtypes the elementwise kernels store (the model's params dtype): they compute in fp32 and round once per
# output (`attention_inputs`, `add_rms_norm`, triton_swiglu's backward).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# One program holds one KV group's query heads, key and value ([q_per_group + 2, head_dim], padded to powers
# of two) in registers (Qwen3-MoE's 10 x 128 pads to 2,048): a bound on that, not a measured limit; larger
# groups keep the compiled function.
MAX_TILE = 8192


def where_unsupported(device_type: str) -> str | None:
    """Why no Triton kernel runs on a `device_type` device (None: they can): CUDA, with triton installed.
    Each kernel's predicate ends with it (and `triton_swiglu.unsupported`)."""
    if device_type != "cuda":
        return f"device {device_type} (the Triton kernel runs on CUDA)"
    if triton is None:
        return "triton is not installed"
    return None


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
    return where_unsupported(device.type)


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
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused.decode_attention_inputs` (the same arguments and result: the rotated query [n, heads, d], k
    and v written into column `col` of the caches) as one Triton kernel; inference only (no autograd).
    The QKV projection's `bias`, where given, is added as megatron's add (the sum rounded to the
    activations' dtype) before the rest, so the projection needs no kernel of its own for it.

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
        mixed if q_norm is None else q_norm, mixed if k_norm is None else k_norm,
        mixed if bias is None else bias, query,
        mixed.stride(0), mixed.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        query.stride(0), float(eps),
        P=per_group, D=d, ROT=rot, BLOCK_H=block_h, BLOCK_D=block_d,
        HAS_QN=q_norm is not None, HAS_KN=k_norm is not None, HAS_BIAS=bias is not None,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )  # fmt: skip
    return query


if triton is not None:

    @triton.jit
    def _kernel(
        mixed_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, col_ptr, qw_ptr, kw_ptr, bias_ptr, out_ptr,
        m_row, m_group, c_row, s_row,
        k_col, k_row, k_group, v_col, v_row, v_group,
        o_row, eps,
        P: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_QN: tl.constexpr, HAS_KN: tl.constexpr, HAS_BIAS: tl.constexpr,
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
        x = tl.load(src + j, mask=live, other=0.0)
        xp = tl.load(src + partner, mask=live & in_rot, other=0.0)
        if HAS_BIAS:  # megatron's add: the sum in fp32 rounded to the activations' dtype
            b_src = bias_ptr + group * ((P + 2) * D) + h * D
            b = tl.load(b_src + j, mask=live, other=0.0).to(tl.float32)
            bp = tl.load(b_src + partner, mask=live & in_rot, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) + b).to(mixed_ptr.dtype.element_ty)
            xp = (xp.to(tl.float32) + bp).to(mixed_ptr.dtype.element_ty)
        x = x.to(tl.float32)
        xp = xp.to(tl.float32)
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


# ------------------------------------------------------------------------------ decode attention
# Cache columns per iteration of the attention kernel's loop, and the programs it aims to keep in flight: a
# step over few rows splits each row's columns into up to MAX_SPLITS parts (flash-decoding), combined by a
# second kernel, so the loads of few rows still spread over the device's SMs.
BLOCK_N = 64
PROGRAMS_PER_SM = 2
MAX_SPLITS = 16
# Launch parameters of the attention kernel (bench/decode_kernels_tune.py sweeps them on the device).
ATTENTION_WARPS = 4
ATTENTION_STAGES = 2


def attention_unsupported(
    device: torch.device, dtype: torch.dtype, head_dim: int, q_per_group: int
) -> str | None:
    """Why `decode_attention` cannot serve a layer of these shapes (None: it can)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (the kernel's products take bf16 or fp16)"
    if not 16 <= head_dim <= 256:
        return f"head dimension {head_dim} (the kernel takes 16 to 256)"
    if not 1 <= q_per_group <= 64:
        return f"{q_per_group} query heads per KV group (the kernel takes 1 to 64)"
    return where_unsupported(device.type)


def attention_splits(rows: int, groups: int, sms: int) -> int:
    """Parts each row's columns are split into: the power of two (at most MAX_SPLITS) that brings the
    programs of a step over `rows` rows and `groups` KV groups to PROGRAMS_PER_SM per SM of `sms`."""
    want = -(-PROGRAMS_PER_SM * sms // max(rows * groups, 1))
    return min(next_power_of_2(want), MAX_SPLITS)


def decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_masked: torch.Tensor,
    first: torch.Tensor,
    col: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """What `decode_attention` computes, in torch (fp32 SDPA over the whole cache, the columns a row may not
    see masked): the CPU tests run the static step's kernel path through it."""
    n, heads, d = query.shape
    cols = torch.arange(k_cache.shape[0], device=query.device)
    hidden = key_masked | (cols > col) | (cols < first[:, None])
    # Hidden columns never enter the sums (the kernel does not load them): zeros, not whatever they hold.
    k, v = (
        c.permute(1, 2, 0, 3).float().masked_fill(hidden[:, None, :, None], 0.0) for c in (k_cache, v_cache)
    )
    out = F.scaled_dot_product_attention(
        query[:, :, None].float(), k, v, attn_mask=~hidden[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.to(query.dtype).view(n, heads * d)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_masked: torch.Tensor,
    first: torch.Tensor,
    col: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one decode column over each row's own cache columns: [n, heads * d] (the query's dtype).

    query [n, heads, d]; k_cache / v_cache [max_len, n, groups, d] (the engine's sequence-first cache, the
    new column already written); key_masked [n, max_len] bool (True = hidden, SDPA's mask inverted);
    first [n] the first column a row may see and col [1] the column just written, both read on the device
    (a CUDA graph replays them). Row r attends over columns first[r]..col not hidden by key_masked: the loop
    ends at the column written, not at a bucket's end, and starts past the row's prompt pads, so the
    kernel reads the row's real keys and values only, and one captured graph serves every column.

    The grid is (row, KV group, split): one program holds its group's query heads ([q_per_group, d],
    padded to 16 rows for the tensor cores) and reads each key and value of its columns once for all of
    them (SDPA reads them once per query head). Numerics: q.k in fp32 from the stored dtype, online softmax
    in fp32 (base 2, the scale folded in), the probabilities rounded to the stored dtype for the p.v
    product (as flash attention does), fp32 accumulation, one rounding of the output."""
    assert triton is not None, "triton is not installed (decode_kernels.attention_unsupported)"
    n, heads, d = query.shape
    groups = k_cache.shape[2]
    per_group = heads // groups
    assert heads == per_group * groups and k_cache.shape[1:] == v_cache.shape[1:] == (n, groups, d), (
        query.shape,
        k_cache.shape,
        v_cache.shape,
    )
    assert key_masked.shape == (n, k_cache.shape[0]) and first.shape == (n,), (key_masked.shape, first.shape)
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and key_masked.stride(-1) == 1
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty((n, heads, d), dtype=query.dtype, device=query.device)
    if n == 0:
        return out.view(n, heads * d)
    splits = attention_splits(n, groups, devices.multiprocessor_count(query.device.type) or 1)
    block_h, block_d = max(16, next_power_of_2(per_group)), max(16, next_power_of_2(d))
    if splits > 1:
        part = torch.empty((n, heads, splits, d), dtype=torch.float32, device=query.device)
        stats = torch.empty((n, heads, splits, 2), dtype=torch.float32, device=query.device)
    else:  # the kernel writes the output itself (its SPLITS switch never touches these)
        part, stats = out, out
    _attention_kernel[(n, groups, splits)](
        query, k_cache, v_cache, key_masked.view(torch.uint8), first, col, out, part, stats,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        key_masked.stride(0), scale * 1.4426950408889634,
        P=per_group, D=d, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=BLOCK_N, SPLITS=splits,
        num_warps=ATTENTION_WARPS, num_stages=ATTENTION_STAGES,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(n, heads)](part, stats, out, D=d, BLOCK_D=block_d, SPLITS=splits, num_warps=4)
    return out.view(n, heads * d)


if triton is not None:

    @triton.jit
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, first_ptr, col_ptr, out_ptr, part_ptr, stats_ptr,
        q_row, q_head, k_col, k_row, k_group, v_col, v_row, v_group, mask_row, scale_log2,
        P: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        """One (row, KV group, split): its query heads against its share of the row's columns."""
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        h = tl.arange(0, BLOCK_H)
        j = tl.arange(0, BLOCK_D)
        in_d = j < D
        head = group * P + h
        q = tl.load(
            q_ptr + row * q_row + head[:, None] * q_head + j[None, :],
            mask=(h < P)[:, None] & in_d[None, :],
            other=0.0,
        )
        # The row's columns first..col, split into SPLITS parts of whole blocks.
        lo = tl.load(first_ptr + row).to(tl.int32)
        hi = tl.load(col_ptr).to(tl.int32) + 1
        lo = tl.minimum(lo, hi - 1) // BLOCK_N * BLOCK_N
        per = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * per
        stop = tl.minimum(start + per, hi)
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        k_base = k_ptr + row * k_row + group * k_group
        v_base = v_ptr + row * v_row + group * v_group
        for c0 in range(start, stop, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)
            hidden = tl.load(mask_ptr + row * mask_row + c, mask=c < stop, other=1)
            seen = (c < stop) & (hidden == 0)
            k = tl.load(
                k_base + c[:, None].to(tl.int64) * k_col + j[None, :],
                mask=seen[:, None] & in_d[None, :],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where(seen[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A block with no column seen keeps m at -inf: its exponentials are taken against 0 (all 0).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + c[:, None].to(tl.int64) * v_col + j[None, :],
                mask=seen[:, None] & in_d[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLITS == 1:
            o = acc / l_i[:, None]
            tl.store(
                out_ptr + (row * (P * tl.num_programs(1)) + head)[:, None] * D + j[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=(h < P)[:, None] & in_d[None, :],
            )
        else:
            at = (row * (P * tl.num_programs(1)) + head) * SPLITS + split
            tl.store(part_ptr + at[:, None] * D + j[None, :], acc, mask=(h < P)[:, None] & in_d[None, :])
            tl.store(stats_ptr + at * 2, m_i, mask=h < P)
            tl.store(stats_ptr + at * 2 + 1, l_i, mask=h < P)

    @triton.jit
    def _combine_kernel(
        part_ptr, stats_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr
    ):
        """One (row, head): its SPLITS partial sums rescaled to their common maximum and normalised."""
        at = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        s = tl.arange(0, SPLITS)
        j = tl.arange(0, BLOCK_D)
        m = tl.load(stats_ptr + (at * SPLITS + s) * 2)
        total = tl.load(stats_ptr + (at * SPLITS + s) * 2 + 1)
        m_all = tl.max(m, 0)
        w = tl.exp2(m - m_all)  # a split that saw no column has m = -inf: weight 0
        acc = tl.load(
            part_ptr + (at * SPLITS + s)[:, None] * D + j[None, :], mask=(j < D)[None, :], other=0.0
        )
        o = tl.sum(acc * w[:, None], 0) / tl.sum(total * w, 0)
        tl.store(out_ptr + at * D + j, o.to(out_ptr.dtype.element_ty), mask=j < D)


# ------------------------------------------------------------------------------ MoE experts at decode
# Rows, weight rows and reduction columns per tile of the experts' kernels. A decode step's experts hold
# a few dozen rows each: one tile of rows reads each weight once, so the kernels stream the weights (the
# bytes of the step) and skip experts that got no row.
@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """Launch parameters of one of the experts' kernels (bench/decode_kernels_tune.py sweeps them)."""

    block_n: int  # weight rows per tile
    block_k: int  # reduction columns per pipelined step
    warps: int
    stages: int


# Swept on one H200 at qwen3-moe's layer (bench/decode_kernels_tune.py, docs/benchmarks.md): at 256 tokens
# 61.8 us a layer against 87.8 with 64 x 128 tiles for both and rows of the mean; no worse at 8, 64, 512.
FC1_TILES = ExpertTiles(block_n=32, block_k=64, warps=4, stages=3)
FC2_TILES = ExpertTiles(block_n=64, block_k=64, warps=4, stages=3)
# Rows per tile: this many times the mean rows per expert (a power of two, 16 .. EXPERT_MAX_BLOCK_M). An expert
# past its tile loops over a second one, which restarts the weights' pipeline (from L2): with twice the mean
# few experts do.
EXPERT_ROWS_OVER_MEAN = 2
EXPERT_MAX_BLOCK_M = 64


def experts_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `expert_swiglu` cannot serve a model's experts (None: it can); the shapes are any (masked tiles)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (the kernel's products take bf16 or fp16)"
    return where_unsupported(device.type)


def expert_block_m(pairs: int, experts: int) -> int:
    """Rows per tile for `pairs` (token, expert) rows over `experts` experts: EXPERT_ROWS_OVER_MEAN times their
    mean per expert as a power of two, 16 to EXPERT_MAX_BLOCK_M (an expert with more loops over tiles,
    re-reading its weights from L2)."""
    mean = -(-pairs * EXPERT_ROWS_OVER_MEAN // max(experts, 1))
    return min(max(16, next_power_of_2(mean)), EXPERT_MAX_BLOCK_M)


def expert_swiglu(
    x: torch.Tensor,
    token: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    probs: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """All local experts of a MoE layer on their rows, in two Triton kernels: [M, H].

    x [T, H] the tokens, token [M] the token of each (token, expert) row in expert-major order (the first
    kernel reads x[token] itself: the dispatch writes no [M, H] copy), offsets [E] int32 the experts'
    cumulative row counts (read on the device), probs [M] each row's routing probability, w1 [E, 2F, H]
    ([gate; up] as megatron's fc1) and w2 [E, H, F] the stacked weights (`moe_decode.ExpertWeights`). The
    first kernel computes a tile of gate and up columns together and stores (silu(gate) * up) * p, so fc1's
    [M, 2F] output never goes to memory; the second is fc2. The grid is (expert, weight-row tile); an expert
    without rows returns at once, so a step over few rows reads only its experts' weights.

    Numerics: each product accumulates in fp32 and is rounded to the weights' dtype where `moe_decode`'s
    path rounds (torch._grouped_mm's outputs), and the epilogue rounds as `moe_experts.swiglu_probs` does
    (silu(gate), its product with up, the product with the fp32 probability), so the two differ by the
    products' summation order only."""
    assert triton is not None, "triton is not installed (decode_kernels.experts_unsupported)"
    (m,) = token.shape
    hidden = x.shape[1]
    experts, two_f, _ = w1.shape
    ffn = two_f // 2
    assert w1.shape == (experts, 2 * ffn, hidden) and w2.shape == (experts, hidden, ffn), (w1.shape, w2.shape)
    assert probs.shape == (m,) and offsets.shape == (experts,), (probs.shape, offsets.shape)
    x, token, w1, w2 = (t if t.is_contiguous() else t.contiguous() for t in (x, token, w1, w2))
    act = torch.empty((m, ffn), dtype=x.dtype, device=x.device)
    out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = expert_block_m(m, experts)
    one, two = FC1_TILES, FC2_TILES
    _fc1_swiglu_kernel[(experts, triton.cdiv(ffn, one.block_n))](
        x, token, w1, probs, offsets, act, hidden, ffn,
        BLOCK_M=block_m, BLOCK_N=one.block_n, BLOCK_K=one.block_k, num_warps=one.warps, num_stages=one.stages,
    )  # fmt: skip
    _grouped_kernel[(experts, triton.cdiv(hidden, two.block_n))](
        act, w2, offsets, out, ffn, hidden,
        BLOCK_M=block_m, BLOCK_N=two.block_n, BLOCK_K=two.block_k, num_warps=two.warps, num_stages=two.stages,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _expert_rows(offsets_ptr, expert):
        """The first row of `expert` and the row past its last (offsets are cumulative counts)."""
        start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
        return start, tl.load(offsets_ptr + expert)

    @triton.jit
    def _fc1_swiglu_kernel(
        x_ptr, tok_ptr, w_ptr, p_ptr, offsets_ptr, out_ptr, K, F,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One (expert, tile of F columns): gate and up of its rows (tokens x[tok]), then (silu(gate) * up) * p."""
        expert = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        start, stop = _expert_rows(offsets_ptr, expert)
        w_base = w_ptr + expert.to(tl.int64) * (2 * F) * K
        kk = tl.arange(0, BLOCK_K)
        for m0 in range(start, stop, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            row = tl.load(tok_ptr + m, mask=m < stop, other=0).to(tl.int64) * K
            gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + kk
                x = tl.load(
                    x_ptr + row[:, None] + k[None, :],
                    mask=(m < stop)[:, None] & (k < K)[None, :],
                    other=0.0,
                )
                on = (n < F)[:, None] & (k < K)[None, :]
                wg = tl.load(w_base + n[:, None] * K + k[None, :], mask=on, other=0.0)
                wu = tl.load(w_base + (F + n)[:, None] * K + k[None, :], mask=on, other=0.0)
                gate = tl.dot(x, tl.trans(wg), gate)
                up = tl.dot(x, tl.trans(wu), up)
            dt = out_ptr.dtype.element_ty
            g = gate.to(dt).to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            a = (silu * up.to(dt).to(tl.float32)).to(dt).to(tl.float32)
            p = tl.load(p_ptr + m, mask=m < stop, other=0.0).to(tl.float32)
            tl.store(
                out_ptr + m[:, None].to(tl.int64) * F + n[None, :],
                (a * p[:, None]).to(dt),
                mask=(m < stop)[:, None] & (n < F)[None, :],
            )

    @triton.jit
    def _grouped_kernel(
        x_ptr, w_ptr, offsets_ptr, out_ptr, K, N,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One (expert, tile of N columns): its rows times its weight [N, K] transposed."""
        expert = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        start, stop = _expert_rows(offsets_ptr, expert)
        w_base = w_ptr + expert.to(tl.int64) * N * K
        kk = tl.arange(0, BLOCK_K)
        for m0 in range(start, stop, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + kk
                x = tl.load(
                    x_ptr + m[:, None].to(tl.int64) * K + k[None, :],
                    mask=(m < stop)[:, None] & (k < K)[None, :],
                    other=0.0,
                )
                w = tl.load(
                    w_base + n[:, None] * K + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0
                )
                acc = tl.dot(x, tl.trans(w), acc)
            tl.store(
                out_ptr + m[:, None].to(tl.int64) * N + n[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=(m < stop)[:, None] & (n < N)[None, :],
            )


# ------------------------------------------------------------------------------ residual add and norm
# Widest row the add-and-norm kernel holds in one program (its registers).
ADD_NORM_MAX_WIDTH = 16384


def add_norm_unsupported(device: torch.device, dtype: torch.dtype, width: int) -> str | None:
    """Why `add_rms_norm` cannot serve a model (None: it can)."""
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    if width > ADD_NORM_MAX_WIDTH:
        return f"hidden size {width} (the kernel holds a row of at most {ADD_NORM_MAX_WIDTH} in one program)"
    return where_unsupported(device.type)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm`'s semantics in torch: (residual + x, its RMSNorm), megatron's bias-dropout-add in eval
    (no bias) and torch.nn.RMSNorm's call (`F.rms_norm`). The CPU path of tests."""
    hidden = residual + x
    return hidden, F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, its RMSNorm by `weight`) of rows x, residual [..., h] in one Triton kernel, one program
    per row: the decode step's residual add with the norm after it (`KVCacheGenerator.add_norm`), where
    megatron's add and torch's norm are two kernels (torch.compile made three of the pair).

    Numerics: the sum is rounded to the dtype as megatron's add rounds it, and the norm reads the rounded
    sum, in fp32: sum of squares over the row, rsqrt(mean + eps), then weight * (x * rstd) rounded once, as
    torch's CUDA RMSNorm does; they differ by the order of the sum of squares only."""
    assert triton is not None, "triton is not installed (decode_kernels.add_norm_unsupported)"
    shape, width = x.shape, x.shape[-1]
    rows = x.reshape(-1, width).contiguous()
    res = residual.reshape(-1, width).contiguous()
    hidden, normed = torch.empty_like(rows), torch.empty_like(rows)
    if rows.shape[0] == 0:
        return hidden.view(shape), normed.view(shape)
    block = next_power_of_2(width)
    _add_rms_norm_kernel[(rows.shape[0],)](
        rows, res, weight.contiguous(), hidden, normed, width, torch.finfo(x.dtype).eps if eps is None else eps,
        BLOCK=block, num_warps=min(16, max(4, block // 512)),
    )  # fmt: skip
    return hidden.view(shape), normed.view(shape)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
        """One row: h = r + x (rounded), out = w * (h * rsqrt(mean(h^2) + eps)) (rounded)."""
        at = tl.program_id(0).to(tl.int64) * H
        i = tl.arange(0, BLOCK)
        on = i < H
        x = tl.load(x_ptr + at + i, mask=on, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + at + i, mask=on, other=0.0).to(tl.float32)
        h = (r + x).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + at + i, h, mask=on)
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, 0) / H + eps)
        w = tl.load(w_ptr + i, mask=on, other=0.0).to(tl.float32)
        tl.store(out_ptr + at + i, (w * (hf * rstd)).to(out_ptr.dtype.element_ty), mask=on)
