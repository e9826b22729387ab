"""Test-only fault points of checkpoint saving: crash tests kill a job exactly between two steps of a save.

Production never sets RLPLAN_CHECKPOINT_FAULT, so `fault_point` is a no-op there. `RLPLAN_CHECKPOINT_FAULT=
POINT[@STEP]` makes the process that reaches POINT (for the checkpoint of STEP, or of any step) SIGKILL the
whole job and then itself, as `kill -9` of the job would: every process of its session (the trainer, Ray's
daemons and workers, a background checkpoint writer) when the job leads its session (start it with
`start_new_session=True`), else only the processes that carry the variable.
Points, in the order a save passes them:

    during_async_write  worker: the background writer of an async save has just been started
    before_manifest     worker: every file of the role is written, its manifest is not
    before_complete     controller: every manifest is verified, the COMPLETE marker is not written
    before_rename       controller: COMPLETE is written in the staging folder, not yet renamed to global_step_N
    before_latest       controller: global_step_N is in place, the latest file still names the previous step
    during_retention    controller: the old checkpoint of STEP is renamed to global_step_N.del-* for deletion
                        and not yet deleted
"""

from __future__ import annotations

import contextlib
import logging
import os

from rltrain.checkpoint.manifest import CheckpointError

logger = logging.getLogger(__name__)

FAULT_ENV = "RLPLAN_CHECKPOINT_FAULT"
FAULT_POINTS = (
    "during_async_write",
    "before_manifest",
    "before_complete",
    "before_rename",
    "before_latest",
    "during_retention",
)


def fault_point(point: str, step: int | None = None) -> None:
    """Test-only fault injection : a no-op unless RLPLAN_CHECKPOINT_FAULT names
    `point`. An unknown point name is an error, so a typo cannot make a crash test pass without crashing."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, _, at = spec.partition("@")
    if name not in FAULT_POINTS or (at and not at.isdigit()):
        raise CheckpointError(
            f"{FAULT_ENV}={spec}: expected POINT[@STEP] with POINT one of {', '.join(FAULT_POINTS)}"
        )
    if name != point or (at and step != int(at)):
        return
    logger.warning("%s=%s: killing this job at %s (step %s)", FAULT_ENV, spec, point, step)
    _kill_session()


def _kill_session() -> None:
    """SIGKILL the job, then this process: every process of this session when the job leads its session
    (the leader carries FAULT_ENV: Ray's agents, started without it, go too), else only those with FAULT_ENV
    (never the shell of a user who typed the variable in front of a command)."""
    import signal

    import psutil

    me, sid = os.getpid(), os.getsid(0)
    try:
        whole_session = FAULT_ENV in psutil.Process(sid).environ()
    except (psutil.Error, OSError):
        whole_session = False
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if (
                proc.pid != me
                and os.getsid(proc.pid) == sid
                and (whole_session or FAULT_ENV in proc.environ())
            ):
                os.kill(proc.pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)
