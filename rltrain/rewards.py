"""Rule-based reward functions and the resolution of `reward.function`.

A reward function has rlplan's signature `(response: str, ground_truth: str, prompt: str) -> float`, or
verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None)` returning a float or a
dict with a `score` key (such a function is wrapped in `VerlStyleReward`, which is also callable the
rlplan way). The built-ins are registered in `REWARD_FUNCTIONS` under exactly the names of
`rlconf.config.BUILTIN_REWARDS` (verl's scorers from rltrain.reward_scores among them); a user function is
named as `package.module:function` (imported with importlib, the spec is never evaluated) or, as verl's
custom_reward_function, `path/to/file.py:function` (the file is imported from its path).
Every resolution problem raises `RewardFunctionError`, a `ConfigError` on the path `reward.function` that
says what to change; so does, during the run, a function that returns something other than a finite
number or raises (`score_batch`): the run stops with exit 2 and a message naming the function and the row.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlconf.errors import ConfigError, error
from rlconf.reward_file import file_spec_issues, split_file_spec
from rltrain.reward_scores import VERL_SCORERS

RewardFunction = Callable[[str, str, str], float]

CONFIG_PATH = "reward.function"


class RewardFunctionError(ConfigError):
    """`reward.function` cannot be resolved to a usable function (message and fix say why)."""

    def __init__(self, message: str, fix: str, rule: str = "reward-function") -> None:
        super().__init__([error(CONFIG_PATH, message, fix, rule=rule)])
        self.message = message
        self.fix = fix


# ------------------------------------------------------------------------------------------ parsing
# Optional sign, digits with thousands commas, optional decimals ("1,234.5", "-3", "0.25"). A trailing
# sentence period ("is 42.") is not part of the number because decimals need a digit after the dot.
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASH_MARKER = re.compile(r"####\s*([^\n]*)")


def _boxed_contents(text: str) -> list[str]:
    r"""Contents of every `\boxed{...}` in text, with nested braces balanced (`\boxed{\frac{1}{2}}`)."""
    out = []
    start = 0
    while (i := text.find("\\boxed{", start)) != -1:
        depth, j = 1, i + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            out.append(text[i + len("\\boxed{") : j - 1])
        start = j
    return out


def extract_answer(text: str) -> str:
    r"""The final-answer part of a response: the last `<answer>...</answer>`, else the text after the last
    `####`, else the last `\boxed{...}`, else the whole text. Whitespace is stripped."""
    if tags := _ANSWER_TAG.findall(text):
        return tags[-1].strip()
    if marks := _HASH_MARKER.findall(text):
        return marks[-1].strip()
    if boxed := _boxed_contents(text):
        return boxed[-1].strip()
    return text.strip()


def extract_last_number(text: str) -> float | None:
    r"""The last number of `text` (GSM8K style): searched in the final-answer part (`<answer>`, `####`,
    `\boxed{}`) first and in the whole text when that part holds none; commas are thousands separators.
    None when there is no number."""
    for part in (extract_answer(text), text):
        if found := _NUMBER.findall(part):
            try:
                return float(found[-1].replace(",", ""))
            except ValueError:  # e.g. "1,,2" cannot occur after removing commas, but stay total
                continue
    return None


def _normalize(text: str) -> str:
    return " ".join(text.split())


# ----------------------------------------------------------------------------------------- built-ins
def exact_match(response: str, ground_truth: str, prompt: str) -> float:
    """1.0 when the response's final answer equals the ground truth, else 0.0.

    The final answer is the `<answer>` / `####` / `\\boxed{}` part when present, else the whole response;
    both sides are compared with runs of whitespace collapsed and ends stripped.
    """
    return float(_normalize(extract_answer(response)) == _normalize(extract_answer(ground_truth)))


def numeric_match(response: str, ground_truth: str, prompt: str) -> float:
    """1.0 when the last number of the response equals the ground truth's number, else 0.0.

    GSM8K style: `#### 1,234`, `\\boxed{42}`, `<answer>7</answer>` and "... so the answer is 42." all give
    their number; the ground truth may itself be a GSM8K solution ending in `#### N`. Numbers compare with a
    relative tolerance of 1e-6 (so "3.0" matches "3").
    """
    truth = extract_last_number(ground_truth)
    got = extract_last_number(response)
    if truth is None or got is None:
        return 0.0
    return float(math.isclose(got, truth, rel_tol=1e-6, abs_tol=1e-9))


_FORMAT_TAG = re.compile(r"<answer>\s*\S.*?</answer>", re.DOTALL)
_FORMAT_HASH = re.compile(r"####[ \t]*\S")


def format_reward(response: str, ground_truth: str, prompt: str) -> float:
    """`format`: 1.0 when the response states a final answer in a recognised format, else 0.0.

    Recognised: a non-empty `<answer>...</answer>` or a `#### <answer>` marker. Correctness is not checked
    (combine with numeric_match in a user function for that).
    """
    return float(bool(_FORMAT_TAG.search(response) or _FORMAT_HASH.search(response)))


def digit_match(response: str, ground_truth: str, prompt: str) -> float:
    """Partial credit: the fraction of the ground truth's characters matched position by position.

    With spaces removed from both, reward = #{i < len(gt) : response[i] == gt[i]} / len(gt). Characters the
    response has beyond the ground truth's length are ignored. A random policy scores a little above 0 and
    each additional correct position adds 1/len(gt), so the signal is dense and rises smoothly, which is what
    the tiny synthetic runs need. An empty ground truth scores 1.0 for an empty response, else 0.0.
    """
    got = response.replace(" ", "")
    truth = ground_truth.replace(" ", "")
    if not truth:
        return float(not got)
    hits = sum(1 for a, b in zip(got, truth, strict=False) if a == b)
    return hits / len(truth)


def no_reward(response: str, ground_truth: str, prompt: str) -> float:
    """`none`: no rule reward (0.0 for every response), so the reward is the reward model's score alone."""
    return 0.0


