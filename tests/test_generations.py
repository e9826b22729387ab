"""Generation records (rltrain.generations, MetricsLogger.log_generations): what a verl user's
trainer.log_val_generations / rollout_data_dir / validation_data_dir give, as rlplan's logging.* fields;
the run itself is tests/test_e2e.py's resume test."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from presets import PRESETS
from rlconf.load import load_config
from rlconf.plan import compile_plan
from rlconf.verl.translate import translate
from rltrain.generations import fixed_sample, text_rows, write_step_file
from rltrain.metrics import VAL_GENERATIONS_FILE, MetricsLogger


@given(st.integers(0, 300), st.integers(0, 400), st.integers(0, 2**63 - 1))
def test_the_fixed_sample_is_distinct_rows_chosen_by_the_seed_alone(n_rows, count, seed):
    chosen = fixed_sample(n_rows, count, seed)
    assert len(chosen) == min(count, n_rows) == len(set(chosen))
    assert all(0 <= i < n_rows for i in chosen)
    assert chosen == fixed_sample(n_rows, count, seed)  # every validation, every process, every resume
    # A larger count extends the same choice (raising val_generations keeps the rows already followed).
    assert fixed_sample(n_rows, count + 5, seed)[: len(chosen)] == chosen


def test_another_seed_chooses_other_rows():
    assert fixed_sample(1000, 10, 1) != fixed_sample(1000, 10, 2)


def test_step_files_are_verl_dump_lines(tmp_path):
    rows = text_rows(["1+1="], ["2"], ["2"], [1.0], ["synthetic"])
    folder = tmp_path / "gens" / "rollout"  # created
    path = write_step_file(str(folder), 7, rows)
    assert path == folder / "7.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"input": "1+1=", "output": "2", "gts": "2", "score": 1.0, "data_source": "synthetic", "step": 7}
    ]
    write_step_file(str(folder), 7, text_rows(["a", "b"], ["c", "d"], [None, [1, 2]], [0.0, 0.5], ["x", "y"]))
    assert len(path.read_text().splitlines()) == 2  # a redone step replaces its file
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_rows_must_line_up():
    with pytest.raises(ValueError):
        text_rows(["p"], ["r1", "r2"], ["g"], [1.0], ["d"])


def _samples(step: int) -> list[dict]:
    return [{"input": "q", "output": f"a{step}", "gts": "g", "score": 0.5, "data_source": "d", "row": 3}]


def test_the_logger_keeps_one_line_per_validation_across_resumes(tmp_path):
    log = MetricsLogger(tmp_path, ("jsonl",))
    for step in (0, 2, 4):
        log.log_generations(step, _samples(step))
    path = tmp_path / VAL_GENERATIONS_FILE
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 2, 4] and lines[1]["samples"] == _samples(2)
    # A resume from step 2 redoes steps 3-4; its validation before training validates step 2 again.
    log.truncate_after(2)
    log.log_generations(2, _samples(22))
    log.log_generations(4, _samples(4))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 2, 4] and lines[1]["samples"] == _samples(22)
    log.truncate_after(0)  # a fresh start over the folder
    assert path.read_text() == ""


def test_tensorboard_gets_the_samples_as_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, ("tensorboard",))
    log.log_generations(2, _samples(2))
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    (event,) = events.Tensors("val/generations/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 2 and "row 3" in text and "a2" in text


def test_the_plan_puts_relative_folders_under_the_run_folder(tmp_path):
    config = load_config(None, preset="tiny-grpo", presets=PRESETS, overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "logging.rollout_data_dir=gens/../dumps",
        f"logging.validation_data_dir={tmp_path / 'val'}", "logging.val_generations=5"])  # fmt: skip
    log = compile_plan(config).run.logging
    assert log.rollout_data_dir == str(tmp_path / "run" / "dumps")
    assert log.validation_data_dir == str(tmp_path / "val") and log.val_generations == 5
    plain = compile_plan(load_config(None, preset="tiny-grpo", presets=PRESETS)).run.logging
    assert plain.rollout_data_dir is None and plain.validation_data_dir is None and plain.val_generations == 0


def test_verl_keys_translate(tmp_path, monkeypatch):
    """verl's folders are relative to the current directory: made absolute, so the run writes where verl
    would have."""
    monkeypatch.chdir(tmp_path)
    result = translate(None, ["trainer.log_val_generations=10", "trainer.rollout_data_dir=dumps/rollout",
                              "trainer.validation_data_dir=/data/val", "trainer.test_freq=5"])  # fmt: skip
    log = result.config.logging
    assert log.val_generations == 10
    assert log.rollout_data_dir == str(tmp_path / "dumps" / "rollout")
    assert log.validation_data_dir == "/data/val"
    assert not {u.verl for u in result.unmapped} & {"trainer.log_val_generations", "trainer.rollout_data_dir"}


def test_rlconf_plan_says_when_the_run_validates_and_what_it_records(tmp_path):
    from rlconf.plan.render import format_plan

    def validation_line(*overrides: str) -> str:
        config = load_config(None, preset="tiny-grpo", presets=PRESETS,
                             overrides=[f"trainer.output_dir={tmp_path}", *overrides])  # fmt: skip
        return next(
            line for line in format_plan(compile_plan(config)).splitlines() if line.startswith("validation:")
        )

    assert validation_line("logging.val_generations=3", "logging.rollout_data_dir=gens") == (
        "validation: before the first step, every 25 steps and after the last; records 3 fixed rows per "
        f"validation -> val_generations.jsonl; every step's responses -> {tmp_path}/gens/STEP.jsonl"
    )
    # No validation: nothing of it recorded (rule generation-records warns), the step dumps still are.
    assert validation_line("trainer.test_freq=0", "trainer.val_before_train=false", "logging.val_generations=3",
                           "logging.validation_data_dir=v") == "validation: none"  # fmt: skip
