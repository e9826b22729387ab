"""verl's rule scorers, behind verl's reward interface, so that a verl dataset scores the same here.

Every function here has verl's signature, `compute_score(data_source, solution_str, ground_truth,
extra_info=None)`, and returns a float or a dict with a `score` key (as verl's own do). They follow the
semantics of verl's `verl.utils.reward_score` modules (written anew here, not copied):

- `gsm8k`: the answer after the last `#### ` marker (strict) or the last number of the response
  (flexible), commas and `$` dropped, compared as a string with the ground truth; 1.0 or 0.0. Only the
  last 300 characters are searched, as in verl.
- `math`: the last `\\boxed{...}` (or `\\boxed x`, `\\fbox{...}`) of the response against the ground
  truth, both normalised the way the MATH benchmark does (fractions, `\\left`, units, spaces, `0.5`,
  `a/b`, ...); 1.0 or 0.0.
- `math_dapo` (DAPO-math, AIME): the last `Answer: ...` line of the last 300 characters, normalised the
  Minerva way; `{"score": 1.0 | -1.0, "acc": bool, "pred": str}`.
- `default_compute_score`: dispatches on each row's `data_source` like verl's function of that name:
  `openai/gsm8k` -> gsm8k, `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`
  -> math, `math_dapo`, `math`, `math_dapo_reasoning` and `aime*` -> math_dapo. verl's other sources
  (numina_*, code contests through a sandbox, geometry3k, search-R1) raise `UnknownDataSource`: point
  reward.function at a verl reward file for them.

- `math_verify`: symbolic equivalence by Hugging Face's Math-Verify (the optional extra
  `pip install 'rlplan[math]'`), as verl's `math_verify` module scores: the ground truth read as
  `\\boxed{...}`, the response's last 300 characters parsed for LaTeX and plain expressions, then compared
  as sympy expressions (`1/2`, `0.5` and `\\frac{1}{2}` are equal); 1.0 or 0.0. verl's default for MATH
  sources is the string comparison of `math`, so default_compute_score keeps that; name `math_verify` to
  choose it. `rlconf validate` reports a missing package (rule reward-function).
"""

from __future__ import annotations

import re
import threading
from typing import Any

# verl searches only the end of a response: the final answer is there, and regexes on long texts are slow.
_CLIP_CHARS = 300


class UnknownDataSource(ValueError):
    """A row's data_source has no built-in scorer."""


# -------------------------------------------------------------------------------------------- GSM8K
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K response: strict (after the last `#### `) or flexible (the last number
    that is not a lone `.`); None when there is none."""
    text = solution_str[-_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method != "flexible":
        raise ValueError(f"method must be strict or flexible, got {method!r}")
    candidates = [n for n in _GSM8K_NUMBER.findall(text) if n not in ("", ".")]
    return candidates[-1] if candidates else None


def gsm8k(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Any = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K: `score` when the extracted answer equals the ground truth, `format_score` when an answer was
    found but differs, 0.0 when none was found."""
    answer = gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)


