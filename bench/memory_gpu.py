"""What each role call of a preset allocates on one GPU, at its peak: the memory estimate's ground truth.

Runs the policy worker's calls of a preset (generate, actor log-prob, ref log-prob, actor update) on one
device with the plan's engines (random init), as `PolicyWorker` runs them, with the CUDA allocator's history
recorded. For each call: the peak (`max_memory_allocated`, what `perf/max_memory_allocated_gib/<role>`
records), the memory held before it, and the tensors alive at the peak grouped by the source line that
allocated them (rlconf/plan/memory.py models these parts). Rows are the synthetic task's: prompts of
`--prompt-tokens` tokens, responses sampled to `max_response_length` (random weights rarely stop).

On the GPU machine (bench/device_setup.sh first):
    python3 bench/memory_gpu.py --preset qwen2.5-1.5b-grpo --fused eager --out $OUT
Writes memory_<preset>_<fused>.json and prints the peaks and the largest parts of each call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.megatron._common import init_groups

GIB = 2**30


def _site(frames: list[dict[str, Any]]) -> str:
    """The two innermost frames outside torch's own Python (where the model code asked for the tensor)."""
    keep = []
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" in name and "/torch/nn/modules/" not in name and "functional" not in name:
            continue
        short = name.split("site-packages/")[-1].split("/work/")[-1]
        keep.append(f"{short}:{f.get('line')}:{f.get('name')}")
        if len(keep) == 2:
            break
    return " <- ".join(keep) or "?"


def breakdown(snapshot: dict[str, Any], base: int) -> tuple[int, list[tuple[str, float, int]]]:
    """(allocated bytes at the traced peak, [(site, GiB alive at the peak, tensors)]) from the history."""
    trace = snapshot["device_traces"][0]
    live: dict[int, tuple[int, str]] = {}
    cur = peak = base
    peak_live: dict[int, tuple[int, str]] = {}
    for ev in trace:
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
            cur += ev["size"]
            if cur > peak:
                peak, peak_live = cur, dict(live)
        elif act == "free_completed":
            cur -= ev["size"]
            live.pop(ev["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in peak_live.values():
        groups[site][0] += size
        groups[site][1] += 1
    rows = sorted(((s, b / GIB, n) for s, (b, n) in groups.items()), key=lambda r: -r[1])
    return peak, rows


def measured(name: str, fn: Any, report: dict[str, Any], trace: bool = True) -> Any:
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if trace:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    entry: dict[str, Any] = {"peak_gib": peak / GIB, "before_gib": base / GIB, "seconds": seconds}
    if trace:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        traced, rows = breakdown(snap, base)
        entry["traced_peak_gib"] = traced / GIB
        entry["at_peak"] = [{"site": s, "gib": round(g, 4), "tensors": n} for s, g, n in rows[:40]]
        del snap
    report[name] = entry
    print(f"== {name}: peak {peak / GIB:.2f} GiB (before {base / GIB:.2f}, {seconds:.1f} s)", flush=True)
    for r in entry.get("at_peak", [])[:25]:
        print(f"   {r['gib']:8.3f} GiB  x{r['tensors']:<5d} {r['site']}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b-grpo")
    ap.add_argument("--fused", default="eager", choices=("eager", "compiled"))
    ap.add_argument("--prompt-tokens", type=int, default=6)
    ap.add_argument("--phases", default="generate,actor_compute_log_prob,ref_compute_log_prob,actor_update")
    ap.add_argument("--set", action="append", default=[], help="PATH=VALUE (ints only)")
    ap.add_argument("--out", default="/tmp/memory_gpu")
    args = ap.parse_args()

    import torch

    from presets import get_preset
    from rlconf.plan import compile_plan
    from rltrain.megatron.actor import MegatronActor

    cfg = get_preset(args.preset)
    cfg = replace(cfg, model=replace(cfg.model, fused_kernels=args.fused))
    for item in args.set:
        path, value = item.split("=")
        sect, key = path.split(".")
        cfg = replace(cfg, **{sect: replace(getattr(cfg, sect), **{key: int(value)})})
    plan = compile_plan(cfg)
    init_groups(cfg.actor.megatron, "cuda")
    actor = MegatronActor.from_plan(plan, "actor")
    ref = MegatronActor.from_plan(plan, "ref", init_from=actor) if "ref" in plan.roles else None
    if ref is not None:
        ref.offload_for_other_roles()
    report: dict[str, Any] = {"preset": args.preset, "fused": args.fused, "torch": torch.__version__}
    phases = args.phases.split(",")

    prompts = cfg.data.train_batch_size
    n = cfg.rollout.n
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 60, (prompts, args.prompt_tokens), generator=g)
    prompt[:, 0] = 1  # bos
    prompt_ids = prompt.repeat_interleave(n, 0)

    def gen() -> dict[str, torch.Tensor]:
        return actor.generate(
            prompt_ids, cfg.rollout.max_response_length, temperature=cfg.rollout.temperature, eos_id=2,
            seed=1, cuda_graph=bool(cfg.rollout.cuda_graph),
        )  # fmt: skip

    batch = measured("generate_sequences", gen, report, trace="generate" in phases)
    report["response_tokens_mean"] = float(batch["response_mask"].float().sum(-1).mean())
    b, r = batch["responses"].shape
    batch["old_log_probs"] = torch.zeros(b, r)
    batch["ref_log_probs"] = torch.zeros(b, r)
    batch["advantages"] = torch.randn(b, r, generator=g)
    t = cfg.rollout.temperature
    if "actor_compute_log_prob" in phases:
        out = measured("actor_compute_log_prob", lambda: actor.compute_log_prob(batch, temperature=t), report)
        batch["old_log_probs"] = out["log_probs"]
    if ref is not None and "ref_compute_log_prob" in phases:
        out = measured(
            "ref_compute_log_prob",
            lambda: ref.compute_log_prob(batch, temperature=t, with_entropy=False),
            report,
        )
        batch["ref_log_probs"] = out["log_probs"]
    if "actor_update" in phases:
        measured("actor_update", lambda: actor.update_policy(batch, temperature=t, step=1), report)
        # The second update: the optimizer state exists from the start (the first one creates it lazily).
        measured("actor_update_2", lambda: actor.update_policy(batch, temperature=t, step=2), report)
    pool = next(p for p in plan.memory.pools if "actor" in p.roles)
    for ph in pool.phases:
        entry = report.get(ph.phase)
        if entry is not None:
            entry["estimate_gib"] = ph.total_gib
            entry["estimate_parts"] = {p.label: p.gib for p in ph.parts}
            ratio = entry["peak_gib"] / ph.total_gib
            print(
                f"{ph.phase}: measured {entry['peak_gib']:.2f} GiB / estimate {ph.total_gib:.2f} = {ratio:.3f}"
            )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"memory_{args.preset}_{args.fused}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
