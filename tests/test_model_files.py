"""Model folders are checked before anything starts (rule model-files, rlconf.model_files) and every file a
run reads is bounded (rlconf.files): each broken folder below is a real HF folder written by transformers and
then damaged the way a bad download, a bad conversion or an attacker would; `rlconf validate` and `rltrain`
exit 2 quickly naming `model.path`, the file and the tensor, never a traceback, never after Ray started."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from presets import PRESETS
from rlconf.cli import main as rlconf_main
from rlconf.files import MIB
from rlconf.load import load_config
from rlconf.model_files import RULE, hf_tensors, read_safetensors_header
from rlconf.model_spec import read_model_arch
from rltrain.cli import main as rltrain_main
from rltrain.tokenizer import CharTokenizer
from tests.read_count import counting_reads

ROOT = Path(__file__).resolve().parents[1]
QWEN = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def make_folder(path: Path, vocab_size: int = 32, tokenizer: bool = True, **kw) -> Path:
    """A tiny random Qwen2 saved by transformers, with the built-in 32-token tokenizer beside it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(
        Qwen2Config(**{**QWEN, **kw}, vocab_size=vocab_size, tie_word_embeddings=True)
    ).save_pretrained(str(path))
    if tokenizer:
        CharTokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("hf") / "good")


@pytest.fixture
def folder(good, tmp_path) -> Path:
    """A fresh copy of the good folder to damage."""
    return Path(shutil.copytree(good, tmp_path / "model"))


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


READ_BOUND = 4 * MIB
"""What validating a damaged tiny folder may read: its files are at most a few hundred KiB (config.json is
read by each check that needs the architecture, five at validate; the safetensors data past the header never),
and a file over its limit or not a regular file is refused unread."""


def _rejects(folder: Path, capsys, *needles: str, flags: tuple[str, ...] = ()) -> str:
    """`rlconf validate` exits 2 with rule model-files naming model.path and each needle, having read at most
    READ_BOUND bytes; returns stderr."""
    with counting_reads() as reads:
        code = rlconf_main(["validate", "--preset", "tiny-grpo", "--set", f"model.path={folder}", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert reads.bytes <= READ_BOUND, reads.bytes
    assert "] model.path:" in err and "fix:" in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_the_good_folder_passes(good, capsys):
    assert rlconf_main(["validate", "--preset", "tiny-grpo", "--set", f"model.path={good}"]) == 0, (
        capsys.readouterr().err
    )


def test_expected_tensors_are_what_transformers_saves(tmp_path):
    """hf_tensors (the list the check and the loader share) names exactly the tensors transformers'
    save_pretrained writes for each family, with their shapes (tied and untied, biases, QK-norm, experts,
    shared experts)."""
    import transformers

    from rlconf.model_files import read_weights

    cases = [
        ("Qwen2", {}, True),
        ("Qwen2", {}, False),
        ("Llama", {}, False),
        ("Qwen3", {"head_dim": 16}, True),
        ("Mistral", {}, False),
        ("Qwen3Moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, False),
        (
            "Qwen2Moe",
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 24,
            },
            False,
        ),
        ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, False),
    ]
    for i, (name, extra, tie) in enumerate(cases):
        cfg = getattr(transformers, f"{name}Config")(**QWEN, **extra, vocab_size=40, tie_word_embeddings=tie)
        out = tmp_path / str(i)
        getattr(transformers, f"{name}ForCausalLM")(cfg).save_pretrained(str(out))
        saved = {k: v.shape for k, v in read_weights(str(out)).items()}
        assert hf_tensors(read_model_arch(str(out))) == saved, name


# ------------------------------------------------------------------------------------- safetensors faults
def test_header_length_2_62(folder, capsys):
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])
    _rejects(folder, capsys, str(f), f"header claims {1 << 62:,} bytes")


def test_header_claiming_1e12_elements(folder, capsys):
    f = folder / "model.safetensors"
    header, data = _header(f)
    header["model.norm.weight"]["shape"] = [1_000_000, 1_000_000]
    _write(f, header, data)
    _rejects(folder, capsys, str(f), "'model.norm.weight'", "[1000000, 1000000]", "more bytes than the file")


def test_truncated_file(folder, capsys):
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) - 100])
    _rejects(folder, capsys, str(f), "outside the file", "truncated")


def test_overlapping_tensor_data(folder, capsys):
    f = folder / "model.safetensors"
    header, data = _header(f)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    _write(f, header, data)
    _rejects(folder, capsys, str(f), "overlapping")


