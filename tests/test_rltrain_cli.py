"""The `rltrain` command line: precedence, errors with paths, the flag surface and the flag round trip."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from presets import get_preset
from rlconf.config import RLConfig
from rlconf.fields import get_path, iter_leaves, type_name
from rltrain.cli import main, parse_args
from rltrain.flags import apply_flags, config_to_flags, flag_values
from tests.typed_strategies import typed_configs

SNAPSHOT = Path(__file__).parent / "snapshots" / "rltrain_flags.txt"


def rltrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rltrain.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_dry_run_shows_flag_in_config_and_plan():
    result = rltrain("tiny-grpo", "--actor.optim.lr", "3e-6", "--dry-run")
    assert result.returncode == 0, result.stderr
    config_part, plan_part = result.stdout.split("# trainer plan")
    assert "lr: 3.0e-06  # default: 0.001" in config_part
    assert "3e-06" in plan_part or "3.0e-06" in plan_part


def test_misspelled_flag_exits_2_with_did_you_mean():
    result = rltrain("tiny-grpo", "--actor.optim.lrr", "1")
    assert result.returncode == 2
    assert "actor.optim.lrr" in result.stderr and "did you mean `actor.optim.lr`" in result.stderr
    assert "Traceback" not in result.stderr


def test_npu_without_torch_npu_exits_2_with_the_install_hint(tmp_path):
    # This machine has no torch_npu, CANN, MindSpeed or NPU: the run stops before Ray starts, on the
    # config path, with what to install.
    result = rltrain("tiny-grpo", "--cluster.device", "npu", "--trainer.output_dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert "cluster.device" in result.stderr and "torch_npu" in result.stderr
    assert "docs/hardware.md" in result.stderr and "MindSpeed" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists(), "nothing of the run was created"


def test_cuda_without_a_gpu_exits_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        return  # a GPU machine runs it for real
    result = rltrain("tiny-grpo", "--cluster.device", "cuda", "--trainer.output_dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert "cluster.device" in result.stderr and "no usable CUDA device" in result.stderr
    assert "Traceback" not in result.stderr


def test_cross_field_errors_from_flags_exit_2(capsys):
    assert main(["tiny-grpo", "--rollout.n", "1", "--actor.optim.lr", "0", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "rollout.n" in err and "actor.optim.lr" in err


def test_precedence_flags_over_file_over_preset(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("actor:\n  optim:\n    lr: 5e-4\n    min_lr: 1e-5\n")
    config, dry_run = parse_args(["tiny-grpo", "--config", str(f), "--actor.optim.lr", "2e-4", "--dry-run"])
    assert dry_run
    assert config.actor.optim.lr == 2e-4 and config.actor.optim.min_lr == 1e-5
    assert config.trainer.output_dir == "outputs/tiny-grpo"


def test_boolean_flags_accept_yaml_spellings():
    config, _ = parse_args(["tiny-grpo", "--actor.shuffle", "false", "--trainer.val_before_train=no"])
    assert config.actor.shuffle is False and config.trainer.val_before_train is False


def test_list_and_help(capsys):
    assert main(["--list"]) == 0
    assert "tiny-ppo" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "PRESET" in capsys.readouterr().out


def test_preset_help_has_field_docstrings():
    result = rltrain("tiny-grpo", "--help")
    assert result.returncode == 0
    assert "--actor.optim.lr" in result.stdout and "Peak learning rate" in result.stdout


def _surface() -> str:
    return "".join(
        f"--{leaf.path} [{type_name(leaf.type)}] = {leaf.default!r}\n" for leaf in iter_leaves(RLConfig)
    )


def test_cli_surface_snapshot():
    """Every config field is a flag; a new or changed flag shows up in review as a snapshot diff.
    Refresh with: UPDATE_SNAPSHOTS=1 pytest tests/test_rltrain_cli.py"""
    current = _surface()
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(current)
    assert SNAPSHOT.read_text() == current, "CLI surface changed: review, then UPDATE_SNAPSHOTS=1"


def test_every_field_is_a_flag():
    """Setting every field by flag at once (the tiny-ppo values over plain defaults) gives tiny-ppo."""
    target = get_preset("tiny-ppo")
    flags = [
        tok
        for leaf in iter_leaves(RLConfig)
        for tok in (f"--{leaf.path}", *flag_values(get_path(target, leaf.path)))
    ]
    assert len([f for f in flags if f.startswith("--")]) == len(list(iter_leaves(RLConfig)))
    assert apply_flags(RLConfig(), flags) == (target, [])


SAFE_TEXT = st.text(alphabet="abcdefghijklmnopqrstuvwxyzNT0123456789_/.", min_size=1, max_size=10).filter(
    lambda s: not s[0].isdigit() and s[0] not in "._"
)


@settings(max_examples=60, deadline=None)
@given(typed_configs(text=SAFE_TEXT))
@example(replace(RLConfig(), model=replace(RLConfig().model, tokenizer_path="null")))
@example(replace(RLConfig(), model=replace(RLConfig().model, tokenizer_path="None")))
def test_config_rendered_to_flags_parses_back_equal(config):
    assert apply_flags(RLConfig(), config_to_flags(config)) == (config, [])


FOUR_ERRORS = """\
preset: tiny-grpo
actor:
  optim:
    lrr: 1e-6           # structural: unknown key
    lr: 0               # cross-field: lr must be > 0
