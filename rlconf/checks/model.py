"""Rules of the model: engine support of its architecture, its files (weights, tokenizer) and what rlplan cannot run.

Each rule registers itself in rlconf.rules with `@rule(name, fields...)` when this module is imported
(rlconf.validate imports every check module, in the order the docs list the rules).
"""

from __future__ import annotations

from collections.abc import Iterator

from rlconf.config import (
    RLConfig,
)
from rlconf.errors import ConfigError, Issue, error
from rlconf.model_files import RULE as MODEL_FILES_RULE
from rlconf.model_files import model_files_issues
from rlconf.model_spec import (
    UNSUPPORTED_RULE,
    family_issues,
    read_model_arch,
)
from rlconf.plan.model_fit import engine_gap_issues, sliding_window_issue
from rlconf.plan.roles import model_folders
from rlconf.rules import rule


@rule("model-engine-support", "model.path", "model.arch.*", "critic.model_path", "reward.reward_model.path",
      filesystem=True)  # fmt: skip
def model_engine_support(c: RLConfig) -> Iterator[Issue]:
    """Models rlconf.model_spec reads but the megatron engine does not build yet (YaRN rope scaling): refused
    before a run's workers start, and by `rlconf plan` too (the plan reads a config.json and asks
    `engine_gap_issues` the same)."""
    for path, folder, spec in model_folders(c):
        builtin = "model.arch" if spec.model == "policy" else None
        if folder is None and builtin is None:
            continue
        try:
            arch = c.model.arch if folder is None else read_model_arch(folder, path)
        except ConfigError:
            continue  # the plan reports a config.json it cannot read
        yield from engine_gap_issues(arch, path if folder is not None else None, builtin or "model.arch")


@rule(MODEL_FILES_RULE, "model.path", "model.tokenizer_path", "critic.model_path", "reward.reward_model.path",
      "data.max_prompt_length", "rollout.max_response_length", filesystem=True)  # fmt: skip
def model_files(c: RLConfig) -> Iterator[Issue]:
    """Model folders agree with their config.json before anything starts (rlconf.model_files): every
    safetensors header is sound (length, byte ranges inside the file, no overlaps), every tensor the loader
    reads is there with its shape and a float dtype (embedding rows == vocab_size), the tokenizer exists
    and its ids fit vocab_size, and prompt + response fit max_position_embeddings."""
    yield from model_files_issues(c)


@rule(UNSUPPORTED_RULE, "model.path", "model.arch.family", "model.arch.add_qkv_bias", "model.arch.qk_layernorm",
      "model.arch.num_moe_experts", "model.arch.moe_router_topk", "model.arch.moe_norm_topk_prob",
      "model.arch.moe_dense_layers",
      "model.arch.sliding_window", "data.max_prompt_length", "rollout.max_response_length")  # fmt: skip
def model_unsupported(c: RLConfig) -> Iterator[Issue]:
    """The built-in `model.arch` is a model rlplan can run: its fields agree with its family (q/k/v biases,
    QK-norm, experts) and a sliding attention window covers prompt + response. A config.json at
    `model.path` (or a critic's / reward model's path) is checked under the same rule when the plan reads
    it: vision-language, multi-token prediction, hybrid attention and other families fail there."""
    if c.model.path is not None:
        return  # model.arch is not used
    for path, message, fix in family_issues(c.model.arch, "model.arch"):
        yield error(path, message, fix, UNSUPPORTED_RULE)
    if (
        issue := sliding_window_issue(c, c.model.arch, "model.arch", "model.arch.sliding_window")
    ) is not None:
        yield issue
