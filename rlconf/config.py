"""The rlplan configuration tree: frozen dataclasses, the single source of every default.

Each section is a small dataclass owned by the component that reads it. The string literal under a field
is its documentation: it becomes CLI help (tyro), the JSON Schema description and the reference docs.
Derived values (effective layouts, resolved paths, schedules) are not stored here; they live in the
trainer plan (`rlconf.plan`). This module imports nothing beyond the standard library, its own sections
(rlconf.profile_config) and the leaf names of rlconf.profile_vocab and rlconf.vocab, which it re-exports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Sections in modules of their own, re-exported (`from rlconf.config import ProfileConfig` keeps working).
from rlconf.profile_config import LoggingConfig, ProfileConfig

# Leaf vocabulary the plan carries verbatim (profiling options, roles, built-in tools): rlconf.profile_vocab,
# re-exported here so the config's whole vocabulary still imports from this module.
from rlconf.profile_vocab import BUILTIN_TOOLS as BUILTIN_TOOLS
from rlconf.profile_vocab import ROLES as ROLES
from rlconf.profile_vocab import (  # noqa: F401
    NpuProfileOptions,
    NsysProfileOptions,
    ProfileTool,
    Role,
    TorchProfileOptions,
)
from rlconf.vocab import AdvEstimator, KLKind, LossAggMode, PolicyLossMode

# Names shared by validation, the plan and the workers. Kept here so that the whole vocabulary of the
# config lives in one module.
Device = Literal["cpu", "cuda", "npu"]
DecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
CheckpointContent = Literal["model", "optimizer", "extra", "hf_model"]
CHECKPOINT_CONTENTS: tuple[str, ...] = CheckpointContent.__args__
# Rule-based reward functions shipped with rltrain (rltrain.rewards registers exactly these names).
BUILTIN_REWARDS: tuple[str, ...] = (
    "exact_match", "numeric_match", "format", "digit_match",
    # verl's scorers, with verl's signature (rltrain/reward_scores.py); default_compute_score dispatches on
    # each row's data_source as verl's default does.
    "default_compute_score", "gsm8k", "gsm8k_flexible", "math", "math_dapo",
)  # fmt: skip


# --------------------------------------------------------------------------------------------- model
ModelFamily = Literal[
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"
]
"""Hugging Face model_type values rlplan reads and writes (rlconf.model_spec.FAMILIES has their features)."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for long context (Hugging Face rope_parameters / rope_scaling)."""

    type: Literal["none", "linear", "llama3", "yarn"] = "none"
    """none: plain RoPE; linear: positions divided by factor; llama3: Llama 3.1 / 3.2 per-frequency
    scaling; yarn: YaRN (Qwen long-context configs)."""
    factor: float = 1.0
    """Scaling factor (context extension ratio)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by
    factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int | None = None
    """llama3 / yarn: the context length of pre-training; None means max_position_embeddings."""
    beta_fast: float = 32.0
    """yarn: rotations above which frequencies are kept (extrapolated)."""
    beta_slow: float = 1.0
    """yarn: rotations below which frequencies are interpolated."""
    mscale: float | None = None
    """yarn (DeepSeek): the attention factor's mscale (rope_scaling.mscale); None: 0.1 ln(factor) + 1."""
    mscale_all_dim: float | None = None
    """yarn (DeepSeek): mscale_all_dim; the softmax scale is multiplied by (0.1 mscale_all_dim ln(factor) + 1)^2
    and the rope attention factor divided by the same term."""


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer described with Megatron's names: the built-in random-init model, or what
    rlconf.model_spec reads from a Hugging Face config.json."""

    family: ModelFamily = "qwen2"
    """Hugging Face model_type this architecture follows; it fixes the weight names, the features that
    come with the family (qkv bias for qwen2, QK-norm for qwen3) and the config.json of exported
    checkpoints."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    ffn_hidden_size: int = 176
    """Inner width of the MLP (SwiGLU: the size of each of the gate and up projections)."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int = 2
    """Number of key/value heads (grouped-query attention); equal to num_attention_heads for MHA."""
    vocab_size: int = 32
    """Vocabulary size (padded by the engine to a multiple of 128 x tensor parallel size)."""
    max_position_embeddings: int = 256
    """Longest sequence the rotary embedding is built for (prompt + response)."""
    kv_channels: int | None = None
    """Per-head width; None means hidden_size / num_attention_heads."""
    rotary_base: float = 10000.0
    """RoPE base (rope_theta in Hugging Face configs)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    add_qkv_bias: bool = True
    """Bias on the query/key/value projection (Qwen2: true, Llama: false)."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output projection to the input embedding (tie_word_embeddings)."""
    qk_layernorm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3's q_norm / k_norm)."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """RoPE scaling for long context."""
    sliding_window: int | None = None
    """Attention window in tokens (Mistral, Qwen use_sliding_window); None: full causal attention. Runs are
    limited to sequences that fit in the window (where windowed and full attention agree)."""
    num_moe_experts: int | None = None
    """Routed experts per MoE layer (num_experts / num_local_experts); None: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (num_experts_per_tok)."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of each routed expert (moe_intermediate_size); None means ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token goes through (qwen2_moe); None: no shared expert."""
    moe_shared_expert_gate: bool = False
    """A sigmoid gate (hidden -> 1) scales the shared expert's output (qwen2_moe)."""
    moe_norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 (norm_topk_prob)."""
    moe_dense_layers: tuple[int, ...] = ()
    """0-based layers whose MLP is dense (ffn_hidden_size) instead of experts (Hugging Face mlp_only_layers
    and the layers decoder_sparse_step skips)."""
    moe_aux_loss_coeff: float = 0.0
    """Router load-balancing loss coefficient (router_aux_loss_coef)."""
    multi_latent_attention: bool = False
    """Multi-head latent attention (DeepSeek-V3 MLA): low-rank q / kv projections and a decoupled rope head;
    the q_lora_rank ... v_head_dim fields below apply."""
    q_lora_rank: int | None = None
    """MLA: rank of the query down-projection (q_a_proj); None: a full-rank q_proj."""
    kv_lora_rank: int = 512
    """MLA: rank of the compressed key/value latent (kv_a_proj_with_mqa), what the latent KV cache holds."""
    qk_head_dim: int = 128
    """MLA: per-head query/key width without rope (qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """MLA: per-head query/key rope width, one rope key shared by all heads (qk_rope_head_dim)."""
    v_head_dim: int = 128
    """MLA: per-head value width."""
    rotary_interleaved: bool = False
    """RoPE on interleaved (even, odd) pairs instead of the two halves (DeepSeek-V3's rope_interleave)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts, or a sigmoid per expert (DeepSeek-V3)."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only (DeepSeek-V3 e_score_correction_bias)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: experts split into this many groups (n_group); None: no groups."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: groups each token may choose experts from (topk_group)."""
    moe_router_topk_scaling_factor: float | None = None
    """Routing weights multiplied by this after top-k (routed_scaling_factor); None: 1."""
    num_mtp_layers: int = 0
    """Multi-token prediction layers stored after the decoder (num_nextn_predict_layers); transformers does not
    build them, and neither the parameter count nor training includes them."""


@dataclass(frozen=True)
class ModelConfig:
    """The policy model: a local Hugging Face folder or a built-in architecture with random init."""

    path: str | None = None
    """Local Hugging Face model folder (config.json + safetensors). None: build `arch` with random init."""
    arch: ModelArch = field(default_factory=ModelArch)
    """Built-in architecture, used when `path` is None (the plan reads config.json when it is set)."""
    tokenizer_path: str | None = None
    """Tokenizer folder; None means `path`, or the built-in character tokenizer when `path` is None."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the compute weights (fp32 master weights are kept by the optimizer for bf16/fp16)."""
    attention_backend: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Core attention: sdpa (torch scaled_dot_product_attention), local (megatron unfused), te (Transformer
    Engine), auto (te when installed, else sdpa)."""
    init_method_std: float = 0.02
    """Std of the random init when no weights are loaded."""
    fused_kernels: Literal["auto", "compiled", "eager"] = "auto"
    """Elementwise chains that dominate after the matmuls (SwiGLU, the log-prob / entropy reductions over
    the vocabulary, decode sampling and RoPE) as fused kernels generated by torch.compile (compiled) or as
    one torch op at a time (eager). auto: compiled on cuda, eager elsewhere. Same math: compiled rounds
    once where eager rounds after every op; compiling costs some seconds on each worker's first step."""
    moe_grouped_gemm: bool = False
    """Mixture-of-experts models: compute each layer's local experts with grouped GEMM (torch._grouped_mm
    on CUDA with bf16, the same math expert by expert elsewhere) instead of one pair of linears per expert.
    Same parameters and checkpoints either way. No effect on dense models."""


# ---------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class DataConfig:
    """Prompts: files (parquet / jsonl) or a built-in synthetic task."""

    train_files: tuple[str, ...] = ()
    """Training prompt files: .parquet, or .jsonl with one JSON object per line (checked to exist before
    the run starts). Empty: use the synthetic task."""
    val_files: tuple[str, ...] = ()
    """Validation prompt files. Empty: a held-out split of the synthetic task."""
    synthetic_task: Literal["count", "copy", "add", "mul"] = "count"
    """Built-in task used when train_files is empty (no download): count -> continue a digit sequence,
    copy -> repeat the prompt's digits, add -> sum two small numbers, mul -> a two-digit number times a
    digit (for tool use: the tiny model cannot multiply)."""
    prompt_key: str = "prompt"
    """Column (parquet) or key (jsonl) holding the prompt text or chat messages."""
    answer_key: str = "answer"
    """Column or key holding the ground truth passed to the reward function."""
    train_batch_size: int = 8
    """Prompts per training step."""
    val_batch_size: int = 16
    """Prompts per validation batch."""
    max_prompt_length: int = 16
    """Longest prompt in tokens; longer prompts are filtered out (or truncated, see `truncation`)."""
    truncation: Literal["error", "left", "right", "filter"] = "filter"
    """What to do with prompts longer than max_prompt_length."""
    apply_chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template (ignored by the built-in tokenizer)."""
    shuffle: bool = True
    """Shuffle prompts each epoch."""
    seed: int | None = None
    """Seed of the prompt order and of the synthetic task. None: trainer.seed (resolved once, in the
    plan); set it to change the prompts while keeping the rest of the run's randomness."""


# ---------------------------------------------------------------------------------- megatron engine
@dataclass(frozen=True)
class OverrideTransformerConfig:
    """Fields forwarded to megatron-core's TransformerConfig (activation recompute and dropout)."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recompute: None (off), selective (recompute_modules only), full (whole layers)."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With full recompute: uniform (every recompute_num_layers layers as a chunk) or block (the first
    recompute_num_layers layers of each stage)."""
    recompute_num_layers: int | None = None
    """Layers per recompute chunk (uniform) or recomputed layers per stage (block)."""
    recompute_modules: tuple[
        Literal["core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj"], ...
    ] = ("core_attn",)
    """Submodules recomputed with selective granularity."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (RL fine-tuning normally keeps this 0)."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP (RL fine-tuning normally keeps this 0)."""
    moe_aux_loss_coeff: float | None = None
    """Mixture-of-experts load-balancing loss coefficient; None: the model's router_aux_loss_coef
    (config.json, or model.arch.moe_aux_loss_coeff). No effect on dense models."""
    moe_z_loss_coeff: float | None = None
    """Mixture-of-experts router z-loss coefficient (mean squared logsumexp of the router logits); None: off,
    as in transformers. No effect on dense models."""


@dataclass(frozen=True)
class DDPConfig:
    """Fields forwarded to megatron-core's DistributedDataParallelConfig."""

    grad_reduce_in_fp32: bool = True
    """Reduce gradients in fp32 even when compute is bf16."""
    overlap_grad_reduce: bool = False
    """Overlap the gradient reduce-scatter/all-reduce with the backward pass."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward."""
    bucket_size: int | None = None
    """Gradient bucket size in elements; None lets megatron choose."""
    average_in_collective: bool = False
    """Average inside the collective instead of pre-scaling gradients."""


# MegatronConfig's fields that make up a role's parallel layout (process grid), in megatron's order.
LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-core parallel layout and engine options for one role (actor, ref or critic)."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (TP): splits each layer's matmuls across devices."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (PP): splits the layers into stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Virtual pipeline stages per device (interleaved 1F1B); needs pipeline_model_parallel_size > 1."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Decoder layers of the first pipeline stage (megatron's uneven split; the middle stages share the rest
    evenly). None: an even split. Not with the account_for_* options."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Decoder layers of the last pipeline stage (megatron's uneven split). None: an even split."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting the layers into stages (the first stage builds one
    decoder layer fewer): (num_layers + 1 [+ 1 for the loss]) must divide by pp (x vpp)."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the loss (output layer) as one layer when splitting the layers into stages (the last stage
    builds one decoder layer fewer)."""
    context_parallel_size: int = 1
    """Context parallel size (CP): splits each sequence across devices."""
    expert_model_parallel_size: int = 1
    """Expert parallel size (EP) for mixture-of-experts layers."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallel size inside experts; None means tensor_model_parallel_size."""
    sequence_parallel: bool = False
    """Split layer-norm and dropout activations along the sequence across TP ranks (use it with TP > 1;
    with TP = 1 it is switched off and a warning says so, as megatron does)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""
    param_offload: bool = False
    """Move parameters to host memory while another role uses the device."""
    grad_offload: bool = False
    """Move gradients to host memory while another role uses the device."""
    optimizer_offload: bool = False
    """Move optimizer state to host memory while another role uses the device."""
    use_dist_checkpointing: bool = False
    """Initialise weights from the megatron dist (torch_dist) checkpoint at dist_checkpointing_path instead
    of HF or random init (model weights only; any TP/PP layout)."""
    dist_checkpointing_path: str | None = None
    """An rlplan role checkpoint folder (checkpoints/global_step_N/actor or .../critic) used when
    use_dist_checkpointing is true."""
    seed: int | None = None
    """Seed of this role's weight initialisation and the base of its per-step dropout and mini-batch
    shuffle streams (megatron's model-parallel RNG tracker, reseeded each step from (seed, step, purpose)).
    None: trainer.seed (resolved once, in the plan)."""
    override_transformer_config: OverrideTransformerConfig = field(default_factory=OverrideTransformerConfig)
    """Overrides applied to megatron's TransformerConfig."""
    override_ddp_config: DDPConfig = field(default_factory=DDPConfig)
    """Overrides applied to megatron's DistributedDataParallelConfig."""


@dataclass(frozen=True)
class Optim:
    """Optimizer and learning-rate schedule (megatron OptimizerParamScheduler semantics)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer (adam is AdamW: decoupled weight decay)."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_warmup_steps: int | None = None
    """Warmup steps; None derives them from lr_warmup_steps_ratio x total steps."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a fraction of trainer.total_steps, used when lr_warmup_steps is None."""
    lr_warmup_init: float = 0.0
    """Learning rate at step 1 of warmup (rises linearly to lr)."""
    lr_decay_steps: int | None = None
    """Steps over which lr decays from lr to min_lr after warmup; None means trainer.total_steps."""
    lr_decay_style: DecayStyle = "constant"
    """Shape of the decay after warmup."""
    lr_wsd_decay_steps: int | None = None
    """WSD only: length of the final decay phase; None means 10% of lr_decay_steps."""
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    """WSD only: shape of the final decay phase."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norms)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam beta1 and beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""


@dataclass(frozen=True)
class Checkpoint:
    """What a role saves and loads (layout under trainer.output_dir/checkpoints)."""

    save_contents: tuple[CheckpointContent, ...] = ("model", "optimizer", "extra")
    """Parts written at each save: model (dist checkpoint), optimizer, extra (RNG, step, dataloader,
    KL controller, scheduler), hf_model (safetensors loadable by transformers)."""
    load_contents: tuple[CheckpointContent, ...] = ("model", "optimizer", "extra")
    """Parts restored on resume; must be a subset of save_contents."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""


# ------------------------------------------------------------------------------------------- roles
@dataclass(frozen=True)
class PolicyLossConfig:
    """Which policy-gradient loss the actor minimises, and the options of the modes that have some."""

    loss_mode: PolicyLossMode = "vanilla"
    """vanilla: PPO clip (clip_ratio_low / high) with dual clip; gspo: sequence-level importance ratio
    (GSPO; verl recipes clip it at about 3e-4 / 4e-4 and aggregate seq-mean-token-mean); gpg: -A x logp,
    no ratio (GPG); clip-cov / kl-cov: PPO clip that detaches / KL-penalises high-covariance tokens (Cui et
    al. 2025); cispo: clipped, stop-gradient IS weight x A x logp (MiniMax-M1); sapo: a sigmoid soft gate
    on the ratio instead of a hard clip (SAPO, tau_pos / tau_neg; aggregated seq-mean-token-mean, its
    paper's objective, as verl)."""
    clip_cov_ratio: float = 0.0002
    """clip-cov: fraction of valid tokens whose gradient is detached (drawn among those in the covariance
    band)."""
    clip_cov_lb: float = 1.0
    """clip-cov: lower bound of the covariance band of candidate tokens."""
    clip_cov_ub: float = 5.0
    """clip-cov: upper bound of the covariance band of candidate tokens."""
    kl_cov_ratio: float = 0.0002
    """kl-cov: fraction of valid tokens (the highest covariance) that get the |log-ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """kl-cov: weight of the |log-ratio| penalty on the selected tokens."""
    tau_pos: float = 1.0
    """sapo: temperature of the soft gate for positive advantages (larger: closer to a hard clip)."""
    tau_neg: float = 1.05
    """sapo: temperature of the soft gate for negative advantages."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the policy's linear layers (rltrain/megatron/lora.py): the base weights stay frozen,
    only the adapters train; with a KL term the reference policy is the same engine with adapters off."""

    rank: int = 0
    """Adapter rank r (0: off, full fine-tuning)."""
    alpha: float = 16.0
    """Scaling numerator: the adapter's output is multiplied by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1) (PEFT's lora_dropout)."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Linear layers that get adapters: megatron names linear_qkv, linear_proj, linear_fc1, linear_fc2, or
    Hugging Face names q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (q_proj alone adapts
    only the query slice of the fused linear_qkv); all-linear: every attention and MLP linear (on a
    mixture-of-experts model: attention only; experts are not adapted yet)."""
    exclude_modules: tuple[str, ...] = ()
    """fnmatch patterns of adapted modules to leave out, matched against megatron paths with global layer
    numbers (decoder.layers.0.self_attention.linear_qkv, decoder.layers.*.mlp.linear_fc2) and the Hugging
    Face ones (model.layers.0.self_attn.q_proj); each must match an adapted module."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """Initial adapters (B is zero either way, so training starts at the base model): kaiming: A
    kaiming-uniform (PEFT's default); gaussian: A normal with std 1 / rank."""
    adapter_path: str | None = None
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start from instead of a
    fresh adapter; its rank, alpha and targets must equal these."""


@dataclass(frozen=True)
class ActorConfig:
    """The policy being trained (PPO/GRPO actor) on the Megatron engine."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout and engine options (megatron-core is the one training engine, CPU and GPU)."""
    optim: Optim = field(default_factory=Optim)
    """Optimizer and lr schedule."""
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    """Checkpoint contents."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (rank 0: full fine-tuning)."""
    ppo_mini_batch_size: int = 4
    """Prompts per optimizer update (each with rollout.n responses); train_batch_size / this = updates
    per epoch."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Responses per forward/backward on one data-parallel rank (ignored with use_dynamic_bsz)."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by a token budget (ppo_max_token_len_per_gpu) instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = 4096
    """Token budget of one micro-batch per rank when use_dynamic_bsz is true."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Responses per forward when computing log-probs (no backward, so it can be larger)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    shuffle: bool = True
    """Shuffle responses between mini-batches."""
    clip_ratio: float = 0.2
    """PPO clip epsilon."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon (asymmetric clipping, DAPO); None means clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (asymmetric clipping, DAPO); None means clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss (loss_mode) and its options."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses are averaged into the batch loss."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL(actor || ref) term to the loss (GRPO style); needs the ref role."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: KLKind = "low_var_kl"
    """KL estimator used in the loss."""
    router_replay: bool = False
    """Mixture-of-experts models only: record the experts each token was routed to during rollout generation
    (embedded engine) and route every token to them again in the policy's old log-prob and update passes
    (verl's R3, megatron's RouterReplay); the router's probabilities still come from the current weights,
    so it keeps learning. Removes the rollout / training mismatch that near-tied router scores cause."""


@dataclass(frozen=True)
class RefConfig:
    """The frozen reference policy (for the KL loss or KL-in-reward); colocated with the actor."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout of the reference model."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Responses per forward when computing reference log-probs."""


@dataclass(frozen=True)
class CriticConfig:
    """The value model (PPO with GAE)."""

    enable: bool = False
    """Train a critic; required by algorithm.adv_estimator = gae."""
    model_path: str | None = None
    """Local HF folder to initialise the critic from; None: the actor's model with a fresh value head."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: share the actor's devices; separate: own devices (num_devices of them)."""
    num_devices: int = 0
    """Devices of the critic's own pool when placement is separate."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout of the critic."""
    optim: Optim = field(default_factory=Optim)
    """Optimizer and lr schedule of the critic."""
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    """Checkpoint contents of the critic."""
    ppo_mini_batch_size: int = 4
    """Prompts per critic update."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Responses per forward/backward on one data-parallel rank."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by a token budget."""
    ppo_max_token_len_per_gpu: int = 4096
    """Token budget of one micro-batch per rank when use_dynamic_bsz is true."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    cliprange_value: float = 0.5
    """Value clipping range."""


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters used for validation rollouts."""

    n: int = 1
    """Samples per validation prompt."""
    temperature: float = 0.0
    """0 means greedy decoding; otherwise in [0.001, 100]."""
    top_p: float = 1.0
    """Nucleus sampling mass."""


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn, tool-using rollouts (verl's rollout.multi_turn): the model writes a tool call, the tool's
    output is appended as observation tokens (attended to, never trained on: response_mask 0), and the
    model goes on, until it ends its answer, runs out of turns or of tokens."""

    enable: bool = False
    """Run the agent loop instead of one response per prompt."""
    max_assistant_turns: int = 4
    """Most model turns per response (a turn ends at a tool call or at EOS)."""
    max_tool_response_length: int = 256
    """Most characters of one tool output shown to the model (longer outputs are cut and marked)."""
    max_total_tokens: int | None = None
    """Most tokens of one response, the model's and the tools' together; null: rollout.max_response_length
    (the plan sizes sequences by it, so a larger value is an error)."""
    tools: tuple[str, ...] = ("calculator",)
    """The tools the model may call: built-in names (calculator, python) or user tools as
    package.module:function (a function with a `schema` attribute) or package.module:Class (with `name`,
    `schema` and `__call__(arguments)`); imported like reward.function, never evaluated. With the built-in
    character tokenizer the call syntax `<ARGS>` calls the first tool."""
    tool_timeout_s: float = 5.0
    """Wall-clock limit of one tool call; a call that runs longer is cut off and its row marked."""
    tool_memory_mib: int = 256
    """Address-space limit of the python sandbox's subprocess."""
    max_parallel_tools: int = 8
    """Tool calls run at once, each in one of as many tool worker processes (never in the driver)."""
    sandbox: Literal["isolated", "none"] = "isolated"
    """How the python tool runs model-written code. isolated: in its own user, mount, PID, network and IPC
    namespaces with a read-only root, a private capped /tmp and a seccomp filter (rltrain/tools/sandbox.py;
    a machine that cannot build it fails validation, rule tool-sandbox); none: without isolation, for code
    you trust only (a warning on every run)."""
    interaction: str | None = None
    """Optional environment as package.module:Class giving feedback per turn and a final reward (see
    rltrain/rollout/agent.py `Interaction`); null: tools only."""


@dataclass(frozen=True)
class RolloutConfig:
    """Response generation."""

    engine: Literal["embedded", "vllm"] = "embedded"
    """embedded: rlplan's generator on the actor's own weights (CPU and GPU, no extra install);
    vllm: the optional vLLM adapter (extra [vllm])."""
    n: int = 8
    """Responses sampled per prompt."""
    max_response_length: int = 16
    """Most tokens generated per response."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts, in [0.001, 100]."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the top probability; 0 disables."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response (EOS always does)."""
    tensor_model_parallel_size: int | None = None
    """Tensor parallel size of the rollout engine; null (or the actor's tp) follows the actor's layout,
    pipeline stages included: the embedded engine generates on the actor's own weights, no copy. Another
    value must divide or be a multiple of the actor's tp: the rollout then runs at this tp without
    pipeline parallel (rollout dp = actor devices / tp), on the actor's weights resharded into it before
    every generation (gathered or split inside tp groups, stages gathered across pp) and freed after it."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: generate on the actor's devices, between its updates (no weight copy with the actor's
    layout). separate: the rollout gets num_devices devices of its own (the trainer keeps the rest) and a
    model in its own layout (tensor_model_parallel_size, no pipeline parallel), refreshed by a weight push
    from the trainer after every update; with algorithm.off_policy_steps > 0 the next batch is generated
    while the current one trains."""
    num_devices: int = 0
    """Devices of the rollout's own pool when placement is separate (a multiple of its tensor parallel
    size); 0 with placement colocated."""
    push_timeout_s: float = 600.0
    """placement separate: most seconds one weight push (and the set-up of its process group) may take; a
    side that does not answer in time (a dead or stuck worker) stops the run with an error naming it, and the
    run resumes from its last checkpoint. Also bounds every collective of the push group."""
    gpu_memory_utilization: float = 0.5
    """vLLM only (rollout.engine: vllm): fraction of device memory vLLM may use for weights and KV cache. The
    embedded engine's KV cache is sized by the plan (`rlconf plan` shows it in generate_sequences)."""
    max_num_seqs: int = 256
    """vLLM only (rollout.engine: vllm): most sequences vLLM decodes at once. The embedded engine decodes
    all rows of its data-parallel rank together."""
    cuda_graph: bool = True
    """Capture each embedded decode step (forward, logits, sampling) in CUDA graphs on cuda workers; no
    effect on cpu, npu or with pipeline parallel (they decode eagerly)."""
    free_cache_engine: bool = True
    """vLLM only (rollout.engine: vllm): put vLLM to sleep between rollouts (colocated training needs the
    memory back). The embedded engine always frees its KV cache after each generation."""
    val: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling for validation."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-using rollouts (the agent loop)."""


@dataclass(frozen=True)
class RewardModelConfig:
    """An optional learned reward model (a Megatron value-head model)."""

    enable: bool = False
    """Score responses with a reward model (added to the rule-based reward)."""
    path: str | None = None
    """Local HF folder of the reward model; None: the actor's model with a fresh head (for tests)."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: share the actor's devices; separate: own devices (num_devices of them)."""
    num_devices: int = 0
    """Devices of the reward model's own pool when placement is separate."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout of the reward model."""
    micro_batch_size_per_gpu: int = 8
    """Responses per forward."""


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO overlong reward shaping: a linear penalty over the last `len` tokens before the length limit."""

    enable: bool = False
    """Add min(0, (L_max - len - L) / len) x penalty_factor to the reward of a response of L tokens, where
    L_max is rollout.max_response_length (training rollouts only; validation reports the task reward)."""
    len: int = 0
    """Buffer length in tokens (0 < len <= rollout.max_response_length when enabled)."""
    penalty_factor: float = 1.0
    """Penalty of a response that reaches the limit (it grows linearly over the buffer)."""


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored."""

    function: str = "digit_match"
    """A built-in rule reward (exact_match, numeric_match, format, digit_match; verl's scorers gsm8k,
    gsm8k_flexible, math, math_dapo, and default_compute_score, which picks one by each row's
    data_source as verl does) or a user function: `package.module:function`, or verl's
    `path/to/file.py:function`. A user function is either rlplan's fn(response, ground_truth, prompt) or
    verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) (told apart by its
    parameter names), returning a float or a dict with a `score` key (its other numeric keys become
    reward_extra/ metrics). Trust: a user function runs code you chose, like a Python preset; the run
    imports it at start (running its top level); `rlconf validate` and `rltrain --dry-run` never import
    it (a file is only parsed, to check the function is defined there)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Optional learned reward model."""
    overlong_buffer: OverlongBuffer = field(default_factory=OverlongBuffer)
    """DAPO's soft penalty on responses that run into the length limit."""


@dataclass(frozen=True)
class KLControl:
    """Coefficient of the KL penalty in the reward."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: constant kl_coef; adaptive: steer towards target_kl (Ziegler et al.)."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient."""
    target_kl: float = 0.1
    """Adaptive only: target KL per token."""
    horizon: int = 10000
    """Adaptive only: responses over which the coefficient adapts."""


@dataclass(frozen=True)
class FilterGroups:
    """DAPO dynamic sampling: drop prompt groups whose responses all score alike, generate more prompts."""

    enable: bool = False
    """Drop every prompt group whose `metric` has zero spread (no learning signal) and generate further
    batches of data.train_batch_size prompts until data.train_batch_size groups are kept."""
    metric: Literal["score", "seq_reward"] = "score"
    """score: the reward function's score (verl's `acc` when that score is correctness); seq_reward: the
    score after the overlong penalty (reward.overlong_buffer)."""
    max_num_gen_batches: int = 0
    """Most generation batches per step before the step fails with an error; 0: unbounded (as in verl)."""


@dataclass(frozen=True)
class RolloutCorrection:
    """Correct for the gap between the rollout engine's log-probs and the trainer's (verl's names)."""

    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights pi_train / pi_rollout on the policy loss, truncated at rollout_is_threshold:
    token: per token; sequence: the product over the response; None: off."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the importance weights."""
    rollout_rs: Literal["token", "sequence"] | None = None
    """Rejection sampling: drop tokens (token) or whole responses (sequence) whose ratio pi_train /
    pi_rollout is outside [1 / rollout_rs_threshold, rollout_rs_threshold]; None: off."""
    rollout_rs_threshold: float = 2.0
    """Bound of the rejection-sampling ratio (its inverse is the lower bound)."""
    bypass_mode: bool = False
    """Use the rollout's log-probs as the old log-probs (skips the old log-prob pass)."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimation and the KL penalty."""

    adv_estimator: AdvEstimator = "grpo"
    """gae (needs a critic), grpo (norm_adv_by_std_in_grpo false: Dr. GRPO), rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline (group-mean baseline, then whitened over the batch), grpo_passk (only the
    best response of each group learns: r_max - r_second) or gpg (group-mean baseline scaled by the share of
    non-zero scores, GPG)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide group-relative advantages by the group's std (false: Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef x KL(actor || ref) from the token rewards; needs the ref role."""
    kl_penalty: KLKind = "kl"
    """KL estimator used in the reward."""
    kl_ctrl: KLControl = field(default_factory=KLControl)
    """KL coefficient controller."""
    filter_groups: FilterGroups = field(default_factory=FilterGroups)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    """Importance weighting and rejection sampling against the rollout engine's log-probs."""
    off_policy_steps: int = 0
    """0: on-policy (each batch is generated with the weights it trains). k > 0 (needs rollout.placement
    separate): the batch of step s may be generated with the weights after step s - 1 - k, so generation of
    the next batches overlaps the current update (1: one-step off-policy). The loss weighs tokens by
    pi_old / pi_rollout (algorithm.rollout_correction; token-level, truncated at rollout_is_threshold, when
    none is set) or takes the rollout's log-probs as the old ones (bypass_mode)."""


# ----------------------------------------------------------------------------------- run and cluster
@dataclass(frozen=True)
class TrainerConfig:
    """The run: length, outputs, saving and resuming."""

    total_steps: int = 100
    """Optimizer steps of the whole run (steps count from 1, across resumes)."""
    total_epochs: int | None = None
    """Passes over data.train_files instead of total_steps (leave total_steps at its default): steps =
    total_epochs x (prompts in the files // data.train_batch_size), derived once by the plan, which shows
    the count. Prompts are the files' rows (.jsonl: non-empty lines); rows that data.truncation = filter
    drops and the extra generation batches of algorithm.filter_groups make the run read more than
    total_epochs passes. Needs prompt files (a synthetic task has no epochs)."""
    output_dir: str = "outputs/rlplan"
    """Folder of config.yaml, plan.json, metrics.jsonl, checkpoints/ and plots."""
    project_name: str = "rlplan"
    """Project name shown by loggers."""
    experiment_name: str = "run"
    """Experiment name shown by loggers."""
    save_freq: int = 0
    """Save a checkpoint every this many steps (and at the last step); 0 disables saving."""
    test_freq: int = 0
    """Validate every this many steps; 0 disables validation."""
    val_before_train: bool = False
    """Validate once before the first step."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """auto: resume from the newest complete checkpoint if any; disable: start fresh; resume_path: resume
    from resume_from_path."""
    resume_from_path: str | None = None
    """Checkpoint folder (global_step_N) used with resume_mode = resume_path."""
    accept_config_changes: bool = False
    """Resume although the config differs from the one the run folder holds (its config.yaml with
    config_history.jsonl applied); the changes take effect from the next step and are recorded in
    config_history.jsonl. Not needed for logging, profile, names, saving, validation, Ray placement, or a
    total_steps that leaves the learning rates of the remaining steps as they were."""
    max_ckpt_to_keep: int | None = None
    """Keep at most this many complete checkpoints; None keeps all."""
    max_bad_steps: int = 3
    """Stop the run (exit code 3) after this many bad steps in a row: steps whose rewards, log-probs,
    values, advantages, loss or gradient norm are not finite. A bad step's update is not applied and it is
    not checkpointed; a finite step resets the count (a resume starts it at 0)."""
    critic_warmup: int = 0
    """Steps that train only the critic before the actor starts updating."""
    seed: int = 1
    """Root seed of the run. Every random stream derives from it by (seed, step, purpose): rollout and
    validation sampling, and through the seeds left None (data.seed, actor/ref/critic.megatron.seed) the
    prompt order, the synthetic task, weight init, dropout and mini-batch shuffling. A resumed run draws
    exactly what the uninterrupted run draws."""


@dataclass(frozen=True)
class ClusterConfig:
    """Where the run executes."""

    device: Device = "cpu"
    """cpu (gloo, CI and laptops), cuda (NCCL) or npu (Ascend, HCCL)."""
    nnodes: int = 1
    """Number of nodes."""
    gpus_per_node: int = 1
    """Devices per node (GPUs, NPUs, or worker processes on cpu)."""
    device_memory_gib: float | None = None
    """Memory of one device in GiB for the plan's memory check. None: on cpu, this machine's memory (MemTotal
    or the cgroup limit) shared by gpus_per_node workers; on an accelerator, no check."""
    ray_address: str | None = None
    """Ray cluster to join; None starts a local cluster (or joins RAY_ADDRESS when set)."""
    connect_timeout_s: float = 30.0
    """Longest wait for the Ray cluster to join (cluster.ray_address or RAY_ADDRESS) to answer; past it the
    run stops with an error naming the address, before anything is written."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each worker process."""


# ---------------------------------------------------------------------------------------------- root
@dataclass(frozen=True)
class RLConfig:
    """The whole run: every section, every default."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and batch size."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response generation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, outputs and checkpoints."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Devices and Ray."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Per-role profiling."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and logs."""


__all__ = [
    name
    for name in dir()
    if not name.startswith("_") and name not in ("annotations", "dataclass", "field", "Literal")
]