rollout:
  n: 1                  # cross-field: grpo needs n >= 2
trainer:
  total_steps: many     # structural: not an integer
"""


def test_every_config_error_at_once_exactly_like_rlconf_validate(tmp_path, capsys):
    from rlconf.cli import main as rlconf_main

    f = tmp_path / "bad.yaml"
    f.write_text(FOUR_ERRORS)
    assert rlconf_main(["validate", str(f)]) == 2
    validate_err = capsys.readouterr().err
    assert main(["tiny-grpo", "--config", str(f), "--dry-run"]) == 2
    rltrain_err = capsys.readouterr().err
    assert rltrain_err == validate_err
    for path in ("actor.optim.lrr", "trainer.total_steps", "actor.optim.lr", "rollout.n"):
        assert f"] {path}:" in rltrain_err
    assert rltrain_err.startswith(f"{f}: invalid config:")


BAD_FLAG_VALUES = [
    ("actor.optim.lr", "abc"),  # not a number
    ("trainer.total_steps", "-x"),  # a value that looks like a flag
    ("trainer.total_steps", "1.5"),
    ("model.params_dtype", "f16"),  # not one of the choices
    ("actor.use_kl_loss", "maybe"),
    ("actor.optim.lrr", "1"),  # no such flag
    ("profile.steps", "[1, x]"),  # a list with a bad item
]


@pytest.mark.parametrize(("path", "value"), BAD_FLAG_VALUES, ids=[f"{p}={v}" for p, v in BAD_FLAG_VALUES])
def test_a_bad_flag_value_reads_as_rlconf_validate_reads_it_in_a_file(path, value, capsys):
    """rlplan's error format, never tyro's box: the rule, path, message and fix `rlconf validate` gives
    the same value, with the command line as the source."""
    from rlconf.cli import main as rlconf_main

    assert main(["tiny-grpo", f"--{path}", value]) == 2
    err = capsys.readouterr().err
    assert rlconf_main(["validate", "--preset", "tiny-grpo", "--set", f"{path}={value}"]) == 2
    validate_err = capsys.readouterr().err
    assert err.startswith("command line: invalid config: 1 error\nerror [")
    assert err.splitlines()[1:] == validate_err.splitlines()[1:]
    assert "╭" not in err and "Traceback" not in err


def test_flag_syntax_errors_name_the_flag_and_the_fix(capsys):
    assert main(["tiny-grpo", "--cluster.nnodes"]) == 2
    err = capsys.readouterr().err
    assert "error [flag-syntax] cluster.nnodes: --cluster.nnodes takes one value (integer), got none" in err
    assert main(["tiny-grpo", "--trainer.total_steps", "1", "2"]) == 2
    assert "takes one value (integer), got 2: 1 2" in capsys.readouterr().err
    assert main(["tiny-grpo", "--actor.optim.betas", "0.9"]) == 2
    assert "error [type] actor.optim.betas: expected 2 items, got 1" in capsys.readouterr().err
    assert main(["tiny-grpo", "stray", "--dry-run"]) == 2
    assert "error [flag-syntax] <root>: `stray` is not a flag and follows no flag" in capsys.readouterr().err


def test_flags_take_negative_numbers_lists_and_null():
    from rlconf.fields import replace_paths

    base = replace_paths(RLConfig(), {"trainer.max_ckpt_to_keep": 3})
    flags = ["--algorithm.gamma", "-1", "--profile.steps", "[2, 3]", "--actor.optim.betas", "0.8", "0.99",
             "--trainer.max_ckpt_to_keep", "None", "--profile.ranks", "--actor.shuffle=0"]  # fmt: skip
    config, issues = apply_flags(base, flags)
    assert issues == []
    assert config.algorithm.gamma == -1.0 and config.profile.steps == (2, 3)
    assert config.actor.optim.betas == (0.8, 0.99) and config.trainer.max_ckpt_to_keep is None
    assert config.profile.ranks == () and config.actor.shuffle is False


def test_every_error_names_its_source(capsys):
    assert main(["tiny-grpoo"]) == 2
    assert capsys.readouterr().err.startswith("command line: invalid config: 1 error\nerror [unknown-preset]")
    assert main(["tiny-grpo", "--cluster.nnodes", "2", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("command line: invalid config:") and "[ray-cluster] cluster.nnodes" in err


def test_a_start_check_names_the_config_file(tmp_path, capsys, monkeypatch):
    # The Ray-cluster check runs as the run starts (not a config rule): it still names where the value came
    # from, the --config file here.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    f = tmp_path / "two-nodes.yaml"
    f.write_text("preset: tiny-grpo\ncluster:\n  nnodes: 2\n")
    assert main(["--config", str(f), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{f}: invalid config: 1 error\nerror [ray-cluster] cluster.nnodes:")
    assert main(["tiny-grpo", "--config", str(f), "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(f"{f}: invalid config:")


def test_a_tokenizer_that_fails_to_load_names_the_source(tmp_path):
    # Raised by the controller as the run starts (before Ray): still `SOURCE: invalid config`.
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    result = rltrain("tiny-grpo", "--model.tokenizer_path", str(tmp_path / "tok"),
                     "--trainer.output_dir", str(tmp_path / "out"))  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        "command line: invalid config: 1 error\nerror [tokenizer-load] model.tokenizer_path" in result.stderr
    )
