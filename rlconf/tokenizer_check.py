"""The tokenizer of a model folder, checked before anything starts (rule `tokenizer-load`).

A run opens `model.tokenizer_path` (else `model.path`) with transformers' AutoTokenizer in every process
that tokenizes (rltrain/tokenizer.py). A folder it cannot open used to fail there, after Ray had started;
this check finds the same causes from `rlconf validate` and the start of `rltrain`, each with the fix that
fits it:

- a package is missing (transformers, tokenizers, jinja2: the base install has them);
- the folder holds no tokenizer files (tokenizer.json, vocab.json + merges.txt, tokenizer.model,
  vocab.txt);
- a file is broken: tokenizer.json that `tokenizers` cannot load, tokenizer_config.json that is not JSON,
  a chat template that does not compile.

It stays free of torch: it loads tokenizer.json with `tokenizers` and compiles the chat template with
jinja2 (importing AutoTokenizer would import torch). Reads are bounded in size.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from typing import Any

from rlconf.config import ModelConfig
from rlconf.errors import Issue, error

RULE = "tokenizer-load"
PACKAGES = ("transformers", "tokenizers", "jinja2")
# tokenizer.json of the largest vocabularies (Gemma, 256k tokens) is ~35 MB; a config or template far less.
MAX_TOKENIZER_JSON = 256 << 20
MAX_SMALL_FILE = 16 << 20
# Any one of these lets AutoTokenizer build a tokenizer (fast, byte-level BPE, SentencePiece, WordPiece).
FILE_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",), ("vocab.txt",))


def _read(path: str, limit: int) -> bytes:
    size = os.path.getsize(path)
    if size > limit:
        raise ValueError(f"{size:,} bytes, more than a tokenizer file holds ({limit:,})")
    with open(path, "rb") as f:
        return f.read(limit + 1)


def _templates(folder: str, config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, template source) of every chat template the folder carries."""
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        yield "chat_template.jinja", _read(jinja, MAX_SMALL_FILE).decode("utf-8")
    as_json = os.path.join(folder, "chat_template.json")
    if os.path.isfile(as_json):
        data = json.loads(_read(as_json, MAX_SMALL_FILE))
        if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
            yield "chat_template.json", data["chat_template"]
    template = config.get("chat_template")
    if isinstance(template, str):
        yield "tokenizer_config.json chat_template", template
    elif isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        for item in template:
            if isinstance(item, dict) and isinstance(item.get("template"), str):
                yield f"tokenizer_config.json chat_template {item.get('name')!r}", item["template"]


def no_tokenizer_files(folder: str, path: str, key: str) -> Issue | None:
    """The error (rule tokenizer-load, at config path `key`) for a folder that holds none of the file sets
    AutoTokenizer builds a tokenizer from; None when it holds one. The one check of it: rlconf.model_files
    reads the files only when they are there. A path that is not a folder is its caller's to report."""
    if not os.path.isdir(folder):
        return None
    present = set(os.listdir(folder))
    if any(all(name in present for name in names) for names in FILE_SETS):
        return None
    shown = ", ".join(sorted(present)[:12]) or "(empty)"
    return error(key, f"{path!r} holds no tokenizer files (it has: {shown})",
                 "copy the model's tokenizer.json and tokenizer_config.json into it, or set "
                 "model.tokenizer_path to a folder that has them", RULE)  # fmt: skip


def tokenizer_issues(model: ModelConfig) -> Iterator[Issue]:
    """Why the tokenizer of `model` would not load (nothing for the built-in tokenizer)."""
    path = model.tokenizer_path if model.tokenizer_path is not None else model.path
    if path is None:
        return
    yield from folder_issues(
        path, "model.tokenizer_path" if model.tokenizer_path is not None else "model.path"
    )


def folder_issues(path: str, key: str) -> Iterator[Issue]:
    """Why the tokenizer folder `path`, named by the config path `key`, would not load."""
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        if key == "model.tokenizer_path":  # a missing model.path is reported by the config.json rule
            yield error(key, f"tokenizer folder {path!r} does not exist",
                        "point it at a local Hugging Face folder with tokenizer.json; nothing is downloaded", RULE)  # fmt: skip
        return
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        yield error(key, f"loading the tokenizer of {path!r} needs {', '.join(missing)}, which "
                    f"{'is' if len(missing) == 1 else 'are'} not installed",
                    "reinstall rlplan (`pip install -e .` installs them), or `pip install "
                    f"{' '.join(missing)}`", RULE)  # fmt: skip
        return
    if (no_files := no_tokenizer_files(folder, path, key)) is not None:
        yield no_files
        return
    present = set(os.listdir(folder))
    if "tokenizer.json" in present:
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_str(
                _read(os.path.join(folder, "tokenizer.json"), MAX_TOKENIZER_JSON).decode("utf-8")
            )
        except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
            yield error(key, f"{path}/tokenizer.json cannot be loaded: {type(exc).__name__}: {str(exc)[:300]}",
                        "the file is broken or cut short: copy it again from the model's release", RULE)  # fmt: skip
            return
    config: dict[str, Any] = {}
    if "tokenizer_config.json" in present:
        try:
            loaded = json.loads(_read(os.path.join(folder, "tokenizer_config.json"), MAX_SMALL_FILE))
            config = loaded if isinstance(loaded, dict) else {}
        except (ValueError, OSError) as exc:
            yield error(key, f"{path}/tokenizer_config.json is not valid JSON: {str(exc)[:300]}",
                        "the file is broken or cut short: copy it again from the model's release", RULE)  # fmt: skip
            return
    try:
        templates = list(_templates(folder, config))
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        yield error(key, f"cannot read the chat template of {path!r}: {str(exc)[:300]}",
                    "copy chat_template.jinja / chat_template.json again from the model's release", RULE)  # fmt: skip
        return
    if templates:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # As transformers compiles chat templates (a sandbox, loop controls); compiling runs nothing.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        for where, source in templates:
            try:
                env.parse(source)
            except TemplateSyntaxError as exc:
                yield error(key, f"the chat template in {path}/{where} does not compile: {exc.message} "
                            f"(line {exc.lineno})", "fix the template, or copy it again from the model's "
                            "release", RULE)  # fmt: skip
