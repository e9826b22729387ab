"""Checkpoint manager: the registry's commit protocol, retention and resume rules on real files, and megatron
save / load on a gloo world of one (round trip of weights, optimizer, scheduler, RNG and extra; async save;
crashes mid-save; HF export loading in transformers; clear errors for loads that cannot be right)."""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rlconf.config import RLConfig, TrainerConfig
from rlconf.errors import ConfigError
from rlconf.plan import compile_plan
from rltrain import checkpoint as ck
from rltrain.checkpoint import CheckpointError, CheckpointRegistry, engine_io

from .megatron._common import actor_of, critic_of

os.environ.setdefault("OMP_NUM_THREADS", "1")

# megatron warns about apex / Transformer Engine and deprecations on every build; torch about ShardedTensor.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


# ============================================================================================ registry
def _fake_save(reg: CheckpointRegistry, step: int, payload: bytes = b"weights") -> dict[str, str]:
    """What the workers do for one save, without megatron: role files, meta.json, manifest."""
    paths = reg.begin(step)
    for role, folder in paths.items():
        f = Path(folder)
        (f / "dist_ckpt").mkdir()
        (f / "dist_ckpt" / "__0_0.distcp").write_bytes(payload * 1000)
        contents = list(reg.contents[role]) if role in reg.contents else ["model"]
        (f / "meta.json").write_text(json.dumps({"role": role, "contents": contents}))
        ck.write_manifest(f, role)
    return paths


def _plan(tmp_path: Path, mode: str = "auto", resume_from: str | None = None):
    t = TrainerConfig(
        output_dir=str(tmp_path), save_freq=1, total_steps=8, resume_mode=mode, resume_from_path=resume_from
    )  # type: ignore[arg-type]
    return compile_plan(RLConfig(trainer=t))


@pytest.fixture
def reg(tmp_path) -> CheckpointRegistry:
    return CheckpointRegistry.from_plan(_plan(tmp_path))


def test_commit_publishes_only_complete_saves(reg: CheckpointRegistry):
    paths = _fake_save(reg, 1)
    # Staged, not published: no global_step_1, no latest file, nothing to resume.
    assert not reg.step_dir(1).exists() and not reg.latest_file.exists()
    assert Path(paths["actor"]).parent.name.startswith("global_step_1.tmp-")
    assert reg.complete_steps() == [] and reg.latest_complete() is None
    final = reg.commit(1)
    assert (
        final == reg.step_dir(1)
        and (final / "COMPLETE").is_file()
        and (final / "actor" / "manifest.json").is_file()
    )
    assert json.loads((final / "COMPLETE").read_text())["step"] == 1
    assert reg.latest_file.read_text().strip() == "1" and reg.latest_complete() == 1
    assert not Path(paths["actor"]).parent.exists()

    # A role without its manifest (its save never finished) and a truncated file both block the commit.
    paths = reg.begin(2)
    assert not reg.ready(2)
    with pytest.raises(CheckpointError, match="incomplete"):
        reg.commit(2)
    reg.abort(2)
    paths = _fake_save(reg, 2)
    with open(Path(paths["actor"]) / "dist_ckpt" / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="bytes, manifest says"):
        reg.commit(2)
    reg.abort(2)
    # A role that saved less than the plan asks for is not committed either.
    paths = _fake_save(reg, 2)
    (Path(paths["actor"]) / "meta.json").write_text(json.dumps({"role": "actor", "contents": ["model"]}))
    ck.write_manifest(paths["actor"], "actor")
    with pytest.raises(CheckpointError, match="lacks optimizer, extra of the planned save"):
        reg.commit(2)
    assert reg.latest_file.read_text().strip() == "1" and not reg.step_dir(2).exists()


