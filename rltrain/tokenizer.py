"""Tokenizers behind one small interface: a built-in character tokenizer and a Hugging Face wrapper.

The built-in `CharTokenizer` serves the tiny random-init model and the synthetic tasks: a fixed 32-token
vocabulary (the default `model.arch.vocab_size`), no files, no downloads. A real model brings its own
tokenizer folder, which `load_tokenizer` opens with `transformers.AutoTokenizer` (local files only) and wraps
in `HFTokenizer` so that the data pipeline, the rollout and the reward code see the same methods:

    encode(text) -> list[int]        decode(ids) -> str           encode_prompt(prompt, chat) -> list[int]
    pad_token_id, eos_token_id, bos_token_id, vocab_size, apply_chat_template(messages, ...)

Multi-turn rollouts (rltrain/rollout/agent.py) also ask a tokenizer how tool calls look in its chat format:
`tool_call_stop_ids()` (tokens that end a model turn at a call), `parse_tool_call(turn_text, tools)` and
`observation_text(result_text, error)` (what follows a call: the tool's answer and the next turn's opening).
The built-in tokenizer's 32 characters cannot spell JSON, so it has a compact call syntax of its own,
`<ARGS>` (CHAR_TOOL_CALL_FORMAT); Hugging Face tokenizers use JSON calls in the Qwen / Hermes convention,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and their own chat template for the answer.

`CharTokenizer.save_pretrained` writes the built-in tokenizer as Hugging Face files (what `rltrain export-hf`
and the hf_model checkpoint part ship next to a tiny model), so `AutoTokenizer` loads it with the same ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlconf.errors import ConfigError, error
from rlconf.model_files import tokenizer_size
from rlconf.plan.run import TokenizerPlan
from rlconf.render_budget import RenderBudgetExceeded, render_budget
from rlconf.safe_paths import FOLDER_PATHS_RULE, model_folder_escapes

# A prompt is plain text or a list of chat messages ({"role": ..., "content": ...}).
Prompt = str | Sequence[dict[str, Any]]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# The built-in vocabulary. Order is part of the checkpoint format of tiny models: append, never reorder.
# Digits and the space carry the synthetic tasks; the symbols cover the `add` task ("12+7="), GSM8K-style
# "#### 42" markers and `<answer>...</answer>` tags (hence the letters a, n, s, w, e, r).
CHAR_VOCAB: tuple[str, ...] = (
    PAD,
    BOS,
    EOS,
    UNK,
    *"0123456789",
    " ",
    *"+-*=#<>/.,\n",
    *"answer",
)
# Shown by decode() for ids that have no character (unknown characters encode to <unk>).
UNK_CHAR = "\ufffd"

CHAR_TOOL_CALL_FORMAT = """The built-in character tokenizer's tool-call format (its alphabet has no braces
or quotes, so no JSON): the model writes `<ARGS>`; `>` ends its turn, and ARGS (the text after the turn's
last `<`) becomes the first parameter of the first tool of rollout.multi_turn.tools (calculator: the
expression). A bare `>` (no `<` in the turn) asks about the question just posed: ARGS is then the last line
of the context before it, without a trailing `=`. The answer follows as observation tokens `=RESULT` and a
newline (`=err` and a newline when the call failed), then the model's next turn begins. Example: prompt
`12*34=`, response `>=408` + newline then EOS (or `<12*34>=408`...); `=408` and the newline are the
observation."""
HF_TOOL_CALL_OPEN, HF_TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class ToolCallParseError(ValueError):
    """A model turn ended at a tool call that cannot be read (the model is shown the message)."""


def _bare_call(turn_text: str, tools: Sequence[Any], context_text: str) -> Any:
    """CHAR_TOOL_CALL_FORMAT: the call of a turn ending in `>` (`context_text`: the prompt and response so
    far, this turn included), None when the turn ended otherwise."""
    from rltrain.tools import ToolCall, first_string_parameter

    if not turn_text.endswith(">"):
        return None
    if not tools:
        raise ToolCallParseError("no tools are configured")
    start = turn_text.rfind("<")
    # A bare `>` asks about the question on the line before it.
    question = context_text[:-1].rsplit("\n", 1)[-1].removesuffix("=")
    args = turn_text[start + 1 : -1] if start >= 0 else question
    return ToolCall(tools[0].name, {first_string_parameter(tools[0].schema): args})


def _json_call(turn_text: str) -> Any:
    """A Hermes / Qwen JSON call at the end of a turn, None when the turn does not end with one."""
    from rltrain.tools import ToolCall

    text = turn_text.rstrip()
    if not text.endswith(HF_TOOL_CALL_CLOSE):
        return None
    start = text.rfind(HF_TOOL_CALL_OPEN)
    if start < 0:
        raise ToolCallParseError(f"{HF_TOOL_CALL_CLOSE} without {HF_TOOL_CALL_OPEN}")
    body = text[start + len(HF_TOOL_CALL_OPEN) : -len(HF_TOOL_CALL_CLOSE)].strip()
    try:
        call = json.loads(body)
        arguments = call["arguments"]
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json.loads(arguments)
        name = call["name"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ToolCallParseError(
            f'cannot read the tool call {body[:80]!r}: expected {{"name": ..., "arguments": {{...}}}} ({exc})'
        ) from exc
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise ToolCallParseError('"name" must be a string and "arguments" an object')
    return ToolCall(name, arguments)


@runtime_checkable
class Tokenizer(Protocol):
    """What rltrain needs from a tokenizer."""

    pad_token_id: int
    eos_token_id: int
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: Prompt, add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]: ...

    def encode_prompt(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]: ...


def messages_to_text(prompt: Prompt) -> str:
    """Plain text of a prompt: the string itself, or the messages' contents joined by newlines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m["content"]) for m in prompt)


