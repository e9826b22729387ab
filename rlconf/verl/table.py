"""The verl key table: one `VerlKey` row per verl key (its rlplan path and converter, or why it has none).

The table is data: `VerlKey(verl, rlplan, note, convert, reason, verl_default)`. A row with `rlplan` None says
why the key has no rlplan equivalent (`reason`: unsupported, ignored-by-verl, not-needed,
deprecated-in-verl). Rows for the per-role families (megatron, optim, checkpoint, profiler) are generated
from one list per family. A row key ending in `.*` covers every key under it. A row's `verl_default` is
verl's default, applied when the input leaves the key unset; what rlplan's default is comes from the config
dataclasses (`VerlKey.default_note`), never restated here.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import rlconf.verl.converters as cv
from rlconf.config import LAYOUT_FIELDS, AdvEstimator, RLConfig
from rlconf.fields import get_path, literal_values
from rlconf.verl.keys import Converter, Reason, VerlKey


# ---------------------------------------------------------------------------------------------- table
def _m(verl: str, rlplan: str, note: str = "", convert: Converter | None = None, **kw: Any) -> VerlKey:
    if "verl_default" in kw:
        note = "; ".join(filter(None, (note, default_note(rlplan, kw["verl_default"]))))
    return VerlKey(verl, rlplan, note, convert, **kw)


def default_note(rlplan: str, verl_default: Any) -> str:
    """`verl's default is X (rlplan's: Y)`, Y read from the config dataclasses (never restated in a row);
    empty for a verl default that interpolates another verl key."""
    if isinstance(verl_default, str) and "${" in verl_default:
        return ""
    ours = get_path(_DEFAULTS, rlplan)
    return f"verl's default is {_note_value(verl_default)} (rlplan's: {_note_value(ours)})"


def _note_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


_DEFAULTS = RLConfig()


def _u(verl: str, reason: Reason, note: str, check: Converter | None = None, **kw: Any) -> VerlKey:
    """A key with no rlplan path; `check` refuses the values rlplan cannot run (raises VerlValueError)."""
    return VerlKey(verl, None, note, check, reason, **kw)


_SAME = object()  # the rlplan suffix equals the verl suffix
_VERL_MCORE_CKPT = (
    "verl's megatron checkpoint converted from model.path (scripts/converter_hf_to_mcore.py) is not read: rlplan "
    "converts model.path's Hugging Face weights itself (to start from an rlplan checkpoint instead, set "
    "*.megatron.use_dist_checkpointing and dist_checkpointing_path)"
)
IN_ACTOR = "rlplan runs the reference policy in the actor's processes, so it uses the actor's layout"

_KERNEL_SWITCH = (
    "a kernel switch: rlplan chooses its kernels itself (model.fused_kernels: fused on cuda, where its own "
    "kernels need no apex or Transformer Engine); the same math either way"
)
_DISPATCH = (
    "rlplan routes tokens to its experts itself (DeepEP and megatron's dispatchers are not used); the same "
    "routing and sums"
)
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
    ("use_dist_checkpointing", None, _VERL_MCORE_CKPT, None, "not-needed"),
    ("dist_checkpointing_path", None, _VERL_MCORE_CKPT, None, "not-needed"),
    ("dist_checkpointing_prefix", None, "rlplan checkpoints have no key prefix", None, "not-needed"),
    ("seed", _SAME, "", None, None),
    ("override_transformer_config.recompute_granularity", _SAME, "", None, None),
    ("override_transformer_config.recompute_method", _SAME, "", None, None),
    ("override_transformer_config.recompute_num_layers", _SAME, "", None, None),
    ("override_transformer_config.recompute_modules", _SAME, "", None, None),
    ("override_transformer_config.attention_dropout", _SAME, "", None, None),
    ("override_transformer_config.hidden_dropout", _SAME, "", None, None),
    ("override_transformer_config.num_layers_in_first_pipeline_stage", "num_layers_in_first_pipeline_stage",
     "megatron's uneven pipeline split: a field of rlplan's MegatronConfig", None, None),
    ("override_transformer_config.num_layers_in_last_pipeline_stage", "num_layers_in_last_pipeline_stage",
     "megatron's uneven pipeline split: a field of rlplan's MegatronConfig", None, None),
    ("override_transformer_config.account_for_embedding_in_pipeline_split",
     "account_for_embedding_in_pipeline_split", "a field of rlplan's MegatronConfig", None, None),
    ("override_transformer_config.account_for_loss_in_pipeline_split", "account_for_loss_in_pipeline_split",
     "a field of rlplan's MegatronConfig", None, None),
    ("override_transformer_config.attention_backend", None,
     "rlplan has one setting for every role: model.attention_backend (see the actor row)", None, "not-needed"),
    ("override_transformer_config.moe_router_dtype", None,
     "rlplan has one setting for every role: model.moe_router_dtype (see the actor row)", None, "not-needed"),
    ("override_transformer_config.moe_grouped_gemm", None,
     "rlplan has one setting for every role: model.moe_grouped_gemm (see the actor row)", None, "not-needed"),
    ("override_transformer_config.gradient_accumulation_fusion", None,
     "rlplan sums each weight's gradient into its fp32 main_grad inside the product whenever its kernels are "
     "fused (model.fused_kernels: auto fuses on cuda)", None, "not-needed"),
    *((f"override_transformer_config.{name}", None, _KERNEL_SWITCH, None, "not-needed") for name in (
        "apply_rope_fusion", "bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
        "persist_layer_norm", "moe_permute_fusion", "moe_shared_expert_overlap")),
    ("override_transformer_config.use_flash_attn", None,
     "rlplan has one attention setting for every role: model.attention_backend (see the actor row of "
     "attention_backend)", None, "not-needed"),
    *((f"override_transformer_config.{name}", None, _DISPATCH, None, "not-needed")
      for name in ("moe_token_dispatcher_type", "moe_enable_deepep")),
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
MEGATRON_ROLES = (
    ("actor_rollout_ref.actor.megatron", "actor.megatron"),
    ("actor_rollout_ref.ref.megatron", "ref.megatron"),
    ("critic.megatron", "critic.megatron"),
    ("reward_model.megatron", "reward.reward_model.megatron"),
)


def _megatron_rows() -> list[VerlKey]:
    rows = []
    for verl_prefix, ours in MEGATRON_ROLES:
        for suffix, target, note, convert, reason in _MEGATRON_FIELDS:
            key = f"{verl_prefix}.{suffix}"
            if ours == "actor.megatron" and suffix == "dtype":
                rows.append(_m(key, "model.params_dtype", "",
                               cv.dtype, verl_default="bfloat16", family="megatron"))  # fmt: skip
            elif ours == "actor.megatron" and suffix == "override_transformer_config.moe_grouped_gemm":
                rows.append(_m(key, "model.moe_grouped_gemm", "one setting for every role's experts",
                               family="megatron"))  # fmt: skip
            elif ours == "actor.megatron" and suffix == "override_transformer_config.moe_router_dtype":
                rows.append(_m(key, "model.moe_router_dtype", "one precision for every role's routers",
                               family="megatron"))  # fmt: skip
            elif ours == "actor.megatron" and suffix == "override_transformer_config.attention_backend":
                rows.append(_m(key, "model.attention_backend",
                               "flash and fused -> auto (Transformer Engine when installed, else sdpa), "
                               "unfused -> local", cv.attention, family="megatron"))  # fmt: skip
            elif target is None:
                rows.append(_u(key, reason or "unsupported", note, family="megatron"))
            else:
                row_note = note
                dest = suffix if target is _SAME else target
                if ours == "ref.megatron" and dest in LAYOUT_FIELDS:
                    row_note = f"must equal the actor's: {IN_ACTOR}; when unset, the actor's value is used"
                rows.append(_m(key, f"{ours}.{dest}", row_note, convert, family="megatron"))
    return rows


_OPTIM_FIELDS: tuple[tuple[str, Any, str, Converter | None, Reason | None], ...] = (
    ("optimizer", _SAME, "adam is AdamW (decoupled weight decay), as in megatron", None, None),
    ("lr", _SAME, "", None, None),
    ("min_lr", _SAME, "", None, None),
    ("lr_warmup_steps", _SAME, "verl's -1 (use the ratio) becomes null", cv.negative_to_none, None),
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
            rows.append(
                _m(key, f"{ours}.{suffix if target is _SAME else target}", note, convert, family="optim",
                   **extra)
            )  # fmt: skip
        rows.append(
            _m(f"{verl_prefix}.min_lr_ratio", f"{ours}.min_lr", "absolute in rlplan: min_lr_ratio x lr",
               cv.min_lr_ratio(f"{verl_prefix}.lr", lr_default), family="optim")
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
            _u(f"{prefix}.enable", "not-needed", "read into profile.roles (see derived): verl profiles only workers "
               "whose flag is true (default false; its colocated actor / rollout / ref worker reads the actor's "
               "flag); no flag true with a tool set: profile.tool none", family="profiler"),
            _m(f"{prefix}.all_ranks", "profile.all_ranks", one, family="profiler"),
            _m(f"{prefix}.ranks", "profile.ranks", "ranks count within each role's world; " + one,
               family="profiler"),
            _m(f"{prefix}.tool", "profile.tool", "null -> none", cv.profile_tool, family="profiler"),
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


_VLLM_ONLY = (
    "read by rollout.engine: vllm only; the import runs the embedded engine, which does not read "
    "it, so rlplan's default is kept (set it again with rollout.engine: vllm)"
)


_ROLLOUT_UNSUPPORTED = "rlplan's embedded rollout has no such engine option"
_PADDING = (
    "one setting for every model's passes in rlplan: model.use_remove_padding (see the "
    "actor_rollout_ref.model row); packed and padded rows give the same sums"
)
_CHUNKING = (
    "no switch: rlplan's log-prob and entropy never hold fp32 [tokens, vocabulary] logits for the "
    "whole micro-batch (eager kernels work in chunks of tokens; model.fused_kernels needs none)"
)

VERL_KEYS: tuple[VerlKey, ...] = (
    # ------------------------------------------------------------------------------------------ data
    _m("data.train_files", "data.train_files", ".parquet or .jsonl; verl's ground-truth column is read through "
       "data.answer_key (set to reward_model.ground_truth)", cv.files),
    _m("data.val_files", "data.val_files", "", cv.files),
    _m("data.prompt_key", "data.prompt_key", "text or a list of chat messages"),
    _m("data.train_batch_size", "data.train_batch_size", "prompts per step, as in verl; 0 (verl's fully async "
       "trainer, which streams prompts) is refused", cv.train_batch_size, verl_default=1024),
    _u("data.gen_batch_size", "not-needed", "with algorithm.filter_groups rlplan generates batches of "
       "data.train_batch_size prompts until data.train_batch_size groups are kept"),
    _m("data.val_batch_size", "data.val_batch_size", ""),
    _m("data.max_prompt_length", "data.max_prompt_length", "", verl_default=512),
    _m("data.max_response_length", "rollout.max_response_length", "moved to rollout", verl_default=512),
    _m("data.truncation", "data.truncation", "no `middle`",
       cv.truncation, verl_default="error"),
    _m("data.filter_overlong_prompts", "data.truncation", "true -> filter (wins over data.truncation)",
       cv.filter_overlong),
    _m("data.shuffle", "data.shuffle", ""),
    _m("data.seed", "data.seed", ""),
    _m("data.tokenizer", "model.tokenizer_path", "", cv.expand),
    _u("data.filter_overlong_prompts_workers", "not-needed", "rlplan filters while tokenizing"),
    _u("data.reward_fn_key", "not-needed", "rlplan reads verl's data_source column (reward.function "
       "default_compute_score dispatches on it, as verl's default does)"),
    _u("data.use_shm", "not-needed", "rlplan reads local files"),
    _u("data.train_max_samples", "unsupported", "trim the file instead"),
    _u("data.val_max_samples", "unsupported", "trim the file instead"),
    _u("data.return_raw_input_ids", "not-needed", "one tokenizer serves policy and reward"),
    _u("data.return_raw_chat", "not-needed", "chat messages are templated by rlplan (data.apply_chat_template)"),
    _u("data.return_full_prompt", "not-needed", "rlplan keeps the prompt with each response"),
    _u("data.dataloader_num_workers", "not-needed", "prompts are tokenized once, up front"),
    _u("data.validation_shuffle", "not-needed", "validation order is fixed"),
    _u("data.tool_config_path", "unsupported", "verl's per-dataset tool YAML is not read: list the tools in "
       "rollout.multi_turn.tools"),
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
       "as Qwen/Qwen2.5-7B-Instruct fails the plan until it points at a downloaded copy)", cv.expand),
    _m("actor_rollout_ref.model.tokenizer_path", "model.tokenizer_path", "", cv.expand),
    _m("actor_rollout_ref.model.enable_gradient_checkpointing",
       "actor.megatron.override_transformer_config.recompute_granularity",
       "true -> full (megatron uniform recompute, 1 layer per chunk, as verl does)", cv.recompute_on),
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
    _u("actor_rollout_ref.model.use_fused_kernels", "not-needed", "the log-prob / entropy reductions are fused by "
       "model.fused_kernels (auto: compiled on cuda)"),
    _m("actor_rollout_ref.model.use_remove_padding", "model.use_remove_padding", "true: rlplan packs rows "
       "(THD) wherever its engine can, as its default null does (the plan says where); false: padded rows",
       cv.packing),
    # LoRA: verl's FSDP keys (lora_rank, ...) and its Megatron-Bridge section (model.lora.*).
    _m("actor_rollout_ref.model.lora_rank", "actor.lora.rank", "0 = off (verl's and rlplan's)"),
    _m("actor_rollout_ref.model.lora_alpha", "actor.lora.alpha", ""),
    _m("actor_rollout_ref.model.target_modules", "actor.lora.target_modules", "all-linear or module names "
       "(HF q_proj.. or megatron linear_qkv..)", cv.lora_targets),
    _m("actor_rollout_ref.model.exclude_modules", "actor.lora.exclude_modules", "fnmatch patterns", cv.lora_targets),
    _m("actor_rollout_ref.model.lora_adapter_path", "actor.lora.adapter_path", "a local PEFT folder", cv.expand),
    _m("actor_rollout_ref.model.lora.rank", "actor.lora.rank", "0 = off; without lora.alpha the import sets "
       "verl's Megatron default alpha 32"),
    _m("actor_rollout_ref.model.lora.alpha", "actor.lora.alpha", ""),
    _m("actor_rollout_ref.model.lora.dropout", "actor.lora.dropout", ""),
    _m("actor_rollout_ref.model.lora.target_modules", "actor.lora.target_modules", "", cv.lora_targets),
    _m("actor_rollout_ref.model.lora.exclude_modules", "actor.lora.exclude_modules", "", cv.lora_targets),
    _m("actor_rollout_ref.model.lora.adapter_path", "actor.lora.adapter_path", "a local PEFT folder", cv.expand),
    _m("actor_rollout_ref.model.lora.lora_A_init_method", "actor.lora.init", "kaiming or normal/gaussian "
       "(B always starts at zero)", cv.lora_a_init),
    _u("actor_rollout_ref.model.lora.lora_B_init_method", "not-needed", "B starts at zero (verl's zero)"),
    _u("actor_rollout_ref.model.lora.type", "not-needed", "plain LoRA (verl's lora / canonical_lora: PEFT's "
       "per-projection adapters either way); dora is not built"),
    _u("actor_rollout_ref.model.lora.merge", "not-needed", "the embedded rollout applies the adapters on the fly"),
    _u("actor_rollout_ref.model.lora.dropout_position", "not-needed", "dropout on the adapter's input (pre)"),
    _u("actor_rollout_ref.model.lora.dtype", "not-needed", "adapters take model.params_dtype"),
    _u("actor_rollout_ref.model.lora.freeze_vision_model", "not-needed", "rlplan has no vision models"),
    _u("actor_rollout_ref.model.lora.a2a_experimental", "unsupported", "experts are not adapted"),
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
       "", verl_default=16384),
    _m("actor_rollout_ref.actor.ppo_epochs", "actor.ppo_epochs", ""),
    _m("actor_rollout_ref.actor.shuffle", "actor.shuffle", "",
       verl_default=False),
    _m("actor_rollout_ref.actor.clip_ratio", "actor.clip_ratio", ""),
    _m("actor_rollout_ref.actor.clip_ratio_low", "actor.clip_ratio_low", ""),
    _m("actor_rollout_ref.actor.clip_ratio_high", "actor.clip_ratio_high", ""),
    _m("actor_rollout_ref.actor.clip_ratio_c", "actor.clip_ratio_c", ""),
    _m("actor_rollout_ref.actor.loss_agg_mode", "actor.loss_agg_mode", "same four modes; "
       "seq-mean-token-sum-norm keeps Dr. GRPO's 1/G (verl's does not: a warning gives the factor)"),
    _m("actor_rollout_ref.actor.entropy_coeff", "actor.entropy_coeff", ""),
    _m("actor_rollout_ref.actor.use_kl_loss", "actor.use_kl_loss", ""),
    _m("actor_rollout_ref.actor.kl_loss_coef", "actor.kl_loss_coef", ""),
    _m("actor_rollout_ref.actor.kl_loss_type", "actor.kl_loss_type", "k1 -> kl, k2 -> mse, k3 -> low_var_kl",
       cv.kl_type),
    _m("actor_rollout_ref.actor.grad_clip", "actor.optim.clip_grad", "verl's FSDP name"),
    _m("actor_rollout_ref.actor.policy_loss.loss_mode", "actor.policy_loss.loss_mode",
       "vanilla, gspo, gpg, clip-cov, kl-cov, cispo, sapo (gspo and sapo aggregate seq-mean-token-mean, as "
       "verl)"),
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
    _u("actor_rollout_ref.actor.use_fused_kernels", "not-needed", "the log-prob / entropy reductions are fused by "
       "model.fused_kernels (auto: compiled on cuda)"),
    _u("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "unsupported", "FSDP only; megatron "
       "context parallel is *.megatron.context_parallel_size"),
    _u("actor_rollout_ref.actor.profile.*", "deprecated-in-verl", "use global_profiler.* and "
       "actor_rollout_ref.actor.profiler.*"),
    # ------------------------------------------------------------------------------------------- ref
    _m("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_micro_batch_size_per_gpu", ""),
    _u("actor_rollout_ref.ref.log_prob_micro_batch_size", "deprecated-in-verl",
       "set log_prob_micro_batch_size_per_gpu"),
    _m("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "ref.log_prob_use_dynamic_bsz",
       "unset: the actor's use_dynamic_bsz, as verl interpolates it"),
    _m("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu",
       "unset: the actor's ppo_max_token_len_per_gpu, as verl interpolates it"),
    _u("actor_rollout_ref.ref.strategy", "not-needed", "the ref runs on megatron in the actor's processes"),
    _u("actor_rollout_ref.ref.use_torch_compile", "not-needed", "rlplan compiles nothing by default"),
    _u("actor_rollout_ref.ref.load_weight", "not-needed", "the ref loads the actor's initial weights"),
    _u("actor_rollout_ref.ref.use_fused_kernels", "not-needed", "the log-prob / entropy reductions are fused by "
       "model.fused_kernels (auto: compiled on cuda)"),
    _u("actor_rollout_ref.ref.profile.*", "deprecated-in-verl", "use global_profiler.*"),
    _u("actor_rollout_ref.ref.sync_actor", "unsupported", "the reference policy stays frozen"),
    _u("actor_rollout_ref.ref.sync_actor_alpha", "unsupported", "the reference policy stays frozen"),
    _u("actor_rollout_ref.ref.sync_steps", "unsupported", "the reference policy stays frozen"),
    _u("actor_rollout_ref.ref.ulysses_sequence_parallel_size", "unsupported", "FSDP only"),
    # --------------------------------------------------------------------------------------- rollout
    _m("actor_rollout_ref.rollout.name", "rollout.engine",
       "vllm, sglang, hf and trtllm -> embedded: rlplan's generator on megatron weights (no extra install; in "
       "the rollout's own tp when it differs, resharded each step); rollout.engine: vllm is the optional "
       "adapter", cv.rollout_engine),
    _m("actor_rollout_ref.rollout.n", "rollout.n", "responses per prompt",
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
    _m("actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization", _VLLM_ONLY, cv.vllm_only),
    _m("actor_rollout_ref.rollout.free_cache_engine", "rollout.free_cache_engine", _VLLM_ONLY, cv.vllm_only),
    _m("actor_rollout_ref.rollout.max_num_seqs", "rollout.max_num_seqs", _VLLM_ONLY, cv.vllm_only),
    _m("actor_rollout_ref.rollout.enforce_eager", "rollout.cuda_graph", "inverted", cv.negate),
    _m("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "actor.log_prob_micro_batch_size_per_gpu",
       "verl's actor recomputes old log-probs with the rollout's micro-batch size"),
    _u("actor_rollout_ref.rollout.log_prob_micro_batch_size", "deprecated-in-verl",
       "set log_prob_micro_batch_size_per_gpu"),
    _m("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "actor.log_prob_use_dynamic_bsz",
       "the old log-prob pass (verl's actor recomputes them with the rollout's settings); unset: the actor's "
       "use_dynamic_bsz, as verl interpolates it"),
    _m("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "actor.log_prob_max_token_len_per_gpu",
       "the old log-prob pass; unset: the actor's ppo_max_token_len_per_gpu, as verl interpolates it"),
    _m("actor_rollout_ref.rollout.val_kwargs.n", "rollout.val.n", ""),
    _m("actor_rollout_ref.rollout.val_kwargs.temperature", "rollout.val.temperature", "0 is greedy"),
    _m("actor_rollout_ref.rollout.val_kwargs.top_p", "rollout.val.top_p", ""),
    _m("actor_rollout_ref.rollout.val_kwargs.top_k", "rollout.val.top_k", "", verl_default=-1),
    _u("actor_rollout_ref.rollout.val_kwargs.do_sample", "not-needed", "false (verl's default): verl validates "
       "greedily whatever val_kwargs.temperature says, so rollout.val.temperature 0 is derived; true: sampled "
       "with val_kwargs' temperature, top_p and top_k", verl_default=False),
    _u("actor_rollout_ref.rollout.do_sample", "not-needed", "training rollouts always sample "
       "(rollout.temperature > 0)"),
    _u("actor_rollout_ref.rollout.mode", "not-needed", "the embedded engine has one mode"),
    _u("actor_rollout_ref.rollout.prompt_length", "not-needed", "rlplan uses data.max_prompt_length"),
    _u("actor_rollout_ref.rollout.dtype", "not-needed", "the rollout runs in model.params_dtype"),
    _u("actor_rollout_ref.rollout.ignore_eos", "unsupported", "responses end at EOS"),
    _u("actor_rollout_ref.rollout.cudagraph_capture_sizes", "not-needed", "rollout.cuda_graph captures the "
       "sizes it needs"),
    _u("actor_rollout_ref.rollout.data_parallel_size", "not-needed", "the rollout's dp is the actor pool / tp"),
    _u("actor_rollout_ref.rollout.expert_parallel_size", "unsupported", "the embedded rollout runs the experts "
       "in the actor's expert layout (actor.megatron.expert_model_parallel_size); a rollout EP of its own is "
       "not built"),
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
    _m("actor_rollout_ref.rollout.multi_turn.enable", "rollout.multi_turn.enable",
       "tool calls parsed from the model's output, tool output appended as observation tokens (never trained on)",
       verl_default=False),
    _m("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", "rollout.multi_turn.max_assistant_turns",
       "verl's null (no bound) keeps rlplan's default", cv.skip_none),
    _m("actor_rollout_ref.rollout.multi_turn.max_tool_response_length",
       "rollout.multi_turn.max_tool_response_length", "", verl_default=256),
    _m("actor_rollout_ref.rollout.multi_turn.max_parallel_calls", "rollout.multi_turn.max_parallel_tools",
       "tool calls run at once (across rows)", verl_default=1),
    _u("actor_rollout_ref.rollout.multi_turn.tool_config_path", "unsupported",
       "verl's tool YAML (class_name + OpenAI schema) is not read: list the tools in rollout.multi_turn.tools "
       "as built-in names (calculator, python) or module:function / module:Class"),
    _u("actor_rollout_ref.rollout.multi_turn.interaction_config_path", "unsupported",
       "verl's interaction YAML is not read: set rollout.multi_turn.interaction to module:Class"),
    _u("actor_rollout_ref.rollout.multi_turn.format", "not-needed",
       "Hugging Face tokenizers use the Hermes / Qwen JSON <tool_call> format (verl's hermes)"),
    _u("actor_rollout_ref.rollout.multi_turn.max_user_turns", "unsupported",
       "user turns come from an interaction plugin, bounded by max_assistant_turns"),
    _u("actor_rollout_ref.rollout.multi_turn.*", "unsupported",
       "no rlplan equivalent for this multi-turn option"),
    _u("actor_rollout_ref.rollout.agent.*", "unsupported", "rlplan's agent loop is rollout.multi_turn (enable, tools, "
       "interaction); verl's agent-loop classes and servers are not loaded"),
    _u("actor_rollout_ref.rollout.calculate_log_probs", "not-needed", "old log-probs are recomputed by the "
       "actor"),
    _u("actor_rollout_ref.rollout.update_weights_bucket_megabytes", "not-needed", "the colocated embedded "
       "rollout generates with the actor's own weights (nothing moves); a separate rollout sizes its weight-sync "
       "buckets itself"),
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
    _m("critic.model.path", "critic.model_path", "null: the actor's model with a fresh value head", cv.expand),
    _m("critic.model.enable_gradient_checkpointing",
       "critic.megatron.override_transformer_config.recompute_granularity", "true -> full", cv.recompute_on),
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
       "", verl_default=32768),
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
    _m("reward_model.model.path", "reward.reward_model.path", "", cv.expand),
    _m("reward_model.micro_batch_size_per_gpu", "reward.reward_model.micro_batch_size_per_gpu", ""),
    _m("reward_model.enable_resource_pool", "reward.reward_model.placement", "true -> separate, false -> "
       "colocated", cv.placement),
    _m("reward_model.n_gpus_per_node", "reward.reward_model.num_devices", "x reward_model.nnodes: the devices "
       "of its own pool", cv.reward_model_devices("reward_model.nnodes")),
    _u("reward_model.nnodes", "not-needed", "folded into reward.reward_model.num_devices"),
    _u("reward_model.micro_batch_size", "deprecated-in-verl", "set micro_batch_size_per_gpu"),
    _u("reward_model.strategy", "not-needed", "megatron only"),
    _u("reward_model.model.input_tokenizer", "not-needed", "the reward model reads the policy's tokens"),
    _u("reward_model.model.external_lib", "unsupported", "rlplan imports no model code"),
    _u("reward_model.model.trust_remote_code", "unsupported", "rlplan runs no code from model folders"),
    _u("reward_model.max_length", "not-needed", "prompt + response lengths bound it"),
    _u("reward_model.use_dynamic_bsz", "unsupported", "reward passes use fixed micro-batches"),
    _u("reward_model.forward_max_token_len_per_gpu", "unsupported", "reward passes use fixed micro-batches"),
    _u("reward_model.reward_manager", "not-needed", "naive, dapo, prime: reward.function scores every "
       "response as they do (DAPO's overlong penalty is reward.overlong_buffer); batch and custom managers are "
       "refused", cv.reward_manager),
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
    _m("custom_reward_function.path", "reward.function", "reward.function is `path:name` (the name from "
       "custom_reward_function.name, verl's default compute_score); verl's signature compute_score("
       "data_source, solution_str, ground_truth, extra_info) is called as is", cv.reward_file),
    _u("custom_reward_function.name", "not-needed", "joined into reward.function (`path/to/file.py:name`)"),
    _u("custom_reward_function.reward_kwargs.*", "unsupported", "bind them in the wrapper function"),
    # ------------------------------------------------------------------------------------- algorithm
    _m("algorithm.adv_estimator", "algorithm.adv_estimator",
       "rlplan has " + ", ".join(literal_values(AdvEstimator)), verl_default="gae"),
    _m("algorithm.gamma", "algorithm.gamma", ""),
    _m("algorithm.lam", "algorithm.lam", ""),
    _m("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo", ""),
    _m("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward", ""),
    _m("algorithm.kl_penalty", "algorithm.kl_penalty", "k1 -> kl, k2 -> mse, k3 -> low_var_kl", cv.kl_type),
    _m("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.type", ""),
    _m("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.kl_coef", ""),
    _m("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.target_kl", ""),
    _m("algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.horizon", ""),
    _u("algorithm.use_pf_ppo", "unsupported", "no preference-feedback PPO reweighting"),
    _u("algorithm.pf_ppo.*", "unsupported", "no preference-feedback PPO reweighting"),
    _m("algorithm.filter_groups.enable", "algorithm.filter_groups.enable", "DAPO dynamic sampling"),
    _m("algorithm.filter_groups.metric", "algorithm.filter_groups.metric", "acc / score -> score (the reward "
       "function's value), seq_reward -> seq_reward", cv.filter_metric),
    _m("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches",
       "0 = unbounded, as in verl"),
    _m("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is",
       "the embedded rollout samples with the actor's own weights, so the weights stay near 1"),
    _m("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction.rollout_is_threshold",
       ""),
    _m("algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs", "token_k1 and "
       "token_k2 -> token, seq_sum_k1 -> sequence (older names token / sequence kept); rejected tokens leave "
       "the loss mask: means over accepted tokens, as verl. Other modes and chained lists are refused",
       cv.rollout_rs),
    _m("algorithm.rollout_correction.rollout_rs_threshold", "algorithm.rollout_correction.rollout_rs_threshold",
       "the ratio bound t (the lower bound is 1/t): verl's `1/t_t` or t for *_k1; token_k2's bound u becomes "
       "t = exp(sqrt(2u))", cv.rollout_rs_threshold),
    _m("algorithm.rollout_correction.bypass_mode", "algorithm.rollout_correction.bypass_mode", ""),
    _u("algorithm.rollout_correction.*", "unsupported", "rlplan has rollout_is, rollout_is_threshold, "
       "rollout_rs, rollout_rs_threshold and bypass_mode"),
    _m("algorithm.rollout_is", "algorithm.rollout_correction.rollout_is", "older verl name"),
    _m("algorithm.rollout_is_threshold", "algorithm.rollout_correction.rollout_is_threshold", "older verl name"),
    # --------------------------------------------------------------------------------------- trainer
    _m("trainer.total_training_steps", "trainer.total_steps", "steps count from 1 across resumes"),
    _m("trainer.total_epochs", "trainer.total_epochs", "the plan counts steps = epochs x (rows of "
       "data.train_files // data.train_batch_size); kept out when trainer.total_training_steps is set (verl "
       "then runs that many steps)", cv.total_epochs),
    _m("trainer.nnodes", "cluster.nnodes", "with a rollout pool of its own (rollout.nnodes): + its nodes when "
       "the pools differ in nodes", cv.cluster_shape(0)),
    _m("trainer.n_gpus_per_node", "cluster.gpus_per_node", "with a rollout pool of its own on the same nodes: + "
       "rollout.n_gpus_per_node", cv.cluster_shape(1), verl_default=8),
    _m("trainer.device", "cluster.device", "", verl_default="cuda"),
    _m("trainer.project_name", "trainer.project_name", ""),
    _m("trainer.experiment_name", "trainer.experiment_name", ""),
    _m("trainer.logger", "logging.backends", "jsonl is added: rlplan writes metrics.jsonl for its plots",
       cv.logger),
    _m("trainer.save_freq", "trainer.save_freq", "-1 (off in verl) -> 0; rlplan also saves at the last step",
       cv.negative_to_zero),
    _m("trainer.test_freq", "trainer.test_freq", "-1 (off in verl) -> 0", cv.negative_to_zero),
    _m("trainer.val_before_train", "trainer.val_before_train", "",
       verl_default=True),
    _m("trainer.resume_mode", "trainer.resume_mode", "same modes"),
    _m("trainer.resume_from_path", "trainer.resume_from_path", "an rlplan checkpoints/global_step_N folder",
       cv.expand),
    _m("trainer.default_local_dir", "trainer.output_dir", "checkpoints go to output_dir/checkpoints", cv.expand),
    _m("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep", "one limit for the whole checkpoint"),
    _m("trainer.max_critic_ckpt_to_keep", "trainer.max_ckpt_to_keep", "one limit for the whole checkpoint"),
    _m("trainer.critic_warmup", "trainer.critic_warmup", ""),
    _m("trainer.seed", "trainer.seed", ""),
    _m("trainer.profile_steps", "profile.steps", "older verl name of global_profiler.steps"),
    _u("trainer.balance_batch", "not-needed", "rlplan balances micro-batches by token count itself"),
    _m("trainer.log_val_generations", "logging.val_generations", "the same validation rows each time, in "
       "val_generations.jsonl and the wandb / tensorboard backends", verl_default=0),
    _u("trainer.esi_redundant_time", "unsupported", "no elastic-instance save deadline"),
    _u("trainer.del_local_ckpt_after_load", "unsupported", "checkpoints are kept by trainer.max_ckpt_to_keep"),
    _u("trainer.default_hdfs_dir", "unsupported", "local or mounted folders only"),
    _u("trainer.ray_wait_register_center_timeout", "not-needed", "no register center"),
    _m("trainer.rollout_data_dir", "logging.rollout_data_dir", "STEP.jsonl per step in verl's format; a "
       "relative folder (verl's: from the current directory) is made absolute", cv.from_cwd),
    _m("trainer.validation_data_dir", "logging.validation_data_dir", "as rollout_data_dir", cv.from_cwd),
    _u("trainer.val_only", "unsupported", "no validation-only mode"),
    _u("trainer.use_legacy_worker_impl", "not-needed", "one worker implementation"),
    _u("trainer.max_ref_ckpt_to_keep", "not-needed", "the ref is never saved"),
    _u("trainer.profile_continuous_steps", "deprecated-in-verl", "use global_profiler.profile_continuous_steps"),
    _u("trainer.controller_nsight_options.*", "deprecated-in-verl", "use global_profiler.global_tool_config"),
    _u("trainer.worker_nsight_options.*", "deprecated-in-verl", "use global_profiler.global_tool_config"),
    # -------------------------------------------------------------------------------------- profiler
    _m("global_profiler.tool", "profile.tool", "null -> none", cv.profile_tool),
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

_FSDP = (
    "translated from FSDP: megatron shards by its tp / pp / dp layout and the distributed optimizer "
    "(*.megatron.*), so FSDP's sharding options are not needed"
)
_FSDP_ROLES = (
    ("actor_rollout_ref.actor.fsdp_config", "actor.megatron"),
    ("actor_rollout_ref.ref.fsdp_config", "ref.megatron"),
    ("critic.model.fsdp_config", "critic.megatron"),
    ("reward_model.model.fsdp_config", "reward.reward_model.megatron"),
)
FSDP_KEYS = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy",
             "reward_model.strategy")  # fmt: skip
"""Keys naming a verl worker's training backend: fsdp / fsdp2 there means the import translates FSDP."""


