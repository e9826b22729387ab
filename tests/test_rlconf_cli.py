"""The `rlconf` tool as users run it: exit codes, messages with paths, no tracebacks."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import yaml

from presets import PRESETS, get_preset
from rlconf.cli import main
from rlconf.load import config_to_dict

THREE_MISTAKES = """\
preset: tiny-grpo
actor:
  optim:
    lrr: 1e-6            # typo
rollout:
  n: 1                   # grpo needs n >= 2
profile:
  ranks: [0, 5]          # world has 1 device
"""


def rlconf(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the real command in its own process (exit code and streams as a user sees them)."""
    return subprocess.run(
        [sys.executable, "-m", "rlconf.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_validate_reports_all_three_mistakes_and_exits_2(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(THREE_MISTAKES)
    result = rlconf("validate", str(f))
    assert result.returncode == 2
    for path in ("actor.optim.lrr", "rollout.n", "profile.ranks[1]"):
        assert path in result.stderr
    assert "did you mean `actor.optim.lr`" in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_ok_and_mixed_files(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("preset: tiny-ppo\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [\n")
    assert main(["validate", str(good)]) == 0
    assert f"ok {good}" in capsys.readouterr().out
    assert main(["validate", str(good), str(bad)]) == 2
    out = capsys.readouterr()
    assert f"ok {good}" in out.out and "YAML syntax error" in out.err


def test_validate_shows_warnings(tmp_path, capsys):
    f = tmp_path / "w.yaml"
    f.write_text("preset: tiny-grpo\nactor:\n  megatron:\n    sequence_parallel: true\n")
    assert main(["validate", str(f)]) == 0
    out = capsys.readouterr()
    assert "1 warning" in out.out and "actor.megatron.sequence_parallel" in out.err


def test_diff_presets_lists_critic_and_algorithm_paths():
    result = rlconf("diff", "preset:tiny-grpo", "preset:tiny-ppo")
    assert result.returncode == 0
    assert "~ critic.enable: false -> true" in result.stdout
    assert "~ algorithm.adv_estimator: grpo -> gae" in result.stdout
    assert "actor.optim.lr" not in result.stdout  # equal values are not listed


def test_diff_file_against_preset(tmp_path, capsys):
    f = tmp_path / "a.yaml"
    f.write_text("preset: tiny-grpo\nactor:\n  optim:\n    lr: 5e-4\n")
    assert main(["diff", str(f), "preset:tiny-grpo"]) == 0
    assert "~ actor.optim.lr: 0.0005 -> 0.001" in capsys.readouterr().out


def test_show_marks_values_that_differ_from_defaults(capsys):
    assert main(["show", "--preset", "tiny-ppo", "--set", "actor.megatron.sequence_parallel=true"]) == 0
    out = capsys.readouterr().out
    assert "enable: true  # default: false" in out
    assert "sequence_parallel: true  # default: false; warning: sequence_parallel needs" in out
    assert yaml.safe_load(out)["critic"]["enable"] is True  # still valid YAML


def test_show_unknown_preset_exits_2(capsys):
    assert main(["show", "--preset", "tiny-grp"]) == 2
    assert "did you mean `tiny-grpo`" in capsys.readouterr().err


def test_schema_validates_every_presets_resolved_yaml(tmp_path):
    result = rlconf("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    for name in PRESETS:
        resolved = yaml.safe_load(rlconf("show", "--plain", f"preset:{name}").stdout)
        assert resolved == config_to_dict(get_preset(name))
        jsonschema.validate(resolved, schema)
    # and rejects what the loader rejects
    bad = config_to_dict(get_preset("tiny-grpo"))
    bad["actor"]["optim"]["lrr"] = 1
    assert not jsonschema.Draft202012Validator(schema).is_valid(bad)


def test_schema_describes_fields():
    result = json.loads(rlconf("schema").stdout)
    lr = result["$defs"]["Optim"]["properties"]["lr"]
    assert lr["type"] == "number" and lr["default"] == 1e-3 and "learning rate" in lr["description"]


def test_crash_is_exit_1_without_traceback(monkeypatch, capsys):
    import rlconf.render

    def boom(*_a, **_k):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(rlconf.render, "render_config", boom)
    assert main(["show", "--preset", "tiny-grpo"]) == 1
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: simulated bug" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["validate", "show", "plan"])
@pytest.mark.parametrize("form", ["file", "preset:NAME", "--preset NAME", "--preset NAME + file"])
def test_every_command_takes_every_input_form(command, form, tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("preset: tiny-ppo\nactor:\n  optim:\n    lr: 0.0005\n" if form == "file" else
                 "actor:\n  optim:\n    lr: 0.0005\n")  # fmt: skip
    args = {
        "file": [str(f)],
        "preset:NAME": ["preset:tiny-ppo"],
        "--preset NAME": ["--preset", "tiny-ppo"],
        "--preset NAME + file": ["--preset", "tiny-ppo", str(f)],
    }[form]
    assert main([command, *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    if command == "show":
        assert "enable: true  # default: false" in out  # the critic of tiny-ppo
    if command == "validate":
        assert out.startswith("ok ")


def test_diff_takes_preset_forms(tmp_path, capsys):
    f = tmp_path / "a.yaml"
    f.write_text("actor:\n  optim:\n    lr: 0.0005\n")
    assert main(["diff", str(f), "--preset", "tiny-grpo"]) == 0  # the file over the preset vs the preset
    assert "~ actor.optim.lr: 0.0005 -> 0.001" in capsys.readouterr().out
    assert main(["diff", "preset:tiny-grpo", "--preset", "tiny-ppo"]) == 2
    assert "both preset:tiny-grpo and --preset tiny-ppo" in capsys.readouterr().err


def test_diff_plan_collapses_per_step_rows_into_ranges(capsys):
    assert main(["diff", "--plan", "preset:tiny-grpo", "preset:tiny-ppo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # The critic's whole lr table is part of a record only tiny-ppo has: one line (515 lines before).
    assert not [line for line in lines if "optim[role=critic]." in line]
    assert "~ optim[role=critic]: <missing> -> <added: 515 values>" in lines
    # The actor's table, on both sides, still collapses into step ranges (tiny-ppo's critic warms up 5 steps).
    assert "~ optim[role=actor].table[step=1..5].update: true -> false" in lines
    assert len(lines) < 120


def test_diff_plan_range_shows_how_a_varying_schedule_changes(tmp_path, capsys):
    f = tmp_path / "warm.yaml"
    f.write_text("preset: tiny-grpo\ntrainer:\n  total_steps: 20\nactor:\n  optim:\n    lr_warmup_steps: 4\n")
    g = tmp_path / "flat.yaml"
    g.write_text("preset: tiny-grpo\ntrainer:\n  total_steps: 20\n")
    assert main(["diff", "--plan", str(f), str(g)]) == 0
    out = capsys.readouterr().out
    # steps 1-4 ramp up in the first plan and are flat in the second; steps 5-20 are equal (not listed)
    assert "~ optim[role=actor].table[step=1..4].lr: 0.0..0.00075 -> 0.001" in out
    assert "step=5" not in out


@pytest.mark.parametrize(
    "args",
    [
        ["schema", "-o", "{bad}/schema.json"],
        ["docs", "{bad}/reference"],
        ["import-verl", "data.train_batch_size=8", "-o", "{bad}/run.yaml"],
    ],
    ids=["schema", "docs", "import-verl"],
)
def test_unwritable_output_paths_exit_2_naming_the_option(args, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder path under a file can never be created, even by root
    assert main([a.format(bad=blocker) for a in args]) == 2
    err = capsys.readouterr().err
    assert "[output-path]" in err and str(blocker) in err and "fix:" in err and "Traceback" not in err


def test_plan_diff_collapses_an_added_role_into_one_line(capsys):
    assert main(["diff", "--plan", "preset:tiny-grpo", "preset:tiny-ppo"]) == 0
    out = capsys.readouterr().out
    assert "~ layouts[role=critic]: <missing> -> <added: " in out
    assert (
        "~ batch[role=critic]: <missing> -> <added: " in out
        and "~ models.critic: <missing> -> <added: " in out
    )
    assert "batch[role=critic].dp" not in out and "models.critic.arch" not in out
    assert main(["diff", "--plan", "preset:tiny-ppo", "preset:tiny-grpo"]) == 0
    assert "~ layouts[role=critic]: <removed: " in capsys.readouterr().out
    # A field that exists on both sides is still shown value by value.
    assert "~ batch[role=actor].responses_per_prompt: 8 -> 1" in out


def test_plan_wording_constant_lr_and_row_counts(capsys):
    assert main(["plan", "preset:tiny-grpo"]) == 0
    out = capsys.readouterr().out
    assert "then constant for 100 steps" in out and "constant decay" not in out
    assert "(1 rows)" not in out
    # One of each: the counts say it in the singular (7 steps leave exactly one lr row out of the table).
    sets = ["trainer.total_steps=7", "actor.optim.lr_warmup_steps=1", "actor.optim.lr_decay_steps=1"]
    assert main(["plan", "preset:tiny-grpo", *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "warmup 1 step from 0, then constant for 1 step;" in out and "    ... (1 row)\n" in out
    assert "x 1 epoch)" in out
    assert not re.search(r"\b1 (steps|rows|epochs|layers)\b", out)


def test_plan_errors_name_their_source(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("preset: tiny-grpo\nmodel:\n  path: /nonexistent/model\n")
    assert main(["plan", str(f)]) == 2
    assert capsys.readouterr().err.startswith(f"{f}: invalid config:")
