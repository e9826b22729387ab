"""How one megatron role's engine settings are resolved from the config (`engine_settings`, compile_plan's
`TrainerPlan.engines`; the dataclasses, `EngineSettings` and `EnginePlan`, are rlconf.plan.types').

Every "None means X" of the megatron and model sections is decided here (the MoE load-balancing coefficient
and expert FFN size, recompute defaults, overlap_param_gather only with the distributed optimizer, the seed,
the tokenizer folder, the forward batching, the fused kernels); the layout (tp, pp, vpp, cp, ep, etp,
sequence parallel, padded vocabulary) is the role's RoleLayout. rltrain.megatron builds TransformerConfig,
the process groups, DDP and the optimizer from these values alone.
"""

from __future__ import annotations

from rlconf.config import (
    ModelArch,
    RLConfig,
)
from rlconf.errors import ConfigError
from rlconf.plan.roles import (
    forward_batching,
    megatron_of,
    overlaps_param_gather,
    packing_blocker,
    packing_issue,
)
from rlconf.plan.types import (
    ENGINE_ROLES,
    DdpSettings,
    EngineSettings,
    ModelSpec,
    MoeSettings,
    OffloadSettings,
    Recompute,
    TransformerSettings,
)
from rlconf.seeding import resolve_seed


# ============================================================================================ resolution
def engine_settings(
    c: RLConfig, roles: tuple[str, ...], models: tuple[ModelSpec, ...]
) -> tuple[EngineSettings, ...]:
    """The resolved engine settings of every megatron role present (compile_plan)."""
    return tuple(
        _settings(c, role, next(m.arch for m in models if role in m.used_by))
        for role in ENGINE_ROLES
        if role in roles
    )


def _settings(c: RLConfig, role: str, arch: ModelArch) -> EngineSettings:
    m = megatron_of(c, role)[1]
    separate_rollout = role == "rollout"
    ov = m.override_transformer_config
    ddp = m.override_ddp_config
    micro, dynamic, budget = forward_batching(c, role)
    tok = c.model.tokenizer_path if c.model.tokenizer_path is not None else c.model.path
    full = ov.recompute_granularity == "full"
    selective = ov.recompute_granularity == "selective"
    return EngineSettings(
        role=role,
        transformer=TransformerSettings(
            params_dtype=c.model.params_dtype,
            attention_backend=c.model.attention_backend,
            init_method_std=c.model.init_method_std,
            moe_grouped_gemm=c.model.moe_grouped_gemm,
            attention_dropout=ov.attention_dropout,
            hidden_dropout=ov.hidden_dropout,
            recompute=Recompute(
                granularity=ov.recompute_granularity,
                method=(ov.recompute_method or "uniform") if full else None,
                num_layers=(ov.recompute_num_layers or 1) if full else None,
                modules=tuple(ov.recompute_modules) if selective else (),
            ),
            # A separate rollout runs the whole model on one pipeline stage.
            num_layers_in_first_pipeline_stage=None
            if separate_rollout
            else m.num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=None
            if separate_rollout
            else m.num_layers_in_last_pipeline_stage,
            account_for_embedding_in_pipeline_split=(
                False if separate_rollout else m.account_for_embedding_in_pipeline_split
            ),
            account_for_loss_in_pipeline_split=False
            if separate_rollout
            else m.account_for_loss_in_pipeline_split,
        ),
        moe=None
        if arch.num_moe_experts is None
        else MoeSettings(
            aux_loss_coeff=arch.moe_aux_loss_coeff
            if ov.moe_aux_loss_coeff is None
            else ov.moe_aux_loss_coeff,
            z_loss_coeff=ov.moe_z_loss_coeff,
            router_dtype=c.model.moe_router_dtype,
            ffn_hidden_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
        ),
        ddp=DdpSettings(
            use_distributed_optimizer=m.use_distributed_optimizer,
            grad_reduce_in_fp32=ddp.grad_reduce_in_fp32,
            overlap_grad_reduce=ddp.overlap_grad_reduce,
            overlap_param_gather=overlaps_param_gather(m),
            bucket_size=ddp.bucket_size,
            average_in_collective=ddp.average_in_collective,
        ),
        offload=OffloadSettings(
            params=m.param_offload and not separate_rollout,
            grads=m.grad_offload and not separate_rollout,
            optimizer=m.optimizer_offload and not separate_rollout,
        ),
        seed=resolve_seed(m.seed, c.trainer.seed),
        dist_checkpointing_path=(
            m.dist_checkpointing_path if m.use_dist_checkpointing and not separate_rollout else None
        ),
        tokenizer_path=tok,
        forward_micro_batch_size=micro,
        forward_use_dynamic_bsz=bool(dynamic),
        forward_max_token_len=budget if dynamic else None,
        fused_kernels=fused_kernels(c),
        fused_kernels_setting=c.model.fused_kernels,
        **_remove_padding(c, role, arch),
    )


def _remove_padding(c: RLConfig, role: str, arch: ModelArch) -> dict[str, bool | str]:
    """EngineSettings' remove_padding and its reason (model.use_remove_padding: null = where supported)."""
    setting = c.model.use_remove_padding
    blocker = packing_blocker(c, role, arch)
    if setting is False:
        return {"remove_padding": False, "remove_padding_reason": "model.use_remove_padding false"}
    if blocker is not None and setting and role != "rollout":
        # The model-source rule refuses this before a plan is compiled, except for what only the model folder's
        # config.json tells (a mixture-of-experts model).
        raise ConfigError([packing_issue(role, blocker)])
    if blocker is not None:
        return {"remove_padding": False, "remove_padding_reason": f"model.use_remove_padding null: {blocker}"}
    why = "model.use_remove_padding true" if setting else "model.use_remove_padding null: supported here"
    return {"remove_padding": True, "remove_padding_reason": why}


def fused_kernels(c: RLConfig) -> bool:
    """Whether the engines run torch.compile'd fused kernels: `model.fused_kernels`, auto = on cuda."""
    if c.model.fused_kernels == "auto":
        return c.cluster.device == "cuda"
    return c.model.fused_kernels == "compiled"