def _fsdp_rows() -> list[VerlKey]:
    """verl's FSDP workers (ppo_trainer.yaml) translated to megatron: offloads map, sharding is megatron's."""
    rows = []
    for verl_prefix, ours in _FSDP_ROLES:
        rows.append(_m(f"{verl_prefix}.param_offload", f"{ours}.param_offload",
                       "FSDP's parameter offload -> megatron's"))  # fmt: skip
        if ours != "ref.megatron" and ours != "reward.reward_model.megatron":
            rows.append(_m(f"{verl_prefix}.optimizer_offload", f"{ours}.optimizer_offload",
                           "FSDP's optimizer-state offload -> megatron's"))  # fmt: skip
        rows.append(_u(f"{verl_prefix}.offload_policy", "unsupported", "FSDP2's CPUOffloadPolicy (parameters, "
                       f"gradients and the optimizer step on the CPU) has no megatron form: set "
                       f"{ours}.param_offload / optimizer_offload"))  # fmt: skip
        rows.append(_u(f"{verl_prefix}.*", "not-needed", _FSDP))
    rows += [
        _u("actor_rollout_ref.model.enable_activation_offload", "unsupported", "FSDP only: use "
           "actor.megatron.override_transformer_config.recompute_* to save activation memory"),
        _u("critic.model.enable_activation_offload", "unsupported", "FSDP only: use "
           "critic.megatron.override_transformer_config.recompute_*"),
        _u("actor_rollout_ref.model.use_liger", "not-needed", "FSDP's Liger kernels; megatron has its own"),
        _u("critic.model.use_remove_padding", "not-needed", _PADDING),
        _u("actor_rollout_ref.actor.entropy_from_logits_with_chunking", "not-needed", _CHUNKING),
        _u("actor_rollout_ref.actor.entropy_checkpointing", "not-needed", _CHUNKING),
        _u("actor_rollout_ref.ref.entropy_from_logits_with_chunking", "not-needed", "the ref computes no "
           "entropy"),
        _u("actor_rollout_ref.ref.entropy_checkpointing", "not-needed", "the ref computes no entropy"),
        _u("actor_rollout_ref.actor.optim.num_cycles", "unsupported", "rlplan's cosine decays once (verl's "
           "default 0.5 cycles)"),
        _u("critic.optim.num_cycles", "unsupported", "rlplan's cosine decays once (verl's default 0.5 cycles)"),
    ]  # fmt: skip
    return rows


