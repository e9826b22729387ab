"""Import a verl (Megatron trainer) config: translate its keys to rlplan paths, report what did not map.

`rlconf import-verl [verl.yaml] [override ...]` reads a verl trainer config (the `ppo_megatron_trainer`
layout, resolved or not) and/or Hydra-style overrides (`key=value`, `+key=value`, `++key=value`,
`~key`), maps every known key with `VERL_KEYS` (one row per verl key; the table is also the source of
docs/migrating-from-verl.md), and validates the result with rlplan's rules and plan.

Design choices
- The table is data: `VerlKey(verl, rlplan, note, convert, reason, verl_default)`. A row with `rlplan`
  None says why the key has no rlplan equivalent (`reason`: unsupported, ignored-by-verl, not-needed,
  deprecated-in-verl). Rows for the per-role families (megatron, optim, checkpoint, profiler) are
  generated from one list per family. A row key ending in `.*` covers every key under it.
- No key is dropped silently: each input key is mapped, reported unmapped with its row's reason, or
  reported as an unknown verl key with a did-you-mean against the table.
- verl's defaults are applied where they differ from rlplan's and change the run (`verl_default` on a
  row; e.g. `trainer.device` is cuda in verl), so an override list translates to the run verl would have
  made. rlplan-specific consequences (the ref in the actor's layout, the embedded rollout at the actor's
  tp, the critic enabled by gae) are added as derived settings. All of these are listed in the report.
- Pure: standard library, PyYAML and rlconf only (no torch, ray or megatron).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlconf.config import LAYOUT_FIELDS, RLConfig
from rlconf.errors import ConfigError, Issue, IssueSet, error, warning
from rlconf.fields import field_types, leaf_paths, strip_optional

Reason = Literal["unsupported", "ignored-by-verl", "not-needed", "deprecated-in-verl"]
REASONS: dict[str, str] = {
    "unsupported": "rlplan has no such feature",
    "ignored-by-verl": "verl itself ignores this key",
    "not-needed": "rlplan derives or does not need it",
    "deprecated-in-verl": "an older verl name",
    "unknown": "unknown verl key",
    "unresolved": "an interpolation that cannot be resolved",
}


class _Skip:
    """Returned by a converter when the verl value asks for nothing to be set (rlplan's default holds)."""

    def __repr__(self) -> str:
        return "SKIP"


SKIP: Any = _Skip()
_NO_DEFAULT: Any = object()


class VerlValueError(ValueError):
    """A verl value with no rlplan translation; the message says why and the fix what to do."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


Converter = Callable[[Any, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class VerlKey:
    """One verl key and its rlplan translation.

    `verl` is the dotted verl key (a trailing `.*` covers every key under it). `rlplan` is the dotted
    rlplan path, or None when there is none; then `reason` says why. `convert(value, verl_values)` turns
    the verl value into the rlplan value (it may return SKIP, or raise VerlValueError). `verl_default` is
    verl's default, applied when the input leaves the key unset (only where it differs from rlplan's and
    changes the run; it may be a `${...}` interpolation of another verl key).
    """

    verl: str
    rlplan: str | None
    note: str = ""
    convert: Converter | None = None
    reason: Reason | None = None
    verl_default: Any = _NO_DEFAULT
    family: str = ""

    def __post_init__(self) -> None:
        if (self.rlplan is None) != (self.reason is not None):
            raise ValueError(f"{self.verl}: a row has either an rlplan path or a reason, not both")

    @property
    def has_default(self) -> bool:
        return self.verl_default is not _NO_DEFAULT


# ------------------------------------------------------------------------------------------ converters
def _ctx(values: Mapping[str, Any], key: str, default: Any) -> Any:
    return values.get(key, default)


def _negative_to_zero(value: Any, _: Mapping[str, Any]) -> Any:
    return 0 if isinstance(value, int) and not isinstance(value, bool) and value < 0 else value


def _negative_to_none(value: Any, _: Mapping[str, Any]) -> Any:
    return None if isinstance(value, int) and not isinstance(value, bool) and value < 0 else value


def _expand(value: Any, _: Mapping[str, Any]) -> Any:
    return os.path.expanduser(value) if isinstance(value, str) else value


def _files(value: Any, _: Mapping[str, Any]) -> Any:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        return value
    return [os.path.expanduser(f) if isinstance(f, str) else f for f in items]


def _not(value: Any, _: Mapping[str, Any]) -> Any:
    return not value if isinstance(value, bool) else value


def _rollout_engine(value: Any, _: Mapping[str, Any]) -> Any:
    if value in ("vllm", "sglang", "hf", "trtllm"):
        return "embedded"
    return value


_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")


def _logger(value: Any, _: Mapping[str, Any]) -> Any:
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


def _kl_type(value: Any, _: Mapping[str, Any]) -> Any:
    return _KL_ALIASES.get(value, value) if isinstance(value, str) else value


def _truncation(value: Any, _: Mapping[str, Any]) -> Any:
    if value == "middle":
        raise VerlValueError("truncation `middle` is not available", "use error, left, right or filter")
    return value


def _filter_overlong(value: Any, _: Mapping[str, Any]) -> Any:
    return "filter" if value is True else SKIP


def _recompute_on(value: Any, _: Mapping[str, Any]) -> Any:
    return "full" if value is True else SKIP


_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32"}  # fmt: skip


def _dtype(value: Any, _: Mapping[str, Any]) -> Any:
    return _DTYPES.get(value, value) if isinstance(value, str) else value


_ATTENTION = {"flash": "auto", "fused": "auto", "auto": "auto", "unfused": "local", "local": "local"}


def _attention(value: Any, _: Mapping[str, Any]) -> Any:
    return _ATTENTION.get(value, value) if isinstance(value, str) else value


def _profile_tool(value: Any, _: Mapping[str, Any]) -> Any:
    if value is None:
        return "none"
    if value == "torch_memory":
        raise VerlValueError("the torch_memory profiler is not available", "use profile.tool: torch")
    return value


def _placement(value: Any, _: Mapping[str, Any]) -> Any:
    return ("separate" if value else "colocated") if isinstance(value, bool) else value


def _rm_devices(value: Any, values: Mapping[str, Any]) -> Any:
    nnodes = _ctx(values, "reward_model.nnodes", 1)
    if isinstance(value, int) and isinstance(nnodes, int) and not isinstance(value, bool):
        return value * max(nnodes, 1)
    return value


def _filter_metric(value: Any, _: Mapping[str, Any]) -> Any:
    # rlplan's reward functions return one number: verl's `acc` (the correctness flag) is that score.
    if value in ("acc", "score"):
        return "score"
    if value == "seq_reward" or value is None:
        return "seq_reward" if value else SKIP
    raise VerlValueError(
        f"filter_groups.metric {value!r} has no rlplan equivalent",
        "use acc / score (the reward function's value) or seq_reward (with the overlong penalty)",
    )


def _total_epochs(value: Any, values: Mapping[str, Any]) -> Any:
    # verl's trainer runs total_training_steps when it is set, whatever total_epochs says.
    return SKIP if value is None or _ctx(values, "trainer.total_training_steps", None) is not None else value


def _min_lr_ratio(lr_key: str, lr_default: float) -> Converter:
    def convert(value: Any, values: Mapping[str, Any]) -> Any:
        if value is None:
            return SKIP
        lr = _ctx(values, lr_key, lr_default)
        if isinstance(value, int | float) and isinstance(lr, int | float):
            return float(value) * float(lr)
        return value

    return convert


# ---------------------------------------------------------------------------------------------- table
def _m(verl: str, rlplan: str, note: str = "", convert: Converter | None = None, **kw: Any) -> VerlKey:
    return VerlKey(verl, rlplan, note, convert, **kw)


def _u(verl: str, reason: Reason, note: str, **kw: Any) -> VerlKey:
    return VerlKey(verl, None, note, None, reason, **kw)


_SAME = object()  # the rlplan suffix equals the verl suffix
_IN_ACTOR = "rlplan runs the reference policy in the actor's processes, so it uses the actor's layout"

# (verl suffix, rlplan suffix | _SAME | None, note, converter, reason, {role: override})
_MEGATRON_FIELDS: tuple[tuple[str, Any, str, Converter | None, Reason | None], ...] = (
    ("tensor_model_parallel_size", _SAME, "", None, None),
    ("pipeline_model_parallel_size", _SAME, "", None, None),
    ("virtual_pipeline_model_parallel_size", _SAME, "", None, None),
    ("context_parallel_size", _SAME, "", None, None),
    ("expert_model_parallel_size", _SAME, "", None, None),
    ("expert_tensor_parallel_size", _SAME, "", None, None),
    ("sequence_parallel", _SAME,
     "verl's default is true; when unset, rlplan turns it on for roles with tp > 1", None, None),
    ("use_distributed_optimizer", _SAME, "", None, None),
    ("param_offload", _SAME, "", None, None),
    ("grad_offload", None,
     "verl's megatron workers move gradients with the parameters (param_offload), so the value had no effect "
     "there; rlplan's `*.megatron.grad_offload` does act: set it explicitly if you want it", None,
     "ignored-by-verl"),
    ("optimizer_offload", _SAME, "", None, None),
    ("use_dist_checkpointing", _SAME, "rlplan reads its own role checkpoints (checkpoints/global_step_N/actor)",
     None, None),
    ("dist_checkpointing_path", _SAME, "an rlplan role checkpoint folder, not a verl/megatron converter output",
     None, None),
    ("dist_checkpointing_prefix", None, "rlplan checkpoints have no key prefix", None, "not-needed"),
    ("seed", _SAME, "", None, None),
    ("override_transformer_config.recompute_granularity", _SAME, "", None, None),
    ("override_transformer_config.recompute_method", _SAME, "", None, None),
    ("override_transformer_config.recompute_num_layers", _SAME, "", None, None),
    ("override_transformer_config.recompute_modules", _SAME, "", None, None),
    ("override_transformer_config.attention_dropout", _SAME, "", None, None),
    ("override_transformer_config.hidden_dropout", _SAME, "", None, None),
    ("override_transformer_config.attention_backend", None,
     "rlplan has one setting for every role: model.attention_backend (see the actor row)", None, "not-needed"),
    ("override_transformer_config.*", None,
     "rlplan forwards only the recompute and dropout fields to megatron's TransformerConfig", None,
     "unsupported"),
    ("override_ddp_config.grad_reduce_in_fp32", _SAME, "", None, None),
    ("override_ddp_config.overlap_grad_reduce", _SAME, "", None, None),
    ("override_ddp_config.overlap_param_gather", _SAME, "", None, None),
    ("override_ddp_config.bucket_size", _SAME, "", None, None),
    ("override_ddp_config.average_in_collective", _SAME, "", None, None),
    ("override_ddp_config.*", None, "rlplan forwards only the fields of its `DDPConfig`", None, "unsupported"),
    ("override_mcore_model_config.*", None, "rlplan builds the model from config.json or model.arch", None,
     "unsupported"),
    ("use_mbridge", None, "rlplan converts Hugging Face <-> megatron weights itself", None, "not-needed"),
    ("vanilla_mbridge", None, "rlplan converts Hugging Face <-> megatron weights itself", None, "not-needed"),
    ("forward_only", None, "rlplan knows which roles only run forward passes", None, "not-needed"),
    ("dtype", None, "rlplan has one compute dtype for every role: model.params_dtype (see the actor row)", None,
     "not-needed"),
)  # fmt: skip
_MEGATRON_ROLES = (
    ("actor_rollout_ref.actor.megatron", "actor.megatron"),
    ("actor_rollout_ref.ref.megatron", "ref.megatron"),
    ("critic.megatron", "critic.megatron"),
    ("reward_model.megatron", "reward.reward_model.megatron"),
)


def _megatron_rows() -> list[VerlKey]:
    rows = []
    for verl_prefix, ours in _MEGATRON_ROLES:
        for suffix, target, note, convert, reason in _MEGATRON_FIELDS:
            key = f"{verl_prefix}.{suffix}"
            if ours == "actor.megatron" and suffix == "dtype":
                rows.append(_m(key, "model.params_dtype", "verl's default is bfloat16 (rlplan's: float32)",
                               _dtype, verl_default="bfloat16", family="megatron"))  # fmt: skip
            elif ours == "actor.megatron" and suffix == "override_transformer_config.attention_backend":
                rows.append(_m(key, "model.attention_backend",
                               "flash and fused -> auto (Transformer Engine when installed, else sdpa), "
                               "unfused -> local", _attention, family="megatron"))  # fmt: skip
            elif target is None:
                rows.append(_u(key, reason or "unsupported", note, family="megatron"))
            else:
                row_note = note
                if ours == "ref.megatron" and suffix in LAYOUT_FIELDS:
                    row_note = f"must equal the actor's: {_IN_ACTOR}; when unset, the actor's value is used"
                rows.append(_m(key, f"{ours}.{suffix}", row_note, convert, family="megatron"))
    return rows


_OPTIM_FIELDS: tuple[tuple[str, Any, str, Converter | None, Reason | None], ...] = (
    ("optimizer", _SAME, "adam is AdamW (decoupled weight decay), as in megatron", None, None),
    ("lr", _SAME, "", None, None),
    ("min_lr", _SAME, "", None, None),
    ("lr_warmup_steps", _SAME, "verl's -1 (use the ratio) becomes null", _negative_to_none, None),
    ("lr_warmup_steps_ratio", _SAME, "", None, None),
    ("lr_warmup_init", _SAME, "", None, None),
    ("lr_decay_steps", _SAME, "", None, None),
    ("lr_decay_style", _SAME, "", None, None),
    ("warmup_style", "lr_decay_style", "the shape after warmup (constant or cosine)", None, None),
    ("lr_scheduler_type", "lr_decay_style", "the shape after warmup (constant or cosine)", None, None),
    ("lr_wsd_decay_steps", _SAME, "", None, None),
    ("lr_wsd_decay_style", _SAME, "", None, None),
    ("weight_decay", _SAME, "", None, None),
    ("weight_decay_incr_style", None, "rlplan keeps weight decay constant (verl's default)", None, "unsupported"),
    ("betas", None,
     "verl's megatron optimizer does not forward it, so megatron's (0.9, 0.999) applied; rlplan's "
     "`optim.betas` acts and defaults to the same (0.9, 0.999)", None, "ignored-by-verl"),
    ("clip_grad", _SAME, "", None, None),
    ("total_training_steps", None, "rlplan derives the schedule's length from trainer.total_steps", None,
     "not-needed"),
    ("use_checkpoint_opt_param_scheduler", None, "the lr schedule is restored from rlplan's `extra` checkpoint",
     None, "not-needed"),
    ("override_optimizer_config.*", None, "rlplan forwards only the fields of `Optim`", None, "unsupported"),
)  # fmt: skip


def _optim_rows() -> list[VerlKey]:
    rows = []
    for verl_prefix, ours, lr_default in (
        ("actor_rollout_ref.actor.optim", "actor.optim", 1e-6),
        ("critic.optim", "critic.optim", 1e-5),
    ):
        for suffix, target, note, convert, reason in _OPTIM_FIELDS:
            key = f"{verl_prefix}.{suffix}"
            if target is None:
                rows.append(_u(key, reason or "unsupported", note, family="optim"))
                continue
            extra: dict[str, Any] = {"verl_default": lr_default} if suffix == "lr" else {}
            note_ = f"verl's default is {lr_default:g} (rlplan's: 1e-3)" if suffix == "lr" else note
            rows.append(
                _m(key, f"{ours}.{suffix if target is _SAME else target}", note_, convert, family="optim",
                   **extra)
            )  # fmt: skip
        rows.append(
            _m(f"{verl_prefix}.min_lr_ratio", f"{ours}.min_lr", "absolute in rlplan: min_lr_ratio x lr",
               _min_lr_ratio(f"{verl_prefix}.lr", lr_default), family="optim")
        )  # fmt: skip
    return rows


def _checkpoint_rows() -> list[VerlKey]:
    rows = []
    for verl_prefix, ours in (("actor_rollout_ref.actor.checkpoint", "actor.checkpoint"),
                              ("critic.checkpoint", "critic.checkpoint")):  # fmt: skip
        rows += [
            _m(f"{verl_prefix}.save_contents", f"{ours}.save_contents", "same values: model, optimizer, extra, "
               "hf_model", family="checkpoint"),
            _m(f"{verl_prefix}.load_contents", f"{ours}.load_contents", "", family="checkpoint"),
            _m(f"{verl_prefix}.contents", f"{ours}.save_contents", "older verl name of save_contents",
               family="checkpoint"),
            _m(f"{verl_prefix}.async_save", f"{ours}.async_save", "", family="checkpoint"),
        ]  # fmt: skip
    return rows


_PROFILER_ROLES = (
    "actor_rollout_ref.actor.profiler",
    "actor_rollout_ref.ref.profiler",
    "actor_rollout_ref.rollout.profiler",
    "critic.profiler",
    "reward_model.profiler",
)


def _profiler_rows() -> list[VerlKey]:
    rows = []
    one = "rlplan has one profile section for all roles; roles that disagree are reported"
    for prefix in _PROFILER_ROLES:
        rows += [
            _u(f"{prefix}.enable", "not-needed", "rlplan profiles the roles in profile.roles (empty: all roles) "
               "at profile.steps", family="profiler"),
            _m(f"{prefix}.all_ranks", "profile.all_ranks", one, family="profiler"),
            _m(f"{prefix}.ranks", "profile.ranks", "ranks count within each role's world; " + one,
               family="profiler"),
            _m(f"{prefix}.tool", "profile.tool", "null -> none", _profile_tool, family="profiler"),
            _m(f"{prefix}.save_path", "profile.save_path", "", family="profiler"),
            _m(f"{prefix}.tool_config.nsys.discrete", "profile.discrete", "", family="profiler"),
            _m(f"{prefix}.tool_config.npu.discrete", "profile.discrete", "", family="profiler"),
            _m(f"{prefix}.tool_config.npu.level", "profile.npu.level", "", family="profiler"),
            _m(f"{prefix}.tool_config.npu.contents", "profile.npu.contents", "", family="profiler"),
            _m(f"{prefix}.tool_config.npu.analysis", "profile.npu.analysis", "", family="profiler"),
            _u(f"{prefix}.tool_config.torch.*", "not-needed", "rlplan profiles whole role calls at profile.steps; "
               "options are under profile.torch", family="profiler"),
            _u(f"{prefix}.tool_config.torch_memory.*", "unsupported", "no memory-snapshot profiler in rlplan",
               family="profiler"),
        ]  # fmt: skip
    return rows


_ROLLOUT_UNSUPPORTED = "rlplan's embedded rollout has no such engine option"

VERL_KEYS: tuple[VerlKey, ...] = (
    # ------------------------------------------------------------------------------------------ data
    _m("data.train_files", "data.train_files", ".parquet or .jsonl; verl's ground-truth column is read through "
       "data.answer_key (set to reward_model.ground_truth)", _files),
    _m("data.val_files", "data.val_files", "", _files),
    _m("data.prompt_key", "data.prompt_key", "text or a list of chat messages"),
    _m("data.train_batch_size", "data.train_batch_size", "prompts per step, as in verl", verl_default=1024),
    _u("data.gen_batch_size", "not-needed", "with algorithm.filter_groups rlplan generates batches of "
       "data.train_batch_size prompts until data.train_batch_size groups are kept"),
    _m("data.val_batch_size", "data.val_batch_size", ""),
    _m("data.max_prompt_length", "data.max_prompt_length", "", verl_default=512),
    _m("data.max_response_length", "rollout.max_response_length", "moved to rollout", verl_default=512),
    _m("data.truncation", "data.truncation", "no `middle`; verl's default is error (rlplan's: filter)",
       _truncation, verl_default="error"),
    _m("data.filter_overlong_prompts", "data.truncation", "true -> filter (wins over data.truncation)",
       _filter_overlong),
    _m("data.shuffle", "data.shuffle", ""),
    _m("data.seed", "data.seed", ""),
    _m("data.tokenizer", "model.tokenizer_path", "", _expand),
    _u("data.filter_overlong_prompts_workers", "not-needed", "rlplan filters while tokenizing"),
    _u("data.reward_fn_key", "not-needed", "rlplan's reward is reward.function for every row (no data_source "
       "dispatch)"),
    _u("data.use_shm", "not-needed", "rlplan reads local files"),
    _u("data.train_max_samples", "unsupported", "trim the file instead"),
    _u("data.val_max_samples", "unsupported", "trim the file instead"),
    _u("data.return_raw_input_ids", "not-needed", "one tokenizer serves policy and reward"),
    _u("data.return_raw_chat", "not-needed", "chat messages are templated by rlplan (data.apply_chat_template)"),
    _u("data.return_full_prompt", "not-needed", "rlplan keeps the prompt with each response"),
    _u("data.dataloader_num_workers", "not-needed", "prompts are tokenized once, up front"),
    _u("data.validation_shuffle", "not-needed", "validation order is fixed"),
    _u("data.tool_config_path", "unsupported", "no multi-turn tool use"),
    _u("data.image_key", "unsupported", "text-only models"),
    _u("data.video_key", "unsupported", "text-only models"),
    _u("data.image_patch_size", "unsupported", "text-only models"),
    _u("data.return_multi_modal_inputs", "unsupported", "text-only models"),
    _u("data.trust_remote_code", "unsupported", "rlplan runs no code from model folders"),
    _u("data.custom_cls.*", "unsupported", "rlplan reads parquet / jsonl with data.prompt_key and "
       "data.answer_key"),
    _u("data.sampler.*", "unsupported", "prompts are shuffled (data.shuffle) or in file order"),
    _u("data.datagen.*", "unsupported", "no dynamic data generation"),
    _u("data.apply_chat_template_kwargs.*", "unsupported", "the tokenizer's chat template is applied as is"),
    # ----------------------------------------------------------------------------------------- model
    _m("actor_rollout_ref.model.path", "model.path", "a local folder: rlplan downloads nothing (a hub id such "
       "as Qwen/Qwen2.5-7B-Instruct fails the plan until it points at a downloaded copy)", _expand),
    _m("actor_rollout_ref.model.tokenizer_path", "model.tokenizer_path", "", _expand),
    _m("actor_rollout_ref.model.enable_gradient_checkpointing",
       "actor.megatron.override_transformer_config.recompute_granularity",
       "true -> full (megatron uniform recompute, 1 layer per chunk, as verl does)", _recompute_on),
    _m("actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_granularity",
       "actor.megatron.override_transformer_config.recompute_granularity", ""),
    _m("actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_method",
       "actor.megatron.override_transformer_config.recompute_method", ""),
    _m("actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_num_layers",
       "actor.megatron.override_transformer_config.recompute_num_layers", ""),
    _u("actor_rollout_ref.model.override_config.*", "unsupported", "with model.path the architecture comes "
       "from config.json; model.arch describes built-in shapes"),
    _u("actor_rollout_ref.model.external_lib", "unsupported", "rlplan imports no model code"),
    _u("actor_rollout_ref.model.trust_remote_code", "unsupported", "rlplan runs no code from model folders"),
    _u("actor_rollout_ref.model.custom_chat_template", "unsupported", "the tokenizer's chat template is used"),
    _u("actor_rollout_ref.model.use_fused_kernels", "not-needed", "rlplan's log-prob kernel is always chunked"),
    _u("actor_rollout_ref.model.use_remove_padding", "not-needed", "rlplan always packs sequences"),
    _u("actor_rollout_ref.model.lora_rank", "unsupported", "no LoRA: full fine-tuning"),
    _u("actor_rollout_ref.model.lora_alpha", "unsupported", "no LoRA: full fine-tuning"),
    _u("actor_rollout_ref.model.target_modules", "unsupported", "no LoRA: full fine-tuning"),
    _u("actor_rollout_ref.model.use_shm", "not-needed", "rlplan reads local folders"),
    _u("actor_rollout_ref.hybrid_engine", "not-needed", "actor, rollout and ref always share processes"),
    _u("actor_rollout_ref.nccl_timeout", "not-needed", "rlplan uses torch's default timeout"),
    # ----------------------------------------------------------------------------------------- actor
    _u("actor_rollout_ref.actor.strategy", "not-needed", "rlplan always runs megatron"),
    _m("actor_rollout_ref.actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size",
       "prompts per optimizer update, as in verl", verl_default=256),
    _u("actor_rollout_ref.actor.ppo_micro_batch_size", "deprecated-in-verl",
       "a global micro-batch; set ppo_micro_batch_size_per_gpu (responses per data-parallel rank)"),
    _m("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size_per_gpu",
       "responses per data-parallel rank"),
    _m("actor_rollout_ref.actor.use_dynamic_bsz", "actor.use_dynamic_bsz", ""),
    _m("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor.ppo_max_token_len_per_gpu",
       "verl's default is 16384 (rlplan's: 4096)", verl_default=16384),
    _m("actor_rollout_ref.actor.ppo_epochs", "actor.ppo_epochs", ""),
    _m("actor_rollout_ref.actor.shuffle", "actor.shuffle", "verl's default is false (rlplan's: true)",
       verl_default=False),
    _m("actor_rollout_ref.actor.clip_ratio", "actor.clip_ratio", ""),
    _m("actor_rollout_ref.actor.clip_ratio_low", "actor.clip_ratio_low", ""),
    _m("actor_rollout_ref.actor.clip_ratio_high", "actor.clip_ratio_high", ""),
    _m("actor_rollout_ref.actor.clip_ratio_c", "actor.clip_ratio_c", ""),
    _m("actor_rollout_ref.actor.loss_agg_mode", "actor.loss_agg_mode", "same four modes"),
    _m("actor_rollout_ref.actor.entropy_coeff", "actor.entropy_coeff", ""),
    _m("actor_rollout_ref.actor.use_kl_loss", "actor.use_kl_loss", ""),
    _m("actor_rollout_ref.actor.kl_loss_coef", "actor.kl_loss_coef", ""),
    _m("actor_rollout_ref.actor.kl_loss_type", "actor.kl_loss_type", "k1 -> kl, k2 -> mse, k3 -> low_var_kl",
       _kl_type),
    _m("actor_rollout_ref.actor.grad_clip", "actor.optim.clip_grad", "verl's FSDP name"),
    _m("actor_rollout_ref.actor.policy_loss.loss_mode", "actor.policy_loss.loss_mode",
       "vanilla, gspo, gpg, clip-cov, kl-cov, cispo, sapo (gspo aggregates seq-mean-token-mean, as verl)"),
    _m("actor_rollout_ref.actor.policy_loss.clip_cov_ratio", "actor.policy_loss.clip_cov_ratio", ""),
    _m("actor_rollout_ref.actor.policy_loss.clip_cov_lb", "actor.policy_loss.clip_cov_lb", ""),
    _m("actor_rollout_ref.actor.policy_loss.clip_cov_ub", "actor.policy_loss.clip_cov_ub", ""),
    _m("actor_rollout_ref.actor.policy_loss.kl_cov_ratio", "actor.policy_loss.kl_cov_ratio", ""),
    _m("actor_rollout_ref.actor.policy_loss.ppo_kl_coef", "actor.policy_loss.ppo_kl_coef", ""),
    _m("actor_rollout_ref.actor.policy_loss.tau_pos", "actor.policy_loss.tau_pos", ""),
    _m("actor_rollout_ref.actor.policy_loss.tau_neg", "actor.policy_loss.tau_neg", ""),
    _m("actor_rollout_ref.actor.tau_pos", "actor.policy_loss.tau_pos", "SAPO's gate temperature"),
    _m("actor_rollout_ref.actor.tau_neg", "actor.policy_loss.tau_neg", "SAPO's gate temperature"),
    _u("actor_rollout_ref.actor.policy_loss.*", "unsupported", "rlplan has the loss modes and options listed "
       "under actor.policy_loss"),
    _u("actor_rollout_ref.actor.use_torch_compile", "not-needed", "rlplan compiles nothing by default"),
    _u("actor_rollout_ref.actor.data_loader_seed", "not-needed", "mini-batch shuffling is seeded by "
       "trainer.seed"),
    _u("actor_rollout_ref.actor.freeze_vision_tower", "unsupported", "text-only models"),
    _u("actor_rollout_ref.actor.load_weight", "not-needed", "weights come from model.path, or random init "
       "without it"),
    _u("actor_rollout_ref.actor.use_fused_kernels", "not-needed", "rlplan's log-prob kernel is always chunked"),
    _u("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "unsupported", "FSDP only; megatron "
       "context parallel is *.megatron.context_parallel_size"),
    _u("actor_rollout_ref.actor.profile.*", "deprecated-in-verl", "use global_profiler.* and "
       "actor_rollout_ref.actor.profiler.*"),
    # ------------------------------------------------------------------------------------------- ref
    _m("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_micro_batch_size_per_gpu", ""),
    _u("actor_rollout_ref.ref.log_prob_micro_batch_size", "deprecated-in-verl",
       "set log_prob_micro_batch_size_per_gpu"),
    _u("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "unsupported", "log-prob passes use fixed micro-batches"),
    _u("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "unsupported",
       "log-prob passes use fixed micro-batches"),
    _u("actor_rollout_ref.ref.strategy", "not-needed", "the ref runs on megatron in the actor's processes"),
    _u("actor_rollout_ref.ref.use_torch_compile", "not-needed", "rlplan compiles nothing by default"),
    _u("actor_rollout_ref.ref.load_weight", "not-needed", "the ref loads the actor's initial weights"),
    _u("actor_rollout_ref.ref.use_fused_kernels", "not-needed", "rlplan's log-prob kernel is always chunked"),
    _u("actor_rollout_ref.ref.profile.*", "deprecated-in-verl", "use global_profiler.*"),
    _u("actor_rollout_ref.ref.sync_actor", "unsupported", "the reference policy stays frozen"),
    _u("actor_rollout_ref.ref.sync_actor_alpha", "unsupported", "the reference policy stays frozen"),
    _u("actor_rollout_ref.ref.sync_steps", "unsupported", "the reference policy stays frozen"),
    _u("actor_rollout_ref.ref.ulysses_sequence_parallel_size", "unsupported", "FSDP only"),
    # --------------------------------------------------------------------------------------- rollout
    _m("actor_rollout_ref.rollout.name", "rollout.engine",
       "vllm, sglang, hf and trtllm -> embedded: rlplan's generator on megatron weights (no extra install; in "
       "the rollout's own tp when it differs, resharded each step); rollout.engine: vllm is the optional "
       "adapter", _rollout_engine),
    _m("actor_rollout_ref.rollout.n", "rollout.n", "responses per prompt; verl's default is 1 (rlplan's: 8)",
       verl_default=1),
    _m("actor_rollout_ref.rollout.temperature", "rollout.temperature", ""),
    _m("actor_rollout_ref.rollout.top_p", "rollout.top_p", ""),
    _m("actor_rollout_ref.rollout.top_k", "rollout.top_k", "-1 disables, as in verl"),
    _m("actor_rollout_ref.rollout.response_length", "rollout.max_response_length",
       "verl interpolates it from data.max_response_length"),
    _m("actor_rollout_ref.rollout.tensor_model_parallel_size", "rollout.tensor_model_parallel_size",
       "the rollout generates at this tp without pipeline parallel (dp = actor devices / tp), the actor's weights "
       "resharded into it before each generation; it must divide or be a multiple of the actor's tp (rule "
       "rollout-engine); unset: null, the actor's layout (no weight copy)"),
    _m("actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization", ""),
    _m("actor_rollout_ref.rollout.free_cache_engine", "rollout.free_cache_engine", ""),
    _m("actor_rollout_ref.rollout.max_num_seqs", "rollout.max_num_seqs", "verl's default is 1024 (rlplan's: 256)",
       verl_default=1024),
    _m("actor_rollout_ref.rollout.enforce_eager", "rollout.cuda_graph", "inverted", _not),
    _m("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "actor.log_prob_micro_batch_size_per_gpu",
       "verl's actor recomputes old log-probs with the rollout's micro-batch size"),
    _u("actor_rollout_ref.rollout.log_prob_micro_batch_size", "deprecated-in-verl",
       "set log_prob_micro_batch_size_per_gpu"),
    _u("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "unsupported",
       "log-prob passes use fixed micro-batches"),
    _u("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "unsupported",
       "log-prob passes use fixed micro-batches"),
    _m("actor_rollout_ref.rollout.val_kwargs.n", "rollout.val.n", ""),
    _m("actor_rollout_ref.rollout.val_kwargs.temperature", "rollout.val.temperature", "0 is greedy"),
    _m("actor_rollout_ref.rollout.val_kwargs.top_p", "rollout.val.top_p", ""),
    _u("actor_rollout_ref.rollout.val_kwargs.top_k", "unsupported", "validation sampling has n, temperature "
       "and top_p"),
    _u("actor_rollout_ref.rollout.val_kwargs.do_sample", "not-needed", "validation temperature 0 is greedy"),
    _u("actor_rollout_ref.rollout.do_sample", "not-needed", "training rollouts always sample "
       "(rollout.temperature > 0)"),
    _u("actor_rollout_ref.rollout.mode", "not-needed", "the embedded engine has one mode"),
    _u("actor_rollout_ref.rollout.prompt_length", "not-needed", "rlplan uses data.max_prompt_length"),
    _u("actor_rollout_ref.rollout.dtype", "not-needed", "the rollout runs in model.params_dtype"),
    _u("actor_rollout_ref.rollout.ignore_eos", "unsupported", "responses end at EOS"),
    _u("actor_rollout_ref.rollout.cudagraph_capture_sizes", "not-needed", "rollout.cuda_graph captures the "
       "sizes it needs"),
    _u("actor_rollout_ref.rollout.data_parallel_size", "not-needed", "the rollout's dp is the actor pool / tp"),
    _u("actor_rollout_ref.rollout.expert_parallel_size", "unsupported", "no mixture-of-experts models"),
    _u("actor_rollout_ref.rollout.pipeline_model_parallel_size", "unsupported", _ROLLOUT_UNSUPPORTED),
    _u("actor_rollout_ref.rollout.max_num_batched_tokens", "not-needed", "the embedded engine batches by "
       "rollout.max_num_seqs"),
    _u("actor_rollout_ref.rollout.max_model_len", "not-needed", "prompt + response lengths bound it"),
    _u("actor_rollout_ref.rollout.enable_chunked_prefill", "not-needed", _ROLLOUT_UNSUPPORTED),
    _u("actor_rollout_ref.rollout.enable_prefix_caching", "not-needed", _ROLLOUT_UNSUPPORTED),
    _u("actor_rollout_ref.rollout.load_format", "not-needed", "the embedded engine uses the actor's weights"),
    _u("actor_rollout_ref.rollout.disable_log_stats", "not-needed", _ROLLOUT_UNSUPPORTED),
    _u("actor_rollout_ref.rollout.over_sample_rate", "unsupported", "every response of a step is kept"),
    _u("actor_rollout_ref.rollout.multi_stage_wake_up", "not-needed", "nothing to wake: weights are shared"),
    _u("actor_rollout_ref.rollout.engine_kwargs.*", "unsupported", _ROLLOUT_UNSUPPORTED),
    _u("actor_rollout_ref.rollout.multi_turn.*", "unsupported", "single-turn rollouts only"),
    _u("actor_rollout_ref.rollout.agent.*", "unsupported", "no agent loop"),
    _u("actor_rollout_ref.rollout.calculate_log_probs", "not-needed", "old log-probs are recomputed by the "
       "actor"),
    _u("actor_rollout_ref.rollout.update_weights_bucket_megabytes", "not-needed", "no weight transfer: the "
       "rollout uses the actor's weights"),
    _u("actor_rollout_ref.rollout.trace.*", "unsupported", "no rollout tracing backend"),
    _u("actor_rollout_ref.rollout.skip_rollout", "unsupported", "rollouts are always generated"),
    _u("actor_rollout_ref.rollout.skip_dump_dir", "unsupported", "rollouts are always generated"),
    _u("actor_rollout_ref.rollout.skip_tokenizer_init", "not-needed", "one tokenizer, loaded once"),
    _u("actor_rollout_ref.rollout.prometheus.*", "unsupported", "metrics go to logging.backends"),
    _u("actor_rollout_ref.rollout.quantization", "unsupported", "the rollout runs in model.params_dtype"),
    _u("actor_rollout_ref.rollout.use_block_quant_rollout", "unsupported", "the rollout runs in "
       "model.params_dtype"),
    _u("actor_rollout_ref.rollout.layer_name_map.*", "not-needed", "no weight renaming: the rollout uses the "
       "actor's modules"),
    _u("actor_rollout_ref.rollout.layered_summon", "not-needed", "FSDP only"),
    # ---------------------------------------------------------------------------------------- critic
    _m("critic.enable", "critic.enable", "null (verl's default) -> enabled exactly when "
       "algorithm.adv_estimator is gae"),
    _m("critic.model.path", "critic.model_path", "null: the actor's model with a fresh value head", _expand),
    _m("critic.model.enable_gradient_checkpointing",
       "critic.megatron.override_transformer_config.recompute_granularity", "true -> full", _recompute_on),
    _u("critic.model.tokenizer_path", "not-needed", "the critic reads the policy's tokens"),
    _u("critic.model.override_config.*", "unsupported", "the architecture comes from config.json"),
    _u("critic.model.external_lib", "unsupported", "rlplan imports no model code"),
    _u("critic.model.trust_remote_code", "unsupported", "rlplan runs no code from model folders"),
    _u("critic.model.gradient_checkpointing_kwargs.*", "unsupported", "use critic.megatron.override_"
       "transformer_config.recompute_*"),
    _m("critic.ppo_mini_batch_size", "critic.ppo_mini_batch_size", "",
       verl_default="${actor_rollout_ref.actor.ppo_mini_batch_size}"),
    _u("critic.ppo_micro_batch_size", "deprecated-in-verl", "set ppo_micro_batch_size_per_gpu"),
    _m("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu", ""),
    _m("critic.use_dynamic_bsz", "critic.use_dynamic_bsz", "",
       verl_default="${actor_rollout_ref.actor.use_dynamic_bsz}"),
    _m("critic.ppo_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu",
       "verl's default is 32768 (rlplan's: 4096)", verl_default=32768),
    _u("critic.forward_max_token_len_per_gpu", "not-needed", "value passes use ppo_max_token_len_per_gpu"),
    _m("critic.ppo_epochs", "critic.ppo_epochs", "", verl_default="${actor_rollout_ref.actor.ppo_epochs}"),
    _m("critic.cliprange_value", "critic.cliprange_value", ""),
    _m("critic.grad_clip", "critic.optim.clip_grad", "verl's FSDP name"),
    _u("critic.shuffle", "not-needed", "the critic's mini-batches follow actor.shuffle"),
    _u("critic.loss_agg_mode", "unsupported", "the value loss is a token mean"),
    _u("critic.rollout_n", "not-needed", "rlplan reads rollout.n"),
    _u("critic.strategy", "not-needed", "megatron only"),
    _u("critic.nccl_timeout", "not-needed", "rlplan uses torch's default timeout"),
    _u("critic.load_weight", "not-needed", "weights come from critic.model_path or the actor's model"),
    _u("critic.data_loader_seed", "not-needed", "mini-batch shuffling is seeded by trainer.seed"),
    _u("critic.kl_ctrl.*", "deprecated-in-verl", "use algorithm.kl_ctrl.*"),
    _u("critic.ulysses_sequence_parallel_size", "unsupported", "FSDP only"),
    # ---------------------------------------------------------------------------------------- reward
    _m("reward_model.enable", "reward.reward_model.enable", ""),
    _m("reward_model.model.path", "reward.reward_model.path", "", _expand),
    _m("reward_model.micro_batch_size_per_gpu", "reward.reward_model.micro_batch_size_per_gpu", ""),
    _m("reward_model.enable_resource_pool", "reward.reward_model.placement", "true -> separate, false -> "
       "colocated", _placement),
    _m("reward_model.n_gpus_per_node", "reward.reward_model.num_devices", "x reward_model.nnodes: the devices "
       "of its own pool", _rm_devices),
    _u("reward_model.nnodes", "not-needed", "folded into reward.reward_model.num_devices"),
    _u("reward_model.micro_batch_size", "deprecated-in-verl", "set micro_batch_size_per_gpu"),
    _u("reward_model.strategy", "not-needed", "megatron only"),
    _u("reward_model.model.input_tokenizer", "not-needed", "the reward model reads the policy's tokens"),
    _u("reward_model.model.external_lib", "unsupported", "rlplan imports no model code"),
    _u("reward_model.model.trust_remote_code", "unsupported", "rlplan runs no code from model folders"),
    _u("reward_model.max_length", "not-needed", "prompt + response lengths bound it"),
    _u("reward_model.use_dynamic_bsz", "unsupported", "reward passes use fixed micro-batches"),
    _u("reward_model.forward_max_token_len_per_gpu", "unsupported", "reward passes use fixed micro-batches"),
    _u("reward_model.reward_manager", "not-needed", "reward.function scores every response; DAPO's overlong "
       "penalty is reward.overlong_buffer"),
    _m("reward_model.overlong_buffer.enable", "reward.overlong_buffer.enable", "DAPO overlong reward shaping "
       "(the dapo reward manager)"),
    _m("reward_model.overlong_buffer.len", "reward.overlong_buffer.len", ""),
    _m("reward_model.overlong_buffer.penalty_factor", "reward.overlong_buffer.penalty_factor", ""),
    _u("reward_model.overlong_buffer.log", "not-needed", "reward/overlong_penalty_mean is always logged"),
    _m("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "reward.overlong_buffer.enable",
       "newer verl's place for the DAPO overlong buffer"),
    _m("reward_model.reward_kwargs.overlong_buffer_cfg.len", "reward.overlong_buffer.len", ""),
    _m("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "reward.overlong_buffer.penalty_factor",
       ""),
    _u("reward_model.reward_kwargs.overlong_buffer_cfg.log", "not-needed",
       "reward/overlong_penalty_mean is always logged"),
    _u("reward_model.reward_kwargs.max_resp_len", "not-needed", "the buffer ends at rollout.max_response_length"),
    _u("reward_model.launch_reward_fn_async", "not-needed", "rule rewards are cheap and run in the controller"),
    _u("reward_model.sandbox_fusion.*", "unsupported", "no code-execution sandbox"),
    _u("reward_model.nccl_timeout", "not-needed", "rlplan uses torch's default timeout"),
    _u("reward_model.load_weight", "not-needed", "weights come from reward.reward_model.path"),
    _u("custom_reward_function.path", "unsupported", "rlplan imports reward.function as `package.module:"
       "function` with the signature (response, ground_truth, prompt) -> float; wrap verl's compute_score "
       "(see below)"),
    _u("custom_reward_function.name", "unsupported", "part of reward.function (`module:function`)"),
    _u("custom_reward_function.reward_kwargs.*", "unsupported", "bind them in the wrapper function"),
    # ------------------------------------------------------------------------------------- algorithm
    _m("algorithm.adv_estimator", "algorithm.adv_estimator", "rlplan has gae, grpo, rloo, reinforce_plus_plus; "
       "verl's default is gae (rlplan's: grpo)", verl_default="gae"),
    _m("algorithm.gamma", "algorithm.gamma", ""),
    _m("algorithm.lam", "algorithm.lam", ""),
    _m("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo", ""),
    _m("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward", ""),
    _m("algorithm.kl_penalty", "algorithm.kl_penalty", "k1 -> kl, k2 -> mse, k3 -> low_var_kl", _kl_type),
    _m("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.type", ""),
    _m("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.kl_coef", ""),
    _m("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.target_kl", ""),
    _m("algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.horizon", ""),
    _u("algorithm.use_pf_ppo", "unsupported", "no preference-feedback PPO reweighting"),
    _u("algorithm.pf_ppo.*", "unsupported", "no preference-feedback PPO reweighting"),
    _m("algorithm.filter_groups.enable", "algorithm.filter_groups.enable", "DAPO dynamic sampling"),
    _m("algorithm.filter_groups.metric", "algorithm.filter_groups.metric", "acc / score -> score (the reward "
       "function's value), seq_reward -> seq_reward", _filter_metric),
    _m("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches",
       "0 = unbounded, as in verl"),
    _m("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is",
       "the embedded rollout samples with the actor's own weights, so the weights stay near 1"),
    _m("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction.rollout_is_threshold",
       ""),
    _m("algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs", "token / sequence "
       "(rejected tokens get weight 0)"),
    _m("algorithm.rollout_correction.rollout_rs_threshold", "algorithm.rollout_correction.rollout_rs_threshold",
       "the lower bound is its inverse"),
    _m("algorithm.rollout_correction.bypass_mode", "algorithm.rollout_correction.bypass_mode", ""),
    _u("algorithm.rollout_correction.*", "unsupported", "rlplan has rollout_is, rollout_is_threshold, "
       "rollout_rs, rollout_rs_threshold and bypass_mode"),
    _m("algorithm.rollout_is", "algorithm.rollout_correction.rollout_is", "older verl name"),
    _m("algorithm.rollout_is_threshold", "algorithm.rollout_correction.rollout_is_threshold", "older verl name"),
    # --------------------------------------------------------------------------------------- trainer
    _m("trainer.total_training_steps", "trainer.total_steps", "steps count from 1 across resumes"),
    _m("trainer.total_epochs", "trainer.total_epochs", "the plan counts steps = epochs x (rows of "
       "data.train_files // data.train_batch_size); kept out when trainer.total_training_steps is set (verl "
       "then runs that many steps)", _total_epochs),
    _m("trainer.nnodes", "cluster.nnodes", ""),
    _m("trainer.n_gpus_per_node", "cluster.gpus_per_node", "verl's default is 8 (rlplan's: 1)", verl_default=8),
    _m("trainer.device", "cluster.device", "verl's default is cuda (rlplan's: cpu)", verl_default="cuda"),
    _m("trainer.project_name", "trainer.project_name", ""),
    _m("trainer.experiment_name", "trainer.experiment_name", ""),
    _m("trainer.logger", "logging.backends", "jsonl is added: rlplan writes metrics.jsonl for its plots",
       _logger),
    _m("trainer.save_freq", "trainer.save_freq", "-1 (off in verl) -> 0; rlplan also saves at the last step",
       _negative_to_zero),
    _m("trainer.test_freq", "trainer.test_freq", "-1 (off in verl) -> 0", _negative_to_zero),
    _m("trainer.val_before_train", "trainer.val_before_train", "verl's default is true (rlplan's: false)",
       verl_default=True),
    _m("trainer.resume_mode", "trainer.resume_mode", "same modes"),
    _m("trainer.resume_from_path", "trainer.resume_from_path", "an rlplan checkpoints/global_step_N folder",
       _expand),
    _m("trainer.default_local_dir", "trainer.output_dir", "checkpoints go to output_dir/checkpoints", _expand),
    _m("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep", "one limit for the whole checkpoint"),
    _m("trainer.max_critic_ckpt_to_keep", "trainer.max_ckpt_to_keep", "one limit for the whole checkpoint"),
    _m("trainer.critic_warmup", "trainer.critic_warmup", ""),
    _m("trainer.seed", "trainer.seed", ""),
    _m("trainer.profile_steps", "profile.steps", "older verl name of global_profiler.steps"),
    _u("trainer.balance_batch", "not-needed", "rlplan balances micro-batches by token count itself"),
    _u("trainer.log_val_generations", "unsupported", "validation logs scores, not generations"),
    _u("trainer.esi_redundant_time", "unsupported", "no elastic-instance save deadline"),
    _u("trainer.del_local_ckpt_after_load", "unsupported", "checkpoints are kept by trainer.max_ckpt_to_keep"),
    _u("trainer.default_hdfs_dir", "unsupported", "local or mounted folders only"),
    _u("trainer.ray_wait_register_center_timeout", "not-needed", "no register center"),
    _u("trainer.rollout_data_dir", "unsupported", "rollouts are not dumped"),
    _u("trainer.validation_data_dir", "unsupported", "validation generations are not dumped"),
    _u("trainer.val_only", "unsupported", "no validation-only mode"),
    _u("trainer.use_legacy_worker_impl", "not-needed", "one worker implementation"),
    _u("trainer.max_ref_ckpt_to_keep", "not-needed", "the ref is never saved"),
    _u("trainer.profile_continuous_steps", "deprecated-in-verl", "use global_profiler.profile_continuous_steps"),
    _u("trainer.controller_nsight_options.*", "deprecated-in-verl", "use global_profiler.global_tool_config"),
    _u("trainer.worker_nsight_options.*", "deprecated-in-verl", "use global_profiler.global_tool_config"),
    # -------------------------------------------------------------------------------------- profiler
    _m("global_profiler.tool", "profile.tool", "null -> none", _profile_tool),
    _m("global_profiler.steps", "profile.steps", "steps count from 1, as in verl"),
    _m("global_profiler.save_path", "profile.save_path", "a relative path is under trainer.output_dir"),
    _m("global_profiler.global_tool_config.nsys.discrete", "profile.discrete",
       "true: one profile per role call; false: one per step"),
    _u("global_profiler.profile_continuous_steps", "unsupported", "each listed step is profiled on its own"),
    _u("global_profiler.global_tool_config.nsys.controller_nsight_options.*", "not-needed",
       "rlplan starts nsys itself; traced APIs are profile.nsys.trace"),
    _u("global_profiler.global_tool_config.nsys.worker_nsight_options.*", "not-needed",
       "rlplan starts nsys itself; traced APIs are profile.nsys.trace"),
    _u("global_profiler.global_tool_config.torch_memory.*", "unsupported", "no memory-snapshot profiler"),
    _u("global_profiler.global_tool_config.torch.*", "not-needed", "options are under profile.torch"),
    _u("global_profiler.global_tool_config.npu.*", "not-needed", "options are under profile.npu"),
    # ----------------------------------------------------------------------------------------- other
    _u("ray_init.*", "not-needed", "Ray's resources are sized from the plan; cluster.ray_address joins a cluster"),
    _u("ray_kwargs.*", "not-needed", "Ray's resources are sized from the plan; cluster.ray_address joins a "
       "cluster"),
    _u("transfer_queue.*", "unsupported", "no transfer queue"),
    _u("hydra.*", "not-needed", "Hydra's own settings"),
    *_megatron_rows(),
    *_optim_rows(),
    *_checkpoint_rows(),
    *_profiler_rows(),
)  # fmt: skip

_INDEX: dict[str, int] = {row.verl: i for i, row in enumerate(VERL_KEYS)}
_PATTERNS: tuple[tuple[str, int], ...] = tuple(
    sorted(((r.verl[:-2], i) for i, r in enumerate(VERL_KEYS) if r.verl.endswith(".*")),
           key=lambda p: -len(p[0]))
)  # fmt: skip
_TARGET_ROW = _u("_target_", "not-needed", "Hydra's instantiation target (verl internals)")


def find_row(key: str) -> tuple[int, VerlKey] | None:
    """The table row of a verl key (exact, else the longest `prefix.*` covering it), with its position."""
    if key in _INDEX:
        return _INDEX[key], VERL_KEYS[_INDEX[key]]
    if key.rsplit(".", 1)[-1] == "_target_":
        return -1, _TARGET_ROW
    for prefix, i in _PATTERNS:
        if key.startswith(prefix + "."):
            return i, VERL_KEYS[i]
    return None


def _did_you_mean(key: str) -> str:
    names = [r.verl for r in VERL_KEYS]
    close = difflib.get_close_matches(key, names, n=2, cutoff=0.75)
    if not close:
        last = key.rsplit(".", 1)[-1]
        close = [n for n in names if n.rsplit(".", 1)[-1] == last][:3]
    return ("did you mean " + " or ".join(f"`{c}`" for c in close) + "?") if close else ""


# --------------------------------------------------------------------------------------- Hydra input
@dataclass(frozen=True)
class Override:
    """One Hydra command-line override: `key=value` (set), `+key=value` (add), `++key=value` (force),
    `~key` (delete)."""

    op: Literal["set", "add", "force", "delete"]
    key: str
    value: Any
    text: str


_HYDRA_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_0-9][\w-]*)*$")
_YAML_ONLY_BOOLS = {"yes", "no", "on", "off", "y", "n"}


def parse_value(text: str) -> Any:
    """A Hydra override value: quoted -> string; otherwise YAML (lists, null, true, 1e-6 -> float)."""
    from rlconf.load import parse_yaml

    stripped = text.strip()
    if stripped == "":
        return ""
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    if stripped.lower() in _YAML_ONLY_BOOLS:
        return stripped
    try:
        value = parse_yaml(stripped, "override")
    except ConfigError:
        return stripped
    if isinstance(value, dict) and not stripped.startswith("{"):
        return stripped  # `a: b` is a string in Hydra
    return value


def parse_override(text: str) -> Override:
    """Parse one Hydra override; raises ConfigError naming the override when it cannot be read."""
    body, op = text.strip(), "set"
    if body.startswith("~"):
        op, body = "delete", body[1:]
    elif body.startswith("++"):
        op, body = "force", body[2:]
    elif body.startswith("+"):
        op, body = "add", body[1:]
    key, sep, raw = body.partition("=")
    key = key.strip()
    if not _HYDRA_KEY.match(key) or (op != "delete" and not sep):
        raise ConfigError(
            [error(key or text, f"cannot read the verl override {text!r}",
                   "write key=value, +key=value, ++key=value or ~key (dotted verl keys)", "override-syntax")],
            "overrides",
        )  # fmt: skip
    return Override(op, key, parse_value(raw) if sep else None, text)  # type: ignore[arg-type]


def flatten_verl(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of every leaf of a nested verl config (lists are leaves; empty sections set nothing)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_verl(value, path + "."))
        else:
            out[path] = value
    return out


def _interpolations(text: str) -> list[tuple[int, int, str]]:
    """(start, end, expression) of every top-level `${...}` in a string (braces inside may nest)."""
    found, i = [], text.find("${")
    while i >= 0:
        depth, j = 0, i + 1
        while j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        if depth:
            break  # unbalanced: not an interpolation
        found.append((i, j + 1, text[i + 2 : j]))
        i = text.find("${", j + 1)
    return found


class _Unresolved(Exception):
    pass


def _subtree(values: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    sub = {k[len(path) + 1 :]: v for k, v in values.items() if k.startswith(path + ".")}
    return sub or None


def _lookup(expr: str, key: str, values: Mapping[str, Any]) -> Any:
    """The value of one interpolation `${expr}` written at `key`."""
    default: Any = _NO_DEFAULT
    if expr.startswith("oc.select:"):
        path, comma, dflt = expr.removeprefix("oc.select:").partition(",")
        default = parse_value(dflt) if comma else None
        expr = path.strip()
    elif ":" in expr:
        raise _Unresolved(f"resolver `{expr.split(':', 1)[0]}` is not evaluated")
    if expr.startswith("."):
        dots = len(expr) - len(expr.lstrip("."))
        parent = key.split(".")[:-dots]
        expr = ".".join([*parent, expr.lstrip(".")])
    if expr in values:
        return values[expr]
    sub = _subtree(values, expr)
    if sub is not None:
        return sub
    if default is not _NO_DEFAULT:
        return default
    raise _Unresolved(f"`{expr}` is not set")


def resolve_interpolations(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Resolve `${key}`, `${.sibling}` and `${oc.select:key,default}` against the other keys.

    Returns the resolved keys and, for keys that could not be resolved, the reason (those keys are
    removed from the result). A reference to a section copies its keys.
    """
    out = dict(values)
    failed: dict[str, str] = {}
    for _ in range(10):  # chains of references resolve in a few rounds
        changed = False
        for key in list(out):
            value = out[key]
            if not isinstance(value, str) or "${" not in value:
                continue
            spans = _interpolations(value.strip())
            if not spans:
                continue
            try:
                if len(spans) == 1 and spans[0][:2] == (0, len(value.strip())):
                    new = _lookup(spans[0][2], key, out)
                else:
                    new, last = "", 0
                    for start, end, expr in _interpolations(value):
                        new += value[last:start] + str(_lookup(expr, key, out))
                        last = end
                    new += value[last:]
            except _Unresolved as exc:
                failed[key] = str(exc)
                del out[key]
                changed = True
                continue
            if isinstance(new, dict):
                del out[key]
                out.update({f"{key}.{k}": v for k, v in flatten_verl(new).items()})
            else:
                out[key] = new
            changed = True
        if not changed:
            break
    for key in [k for k, v in out.items() if isinstance(v, str) and _interpolations(v)]:
        failed[key] = "a reference cycle"
        del out[key]
    return out, failed


