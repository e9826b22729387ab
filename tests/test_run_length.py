"""trainer.total_epochs: the plan derives the step count from the prompt files once, shows it, and every
table of the plan (lr, checkpoints) and the data loader's epochs follow that one number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from presets import PRESETS
from rlconf.cli import main as rlconf
from rlconf.errors import ConfigError
from rlconf.load import load_config
from rlconf.plan import compile_plan, format_plan, plan_to_dict
from rlconf.validate import check_config


def write_jsonl(path: Path, rows: int, blank_lines: int = 0) -> Path:
    lines = [json.dumps({"prompt": f"{i % 5} {i % 5 + 1} {i % 5 + 2}", "answer": "1"}) for i in range(rows)]
    # Blank lines are not prompts (the loader skips them): the count must skip them too.
    path.write_text("\n".join(lines) + "\n" * (blank_lines + 1))
    return path


def write_parquet(path: Path, rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": [f"{i % 5} {i % 5 + 1}" for i in range(rows)], "answer": ["1"] * rows})
    pq.write_table(table, path, row_group_size=7)  # several row groups: the footer sums them
    return path


def config(*overrides: str):
    return load_config(None, preset="tiny-grpo", overrides=list(overrides), filesystem=True, presets=PRESETS)


def test_jsonl_epochs_give_the_steps_every_table_uses(tmp_path):
    """645 prompts in batches of 64: 10 full batches per epoch (the last 5 prompts are left over, as the
    loader drops an epoch's incomplete batch), so 15 epochs are 150 steps."""
    f = write_jsonl(tmp_path / "train.jsonl", 645, blank_lines=3)
    c = config(f"data.train_files=[{f}]", "data.train_batch_size=64", "actor.ppo_mini_batch_size=16",
               "trainer.total_epochs=15", "trainer.save_freq=40")  # fmt: skip
    plan = compile_plan(c)
    assert plan.run.total_steps == 150 and plan.run.total_epochs == 15
    table = plan.optim_plan("actor").table
    assert [r.step for r in table] == list(range(1, 151))
    assert plan.checkpoint.save_steps == (40, 80, 120, 150)
    assert plan.batch_plan("actor").update_steps == 150
    text = format_plan(plan)
    assert "run: total_steps 150 = 15 epochs x 10 batches of 64 prompts" in text, text
    assert "645 prompts in data.train_files; 5 left over each epoch" in text, text
    length = plan_to_dict(plan)["length"]
    assert length == {"total_steps": 150, "total_epochs": 15, "prompts": 645, "batch_size": 64,
                      "batches_per_epoch": 10}  # fmt: skip


def test_parquet_rows_are_counted_over_all_files(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", 30)
    b = write_parquet(tmp_path / "b.parquet", 21)
    c = config(f"data.train_files=[{a},{b}]", "trainer.total_epochs=3")  # 51 prompts, batch 8: 6 per epoch
    plan = compile_plan(c)
    assert (plan.length.prompts, plan.length.batches_per_epoch, plan.run.total_steps) == (
        51,
        6,
        18,
    )
    assert len(plan.optim_plan("actor").table) == 18


def test_the_loader_ends_its_epochs_where_the_plan_counts_them(tmp_path):
    """The data loader and the plan share one rule: after the plan's steps the loader has made exactly
    total_epochs passes (and the next batch starts a new epoch)."""
    from rltrain.data import build_dataloaders
    from rltrain.tokenizer import load_tokenizer

    f = write_jsonl(tmp_path / "train.jsonl", 21)
    c = config(f"data.train_files=[{f}]", "trainer.total_epochs=3")
    plan = compile_plan(c)
    train, _ = build_dataloaders(plan.data, load_tokenizer(plan.tokenizer))
    assert len(train) == plan.length.batches_per_epoch == 2
    epochs = [train.epoch for _ in range(plan.run.total_steps) if next(train)]
    assert epochs == [0, 0, 1, 1, 2, 2]
    next(train)
    assert train.epoch == 3


def test_warmup_is_checked_against_the_derived_steps(tmp_path):
    """150 derived steps: a 120-step warmup fits (against total_steps' default of 100 it would not)."""
    f = write_jsonl(tmp_path / "train.jsonl", 640)
    c = config(f"data.train_files=[{f}]", "data.train_batch_size=64", "actor.ppo_mini_batch_size=16",
               "trainer.total_epochs=15", "actor.optim.lr_warmup_steps=120")  # fmt: skip
    assert not [i for i in check_config(c, filesystem=True) if i.severity == "error"]
    assert compile_plan(c).optim_plan("actor").warmup_steps == 120


def test_too_few_prompts_for_one_batch_is_a_config_error(tmp_path):
    f = write_jsonl(tmp_path / "train.jsonl", 5)
    with pytest.raises(ConfigError) as exc:
        config(f"data.train_files=[{f}]", "trainer.total_epochs=2")
    issue = next(i for i in exc.value.issues if i.rule == "total-epochs-prompts")
    assert issue.path == "data.train_batch_size" and "hold 5 prompts, fewer than" in issue.message
    assert "lower data.train_batch_size to at most 5" in issue.fix


def test_epochs_beyond_the_plan_limit_name_total_epochs(tmp_path):
    f = write_jsonl(tmp_path / "train.jsonl", 800)  # 100 batches per epoch
    with pytest.raises(ConfigError) as exc:
        config(f"data.train_files=[{f}]", "trainer.total_epochs=1001")
    assert "trainer.total_epochs" in exc.value.paths
    assert "total_steps 100100 = 1001 epochs x 100 batches" in exc.value.format()


def test_the_plan_names_an_unreadable_file(tmp_path):
    """The plan (rlconf plan, the import) counts files too; a broken parquet file is a named error there."""
    from rlconf.config import DataConfig, RLConfig, TrainerConfig

    bad = tmp_path / "train.parquet"
    bad.write_bytes(b"not parquet")
    c = RLConfig(data=DataConfig(train_files=(str(bad),)), trainer=TrainerConfig(total_epochs=2))
    with pytest.raises(ConfigError) as exc:
        compile_plan(c)
    assert exc.value.paths == ("data.train_files[0]",)
    assert "cannot read the parquet footer" in exc.value.format()


def test_cli_plan_shows_the_derived_steps_and_rejects_synthetic_epochs(tmp_path, capsys):
    f = write_jsonl(tmp_path / "train.jsonl", 40)
    assert rlconf(["plan", "--preset", "tiny-grpo", "--set", f"data.train_files=[{f}]",
                   "--set", "trainer.total_epochs=4"]) == 0  # fmt: skip
    assert "run: total_steps 20 = 4 epochs x 5 batches of 8 prompts" in capsys.readouterr().out
    assert rlconf(["plan", "--preset", "tiny-grpo", "--set", "trainer.total_epochs=4"]) == 2
    err = capsys.readouterr().err
    assert "trainer.total_epochs" in err and "unbounded stream" in err and "set trainer.total_steps" in err


@pytest.mark.slow
@pytest.mark.multiproc
def test_rltrain_runs_the_derived_steps(tmp_path):
    """A real run with total_epochs: 20 prompts in batches of 8 give 2 steps per epoch, so 2 epochs run
    steps 1..4 (the trainer loop reads the plan's count), and plan.json records where 4 came from."""
    import os
    import subprocess
    import sys

    f = write_jsonl(tmp_path / "train.jsonl", 20)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--data.train_files", str(f), "--trainer.total_epochs",
         "2", "--trainer.output_dir", str(out), "--trainer.val_before_train", "false", "--trainer.save_freq", "0"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["length"]["total_steps"] == 4 and plan["run"]["total_steps"] == 4