FSDP_ROWS: dict[str, VerlKey] = {
    f"{prefix}.betas": _m(f"{prefix}.betas", f"{ours}.betas", "verl's FSDP optimizer uses them (its megatron "
                          "one does not)")
    for prefix, ours in (("actor_rollout_ref.actor.optim", "actor.optim"), ("critic.optim", "critic.optim"))
}  # fmt: skip
_ULYSSES = (
    "FSDP's Ulysses sequence parallel splits each sequence over this many devices, as megatron's context "
    "parallel does"
)
FSDP_ROWS.update(
    {
        f"{prefix}.ulysses_sequence_parallel_size": _m(
            f"{prefix}.ulysses_sequence_parallel_size", f"{ours}.megatron.context_parallel_size", _ULYSSES
        )
        for prefix, ours in (
            ("actor_rollout_ref.actor", "actor"),
            ("actor_rollout_ref.ref", "ref"),
            ("critic", "critic"),
        )
    }
)
FSDP_ROWS.update({
    f"{prefix}.ppo_max_token_len_per_gpu": _m(
        f"{prefix}.ppo_max_token_len_per_gpu", f"{ours}.ppo_max_token_len_per_gpu", "x ulysses_sequence_parallel_"
        "size: verl's FSDP budget counts one device's share of a sequence split by Ulysses; rlplan's counts whole "
        "sequences per data-parallel rank", cv.times_ulysses(f"{prefix}.ulysses_sequence_parallel_size"))
    for prefix, ours in (("actor_rollout_ref.actor", "actor"), ("critic", "critic"))
} | {
    f"{prefix}.log_prob_max_token_len_per_gpu": _m(
        f"{prefix}.log_prob_max_token_len_per_gpu", f"{ours}.log_prob_max_token_len_per_gpu", "x "
        "ulysses_sequence_parallel_size, as the update's budget", cv.times_ulysses(f"{ulysses}.ulysses_sequence_parallel_size"))
    for prefix, ours, ulysses in (("actor_rollout_ref.rollout", "actor", "actor_rollout_ref.actor"),
                                  ("actor_rollout_ref.ref", "ref", "actor_rollout_ref.ref"))
})  # fmt: skip
"""Rows that replace the table's for an FSDP script (where verl's FSDP workers read a key its megatron ones
ignore, or read it with another meaning)."""