# ---------------------------------------------------------------------------------------- translation
@dataclass(frozen=True)
class Mapped:
    """A verl key that set an rlplan field (`value` is None when the row asked for nothing to be set)."""

    verl: str
    verl_value: Any
    rlplan: str
    value: Any
    note: str
    applied: bool = True


@dataclass(frozen=True)
class Unmapped:
    """A verl key with no rlplan setting: why (`reason`, see REASONS) and what to do (`note`)."""

    verl: str
    verl_value: Any
    reason: str
    note: str


@dataclass(frozen=True)
class Derived:
    """An rlplan setting the input did not spell out: a verl default or a consequence of rlplan's design."""

    rlplan: str
    value: Any
    note: str


@dataclass(frozen=True)
class Translation(IssueSet):
    """The result of importing a verl config: settings, what mapped and what did not, and our verdict."""

    settings: dict[str, Any]
    mapped: tuple[Mapped, ...]
    unmapped: tuple[Unmapped, ...]
    derived: tuple[Derived, ...]
    notes: tuple[str, ...]
    issues: tuple[Issue, ...]
    origin: dict[str, str]
    config: RLConfig
    plan_checked: bool = False
    sources: tuple[str, ...] = field(default=())

    @property
    def valid(self) -> bool:
        return not self.errors


