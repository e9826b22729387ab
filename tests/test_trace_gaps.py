"""bench/trace_gaps.py on a hand-written torch trace: the device's busy and idle time, its device -> host reads
and synchronising calls named by the CPU ops around them, and each idle gap charged to the op that launched
the work ending it (what a GPU profile of a host-bound pass is read with, docs/profiling.md)."""

from __future__ import annotations

import json

from bench.trace_gaps import summarize


def _x(cat, name, ts, dur, tid=1, corr=None, pid=1):
    event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def test_idle_gaps_and_host_reads_are_charged_to_the_ops_that_caused_them(tmp_path):
    events = [
        _x("cpu_op", "ProfilerStep#2", 0, 2000),  # left out of the op chains
        _x("user_annotation", "actor_update", 0, 2000),
        _x("cpu_op", "aten::mm", 10, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 5, corr=1),
        _x("cpu_op", "aten::item", 100, 400),
        _x("cpu_op", "aten::_local_scalar_dense", 101, 398),
        _x("cuda_runtime", "cudaMemcpyAsync", 102, 390, corr=2),
        _x("cuda_runtime", "cudaStreamSynchronize", 495, 3),
        _x("cpu_op", "aten::zeros", 900, 30),
        _x("cpu_op", "aten::fill_", 905, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 910, 5, corr=3),
        _x("cuda_runtime", "cudaLaunchKernel", 950, 5, corr=4),  # no op around it
        # the device: a kernel 20-320, the read's copy 480-490, a fill 1000-1010, a kernel 1015-1100
        _x("kernel", "gemm", 20, 300, tid=7, corr=1, pid=0),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 480, 10, tid=7, corr=2, pid=0),
        _x("kernel", "fill", 1000, 10, tid=7, corr=3, pid=0),
        _x("kernel", "next", 1015, 85, tid=7, corr=4, pid=0),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = summarize(path, min_gap_us=20.0)
    assert report["span_s"] == 1080e-6 and report["busy_s"] == 405e-6
    assert report["device_events"] == 4
    read = ("actor_update < aten::item < aten::_local_scalar_dense", 1)
    assert report["host_reads_by_op"] == [read] and report["syncs_by_op"] == [read]
    # Gaps of at least 20 us: 320-480 (ended by the read's copy) and 490-1000 (ended by the fill, after the
    # copy); the 5 us gap before "next" is under the threshold.
    gaps = dict(report["gap_s_by_launching_op"])
    assert gaps == {
        "actor_update < aten::item < aten::_local_scalar_dense": 160e-6,
        "actor_update < aten::zeros < aten::fill_": 510e-6,
    }
    assert report["gap_s_after_copy"] == [("Memcpy DtoH (Device -> Pinned)", 510e-6)]
    assert report["gaps_over_min_s"] == 670e-6
