"""The resume guard reads the checkpoint, not config.yaml: each COMPLETE marker records the resolved config and
the size + sha256 of every data file, and a resume that differs from that record is refused (exit 2, naming
the config path or the file) unless --trainer.accept_config_changes is given, which the history records.

The fast tests build the run folder with real registry commits of small files (no megatron) and run the real
`rltrain` command, which refuses before Ray starts; the slow one checks that a real training run writes the
record and that a replaced data file is caught on its resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlconf.errors import ConfigError
from rltrain import checkpoint as ck
from rltrain.run_record import RECORD_KEY
from rltrain.runfolder import HISTORY_FILE, RunFolder, read_history
from tests.test_runfolder import ENV, started, tiny

ROWS_A = [{"prompt": "1 2 3", "answer": "4 5 6"}, {"prompt": "2 3 4", "answer": "5 6 7"}]
ROWS_B = [{"prompt": "3 4 5", "answer": "6 7 8"}, {"prompt": "4 5 6", "answer": "7 8 9"}]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def rltrain(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "tiny-grpo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def flags(out: Path, *more: str) -> list[str]:
    return ["--trainer.output_dir", str(out), "--trainer.save_freq", "2", "--trainer.total_steps", "4", *more]


def marker(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / f"global_step_{step}" / ck.COMPLETE).read_text())


def test_every_checkpoint_records_the_config_and_the_data_files(tmp_path):
    data = tmp_path / "train.jsonl"
    write_rows(data, ROWS_A)
    out = tmp_path / "run"
    started(out, [2], data__train_files=(str(data),))
    record = marker(out, 2)[RECORD_KEY]
    assert record["config"]["actor"]["optim"]["lr"] == 0.001
    assert record["config"]["data"]["train_files"] == [str(data)]
    import hashlib

    assert record["data"] == {
        str(data): {
            "key": "data.train_files",
            "size": data.stat().st_size,
            "sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
        }
    }
    assert len(record["config_sha256"]) == 64
    # `rltrain inspect` shows it.
    from rltrain.checkpoint.tools import format_step, inspect_step

    text = format_step(inspect_step(out / "checkpoints" / "global_step_2"))
    assert f"run record  config sha256 {record['config_sha256'][:16]}, 1 data file(s)" in text, text


@pytest.mark.parametrize("damage", ["deleted", "edited"])
def test_resume_with_another_lr_is_refused_whatever_config_yaml_says(tmp_path, damage):
    out = tmp_path / "run"
    started(out, [2])
    config_yaml = out / "config.yaml"
    if damage == "deleted":
        config_yaml.unlink()
    else:  # the user "fixes" the folder's config by hand to the lr they want now
        text = config_yaml.read_text()
        assert "lr: 0.001\n" in text
        config_yaml.write_text(text.replace("lr: 0.001\n", "lr: 0.0005\n"))
    before = config_yaml.read_text() if config_yaml.exists() else None

    result = rltrain(*flags(out, "--actor.optim.lr", "5e-4"))
    assert result.returncode == 2, result.stderr[-3000:]
    err = result.stderr
    assert "[run-config-changed] actor.optim.lr: 0.001 -> 0.0005" in err, err
    assert "the config recorded in the checkpoint of step 2" in err
    assert "--trainer.accept_config_changes true" in err
    assert "Traceback" not in err and "Started a local Ray instance" not in err + result.stdout
    # Nothing written by the refused start.
    assert (config_yaml.read_text() if config_yaml.exists() else None) == before
    assert not (out / HISTORY_FILE).exists()


def test_config_yaml_deleted_and_the_same_config_resumes_and_restores_it(tmp_path):
    out = tmp_path / "run"
    started(out, [2])
    original = (out / "config.yaml").read_text()
    (out / "config.yaml").unlink()
    config, plan = tiny(out)
    folder = RunFolder.open(config, plan)
    assert folder.start_step == 3 and [c for c in folder.changes if not c.free] == []
    folder.record_start(config, plan)
    folder.close()
    assert (out / "config.yaml").read_text() == original, (
        "config.yaml comes back from the checkpoint's record"
    )


def test_a_replaced_data_file_with_the_same_rows_is_refused_naming_it(tmp_path):
    data = tmp_path / "train.jsonl"
    write_rows(data, ROWS_A)
    out = tmp_path / "run"
    started(out, [2], data__train_files=(str(data),))
    write_rows(data, ROWS_B)  # same row count, same size, other prompts
    assert len(data.read_text().splitlines()) == len(ROWS_A)

    result = rltrain(*flags(out, "--data.train_files", str(data)))
    assert result.returncode == 2, result.stderr[-3000:]
    err = result.stderr
    assert f"[run-data-changed] data.train_files: {data} changed since the checkpoint of step 2" in err, err
    assert "sha256" in err and "put the original" in err
    assert "Traceback" not in err

    # The same file content again (a copy restored elsewhere under the same name): resumes.
    write_rows(data, ROWS_A)
    folder = RunFolder.open(*tiny(out, data__train_files=(str(data),)))
    folder.close()
    assert folder.data_changes == [] and folder.start_step == 3


def test_accepted_changes_resume_and_are_recorded_with_their_checkpoint(tmp_path):
    data = tmp_path / "train.jsonl"
    write_rows(data, ROWS_A)
    out = tmp_path / "run"
    started(out, [2], data__train_files=(str(data),))
    (out / "config.yaml").unlink()
    write_rows(data, ROWS_B)
    changed = {"data__train_files": (str(data),), "actor__optim__lr": 5e-4}
    with pytest.raises(ConfigError) as exc:
        RunFolder.open(*tiny(out, **changed))
    assert exc.value.paths == ("actor.optim.lr", "data.train_files", "trainer.accept_config_changes")

    config, plan = tiny(out, trainer__accept_config_changes=True, **changed)
    folder = RunFolder.open(config, plan)
    folder.record_start(config, plan)
    folder.close()
    (entry,) = read_history(out)
    assert entry["step"] == 3 and not entry["restart"]
    assert {"path": "actor.optim.lr", "old": 0.001, "new": 0.0005, "kind": "accepted"} in entry["changes"]
    (dc,) = entry["data_changes"]
    assert dc["path"] == "data.train_files" and dc["file"] == str(data) and dc["kind"] == "accepted"
    assert dc["new"]["sha256"] != dc["old"]["sha256"]
    assert entry["from_checkpoint"]["step"] == 2

    # The next start from the same checkpoint with the accepted config needs no flag; the old one is a change.
    folder = RunFolder.open(*tiny(out, **changed))
    folder.close()
    assert [c for c in folder.changes if not c.free] == [] and folder.data_changes == []
    with pytest.raises(ConfigError) as exc:
        RunFolder.open(*tiny(out, data__train_files=(str(data),)))
    assert "actor.optim.lr: 0.0005 -> 0.001" in exc.value.format()

    # A checkpoint saved after the accepted start records the new config: it is what a resume from it matches.
    config, plan = tiny(out, **changed)
    folder = RunFolder.open(config, plan)
    from tests.test_runfolder import commit_checkpoint

    commit_checkpoint(folder, 4)
    folder.close()
    assert marker(out, 4)[RECORD_KEY]["config"]["actor"]["optim"]["lr"] == 5e-4


def test_a_checkpoint_without_a_record_falls_back_to_config_yaml_with_a_warning(tmp_path):
    out = tmp_path / "run"
    started(out, [2])
    path = out / "checkpoints" / "global_step_2" / ck.COMPLETE
    old = json.loads(path.read_text())
    del old[RECORD_KEY]  # as rlplan wrote markers before the record
    path.write_text(json.dumps(old))
    warned = pytest.warns(UserWarning, match="did not record the run's config; the resume is checked against")
    with warned, pytest.raises(ConfigError) as exc:
        RunFolder.open(*tiny(out, actor__optim__lr=5e-4))
    assert "the folder's config (config.yaml" in exc.value.format()
    (out / "config.yaml").unlink()
    with pytest.warns(UserWarning, match="did not record"):
        folder = RunFolder.open(*tiny(out, actor__optim__lr=5e-4))
    folder.close()
    assert folder.start_step == 3  # today's behaviour: nothing to compare with


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_real_run_records_its_data_and_its_resume_is_guarded(tmp_path):
    """tiny-grpo on a jsonl file, 2 steps saved; the file replaced (same rows) -> refused; accepted -> runs."""
    data = tmp_path / "train.jsonl"
    write_rows(data, ROWS_A * 4)
    out = tmp_path / "run"
    base = ["--trainer.output_dir", str(out), "--trainer.save_freq", "2", "--data.train_files", str(data)]
    result = rltrain(*base, "--trainer.total_steps", "2", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = marker(out, 2)[RECORD_KEY]
    assert record["data"][str(data)]["size"] == data.stat().st_size

    write_rows(data, ROWS_B * 4)
    (out / "config.yaml").unlink()
    result = rltrain(*base, "--trainer.total_steps", "3", timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"data.train_files: {data} changed since the checkpoint of step 2" in result.stderr
    assert "Traceback" not in result.stderr

    result = rltrain(
        *base, "--trainer.total_steps", "3", "--trainer.accept_config_changes", "true", timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "config changes accepted from step 3" in result.stderr
    (entry,) = read_history(out)
    assert entry["data_changes"][0]["file"] == str(data)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]
    assert os.path.exists(out / "config.yaml")