@dataclass(frozen=True)
class VerlStyleReward:
    """A function with verl's signature, called as verl's reward managers call it (by keyword):
    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...). Calling the wrapper with
    rlplan's three arguments scores a row without a data_source."""

    fn: Callable[..., Any]
    name: str

    def __call__(
        self,
        response: str,
        ground_truth: str,
        prompt: str = "",
        data_source: str = "",
        extra_info: Any = None,
    ) -> Any:
        return self.fn(
            data_source=data_source, solution_str=response, ground_truth=ground_truth, extra_info=extra_info
        )


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "format": format_reward,
    "digit_match": digit_match,
    "none": no_reward,
    **{name: VerlStyleReward(fn, name) for name, fn in VERL_SCORERS.items()},
}


# --------------------------------------------------------------------------------------- resolution
_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


_VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")


def _is_verl_style(fn: Callable) -> bool:
    """verl's compute_score is told apart by its parameter names (verl passes them by keyword)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return "solution_str" in params or (bool(params) and params[0] == "data_source")


def _check_signature(fn: Callable, spec: str) -> None:
    """Fail early when `fn` cannot be called as fn(response, ground_truth, prompt), or for verl's style as
    fn(data_source=, solution_str=, ground_truth=, extra_info=)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without signature metadata: trust them
        return
    if _is_verl_style(fn):
        try:
            sig.bind(**dict.fromkeys(_VERL_PARAMS, ""))
        except TypeError as exc:
            raise RewardFunctionError(
                f"{spec!r} has signature {sig}, which verl's reward managers cannot call as "
                f"fn(data_source=, solution_str=, ground_truth=, extra_info=) ({exc})",
                "give it verl's parameters: compute_score(data_source, solution_str, ground_truth, "
                "extra_info=None)",
                rule="reward-function-signature",
            ) from exc
        return
    try:
        sig.bind("", "", "")
    except TypeError as exc:
        raise RewardFunctionError(
            f"{spec!r} has signature {sig}, which cannot be called as fn(response, ground_truth, prompt) "
            f"({exc})",
            "give the function three positional parameters (response: str, ground_truth: str, prompt: str)"
            " returning a float",
            rule="reward-function-signature",
        ) from exc


