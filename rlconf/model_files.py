"""Model folders checked before anything starts (rule `model-files`): weights and tokenizer against config.json.

`rlconf validate` (and so `rltrain`, before Ray starts) reads every safetensors header of `model.path` (and of
a critic's / reward model's folder) and the tokenizer files, bounded by rlconf.files, and checks them against
the ModelArch that rlconf.model_spec read from config.json:

- each header: its length is sane for the file's size, its JSON is shallow, each tensor's dtype is known and
  its byte range is inside the file, exactly as long as its shape says, and overlaps no other tensor (a header
  claiming 1e12 elements, a truncated file or overlapping data is an error naming the file and tensor);
- every tensor the megatron loader reads (`hf_tensors`, the one list the loader in
  rltrain.megatron.hf_weights checks too) is present with its shape and a floating dtype: embedding rows ==
  vocab_size (transformers' own rule: the embedding has exactly vocab_size rows; megatron's padding to a
  multiple is added by the loader, not stored);
- a tokenizer exists (tokenizer.json, vocab.json + merges.txt, vocab.txt or tokenizer.model) and its largest
  token id is below vocab_size (each id indexes an embedding row);
- data.max_prompt_length + rollout.max_response_length <= max_position_embeddings.

Each problem is an error naming the config path (`model.path`), the file and the tensor. Pure standard
library: safetensors headers are JSON, parsed here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlconf.config import ModelArch, RLConfig
from rlconf.errors import ConfigError, Issue, error
from rlconf.files import (
    MAX_MANIFEST_BYTES,
    MAX_SAFETENSORS_HEADER_BYTES,
    MAX_TOKENIZER_BYTES,
    MAX_TOKENIZER_CONFIG_BYTES,
    check_regular,
    parse_json_bounded,
    read_json,
    read_span,
    read_text,
)
from rlconf.model_spec import head_dim, is_moe_layer, read_model_arch
from rlconf.plan.roles import model_folders
from rlconf.render_budget import RenderBudgetExceeded, render_budget
from rlconf.safe_paths import model_folder_escapes
from rlconf.tokenizer_check import no_tokenizer_files

RULE = "model-files"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
"""Element sizes of the safetensors dtypes with whole bytes (the format's own table)."""
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
"""Dtypes the loader converts to the model's params_dtype; others (int, fp8: quantized weights) are refused."""
MAX_TENSORS = 1 << 20
"""Tensors in one safetensors header (a 671B model has about 100k)."""
MAX_REPORTED = 8
"""Missing / mismatched tensors listed one by one; the rest are counted."""
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model")
_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")


# ============================================================================================ expected
def hf_tensors(arch: ModelArch, *, lm_head: bool = True) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor the megatron loader reads for `arch`, with its shape: the embedding, the
    final norm, `lm_head` (unless tied or `lm_head` is False: a value model replaces it) and each layer's
    norms, attention (q/k/v with biases where the family has them, QK-norm) and MLP or experts."""
    h, d = arch.hidden_size, head_dim(arch)
    q, g = arch.num_attention_heads * d, arch.num_query_groups * d
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if lm_head and not arch.share_embeddings_and_output_weights:
        out["lm_head.weight"] = (arch.vocab_size, h)
    mixtral = arch.family == "mixtral"
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if arch.multi_latent_attention:
            out.update(_mla_tensors(arch, p + "self_attn."))
        else:
            for x, rows in (("q", q), ("k", g), ("v", g)):
                out[f"{p}self_attn.{x}_proj.weight"] = (rows, h)
                if arch.add_qkv_bias:
                    out[f"{p}self_attn.{x}_proj.bias"] = (rows,)
            out[p + "self_attn.o_proj.weight"] = (h, q)
        if arch.qk_layernorm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        if not is_moe_layer(arch, i):
            f = arch.ffn_hidden_size
            out.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                        p + "mlp.down_proj.weight": (h, f)})  # fmt: skip
            continue
        assert arch.num_moe_experts is not None
        block = "block_sparse_moe" if mixtral else "mlp"
        fe = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
        out[f"{p}{block}.gate.weight"] = (arch.num_moe_experts, h)
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for e in range(arch.num_moe_experts):
            x = f"{p}{block}.experts.{e}."
            out.update(
                {f"{x}{gate}.weight": (fe, h), f"{x}{up}.weight": (fe, h), f"{x}{down}.weight": (h, fe)}
            )
        fs = arch.moe_shared_expert_intermediate_size
        if arch.multi_latent_attention:  # DeepseekV3MoE: shared_experts, the router's score bias
            out[p + "mlp.gate.e_score_correction_bias"] = (arch.num_moe_experts,)
            w = fs or 0  # n_shared_experts 0: transformers still builds (and saves) zero-width ones
            out.update({p + "mlp.shared_experts.gate_proj.weight": (w, h), p + "mlp.shared_experts.up_proj."
                        "weight": (w, h), p + "mlp.shared_experts.down_proj.weight": (h, w)})  # fmt: skip
        elif fs is not None:
            out.update({p + "mlp.shared_expert.gate_proj.weight": (fs, h), p + "mlp.shared_expert.up_proj.weight":
                        (fs, h), p + "mlp.shared_expert.down_proj.weight": (h, fs)})  # fmt: skip
            if arch.moe_shared_expert_gate:
                out[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return out


def _mla_tensors(arch: ModelArch, p: str) -> dict[str, tuple[int, ...]]:
    """DeepseekV3Attention's tensors under prefix `p` (q_a / q_b with q_lora_rank, else q_proj)."""
    h, n = arch.hidden_size, arch.num_attention_heads
    qk = n * (arch.qk_head_dim + arch.qk_pos_emb_head_dim)
    out: dict[str, tuple[int, ...]] = {
        p + "kv_a_proj_with_mqa.weight": (arch.kv_lora_rank + arch.qk_pos_emb_head_dim, h),
        p + "kv_a_layernorm.weight": (arch.kv_lora_rank,),
        p + "kv_b_proj.weight": (n * (arch.qk_head_dim + arch.v_head_dim), arch.kv_lora_rank),
        p + "o_proj.weight": (h, n * arch.v_head_dim),
    }
    r = arch.q_lora_rank
    if r is None:
        out[p + "q_proj.weight"] = (qk, h)
    else:
        out.update(
            {p + "q_a_proj.weight": (r, h), p + "q_a_layernorm.weight": (r,), p + "q_b_proj.weight": (qk, r)}
        )
    return out


# ============================================================================================ headers
@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header."""

    file: str
    dtype: str
    shape: tuple[int, ...]


class _Bad(Exception):
    """A problem with one file (message names the file and tensor)."""


def read_safetensors_header(path: str, key: str = "model.path") -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, after checking its header against the file: the header length
    against the file size and MAX_SAFETENSORS_HEADER_BYTES, JSON depth, dtypes, every byte range inside
    the file and exactly as long as its shape, no two ranges overlapping. Raises ConfigError (rule
    model-files) naming `key`, the file and the tensor."""
    what = f"weights of {key}"
    prefix, size = read_span(path, 0, 8, key=key, what=what, rule=RULE)

    def bad(message: str, fix: str = "replace the file with a complete copy (re-download or re-export it)"):
        return ConfigError([error(key, f"{path}: {message}", fix, RULE)])

    if len(prefix) < 8:
        raise bad(f"is {size} bytes, too short for a safetensors file (truncated?)")
    n = int.from_bytes(prefix, "little")
    if n > MAX_SAFETENSORS_HEADER_BYTES or 8 + n > size:
        raise bad(
            f"its safetensors header claims {n:,} bytes, but the file is {size:,} bytes"
            + (
                f" (the format allows at most {MAX_SAFETENSORS_HEADER_BYTES:,})"
                if n > MAX_SAFETENSORS_HEADER_BYTES
                else "; the file is truncated or not a safetensors file"
            )
        )
    raw, _ = read_span(path, 8, n, key=key, what=what, rule=RULE)
    header = parse_json_bounded(raw, key=key, what=what, name=path, max_depth=4)
    if not isinstance(header, dict):
        raise bad("its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    if len(header) > MAX_TENSORS:
        raise bad(f"its header lists {len(header):,} tensors, more than {MAX_TENSORS:,}")
    data_size = size - 8 - n
    spans: list[tuple[int, int, str]] = []
    out: dict[str, TensorEntry] = {}
    for name, entry in header.items():
        t = f"tensor {name!r}"
        if not isinstance(entry, dict):
            raise bad(f"{t}: its header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise bad(f"{t} has dtype {dtype!r}, which is not a safetensors dtype rlplan reads")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):  # fmt: skip
            raise bad(f"{t}: shape {shape!r} is not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):  # fmt: skip
            raise bad(f"{t}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        nbytes = DTYPE_BYTES[dtype]
        for s in shape:
            nbytes *= s
            if nbytes > data_size:  # stop early: a claim of 1e12 elements is not multiplied out
                break
        if nbytes > data_size:
            raise bad(f"{t} claims shape {shape} ({dtype}), more bytes than the file's {data_size:,} bytes of "
                      "tensor data (truncated or corrupt)")  # fmt: skip
        if not 0 <= begin <= end or end > data_size:
            raise bad(f"{t}: data_offsets [{begin}, {end}] are outside the file's {data_size:,} bytes of tensor "
                      "data (truncated?)")  # fmt: skip
        if end - begin != nbytes:
            raise bad(f"{t}: data_offsets [{begin}, {end}] hold {end - begin:,} bytes, its shape {shape} "
                      f"({dtype}) needs {nbytes:,}")  # fmt: skip
        spans.append((begin, end, name))
        out[name] = TensorEntry(os.path.basename(path), dtype, tuple(shape))
    spans.sort()
    reach, owner = 0, ""  # the furthest end so far and its tensor
    for begin, end, name in spans:
        if begin < reach and end > begin:
            raise bad(f"tensors {owner!r} and {name!r} share bytes [{begin}, {min(reach, end)}) of the data "
                      "(overlapping tensors: a corrupt or crafted file)")  # fmt: skip
        if end > reach:
            reach, owner = end, name
    return out


def _weight_files(folder: str, key: str) -> list[str]:
    """The safetensors files of a folder: those its index names, else every *.safetensors."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.lexists(index):
        data = read_json(index, MAX_MANIFEST_BYTES, key=key, what=f"weights index of {key}", rule=RULE)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError([error(key, f"{index} has no weight_map of tensor -> file names",
                                     "replace the index with the one written beside the weights", RULE)])  # fmt: skip
        names = sorted(set(weight_map.values()))
        for name in names:
            # A file name in the folder: the loader refuses other paths too (no reading outside the folder).
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ConfigError([error(key, f"{index} names {name!r}, which is not a file in {folder}",
                                         "list the folder's own safetensors files in the index", RULE)])  # fmt: skip
        return [os.path.join(folder, n) for n in names]
    try:
        entries = sorted(os.listdir(folder))
    except OSError as exc:
        raise ConfigError(
            [error(key, f"cannot list {folder}: {exc.strerror or exc}", "check the path", RULE)]
        ) from None
    files = [os.path.join(folder, e) for e in entries if e.endswith(".safetensors")]
    if files:
        return files
    pickled = [e for e in entries if e in _PICKLE_WEIGHTS or e.endswith((".bin", ".pt", ".pth"))]
    if pickled:
        message = (f"{folder} has no safetensors weights, only {', '.join(pickled[:3])} (pickle files, which "
                   "rlplan never unpickles)")  # fmt: skip
        fix = (
            "convert them to safetensors (transformers: model.save_pretrained(dir, safe_serialization=True))"
        )
    else:
        message = f"{folder} has no weights file (no *.safetensors)"
        fix = "point it at a folder with model.safetensors (or its shards and model.safetensors.index.json)"
    raise ConfigError([error(key, message, fix, RULE)])


def read_weights(folder: str, key: str = "model.path") -> dict[str, TensorEntry]:
    """Every tensor of a model folder's safetensors files (headers checked, see read_safetensors_header);
    a tensor in two files, or one the index places in a file that lacks it, is an error."""
    files = _weight_files(folder, key)
    out: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in read_safetensors_header(path, key).items():
            if name in out:
                raise ConfigError([error(key, f"tensor {name!r} is in both {out[name].file} and {entry.file}",
                                         "keep one copy of each tensor", RULE)])  # fmt: skip
            out[name] = entry
    index = os.path.join(folder, INDEX_FILE)
    if os.path.lexists(index):
        weight_map = read_json(index, MAX_MANIFEST_BYTES, key=key, what=f"weights index of {key}", rule=RULE)[
            "weight_map"
        ]
        for name, fname in weight_map.items():
            if name in out and out[name].file != fname:
                raise ConfigError([error(key, f"{index} places {name!r} in {fname}, but it is in {out[name].file}",
                                         "rewrite the index from the files", RULE)])  # fmt: skip
    return out


def weights_issues(
    folder: str, arch: ModelArch, key: str = "model.path", *, lm_head: bool = True
) -> list[Issue]:
    """Errors for the folder's safetensors against `arch`: a bad header, a missing tensor, a wrong shape
    or dtype (empty: the loader finds every tensor it reads)."""
    implied = 3 + arch.num_layers * (16 + 3 * (arch.num_moe_experts or 0))  # bounds hf_tensors from above
    if implied > MAX_TENSORS:  # checked before listing them: num_experts = 10^9 is not a list of 10^9 names
        return [error(key, f"{os.path.join(folder, 'config.json')} implies about {implied:,} weight tensors, more "
                      f"than any model has ({MAX_TENSORS:,})", "fix config.json", RULE)]  # fmt: skip
    try:
        tensors = read_weights(folder, key)
    except ConfigError as exc:
        return list(exc.issues)
    issues: list[Issue] = []
    missing: list[str] = []
    for name, shape in hf_tensors(arch, lm_head=lm_head).items():
        entry = tensors.get(name)
        if entry is None:
            missing.append(name)
            continue
        where = f"{os.path.join(folder, entry.file)}: tensor {name!r}"
        if entry.shape != shape:
            if name in ("model.embed_tokens.weight", "lm_head.weight") and entry.shape[1:] == shape[1:]:
                message = f"{where} has {entry.shape[0]} rows, config.json's vocab_size is {arch.vocab_size}"
                fix = "use the config.json written with these weights (vocab_size = the embedding's rows)"
            else:
                message = f"{where} has shape {list(entry.shape)}, config.json implies {list(shape)}"
                fix = "use the config.json written with these weights"
            issues.append(error(key, message, fix, RULE))
        elif entry.dtype not in FLOAT_DTYPES:
            issues.append(error(key, f"{where} has dtype {entry.dtype}; rlplan loads {', '.join(FLOAT_DTYPES)}",
                                "use unquantized floating-point weights", RULE))  # fmt: skip
        if len(issues) >= MAX_REPORTED:
            break
    if missing:
        shown = ", ".join(missing[:MAX_REPORTED]) + (f" and {len(missing) - MAX_REPORTED} more" if len(missing) >
                                                      MAX_REPORTED else "")  # fmt: skip
        issues.append(error(key, f"{folder}: the safetensors files lack {len(missing)} tensor(s) that config.json "
                            f"implies: {shown}", "use the config.json written with these weights, or complete "
                            "the download", RULE))  # fmt: skip
    return issues


# ============================================================================================ tokenizer
def _max_id(values: Any) -> int:
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return max(ids, default=-1)


def tokenizer_size(folder: str, key: str) -> tuple[int, str] | None:
    """(largest token id + 1, the file that holds it) of the tokenizer files in `folder`, read bounded;
    None when the format does not say it without parsing (tokenizer.model, a sentencepiece protobuf).
    Raises ConfigError naming `key` when there are no tokenizer files (rlconf.tokenizer_check's error) or
    one cannot be read."""
    what = f"tokenizer of {key}"
    if (no_files := no_tokenizer_files(folder, folder, key)) is not None:
        raise ConfigError([no_files])
    present = [f for f in TOKENIZER_FILES if os.path.lexists(os.path.join(folder, f))]
    best, source = -1, ""

    def note(n: int, fname: str) -> None:
        nonlocal best, source
        if n > best:
            best, source = n, os.path.join(folder, fname)

    for fname in present:
        path = os.path.join(folder, fname)
        if fname == "tokenizer.json":
            data = read_json(path, MAX_TOKENIZER_BYTES, key=key, what=what, rule=RULE)
            model = data.get("model") if isinstance(data, dict) else None
            vocab = model.get("vocab") if isinstance(model, dict) else None
            if isinstance(vocab, dict):
                note(_max_id(vocab.values()), fname)
            elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids are positions
                note(len(vocab) - 1, fname)
            added = data.get("added_tokens") if isinstance(data, dict) else None
            if isinstance(added, list):
                note(_max_id(a.get("id") for a in added if isinstance(a, dict)), fname)
        elif fname == "vocab.json":
            data = read_json(path, MAX_TOKENIZER_BYTES, key=key, what=what, rule=RULE)
            if isinstance(data, dict):
                note(_max_id(data.values()), fname)
        elif fname == "vocab.txt":  # one token per line, ids are line numbers
            note(read_text(path, MAX_TOKENIZER_BYTES, key=key, what=what, rule=RULE).count("\n") - 1, fname)
        else:
            check_regular(path, MAX_TOKENIZER_BYTES, key=key, what=what)
    tok_config: Any = None
    for fname in ("added_tokens.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(folder, fname)
        if not os.path.lexists(path):
            continue
        data = read_json(path, MAX_TOKENIZER_CONFIG_BYTES, key=key, what=what, rule=RULE)
        tok_config = data if fname == "tokenizer_config.json" else tok_config
        if fname == "added_tokens.json" and isinstance(data, dict):
            note(_max_id(data.values()), fname)
        if fname == "tokenizer_config.json" and isinstance(data, dict):
            decoder = data.get("added_tokens_decoder")
            if isinstance(decoder, dict):
                note(_max_id(int(k) for k in decoder if k.isdigit() and len(k) < 12), fname)
    templates: list[tuple[str, str]] = []  # (file, template text)
    config = os.path.join(folder, "tokenizer_config.json")
    if isinstance(tok_config, dict):
        chat = tok_config.get("chat_template")
        if isinstance(chat, str):
            templates.append((config, chat))
        elif isinstance(chat, list):  # [{"name": ..., "template": ...}, ...]
            templates += [
                (config, t["template"])
                for t in chat
                if isinstance(t, dict) and isinstance(t.get("template"), str)
            ]
    for fname in ("chat_template.jinja", "chat_template.json"):
        path = os.path.join(folder, fname)
        if os.path.lexists(path):
            text = read_text(path, MAX_TOKENIZER_CONFIG_BYTES, key=key, what=what, rule=RULE)
            if fname.endswith(".jinja"):
                templates.append((path, text))
            else:
                data = parse_json_bounded(text, key=key, what=what, name=path)
                if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
                    templates.append((path, data["chat_template"]))
    for path, template in templates:
        check_chat_template(template, path, key)
    if best < 0:
        return None
    return best + 1, source


def check_chat_template(template: str, path: str, key: str) -> None:
    """Render a chat template once on a one-message conversation within rlconf.render_budget's time and memory
    budget, in Jinja's sandbox as transformers does; a ConfigError naming `key` and the file when it runs past
    the budget. A template that does not compile or render here for another reason (a tag only transformers
    defines, a raise_exception for this conversation) is left to transformers."""
    try:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # jinja2 comes with transformers; without it nothing renders templates
        return

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "")
    try:
        with render_budget(f"{path}: the chat template"):
            env.from_string(template).render(
                messages=[{"role": "user", "content": "hello"}], add_generation_prompt=True, tools=None,
                bos_token="", eos_token="",
            )  # fmt: skip
    except RenderBudgetExceeded as exc:
        raise ConfigError([error(key, f"{exc} rendering one short message", "use the model's own chat template "
                                 "(one renders in milliseconds), or remove it", RULE)]) from None  # fmt: skip
    except Exception:
        return


def tokenizer_issues(folder: str, vocab_size: int, key: str, vocab_source: str) -> list[Issue]:
    """Errors for the tokenizer in `folder`: unreadable, or with token ids >= vocab_size (a folder without
    tokenizer files is rule tokenizer-load's, reported once there)."""
    if no_tokenizer_files(folder, folder, key) is not None:
        return []
    try:
        found = tokenizer_size(folder, key)
    except ConfigError as exc:
        return list(exc.issues)
    if found is None or found[0] <= vocab_size:
        return []
    n, source = found
    return [error(key, f"{source}: the tokenizer has token ids up to {n - 1}, but {vocab_source} vocab_size is "
                  f"{vocab_size} (ids >= vocab_size have no embedding row)",
                  "use the tokenizer of these weights, or a model whose vocab_size covers it", RULE)]  # fmt: skip


# ============================================================================================ the rule
def model_files_issues(c: RLConfig) -> Iterator[Issue]:
    """Rule model-files: each model folder's weights and tokenizer agree with its config.json, and the
    run's sequences fit max_position_embeddings."""
    sources = [(key, folder, spec.model == "policy") for key, folder, spec in model_folders(c)]
    seq = c.data.max_prompt_length + c.rollout.max_response_length
    policy_arch: ModelArch | None = c.model.arch if c.model.path is None else None
    for key, folder, lm_head in sources:
        if folder is None or model_folder_escapes(folder):
            continue  # a name leading outside the folder: rule model-folder-paths, and nothing is opened
        try:
            arch = read_model_arch(folder, key)
        except ConfigError:
            continue  # the plan reports a config.json it cannot read (rule model-config-json)
        if key == "model.path":
            policy_arch = arch
        cfg_file = os.path.join(folder, "config.json")
        if seq > arch.max_position_embeddings:
            yield error(key, f"{cfg_file}: max_position_embeddings = {arch.max_position_embeddings} is shorter than "
                        f"data.max_prompt_length + rollout.max_response_length = {seq}",
                        "shorten data.max_prompt_length / rollout.max_response_length, or use a model with "
                        "longer positions", RULE)  # fmt: skip
        yield from weights_issues(folder, arch, key, lm_head=lm_head)
    tok_folder = c.model.tokenizer_path if c.model.tokenizer_path is not None else c.model.path
    if tok_folder is not None and policy_arch is not None and not model_folder_escapes(tok_folder):
        key = "model.tokenizer_path" if c.model.tokenizer_path is not None else "model.path"
        vocab_source = (
            "model.arch" if c.model.path is None else f"{os.path.join(c.model.path, 'config.json')}'s"
        )
        yield from tokenizer_issues(tok_folder, policy_arch.vocab_size, key, vocab_source)