class CharTokenizer:
    """One token per character over `CHAR_VOCAB`; ids 0-3 are pad, bos, eos, unk.

    Characters outside the vocabulary encode to `<unk>` (so any text can be scored), which decodes as
    U+FFFD. Its chat template is a no-op: messages are joined into plain text, because a 32-token model has
    no use for role markup.
    """

    def __init__(self) -> None:
        self.vocab: tuple[str, ...] = CHAR_VOCAB
        self._ids = {tok: i for i, tok in enumerate(self.vocab)}
        self.pad_token_id: int = self._ids[PAD]
        self.bos_token_id: int | None = self._ids[BOS]
        self.eos_token_id: int = self._ids[EOS]
        self.unk_token_id: int = self._ids[UNK]
        self.vocab_size: int = len(self.vocab)
        self.special_ids = frozenset({self.pad_token_id, self.bos_token_id, self.eos_token_id})

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of `text` (no bos/eos added)."""
        return [self._ids.get(ch, self.unk_token_id) for ch in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; pad/bos/eos are dropped unless skip_special_tokens is false."""
        out = []
        for i in ids:
            i = int(i)
            if i in self.special_ids:
                if not skip_special_tokens:
                    out.append(self.vocab[i])
            elif i == self.unk_token_id or not 0 <= i < self.vocab_size:
                out.append(UNK_CHAR)
            else:
                out.append(self.vocab[i])
        return "".join(out)

    def apply_chat_template(
        self, messages: Prompt, add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]:
        """No-op template: the plain text of the messages (ids of it when tokenize is true)."""
        text = messages_to_text(messages)
        return self.encode(text) if tokenize else text

    def encode_prompt(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
        """`<bos>` + the characters of the prompt: the sequence the policy continues."""
        return [self._ids[BOS], *self.encode(messages_to_text(prompt))]

    def encode_agent_prompt(self, prompt: Prompt, tool_schemas: Sequence[dict[str, Any]]) -> list[int]:
        """The prompt of a multi-turn rollout: the same as `encode_prompt` (the call syntax is fixed,
        CHAR_TOOL_CALL_FORMAT, so no tool description is added)."""
        return self.encode_prompt(prompt)

    def tool_call_stop_ids(self) -> tuple[int, ...]:
        """`>` ends a model turn at a tool call (CHAR_TOOL_CALL_FORMAT)."""
        return (self._ids[">"],)

    def parse_tool_call(self, turn_text: str, tools: Sequence[Any], context_text: str = "") -> Any:
        """The ToolCall a turn ends with (CHAR_TOOL_CALL_FORMAT); None when the turn ended otherwise
        (EOS, length). `context_text`: the prompt and response so far, this turn included."""
        return _bare_call(turn_text, tools, context_text or turn_text)

    def observation_text(self, result_text: str, error: bool) -> str:
        """`=RESULT` and a newline (`=err` for a failed call): what follows a call (CHAR_TOOL_CALL_FORMAT)."""
        return "=" + ("err" if error else result_text.strip()) + "\n"

    def save_pretrained(self, folder: str | os.PathLike) -> list[str]:
        """Write this tokenizer as a Hugging Face fast tokenizer (tokenizer.json, tokenizer_config.json,
        special_tokens_map.json) into `folder`; returns the file names.

        `transformers.AutoTokenizer.from_pretrained(folder)` then behaves like this class: the same ids
        (`encode(text, add_special_tokens=False)` == `encode(text)`; the default adds `<bos>` like
        `encode_prompt`), `<unk>` for other characters, decoding with U+FFFD for `<unk>` and pad / bos / eos
        dropped under skip_special_tokens, special-token text in the input split into characters
        (split_special_tokens), and the same no-op chat template. Written as JSON, so neither `tokenizers`
        nor `transformers` is needed to export.
        """
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        specials = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            # The built-in tokenizer never treats "<eos>" in a text as a token, and never edits spaces.
            "split_special_tokens": True,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": True,
            "model_max_length": 1 << 20,
            # messages_to_text: the contents joined by newlines, no role markup.
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}",
        }
        files = {
            "tokenizer.json": self._hf_tokenizer_json(),
            "tokenizer_config.json": config,
            "special_tokens_map.json": specials,
        }
        for name, obj in files.items():
            (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return list(files)

    def _hf_tokenizer_json(self) -> dict[str, Any]:
        """The `tokenizers` serialisation of a WordLevel model over single characters with these ids."""

        def added(token: str) -> dict[str, Any]:
            return {"id": self._ids[token], "content": token, "single_word": False, "lstrip": False,
                    "rstrip": False, "normalized": False, "special": True}  # fmt: skip

        bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [added(t) for t in (PAD, BOS, EOS)],
            "normalizer": None,
            # Every character is a word (newlines included), written in the byte-level alphabet (a space is
            # "Ġ", a newline "Ċ") and looked up in the vocabulary. Byte-level keys matter: for model_type
            # qwen2, transformers 5 ignores tokenizer_class and builds its byte-level Qwen2Tokenizer from this
            # file's vocabulary, which then gives the same ids for every character of the vocabulary
            # (characters outside it it drops, where this file gives <unk>).
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {
                        "type": "Split",
                        "pattern": {"Regex": "[\\s\\S]"},
                        "behavior": "Isolated",
                        "invert": False,
                    },
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": False,
                        "trim_offsets": False,
                        "use_regex": False,
                    },
                ],
            },
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [
                    bos,
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 0}},
                ],
                "special_tokens": {BOS: {"id": BOS, "ids": [self._ids[BOS]], "tokens": [BOS]}},
            },
            "decoder": {
                "type": "Sequence",
                "decoders": [
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": False,
                        "trim_offsets": False,
                        "use_regex": False,
                    },
                    {"type": "Replace", "pattern": {"String": UNK}, "content": UNK_CHAR},
                ],
            },
            "model": {
                "type": "WordLevel",
                "vocab": {
                    t if t in (PAD, BOS, EOS, UNK) else _byte_level(t): i for t, i in self._ids.items()
                },
                "unk_token": UNK,
            },
        }

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def _byte_level(text: str) -> str:
    """`text` in the byte-level alphabet of GPT-2 style tokenizers: each UTF-8 byte is one printable
    character (printable Latin-1 bytes stand for themselves, the others are shifted past 255)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b], shift = chr(256 + shift), shift + 1
    return "".join(table[b] for b in text.encode("utf-8"))


class HFTokenizer:
    """A `transformers` tokenizer behind the rltrain interface."""

    def __init__(self, hf_tokenizer: Any, key: str = "model.path", folder: str = "") -> None:
        """`key` / `folder`: the config path and folder it was loaded from (named when its chat template
        runs past its budget)."""
        self.hf = hf_tokenizer
        self.key, self.folder = key, folder
        self.eos_token_id: int = hf_tokenizer.eos_token_id
        # Many chat models (Qwen2) have no pad token; padding positions are masked anyway, so eos serves.
        pad = hf_tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else self.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.hf, "chat_template", None) is not None

    def encode(self, text: str) -> list[int]:
        """Ids of `text` without special tokens."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Prompt, add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]:
        """The HF chat template; a plain string is treated as one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        text = self._render(list(messages), add_generation_prompt=add_generation_prompt)
        if not tokenize:
            return text
        # What transformers' apply_chat_template(tokenize=True) does after rendering: the template wrote the
        # special tokens itself.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[Any], **kwargs: Any) -> str:
        """The chat template's text, rendered within rltrain.render_budget's time and memory budget."""
        what = f"the chat template of {self.key} ({self.folder})"
        try:
            with render_budget(what):
                return self.hf.apply_chat_template(messages, tokenize=False, **kwargs)
        except RenderBudgetExceeded as exc:
            raise ConfigError(
                [
                    error(
                        self.key,
                        str(exc),
                        "use the model's own chat template (a chat template renders in milliseconds), or "
                        "data.apply_chat_template: false",
                        rule="chat-template",
                    )
                ]
            ) from None

    def encode_prompt(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
        """Ids the policy continues: chat-templated when asked and available, else the plain text with the
        tokenizer's own special tokens (e.g. a bos)."""
        if apply_chat_template and self.has_chat_template:
            return list(self.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
        return list(self.hf.encode(messages_to_text(prompt), add_special_tokens=True))

    def encode_agent_prompt(self, prompt: Prompt, tool_schemas: Sequence[dict[str, Any]]) -> list[int]:
        """The prompt of a multi-turn rollout: the chat template with the tools' JSON schemas (`tools=`, how
        Qwen / Hermes templates list them in the system turn); without a chat template, `encode_prompt`."""
        if not self.has_chat_template:
            return self.encode_prompt(prompt, apply_chat_template=False)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = self._render(messages, tools=list(tool_schemas) or None, add_generation_prompt=True)
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def tool_call_stop_ids(self) -> tuple[int, ...]:
        """The id of `</tool_call>` when the vocabulary has it as one token (Qwen2.5, Hermes); else none (a
        turn then ends at EOS and its last call is read from the text)."""
        ids = self.hf.encode(HF_TOOL_CALL_CLOSE, add_special_tokens=False)
        return (int(ids[0]),) if len(ids) == 1 else ()

    def parse_tool_call(self, turn_text: str, tools: Sequence[Any], context_text: str = "") -> Any:
        """The ToolCall a turn ends with: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; None
        when the turn ends otherwise; ToolCallParseError for a call that is not that JSON."""
        return _json_call(turn_text)

    def observation_text(self, result_text: str, error: bool) -> str:
        """What the chat template puts between the model's call and its next turn: the end of the
        assistant turn, a `tool` message holding the result, and the next assistant turn's opening (the
        template's text after a sentinel assistant message; the bare result without a template)."""
        if not self.has_chat_template:
            return "\n" + result_text + "\n"
        sentinel = "\u2063rlplan-call\u2063"
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": sentinel},
            {"role": "tool", "content": result_text},
        ]
        text = self._render(messages, add_generation_prompt=True)
        return text[text.index(sentinel) + len(sentinel) :]

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"


