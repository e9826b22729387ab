"""Where a GPU waited for its host, from a torch profiler trace (`trace.json` of `--profile.tool torch`).

A key_averages table says how long kernels ran, not whether the device idled between them. This reads the
Chrome trace and reports, over the span of the device's work:

- `busy_s` / `idle_s`: the union of kernel, copy and memset intervals, and the rest of the span;
- `host_reads`: device -> host copies (each a point where the host waits for everything queued before it),
  counted by the CPU ops around the call that issued them (what code reads a tensor's value);
- `syncs`: explicit synchronize calls, counted the same way;
- `gaps`: idle stretches of at least `--min-gap-us`, summed by the CPU op that launched the work ending each
  gap (what the host was busy with while the device waited), and by the copy that began it where one did.

    python3 bench/trace_gaps.py path/to/trace.json [--min-gap-us 20] [--top 25]

bench/grpo_step_gpu.py runs it on every trace of a profiled run and keeps the report next to the tables.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# Enclosing CPU ops that say nothing about which code ran (the profiler's step markers, dispatch layers).
NOISE = ("ProfilerStep", "## Call", "Torch-Compiled Region")


def _stacks(ops: list[dict], queries: list[dict], depth: int) -> dict[int, str]:
    """For each query event (a runtime call) of one thread, the innermost `depth` CPU ops of that thread open
    at its start, outermost first, by one sweep over both sorted by time (ops on a thread nest)."""
    out: dict[int, str] = {}
    stack: list[dict] = []
    i = 0
    for q in sorted(queries, key=lambda e: e["ts"]):
        t = q["ts"]
        while i < len(ops) and ops[i]["ts"] <= t:
            op = ops[i]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < op["ts"]:
                stack.pop()
            stack.append(op)
            i += 1
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
            stack.pop()
        names = [op["name"] for op in stack if not op["name"].startswith(NOISE)]
        out[id(q)] = " < ".join(names[-depth:]) or "(no op)"
    return out


def summarize(path: str | Path, min_gap_us: float = 20.0, top: int = 25, depth: int = 3) -> dict:
    """The report described in the module docstring, as a dict."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    if not device:
        return {"trace": str(path), "note": "no device events"}
    runtime = {}
    ops_by_thread: dict = defaultdict(list)
    calls = []
    for e in events:
        cat = e.get("cat")
        if cat == "cuda_runtime" or cat == "cuda_driver":
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                runtime[corr] = e
            calls.append(e)
        elif cat in ("cpu_op", "user_annotation", "python_function") and "dur" in e:
            ops_by_thread[(e["pid"], e["tid"])].append(e)
    for ops in ops_by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))  # an op before the ops it encloses

    span0, span1 = device[0]["ts"], max(e["ts"] + e["dur"] for e in device)
    busy = 0.0
    gaps = []  # (gap us, launching call, the event before the gap)
    end = device[0]["ts"]
    previous = None
    for e in device:
        if e["ts"] > end and e["ts"] - end >= min_gap_us:
            gaps.append((e["ts"] - end, runtime.get(e.get("args", {}).get("correlation")), previous))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        if e["ts"] + e["dur"] > end:
            end = e["ts"] + e["dur"]
            previous = e
    copies = [runtime.get(e.get("args", {}).get("correlation")) for e in device
              if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]]  # fmt: skip
    sync_calls = [c for c in calls if c["name"].startswith(SYNC_CALLS)]
    queries: dict = defaultdict(dict)
    for call in (*(g[1] for g in gaps), *copies, *sync_calls):
        if call is not None:
            queries[(call["pid"], call["tid"])][id(call)] = call
    where: dict[int, str] = {}
    for key, qs in queries.items():
        where.update(_stacks(ops_by_thread.get(key, []), list(qs.values()), depth))

    def site(call: dict | None) -> str:
        return "?" if call is None else where.get(id(call), "?")

    gaps_by_launch: Counter = Counter()
    gaps_after_copy: Counter = Counter()
    for gap, call, before in gaps:
        gaps_by_launch[site(call)] += gap
        if before is not None and before.get("cat") == "gpu_memcpy":
            gaps_after_copy[before["name"]] += gap
    gap_total = sum(g[0] for g in gaps)
    reads = Counter(site(c) for c in copies)
    syncs = Counter(site(c) for c in sync_calls)
    span = (span1 - span0) / 1e6
    return {
        "trace": str(path),
        "span_s": round(span, 6),
        "busy_s": round(busy / 1e6, 6),
        "idle_s": round(span - busy / 1e6, 6),
        "gaps_over_min_s": round(gap_total / 1e6, 6),
        "min_gap_us": min_gap_us,
        "device_events": len(device),
        "host_reads": sum(reads.values()),
        "host_reads_by_op": reads.most_common(top),
        "syncs": sum(syncs.values()),
        "syncs_by_op": syncs.most_common(top),
        "gap_s_by_launching_op": [(k, round(v / 1e6, 6)) for k, v in gaps_by_launch.most_common(top)],
        "gap_s_after_copy": [(k, round(v / 1e6, 6)) for k, v in gaps_after_copy.most_common(top)],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--depth", type=int, default=3, help="enclosing CPU ops named per site")
    a = ap.parse_args()
    print(json.dumps(summarize(a.trace, a.min_gap_us, a.top, a.depth), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
