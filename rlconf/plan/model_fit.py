"""What a model's architecture must fit, checked once for the validator and the compiler: the engine's
gaps (rule model-engine-support, e.g. YaRN) and an attention window against the run's sequence lengths
(rule model-unsupported). rlconf.checks.model runs them on `model.arch` and the config.json files of a
config; rlconf.plan.compile on each architecture it reads.
"""

from __future__ import annotations

from rlconf.config import ModelArch, RLConfig
from rlconf.errors import Issue, error
from rlconf.model_spec import UNSUPPORTED_RULE, engine_gaps


def engine_gap_issues(arch: ModelArch, path: str | None, builtin: str = "model.arch") -> list[Issue]:
    """rule model-engine-support's errors for `arch`, read from the config.json at config path `path` (None:
    the built-in `builtin` section, whose field each error names)."""
    fix = ("choose a model without it (config.json's rope_scaling / rope_parameters rope_type)" if path
           else f"set {builtin}.rope_scaling.type to none, linear or llama3")  # fmt: skip
    return [error(path if path is not None else f"{builtin}.{field}", gap, fix, "model-engine-support")
            for field, gap in engine_gaps(arch)]  # fmt: skip


def sliding_window_issue(c: RLConfig, arch: ModelArch, source: str, path: str) -> Issue | None:
    """The error for an attention window shorter than the run's sequences, a feature the engine does not build
    (within the window, windowed and full causal attention are the same computation); `source` names where
    the architecture comes from. The plan asks the same of an architecture read from config.json."""
    seq = c.data.max_prompt_length + c.rollout.max_response_length
    if arch.sliding_window is None or seq <= arch.sliding_window:
        return None
    return error(
        path,
        f"{source}: family {arch.family} attends within a sliding window of {arch.sliding_window} tokens, "
        f"shorter than prompt + response = {seq}; rlplan builds full causal attention only",
        f"keep data.max_prompt_length + rollout.max_response_length <= {arch.sliding_window}",
        UNSUPPORTED_RULE,
    )
