"""Cost of a role call that is not profiled (target: well under 1 µs per call).

Every worker method runs inside `profiler.profiled(ROLE)`; on all but the profiled steps, roles and ranks
that wrapper must cost nothing measurable. This times `with profiler.profiled(role): pass` and the
`@profiled(role)` decorator against the bare loop / bare method, for a disabled plan (tool none) and for an
enabled plan at a step, role or rank it does not profile.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/profiler_overhead.py [--calls 200000] [--repeat 15]. Prints ns/call per
case and a JSON line; exits 1 when a case reaches 1 µs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from presets import PRESETS
from rlconf.load import load_config
from rlconf.plan import ProfilePlan, compile_plan
from rltrain.profiling import Profiler, profiled

LIMIT_NS = 1000.0


def plan_of(out: str, *overrides: str) -> ProfilePlan:
    cfg = load_config(
        None, preset="tiny-grpo", overrides=[f"trainer.output_dir={out}", *overrides], presets=PRESETS
    )
    return compile_plan(cfg).profile


def per_call_ns(fn: Callable[[int], None], calls: int, repeat: int) -> float:
    """Best of `repeat` runs of `fn(calls)`, in ns per call (the minimum, as timeit advises: on a shared
    machine the slower runs measure the neighbours, not the code)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn(calls)
        times.append((time.perf_counter_ns() - t0) / calls)
    return min(times)


def context_loop(prof: Profiler, role: str) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            with prof.profiled(role):
                pass

    return run


def bare_loop(n: int) -> None:
    for _ in range(n):
        pass


class Worker:
    def __init__(self, prof: Profiler) -> None:
        self.profiler = prof

    @profiled("actor_update")
    def update(self) -> None:
        pass

    def update_bare(self) -> None:
        pass


def method_loop(method: Callable[[], None]) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            method()

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as out:
        off = Profiler(plan_of(out), worker="actor", rank=0, device="cpu")
        on_plan = plan_of(out, "profile.tool=torch", "profile.steps=[2]", "profile.roles=[actor_update]")
        other_step = Profiler(on_plan, worker="actor", rank=0, device="cpu")
        other_role = Profiler(on_plan, worker="actor", rank=0, device="cpu")
        for p in (off, other_step):
            p.set_step(1)
        other_role.set_step(2)  # the profiled step, but a role the plan leaves out

        base = per_call_ns(bare_loop, args.calls, args.repeat)
        worker = Worker(off)
        base_method = per_call_ns(method_loop(worker.update_bare), args.calls, args.repeat)
        cases = {
            "with profiled(), tool=none": per_call_ns(
                context_loop(off, "actor_update"), args.calls, args.repeat
            )
            - base,
            "with profiled(), step not profiled": per_call_ns(
                context_loop(other_step, "actor_update"), args.calls, args.repeat
            )
            - base,
            "with profiled(), role not profiled": per_call_ns(
                context_loop(other_role, "generate_sequences"), args.calls, args.repeat
            )
            - base,
            "@profiled method, tool=none": per_call_ns(method_loop(worker.update), args.calls, args.repeat)
            - base_method,
        }
        # Nothing may have been written by calls that are not profiled.
        assert not any(p.is_file() for p in Path(out).rglob("*"))

    width = max(map(len, cases))
    print(f"{'case':<{width}}  ns/call (overhead over the bare loop / method)")
    for name, ns in cases.items():
        print(f"{name:<{width}}  {ns:8.1f}")
    print(json.dumps({"calls": args.calls, "overhead_ns": {k: round(v, 1) for k, v in cases.items()}}))
    return 0 if all(ns < LIMIT_NS for ns in cases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