def test_missing_tensor(folder, capsys):
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(f))
    _rejects(folder, capsys, "lack 1 tensor", "model.layers.1.self_attn.k_proj.weight")


def test_no_weights_file(folder, capsys):
    (folder / "model.safetensors").unlink()
    _rejects(folder, capsys, "has no weights file")


def test_pickle_weights_only(folder, capsys):
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    _rejects(folder, capsys, "pytorch_model.bin", "never unpickles")


def test_no_tokenizer_files(folder, capsys):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink()
    # Reported once, by rule tokenizer-load (rlconf.tokenizer_check.no_tokenizer_files); model-files reads
    # the tokenizer's files only when they are there.
    _rejects(folder, capsys, "holds no tokenizer files")


def test_embedding_of_10_rows_for_vocab_32(folder, capsys):
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:10].clone()
    save_file(tensors, str(f))
    _rejects(folder, capsys, "'model.embed_tokens.weight' has 10 rows", "vocab_size is 32")


def test_vocab_size_1_with_a_32_token_tokenizer(tmp_path, capsys):
    folder = make_folder(tmp_path / "model", vocab_size=1)
    err = _rejects(folder, capsys, "tokenizer.json", "token ids up to 31", "vocab_size is 1")
    assert err.count("error [") == 1  # the weights agree with config.json: only the tokenizer is wrong


def test_max_position_embeddings_1(folder, capsys):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["max_position_embeddings"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    _rejects(
        folder, capsys, "max_position_embeddings = 1", "data.max_prompt_length + rollout.max_response_length"
    )


def test_wrong_dtype_and_shape(folder, capsys):
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:, :4].clone()
    save_file(tensors, str(f))
    _rejects(
        folder,
        capsys,
        "'model.norm.weight' has dtype I8",
        "'model.layers.0.mlp.up_proj.weight' has shape [64, 4]",
    )


def test_sharded_index_naming_a_file_outside_the_folder(folder, capsys):
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "../model.safetensors"}})
    )
    # Refused once, by path containment (rule model-folder-paths); model-files then opens nothing of it.
    _rejects(folder, capsys, "'../model.safetensors'", "[model-folder-paths]")


def test_rltrain_stops_before_ray(folder, capsys, monkeypatch):
    """Not a dry run: rltrain exits 2 at its checks, before Ray or a worker starts."""
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init called for a folder the checks refuse")

    monkeypatch.setattr(ray, "init", no_ray)
    (folder / "model.safetensors").unlink()
    code = rltrain_main(
        ["tiny-grpo", "--model.path", str(folder), "--trainer.output_dir", str(folder.parent / "o")]
    )
    err = capsys.readouterr().err
    assert code == 2 and "[model-files] model.path:" in err and "no weights file" in err, err
    assert not (folder.parent / "o").exists()


def test_the_loader_checks_the_same_list(folder):
    """The megatron loader refuses the folder with the same error (it is also called without validate)."""
    from rlconf.errors import ConfigError
    from rltrain.megatron.hf_weights import check_hf_folder

    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError) as info:
        check_hf_folder(folder, read_model_arch(str(folder)))
    assert info.value.issues[0].rule == RULE and "no weights file" in info.value.issues[0].message