def quiet_transformers() -> None:
    """Keep transformers' own output (progress bars such as "Loading weights", advisory warnings and info
    logs) out of rltrain's: a failure still raises, and rltrain reports it in its own error format."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(plan: TokenizerPlan) -> CharTokenizer | HFTokenizer:
    """The tokenizer the plan names: its folder (model.tokenizer_path, else model.path), else the built-in
    character tokenizer.

    Raises ConfigError naming the config path when the folder cannot be opened or the built-in vocabulary
    does not fit `model.arch.vocab_size`.
    """
    path, key = plan.path, plan.key
    if path is None:
        tok = CharTokenizer()
        if plan.vocab_size < tok.vocab_size:
            raise ConfigError(
                [
                    error(
                        "model.arch.vocab_size",
                        f"{plan.vocab_size} is smaller than the built-in character tokenizer's "
                        f"vocabulary ({tok.vocab_size} tokens)",
                        f"set model.arch.vocab_size >= {tok.vocab_size}, or set model.tokenizer_path",
                        rule="tokenizer-vocab",
                    )
                ]
            )
        return tok
    # transformers opens the folder's files by name, following symlinks: none may lead outside the folder.
    if escapes := model_folder_escapes(path):
        raise ConfigError([error(key, str(e), "use a tokenizer folder whose files are all inside it (copy the "
                                 "files in instead of linking them)", FOLDER_PATHS_RULE) for e in escapes])  # fmt: skip
    from rlconf.tokenizer_check import folder_issues

    # The fix that fits the cause (a package, the files, a broken file), as `rlconf validate` gives it;
    # checked first because transformers 5 builds an empty tokenizer from a folder with config.json only.
    if found := list(folder_issues(path, key)):
        raise ConfigError(found)
    if os.path.isdir(path):
        # The files transformers is about to read, read first with rlconf.files' bounds (no FIFO, device or
        # oversized file reaches it).
        tokenizer_size(path, key)
    try:
        quiet_transformers()
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/... depending on what is missing
        raise ConfigError(
            [
                error(
                    key,
                    f"cannot load a tokenizer from {path!r}: {type(exc).__name__}: {exc}",
                    "the folder has tokenizer files that transformers' AutoTokenizer could not open: check "
                    "tokenizer_config.json's tokenizer_class against the installed transformers; nothing "
                    "is downloaded",
                    rule="tokenizer-load",
                )
            ]
        ) from exc
    tok = HFTokenizer(hf, key, path)
    if tok.has_chat_template:  # a template that cannot render within its budget stops here, at start-up
        tok.apply_chat_template("hello")
    return tok
