"""Rollout throughput on one GPU: HF `generate` vs the embedded KV-cache engine on the same weights, and
what a weight refit costs (colocated: nothing; a separate engine: rltrain/rollout/weight_sync.py).

One process. A random-init model of the chosen shape (default Qwen2.5-0.5B, bf16) is built by
transformers, saved to a temporary folder and loaded into megatron (`ModelConfig(path=...)`), so both
paths generate with identical weights. Prompts: `--prompt` tokens, no padding; every row generates exactly
`--new-tokens` tokens (EOS ignored: HF with min_new_tokens = max_new_tokens, the engine with eos_id=None);
pure sampling at temperature 1 (no top-k/top-p) on both sides. Reported per batch size:

  hf_tok_s            transformers AutoModelForCausalLM.generate (sdpa, dynamic cache), generated tokens / s
  engine_tok_s        MegatronActor.generate (rltrain/megatron/inference.py, KV cache), eager decode
  engine_graph_tok_s  the same with `cuda_graph=True` (StaticDecodeStep: decode captured in CUDA graphs;
                      the capture of each key-length bucket's graph is inside the timing, as in a rollout)
  ratio, ratio_graph  engine / hf, engine_graph / hf
and once:
  colocated_refit_s   0: the embedded engine samples with the actor's own parameters (no copy exists)
  sync_pack_s         weight_sync.send_weights without receivers (TP gather + HF mapping + bucket packing)
  sync_load_s         the same plus unpacking into the HF model's parameters (the `load_weights` a separate
                      engine such as vLLM runs), i.e. everything a separate engine's refit costs except
                      the wire; with the bytes moved and the bucket count.

Each case runs in its own try/except (an error is recorded, the others still run), after a warm-up, with
torch.cuda.synchronize() around every timing. Prints a table, writes rollout_gpu.json to --out ($OUT).

GPU (lead):  PYTHONPATH=/tmp/site:$PWD python3 bench/rollout_gpu.py --arch qwen05b --out $OUT
             (and --arch qwen15b for the Qwen2.5-1.5B shape)
CPU smoke:   OMP_NUM_THREADS=1 .venv/bin/python bench/rollout_gpu.py --arch tiny --device cpu \
                 --batches 4,8 --prompt 8 --new-tokens 8 --out /tmp/rollout_gpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.megatron._common import actor_of, init_groups


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> tuple[float, object]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def get_arch(name: str, min_positions: int):
    from dataclasses import replace

    from rlconf.config import ModelArch

    if name == "qwen05b":
        from presets.gpu import QWEN25_05B

        arch = QWEN25_05B
    elif name == "qwen15b":
        from presets.gpu import QWEN25_15B

        arch = QWEN25_15B
    else:  # the tests' tiny Qwen2 shape
        arch = ModelArch(
            num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2,
            vocab_size=100, max_position_embeddings=128,
        )  # fmt: skip
    if arch.max_position_embeddings < min_positions:
        arch = replace(arch, max_position_embeddings=min_positions)
    return arch


def build_hf(arch, dtype: torch.dtype, device: str, folder: Path):
    """Random-init HF model of `arch` on `device`, also saved to `folder` (megatron loads it from there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rltrain.megatron.hf_weights import hf_config_from_arch

    cfg_dict = hf_config_from_arch(arch, dtype)
    model_type = cfg_dict.pop("model_type")
    hf_cfg = AutoConfig.for_model(model_type, **cfg_dict)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    hf.save_pretrained(str(folder))
    return hf.to(device).eval()


def build_actor(folder: Path, dtype_name: str, device: str, batch: int):
    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig

    model_cfg = ModelConfig(path=str(folder), params_dtype=dtype_name, attention_backend="sdpa")  # type: ignore[arg-type]
    actor_cfg = ActorConfig(megatron=MegatronConfig(), log_prob_micro_batch_size_per_gpu=batch)
    return actor_of(model_cfg, actor_cfg, device, trainable=False)


def hf_generate(hf, ids: torch.Tensor, new_tokens: int, device: str) -> torch.Tensor:
    ids = ids.to(device)
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,  # the generation config's default top_k=50 would filter; the engine samples the full vocab
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return out


def engine_generate(
    actor, ids: torch.Tensor, new_tokens: int, cuda_graph: bool = False
) -> dict[str, torch.Tensor]:
    out = actor.generate(
        ids,
        new_tokens,
        temperature=1.0,
        eos_id=None,
        pad_id=0,
        prompt_mask=torch.ones_like(ids),
        cuda_graph=cuda_graph,
    )
    assert int(out["response_mask"].sum()) == ids.shape[0] * new_tokens
    return out


def hf_loader(hf):
    """`load_weights` into the HF model by HF name: what a separate engine runs on its side."""
    params = dict(hf.named_parameters())

    @torch.no_grad()
    def load(pairs) -> None:
        for name, t in pairs:
            params[name].copy_(t)

    return load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen05b", choices=["qwen05b", "qwen15b", "tiny"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on cuda"
    )
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    batches = [int(b) for b in args.batches.split(",")]
    p, n = args.prompt, args.new_tokens

    from rlconf.config import MegatronConfig
    from rltrain.megatron.parallel import free_port
    from rltrain.rollout.weight_sync import send_weights, sync_weights

    init_groups(MegatronConfig(), args.device, rank=0, world_size=1, master_port=free_port())
    arch = get_arch(args.arch, p + n)
    report: dict[str, object] = {
        "arch": args.arch,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": dtype_name,
        "prompt": p,
        "new_tokens": n,
        "torch": torch.__version__,
        "cases": {},
        "errors": {},
    }
    errors: dict[str, str] = report["errors"]  # type: ignore[assignment]
    cases: dict[str, dict[str, float]] = report["cases"]  # type: ignore[assignment]

    def attempt(name: str, fn) -> object:
        try:
            return fn()
        except Exception as exc:  # one failure must not lose the other cases
            traceback.print_exc()
            errors[name] = f"{type(exc).__name__}: {exc}"
            return None

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        hf = build_hf(arch, dtype, args.device, folder)
        import transformers

        report["transformers"] = transformers.__version__
        actor = build_actor(folder, dtype_name, args.device, max(batches))
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(1, arch.vocab_size, (b, p), generator=g) for b in batches}
    warm = min(args.warmup_tokens, n)
    attempt("warmup_hf", lambda: hf_generate(hf, prompts[batches[0]], warm, args.device))
    attempt("warmup_engine", lambda: engine_generate(actor, prompts[batches[0]], warm))
    attempt("warmup_graph", lambda: engine_generate(actor, prompts[batches[0]], warm, cuda_graph=True))

    for b in batches:
        row: dict[str, float] = {"batch": b}
        cases[str(b)] = row
        for name, fn in (
            ("hf", lambda b=b: hf_generate(hf, prompts[b], n, args.device)),
            ("engine", lambda b=b: engine_generate(actor, prompts[b], n)),
            ("engine_graph", lambda b=b: engine_generate(actor, prompts[b], n, cuda_graph=True)),
        ):
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            res = attempt(f"{name}_b{b}", lambda fn=fn: timed(fn, args.device))
            if res is not None:
                secs = res[0]  # type: ignore[index]
                row[f"{name}_s"] = secs
                row[f"{name}_tok_s"] = b * n / secs
                if args.device == "cuda":
                    row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if args.device == "cuda":
                torch.cuda.empty_cache()
        for engine, ratio in (("engine", "ratio"), ("engine_graph", "ratio_graph")):
            if "hf_tok_s" in row and f"{engine}_tok_s" in row:
                row[ratio] = row[f"{engine}_tok_s"] / row["hf_tok_s"]

    # ---- refit cost
    bucket = int(args.bucket_mb * 2**20)
    refit: dict[str, object] = {
        "colocated_refit_s": 0.0,
        "colocated_note": "the embedded engine generates with the actor's own parameters in place: "
        "an update is visible to the next rollout with nothing to copy",
        "bucket_bytes": bucket,
    }
    report["refit"] = refit

    def pack_only():
        attempt("sync_pack_warmup", lambda: send_weights([], None, 0, bucket, args.device))
        return timed(lambda: sync_weights(actor.chunks, actor.arch, None, 0, bucket), args.device)

    def pack_and_load():
        return timed(
            lambda: sync_weights(actor.chunks, actor.arch, None, 0, bucket, local_load=hf_loader(hf)),
            args.device,
        )

    for name, fn in (("sync_pack", pack_only), ("sync_load", pack_and_load)):
        res = attempt(name, fn)
        if res is not None:
            secs, stats = res  # type: ignore[misc]
            refit[f"{name}_s"] = secs
            refit[f"{name}_gib"] = stats.bytes / 2**30
            refit[f"{name}_buckets"] = stats.buckets
            refit[f"{name}_gib_per_s"] = stats.bytes / 2**30 / max(secs, 1e-9)

    # ---- output
    print(
        f"\nrollout {args.arch} {dtype_name} on {report['device']}: prompt {p}, {n} new tokens, sampling T=1"
    )
    cols = ["hf_tok_s", "engine_tok_s", "engine_graph_tok_s", "ratio", "ratio_graph"]
    cols += ["hf_peak_gib", "engine_peak_gib", "engine_graph_peak_gib"]
    print(f"{'batch':>6} " + " ".join(f"{c:>21}" for c in cols))
    for b in batches:
        r = cases[str(b)]
        print(f"{b:>6} " + " ".join(f"{r.get(c, float('nan')):>21.2f}" for c in cols))
    print(
        f"refit: colocated 0 s (weights used in place); separate engine: pack "
        f"{refit.get('sync_pack_s', float('nan')):.3f} s, pack + load_weights "
        f"{refit.get('sync_load_s', float('nan')):.3f} s for {refit.get('sync_load_gib', float('nan')):.2f} GiB "
        f"in {refit.get('sync_load_buckets', '?')} buckets of {args.bucket_mb:g} MiB (wire time not included)"
    )
    if errors:
        print("errors:", json.dumps(errors, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rollout_gpu_{args.arch}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