def test_header_reader_direct(folder):
    tensors = read_safetensors_header(str(folder / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == (32, 32)


# ------------------------------------------------------------------------------------- unbounded files
def _cli(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "rlconf.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)  # fmt: skip


@pytest.mark.parametrize("kind", ["symlink-dev-zero", "fifo"])
def test_config_json_that_is_not_a_regular_file(folder, kind):
    cfg = folder / "config.json"
    cfg.unlink()
    if kind == "fifo":
        os.mkfifo(cfg)
    else:
        cfg.symlink_to("/dev/zero")
    result = _cli(
        "validate", "--preset", "tiny-grpo", "--set", f"model.path={folder}"
    )  # a hang fails the timeout
    assert result.returncode == 2, result.stderr
    # A link out of the folder is refused first by path containment (rule model-folder-paths), before any
    # read; a FIFO inside it by the bounded reader.
    refusal = "[model-folder-paths]" if kind == "symlink-dev-zero" else f"{cfg} is not a regular file"
    assert refusal in result.stderr and "] model.path:" in result.stderr
    assert "Traceback" not in result.stderr


def test_config_json_too_large_or_too_deep(folder, capsys):
    cfg = folder / "config.json"
    cfg.write_text("[" * 100_000 + "]" * 100_000)
    _rejects(folder, capsys, "nested deeper than")
    cfg.write_text(" " * (5 << 20) + "{}")
    _rejects(folder, capsys, "larger than 4 MiB")  # refused by its size, unread


def test_tokenizer_json_symlink_to_dev_zero(folder, capsys):
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to("/dev/zero")
    _rejects(folder, capsys, "tokenizer.json", "[model-folder-paths]")  # a link out: refused before any read
    (folder / "tokenizer.json").unlink()
    os.mknod(folder / "tokenizer.json", stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero's node, inside
    _rejects(folder, capsys, "tokenizer.json is not a regular file")


@pytest.mark.parametrize("kind", ["fifo", "symlink-dev-zero"])
def test_config_file_fifo(tmp_path, kind):
    f = tmp_path / "run.yaml"
    if kind == "fifo":
        os.mkfifo(f)
    else:
        f.symlink_to("/dev/zero")
    result = _cli("validate", str(f))
    assert result.returncode == 2 and "is not a regular file" in result.stderr, result.stderr


def test_good_folder_loads_through_load_config(good):
    load_config(None, preset="tiny-grpo", overrides=[f"model.path={good}"], filesystem=True, presets=PRESETS)


# ------------------------------------------------------------------------------------- chat templates
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


def _set_template(folder: Path, template: str) -> None:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_chat_template_bomb_is_stopped_at_validate(folder, capsys):
    """Two nested range(100000) loops (the issue: 10.2 GB after 90 s): the render budget stops it."""
    _set_template(folder, BOMB)
    code = rlconf_main(["validate", "--preset", "tiny-grpo", "--set", f"model.path={folder}"])
    err = capsys.readouterr().err
    assert code == 2, err  # unstopped, the template runs 10^10 iterations: hours, not the budget's seconds
    assert (
        "[model-files] model.path:" in err
        and "tokenizer_config.json: the chat template ran longer than" in err
    )


def test_chat_template_bomb_is_stopped_when_the_run_renders_it(folder):
    """The tokenizer a run loads renders every prompt under the same budget (a bomb that depends on the
    data is stopped there too), and a real template renders the same ids as transformers' own call."""
    from rlconf.config import ModelConfig
    from rlconf.errors import ConfigError
    from rlconf.plan.run import tokenizer_plan
    from rltrain.tokenizer import load_tokenizer

    _set_template(folder, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = load_tokenizer(tokenizer_plan(ModelConfig(path=str(folder))))
    expected = tok.hf.apply_chat_template([{"role": "user", "content": "12+7="}], tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    assert tok.encode_prompt("12+7=") == list(expected)
    # Data-dependent: quick for a short prompt, 10^10 iterations for a 100000-character one.
    _set_template(folder, "{% for m in messages %}{% for c in m['content'] %}{% for d in m['content'] %}"
                  "{% endfor %}{% endfor %}{% endfor %}")  # fmt: skip
    tok = load_tokenizer(tokenizer_plan(ModelConfig(path=str(folder))))
    with pytest.raises(ConfigError) as info:  # the message says the budget stopped it, not an error
        tok.encode_prompt("1" * 100_000)
    assert info.value.path == "model.path" and "ran longer than" in info.value.issues[0].message


def test_config_json_with_a_billion_experts_is_refused_before_listing_them(tmp_path, capsys):
    """num_experts = 10^9 would list 3 x 10^9 expected tensors: refused from the count, at once."""
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 32,
        "max_position_embeddings": 256, "num_experts": 10**9, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }))  # fmt: skip
    CharTokenizer().save_pretrained(str(folder))
    _rejects(folder, capsys, "weight tensors, more than any model has")


def test_validate_reads_each_weights_header_once(good, capsys, monkeypatch):
    """`rlconf validate` runs the folder rules once (it ran them twice, to collect the warnings again): a
    large model's thousands of header entries are parsed once per command."""
    import rlconf.model_files as model_files

    calls, real = [], model_files.read_safetensors_header

    def counted(path, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(model_files, "read_safetensors_header", counted)
    assert rlconf_main(["validate", "--preset", "tiny-grpo", "--set", f"model.path={good}"]) == 0, (
        capsys.readouterr().err
    )
    assert calls == [str(good / "model.safetensors")]
