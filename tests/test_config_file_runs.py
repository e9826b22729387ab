"""`rltrain --config FILE` runs a complete config without a preset (an imported verl run, a file of your
own); `rltrain` alone is a usage error; the migration guide's headline `import-verl` example runs as
printed, its output plans, and the report names the command that runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from presets import get_preset
from rlconf.config import RLConfig
from rltrain.cli import main, parse_args
from rltrain.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
QWEN25_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip


def test_a_file_without_preset_is_the_whole_config(tmp_path):
    """No preset's values slip in: what the file leaves out is the dataclass default."""
    f = tmp_path / "run.yaml"
    f.write_text("trainer:\n  total_steps: 3\n  output_dir: out\nactor:\n  optim:\n    lr: 5.0e-4\n")
    config, dry_run = parse_args(["--config", str(f), "--dry-run", "--trainer.save_freq", "1"])
    assert dry_run and config.trainer.total_steps == 3 and config.actor.optim.lr == 5e-4
    assert config.trainer.save_freq == 1  # flags still overlay the file
    preset = get_preset("tiny-grpo")
    assert preset.trainer.max_ckpt_to_keep != RLConfig().trainer.max_ckpt_to_keep
    assert config.trainer.max_ckpt_to_keep == RLConfig().trainer.max_ckpt_to_keep  # not the preset's
    # The file's own `preset:` line is honoured; a PRESET argument still works as before.
    f.write_text("preset: tiny-grpo\ntrainer:\n  total_steps: 3\n")
    config, _ = parse_args(["--config", str(f)])
    assert config.trainer.max_ckpt_to_keep == preset.trainer.max_ckpt_to_keep
    config, _ = parse_args(["tiny-grpo", "--config", str(f)])
    assert config.trainer.total_steps == 3


def test_bare_rltrain_is_a_usage_error_and_flags_need_a_preset_or_file(capsys):
    assert main([]) == 2
    assert "rltrain --config FILE.yaml" in capsys.readouterr().err
    assert main(["--dry-run"]) == 2
    assert "expected a PRESET or --config FILE first" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_rltrain_config_dry_run_in_a_subprocess(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("trainer:\n  total_steps: 2\n")
    result = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "--config", str(f), "--dry-run"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "# trainer plan" in result.stdout and "total_steps: 2" in result.stdout


def _verl_home(home: Path, rows: int = 64) -> None:
    """What a verl user has: a model folder and the parquet files of verl's gsm8k preprocessing."""
    model = home / "models" / "Qwen2.5-7B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    CharTokenizer().save_pretrained(model)
    data = home / "data" / "gsm8k"
    data.mkdir(parents=True)
    for split in ("train", "test"):
        table = pa.Table.from_pylist(
            [
                {
                    "data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": f"{i}+{i}="}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                    "extra_info": {"split": split, "index": i},
                }
                for i in range(rows)
            ]
        )
        pq.write_table(table, data / f"{split}.parquet")


def _first_bash_block(page: str) -> str:
    return re.search(r"```bash\n(.*?)```", page, re.DOTALL).group(1)


def test_migration_guide_headline_example_runs_as_printed(tmp_path):
    home = tmp_path / "home"
    _verl_home(home)
    work = tmp_path / "work"
    work.mkdir()
    block = _first_bash_block((ROOT / "docs" / "migrating-from-verl.md").read_text())
    commands = [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    assert [c.split()[:2] for c in commands] == [["rlconf", "import-verl"], ["rlconf", "plan"]]
    outputs = []
    for command in commands:
        result = subprocess.run(
            command, shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=300,
            cwd=work, env={**ENV, "HOME": str(home)},
        )  # fmt: skip
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
        outputs.append(result.stdout + result.stderr)
    assert "run:  rltrain --config rlplan.yaml" in outputs[0]
    text = (work / "rlplan.yaml").read_text()
    assert "preset:" not in text and "function: default_compute_score" in text
    assert (
        "run: total_steps 30 = 15 epochs x 2 batches of 32 prompts" in outputs[1]
    )  # counted from the parquet
