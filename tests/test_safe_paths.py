"""Paths stay inside their folder: a model folder whose safetensors index names `../outside/x.safetensors` or
an absolute path, or that holds a symlink pointing outside, is refused with exit 2 naming `model.path` and
the entry, at `rlconf validate`, at `rltrain` start and at load time (weights and tokenizer), and the outside
file is never opened (an audit hook watches every open). A checkpoint file swapped for a symlink to a copy
outside (same bytes, so its CRC matches) is refused too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlconf.errors import ConfigError
from rlconf.safe_paths import PathEscapeError, model_folder_escapes, resolve_inside

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}

# Paths Python opened while a test of this module ran (sys.addaudithook cannot be removed: outside these
# tests it records nothing).
_OPENED: list[str] = []
_WATCHING = [False]


def _audit(event: str, args: tuple) -> None:
    if _WATCHING[0] and event == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def _watch_opens():
    _OPENED.clear()
    _WATCHING[0] = True
    yield
    _WATCHING[0] = False
    _OPENED.clear()


def opened_under(folder: Path) -> list[str]:
    real = str(folder.resolve())
    return [p for p in _OPENED if os.path.realpath(p).startswith(real)]


# ============================================================================================ the helper
def test_resolve_inside_accepts_names_in_the_folder_and_refuses_every_way_out(tmp_path):
    root = tmp_path / "model"
    (root / "sub").mkdir(parents=True)
    (root / "a.safetensors").write_bytes(b"x")
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    assert resolve_inside(root, "a.safetensors", "w") == (root / "a.safetensors").resolve()
    assert resolve_inside(root, "sub/b.safetensors", "w") == (root / "sub" / "b.safetensors").resolve()
    (root / "inner-link").symlink_to("a.safetensors")  # a symlink inside the folder is fine
    assert resolve_inside(root, "inner-link", "w") == (root / "a.safetensors").resolve()
    (root / "link").symlink_to(tmp_path / "outside.safetensors")
    (root / "dirlink").symlink_to(tmp_path)
    refused = {
        "../outside.safetensors": "climbs out with '..'",
        "sub/../../outside.safetensors": "climbs out with '..'",
        str(tmp_path / "outside.safetensors"): "is an absolute path",
        "C:\\outside.safetensors": "is an absolute path",
        "\\\\host\\share\\x": "is an absolute path",
        "..\\outside.safetensors": "climbs out with '..'",
        "a\0b": "holds a NUL byte",
        "": "is not a file name",
        "link": "resolves to",
        "dirlink/outside.safetensors": "resolves to",
    }
    for entry, why in refused.items():
        with pytest.raises(PathEscapeError, match=why) as info:
            resolve_inside(root, entry, "the index entry 'w'")
        assert info.value.entry == entry and "the index entry 'w' names" in str(info.value)
    with pytest.raises(PathEscapeError, match="is not a file name"):
        resolve_inside(root, 3, "w")


def test_a_hub_cache_snapshot_may_link_into_its_own_blobs_only(tmp_path):
    """huggingface_hub's cache: snapshots/REV/* are symlinks to ../../blobs/HASH of the same repository."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_bytes(b"x")
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../blobs/abc")
    assert resolve_inside(snap, "model.safetensors", "w") == (repo / "blobs" / "abc").resolve()
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "def").write_bytes(b"x")
    (snap / "config.json").symlink_to(other / "def")
    assert [e.entry for e in model_folder_escapes(snap)] == ["config.json"]


# ============================================================================================ model folders
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from .megatron._common import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path_factory.mktemp("hf") / "qwen2_tiny")
    from rltrain.tokenizer import CharTokenizer

    CharTokenizer().save_pretrained(path)
    return path


