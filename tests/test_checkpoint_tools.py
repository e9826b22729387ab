"""Checkpoint tools and damaged checkpoints: `rltrain inspect`, `rltrain export-hf`, manifest verification of
truncated or overwritten files (at load, in inspect, and the fallback of resume_mode auto), and the choice
of the checkpoint to resume when the latest file is stale.

The registry tests write checkpoints the way the workers do, without megatron (fast). The export tests
build a real actor in a gloo world of one (in-process), and export a checkpoint that a TP=2 training run
saved (the CLI, in a subprocess) to compare with the HF export the run wrote itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlconf.config import ModelConfig, RLConfig, TrainerConfig
from rlconf.load import config_to_dict, dump_yaml
from rlconf.plan import compile_plan
from rltrain import checkpoint as ck
from rltrain.checkpoint import CheckpointError, CheckpointRegistry, faults, manifest, tools

from .megatron._common import actor_of

os.environ.setdefault("OMP_NUM_THREADS", "1")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

BIG = 3 << 20  # a tensor shard of a few MiB (older manifests kept only a sampled digest of files > 1 MiB)


# ============================================================================================ registry
def _plan(out: Path):
    return compile_plan(RLConfig(trainer=TrainerConfig(output_dir=str(out), save_freq=1, total_steps=8)))


def _save(reg: CheckpointRegistry, step: int, shard_bytes: int = BIG) -> Path:
    """A committed checkpoint as the workers write it: a large tensor file, small files, meta, manifest."""
    paths = reg.begin(step)
    for role, folder in paths.items():
        f = Path(folder)
        (f / "dist_ckpt").mkdir()
        (f / "dist_ckpt" / "__0_0.distcp").write_bytes(os.urandom(shard_bytes))
        (f / "dist_ckpt" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        meta = {
            "format": ck.FORMAT,
            "role": role,
            "contents": list(reg.contents.get(role, ("model",))),
            "layout": {"world_size": 4, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                       "virtual_pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                       "expert_model_parallel_size": 1, "data_parallel_size": 1},
            "distributed_optimizer": True,
            "optimizer_sharding": ck.OPTIM_SHARDING,
            "params_dtype": "bfloat16",
            "arch": {"num_layers": 2, "hidden_size": 64, "vocab_size": 32},
            "value_head": False,
        }  # fmt: skip
        (f / "meta.json").write_text(json.dumps(meta))
        (f / "extra.json").write_text(json.dumps({"extra": {"step": step}, "lr_scheduler": None}))
        ck.write_manifest(f, role)
    return reg.commit(step)


@pytest.fixture
def reg(tmp_path) -> CheckpointRegistry:
    return CheckpointRegistry.from_plan(_plan(tmp_path / "run"))


def _zero_block(path: Path, offset: int, n: int = 4096) -> None:
    """Overwrite n bytes with zeros in place (same size): what a lost page looks like after a power loss."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * n)


