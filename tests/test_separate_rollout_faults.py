"""Attacks on the separate rollout pool (issue 24): faults in the weight push (a sender that dies or stalls
mid-push), signals while the producer thread generates ahead, and push timeouts a run cannot honour. Each
must end the run with the user-facing message (role and rank, or the stop line), exit 1 / 130 / 143,
no hang, no traceback, and leave a run folder that the same command resumes.

The fast tests run the push groups in threads of this process (real gloo groups on a real TCP store); the
runs are slow and multi-process, as tests/test_separate_rollout_e2e.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from presets import PRESETS
from rlconf.errors import ConfigError
from rlconf.load import load_config
from rlconf.plan import compile_plan
from rltrain.rollout import push
from rltrain.rollout.weight_sync import receive_weights, send_weights
from tests.test_e2e import metrics, rltrain
from tests.test_signals import ENV, kill_session, logged_steps

SEPARATE = ("--rollout.placement", "separate", "--rollout.num_devices", "1")
OFF_POLICY = ("tiny-grpo", "--cluster.gpus_per_node", "3", *SEPARATE, "--algorithm.off_policy_steps", "1")


# ------------------------------------------------------------------------------------------ fast: push
def _push_pair(timeout_s: float) -> tuple[push.PushGroup, push.PushGroup]:
    """A sender and a receiver push group of stage 0 on one store (the receiver's set-up runs in a thread:
    the group's creation is collective)."""
    store, port = push.host_store(timeout_s)
    endpoint = push.PushEndpoint("127.0.0.1", port, timeout_s, senders=1, receivers=1)
    out: dict[str, push.PushGroup] = {}
    t = threading.Thread(
        target=lambda: out.setdefault(
            "r", push.PushGroup(push.connect_store(endpoint), 0, 1, 2, "cpu", timeout_s)
        )
    )
    t.start()
    sender = push.PushGroup(store, 0, 0, 2, "cpu", timeout_s)
    t.join()
    return sender, out["r"]


def test_a_stalled_sender_makes_the_receiver_time_out_not_hang(monkeypatch):
    """`sender_stalls@1`: the sender stops after its first bucket header for longer than the push timeout.
    The receiver, inside the push's collectives, fails after about push_timeout_s: no collective of a push
    group waits forever."""
    monkeypatch.setenv(push.FAULT_ENV, "sender_stalls@1")
    sender, receiver = _push_pair(timeout_s=2.0)
    named = [("model.embed_tokens.weight", torch.randn(8, 4)), ("lm_head.weight", torch.randn(8, 4))]
    errors: list[BaseException] = []

    def recv() -> None:
        try:
            receive_weights(lambda pairs: None, receiver, 0, version=1)
        except BaseException as exc:
            errors.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=recv, daemon=True)
    t.start()
    with contextlib.suppress(RuntimeError):  # after the stall its peer has given up (or not: a send may land)
        send_weights(iter(named), sender, 0, bucket_bytes=64, version=1)
    t.join(timeout=30)
    assert not t.is_alive(), "the receiver still waits in the push"
    assert errors and time.monotonic() - t0 < 20, errors
    # The user reads what broke and which setting bounds it, not a gloo source path.
    message = str(errors[0])
    assert "weight push of stage 0" in message and "rollout.push_timeout_s = 2" in message, message
    assert "timed out" in message.lower() and ".cc:" not in message, message


def test_an_unknown_fault_spec_is_an_error(monkeypatch):
    monkeypatch.setenv(push.FAULT_ENV, "sender_explodes@1")
    with pytest.raises(ValueError, match="sender_dies"):
        push.receiver_fault(0, 1)


# ------------------------------------------------------------------------------------------ blame
class _Side:
    """One side of a push: the trainer's sender sees its peer's socket close and fails at once (what gloo
    raises), while the receiver's process is the one that died (Ray reports a death a moment later)."""

    def __init__(self, role: str, rank: int, world_size: int, master_addr: str, master_port: int):
        self.role = role

    def ready(self) -> None:
        """Both sides are up before the push, as in a run (an actor still starting would not die in time)."""

    def push(self) -> None:
        if self.role == "actor":
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
        time.sleep(1.0)
        os._exit(1)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_push_that_breaks_because_a_peer_died_names_the_dead_worker(tmp_path):
    """Found by killing the rollout worker while it generated ahead: the run stopped with `actor worker
    rank 0 failed: RuntimeError: ... Connection reset by peer`, blaming the healthy trainer. The rank that
    died is the cause and must be the one named."""
    import ray

    from rltrain.ray_group import Pool, WorkerError, WorkerGroup, start_ray, wait_all

    os.environ["RAY_AUTH_MODE"] = "disabled"
    start_ray(None, num_cpus=2, temp_dir=tempfile.mkdtemp(prefix="rlray", dir="/tmp"))
    try:
        pool = Pool.reserve("push", 1, "cpu", 0.5, 2)
        trainer = WorkerGroup("actor", _Side, pool, 1, "cpu", 0.5, {})
        rollout = WorkerGroup("rollout", _Side, pool, 1, "cpu", 0.5, {})
        wait_all([(trainer, trainer.submit("ready", [()])), (rollout, rollout.submit("ready", [()]))])
        with pytest.raises(WorkerError) as info:
            wait_all([(trainer, trainer.submit("push", [()])), (rollout, rollout.submit("push", [()]))])
        assert (info.value.role, info.value.rank, info.value.died) == ("rollout", 0, True), str(info.value)
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------------------ fast: config
@pytest.mark.parametrize("timeout", ["1e-9", "1e300"])
def test_a_push_timeout_the_groups_cannot_honour_is_refused(timeout):
    """1e-9 s cannot even open the store's connection; 1e300 s overflows the process group's timeout."""
    overrides = ["cluster.gpus_per_node=3", "rollout.placement=separate", "rollout.num_devices=1",
                 f"rollout.push_timeout_s={timeout}"]  # fmt: skip
    with pytest.raises(ConfigError) as info:
        compile_plan(load_config(None, preset="tiny-grpo", overrides=overrides, presets=PRESETS))
    assert "rollout.push_timeout_s" in str(info.value)


