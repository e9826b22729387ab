"""Reads and derived sizes are bounded (issue 31 items 2 and 3): an interpolation bomb in a verl config, a chat
template that loops 10^10 times, data files that are devices or FIFOs, and plans far larger than this machine
all stop with exit 2 having read and allocated little (or at the render budget), naming the file or key;
never a hang, a MemoryError, or gigabytes of memory."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from rlconf.cli import main as rlconf_main
from rltrain.cli import main as rltrain_main
from tests.read_count import counting_reads

ROOT = Path(__file__).resolve().parents[1]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------------- import-verl
def test_import_verl_interpolation_bomb(tmp_path, capsys):
    """40 chained `${a}${a}` interpolations would expand to 2^40 characters (the issue saw 4.2 GB, then a
    MemoryError): the expansion stops at its limit with exit 2 naming the key."""
    lines = ["custom:", "  k0: ab"] + [
        f"  k{i}: ${{custom.k{i - 1}}}${{custom.k{i - 1}}}" for i in range(1, 41)
    ]
    verl = tmp_path / "verl.yaml"
    verl.write_text("\n".join(lines) + "\n")
    before = _peak_rss_mib()
    code = rlconf_main(["import-verl", str(verl)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert _peak_rss_mib() - before < 200  # expanded, 2^40 characters: a MemoryError
    assert "custom.k" in err and "expands to more than" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------- memory on cpu
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--rollout.n", "100000000"], "rollout kv cache"),
        (["--data.train_batch_size", "1000000000", "--actor.ppo_mini_batch_size", "1000000000"], "GiB"),
        (["--model.arch.hidden_size", str(2**40)], "actor params"),
    ],
    ids=["rollout.n-1e8", "batch-1e9", "hidden_size-2^40"],
)
def test_plans_larger_than_this_machine_exit_2_at_dry_run(flags, needle, capsys):
    """On cpu the budget is this machine's memory: the plan's own estimate and its advice, exit 2, fast."""
    before = _peak_rss_mib()
    code = rltrain_main(["tiny-grpo", *flags, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert _peak_rss_mib() - before < 200  # judged from the plan's arithmetic, nothing of that size built
    assert "[memory-exceeds-device]" in err and "this machine's memory per worker on cpu" in err
    assert needle in err and "fix: change one or more of" in err and "Traceback" not in err
    sets = [
        a
        for flag, value in zip(flags[::2], flags[1::2], strict=True)
        for a in ("--set", f"{flag[2:]}={value}")
    ]
    code = rlconf_main(["validate", "--preset", "tiny-grpo", *sets])
    assert code == 2 and "[memory-exceeds-device]" in capsys.readouterr().err


def test_cpu_presets_fit_a_24_gib_2_core_machine(monkeypatch):
    """The shipped CPU presets pass the check on the smallest machine CI runs on (24 GiB, 2 workers)."""
    from presets import PRESETS
    from rlconf import host_memory
    from rlconf.plan import compile_plan

    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: (24 << 30, "a 24 GiB machine"))
    checked = 0
    for name, preset in PRESETS.items():
        config = preset.build()
        if config.cluster.device == "cpu":
            plan = compile_plan(config)  # raises ConfigError when the estimate exceeds the budget
            budget = 24 / config.cluster.gpus_per_node
            assert plan.memory.peak_gib < budget / 10, name  # far inside: the presets are tiny
            checked += 1
    assert checked >= 4


def test_the_budget_is_memtotal_or_the_cgroup_limit():
    from rlconf.host_memory import host_memory_bytes

    found = host_memory_bytes()
    assert found is not None
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert found[0] <= total


def test_explicit_device_memory_overrides_the_host(capsys):
    assert rlconf_main(["validate", "--preset", "tiny-grpo", "--set", "rollout.n=1000000",
                        "--set", "cluster.device_memory_gib=100000"]) == 0  # fmt: skip


# ------------------------------------------------------------------------------------- data files
def _cli(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "rlconf.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)  # fmt: skip


@pytest.mark.parametrize("kind", ["fifo", "symlink-dev-zero"])
def test_data_file_that_is_not_a_regular_file(tmp_path, kind):
    f = tmp_path / "train.jsonl"
    if kind == "fifo":
        os.mkfifo(f)
    else:
        f.symlink_to("/dev/zero")
    result = _cli("validate", "--preset", "tiny-grpo", "--set", f"data.train_files=[{f}]")
    assert result.returncode == 2, result.stderr
    assert "] data.train_files[0]:" in result.stderr and "is not a regular file" in result.stderr


@pytest.mark.parametrize("kind", ["fifo", "symlink-dev-zero"])
def test_data_loader_refuses_what_is_not_a_regular_file(tmp_path, kind):
    """The loader itself (a library caller skips validate) refuses without blocking."""
    from rlconf.config import DataConfig
    from rlconf.errors import ConfigError
    from rlconf.plan.run import data_plan
    from rltrain.data import build_dataloaders
    from rltrain.tokenizer import CharTokenizer

    f = tmp_path / "train.jsonl"
    if kind == "fifo":
        os.mkfifo(f)
    else:
        f.symlink_to("/dev/zero")
    with pytest.raises(ConfigError) as info:
        build_dataloaders(data_plan(DataConfig(train_files=(str(f),))), CharTokenizer())
    assert (
        info.value.path.startswith("data.train_files")
        and "not a regular file" in info.value.issues[0].message
    )


# ------------------------------------------------------------------------------------- checkpoint records
@pytest.mark.parametrize("kind", ["fifo", "symlink-dev-zero", "deep", "huge"])
def test_checkpoint_records_are_read_bounded(tmp_path, kind):
    """A checkpoint's manifest / meta.json that is a FIFO, /dev/zero, nested 100000 deep or 100 MiB: an
    error naming the file (in JSON_ERRORS, which every caller reports), at once, never a hang."""
    from rltrain.checkpoint.manifest import JSON_ERRORS, read_json

    f = tmp_path / "manifest.json"
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "symlink-dev-zero":
        f.symlink_to("/dev/zero")
    elif kind == "deep":
        f.write_text("[" * 100_000 + "]" * 100_000)
    else:
        with open(f, "wb") as out:
            out.truncate(100 << 20)
    with counting_reads() as reads, pytest.raises(JSON_ERRORS) as info:
        read_json(f)
    assert reads.bytes <= 200_000  # the 200,000-byte nested file; the others are refused unread
    assert str(f) in str(info.value)
    assert {"fifo": "FIFO", "symlink-dev-zero": "a device", "deep": "nested deeper", "huge": "larger than"}[
        kind
    ] in str(info.value)
