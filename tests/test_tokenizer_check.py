"""`rlconf validate` loads a model folder's tokenizer before anything starts (rule tokenizer-load), with
the fix that fits the cause: a missing package, missing files, a broken tokenizer.json, a broken
tokenizer_config.json or a chat template that does not compile. rlconf stays free of torch doing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlconf.config import ModelConfig
from rlconf.errors import ConfigError
from rlconf.plan.run import tokenizer_plan
from rlconf.tokenizer_check import tokenizer_issues
from rltrain.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
QWEN_SMALL = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}  # fmt: skip
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def model_folder(tmp_path: Path) -> Path:
    """config.json and the built-in tokenizer's Hugging Face files, with a chat template."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN_SMALL))
    CharTokenizer().save_pretrained(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return folder


def messages(folder: Path) -> list[str]:
    return [
        f"{i.rule} {i.path}: {i.message} | {i.fix}" for i in tokenizer_issues(ModelConfig(path=str(folder)))
    ]


def test_a_good_folder_passes_and_loads(tmp_path):
    folder = model_folder(tmp_path)
    assert messages(folder) == []
    tok = load_tokenizer(tokenizer_plan(ModelConfig(path=str(folder))))
    assert isinstance(tok, HFTokenizer) and tok.has_chat_template


def test_each_cause_has_its_own_fix(tmp_path):
    folder = model_folder(tmp_path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    (msg,) = messages(folder)
    assert "tokenizer-load model.path" in msg and "chat template" in msg and "does not compile" in msg

    (folder / "tokenizer_config.json").write_text('{"chat_template": ')
    (msg,) = messages(folder)
    assert "tokenizer_config.json is not valid JSON" in msg

    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[: len(text) // 2])  # cut short, as by a failed copy
    (msg,) = messages(folder)
    assert "tokenizer.json cannot be loaded" in msg and "copy it again" in msg

    for name in os.listdir(folder):
        if name != "config.json":
            os.remove(folder / name)
    (msg,) = messages(folder)
    assert "holds no tokenizer files (it has: config.json)" in msg and "model.tokenizer_path" in msg
    # The run gives the same message, not transformers' own.
    with pytest.raises(ConfigError) as info:
        load_tokenizer(tokenizer_plan(ModelConfig(path=str(folder))))
    assert "holds no tokenizer files" in info.value.format()


def test_a_missing_package_says_what_to_install(tmp_path):
    """An interpreter where transformers cannot be imported (None in sys.modules is Python's documented
    way to block an import: `import transformers` then raises ModuleNotFoundError)."""
    folder = model_folder(tmp_path)
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "from rlconf.config import ModelConfig\n"
        "from rlconf.tokenizer_check import tokenizer_issues\n"
        f"(i,) = tokenizer_issues(ModelConfig(path={str(folder)!r}))\n"
        "print(i.message, '|', i.fix)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "needs transformers, which is not installed" in out.stdout and "pip install -e ." in out.stdout


def test_rlconf_validate_reports_it_and_imports_no_torch(tmp_path):
    folder = model_folder(tmp_path)
    (folder / "tokenizer.json").write_text("{}")
    run = tmp_path / "run.yaml"
    run.write_text(f"model:\n  path: {folder}\n")
    code = (
        "import sys\n"
        "from rlconf.cli import main\n"
        f"code = main(['validate', {str(run)!r}])\n"
        "assert 'torch' not in sys.modules, 'rlconf validate imported torch'\n"
        "sys.exit(code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "tokenizer-load" in text and "model.path" in text and "tokenizer.json cannot be loaded" in text
    assert "Traceback" not in text


def test_loading_a_folder_prints_nothing_and_quiets_transformers(tmp_path):
    # In a fresh process: transformers' logging and progress-bar switches are process-wide. Whatever rltrain
    # loads next from transformers (a tokenizer in every worker) prints no "Loading weights" bar or notice.
    folder = model_folder(tmp_path)
    code = (
        "import sys; from rlconf.config import ModelConfig; from rlconf.plan.run import tokenizer_plan\n"
        "from rltrain.tokenizer import load_tokenizer\n"
        f"load_tokenizer(tokenizer_plan(ModelConfig(path={str(folder)!r})))\n"
        "from transformers.utils import logging\n"
        "sys.exit(0 if not logging.is_progress_bar_enabled() and logging.get_verbosity() >= logging.ERROR "
        "else 3)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout + result.stderr == ""