def test_crash_mid_save_keeps_previous_and_cleanup_removes_partial(tmp_path, reg: CheckpointRegistry):
    _fake_save(reg, 1)
    reg.commit(1)
    partial = Path(reg.begin(2)["actor"])
    (partial / "meta.json").write_text("{}")  # some files written, then the process dies
    # Also: a marker-less global_step_3 written by us (its COMPLETE deleted by hand: the weights are intact)
    # and a foreign folder; neither is ever deleted.
    _fake_save(reg, 3)
    reg.commit(3)
    (reg.step_dir(3) / "COMPLETE").unlink()
    (reg.root / "global_step_4").mkdir()
    (reg.root / "global_step_4" / "weights.bin").write_bytes(b"x")
    stray = reg.root / f".{ck.LATEST_FILE}.tmp-0123abcd"  # a latest-file rewrite cut short
    stray.write_text("2")

    restarted = CheckpointRegistry.from_plan(_plan(tmp_path))
    removed = restarted.cleanup_incomplete()
    assert sorted(p.name for p in removed) == sorted([partial.parent.name, stray.name])
    assert (reg.root / "global_step_4" / "weights.bin").is_file()
    assert (reg.step_dir(3) / "actor" / "dist_ckpt" / "__0_0.distcp").is_file()
    with pytest.warns(UserWarning) as record:
        assert restarted.latest_complete() == 1  # the crash changed nothing published
    message = " ".join(str(w.message) for w in record)
    assert (
        "global_step_3 has no COMPLETE marker, though its files match their manifests; it is kept" in message
    )
    assert f"trainer.resume_from_path: {reg.step_dir(3)}" in message
    assert "global_step_4 has no COMPLETE marker: kept, not loaded" in message
    assert restarted.complete_steps() == [1] and restarted.check_complete(restarted.step_dir(1)) is None
    # Retention never deletes it either; naming it explicitly resumes from it (its files verified in full).
    assert restarted.apply_retention(1) == [] and reg.step_dir(3).is_dir()
    with pytest.warns(UserWarning, match="has no COMPLETE marker; every file of actor matches its manifest"):
        resume = restarted.resolve_resume(_plan(tmp_path, "resume_path", str(reg.step_dir(3))))
    assert (resume.step, resume.folder) == (3, reg.step_dir(3))


def test_resave_of_existing_step_replaces_it_and_interrupted_replace_is_recovered(reg: CheckpointRegistry):
    _fake_save(reg, 1, b"old")
    reg.commit(1)
    _fake_save(reg, 1, b"new")
    reg.commit(1)
    assert (reg.step_dir(1) / "actor" / "dist_ckpt" / "__0_0.distcp").read_bytes().startswith(b"new")
    assert [p.name for p in reg.root.iterdir() if p.name.startswith("global_step_1")] == ["global_step_1"]
    # Crash after moving the old step aside and before the new one landed: start-up puts the old one back.
    os.replace(reg.step_dir(1), reg.root / "global_step_1.old-abc123")
    CheckpointRegistry(reg.root).cleanup_incomplete()
    assert reg.is_complete(reg.step_dir(1))


def test_retention_keeps_newest_latest_named_and_in_progress(reg: CheckpointRegistry):
    for step in range(1, 6):
        _fake_save(reg, step)
        reg.commit(step)
        reg.apply_retention(2)
    assert reg.complete_steps() == [4, 5]
    # The latest file names an older step (e.g. after a resume from it): that one is protected too.
    reg.latest_file.write_text("4\n")
    _fake_save(reg, 6)  # in progress: staged, never touched
    staged = reg.pending_steps()
    assert reg.apply_retention(1) == []  # 5 is the newest, 4 is named by the latest file
    assert reg.complete_steps() == [4, 5] and staged == [6]
    reg.commit(6)
    assert reg.apply_retention(1) == [4, 5] and reg.complete_steps() == [6]
    assert reg.apply_retention(None) == []