def _rlplan_type(path: str) -> Any:
    cls: Any = RLConfig
    for part in path.split("."):
        cls = field_types(cls)[part]
    return cls


def _rlplan_default(path: str) -> Any:
    from rlconf.fields import get_path

    return get_path(RLConfig(), path)


def _current(settings: Mapping[str, Any], path: str, default: Any = _NO_DEFAULT) -> Any:
    """The value an rlplan path gets: the imported setting, else `default`, else rlplan's own default."""
    if path in settings:
        return settings[path]
    return _rlplan_default(path) if default is _NO_DEFAULT else default


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _nest(settings: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in settings.items():
        node = out
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def gather_input(
    data: Mapping[str, Any] | None, overrides: Sequence[str]
) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """Flat verl keys from a (nested) config and Hydra overrides, interpolations resolved.

    Returns the keys, notes for the report, and the keys whose interpolation could not be resolved.
    """
    notes: list[str] = []
    flat: dict[str, Any] = {}
    if data is not None:
        data = dict(data)
        defaults = data.pop("defaults", None)  # a Hydra input dict, not an rlplan config
        if defaults is not None and defaults != ["_self_"]:
            notes.append(
                f"the file's `defaults` list ({defaults!r}) is not resolved: only the keys written in the file "
                "are read. Pass a resolved config (`python -m verl.trainer.main_ppo --cfg job --resolve ...` "
                "prints one) or the override list of your run script."
            )
        flat = flatten_verl(data)
    parsed = [parse_override(text) for text in overrides]
    for ov in parsed:
        under = [k for k in flat if k == ov.key or k.startswith(ov.key + ".")]
        if ov.op == "delete":
            if not under:
                notes.append(f"`{ov.text}` deletes a key that is not set")
            for k in under:
                del flat[k]
            continue
        for k in under:
            del flat[k]
        if isinstance(ov.value, Mapping) and ov.value:
            flat.update({f"{ov.key}.{k}": v for k, v in flatten_verl(ov.value).items()})
        elif not (isinstance(ov.value, Mapping) and not ov.value):
            flat[ov.key] = ov.value
    missing = [k for k, v in flat.items() if v == "???"]
    for k in missing:
        notes.append(f"`{k}` is ??? (mandatory, unset) in the input: not translated")
        del flat[k]
    resolved, failed = resolve_interpolations(flat)
    return resolved, notes, failed


def _convert(row: VerlKey, value: Any, ctx: Mapping[str, Any]) -> Any:
    assert row.rlplan is not None
    new = row.convert(value, ctx) if row.convert is not None else value
    if new is None:
        _, optional = strip_optional(_rlplan_type(row.rlplan))
        if not optional:
            return SKIP
    return new


def translate(
    data: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    *,
    sources: Sequence[str] = (),
    check_plan: bool = True,
) -> Translation:
    """Translate a verl config (nested dict) and Hydra overrides into rlplan settings, then validate them.

    Raises ConfigError only for input that cannot be read (an override that is not `key=value`);
    everything else (unknown keys, untranslatable values, rule violations) is in the Translation.
    """
    values, notes, failed = gather_input(data, overrides)
    mapped: list[Mapped] = []
    unmapped: list[Unmapped] = []
    derived: list[Derived] = []
    issues: list[Issue] = []
    settings: dict[str, Any] = {}
    origin: dict[str, str] = {}

    for key, why in failed.items():
        unmapped.append(Unmapped(key, None, "unresolved", f"its interpolation cannot be resolved: {why}; give "
                                 "the value explicitly"))  # fmt: skip

    # Verl defaults stand in for keys the input leaves unset (also inside interpolations and converters).
    ctx: dict[str, Any] = {r.verl: r.verl_default for r in VERL_KEYS if r.has_default}
    ctx, _ = resolve_interpolations({**ctx, **values})

    def put(path: str, value: Any, source: str) -> None:
        if path in settings and settings[path] != value:
            notes.append(f"{origin[path]} and {source} both set {path}: {source} = {_show(value)} is used")
        settings[path] = value
        origin[path] = source

    located = [(find_row(k), k) for k in values]
    order = sorted(range(len(located)), key=lambda i: (located[i][0] is None, (located[i][0] or (0,))[0], i))
    for i in order:
        found, key = located[i]
        value = values[key]
        if found is None:
            unmapped.append(Unmapped(key, value, "unknown", _did_you_mean(key) or "not a key of verl's "
                                     "ppo_megatron_trainer config known to rlplan"))  # fmt: skip
            continue
        _, row = found
        if row.rlplan is None:
            unmapped.append(Unmapped(key, value, row.reason or "unsupported", row.note))
            continue
        try:
            new = _convert(row, value, ctx)
        except VerlValueError as exc:
            issues.append(error(row.rlplan, f"{key} = {_show(value)}: {exc}", exc.fix, "verl-import"))
            origin.setdefault(row.rlplan, key)
            continue
        if new is SKIP:
            mapped.append(Mapped(key, value, row.rlplan, _plain(_rlplan_default(row.rlplan)),
                                 row.note or "null in verl: rlplan's default is kept", applied=False))  # fmt: skip
            continue
        mapped.append(Mapped(key, value, row.rlplan, new, row.note))
        put(row.rlplan, new, key)

    def derive(path: str, value: Any, note: str) -> None:
        settings[path] = value
        origin[path] = f"derived: {note}"
        derived.append(Derived(path, value, note))

    # verl's defaults where they differ from rlplan's (the critic's only when the run has one).
    estimator = _current(settings, "algorithm.adv_estimator", ctx["algorithm.adv_estimator"])
    with_critic = _current(settings, "critic.enable", estimator == "gae") is True
    for row in VERL_KEYS:
        if row.rlplan is not None and row.rlplan.startswith("critic.") and not with_critic:
            continue
        if not row.has_default or row.rlplan is None or row.verl in values or row.rlplan in settings:
            continue
        if row.verl not in ctx:  # an interpolated default whose source is unset: rlplan's default holds
            continue
        new = _convert(row, ctx[row.verl], ctx)
        if new is not SKIP and new != _rlplan_default(row.rlplan):
            derive(row.rlplan, new, f"verl's default {row.verl} = {_show(ctx[row.verl])}")
    _derive_rlplan_rules(values, settings, derive)
    if "reward.function" not in settings and ("data.train_files" in settings):
        notes.append(
            "verl scores each row by its data_source (gsm8k, math, ...); rlplan scores with reward.function "
            "(default digit_match): set reward.function, e.g. numeric_match for GSM8K-style answers"
        )

    position = {key: i for i, key in enumerate(values)}
    mapped.sort(key=lambda m: position[m.verl])
    unmapped.sort(key=lambda u: position.get(u.verl, -1))
    config, verdict = _check(settings, check_plan)
    issues += verdict
    return Translation(
        settings=settings, mapped=tuple(mapped), unmapped=tuple(unmapped), derived=tuple(derived),
        notes=tuple(notes), issues=tuple(issues), origin=origin, config=config,
        plan_checked=check_plan and not any(i.severity == "error" for i in issues), sources=tuple(sources),
    )  # fmt: skip


def _derive_rlplan_rules(
    values: Mapping[str, Any], settings: dict[str, Any], derive: Callable[[str, Any, str], None]
) -> None:
    """Settings rlplan's design needs where verl's structure differs (each one listed in the report)."""
    estimator = _current(settings, "algorithm.adv_estimator")
    if "critic.enable" not in settings and estimator == "gae":
        derive("critic.enable", True, "verl enables the critic for adv_estimator gae (critic.enable: null)")
    for name in LAYOUT_FIELDS:
        actor_path, ref_path = f"actor.megatron.{name}", f"ref.megatron.{name}"
        if actor_path in settings and ref_path not in settings:
            derive(ref_path, settings[actor_path], _IN_ACTOR)
    for verl_prefix, ours in _MEGATRON_ROLES:
        tp_key = f"{ours}.tensor_model_parallel_size"
        tp = _current(settings, tp_key)
        if f"{verl_prefix}.sequence_parallel" not in values and isinstance(tp, int) and tp > 1:
            derive(f"{ours}.sequence_parallel", True, "verl's default sequence_parallel = true (tp > 1)")
    if ("data.train_files" in settings or "data.val_files" in settings) and "data.answer_key" not in settings:
        derive("data.answer_key", "reward_model.ground_truth", "verl's parquet files keep the ground truth in "
               "the reward_model column")  # fmt: skip


def _check(settings: Mapping[str, Any], check_plan: bool) -> tuple[RLConfig, list[Issue]]:
    from rlconf.load import build_config
    from rlconf.validate import check_config

    config, structural = build_config(_nest(settings))
    issues = list(structural) + list(check_config(config))
    if check_plan and not any(i.severity == "error" for i in issues):
        from rlconf.plan import compile_plan

        planned = config
        missing = [f for f in config.data.train_files if not os.path.isfile(f)]
        if config.trainer.total_epochs is not None and missing:
            # The prompt files live where the run starts (a verl script's /data/...): plan the rest and say so.
            planned = dataclasses.replace(
                config, trainer=dataclasses.replace(config.trainer, total_epochs=None)
            )
            issues.append(warning(
                "trainer.total_epochs", f"{missing[0]} is not on this machine, so the steps of "
                f"{config.trainer.total_epochs} epochs are not counted here (the plan checked uses "
                f"trainer.total_steps = {config.trainer.total_steps})",
                "run `rlconf plan` where data.train_files are: it counts them and shows the steps", "total-epochs"))  # fmt: skip
        try:
            compile_plan(planned)
        except ConfigError as exc:
            issues += exc.issues
    return config, issues


# --------------------------------------------------------------------------------------------- report
# What each rlplan rule means for a verl user: where verl would have failed (late), or that the rule is
# rlplan's own (verl runs the setting, rlplan does not).
_LATE_IN_VERL = {
    "batch-layout": "verl's workers assert this when they split the batch, after Ray has started and the "
    "model has loaded",
    "world-divisible-by-model-parallel": "megatron fails when every worker initialises its process groups",
    "heads-divisible-by-tp": "megatron fails while building the model on every worker",
    "layers-divisible-by-pp": "megatron fails while building the model on every worker",
    "model-config-json": "verl's workers fail when they load the model",
    "memory-exceeds-device": "the run goes out of device memory",
    "estimator-needs": "verl runs it, but the estimator cannot learn as configured (e.g. GRPO with n = 1 "
    "gives every response a zero advantage)",
    "positive-size": "verl fails or divides by zero once the workers run",
    "optim": "megatron's scheduler fails or trains with a broken schedule",
    "sampling": "the rollout engine rejects it at the first generation",
    "checkpoint-contents": "the first resume fails",
}
for _sub, _parent in (
    ("mini-batch-divides-batch", "batch-layout"),
    ("batch-divisible-by-dp-micro", "batch-layout"),
    ("mini-batch-covers-micro", "batch-layout"),
    ("token-budget-fits-sequence", "batch-layout"),
):
    _LATE_IN_VERL[_sub] = _LATE_IN_VERL[_parent]  # fmt: skip
RLPLAN_ONLY_RULES: dict[str, str] = {
    "rollout-engine": "rlplan regroups tensor-parallel shards (rollout tp divides or is a multiple of the actor's) "
    "and runs vLLM only where it is installed",
    "ref-layout-matches-actor": _IN_ACTOR,
    "engine-support": "rlplan's megatron engine does not run this layout yet",
    "verl-import": "the verl value has no rlplan translation",
    "unknown-key": "the value does not fit rlplan's field",
    "type": "the value does not fit rlplan's field",
    "invalid-choice": "rlplan does not offer this value",
}


def verl_context(rule: str) -> tuple[str, str]:
    """('late-in-verl' | 'rlplan-rule' | 'checked-early', explanation) of an rlplan rule for a verl user."""
    if rule in _LATE_IN_VERL:
        return "late-in-verl", _LATE_IN_VERL[rule]
    if rule in RLPLAN_ONLY_RULES:
        return "rlplan-rule", RLPLAN_ONLY_RULES[rule]
    return "checked-early", "rlplan checks it before anything starts"


def issue_origin(tr: Translation, issue: Issue) -> str:
    """The verl key (or derivation) that set the config path an issue names; '' for rlplan defaults."""
    path = issue.path.split("[")[0]
    return tr.origin.get(path, "")


def _show(value: Any) -> str:
    from rlconf.render import _scalar

    return _scalar(_plain(value))


def format_report(tr: Translation) -> str:
    """The text report of `rlconf import-verl`."""
    applied = [m for m in tr.mapped if m.applied]
    out = [
        f"rlconf import-verl: {len(tr.mapped) + len(tr.unmapped)} verl keys: {len(applied)} mapped, "
        f"{len(tr.mapped) - len(applied)} kept rlplan's default, {len(tr.unmapped)} not mapped",
        "",
        "mapped (verl = value -> rlplan = value)",
    ]
    for m in tr.mapped:
        target = (
            f"{m.rlplan} = {_show(m.value)}" if m.applied else f"{m.rlplan} (default {_show(m.value)} kept)"
        )
        out.append(f"  {m.verl} = {_show(m.verl_value)} -> {target}")
        if m.note and (_show(m.verl_value) != _show(m.value) or not m.applied):
            out.append(f"      {m.note}")
    if tr.derived:
        out += ["", "derived (verl defaults that differ from rlplan's, and what rlplan's design needs)"]
        out += [f"  {d.rlplan} = {_show(d.value)}: {d.note}" for d in tr.derived]
    out += ["", f"not mapped ({len(tr.unmapped)})"]
    if not tr.unmapped:
        out.append("  (none)")
    for reason in (
        "unknown",
        "unresolved",
        "unsupported",
        "ignored-by-verl",
        "deprecated-in-verl",
        "not-needed",
    ):
        group = [u for u in tr.unmapped if u.reason == reason]
        if group:
            out.append(f"  {reason} ({REASONS[reason]}):")
            out += [f"    {u.verl} = {_show(u.verl_value)}: {u.note}" for u in group]
    if tr.notes:
        out += ["", "notes"] + [f"  {n}" for n in tr.notes]
    out.append("")
    n_err, n_warn = len(tr.errors), len(tr.warnings)
    checked = "rlplan's rules" + (" and plan" if tr.plan_checked else "")
    if not tr.issues:
        out.append(f"validation: ok ({checked})")
    else:
        verdict = "invalid" if n_err else "ok"
        out.append(f"validation: {verdict} ({checked}): {n_err} error(s), {n_warn} warning(s)")
    groups = (
        ("late-in-verl", "fail now, would have failed late (or silently) in verl"),
        ("checked-early", "checked before anything starts"),
        ("rlplan-rule", "rlplan's own rules (verl runs this; rlplan does not)"),
    )
    for kind, title in groups:
        items = [i for i in tr.issues if verl_context(i.rule)[0] == kind]
        if not items:
            continue
        out.append(f"  {title}:")
        for issue in items:
            src = issue_origin(tr, issue)
            frm = f" (from {src})" if src and not src.startswith("derived") else (f" ({src})" if src else "")
            out.append(f"    {issue.severity} [{issue.rule}] {issue.path}{frm}: {issue.message}")
            out.append(f"        fix: {issue.fix}")
            out.append(f"        verl: {verl_context(issue.rule)[1]}")
    return "\n".join(out) + "\n"


def translation_to_dict(tr: Translation) -> dict[str, Any]:
    """The report as JSON-ready data (`rlconf import-verl --json`)."""

    def issue(i: Issue) -> dict[str, Any]:
        kind, why = verl_context(i.rule)
        return {
            **dataclasses.asdict(i),
            "verl_key": issue_origin(tr, i),
            "verl_context": kind,
            "in_verl": why,
        }

    return {
        "valid": tr.valid,
        "settings": {k: _plain(v) for k, v in tr.settings.items()},
        "mapped": [dataclasses.asdict(m) for m in tr.mapped],
        "unmapped": [dataclasses.asdict(u) for u in tr.unmapped],
        "derived": [dataclasses.asdict(d) for d in tr.derived],
        "notes": list(tr.notes),
        "issues": [issue(i) for i in tr.issues],
        "yaml": to_yaml(tr),
    }


def to_yaml(tr: Translation) -> str:
    """The rlplan config: every imported setting that differs from rlplan's default, each with the verl key
    it came from as a comment."""
    changed = {p: v for p, v in tr.settings.items() if _plain(v) != _plain(_rlplan_default(p))}
    order = {p: i for i, p in enumerate(leaf_paths(RLConfig))}
    ordered = dict(sorted(changed.items(), key=lambda kv: order[kv[0]] if kv[0] in order else len(order)))
    head = [
        "# rlplan config imported from verl by `rlconf import-verl`"
        + (f" ({', '.join(tr.sources)})" if tr.sources else ""),
        f"# {sum(m.applied for m in tr.mapped)} verl keys mapped, {len(tr.derived)} settings derived, "
        f"{len(tr.unmapped)} keys not mapped (see the report). Check it: rlconf validate / rlconf plan.",
    ]
    if not tr.valid:
        head.append(f"# INVALID: {len(tr.errors)} error(s) to fix (rlconf validate lists them).")
    lines: list[str] = []

    def walk(node: Mapping[str, Any], prefix: str, indent: int) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            pad = "  " * indent
            if isinstance(value, dict) and path not in ordered:
                lines.append(f"{pad}{key}:")
                walk(value, path + ".", indent + 1)
                continue
            src = tr.origin.get(path, "")
            comment = f"  # {src}" if src else ""
            lines.append(f"{pad}{key}: {_show(value)}{comment}")

    walk(_nest(ordered), "", 0)
    return "\n".join(head + lines) + "\n"


# ----------------------------------------------------------------------------------------------- docs
_FAMILY_TITLES = {
    "megatron": ("Megatron engine (per role)", "The same keys under each role's `megatron` section."),
    "optim": ("Optimizer (actor and critic)", "The same keys under `actor_rollout_ref.actor.optim` and "
              "`critic.optim`."),
    "checkpoint": ("Checkpoint contents (actor and critic)", ""),
    "profiler": ("Per-role profiler", "verl has a profiler section per role; rlplan has one `profile` "
                 "section with `profile.roles`. See [Profiling](profiling.md)."),
}  # fmt: skip
_SECTION_TITLES = (
    ("data.", "data"),
    ("actor_rollout_ref.model.", "actor_rollout_ref.model"),
    ("actor_rollout_ref.actor.", "actor_rollout_ref.actor"),
    ("actor_rollout_ref.ref.", "actor_rollout_ref.ref"),
    ("actor_rollout_ref.rollout.", "actor_rollout_ref.rollout"),
    ("actor_rollout_ref.", "actor_rollout_ref"),
    ("critic.", "critic"),
    ("reward_model.", "reward_model and custom_reward_function"),
    ("custom_reward_function.", "reward_model and custom_reward_function"),
    ("algorithm.", "algorithm"),
    ("trainer.", "trainer"),
    ("global_profiler.", "global_profiler"),
    ("", "Ray, Hydra and the rest"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _target_cell(row: VerlKey) -> str:
    if row.rlplan is not None:
        return f"`{row.rlplan}`"
    return f"— ({row.reason})"


def _default_cell(row: VerlKey) -> str:
    """What the docs say about a row's verl default (appended to its note)."""
    if not row.has_default:
        return ""
    if "verl's default" in row.note:
        return "; applied when unset"
    return f"{'; ' if row.note else ''}verl's default `{_show(row.verl_default)}` applied when unset"


def migration_page() -> str:
    """docs/migrating-from-verl.md, generated from VERL_KEYS (written by `rlconf docs`)."""
    from rlconf.docs import HEADER

    out = [HEADER.replace("rlconf docs`", "rlconf docs` from `rlconf/verl.py`"), _PAGE_INTRO]
    sections: dict[str, list[VerlKey]] = {}
    for row in VERL_KEYS:
        if row.family:
            continue
        title = next(t for prefix, t in _SECTION_TITLES if row.verl.startswith(prefix))
        sections.setdefault(title, []).append(row)
    out.append("## Key by key\n\n")
    out.append(
        "Every verl key `rlconf import-verl` knows, generated from its table (`rlconf/verl.py`). "
        '"—" marks a key with no rlplan setting; the reason is one of: '
        + "; ".join(f"**{k}**: {v}" for k, v in REASONS.items() if k not in ("unknown", "unresolved"))
        + ". A key that ends in `.*` covers every key under it. Keys that are not listed are reported as "
        "unknown.\n\n"
    )
    for title, rows in sections.items():
        out.append(f"### {title}\n\n| verl | rlplan | note |\n|---|---|---|\n")
        for row in rows:
            note = _cell(row.note + _default_cell(row))
            out.append(f"| `{row.verl}` | {_target_cell(row)} | {note} |\n")
        out.append("\n")
    for family, (title, intro) in _FAMILY_TITLES.items():
        rows = [r for r in VERL_KEYS if r.family == family]
        roles: list[str] = []
        table: dict[str, dict[str, VerlKey]] = {}
        for r in rows:
            role, _, suffix = r.verl.partition(f".{family}.")
            if role not in roles:
                roles.append(role)
            table.setdefault(suffix, {})[role] = r
        out.append(f"### {title}\n\n" + (f"{intro}\n\n" if intro else ""))
        out.append(f"| key | {' | '.join(f'`{r}.{family}.`' for r in roles)} | note |\n")
        out.append("|---" * (len(roles) + 2) + "|\n")
        for suffix, by_role in table.items():
            cells = [_target_cell(by_role[r]) if r in by_role else "" for r in roles]
            by_note: dict[str, list[str]] = {}
            for role, r in by_role.items():
                if r.note or r.has_default:
                    by_note.setdefault(r.note + _default_cell(r), []).append(role.rsplit(".", 1)[-1])
            notes = [
                text if len(who) == len(by_role) else f"{', '.join(who)}: {text}"
                for text, who in by_note.items()
            ]
            out.append(f"| `{suffix}` | {' | '.join(cells)} | {_cell(' / '.join(notes))} |\n")
        out.append("\n")
    out.append(_PAGE_DIFFERENCES)
    return "".join(out)


_PAGE_INTRO = """\
# Migrating from verl

rlplan follows verl's and Megatron's field names wherever the concept is the same, so most keys move over
by dropping the `actor_rollout_ref.` prefix. `rlconf import-verl` does the translation for you: it reads a
verl trainer config (the `ppo_megatron_trainer.yaml` layout) and/or the Hydra overrides of a run script,
maps every key it knows, lists every key it cannot map with the reason, and validates the result with
rlplan's rules and plan, so that settings which would fail late in verl (after Ray has started and the
model has loaded) fail now.

```text
$ rlconf import-verl \\
    algorithm.adv_estimator=grpo data.train_batch_size=32 data.max_prompt_length=1024 \\
    data.max_response_length=1024 actor_rollout_ref.model.path=/models/Qwen2.5-7B-Instruct \\
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=8 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \\
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 \\
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 \\
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=5 \\
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=15 -o rlplan.yaml
$ rlconf plan rlplan.yaml
```

The report has four parts: **mapped** keys (verl key and value -> rlplan path and value, with a note where
the meaning differs), **derived** settings (verl defaults that differ from rlplan's, such as
`trainer.device: cuda`, and what rlplan's design needs, such as the reference policy in the actor's
layout), keys **not mapped** with the reason (unknown keys get a did-you-mean), and the **validation**
result: each error names the rlplan path, the verl key it came from, the fix, and what verl would have
done. The exit code is 0 when the translation validates and 2 when it does not (the file is still
written, marked invalid, so you can fix it); `--json` prints the report as JSON.

Input: a file may hold a resolved config (`python -m verl.trainer.main_ppo --cfg job --resolve ...`
prints one) or a partial one; a `defaults:` list is not resolved (the report says so). Interpolations
`${key}`, `${.sibling}` and `${oc.select:key,default}` are resolved against the other keys. Overrides use
Hydra's syntax: `key=value` and `+key=value` set, `++key=value` forces, `~key` deletes; values are YAML
(`[console,wandb]`, `null`, `1e-6`), quotes keep a string.

Once moved, rlplan's own override syntax is `--actor.optim.lr 1e-6` on `rltrain`, `--set
actor.optim.lr=1e-6` on `rlconf`, or the same nesting in a YAML file. A key rlplan does not have is an
error (`unknown-key`) with a suggestion, never silently ignored.

"""

_PAGE_DIFFERENCES = """\
## Differences that change numbers

- **Batch sizes count like verl.** `data.train_batch_size` and `ppo_mini_batch_size` count prompts, and
  `ppo_micro_batch_size_per_gpu` counts responses on one data-parallel rank. One mini-batch is
  `ppo_mini_batch_size x rollout.n` responses, split over dp ranks. verl normalises these numbers
  internally. rlplan checks them and shows them: a batch that does not divide evenly is an error
  (`mini-batch-divides-batch`, `batch-divisible-by-dp-micro`, `mini-batch-covers-micro`), and
  `rlconf plan` prints the per-rank numbers.
- **The rollout runs on the actor's weights.** `rollout.engine: embedded` generates with the actor's
  megatron weights: in the actor's layout when `rollout.tensor_model_parallel_size` is unset (no copy),
  otherwise at that tp without pipeline parallel, resharded from the actor's layout before each
  generation (see [GPUs](gpus.md#gpu-presets)); verl's vllm / sglang settings translate to it.
- **The reference policy** shares the actor's processes, so `ref.megatron` must match `actor.megatron`
  (verl gives the ref its own worker group and layout).
- **The lr schedule advances once per training step**, as in verl. It does not advance once per optimizer
  step. With warmup, step 1 trains at `lr_warmup_init` (0 by default). The plan's lr table shows every step.
- **Steps count from 1 across resumes.** `trainer.total_steps` is the whole run. `trainer.total_epochs`
  works as in verl: the plan derives the steps from the rows of `data.train_files` and shows them.
- **Reward functions** have the signature `(response: str, ground_truth: str, prompt: str) -> float`.
    verl's is `compute_score(data_source, solution_str, ground_truth, extra_info)`. Wrap an existing verl
    function in a small module:

    ```python
    # my_rewards.py (importable: on PYTHONPATH or installed)
    from my_verl_scores import compute_score


    def gsm8k(response: str, ground_truth: str, prompt: str) -> float:
        return float(compute_score("openai/gsm8k", response, ground_truth, None))
    ```

    ```yaml
    reward:
      function: my_rewards:gsm8k
    ```

    The built-ins are `exact_match`, `numeric_match` (last number, GSM8K style), `format` and `digit_match`.

- **Ground truth** lives in verl's `reward_model.ground_truth` column; rlplan reads it through
  `data.answer_key: reward_model.ground_truth` (dotted keys look into nested columns), which
  `rlconf import-verl` sets when the config names data files.
- **Defaults differ** in places: `actor.optim.lr` is 1e-3 (tuned for the tiny CPU model; the GPU presets
  use 1e-6), `actor.shuffle` is true, `cluster.device` is cpu and `val_before_train` is false.
  `rlconf import-verl` applies verl's defaults where they differ; otherwise start from a preset and check
  with `rlconf show`, which marks every value that differs from the defaults.
"""


def translate_sources(file: str | None, overrides: Iterable[str]) -> Translation:
    """Read an optional verl config file and translate it with the overrides (the CLI's entry point)."""
    from rlconf.load import read_config_file

    data = read_config_file(os.path.expanduser(file)) if file is not None else None
    overrides = list(overrides)
    if data is None and not overrides:
        raise ConfigError(
            [
                error(
                    "",
                    "nothing to import",
                    "pass a verl config file and/or verl overrides (key=value)",
                    "usage",
                )
            ],
            "rlconf import-verl",
        )
    sources = ([file] if file else []) + ([f"{len(overrides)} overrides"] if overrides else [])
    return translate(data, overrides, sources=sources)