def load_reward_function(spec: str) -> RewardFunction:
    """Resolve `reward.function`: a built-in name or `package.module:function` (imported, never eval'd).

    Raises RewardFunctionError (a ConfigError on `reward.function`) when the name is unknown, the module
    cannot be imported, the attribute is missing, or it is not a callable taking three arguments.
    """
    builtins = ", ".join(REWARD_FUNCTIONS)
    if not isinstance(spec, str) or not spec.strip():
        raise RewardFunctionError(
            f"expected a reward function name, got {spec!r}",
            f"use one of the built-ins ({builtins}) or a user function as package.module:function",
            rule="reward-function-unknown",
        )
    spec = spec.strip()
    if split_file_spec(spec) is not None:
        return _load_file_function(spec)
    if ":" not in spec:
        if spec in REWARD_FUNCTIONS:
            return REWARD_FUNCTIONS[spec]
        close = difflib.get_close_matches(spec, list(REWARD_FUNCTIONS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        if "." in spec:
            mod, _, attr = spec.rpartition(".")
            hint += f"for a user function write {mod}:{attr} (module and function separated by ':'). "
        raise RewardFunctionError(
            f"unknown reward function {spec!r}; built-ins are: {builtins}",
            f"{hint}use a built-in name or package.module:function",
            rule="reward-function-unknown",
        )

    module_name, _, attr_path = spec.partition(":")
    if not _MODULE_PATH.match(module_name) or not _MODULE_PATH.match(attr_path):
        raise RewardFunctionError(
            f"{spec!r} is not of the form package.module:function",
            "write the importable module path, a single ':', then the function name, e.g. "
            "my_rewards.math:score",
            rule="reward-function-syntax",
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise RewardFunctionError(
            f"cannot import module {module_name!r} of {spec!r}: {exc}",
            "install the package or add its folder to PYTHONPATH (the workers import it too), and check "
            "the spelling",
            rule="reward-function-import",
        ) from exc
    except Exception as exc:  # the module exists but raised while importing: report its own error
        raise RewardFunctionError(
            f"importing module {module_name!r} of {spec!r} raised {type(exc).__name__}: {exc}",
            f"fix the error in {module_name} (try `python -c 'import {module_name}'`)",
            rule="reward-function-import",
        ) from exc

    obj: object = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RewardFunctionError(
                f"module {module_name!r} has no attribute {attr_path!r}",
                f"{hint}callables in {module_name}: {', '.join(names) or '(none)'}",
                rule="reward-function-attribute",
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardFunctionError(
            f"{spec!r} is a {type(obj).__name__}, not a function",
            "point reward.function at a function (response, ground_truth, prompt) -> float",
            rule="reward-function-not-callable",
        )
    return _checked(obj, spec)


def _checked(obj: Callable, spec: str) -> RewardFunction:
    """`obj` after the signature check, wrapped when it has verl's signature."""
    _check_signature(obj, spec)
    if _is_verl_style(obj):
        return VerlStyleReward(obj, spec)  # type: ignore[return-value]
    return obj  # type: ignore[return-value]


def _load_file_function(spec: str) -> RewardFunction:
    """`path/to/file.py:function`: the file checked as `rlconf validate` checks it, then imported from
    its path under a module name of its own (so two reward files named alike do not collide)."""
    if issues := [*file_spec_issues(spec, filesystem=False), *file_spec_issues(spec, filesystem=True)]:
        raise RewardFunctionError(issues[0].message, issues[0].fix, rule=issues[0].rule)
    path, name = split_file_spec(spec)  # type: ignore[misc]
    full = os.path.abspath(os.path.expanduser(path))
    module_name = "rlplan_reward_" + hashlib.sha256(full.encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(module_name, full)
        assert loader_spec is not None and loader_spec.loader is not None  # a .py path always has one
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise RewardFunctionError(
                f"importing reward file {path!r} of {spec!r} raised {type(exc).__name__}: {exc}",
                f"fix the error in {path} (try `python {path}`)",
                rule="reward-function-import",
            ) from exc
    obj = getattr(module, name, None)
    if not callable(obj):
        raise RewardFunctionError(
            f"{name!r} in {path!r} is a {type(obj).__name__}, not a function",
            "point reward.function at a function compute_score(data_source, solution_str, ground_truth, "
            "extra_info=None)",
            rule="reward-function-not-callable",
        )
    return _checked(obj, spec)


def function_name(fn: Callable) -> str:
    """`module:qualname` of a reward function, as `reward.function` spells a user function."""
    if isinstance(fn, VerlStyleReward):
        return fn.name
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"


def _shorten(text: str, limit: int = 48) -> str:
    """`text` quoted, cut to about `limit` characters (long prompts and responses would bury the message)."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _as_reward(value: object) -> float | None:
    """`value` as a finite float, or None when it is not a real number (None, str, NaN, inf, a list...).

    Numbers and number-like scalars (bool, numpy scalars, one-element tensors) are accepted; strings are
    not, although float("1") would parse them: a string reward is a bug in the function.
    """
    if isinstance(value, str | bytes) or not hasattr(type(value), "__float__"):
        return None
    try:
        score = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
        return None
    return score if math.isfinite(score) else None


def _split_result(value: object) -> tuple[object, dict[str, float]]:
    """(score, extras) of a reward function's result: verl's dict results carry the score under `score`
    and other values beside it; the numeric ones (bools included, verl's `acc`) become metrics."""
    if not isinstance(value, Mapping):
        return value, {}
    extras = {}
    for key, item in value.items():
        if key != "score" and isinstance(key, str) and (number := _as_reward(item)) is not None:
            extras[key] = number
    return value.get("score"), extras


def score_rows(
    fn: RewardFunction,
    responses: Sequence[str],
    ground_truths: Sequence[str],
    prompts: Sequence[str],
    data_sources: Sequence[str] | None = None,
    extra_infos: Sequence[Any] | None = None,
) -> tuple[list[float], dict[str, float]]:
    """Scores of every row and the means of the extra values dict results carried (`reward_extra/KEY`,
    over the rows that had the key). A verl-style function gets each row's data_source and extra_info
    (empty / None when the data has none); rlplan's gets (response, ground_truth, prompt).

    A function that returns something other than a finite real number (None, NaN, inf, a string, a dict
    without `score`, ...) or raises is a RewardFunctionError on `reward.function` (exit 2): a NaN reward
    would silently poison every advantage of its group. The message names the function, the row and its
    prompt and response (shortened).
    """
    rows = len(responses)
    sources = list(data_sources) if data_sources is not None else [""] * rows
    infos = list(extra_infos) if extra_infos is not None else [None] * rows
    if not rows == len(ground_truths) == len(prompts) == len(sources) == len(infos):
        raise ValueError(
            f"score_batch needs equally long inputs, got {len(responses)} responses, "
            f"{len(ground_truths)} ground truths, {len(prompts)} prompts, {len(sources)} data sources and "
            f"{len(infos)} extra_infos"
        )
    name = function_name(fn)
    verl_style = isinstance(fn, VerlStyleReward)
    scores: list[float] = []
    sums: dict[str, list[float]] = {}
    for i, (resp, truth, prompt) in enumerate(zip(responses, ground_truths, prompts, strict=True)):
        row = f"row {i} (prompt {_shorten(prompt)}, response {_shorten(resp)})"
        try:
            value = fn(resp, truth, prompt, sources[i], infos[i]) if verl_style else fn(resp, truth, prompt)  # type: ignore[call-arg]
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            raise RewardFunctionError(
                f"reward function {name} raised {type(exc).__name__}: {exc} "
                f"(at {where.filename}:{where.lineno}) on {row}",
                f"fix {name} so that it returns a float for every response (call it on this prompt and "
                "response to reproduce)",
                rule="reward-function-raised",
            ) from exc
        raw, extras = _split_result(value)
        score = _as_reward(raw)
        if score is None:
            shown = f"{value!r} ({type(value).__name__})"
            raise RewardFunctionError(
                f"reward function {name} returned {shown[:80]} for {row}; a reward must be a finite number "
                "(or a dict with a finite `score`)",
                f"make {name} return a finite float for every response (e.g. 0.0 for a response it cannot "
                "score)",
                rule="reward-function-value",
            )
        scores.append(score)
        for key, number in extras.items():
            sums.setdefault(key, []).append(number)
    return scores, {f"reward_extra/{k}": sum(v) / len(v) for k, v in sums.items()}


def score_batch(
    fn: RewardFunction,
    responses: Sequence[str],
    ground_truths: Sequence[str],
    prompts: Sequence[str],
) -> list[float]:
    """Score each (response, ground truth, prompt) triple (no data_source): `score_rows`' scores."""
    return score_rows(fn, responses, ground_truths, prompts)[0]


def check_data_sources(fn: RewardFunction, data_sources: Sequence[str]) -> None:
    """Before a run starts: every row's data_source has a scorer under `default_compute_score` (else the
    first step would stop on the first such row). Other reward functions take any data_source."""
    from rltrain.reward_scores import default_compute_score, scorer_for

    if not isinstance(fn, VerlStyleReward) or fn.fn is not default_compute_score:
        return
    unknown = sorted({s for s in data_sources if scorer_for(s) is None})
    if unknown:
        shown = ", ".join(repr(s) for s in unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise RewardFunctionError(
            f"default_compute_score has no scorer for data_source {shown} of the prompt files",
            "set reward.function to path/to/reward.py:compute_score (a verl reward function for these "
            "sources), or to a built-in scorer for every row (gsm8k, math, math_dapo)",
            rule="reward-function-data-source",
        )
