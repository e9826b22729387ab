"""Probe (GPU): which varlen attention torch offers here and how fast packed attention is vs padded SDPA."""
import inspect, json, time, torch, torch.nn.functional as F
out = {"torch": torch.__version__}
try:
    from torch.nn.attention import varlen
    out["varlen_sig"] = str(inspect.signature(varlen.varlen_attn))
except Exception as e:
    out["varlen_err"] = repr(e)
dev = "cuda"; dt = torch.bfloat16; hq, hk, d = 12, 2, 128
lens = [4096, 1500, 800, 3000, 2200, 400, 1700, 2600]
cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
T = sum(lens); mx = max(lens)
def timeit(fn, n=10):
    fn(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e3
q = torch.randn(T, hq, d, device=dev, dtype=dt, requires_grad=True)
k = torch.randn(T, hk, d, device=dev, dtype=dt, requires_grad=True)
v = torch.randn(T, hk, d, device=dev, dtype=dt, requires_grad=True)
def run_varlen(gqa):
    kw = {}
    sig = inspect.signature(varlen.varlen_attn).parameters
    if "window_size" in sig: kw["window_size"] = (-1, 0)
    if "is_causal" in sig: kw["is_causal"] = True
    kk, vv = k, v
    if gqa and "enable_gqa" in sig: kw["enable_gqa"] = True
    else: kk, vv = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    o = varlen.varlen_attn(q, kk, vv, cu, cu, mx, mx, **kw)
    o.float().sum().backward()
    return o
for gqa in (True, False):
    try:
        out[f"varlen_fwdbwd_ms_gqa{gqa}"] = timeit(lambda: run_varlen(gqa))
    except Exception as e:
        out[f"varlen_err_gqa{gqa}"] = repr(e)[:500]
# exactness vs per-row sdpa
def per_row():
    outs = []
    for i, L in enumerate(lens):
        s = slice(int(cu[i]), int(cu[i+1]))
        outs.append(F.scaled_dot_product_attention(q[s].transpose(0,1)[None], k[s].transpose(0,1)[None], v[s].transpose(0,1)[None], is_causal=True, enable_gqa=True)[0].transpose(0,1))
    o = torch.cat(outs); o.float().sum().backward(); return o
out["per_row_sdpa_ms"] = timeit(per_row)
try:
    with torch.no_grad():
        a = run_varlen(True) if "varlen_sig" in out else None
    out["max_diff_vs_row"] = float((a - per_row()).abs().max()) if a is not None else None
except Exception as e:
    out["diff_err"] = repr(e)[:300]
B = len(lens)
qp = torch.randn(B, hq, mx, d, device=dev, dtype=dt, requires_grad=True)
kp = torch.randn(B, hk, mx, d, device=dev, dtype=dt, requires_grad=True)
vp = torch.randn(B, hk, mx, d, device=dev, dtype=dt, requires_grad=True)
def padded():
    o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True); o.float().sum().backward()
out["padded_sdpa_ms"] = timeit(padded)
# flex attention document mask
try:
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    doc = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(lens, device=dev))
    def mask_mod(b, h, qi, ki): return (doc[qi] == doc[ki]) & (qi >= ki)
    t0 = time.perf_counter()
    bm = create_block_mask(mask_mod, 1, 1, T, T, device=dev)
    fa = torch.compile(flex_attention)
    def flex():
        o = fa(q.transpose(0,1)[None], k.transpose(0,1)[None], v.transpose(0,1)[None], block_mask=bm, enable_gqa=True); o.float().sum().backward()
    flex(); torch.cuda.synchronize(); out["flex_compile_s"] = time.perf_counter() - t0
    out["flex_fwdbwd_ms"] = timeit(flex)
    out["flex_blockmask_ms"] = timeit(lambda: create_block_mask(mask_mod, 1, 1, T, T, device=dev))
except Exception as e:
    out["flex_err"] = repr(e)[:500]
print(json.dumps(out, indent=1))
