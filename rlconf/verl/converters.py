"""The verl key table's converters: each turns a verl value (with the other verl values at hand) into the
rlplan value, returns SKIP (rlplan's default holds) or raises VerlValueError with the fix."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rlconf.verl.keys import SKIP, Converter, VerlValueError


def _ctx(values: Mapping[str, Any], key: str, default: Any) -> Any:
    return values.get(key, default)


def negative_to_zero(value: Any, _: Mapping[str, Any]) -> Any:
    return 0 if isinstance(value, int) and not isinstance(value, bool) and value < 0 else value


def negative_to_none(value: Any, _: Mapping[str, Any]) -> Any:
    return None if isinstance(value, int) and not isinstance(value, bool) and value < 0 else value


def expand(value: Any, _: Mapping[str, Any]) -> Any:
    return os.path.expanduser(value) if isinstance(value, str) else value


def from_cwd(value: Any, _: Mapping[str, Any]) -> Any:
    """A verl folder relative to the current directory, made absolute (rlplan's are under output_dir)."""
    return os.path.abspath(os.path.expanduser(value)) if isinstance(value, str) and value else value


def packing(value: Any, _: Mapping[str, Any]) -> Any:
    """verl's use_remove_padding: true keeps rlplan's null (packed wherever the engine can), false pads."""
    return SKIP if value is True else value


def files(value: Any, _: Mapping[str, Any]) -> Any:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        return value
    return [os.path.expanduser(f) if isinstance(f, str) else f for f in items]


def reward_file(value: Any, values: Mapping[str, Any]) -> Any:
    """custom_reward_function.path (+ .name) -> reward.function `path:name`; null keeps the default."""
    if value is None:
        return SKIP
    name = values.get("custom_reward_function.name") or "compute_score"
    return f"{os.path.expanduser(value)}:{name}" if isinstance(value, str) else value


def negate(value: Any, _: Mapping[str, Any]) -> Any:
    return not value if isinstance(value, bool) else value


def rollout_engine(value: Any, _: Mapping[str, Any]) -> Any:
    if value in ("vllm", "sglang", "hf", "trtllm"):
        return "embedded"
    return value


_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")


def logger(value: Any, _: Mapping[str, Any]) -> Any:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        return value
    unsupported = [b for b in items if b not in _BACKENDS]
    if unsupported:
        raise VerlValueError(
            f"logger {', '.join(map(str, unsupported))} is not available in rlplan",
            f"use {', '.join(_BACKENDS)}",
        )
    return [*items, "jsonl"] if "jsonl" not in items else list(items)


_KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def lora_targets(value: Any, _: Mapping[str, Any]) -> Any:
    """verl's target_modules / exclude_modules: a string (all-linear, one name) or a list."""
    return [value] if isinstance(value, str) else value


def lora_a_init(value: Any, _: Mapping[str, Any]) -> Any:
    init = {"kaiming": "kaiming", "kaiming_uniform": "kaiming", "normal": "gaussian", "gaussian": "gaussian"}
    if value not in init:
        raise VerlValueError(
            f"lora_A_init_method {value} is not built in rlplan", "use kaiming (PEFT's default)"
        )
    return init[value]


def kl_type(value: Any, _: Mapping[str, Any]) -> Any:
    return _KL_ALIASES.get(value, value) if isinstance(value, str) else value


def truncation(value: Any, _: Mapping[str, Any]) -> Any:
    if value == "middle":
        raise VerlValueError("truncation `middle` is not available", "use error, left, right or filter")
    return value


def filter_overlong(value: Any, _: Mapping[str, Any]) -> Any:
    return "filter" if value is True else SKIP


def recompute_on(value: Any, _: Mapping[str, Any]) -> Any:
    return "full" if value is True else SKIP


_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32"}  # fmt: skip


def dtype(value: Any, _: Mapping[str, Any]) -> Any:
    return _DTYPES.get(value, value) if isinstance(value, str) else value


_ATTENTION = {"flash": "auto", "fused": "auto", "auto": "auto", "unfused": "local", "local": "local"}


def attention(value: Any, _: Mapping[str, Any]) -> Any:
    return _ATTENTION.get(value, value) if isinstance(value, str) else value


def profile_tool(value: Any, _: Mapping[str, Any]) -> Any:
    if value is None:
        return "none"
    if value == "torch_memory":
        raise VerlValueError("the torch_memory profiler is not available", "use profile.tool: torch")
    return value


def placement(value: Any, _: Mapping[str, Any]) -> Any:
    return ("separate" if value else "colocated") if isinstance(value, bool) else value


def reward_model_devices(nnodes_key: str) -> Converter:
    """n_gpus_per_node x the reward model's node count (read at `nnodes_key`): the devices of its own pool."""

    def convert(value: Any, values: Mapping[str, Any]) -> Any:
        nnodes = _ctx(values, nnodes_key, 1)
        if isinstance(value, int) and isinstance(nnodes, int) and not isinstance(value, bool):
            return value * max(nnodes, 1)
        return value

    return convert


def filter_metric(value: Any, _: Mapping[str, Any]) -> Any:
    # rlplan's reward functions return one number: verl's `acc` (the correctness flag) is that score.
    if value in ("acc", "score"):
        return "score"
    if value == "seq_reward" or value is None:
        return "seq_reward" if value else SKIP
    raise VerlValueError(
        f"filter_groups.metric {value!r} has no rlplan equivalent",
        "use acc / score (the reward function's value) or seq_reward (with the overlong penalty)",
    )


def total_epochs(value: Any, values: Mapping[str, Any]) -> Any:
    # verl's trainer runs total_training_steps when it is set, whatever total_epochs says.
    return SKIP if value is None or _ctx(values, "trainer.total_training_steps", None) is not None else value


def min_lr_ratio(lr_key: str, lr_default: float) -> Converter:
    def convert(value: Any, values: Mapping[str, Any]) -> Any:
        if value is None:
            return SKIP
        lr = _ctx(values, lr_key, lr_default)
        if isinstance(value, int | float) and isinstance(lr, int | float):
            return float(value) * float(lr)
        return value

    return convert


def skip_none(value: Any, _: Mapping[str, Any]) -> Any:
    return SKIP if value is None else value


def vllm_only(value: Any, _: Mapping[str, Any]) -> Any:
    # verl's rollout is vLLM / SGLang; the import picks the embedded engine (actor_rollout_ref.rollout.name).
    return SKIP


_RS_KEY = "algorithm.rollout_correction.rollout_rs"
_RS_THRESHOLD_KEY = "algorithm.rollout_correction.rollout_rs_threshold"
_RS_MODES = {"token": "token", "sequence": "sequence", "token_k1": "token", "token_k2": "token",
             "seq_sum_k1": "sequence"}  # fmt: skip
_RS_FIX = (
    "use token_k1 or token_k2 (rlplan's token), seq_sum_k1 (rlplan's sequence), one mode at a time, or "
    "drop rollout_rs"
)


def rollout_rs(value: Any, values: Mapping[str, Any]) -> Any:
    if value is None or not isinstance(value, str):
        return value
    if value not in _RS_MODES:
        raise VerlValueError(f"rejection mode {value!r} has no rlplan equivalent (rlplan bounds |log rho| of "
                             "each token or of the summed response)", _RS_FIX)  # fmt: skip
    if value not in ("token", "sequence") and values.get(_RS_THRESHOLD_KEY) is None:
        raise VerlValueError(f"{value} without rollout_rs_threshold (verl raises at its first step)",
                             "set algorithm.rollout_correction.rollout_rs_threshold, e.g. 2.0")  # fmt: skip
    return _RS_MODES[value]


def rollout_rs_threshold(value: Any, values: Mapping[str, Any]) -> Any:
    """verl's threshold spec -> rlplan's symmetric ratio bound t (tokens kept while |log rho| <= log t)."""
    import math

    if value is None:
        return SKIP
    mode = values.get(_RS_KEY)
    if isinstance(mode, str) and mode not in _RS_MODES:
        return SKIP  # a bound of another statistic: the mode itself is refused (rollout_rs)
    if isinstance(value, str):
        low, sep, high = value.partition("_")
        try:
            lo, hi = (float(low), float(high)) if sep else (None, float(value))
        except ValueError:
            raise VerlValueError(f"cannot read the threshold {value!r}", "write t or 1/t_t (lower_upper), "
                                 "one threshold for one mode") from None  # fmt: skip
        if lo is not None:
            if lo <= 0 or hi <= 0 or not math.isclose(lo * hi, 1.0, rel_tol=1e-3):
                raise VerlValueError(f"the bounds {value!r} are not symmetric (lower x upper != 1); rlplan "
                                     "keeps ratios in [1/t, t]", "use t alone, or 1/t_t")  # fmt: skip
            value = hi
        else:
            value = hi
    if mode == "token_k2" and isinstance(value, int | float) and value > 0:
        # 0.5 (log rho)^2 <= u  <=>  |log rho| <= sqrt(2u): the same token set as rlplan's bound exp(sqrt(2u))
        return math.exp(math.sqrt(2.0 * float(value)))
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def router_replay(value: Any, _: Mapping[str, Any]) -> Any:
    if value in ("disabled", None):
        return False
    if value == "R3":
        return True
    raise VerlValueError(f"router_replay.mode {value!r} has no rlplan equivalent (rlplan replays the rollout's "
                         "routing, verl's R3)", "use R3 or disabled")  # fmt: skip


def train_batch_size(value: Any, _: Mapping[str, Any]) -> Any:
    if value == 0 and not isinstance(value, bool):
        raise VerlValueError(
            "0 is verl's fully async trainer, which streams prompts and updates every "
            "async_training.require_batches x ppo_mini_batch_size of them; rlplan steps over data.train_batch_size "
            "prompts",
            "set data.train_batch_size to the prompts of one step (e.g. actor.ppo_mini_batch_size)",
        )
    return value


PER_RESPONSE_REWARD_MANAGERS = ("naive", "dapo", "prime")
"""verl's reward managers that call compute_score once per response, as rlplan calls reward.function (dapo adds
the overlong buffer: reward.overlong_buffer; prime runs the same calls in a process pool)."""


def reward_manager(value: Any, _: Mapping[str, Any]) -> Any:
    """Refuses a reward manager that calls the reward function another way than once per response."""
    if value in PER_RESPONSE_REWARD_MANAGERS:
        return SKIP
    if value == "batch":
        raise VerlValueError(
            "verl's batch reward manager calls compute_score once with lists (data_sources, solution_strs, "
            "ground_truths, extra_infos); rlplan calls reward.function once per response, so the function "
            "would get one string where it expects a list",
            "give a per-response function compute_score(data_source, solution_str, ground_truth, extra_info) "
            "as custom_reward_function (it may call your batch function with one-element lists)",
        )
    raise VerlValueError(
        f"a reward manager rlplan does not run (it runs {', '.join(PER_RESPONSE_REWARD_MANAGERS)}: one "
        "compute_score call per response)",
        "drop reward_manager and give the scoring as a per-response custom_reward_function",
    )


def refuse_true(message: str, fix: str) -> Converter:
    """A check for a key with no rlplan path: true asks for a feature rlplan does not build."""

    def check(value: Any, _: Mapping[str, Any]) -> Any:
        if value is True:
            raise VerlValueError(message, fix)
        return SKIP

    return check


def refuse_positive(message: str, fix: str) -> Converter:
    """A check for a key with no rlplan path: a positive number asks for a feature rlplan does not build."""

    def check(value: Any, _: Mapping[str, Any]) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            raise VerlValueError(message, fix)
        return SKIP

    return check


def times_ulysses(size_key: str) -> Converter:
    """An FSDP token budget per device -> rlplan's per data-parallel rank: x the Ulysses sequence-parallel size."""

    def convert(value: Any, values: Mapping[str, Any]) -> Any:
        size = values.get(size_key, 1)
        if isinstance(value, int) and isinstance(size, int) and not isinstance(size, bool) and size > 1:
            return value * size
        return value

    return convert


def _pool_shape(values: Mapping[str, Any]) -> tuple[Any, Any] | None:
    """(nodes, devices per node) of the whole cluster: the trainer's pool plus, for verl's one-step-off
    trainer, the rollout's own pool (rollout.nnodes x rollout.n_gpus_per_node) on the same nodes or on more;
    None when the two pools share neither (rollout_pool_devices refuses that)."""
    nodes, per_node = values.get("trainer.nnodes", 1), values.get("trainer.n_gpus_per_node", 8)
    if "rollout.n_gpus_per_node" not in values and "rollout.nnodes" not in values:
        return nodes, per_node
    r_nodes, r_per_node = values.get("rollout.nnodes", 1), values.get("rollout.n_gpus_per_node", 8)
    if not all(
        isinstance(v, int) and not isinstance(v, bool) for v in (nodes, per_node, r_nodes, r_per_node)
    ):
        return nodes, per_node  # a value of the wrong type: validation names it
    if nodes == r_nodes:
        return nodes, per_node + r_per_node
    if per_node == r_per_node:
        return nodes + r_nodes, per_node
    return None


def cluster_shape(index: int) -> Converter:
    """trainer.nnodes (0) / trainer.n_gpus_per_node (1) -> the cluster's, with a one-step-off rollout pool."""

    def convert(value: Any, values: Mapping[str, Any]) -> Any:
        shape = _pool_shape({**values, ("trainer.nnodes", "trainer.n_gpus_per_node")[index]: value})
        return value if shape is None else shape[index]

    return convert


def rollout_pool_devices(value: Any, values: Mapping[str, Any]) -> Any:
    """rollout.n_gpus_per_node (verl's one-step-off rollout pool) -> rollout.num_devices (x rollout.nnodes)."""
    nodes = values.get("rollout.nnodes", 1)
    if _pool_shape(values) is None:
        raise VerlValueError(
            f"the trainer's pool ({values.get('trainer.nnodes', 1)} x {values.get('trainer.n_gpus_per_node', 8)}) "
            f"and the rollout's ({nodes} x {value}) share neither their nodes nor their devices per node; rlplan's "
            "cluster is nodes x devices per node",
            "give both pools the same nodes (trainer.nnodes = rollout.nnodes) or the same devices per node",
        )
    if isinstance(value, int) and isinstance(nodes, int) and not isinstance(nodes, bool):
        return value * nodes
    return value