def test_resume_modes(tmp_path, reg: CheckpointRegistry):
    auto = _plan(tmp_path, "auto")
    assert reg.resolve_resume(auto) is None  # nothing saved yet
    for step in (1, 2, 3):
        _fake_save(reg, step)
        reg.commit(step)
    step, folder = reg.resolve_resume(auto)
    assert (step, folder) == (3, reg.step_dir(3))
    assert reg.resolve_resume(auto).role_folder("actor") == reg.step_dir(3) / "actor"

    # A latest file naming a folder that is incomplete, missing or not a number: the newest complete one,
    # loudly; never a silent start from scratch.
    (reg.step_dir(3) / "COMPLETE").unlink()
    with pytest.warns(UserWarning, match="newest complete one, step 2"):
        assert reg.resolve_resume(auto).step == 2
    reg.latest_file.write_text("garbage")
    with pytest.warns(UserWarning, match="does not hold a step number"):
        assert reg.resolve_resume(auto).step == 2
    reg.latest_file.unlink()
    with pytest.warns(UserWarning, match="is missing"):
        assert reg.resolve_resume(auto).step == 2

    # disable: start fresh even though checkpoints exist (and say so).
    with pytest.warns(UserWarning, match="ignoring the checkpoints"):
        assert reg.resolve_resume(_plan(tmp_path, "disable")) is None

    # resume_path: a complete folder (or a role folder in one) ...
    good = reg.resolve_resume(_plan(tmp_path, "resume_path", str(reg.step_dir(1))))
    assert (good.step, good.folder) == (1, reg.step_dir(1))
    assert reg.resolve_resume(_plan(tmp_path, "resume_path", str(reg.step_dir(2) / "actor"))).step == 2
    # ... anything else is a ConfigError naming trainer.resume_from_path.
    with pytest.raises(ConfigError, match=r"trainer\.resume_from_path: .*nowhere does not exist"):
        reg.resolve_resume(_plan(tmp_path, "resume_path", str(tmp_path / "nowhere")))
    # Without its marker but intact, step 3 is taken when named explicitly; once a file is damaged, it is not.
    with pytest.warns(UserWarning, match="has no COMPLETE marker; every file of actor matches its manifest"):
        assert reg.resolve_resume(_plan(tmp_path, "resume_path", str(reg.step_dir(3)))).step == 3
    with open(reg.step_dir(3) / "actor" / "dist_ckpt" / "__0_0.distcp", "r+b") as f:
        f.truncate(3)
    for bad in (reg.step_dir(3), tmp_path):  # incomplete; the run folder: both show what can be picked
        with pytest.raises(ConfigError, match=r"trainer\.resume_from_path") as info:
            reg.resolve_resume(_plan(tmp_path, "resume_path", str(bad)))
        assert f"complete checkpoints in {reg.root}: steps [1, 2]" in str(info.value)
    # A small file changed after the save (same size, other bytes) is caught for an explicit path.
    meta = reg.step_dir(1) / "actor" / "meta.json"
    meta.write_text(meta.read_text().replace("actor", "ACTOR"))
    with pytest.raises(ConfigError, match=r"meta\.json: content differs from the manifest \(crc32"):
        reg.resolve_resume(_plan(tmp_path, "resume_path", str(reg.step_dir(1))))
    # A checkpoint without a role this run needs (a GRPO checkpoint for a PPO run) cannot resume it.
    ppo = CheckpointRegistry(reg.root, ["actor", "critic"])
    with pytest.raises(ConfigError, match="has no critic"):
        ppo.resolve_resume(_plan(tmp_path, "resume_path", str(reg.step_dir(2))))
    with pytest.raises(ConfigError, match="no resume_from_path"):
        reg.resolve_resume(replace(auto.checkpoint, resume_mode="resume_path", resume_from=None))


def test_only_incomplete_checkpoints_warn_before_starting_fresh(reg: CheckpointRegistry):
    reg.begin(1)
    (reg.root / "global_step_1").mkdir()
    with pytest.warns(UserWarning, match="none is complete"):
        assert reg.latest_complete() is None


# ============================================================================================ megatron


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from .megatron._common import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path_factory.mktemp("hf") / "qwen2_tiny")
    # A tokenizer file to check that the export carries it along.
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return path


def _actor(path: str | None = None, **megatron_kw):
    from rlconf.config import Optim

    from .megatron._common import actor_cfg, tiny_model_cfg

    cfg = actor_cfg(ppo_mini_batch_size=4, optim=Optim(lr=1e-2, clip_grad=1.0))
    cfg = replace(cfg, megatron=replace(cfg.megatron, **megatron_kw))
    return actor_of(tiny_model_cfg(path), cfg, "cpu", total_steps=8)


def _rl(actor) -> dict:
    from .megatron._common import make_batch

    batch = make_batch(b=8)
    old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
    return {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}


def _params(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for m in actor.modules() for p in m.parameters()]


def _draws(actor) -> list:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(4)
    return [
        torch.rand(4).tolist(),
        random.random(),
        np.random.rand(2).tolist(),
        tracked.tolist(),
        actor._sample_calls,
    ]


