"""`rlconf validate` and `rltrain` (with or without --dry-run) reject what the run would reject, before it
starts, with exit 2, the config path and a fix; and the run's own components reject the same inputs (so
the rule and the run cannot drift apart unnoticed)."""

from __future__ import annotations

import numpy as np
import pytest

from presets import PRESETS
from rlconf.cli import main as rlconf_main
from rlconf.config import DataConfig
from rlconf.errors import ConfigError
from rlconf.load import load_config
from rlconf.plan import compile_plan
from rlconf.plan.run import data_plan, tokenizer_plan
from rlconf.validate import CHECKPOINT_COMPLETE_MARKER, PROMPT_FILE_TYPES, SEED_LIMIT
from rltrain.cli import main as rltrain_main


def _both_reject(tmp_path, capsys, body: str, path: str, *flags: str) -> tuple[str, str]:
    """Run `rlconf validate` on a file and `rltrain tiny-grpo --config FILE --dry-run`; both exit 2 naming
    `path`. Returns their stderr."""
    f = tmp_path / "run.yaml"
    f.write_text("preset: tiny-grpo\n" + body)
    assert rlconf_main(["validate", str(f)]) == 2
    validate_err = capsys.readouterr().err
    assert rltrain_main(["tiny-grpo", "--config", str(f), *flags, "--dry-run"]) == 2
    captured = capsys.readouterr()
    for err in (validate_err, captured.err):
        assert f"] {path}:" in err and "fix:" in err and "Traceback" not in err
    assert "# trainer plan" not in captured.out  # the dry run did not claim it would run
    return validate_err, captured.err