# verl's current schema moved the reward settings under `reward.` (verl/trainer/config/reward/reward.yaml):
# each old row is repeated under its new name, so both spellings translate the same way.
_CURRENT_PREFIXES = (
    ("reward.custom_reward_function.", "custom_reward_function."),
    ("reward.reward_kwargs.", "reward_model.reward_kwargs."),
    ("reward.sandbox_fusion.", "reward_model.sandbox_fusion."),
)
_CURRENT_RENAMES = (
    ("reward.reward_model.enable", "reward_model.enable"),
    ("reward.reward_model.model_path", "reward_model.model.path"),
    ("reward.reward_model.enable_resource_pool", "reward_model.enable_resource_pool"),
    ("reward.reward_model.nnodes", "reward_model.nnodes"),
    ("reward.reward_manager.name", "reward_model.reward_manager"),
)


def _current_schema_rows(rows: tuple[VerlKey, ...]) -> list[VerlKey]:
    by_key = {r.verl: r for r in rows}
    out = []
    for new, old in _CURRENT_PREFIXES:
        for r in rows:
            if r.verl.startswith(old):
                out.append(dataclasses.replace(r, verl=new + r.verl[len(old) :]))
    out += [dataclasses.replace(by_key[old], verl=new) for new, old in _CURRENT_RENAMES]
    out += [
        _m("reward.reward_model.n_gpus_per_node", "reward.reward_model.num_devices", "x reward.reward_model."
           "nnodes: the devices of its own pool", cv.reward_model_devices("reward.reward_model.nnodes")),
        dataclasses.replace(by_key["reward_model.rollout.*"], verl="reward.reward_model.rollout.*"),
        _u("reward.reward_manager.*", "unsupported", "rlplan loads no reward manager class: reward.function "
           "scores each response"),
        dataclasses.replace(by_key["reward_model.num_workers"], verl="reward.num_workers"),
        _u("reward.compute_score_kwargs.*", "unsupported", "keyword arguments of verl's built-in scorers: bind "
           "them in a reward function of your own"),
    ]  # fmt: skip
    return out