@pytest.mark.usefixtures("world")
@pytest.mark.slow
@pytest.mark.parametrize("dist_opt", [True, False], ids=["distributed_optimizer", "plain_optimizer"])
def test_round_trip_continues_exactly(tmp_path, hf_dir, dist_opt):
    """Save after one update; a fresh engine loads it and its next update equals the uninterrupted one."""
    reg = CheckpointRegistry(tmp_path / "checkpoints", ["actor"])
    a = _actor(str(hf_dir), use_distributed_optimizer=dist_opt)
    rl = _rl(a)
    a.update_policy(rl)
    a.generate(rl["input_ids"][:2, :6], 2, temperature=1.0)  # advances the sampler's call counter
    contents = ("model", "optimizer", "extra", "hf_model") if dist_opt else ("model", "optimizer", "extra")
    extra = {"step": 1, "dataloader": {"epoch": 0, "index": 3}, "kl_coef": 0.001}
    assert ck.save_engine(a, reg.begin(1)["actor"], contents, extra)
    reg.commit(1)
    saved_lp = a.compute_log_prob(rl, with_entropy=False)["log_probs"]
    expected_draws = _draws(a)
    a.update_policy(rl)
    a_next = _params(a)

    b = _actor(None, use_distributed_optimizer=dist_opt)  # random init: everything must come from disk
    step, folder = reg.resolve_resume(_plan(tmp_path).checkpoint)
    assert step == 1
    assert ck.load_engine(b, folder / "actor", ("model", "optimizer", "extra")) == extra
    assert _draws(b) == expected_draws  # python, numpy, torch, megatron tracker, sampler counter
    assert b.lr_scheduler.num_steps == a.lr_scheduler.num_steps - 1
    torch.testing.assert_close(
        b.compute_log_prob(rl, with_entropy=False)["log_probs"], saved_lp, atol=0, rtol=0
    )
    b.update_policy(rl)
    for x, y in zip(a_next, _params(b), strict=True):
        assert torch.equal(x, y)

    # The same load without the optimizer state continues differently: the check above has teeth.
    c = _actor(None, use_distributed_optimizer=dist_opt)
    ck.load_engine(c, folder / "actor", ("model", "extra"))
    c.update_policy(rl)
    assert any(not torch.equal(x, y) for x, y in zip(a_next, _params(c), strict=True))

    if dist_opt:
        _check_hf_export(folder / "actor", hf_dir, rl, saved_lp)


def _check_hf_export(role_folder: Path, hf_dir: Path, rl: dict, saved_lp: torch.Tensor) -> None:
    from .megatron._common import hf_logits, reference_log_probs

    hf = role_folder / "huggingface"
    assert (hf / "tokenizer_config.json").is_file()
    assert json.loads((hf / "config.json").read_text())["model_type"] == "qwen2"
    lp = reference_log_probs(hf_logits(hf, rl["input_ids"], rl["attention_mask"]), rl)
    torch.testing.assert_close(lp, saved_lp, atol=1e-5, rtol=1e-5)
    # hf_model alone initialises an engine's weights from that folder.
    d = _actor(None)
    ck.load_engine(d, role_folder, ("hf_model",))
    torch.testing.assert_close(
        d.compute_log_prob(rl, with_entropy=False)["log_probs"], saved_lp, atol=1e-5, rtol=1e-5
    )


@pytest.mark.usefixtures("world")
@pytest.mark.slow
def test_async_save_commits_only_after_finishing(tmp_path):
    reg = CheckpointRegistry(tmp_path / "checkpoints", ["actor"])
    a = _actor()
    rl = _rl(a)
    a.update_policy(rl)
    at_save = _params(a)
    staged = reg.begin(1)["actor"]
    done = ck.save_engine(a, staged, ("model", "optimizer", "extra"), {"step": 1}, async_save=True)
    assert done is False and ck.has_pending()
    assert not reg.ready(1)
    with pytest.raises(CheckpointError, match="incomplete"):
        reg.commit(1)
    a.update_policy(rl)  # training goes on while the save is written
    finished = ck.finalize_pending(blocking=True)
    assert finished == [staged] and not ck.has_pending()
    assert reg.ready(1)
    reg.commit(1)
    b = _actor()
    ck.load_engine(b, reg.step_dir(1) / "actor", ("model", "optimizer", "extra"))
    for x, y in zip(at_save, _params(b), strict=True):
        assert torch.equal(x, y)  # the state of the moment of the save, not of later updates