# ------------------------------------------------------------------------------------------- data files
def test_json_prompt_files_are_rejected_by_validate_and_by_the_data_loader(tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text('{"prompt": "1 2 3", "answer": "4 5 6"}\n')
    _both_reject(tmp_path, capsys, f"data:\n  train_files: [{prompts}]\n", "data.train_files[0]")

    from rlconf.config import ModelConfig
    from rltrain.data import load_prompt_files
    from rltrain.tokenizer import load_tokenizer

    with pytest.raises(ConfigError, match="unsupported prompt file type"):
        load_prompt_files(
            [str(prompts)],
            data_plan(DataConfig(train_files=(str(prompts),))),
            load_tokenizer(tokenizer_plan(ModelConfig())),
        )
    assert ".json" not in PROMPT_FILE_TYPES


def test_missing_prompt_file_is_rejected_before_the_run(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    validate_err, _ = _both_reject(
        tmp_path, capsys, f"data:\n  val_files: [{missing}]\n", "data.val_files[0]"
    )
    assert "does not exist" in validate_err


def test_existing_jsonl_prompt_file_passes(tmp_path, capsys):
    prompts = tmp_path / "prompts.JSONL"  # the loader compares suffixes case-insensitively
    prompts.write_text('{"prompt": "1 2 3", "answer": "4 5 6"}\n')
    f = tmp_path / "run.yaml"
    f.write_text(f"preset: tiny-grpo\ndata:\n  train_files: [{prompts}]\n")
    assert rlconf_main(["validate", str(f)]) == 0, capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ numbers
def test_huge_seed_is_rejected_and_the_limit_fits_every_generator(tmp_path, capsys):
    _both_reject(tmp_path, capsys, "trainer:\n  seed: 100000000000000000000000000000\n", "trainer.seed")
    import torch

    # What a worker did with it: died without naming the cause.
    with pytest.raises((RuntimeError, ValueError)):
        torch.manual_seed(10**29)
    # The largest accepted seed, plus the offsets workers add (ranks, megatron's 2718 + tp rank), is fine.
    torch.manual_seed(SEED_LIMIT - 1 + 2718 + 1024)
    np.random.default_rng([SEED_LIMIT - 1, 3]).random()
    with pytest.raises(ValueError):
        np.random.default_rng([-1, 3])  # and why seeds are non-negative


def test_step_count_the_plan_cannot_build_is_rejected_by_validate(tmp_path, capsys):
    _both_reject(tmp_path, capsys, "trainer:\n  total_steps: 100000000000000000000000000000\n",
                 "trainer.total_steps")  # fmt: skip
    # validate reports it under the same path the plan compiler does (the rule mirrors the plan's limit)
    from rlconf.load import build_from_sources

    config, _, _ = build_from_sources(
        None, preset="tiny-grpo", overrides=["trainer.total_steps=100001"], presets=PRESETS
    )
    with pytest.raises(ConfigError) as info:
        compile_plan(config)
    assert "trainer.total_steps" in info.value.paths


# ----------------------------------------------------------------------------------------- resume / output
def test_dry_run_with_a_missing_resume_path_says_it_cannot_resume(tmp_path, capsys):
    missing = tmp_path / "checkpoints" / "global_step_5"
    _, err = _both_reject(
        tmp_path, capsys, "trainer:\n  resume_mode: resume_path\n", "trainer.resume_from_path",
        "--trainer.resume_from_path", str(missing),
    )  # fmt: skip
    assert "cannot resume" in err and "does not exist" in err


def test_resume_path_needs_a_finished_checkpoint(tmp_path, capsys):
    step = tmp_path / "checkpoints" / "global_step_5"
    (step / "actor").mkdir(parents=True)
    argv = ["tiny-grpo", "--trainer.resume_mode", "resume_path", "--trainer.output_dir", str(tmp_path / "o")]
    assert rltrain_main([*argv, "--trainer.resume_from_path", str(step), "--dry-run"]) == 2
    assert f"no {CHECKPOINT_COMPLETE_MARKER} marker" in capsys.readouterr().err
    (step / CHECKPOINT_COMPLETE_MARKER).write_text("{}")
    # naming the run's checkpoints folder instead of a step: the fix lists the steps there
    assert rltrain_main([*argv, "--trainer.resume_from_path", str(step.parent), "--dry-run"]) == 2
    assert "not a global_step_N folder" in (err := capsys.readouterr().err) and "steps [5]" in err
    # a role folder names its checkpoint; the run re-checks the digests at start
    assert rltrain_main([*argv, "--trainer.resume_from_path", str(step / "actor"), "--dry-run"]) == 0


def test_the_marker_name_is_the_checkpoint_managers():
    from rltrain.checkpoint import COMPLETE

    assert CHECKPOINT_COMPLETE_MARKER == COMPLETE


def test_output_dir_that_is_a_file_is_a_config_error(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    _, err = _both_reject(tmp_path, capsys, f"trainer:\n  output_dir: {taken}\n", "trainer.output_dir")
    assert "is not a folder" in err
    _both_reject(tmp_path, capsys, f"trainer:\n  output_dir: {taken}/run\n", "trainer.output_dir")


def test_output_dir_that_can_be_created_passes(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "run"
    assert rlconf_main(["validate", "preset:tiny-grpo", "--set", f"trainer.output_dir={out}"]) == 0
    assert not out.exists()  # validate checks, it creates nothing


# ---------------------------------------------------------------------------------------------- rewards
def test_validate_and_dry_run_never_import_the_reward_module(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "imported"
    (tmp_path / "sneaky_reward.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n\ndef score(response, ground_truth, prompt):\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = "sneaky_reward:score"
    assert rlconf_main(["validate", "preset:tiny-grpo", "--set", f"reward.function={spec}"]) == 0
    assert rltrain_main(["tiny-grpo", "--reward.function", spec, "--dry-run"]) == 0
    capsys.readouterr()
    assert not marker.exists()
    # the run does import it (at start, with its signature checked): the import is real
    from rltrain.rewards import load_reward_function

    load_reward_function(spec)
    assert marker.exists()


def test_reward_function_doc_states_the_trust_model():
    from rlconf.config import RewardConfig
    from rlconf.fields import field_docs

    doc = field_docs(RewardConfig)["function"]
    assert "never import it" in doc and "runs code" in doc


# ------------------------------------------------------------------------------------- load_config API
def test_filesystem_rules_run_only_when_asked(tmp_path):
    overrides = [f"data.train_files=[{tmp_path / 'absent.jsonl'}]"]
    # a config checked away from its files
    load_config(None, preset="tiny-grpo", overrides=overrides, presets=PRESETS)
    with pytest.raises(ConfigError) as info:
        load_config(None, preset="tiny-grpo", overrides=overrides, filesystem=True, presets=PRESETS)
    assert info.value.paths == ("data.train_files[0]",)


# ------------------------------------------------------------------------------------------------ the plan
def test_validate_reports_what_only_the_plan_compiler_finds(tmp_path, capsys):
    """A model folder without config.json passes the rules (they cannot read it) but not the plan, which
    the run compiles first: validate compiles it too."""
    model = tmp_path / "model"
    model.mkdir()
    f = tmp_path / "run.yaml"
    f.write_text(f"preset: tiny-grpo\nmodel:\n  path: {model}\n")
    assert rlconf_main(["validate", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}: invalid config" in err and "] model.path:" in err and "config.json" in err
    assert rltrain_main(["tiny-grpo", "--config", str(f), "--dry-run"]) == 2
    assert "] model.path:" in capsys.readouterr().err