def hostile(tmp_path: Path, tiny_model: Path, how: str) -> tuple[Path, Path, str]:
    """(model folder, the outside folder, the offending entry): the weights moved out of the folder and
    named from inside it, as `how` says. The outside file is a real one: without the check it would load."""
    model, outside = tmp_path / "model", tmp_path / "outside"
    shutil.copytree(tiny_model, model)
    outside.mkdir()
    target = outside / "x.safetensors"
    shutil.move(model / "model.safetensors", target)
    if how == "symlink":
        (model / "model.safetensors").symlink_to(target)
        return model, outside, "model.safetensors"
    entry = "../outside/x.safetensors" if how == "dotdot" else str(target)
    from safetensors import safe_open

    with safe_open(target, "pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, entry)}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return model, outside, entry


HOW = ["dotdot", "absolute", "symlink"]


def _config(model: Path):
    from dataclasses import replace

    from presets import PRESETS

    cfg = PRESETS["tiny-grpo"].build()
    return replace(cfg, model=replace(cfg.model, path=str(model)))


@pytest.mark.parametrize("how", HOW)
def test_validate_refuses_a_model_folder_naming_files_outside(tmp_path, tiny_model, how):
    from rlconf.validate import check_config

    model, outside, entry = hostile(tmp_path, tiny_model, how)
    _OPENED.clear()
    issues = [i for i in check_config(_config(model), filesystem=True) if i.rule == "model-folder-paths"]
    assert len(issues) == 1 and issues[0].path == "model.path" and issues[0].severity == "error"
    assert repr(entry) in issues[0].message and str(model) in issues[0].message
    assert opened_under(outside) == []


@pytest.fixture
def safe_opens(monkeypatch) -> list[str]:
    """Files the weight reader opens with safetensors (Rust opens them: the audit hook does not see those)."""
    from rltrain.megatron import hf_weights

    seen: list[str] = []
    real = hf_weights.safe_open

    def recording(path, *args, **kwargs):
        seen.append(os.path.realpath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(hf_weights, "safe_open", recording)
    return seen


@pytest.mark.parametrize("how", HOW)
def test_weight_loader_refuses_it_before_opening_anything_outside(tmp_path, tiny_model, how, safe_opens):
    """At load time (the folder may change after validation)."""
    from rltrain.megatron.hf_weights import _HFReader

    model, outside, entry = hostile(tmp_path, tiny_model, how)
    _OPENED.clear()
    with pytest.raises(ConfigError) as info:
        _HFReader(model)
    (issue,) = info.value.errors
    assert issue.path == "model.path" and issue.rule == "model-folder-paths" and repr(entry) in issue.message
    with pytest.raises(ConfigError) as info:
        _HFReader(model, "critic.model_path")
    assert info.value.errors[0].path == "critic.model_path"
    assert opened_under(outside) == [] and not [p for p in safe_opens if p.startswith(str(outside))]


def test_tokenizer_loader_refuses_a_tokenizer_file_linked_from_outside(tmp_path, tiny_model):
    from rlconf.plan.run import tokenizer_plan
    from rltrain.tokenizer import load_tokenizer

    model, outside = tmp_path / "model", tmp_path / "outside"
    shutil.copytree(tiny_model, model)
    outside.mkdir()
    shutil.move(model / "tokenizer.json", outside / "tokenizer.json")
    (model / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    _OPENED.clear()
    with pytest.raises(ConfigError) as info:
        load_tokenizer(tokenizer_plan(_config(model).model))
    (issue,) = info.value.errors
    assert issue.path == "model.path" and "'tokenizer.json'" in issue.message
    assert f"resolves to {outside / 'tokenizer.json'}" in issue.message
    assert opened_under(outside) == []
    # The same file inside the folder loads (the refusal is the link, not the file).
    (model / "tokenizer.json").unlink()
    shutil.move(outside / "tokenizer.json", model / "tokenizer.json")
    assert load_tokenizer(tokenizer_plan(_config(model).model)).vocab_size > 0


def test_the_untouched_folder_loads(tmp_path, tiny_model, safe_opens):
    """The refusals above are not a broken reader, and the watchers see opens: the same weights inside the
    folder (one file, or an index naming shards in a subfolder) load, and their opens are recorded."""
    from safetensors import safe_open

    from rltrain.megatron.hf_weights import _HFReader

    reader = _HFReader(tiny_model)
    assert "model.embed_tokens.weight" in reader and reader.get("model.embed_tokens.weight").ndim == 2
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "shards").mkdir()
    shutil.move(model / "model.safetensors", model / "shards" / "a.safetensors")
    with safe_open(model / "shards" / "a.safetensors", "pt") as f:
        names = list(f.keys())
    index = {"weight_map": dict.fromkeys(names, "shards/a.safetensors")}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    _OPENED.clear()
    safe_opens.clear()
    assert _HFReader(model).get("model.embed_tokens.weight").ndim == 2
    assert model_folder_escapes(model) == []
    assert safe_opens == [str((model / "shards" / "a.safetensors").resolve())]
    assert str((model / "model.safetensors.index.json").resolve()) in opened_under(model)


@pytest.mark.parametrize("command", ["rlconf", "rltrain"])
def test_validate_and_rltrain_start_exit_2_naming_model_path(tmp_path, tiny_model, command):
    model, _, entry = hostile(tmp_path, tiny_model, "dotdot")
    if command == "rlconf":
        f = tmp_path / "run.yaml"
        f.write_text(f"preset: tiny-grpo\nmodel:\n  path: {model}\n")
        args = [sys.executable, "-m", "rlconf.cli", "validate", str(f)]
    else:
        args = [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--model.path", str(model),
                "--trainer.output_dir", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    line = next(ln for ln in done.stderr.splitlines() if "[model-folder-paths]" in ln)
    assert line.startswith("error [model-folder-paths] model.path: ") and repr(entry) in line
    assert not (tmp_path / "run" / "checkpoints").exists()


# ============================================================================================ checkpoints
def test_a_checkpoint_file_swapped_for_a_symlink_outside_is_refused(tmp_path):
    """Same bytes outside, so size and CRC match the manifest: the symlink itself is what is refused."""
    from rltrain.checkpoint import verify_manifest, write_manifest

    role = tmp_path / "global_step_1" / "actor"
    (role / "rng").mkdir(parents=True)
    (role / "meta.json").write_text("{}")
    (role / "rng" / "rank_00000.pt").write_bytes(b"state")
    write_manifest(role, "actor")
    outside = tmp_path / "elsewhere.pt"
    shutil.move(role / "rng" / "rank_00000.pt", outside)
    (role / "rng" / "rank_00000.pt").symlink_to(outside)
    (problem,) = verify_manifest(role, full=True)
    assert problem.startswith(f"{role / 'rng' / 'rank_00000.pt'}: ") and "'rng/rank_00000.pt'" in problem
    assert f"resolves to {outside}" in problem


def test_a_checkpoint_hf_folder_naming_files_outside_is_refused(tmp_path, tiny_model):
    """export-hf copies a checkpoint's huggingface/ folder: its names must stay inside too."""
    from rltrain.checkpoint import role_problems

    role = tmp_path / "actor"
    hf, _, entry = hostile(tmp_path, tiny_model, "dotdot")
    role.mkdir()
    shutil.move(hf, role / "huggingface")
    (problem,) = role_problems(role)
    assert problem.startswith(f"{role / 'huggingface'}: refused: ") and repr(entry) in problem
