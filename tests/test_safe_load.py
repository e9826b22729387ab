"""Nothing rlplan loads from a checkpoint runs code: a `__reduce__` payload planted in the RNG file, in
dist_ckpt/.metadata or in a byte item inside a .distcp file, with the manifest's CRCs recomputed (so the
damage check passes), is refused by `rltrain inspect`, `rltrain export-hf`, a resume (`rltrain tiny-grpo`
rerun on the folder) and `load_engine` itself, and the payload never runs (its marker file never appears).

Real files throughout: a real tiny-grpo run makes the checkpoint, real megatron saves list what torch pickles
into .metadata, and the payloads are real pickles that would create the marker if anything unpickled them.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rltrain import checkpoint as ck
from rltrain.checkpoint import CheckpointRegistry, UnsafeCheckpointError, engine_io, safe_load
from rltrain.checkpoint.manifest import write_manifest

from .megatron._common import actor_of

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
RUN_FLAGS = ("--trainer.save_freq", "1", "--trainer.val_before_train", "false", "--trainer.test_freq", "0",
             "--logging.plot_reward", "false")  # fmt: skip


class Payload:
    """Unpickled, it creates `marker` (what an attacker's code would do, visibly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _recorded_globals(path: Path) -> set[tuple[str, str]]:
    """Every global a pickle file names, without calling any of them (trusted files of this test only)."""
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as f:
        Recorder(f).load()
    return seen


# ============================================================================================ planting
def plant_rng(role: Path, marker: Path) -> Path:
    f = role / "rng" / "rank_00000.pt"
    state = torch.load(f, weights_only=True)
    state["extra_state"] = Payload(marker)
    torch.save(state, f)
    return f


def plant_metadata(role: Path, marker: Path) -> Path:
    f = role / "dist_ckpt" / ".metadata"
    metadata = safe_load.read_dcp_metadata(f)
    metadata.planner_data = Payload(marker)
    with open(f, "wb") as out:
        pickle.dump(metadata, out)
    return f


def plant_byte_item(role: Path, marker: Path) -> Path:
    """Replace one of megatron's sharded objects (bytes inside a .distcp file) by a payload: appended to the
    file, and .metadata pointed at it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    dist = role / "dist_ckpt"
    metadata = safe_load.read_dcp_metadata(dist / ".metadata")
    key = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    buf = io.BytesIO()
    torch.save([Payload(marker)], buf)
    target = dist / info.relative_path
    offset = target.stat().st_size
    with open(target, "ab") as out:
        out.write(buf.getvalue())
    metadata.storage_data[index] = replace(info, offset=offset, length=len(buf.getvalue()))
    with open(dist / ".metadata", "wb") as out:
        pickle.dump(metadata, out)
    return target


PLANTS = {"rng": plant_rng, "metadata": plant_metadata, "byte_item": plant_byte_item}


def plant(role: Path, where: str, marker: Path) -> Path:
    """Plant the payload and recompute the manifest, as a forger would: the CRC check then passes."""
    f = PLANTS[where](role, marker)
    write_manifest(role, role.name)
    assert ck.verify_manifest(role, full=True) == []
    assert not marker.exists()
    return f


# ============================================================================================ in-process
def _actor(path: str | None = None, **megatron_kw):
    from rlconf.config import Optim

    from .megatron._common import actor_cfg, tiny_model_cfg

    cfg = actor_cfg(ppo_mini_batch_size=4, optim=Optim(lr=1e-2, clip_grad=1.0))
    cfg = replace(cfg, megatron=replace(cfg.megatron, **megatron_kw))
    return actor_of(tiny_model_cfg(path), cfg, "cpu", total_steps=8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, world) -> dict[str, Path]:
    """Role folders saved by real engines: distributed and plain optimizer, model + optimizer + extra."""
    out = {}
    for dist_opt in (True, False):
        reg = CheckpointRegistry(tmp_path_factory.mktemp(f"ckpt-{dist_opt}"), ["actor"])
        a = _actor(None, use_distributed_optimizer=dist_opt)
        assert ck.save_engine(a, reg.begin(1)["actor"], ("model", "optimizer", "extra"), {"step": 1})
        out["distributed" if dist_opt else "plain"] = reg.commit(1) / "actor"
    return out


@pytest.mark.slow
def test_metadata_allow_list_is_exactly_what_megatron_saves_and_new_files_need_no_extra_globals(saved):
    """The restricted unpickler's allow list is what real saves write (a name torch adds later fails here,
    rather than a resume in the field); every .pt file of a fresh save loads with plain
    torch.load(weights_only=True), without the numpy allowances older RNG files need."""
    names: set[tuple[str, str]] = set()
    known = re.compile(r"^(meta\.json|extra\.json|manifest\.json|rng/rank_\d{5}\.pt|"
                       r"dist_ckpt/(\.metadata|metadata\.json|common\.pt|__\d+_\d+\.distcp))$")  # fmt: skip
    for role in saved.values():
        # Every file a save writes is one the loaders of safe_load.py cover: a new kind fails here.
        files = [p.relative_to(role).as_posix() for p in role.rglob("*") if p.is_file()]
        assert [f for f in files if not known.match(f)] == []
        names |= _recorded_globals(role / "dist_ckpt" / ".metadata")
        assert safe_load.role_problems(role) == []
        for pt in role.rglob("*.pt"):
            torch.load(pt, weights_only=True)  # no safe_globals: tensors and plain data only
    dtypes = {(m, n) for m, n in names if m == "torch" and isinstance(getattr(torch, n, None), torch.dtype)}
    assert names - dtypes <= safe_load.DCP_METADATA_GLOBALS
    # Every allowed name is used by a real save (the list is no wider than needed).
    assert safe_load.DCP_METADATA_GLOBALS - names <= {
        ("torch.distributed.checkpoint.metadata", "StorageMeta")
    }


def test_rng_files_of_older_versions_still_load(tmp_path):
    """RNG files written before this change hold numpy's state as an ndarray: they load (numpy's array
    rebuild allowed for them alone) and restore the same numpy stream."""
    np.random.seed(7)
    random.seed(7)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "tracker": {}, "sample_calls": 3}  # fmt: skip
    torch.save(old, tmp_path / "rank_00000.pt")
    expected = np.random.rand(3)
    np.random.seed(0)
    state = safe_load.load_rng_file(tmp_path / "rank_00000.pt")
    np.random.set_state(state["numpy"])
    assert np.array_equal(np.random.rand(3), expected)
    assert state["sample_calls"] == 3 and state["python"] == old["python"]
    # Without the allowance torch itself refuses the old file: the allowance is what makes it load.
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "rank_00000.pt", weights_only=True)
    # A file written under numpy 1 names numpy.core.multiarray: it loads too.
    with zipfile.ZipFile(tmp_path / "rank_00000.pt") as z:
        members = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in members if n.endswith("data.pkl"))
    assert b"numpy._core.multiarray\n_reconstruct" in members[pkl]
    members[pkl] = members[pkl].replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    with zipfile.ZipFile(tmp_path / "numpy1.pt", "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    assert np.array_equal(safe_load.load_rng_file(tmp_path / "numpy1.pt")["numpy"][1], old["numpy"][1])


@pytest.mark.slow
@pytest.mark.parametrize("where", sorted(PLANTS))
def test_load_engine_refuses_a_planted_payload_even_past_the_pre_check(tmp_path, saved, where, monkeypatch):
    """load_engine refuses the payload with a named error; with the pre-check (role_problems) switched off,
    megatron's own load still cannot run it (guarded_dist_load: the .metadata reader and every torch.load
    restricted; the RNG file loaded weights_only). The marker never appears."""
    role = tmp_path / "global_step_1" / "actor"
    shutil.copytree(saved["distributed"], role)
    marker = tmp_path / "MARKER"
    planted = plant(role, where, marker)
    engine = _actor(None, use_distributed_optimizer=True)
    with pytest.raises(UnsafeCheckpointError, match=rf"^{planted}.*refused: .*posix\.system"):
        ck.load_engine(engine, role, ("model", "optimizer", "extra"))
    assert not marker.exists()
    monkeypatch.setattr(engine_io, "role_problems", lambda folder: [])
    with pytest.raises(UnsafeCheckpointError, match=r"refused: .*posix\.system"):
        ck.load_engine(engine, role, ("model", "optimizer", "extra"))
    assert not marker.exists()
    # The guard is gone after the load: torch's own functions are back.
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    assert safe_load._ORIGINAL_TORCH_LOAD is None and torch.load.__module__ == "torch.serialization"
    assert FileSystemReader.read_metadata.__module__ == "torch.distributed.checkpoint.filesystem"


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    """.metadata names the .distcp file of every item: one outside dist_ckpt/ is refused, never opened."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    dist = tmp_path / "dist_ckpt"
    dist.mkdir()
    md = Metadata(
        state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo("../../secret", 0, 8)}
    )
    with open(dist / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refused: .*'\.\./\.\./secret'.*climbs out"):
        safe_load.read_dcp_metadata(dist / ".metadata")


# ============================================================================================ the commands
@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A real run folder: tiny-grpo, one step, one checkpoint."""
    out = tmp_path_factory.mktemp("run") / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.total_steps", "1",
         "--trainer.output_dir", str(out), *RUN_FLAGS],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _rltrain(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rltrain.cli", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("where", sorted(PLANTS))
def test_inspect_export_and_resume_refuse_a_planted_payload(tmp_path, run_folder, where):
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)
    step = run / "checkpoints" / "global_step_1"
    marker = tmp_path / "MARKER"
    planted = plant(step / "actor", where, marker)

    inspect = _rltrain("inspect", str(step))
    assert inspect.returncode == 2, inspect.stdout + inspect.stderr
    assert inspect.stderr.count("\n") == 1 and "Traceback" not in inspect.stderr
    assert inspect.stderr.startswith(f"error: {planted}") and "refused: " in inspect.stderr
    assert "posix.system" in inspect.stderr and "verified    FAILED" in inspect.stdout

    export = _rltrain("export-hf", str(step), str(tmp_path / "hf"))
    assert export.returncode == 2, export.stdout + export.stderr
    assert export.stderr.count("\n") == 1 and export.stderr.startswith(f"error: {planted}")
    assert "refused: " in export.stderr and not (tmp_path / "hf").exists()

    resume = _rltrain("tiny-grpo", "--trainer.total_steps", "2", "--trainer.output_dir", str(run), *RUN_FLAGS)
    assert resume.returncode == 2, resume.stdout + resume.stderr[-3000:]
    assert "Traceback" not in resume.stderr
    errors = [line for line in resume.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error [checkpoint-unsafe] trainer.resume_mode: ")
    assert str(planted) in errors[0] and "posix.system" in errors[0]
    assert "resumed from" not in resume.stdout and "step    2" not in resume.stdout
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_untouched_run_folder_still_resumes(tmp_path, run_folder):
    """The refusals above are not a broken loader: the same folder, unplanted, is verified and resumes."""
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)
    inspect = _rltrain("inspect", str(run / "checkpoints" / "global_step_1"))
    assert inspect.returncode == 0 and "verified    ok" in inspect.stdout, inspect.stderr
    resume = _rltrain("tiny-grpo", "--trainer.total_steps", "2", "--trainer.output_dir", str(run), *RUN_FLAGS)
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert "resumed from" in resume.stdout and "step    2" in resume.stdout


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_planted_dist_checkpointing_path_is_refused_naming_it(tmp_path, run_folder):
    """`actor.megatron.use_dist_checkpointing` starts a new run from a checkpoint's weights: a forged one
    stops the run (exit 2) naming actor.megatron.dist_checkpointing_path, and the payload never runs."""
    role = tmp_path / "global_step_1" / "actor"
    shutil.copytree(run_folder / "checkpoints" / "global_step_1" / "actor", role)
    marker = tmp_path / "MARKER"
    planted = plant(role, "metadata", marker)
    run = _rltrain("tiny-grpo", "--trainer.total_steps", "1", "--trainer.output_dir", str(tmp_path / "new"),
                   "--actor.megatron.use_dist_checkpointing", "true",
                   "--actor.megatron.dist_checkpointing_path", str(role), *RUN_FLAGS)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert errors[0].startswith("error [checkpoint-unsafe] actor.megatron.dist_checkpointing_path: ")
    assert str(planted) in errors[0] and "posix.system" in errors[0]
    assert not marker.exists()