# ------------------------------------------------------------------------------------------ runs
RUN = (*OFF_POLICY, "--trainer.total_steps", "5", "--trainer.save_freq", "2")


def _faulted(out, fault: str, *flags: str) -> subprocess.CompletedProcess[str]:
    os.environ[push.FAULT_ENV] = fault
    try:
        return rltrain(*RUN, "--trainer.output_dir", str(out), *flags, timeout=400)
    finally:
        del os.environ[push.FAULT_ENV]


def _resumes(out, *flags: str) -> None:
    """The same command ends the run: steps 1-5 each logged once, the resumed step after the checkpoint
    generated with the checkpoint's weights (the first push of a resumed run)."""
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = rltrain(*RUN, "--trainer.output_dir", str(out), *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "(step 2)" in resumed.stdout
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["rollout/weight_version"] == 2


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_trainer_rank_dying_mid_push_stops_the_run_naming_it_and_it_resumes(tmp_path):
    """The sender exits after the first bucket header of the push of version 3, the rollout rank waiting
    for the bucket's bytes: the run stops at once (not after the push timeout) naming the dead trainer
    rank, exit 1, no traceback; the same command resumes."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    failed = _faulted(out, "sender_dies@3", "--rollout.push_timeout_s", "300")
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert time.monotonic() - t0 < 250  # the push timeout (300 s) was not what ended it
    assert "error: actor worker rank 0 died" in failed.stderr, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    _resumes(out, "--rollout.push_timeout_s", "300")


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_stuck_push_times_out_naming_a_rank_and_the_run_resumes(tmp_path):
    """The sender stalls mid-push for longer than rollout.push_timeout_s (10 s): the rollout rank's
    collective times out, the run stops naming it (exit 1, no hang, no traceback) and resumes."""
    out = tmp_path / "run"
    failed = _faulted(out, "sender_stalls@3", "--rollout.push_timeout_s", "10")
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "error: rollout worker rank 0 failed: PushError: weight push of stage 0" in failed.stderr, (
        failed.stderr[-3000:]
    )
    assert "rollout.push_timeout_s = 10" in failed.stderr
    assert "Traceback" not in failed.stderr
    _resumes(out, "--rollout.push_timeout_s", "10")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_a_signal_while_the_producer_generates_ahead_stops_cleanly_and_resumes(tmp_path, signum, code):
    """With off_policy_steps 1 the producer thread is almost always generating the next batch: a signal
    to the driver stops the run with its exit code and one stop line (no traceback from the thread), and
    the same command resumes with every step logged once."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rltrain.cli", *OFF_POLICY, "--trainer.total_steps", "200", "--trainer.save_freq",
           "3", "--trainer.output_dir", str(out)]  # fmt: skip
    err_path = tmp_path / "stderr.txt"
    with open(tmp_path / "stdout.txt", "w") as so, open(err_path, "w") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len(logged_steps(out)) < 7:
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 7"
            time.sleep(0.1)
        os.kill(proc.pid, signum)
        assert proc.wait(timeout=120) == code
    finally:
        kill_session(proc.pid)
        proc.kill()
        proc.wait()
    stderr = err_path.read_text()
    assert "Traceback" not in stderr and "Exception in thread" not in stderr, stderr[-3000:]
    lines = [
        line for line in stderr.splitlines() if line.startswith(f"stopped by {signal.Signals(signum).name}: ")
    ]
    assert len(lines) == 1, stderr[-3000:]
    resume_step = int(re.search(r"resume from step (\d+)", lines[0]).group(1))
    assert resume_step >= 6
    cmd[cmd.index("200")] = str(resume_step + 2)
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, resume_step + 3))
    # The resumed batch was generated with the checkpoint's weights: it missed no update.
    assert rows[resume_step]["off_policy/staleness"] == 0
    assert rows[resume_step]["rollout/weight_version"] == resume_step


def test_a_separate_rollout_tp_need_not_divide_the_trainer_pool():
    """Three trainer devices (dp 3) and a rollout of tp 2 on two devices of its own: a valid split."""
    plan = compile_plan(load_config(None, preset="tiny-grpo", presets=PRESETS, overrides=[
        "cluster.gpus_per_node=5", "rollout.placement=separate", "rollout.num_devices=2",
        "rollout.tensor_model_parallel_size=2", "data.train_batch_size=6", "actor.ppo_mini_batch_size=6"]))  # fmt: skip
    assert plan.layout("actor").dp == 3 and plan.layout("rollout").tp == 2 and plan.layout("rollout").dp == 1
