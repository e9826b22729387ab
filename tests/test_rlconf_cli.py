"""The `rlconf` tool as users run it: exit codes, messages with paths, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
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