@pytest.mark.usefixtures("world")
@pytest.mark.slow
def test_crashes_mid_save_leave_previous_checkpoint(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    plan = _plan(tmp_path)
    reg = CheckpointRegistry.from_plan(plan)
    a = _actor()
    rl = _rl(a)
    a.update_policy(rl)
    ck.save_engine(a, reg.begin(1)["actor"], ("model", "optimizer", "extra"), {"step": 1})
    reg.commit(1)
    at_1 = _params(a)
    a.update_policy(rl)

    # 1. An exception inside the save after the dist checkpoint is written (the HF export fails).
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(engine_io, "_export_hf", boom)
    staged = reg.begin(2)["actor"]
    with pytest.raises(OSError, match="disk full"):
        ck.save_engine(a, staged, ("model", "optimizer", "extra", "hf_model"), {"step": 2})
    assert (Path(staged) / "dist_ckpt").is_dir() and not (Path(staged) / "manifest.json").exists()
    assert not reg.ready(2)
    monkeypatch.undo()

    # 2. The background writer dies mid-write (as under SIGKILL): finalize raises, nothing is committed.
    def die(*args, **kwargs):
        os._exit(9)

    monkeypatch.setattr(
        filesystem_async.FileSystemWriterAsync, "write_preloaded_data_multiproc", staticmethod(die)
    )
    staged3 = reg.begin(3)["actor"]
    assert not ck.save_engine(a, staged3, ("model", "optimizer", "extra"), {"step": 3}, async_save=True)
    with pytest.raises(CheckpointError, match="background checkpoint write failed"):
        ck.finalize_pending(blocking=True)
    monkeypatch.undo()
    assert not ck.has_pending() and not reg.ready(3)

    # The process "restarts": the partial folders go, step 1 is what resumes, and it loads.
    assert reg.latest_file.read_text().strip() == "1"
    restarted = CheckpointRegistry.from_plan(plan)
    assert len(restarted.cleanup_incomplete()) == 2
    step, folder = restarted.resolve_resume(plan)
    assert step == 1 and sorted(p.name for p in restarted.root.iterdir()) == ["global_step_1", ck.LATEST_FILE]
    b = _actor()
    assert ck.load_engine(b, folder / "actor", ("model", "optimizer", "extra")) == {"step": 1}
    for x, y in zip(at_1, _params(b), strict=True):
        assert torch.equal(x, y)


@pytest.mark.usefixtures("world")
@pytest.mark.slow
def test_loads_that_cannot_be_right_are_clear_errors(tmp_path):
    a = _actor()
    folder = tmp_path / "global_step_1" / "actor"
    ck.save_engine(a, folder, ("model", "optimizer"), {})
    with pytest.raises(CheckpointError, match=r"actor\.checkpoint\.load_contents asks for extra"):
        ck.load_engine(_actor(), folder, ("model", "optimizer", "extra"))
    with pytest.raises(CheckpointError, match=r"add model to actor\.checkpoint\.load_contents"):
        ck.load_engine(_actor(), folder, ("optimizer",))
    # Optimizer state of the distributed optimizer into a plain one: refused, naming both ways out.
    plain = _actor(use_distributed_optimizer=False)
    with pytest.raises(
        CheckpointError,
        match=r"use_distributed_optimizer.*drop optimizer from actor\.checkpoint\.load_contents",
    ):
        ck.load_engine(plain, folder, ("model", "optimizer"))
    ck.load_engine(plain, folder, ("model",))  # the weights alone are fine
    for x, y in zip(_params(a), _params(plain), strict=True):
        assert torch.equal(x, y)
    # An incomplete role folder is never loaded.
    (folder / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ck.load_engine(_actor(), folder, ("model",))


@pytest.mark.usefixtures("world")
@pytest.mark.slow
def test_critic_round_trip_and_no_hf_form(tmp_path):
    from rlconf.config import CriticConfig, Optim

    from .megatron._common import tiny_model_cfg

    cfg = CriticConfig(enable=True, ppo_mini_batch_size=8, optim=Optim(lr=1e-2))

    def critic():
        return critic_of(tiny_model_cfg(), cfg, "cpu", total_steps=8)

    a = critic()
    rl = _rl(_actor())
    values = a.compute_values(rl)
    vb = {**rl, "values": values, "returns": torch.ones_like(values) * rl["response_mask"]}
    a.update_critic(vb)
    folder = tmp_path / "global_step_1" / "critic"
    # A value head has no causal-LM form: hf_model is skipped with a warning naming the setting.
    with pytest.warns(UserWarning, match=r"drop hf_model from critic\.checkpoint\.save_contents"):
        ck.save_engine(a, folder, ("model", "optimizer", "extra", "hf_model"), {"step": 1})
    assert not (folder / "huggingface").exists()
    assert ck.read_role_meta(folder)["contents"] == ["model", "optimizer", "extra"]
    b = critic()
    assert ck.load_engine(b, folder, ("model", "optimizer", "extra")) == {"step": 1}
    m_a, m_b = a.update_critic(vb), b.update_critic(vb)
    assert m_a["critic/vf_loss"] == m_b["critic/vf_loss"]
    for x, y in zip(_params(a), _params(b), strict=True):
        assert torch.equal(x, y)
    # A critic checkpoint is no policy: loading it into an actor is refused.
    with pytest.raises(CheckpointError, match="saved for another model"):
        ck.load_engine(_actor(), folder, ("model",))


@pytest.mark.usefixtures("world")
def test_saves_collect_their_write_results_without_a_manager_process(tmp_path, hf_dir, monkeypatch):
    """megatron's own write-results queue is a Manager started by spawn (seconds on a first save, a process
    kept alive): a synchronous save and an asynchronous one (a forked writer) hand their results through
    rlplan's queue instead, start no process that outlives them, and leave the queue empty."""
    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from rltrain.checkpoint.results_queue import WriteResultsQueue

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh process
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    reg = CheckpointRegistry(tmp_path / "checkpoints", ["actor"])
    a = _actor(str(hf_dir))
    assert ck.save_engine(a, reg.begin(1)["actor"], ("model", "optimizer", "extra"), {"step": 1})
    queue = filesystem_async._results_queue
    assert isinstance(queue, WriteResultsQueue) and queue.empty()
    staged = reg.begin(2)["actor"]
    assert ck.save_engine(a, staged, ("model", "optimizer", "extra"), {"step": 2}, async_save=True) is False
    assert ck.finalize_pending(blocking=True) == [staged]
    assert filesystem_async._results_queue is queue and queue.empty()
    reg.commit(1)
    reg.commit(2)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left


def _send_results(q, payload: bytes) -> None:
    q.put({"payload": payload, "size": torch.Size([len(payload)])})


def test_write_results_cross_the_fork_whole_and_a_silent_writer_is_reported(monkeypatch):
    """The owner's own put, and two forked writers' results larger than a pipe's buffer sent at once,
    arrive whole; a writer that dies before sending leaves an empty read after the arrival wait (megatron
    then reports the missing results), not a hang."""
    import multiprocessing
    import queue as queue_module

    from rltrain.checkpoint import results_queue

    q = results_queue.WriteResultsQueue()
    q.put("own")
    assert q.get_nowait() == "own"
    ctx = multiprocessing.get_context("fork")
    payloads = [bytes([i]) * (3 << 20) for i in (1, 2)]  # 3 MiB each: many pipe buffers
    writers = [ctx.Process(target=_send_results, args=(q, p)) for p in payloads]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    got = sorted((q.get_nowait() for _ in writers), key=lambda r: r["payload"][0])
    assert [r["payload"] for r in got] == payloads
    assert [r["size"] for r in got] == [torch.Size([3 << 20])] * 2
    silent = ctx.Process(target=os._exit, args=(0,))
    silent.start()
    silent.join(60)
    monkeypatch.setattr(results_queue, "ARRIVAL_WAIT_S", 0.2)
    with pytest.raises(queue_module.Empty):
        q.get_nowait()


def _save_in_fork(conn) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from rltrain.checkpoint import results_queue

    inherited = filesystem_async._results_queue
    own = results_queue.install()
    own.put("mine")
    conn.send((own is not inherited, own.owner == os.getpid(), own.get_nowait()))


def test_a_process_forked_from_a_saver_gets_its_own_results_queue(monkeypatch):
    """The inherited queue's reader thread lives in the parent: a forked process that saves installs its
    own, while the parent keeps its."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from rltrain.checkpoint import results_queue

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    parent = results_queue.install()
    assert results_queue.install() is parent  # once per process
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_save_in_fork, args=(send,))
    child.start()
    assert recv.recv() == (True, True, "mine")
    child.join(60)
    assert child.exitcode == 0 and filesystem_async._results_queue is parent
