"""Reaper of a local Ray cluster: when the driver that started it dies, kill what is left of the cluster.

Ray ties the head processes it starts (gcs_server, raylet, dashboard, log monitor) to the driver with
PR_SET_PDEATHSIG, but the raylet's own children (dashboard agent, runtime-env agent, idle workers) notice
their raylet is gone only later: with Ray 2.60 both agents lingered about a minute after `kill -9` of the
driver, and they rename themselves (`ray::DashboardAgent`), so nothing on their command line names the run.

`start_ray` starts this process in its own session (a signal to the driver's process group leaves it
alive to clean up) with a pipe from the driver on stdin, the driver's pid, the pids of the Ray processes
ray.init started and the raylet's pid. Twice a second it records every descendant of those processes.
It ends when the driver dies (the pipe closes, whatever killed the driver) or when the cluster stops
(the raylet exits after ray.shutdown; the old cluster's reaper must not outlive it, nor touch the next
cluster of the same driver). It then kills every recorded process, and every process whose environment
names the raylet (RAY_RAYLET_PID, which Ray sets in the agents and workers), and exits.

Run as `python -m rltrain.ray_reaper DRIVER_PID RAYLET_PID ROOT_PID...`. Imports only psutil: it starts
in a fraction of a second and costs a few MiB.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys

import psutil

POLL_S = 0.5
# After ray.shutdown Ray stops its own processes: give it this long before killing what remains.
SHUTDOWN_GRACE_S = 2.0


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _alive(proc: psutil.Process) -> bool:
    # is_running also compares the creation time, so a reused pid is not mistaken for the process.
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _record(roots: list[psutil.Process], seen: dict[int, psutil.Process]) -> None:
    for root in roots:
        try:
            family = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in family:
            seen.setdefault(proc.pid, proc)


def _children_of_raylet(raylet_pid: int, seen: dict[int, psutil.Process]) -> list[psutil.Process]:
    """Processes not recorded (started between two polls, or reparented before the first) whose
    environment says the raylet started them."""
    found = []
    mark = str(raylet_pid)
    for proc in psutil.process_iter():
        if proc.pid in seen or proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get("RAY_RAYLET_PID") == mark:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def reap(procs: list[psutil.Process], grace_s: float) -> None:
    """Wait up to `grace_s` for `procs` to exit, then SIGKILL the rest and wait for them."""
    procs = [p for p in procs if _alive(p)]
    if grace_s > 0:
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)


def watch(driver_pid: int, raylet_pid: int, root_pids: list[int]) -> None:
    driver = _process(driver_pid)
    roots = [p for p in map(_process, root_pids) if p is not None]
    raylet = next((p for p in roots if p.pid == raylet_pid), None)
    seen: dict[int, psutil.Process] = {}
    driver_died = False
    while True:
        _record(roots, seen)
        readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            driver_died = True  # the pipe closed: the driver exited, however it was killed
        elif driver is None or not _alive(driver):
            driver_died = True  # a forked child may still hold the pipe open
        if driver_died or raylet is None or not _alive(raylet):
            break
    leftovers = list(seen.values()) + _children_of_raylet(raylet_pid, seen)
    reap(leftovers, 0.0 if driver_died else SHUTDOWN_GRACE_S)


def main(argv: list[str]) -> None:
    driver_pid, raylet_pid, *root_pids = (int(a) for a in argv)
    watch(driver_pid, raylet_pid, root_pids)


if __name__ == "__main__":
    main(sys.argv[1:])