_ASYNC = (
    "verl's fully async trainer (streamed generation within a staleness bound) is not built: rlplan's nearest is "
    "rollout.placement: separate with rollout.num_devices and algorithm.off_policy_steps: 1 (verl's one-step-off)"
)
_CRITIC_LORA = "a LoRA critic is not built: rlplan adapts only the actor (actor.lora)"
_CRITIC_LORA_FIX = "set critic.model.lora.rank=0 (the critic trains all its weights) or run without a critic"


def _newer_rows() -> list[VerlKey]:
    """Keys of verl's current run scripts (examples/) that the rows above do not name."""
    return [
        _m("actor_rollout_ref.actor.router_replay.mode", "actor.router_replay", "R3 -> true (the rollout's "
           "routing replayed in the old log-prob and update passes), disabled -> false; R2 is refused",
           cv.router_replay),
        _u("actor_rollout_ref.actor.router_replay.*", "not-needed", "rlplan keeps the recorded routing in memory "
           "with the batch"),
        _u("actor_rollout_ref.ref.router_replay.*", "not-needed", "the reference policy routes on its own"),
        _u("actor_rollout_ref.rollout.enable_rollout_routing_replay", "not-needed", "the embedded rollout "
           "records the routing whenever actor.router_replay is on"),
        _u("actor_rollout_ref.rollout.checkpoint_engine.*", "not-needed", "the colocated embedded rollout "
           "generates with the actor's own weights; a separate rollout sizes its weight-sync buckets itself"),
        _u("actor_rollout_ref.model.mtp.enable", "unsupported", "no multi-token-prediction heads (true is refused)",
           check=cv.refuse_true("multi-token prediction (MTP) heads are not built in rlplan", "set "
                                "actor_rollout_ref.model.mtp.enable=False (the main model trains without them)")),
        _u("actor_rollout_ref.model.mtp.*", "unsupported", "no multi-token-prediction heads"),
        # verl's fully async and one-step-off trainers (verl/experimental): their own rollout pool and streaming.
        _u("async_training.*", "unsupported", _ASYNC),
        _m("rollout.n_gpus_per_node", "rollout.num_devices", "the rollout pool of verl's one-step-off trainer "
           "(x rollout.nnodes): rlplan's rollout.placement separate, a part of the cluster (see derived)",
           cv.rollout_pool_devices),
        _u("rollout.nnodes", "not-needed", "folded into rollout.num_devices and the cluster's shape"),
        _u("rollout.*", "unsupported", "an option of verl's fully async trainer; " + _ASYNC),
        _u("actor_rollout_ref.actor.use_rollout_log_probs", "unsupported", "verl's fully async option: rlplan's "
           "algorithm.rollout_correction.bypass_mode takes the rollout's log-probs as the old ones"),
        # The critic's LoRA (verl's Megatron-Bridge section and FSDP name): rlplan adapts only the actor.
        _u("critic.model.lora.rank", "unsupported", "rlplan adapts only the actor (actor.lora); 0 (off) is "
           "accepted, a rank is refused", check=cv.refuse_positive(_CRITIC_LORA, _CRITIC_LORA_FIX)),
        _u("critic.model.lora_rank", "unsupported", "rlplan adapts only the actor (actor.lora); 0 (off) is "
           "accepted, a rank is refused", check=cv.refuse_positive(_CRITIC_LORA, _CRITIC_LORA_FIX)),
        _u("critic.model.lora.*", "unsupported", "rlplan adapts only the actor (actor.lora)"),
        _u("critic.model.lora_alpha", "unsupported", "rlplan adapts only the actor (actor.lora)"),
        _u("critic.model.target_modules", "unsupported", "rlplan adapts only the actor (actor.lora)"),
        _u("actor_rollout_ref.model.fused_kernel_options.*", "not-needed", "the log-prob / entropy reductions "
           "are fused by model.fused_kernels (auto: compiled on cuda)"),
        _u("actor_rollout_ref.actor.use_prefix_grouper", "unsupported", "prompts are not shared across a "
           "group's forward passes"),
        _u("actor_rollout_ref.actor.calculate_sum_pi_squared", "unsupported", "no such metric"),
        _u("reward_model.use_reward_loop", "not-needed", "rule rewards run in the controller; a reward model "
           "runs as a megatron forward pass"),
        _u("reward_model.num_workers", "not-needed", "rule rewards run in the controller"),
        _u("reward_model.rollout.*", "unsupported", "rlplan runs a reward model as a megatron forward pass "
           "(reward.reward_model.*), not through a rollout engine"),
        _u("reward_model.model.use_remove_padding", "not-needed", _PADDING),
        _u("reward_model.reward_loop_source", "not-needed", "rlplan loads no reward loop class"),
        _u("reward_model.reward_loop_module_path", "unsupported", "rlplan loads no reward loop class: "
           "reward.function scores each response"),
        _u("reward_model.reward_loop_class_name", "unsupported", "rlplan loads no reward loop class: "
           "reward.function scores each response"),
    ]  # fmt: skip


VERL_KEYS = VERL_KEYS + tuple(_fsdp_rows()) + tuple(_newer_rows())
VERL_KEYS = VERL_KEYS + tuple(_current_schema_rows(VERL_KEYS))

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


def did_you_mean_key(key: str) -> str:
    names = [r.verl for r in VERL_KEYS]
    close = difflib.get_close_matches(key, names, n=2, cutoff=0.75)
    if not close:
        last = key.rsplit(".", 1)[-1]
        close = [n for n in names if n.rsplit(".", 1)[-1] == last][:3]
    return ("did you mean " + " or ".join(f"`{c}`" for c in close) + "?") if close else ""