def gsm8k_flexible(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """GSM8K with the flexible extraction (the last number of the response)."""
    return gsm8k(data_source, solution_str, ground_truth, extra_info, method="flexible")


# --------------------------------------------------------------------------------------------- MATH
def last_boxed(text: str) -> str | None:
    r"""The contents of the last `\boxed{...}` (balanced braces), `\boxed x` (up to a `$`) or
    `\fbox{...}` of `text`; None when there is none or its braces do not close."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth, i = 0, start
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                whole = text[start : i + 1]
                opening = whole.find("{")
                return whole[opening + 1 : -1]
        i += 1
    return None


def _fix_fracs(s: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{7}` -> `\frac{1}{7}` (braces around single-character args)."""
    head, *parts = s.split("\\frac")
    out = [head]
    for part in parts:
        out.append("\\frac")
        if part.startswith("{"):
            out.append(part)
            continue
        if len(part) < 2:
            return s  # `\frac` with fewer than two characters after it: leave the string alone
        a, b, rest = part[0], part[1], part[2:]
        out.append(f"{{{a}}}{{{b}}}{rest}" if b != "{" else f"{{{a}}}{b}{rest}")
    return "".join(out)


def _fix_slash(s: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are plain integers."""
    a, sep, b = s.partition("/")
    if not sep or "/" in b or not re.fullmatch(r"-?\d+", a) or not re.fullmatch(r"-?\d+", b):
        return s
    if f"{int(a)}/{int(b)}" != s:
        return s
    return f"\\frac{{{int(a)}}}{{{int(b)}}}"


def _fix_sqrt(s: str) -> str:
    r"""`\sqrt3` -> `\sqrt{3}`."""
    head, *parts = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p.startswith("{") else f"{{{p[:1]}}}{p[1:]}") for p in parts)


def normalize_math(s: str) -> str:
    """A MATH-benchmark answer in canonical form (the normalisation verl's math scorer uses)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:  # units written as `\text{ cm}` on the right
        pieces = s.split("\\text{ ")
        s = pieces[0] if len(pieces) == 2 else s
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s.startswith("."):
        s = "0" + s
    left, eq, right = s.partition("=")
    if eq and "=" not in right and len(left) <= 2:  # `k = 5` -> `5`
        s = right
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def math_equal(answer: str | None, ground_truth: str | None) -> bool:
    """Whether two MATH answers are equal after normalisation (both None counts as equal)."""
    if answer is None or ground_truth is None:
        return answer is None and ground_truth is None
    return normalize_math(answer) == normalize_math(ground_truth)


def math(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    r"""MATH: 1.0 when the last `\boxed{}` answer equals the ground truth after normalisation, else 0.0."""
    answer = last_boxed(solution_str)
    return float(answer is not None and math_equal(answer, str(ground_truth)))


# ----------------------------------------------------------------------------------- DAPO-math / AIME
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_MINERVA_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_MINERVA_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
)  # fmt: skip


def normalize_minerva(answer: str) -> str:
    """A final answer in the Minerva canonical form (what DAPO's math scorer compares)."""
    s = answer.split("=")[-1]
    for before, after in _MINERVA_SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _MINERVA_REMOVED:
        s = s.replace(expr, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for command in ("text", "textbf", "overline"):
        s = re.sub(rf"(\\{command}\{{)(.*?)(\}})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def math_dapo(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> dict[str, Any]:
    """DAPO-math / AIME: the last `Answer: X` of the response's end against the ground truth (both in
    Minerva form): score 1.0 when equal, else -1.0; `acc` the verdict, `pred` the normalised answer."""
    found = _DAPO_ANSWER.findall(solution_str[-_CLIP_CHARS:])
    pred = normalize_minerva(found[-1] if found else "[INVALID]")
    correct = pred == normalize_minerva(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# -------------------------------------------------------------------------------------- Math-Verify
MATH_VERIFY_TIMEOUT_S = 5
"""Seconds each Math-Verify parse / comparison may take (sympy on model-written text can run away).
Math-Verify bounds them with SIGALRM, which only the main thread can set: off it, the 300-character clip is
the bound."""


def math_verify(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """Symbolic equivalence of the response's final expression and the ground truth (Math-Verify)."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as e:  # rlconf validate names the extra before a run; this is the direct call
        raise ImportError(
            "reward.function math_verify needs `pip install 'rlplan[math]'` (math-verify)"
        ) from e
    limit = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{ground_truth}}}", (LatexExtractionConfig(),), parsing_timeout=limit)
    pred = parse(
        solution_str[-_CLIP_CHARS:], (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=limit
    )
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0


# ---------------------------------------------------------------------------------------- dispatch
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")


def scorer_for(data_source: str) -> Any:
    """The built-in scorer verl's default_compute_score picks for `data_source`, None when it has none."""
    if data_source == "openai/gsm8k":
        return gsm8k
    if data_source in MATH_SOURCES:
        return math
    if data_source in DAPO_SOURCES or data_source.startswith("aime"):
        return math_dapo
    return None


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float | dict[str, Any]:
    """The scorer for each row's data_source, as verl's default_compute_score chooses it."""
    if (scorer := scorer_for(data_source)) is not None:
        return scorer(data_source, solution_str, ground_truth, extra_info)
    raise UnknownDataSource(
        f"no built-in scorer for data_source {data_source!r} (built-in: openai/gsm8k, "
        f"{', '.join(MATH_SOURCES)}, {', '.join(DAPO_SOURCES)}, aime*); set reward.function to "
        "path/to/reward.py:compute_score with a verl reward function for it"
    )


# Built-in names (rlconf.config.BUILTIN_REWARDS lists them too) with verl's signature.
VERL_SCORERS = {
    "default_compute_score": default_compute_score,
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
    "math": math,
    "math_dapo": math_dapo,
    "math_verify": math_verify,
}