def test_manifest_digests_cover_every_byte(reg: CheckpointRegistry):
    folder = _save(reg, 1) / "actor"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["digest"] == {"algorithm": "crc32", "block_bytes": 64 << 20}
    assert set(manifest["files"]) == {
        "dist_ckpt/__0_0.distcp",
        "dist_ckpt/metadata.json",
        "extra.json",
        "meta.json",
    }
    assert all(len(e["crc32"]) == 1 for e in manifest["files"].values())
    assert ck.verify_manifest(folder) == []
    tensor = folder / "dist_ckpt" / "__0_0.distcp"
    # One byte changed in the middle of a large file: same size, so only the full check sees it.
    with open(tensor, "r+b") as f:
        f.seek(BIG // 2 + 12345)
        old = f.read(1)
        f.seek(BIG // 2 + 12345)
        f.write(bytes([old[0] ^ 0x10]))
    assert ck.verify_manifest(folder, full=False) == []
    assert ck.verify_manifest(folder) == [
        f"{tensor}: content differs from the manifest (crc32 of bytes 0-{BIG})"
    ]
    with open(tensor, "r+b") as f:
        f.truncate(BIG - 1)
    assert ck.verify_manifest(folder, full=False) == [
        f"{tensor}: {BIG - 1} bytes, manifest says {BIG} (truncated or overwritten)"
    ]
    # A file that appeared after the save is not covered by any digest: named too.
    (folder / "dist_ckpt" / "__1_0.distcp").write_bytes(b"x")
    assert f"{folder / 'dist_ckpt' / '__1_0.distcp'}: not in the manifest" in ck.verify_manifest(folder)[-1]


def test_blocks_locate_the_damage(reg: CheckpointRegistry, monkeypatch):
    monkeypatch.setattr(manifest, "_DIGEST_BLOCK", 1 << 20)  # 3 blocks of 1 MiB, hashed by the thread pool
    folder = _save(reg, 1) / "actor"
    tensor = folder / "dist_ckpt" / "__0_0.distcp"
    assert (
        len(json.loads((folder / "manifest.json").read_text())["files"]["dist_ckpt/__0_0.distcp"]["crc32"])
        == 3
    )
    _zero_block(tensor, (2 << 20) + 100, 8)
    assert ck.verify_manifest(folder) == [
        f"{tensor}: content differs from the manifest (crc32 of bytes {2 << 20}-{3 << 20})"
    ]


def test_zeroed_megabyte_inside_a_48mb_shard_is_caught_by_inspect_export_and_resume(
    tmp_path, capsys, reg: CheckpointRegistry
):
    """The issue's case: 1 MB of zeros in the middle of a 48 MB shard passed the sampled digest everywhere."""
    size = 48 << 20
    _save(reg, 1, shard_bytes=size)
    step2 = _save(reg, 2, shard_bytes=size)
    shard = step2 / "actor" / "dist_ckpt" / "__0_0.distcp"
    _zero_block(shard, size // 2 - (1 << 19), 1 << 20)

    code, out, err = _inspect(capsys, str(step2))
    assert code == 2 and "verified    FAILED" in out and err.count("\n") == 1
    assert err.startswith(f"error: {shard}: content differs from the manifest (crc32 of bytes 0-{size})")
    code = tools.main(["export-hf", str(step2), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {shard}: content differs") and "is damaged" in err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(CheckpointError, match=rf"{shard}: content differs .* is damaged"):
        ck.load_engine(None, step2 / "actor", ("model",))  # type: ignore[arg-type]
    with pytest.warns(
        UserWarning, match=r"latest checkpoint not usable .*__0_0\.distcp: content differs.* step 1"
    ):
        assert reg.resolve_resume(_plan(tmp_path / "run")).step == 1


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "small_file"])
def test_resume_auto_falls_back_to_the_previous_intact_checkpoint(tmp_path, reg: CheckpointRegistry, damage):
    _save(reg, 1)
    newest = _save(reg, 2) / "actor"
    if damage == "truncated":
        bad = newest / "dist_ckpt" / "__0_0.distcp"
        with open(bad, "r+b") as f:
            f.truncate(1000)
        expected = "1000 bytes, manifest says"
    elif damage == "zeroed":
        bad = newest / "dist_ckpt" / "__0_0.distcp"
        _zero_block(bad, BIG - 10_000)
        expected = "content differs from the manifest (crc32"
    else:
        bad = newest / "extra.json"
        bad.write_text(bad.read_text().replace('"step": 2', '"step": 7'))
        expected = "content differs from the manifest (crc32"
    with pytest.warns(UserWarning, match="resuming from the newest complete one, step 1") as record:
        resume = reg.resolve_resume(_plan(tmp_path / "run"))
    assert resume.step == 1
    message = str(record[0].message)
    assert str(bad) in message and expected in message, message


def test_load_refuses_a_damaged_role_folder_naming_the_file(reg: CheckpointRegistry):
    folder = _save(reg, 1) / "actor"
    bad = folder / "dist_ckpt" / "__0_0.distcp"
    _zero_block(bad, 0)
    # load_engine checks the manifest before it touches the engine (None is never used).
    with pytest.raises(CheckpointError, match=rf"{bad}: content differs .* is damaged.*resume_mode: auto"):
        ck.load_engine(None, folder, ("model",))  # type: ignore[arg-type]


def _touch(path: Path, when: float) -> None:
    os.utime(path, (when, when))


def test_resume_picks_the_last_commit_even_when_the_latest_file_lags(tmp_path, reg: CheckpointRegistry):
    plan = _plan(tmp_path / "run")
    for step in (1, 2, 3):
        _save(reg, step)
    now = time.time()
    for step in (1, 2, 3):
        _touch(reg.step_dir(step) / "COMPLETE", now - 100 + 10 * step)
    # Killed between publishing step 3 and rewriting the latest file: it still names step 2, written
    # before step 3's marker.
    reg.latest_file.write_text("2\n")
    _touch(reg.latest_file, now - 100 + 25)
    with pytest.warns(UserWarning, match="names step 2, but step 3 was committed after"):
        assert reg.resolve_resume(plan).step == 3
    # A user who points the latest file at an older step (written after every commit) is obeyed, silently.
    reg.latest_file.write_text("1\n")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.resolve_resume(plan).step == 1
    # ... unless that one is damaged: then the newest intact commit, saying why.
    with open(reg.step_dir(1) / "actor" / "dist_ckpt" / "__0_0.distcp", "r+b") as f:
        f.truncate(5)
    with pytest.warns(UserWarning, match=r"latest checkpoint not usable .*global_step_1.* step 3"):
        assert reg.resolve_resume(plan).step == 3


# ============================================================================================ malformed files
# Each: (what, file under checkpoints/ relative to global_step_2 or the root, bytes written there).
_MALFORMED_LATEST = {
    "5000 digits": b"9" * 5000,
    "arabic-indic digit": "\u0663".encode(),
    "superscript two": "\u00b2\n".encode(),
    "not utf-8": b"\xff\xfe2",
    "negative": b"-2",
    "zero": b"0\n",
    "empty": b"",
}
_MALFORMED_MARKER = {
    "truncated json": b'{"step": 2, "roles": ["act',
    "a list": b"[]",
    "5000-digit step": b'{"step": ' + b"9" * 5000 + b', "roles": ["actor"]}',
    "step of another folder": b'{"step": 7, "roles": ["actor"]}',
    "step is text": b'{"step": "2", "roles": ["actor"]}',
    "roles is a string": b'{"step": 2, "roles": "actor"}',
    "role outside the folder": b'{"step": 2, "roles": ["../../.."]}',
    "nested brackets": b"[" * 100_000,
    "not utf-8": b'{"step": 2, "roles": ["\xff"]}',
}
_MALFORMED_MANIFEST = {
    "truncated json": b'{"format": "rlplan',
    "files is a list": b'{"format": "rlplan-megatron-checkpoint/1", "files": []}',
    "entry without size": b'{"format": "rlplan-megatron-checkpoint/1", "files": {"meta.json": {"crc32": [1]}}}',
    "path outside the folder": b'{"format": "rlplan-megatron-checkpoint/1", "digest": {"algorithm": "crc32", '
    b'"block_bytes": 67108864}, "files": {"../../../COMPLETE": {"size": 1, "crc32": [1]}}}',
    "absolute path": b'{"format": "rlplan-megatron-checkpoint/1", "digest": {"algorithm": "crc32", '
    b'"block_bytes": 67108864}, "files": {"/etc/hostname": {"size": 1, "crc32": [1]}}}',
    "crc list too short": b'{"format": "rlplan-megatron-checkpoint/1", "digest": {"algorithm": "crc32", '
    b'"block_bytes": 1}, "files": {"meta.json": {"size": 5, "crc32": [1]}}}',
    "empty files table": b'{"format": "rlplan-megatron-checkpoint/1", "files": {}}',
    "nested brackets": b"[" * 100_000,
}


@pytest.mark.parametrize(
    ("kind", "case"),
    [("latest", c) for c in _MALFORMED_LATEST]
    + [("marker", c) for c in _MALFORMED_MARKER]
    + [("manifest", c) for c in _MALFORMED_MANIFEST],
)
def test_malformed_latest_marker_or_manifest_falls_back_and_inspect_says_why(
    tmp_path, capsys, reg: CheckpointRegistry, kind, case
):
    _save(reg, 1)
    step2 = _save(reg, 2)
    if kind == "latest":
        bad, data = reg.latest_file, _MALFORMED_LATEST[case]
    elif kind == "marker":
        bad, data = step2 / "COMPLETE", _MALFORMED_MARKER[case]
    else:
        bad, data = step2 / "actor" / "manifest.json", _MALFORMED_MANIFEST[case]
    bad.write_bytes(data)

    # resume_mode auto: the newest intact checkpoint, with a warning naming the file.
    expected = 2 if kind == "latest" else 1
    with pytest.warns(UserWarning, match="resuming from the newest complete one") as record:
        assert reg.resolve_resume(_plan(tmp_path / "run")).step == expected
    assert str(bad) in str(record[0].message), str(record[0].message)
    # Start-up clean-up never touches global_step_N folders, whatever their markers say.
    assert reg.cleanup_incomplete() == [] and step2.is_dir() and (step2 / "actor" / "dist_ckpt").is_dir()

    # inspect: one line naming the file, exit 2 (for the checkpoint, or the checkpoints folder when the latest
    # file is the broken part), never a traceback.
    code, out, err = _inspect(capsys, str(reg.root if kind == "latest" else step2))
    assert code == 2 and err.count("\n") == 1 and str(bad) in err, (code, err)
    if kind == "latest":
        assert "does not hold a step number" in err and "echo 2 >" in err
    else:
        assert "INCOMPLETE" in out or "FAILED" in out
        code, out, _ = _inspect(capsys, str(step2), "--json")
        assert code == 2 and not json.loads(out)["ok"]
        # export-hf refuses it too (before any model is built).
        code = tools.main(["export-hf", str(step2), str(tmp_path / "hf")])
        err = capsys.readouterr().err
        assert code == 2 and str(bad) in err and not (tmp_path / "hf").exists()
    # The listing of the run works either way.
    code, out, _ = _inspect(capsys, str(reg.root.parent))
    assert code == (2 if kind == "latest" else 0) and "global_step" not in out.splitlines()[0]


def test_deleting_only_complete_keeps_the_weights(tmp_path, capsys, reg: CheckpointRegistry):
    _save(reg, 1)
    step2 = _save(reg, 2)
    (step2 / "COMPLETE").unlink()
    assert reg.cleanup_incomplete() == []
    with pytest.warns(UserWarning, match="has no COMPLETE marker, though its files match their manifests"):
        assert reg.resolve_resume(_plan(tmp_path / "run")).step == 1
    assert (step2 / "actor" / "dist_ckpt" / "__0_0.distcp").stat().st_size == BIG
    code, out, err = _inspect(capsys, str(reg.root))
    assert code == 0 and "unmarked" in out
    code, out, err = _inspect(capsys, str(step2))
    assert code == 2 and "kept" in out and "has no COMPLETE marker" in err


# ============================================================================================ inspect
def _inspect(capsys, *args: str) -> tuple[int, str, str]:
    code = tools.main(["inspect", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_inspect_shows_a_checkpoint_and_its_layout(capsys, reg: CheckpointRegistry):
    folder = _save(reg, 3)
    code, out, err = _inspect(capsys, str(folder))
    assert code == 0 and err == ""
    assert f"checkpoint  {folder}" in out and "step        3" in out
    assert "status      complete" in out and "latest      yes" in out
    assert "verified    ok: 4 files match their manifests (sizes; crc32 of every byte of 4)" in out
    assert "TP=2 PP=2 VPP=1 CP=1 EP=1 DP=1 (world 4)" in out and "distributed, fully_reshardable" in out
    assert "model, optimizer, extra" in out and "bfloat16" in out
    assert "3.15 MB  dist_ckpt/__0_0.distcp" in out
    # A role folder names the same checkpoint; --json carries the same facts.
    code, out, _ = _inspect(capsys, str(folder / "actor"), "--json")
    report = json.loads(out)
    assert code == 0 and report["step"] == 3 and report["complete"] and report["verified"]
    actor = report["roles"]["actor"]
    assert actor["layout"]["tensor_model_parallel_size"] == 2 and actor["saved_step"] == 3
    assert {"path": "dist_ckpt/__0_0.distcp", "bytes": BIG} in actor["files"]
    # The run folder (or checkpoints/) lists every step.
    _save(reg, 4)
    code, out, _ = _inspect(capsys, str(reg.root.parent))
    assert code == 0 and "latest      step 4 (*)" in out
    assert [line.split()[:2] for line in out.splitlines() if line[:1].isdigit()] == [
        ["3", "complete"], ["4", "*"]
    ]  # fmt: skip


def test_inspect_errors_are_one_line_exit_2(capsys, tmp_path, reg: CheckpointRegistry):
    folder = _save(reg, 1)
    code, out, err = _inspect(capsys, str(reg.root / "global_step_9"))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {reg.root / 'global_step_9'} does not exist") and "steps [1]" in err
    bad = folder / "actor" / "dist_ckpt" / "__0_0.distcp"
    with open(bad, "r+b") as f:
        f.truncate(100)
    code, out, err = _inspect(capsys, str(folder))
    assert code == 2 and "verified    FAILED" in out
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: 100 bytes, manifest says {BIG}")
    assert "resume_mode: auto" in err
    code, out, err = _inspect(capsys, str(folder), "--json")
    assert code == 2 and json.loads(out)["problems"] == [
        f"{bad}: 100 bytes, manifest says {BIG} (truncated or overwritten)"
    ]

    # An unfinished save (staging folder, no COMPLETE marker) and a missing folder.
    reg.begin(2)
    (staged,) = reg.root.glob("global_step_2.tmp-*")
    code, out, err = _inspect(capsys, str(staged))
    assert code == 2 and "INCOMPLETE" in out and err.count("\n") == 1
    assert "has no COMPLETE marker" in err and "use an earlier complete checkpoint" in err
    code, _, err = _inspect(capsys, str(tmp_path / "empty_dir_that_is_missing"))
    assert code == 2 and "does not exist" in err


def test_cli_dispatch_no_traceback(tmp_path):
    """`rltrain inspect` through the real entry point: exit 2 and one line, never a traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "inspect", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "RLPLAN_DEBUG": ""},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert f"{tmp_path / 'nope'} does not exist" in result.stderr


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_export_hf_never_writes_into_or_over_a_run(tmp_path, capsys, reg: CheckpointRegistry, overwrite):
    """`export-hf CKPT RUN --overwrite` deleted the run; every OUT that is, holds or lies inside a run folder or
    checkpoint is refused (exit 2, one line with the fix), before any model is built, and nothing changes."""
    step = _save(reg, 1)
    run = reg.root.parent
    for name in ("config.yaml", "metrics.jsonl", "plan.json"):
        (run / name).write_text("{}\n")
    (tmp_path / "link_to_run").symlink_to(run)
    lookalike = tmp_path / "other_run"
    lookalike.mkdir()
    (lookalike / "config.yaml").write_text("model: {}\n")
    before = _tree(tmp_path)
    outs = {
        run: "is a run folder or checkpoint (it holds metrics.jsonl)",
        reg.root: "is a run folder or checkpoint (it holds latest_checkpointed_iteration.txt)",
        step: "is a run folder or checkpoint (it is named global_step_1)",
        step / "actor" / "hf": "is inside the checkpoint being exported",
        tmp_path: "holds the checkpoint being exported",
        run / "hf": f"is inside {run}, which is a run folder or checkpoint",
        tmp_path / "link_to_run": "is a run folder or checkpoint",
        lookalike: "is a run folder or checkpoint (it holds config.yaml)",
    }
    for out, why in outs.items():
        code = tools.main(["export-hf", str(step), str(out), *(["--overwrite"] if overwrite else [])])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, (out, err)
        assert err.startswith(f"error: {out} {why}"), (out, err)
        assert "never writes there, with or without --overwrite: choose a new folder outside the run" in err
    assert _tree(tmp_path) == before


# ============================================================================================ export (megatron)


@pytest.mark.usefixtures("world")
@pytest.mark.slow
def test_export_hf_from_a_checkpoint_without_hf_model(tmp_path):
    """A run folder (config.yaml naming an HF model with a tokenizer) whose checkpoint has no hf_model: the
    export equals the trained actor (log-probs through transformers) and carries the tokenizer files."""
    from rlconf.config import Optim

    from .megatron._common import actor_cfg, hf_logits, make_batch, make_tiny_qwen2, reference_log_probs

    hf_dir = make_tiny_qwen2(tmp_path / "base")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    model = ModelConfig(path=str(hf_dir), attention_backend="sdpa")
    (out_dir / "config.yaml").write_text(dump_yaml(config_to_dict(RLConfig(model=model))))

    cfg = actor_cfg(ppo_mini_batch_size=4, optim=Optim(lr=1e-2, clip_grad=1.0))
    actor = actor_of(model, cfg, "cpu", total_steps=4)
    batch = make_batch(b=8)
    old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
    actor.update_policy({**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]})
    trained = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    assert not torch.allclose(trained, old)

    reg = CheckpointRegistry(out_dir / "checkpoints", ["actor"])
    ck.save_engine(actor, reg.begin(1)["actor"], ("model", "optimizer", "extra"), {"step": 1})
    step_dir = reg.commit(1)
    assert not (step_dir / "actor" / "huggingface").exists()

    result = tools.export_hf(step_dir / "actor", tmp_path / "hf")
    hf = tmp_path / "hf"
    assert (hf / "tokenizer_config.json").is_file() and (hf / "model.safetensors").is_file()
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 4
    assert any("tokenizer files" in n for n in result["notes"])
    lp = reference_log_probs(hf_logits(hf, batch["input_ids"], batch["attention_mask"]), batch)
    torch.testing.assert_close(lp, trained, atol=1e-5, rtol=1e-5)
    assert not list(tmp_path.glob(".hf.tmp-*"))

    # OUT not empty: refused unless --overwrite; a damaged checkpoint: refused naming the file.
    with pytest.raises(CheckpointError, match="not empty; choose a new folder or pass --overwrite"):
        tools.export_hf(step_dir, hf)
    tools.export_hf(step_dir, hf, overwrite=True)
    _zero_block(step_dir / "actor" / "rng" / "rank_00000.pt", 0, 16)
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt: content differs .* is damaged"):
        tools.export_hf(step_dir, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


@pytest.mark.usefixtures("world")
@pytest.mark.slow
def test_export_hf_of_a_tiny_model_ships_the_builtin_tokenizer_and_normal_modes(tmp_path):
    """A tiny run (built-in character tokenizer): the export's tokenizer files load in transformers with the
    ids of CharTokenizer, the model generates text through them, and the files have the modes of a plain write
    (umask 022). The class the files name reproduces CharTokenizer exactly (unknown characters too);
    AutoTokenizer, which transformers 5 turns into its byte-level Qwen2Tokenizer for every model_type qwen2
    folder, gives the same ids for text over the vocabulary, and the model generates through it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from rltrain.tokenizer import CharTokenizer

    from .megatron._common import actor_cfg, tiny_model_cfg

    old_mask = os.umask(0o022)
    try:
        actor = actor_of(tiny_model_cfg(), actor_cfg(), "cpu", total_steps=2)
        # No config.yaml next to checkpoints/: the tokenizer kind comes from meta.json.
        reg = CheckpointRegistry(tmp_path / "run" / "checkpoints", ["actor"])
        ck.save_engine(actor, reg.begin(1)["actor"], ("model", "extra", "hf_model"), {"step": 1})
        step_dir = reg.commit(1)
        assert ck.read_role_meta(step_dir / "actor")["tokenizer"] == {"kind": "char", "vocab_size": 32}
        assert tools.main(["export-hf", str(step_dir), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old_mask)
    builtin = CharTokenizer()
    for folder in (tmp_path / "hf", step_dir / "actor" / "huggingface"):  # export-hf, and the in-run hf_model
        modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
        assert set(modes) >= {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"}
        assert set(modes.values()) == {0o644}, modes
        assert (
            json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
            == "PreTrainedTokenizerFast"
        )
        tok = PreTrainedTokenizerFast.from_pretrained(folder)
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
        for text in [
            "12+7=19",
            "#### 42",
            "<answer>5</answer>",
            "a b\nc",
            "héllo, wörld",
            "<eos> stays text",
            "",
        ]:
            assert tok.encode(text, add_special_tokens=False) == builtin.encode(text), text
            assert tok.encode(text) == builtin.encode_prompt(text), text
            ids = [*builtin.encode_prompt(text), builtin.eos_token_id, builtin.pad_token_id]
            assert tok.decode(ids, skip_special_tokens=True) == builtin.decode(ids), text
        auto = AutoTokenizer.from_pretrained(folder)
        for text in ["12+7=19", "#### 42", "<answer>5</answer>", " 3 \n 4 ", "answer 1, 2. 3*4/5-6", ""]:
            assert auto.encode(text) == builtin.encode_prompt(text), text
            assert auto.decode(builtin.encode_prompt(text), skip_special_tokens=True) == text, text
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = tok("12+7=", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    new_ids = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(new_ids) > 0 and tok.decode(new_ids, skip_special_tokens=True) == builtin.decode(new_ids)


@pytest.mark.usefixtures("world")
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_never_stepped_plain_optimizer_round_trip(tmp_path, dtype):
    """A save before the first update (e.g. the actor during critic warmup) with the non-distributed
    optimizer: megatron drops the step-0 Adam step from it; the load puts it back instead of KeyError."""

    from .megatron._common import actor_cfg, tiny_model_cfg

    model = replace(tiny_model_cfg(), params_dtype=dtype)
    cfg = actor_cfg()
    cfg = replace(cfg, megatron=replace(cfg.megatron, use_distributed_optimizer=False))
    folder = tmp_path / "global_step_1" / "actor"
    ck.save_engine(actor_of(model, cfg, "cpu", total_steps=4), folder, ("model", "optimizer"), {})
    fresh = actor_of(model, cfg, "cpu", total_steps=4)
    ck.load_engine(fresh, folder, ("model", "optimizer"))
    steps = {float(s["step"]) for s in fresh.optimizer.optimizer.state.values()}
    assert steps == {0.0}


@pytest.mark.slow
@pytest.mark.multiproc
def test_export_hf_cli_reshards_a_tp2_run(tmp_path):
    """A TP=2 training run saves its own HF export (hf_model); `rltrain export-hf` of the same checkpoint,
    built at TP=1 from the dist checkpoint, writes the same tensors and a config transformers loads."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    out = tmp_path / "run"
    train = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.total_steps", "1", "--trainer.save_freq", "1",
         "--trainer.output_dir", str(out), "--trainer.val_before_train", "false", "--trainer.test_freq", "0",
         "--logging.plot_reward", "false", "--cluster.gpus_per_node", "2",
         "--actor.megatron.tensor_model_parallel_size", "2", "--rollout.tensor_model_parallel_size", "2",
         "--actor.checkpoint.save_contents", "[model, optimizer, extra, hf_model]"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    step_dir = out / "checkpoints" / "global_step_1"
    export = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "export-hf", str(step_dir), str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr[-3000:]
    assert f"exported actor of {step_dir}" in export.stdout
    ours = load_file(str(tmp_path / "hf" / "model.safetensors"))
    theirs = load_file(str(step_dir / "actor" / "huggingface" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    mine = json.loads((tmp_path / "hf" / "config.json").read_text())
    saved = json.loads((step_dir / "actor" / "huggingface" / "config.json").read_text())
    assert mine == saved
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_hidden_layers == 2

    inspect = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "inspect", str(step_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert inspect.returncode == 0, inspect.stderr
    assert "TP=2 PP=1 VPP=1 CP=1 EP=1 DP=1 (world 2)" in inspect.stdout
    assert "model, optimizer, extra, hf_model" in inspect.stdout
    # A second export into the same folder is refused: exit 2, one line, the fix named.
    again = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "export-hf", str(step_dir), str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--overwrite" in again.stderr


def test_unknown_fault_point_is_an_error(monkeypatch):
    monkeypatch.setenv(ck.FAULT_ENV, "before_lunch@3")
    with pytest.raises(CheckpointError, match="expected POINT"):
        faults.fault_point("before_manifest", 3)
    monkeypatch.setenv(ck.FAULT_ENV, "before_manifest@3")
    faults.fault_point("before_manifest", 2)  # another step: no-op
    faults.fault_point("before_rename", 3)  # another point: no-op
