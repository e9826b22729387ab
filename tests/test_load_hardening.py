"""Hostile or mistaken config files: duplicate keys, YAML anchor bombs, deep nesting, devices, huge files.

Each is refused with exit 2, a message naming the file (and the dotted path where there is one) and a fix,
having built little (the peak memory grows by less than MEMORY_BOUND_MIB), by every command that reads a
config file. Bounds are asserted in memory, not seconds: a wall-clock bound fails on a loaded CI machine.
"""

from __future__ import annotations

import json
import resource

import pytest

from rlconf.cli import main as rlconf_main
from rlconf.load import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_NODES
from rltrain.cli import main as rltrain_main
from tests.read_count import counting_reads

# Before the bounds the anchor bomb took 47 s and 3 GB; bounded, each case grows the peak by a few MiB.
MEMORY_BOUND_MIB = 200


def _billion_laughs(levels: int = 12) -> str:
    """A ~600-byte YAML whose last key expands to 9**levels strings."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


HOSTILE = {
    "anchor-bomb.yaml": (_billion_laughs(), f"more than {MAX_CONFIG_NODES:,} values"),
    "self-alias.yaml": ("trainer: &t\n  inner: *t\n", "contains itself through a YAML alias"),
    "deep-flow.yaml": ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", f"deeper than {MAX_CONFIG_DEPTH}"),
    "deep-block.yaml": (
        "".join(f"{' ' * i}k{i}:\n" for i in range(200)) + " " * 200 + "v: 1\n",
        f"deeper than {MAX_CONFIG_DEPTH}",
    ),
    "deep.json": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", f"deeper than {MAX_CONFIG_DEPTH}"),
    "many-values.yaml": ("profile:\n  ranks: [" + ", ".join(["0"] * 60_000) + "]\n", "more than"),
    "huge.yaml": ("# " + "x" * MAX_CONFIG_BYTES + "\n", "larger than"),
}


def _bounded(fn, *args) -> tuple[int, float]:
    """(exit code, MiB the process's peak resident memory grew by while `fn` ran)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = fn(*args)
    return code, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_file_exits_2_bounded_with_the_file_and_a_fix(name, tmp_path, capsys):
    text, expected = HOSTILE[name]
    f = tmp_path / name
    f.write_text(text)
    code, grown = _bounded(rlconf_main, ["validate", str(f)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert grown < MEMORY_BOUND_MIB
    assert str(f) in err and expected in err and "fix:" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_device_files_are_refused_without_reading_them(device, capsys):
    with counting_reads() as reads:
        code = rlconf_main(["validate", device])
    err = capsys.readouterr().err
    assert code == 2 and reads.bytes == 0
    assert f"{device} is not a regular file" in err and "fix:" in err


def test_folder_is_refused(tmp_path, capsys):
    assert rlconf_main(["validate", str(tmp_path)]) == 2
    assert "is a folder, not a config file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("trainer:\n  total_steps: 3\nactor:\n  ppo_epochs: 2\ntrainer:\n  save_freq: 2\n", "trainer"),
        ("trainer:\n  total_steps: 3\n  save_freq: 1\n  total_steps: 4\n", "trainer.total_steps"),
        ("profile:\n  ranks: [0]\n  steps: [1]\n  ranks: [1]\n", "profile.ranks"),
    ],
)
def test_duplicate_yaml_keys_name_their_path(text, path, tmp_path, capsys):
    f = tmp_path / "dup.yaml"
    f.write_text("preset: tiny-grpo\n" + text)
    assert rlconf_main(["validate", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"[duplicate-key] {path}: `{path}` is given twice" in err
    assert "merge the two" in err


def test_duplicate_json_keys_name_their_path(tmp_path, capsys):
    f = tmp_path / "dup.json"
    f.write_text('{"preset": "tiny-grpo", "trainer": {"total_steps": 3, "total_steps": 4}}')
    assert rlconf_main(["validate", str(f)]) == 2
    err = capsys.readouterr().err
    assert "[duplicate-key] trainer.total_steps:" in err and str(f) in err


def test_yaml_merge_keys_are_not_duplicates(tmp_path, capsys):
    # `<<:` merges an anchor's keys; overriding one of them is what merge keys are for.
    f = tmp_path / "merge.yaml"
    f.write_text(
        "preset: tiny-grpo\nactor:\n  optim: &o\n    lr: 0.001\n    min_lr: 0.0\n"
        "critic:\n  optim:\n    <<: *o\n    lr: 0.002\n"
    )
    assert rlconf_main(["validate", str(f)]) == 0, capsys.readouterr().err


def test_ordinary_aliases_still_work(tmp_path, capsys):
    f = tmp_path / "alias.yaml"
    f.write_text(
        "preset: tiny-grpo\nactor:\n  optim:\n    betas: &b [0.8, 0.9]\ncritic:\n  optim:\n    betas: *b\n"
    )
    assert rlconf_main(["show", "--plain", str(f)]) == 0
    assert "betas: [0.8, 0.9]" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["show", "plan", "diff"])
def test_every_rlconf_command_applies_the_bounds(command, tmp_path, capsys):
    f = tmp_path / "bomb.yaml"
    f.write_text(_billion_laughs())
    args = [command, str(f)] + (["preset:tiny-grpo"] if command == "diff" else [])
    code, grown = _bounded(rlconf_main, args)
    assert code == 2 and grown < MEMORY_BOUND_MIB
    assert "more than" in capsys.readouterr().err


def test_rltrain_config_applies_the_bounds(tmp_path, capsys):
    f = tmp_path / "bomb.yaml"
    f.write_text(_billion_laughs())
    code, grown = _bounded(rltrain_main, ["tiny-grpo", "--config", str(f), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and grown < MEMORY_BOUND_MIB
    assert str(f) in err and "more than" in err
    assert rltrain_main(["tiny-grpo", "--config", "/dev/zero", "--dry-run"]) == 2
    assert "/dev/zero is not a regular file" in capsys.readouterr().err


def test_import_verl_applies_the_bounds(tmp_path, capsys):
    f = tmp_path / "verl.yaml"
    f.write_text(_billion_laughs())
    code, grown = _bounded(rlconf_main, ["import-verl", str(f)])
    assert code == 2 and grown < MEMORY_BOUND_MIB
    assert "more than" in capsys.readouterr().err
    dup = tmp_path / "verl.json"
    dup.write_text(json.dumps({"trainer": {"total_epochs": 1}})[:-1] + ', "trainer": {}}')
    assert rlconf_main(["import-verl", str(dup)]) == 2
    assert "[duplicate-key] trainer:" in capsys.readouterr().err


def test_unprintable_characters_are_a_syntax_error_naming_the_file(tmp_path, capsys):
    f = tmp_path / "ctrl.yaml"
    f.write_text("trainer:\n  total_steps: 3\x1f\n")
    assert rlconf_main(["validate", str(f)]) == 2
    err = capsys.readouterr().err
    assert str(f) in err and "[yaml-syntax]" in err and "unacceptable character" in err
