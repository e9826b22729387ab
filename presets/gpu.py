"""GPU presets for Qwen2.5-shaped models on Megatron (random init unless model.path points at weights)."""

from __future__ import annotations

from rlconf.config import ModelArch, RLConfig
from rlconf.fields import replace_paths

QWEN25_05B = ModelArch(
    num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14, num_query_groups=2,
    vocab_size=151936, max_position_embeddings=32768, rotary_base=1000000.0,
    share_embeddings_and_output_weights=True,
)  # fmt: skip
QWEN25_15B = ModelArch(
    num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12, num_query_groups=2,
    vocab_size=151936, max_position_embeddings=32768, rotary_base=1000000.0,
    share_embeddings_and_output_weights=True,
)  # fmt: skip
QWEN25_7B = ModelArch(
    num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4,
    vocab_size=152064, max_position_embeddings=32768, rotary_base=1000000.0,
    share_embeddings_and_output_weights=False,
)  # fmt: skip


def qwen25_05b_grpo() -> RLConfig:
    """GRPO with a KL loss on one 80 GiB-class GPU: the shape of verl's GSM8K quick start."""
    return replace_paths(
        RLConfig(),
        {
            "model.arch": QWEN25_05B,
            "model.params_dtype": "bfloat16",
            "model.attention_backend": "auto",
            "cluster.device": "cuda",
            "cluster.gpus_per_node": 1,
            "cluster.device_memory_gib": 80.0,
            "data.train_batch_size": 64,
            "data.max_prompt_length": 512,
            "data.synthetic_task": "add",
            "reward.function": "numeric_match",
            "rollout.n": 8,
            "rollout.max_response_length": 1024,
            "algorithm.adv_estimator": "grpo",
            "actor.optim.lr": 1e-6,
            "actor.optim.lr_warmup_steps_ratio": 0.0,
            "actor.optim.weight_decay": 0.01,
            "actor.ppo_mini_batch_size": 16,
            "actor.ppo_micro_batch_size_per_gpu": 8,
            "actor.use_dynamic_bsz": True,
            "actor.ppo_max_token_len_per_gpu": 16384,
            "actor.log_prob_micro_batch_size_per_gpu": 32,
            "actor.use_kl_loss": True,
            "actor.kl_loss_coef": 0.001,
            "ref.log_prob_micro_batch_size_per_gpu": 32,
            "trainer.total_steps": 200,
            "trainer.save_freq": 50,
            "trainer.test_freq": 25,
            "trainer.max_ckpt_to_keep": 2,
            "trainer.output_dir": "outputs/qwen2.5-0.5b-grpo",
            "trainer.experiment_name": "qwen2.5-0.5b-grpo",
        },
    )


def qwen25_15b_grpo() -> RLConfig:
    """The 0.5B GRPO recipe on the 1.5B shape (one GPU)."""
    return replace_paths(
        qwen25_05b_grpo(),
        {
            "model.arch": QWEN25_15B,
            "actor.ppo_max_token_len_per_gpu": 12288,
            "trainer.output_dir": "outputs/qwen2.5-1.5b-grpo",
            "trainer.experiment_name": "qwen2.5-1.5b-grpo",
        },
    )


def qwen25_15b_ppo_tp2() -> RLConfig:
    """PPO with GAE and a colocated critic at TP=2 on two GPUs."""
    tp2 = {
        "megatron.tensor_model_parallel_size": 2,
        "megatron.sequence_parallel": True,
    }
    return replace_paths(
        qwen25_15b_grpo(),
        {
            "cluster.gpus_per_node": 2,
            "algorithm.adv_estimator": "gae",
            "algorithm.lam": 0.95,
            "rollout.n": 1,
            "data.train_batch_size": 256,
            "actor.ppo_mini_batch_size": 64,
            "actor.use_kl_loss": False,
            "critic.enable": True,
            "critic.optim.lr": 1e-5,
            "critic.ppo_mini_batch_size": 64,
            "critic.use_dynamic_bsz": True,
            "critic.ppo_max_token_len_per_gpu": 16384,
            **{f"actor.{k}": v for k, v in tp2.items()},
            **{f"ref.{k}": v for k, v in tp2.items()},
            **{f"critic.{k}": v for k, v in tp2.items()},
            "rollout.tensor_model_parallel_size": 2,
            "trainer.output_dir": "outputs/qwen2.5-1.5b-ppo-tp2",
            "trainer.experiment_name": "qwen2.5-1.5b-ppo-tp2",
        },
    )


def qwen25_7b_grpo_tp4pp2() -> RLConfig:
    """GRPO on the 7B shape over one 8-GPU node: TP=4 x PP=2 (DP=1), distributed optimizer, recompute."""
    layout = {
        "megatron.tensor_model_parallel_size": 4,
        "megatron.pipeline_model_parallel_size": 2,
        "megatron.sequence_parallel": True,
    }
    return replace_paths(
        qwen25_05b_grpo(),
        {
            "model.arch": QWEN25_7B,
            "cluster.gpus_per_node": 8,
            "data.train_batch_size": 128,
            "actor.ppo_mini_batch_size": 32,
            "actor.ppo_max_token_len_per_gpu": 8192,
            "actor.megatron.override_transformer_config.recompute_granularity": "full",
            "actor.megatron.override_transformer_config.recompute_method": "uniform",
            "actor.megatron.override_transformer_config.recompute_num_layers": 1,
            **{f"actor.{k}": v for k, v in layout.items()},
            **{f"ref.{k}": v for k, v in layout.items()},
            "rollout.tensor_model_parallel_size": 4,
            "trainer.output_dir": "outputs/qwen2.5-7b-grpo-tp4pp2",
            "trainer.experiment_name": "qwen2.5-7b-grpo-tp4pp2",
        },
    )


def qwen25_05b_dapo() -> RLConfig:
    """DAPO on the qwen2.5-0.5b-grpo setup: clip-higher (0.2 / 0.28), token-mean loss, dynamic sampling on
    the score, the overlong penalty over the last 256 of 1024 response tokens, and no KL (the DAPO recipe
    drops it). Dynamic sampling needs groups whose scores differ: the reward is digit_match's partial credit
    (numeric_match's all-or-nothing left 2 of 64 groups varying on the random-init shape, so the step stopped
    at its generation-batch bound), and the number of generation batches per step is unbounded, as in verl
    (max_num_gen_batches 0): a step generates until 64 groups are kept, however many batches that takes.
    On the built-in random-init shape almost no group varies (measured on one H200: no step within ~110 s), so
    run it with model.path set to a real model; the random-init presets above measure speed."""
    return replace_paths(
        qwen25_05b_grpo(),
        {
            "actor.use_kl_loss": False,
            "actor.clip_ratio_low": 0.2,
            "actor.clip_ratio_high": 0.28,
            "actor.clip_ratio_c": 10.0,
            "actor.loss_agg_mode": "token-mean",
            "algorithm.filter_groups.enable": True,
            "algorithm.filter_groups.metric": "score",
            "algorithm.filter_groups.max_num_gen_batches": 0,
            "reward.function": "digit_match",
            "reward.overlong_buffer.enable": True,
            "reward.overlong_buffer.len": 256,
            "reward.overlong_buffer.penalty_factor": 1.0,
            "trainer.output_dir": "outputs/qwen2.5-0.5b-dapo",
            "trainer.experiment_name": "qwen2.5-0.5b-dapo",
        },
    )


def qwen25_05b_tool() -> RLConfig:
    """Multi-turn tool use on the qwen2.5-0.5b-grpo setup: the calculator on the `mul` task, up to 4
    assistant turns in 1024 response tokens (tool output included, never trained on), no KL. With a real
    model.path the model's own chat template and the Hermes / Qwen JSON `<tool_call>` format are used; on the
    built-in random-init shape the character tokenizer's call syntax is."""
    return replace_paths(
        qwen25_05b_grpo(),
        {
            "data.synthetic_task": "mul",
            "actor.use_kl_loss": False,
            "rollout.multi_turn.enable": True,
            "rollout.multi_turn.max_assistant_turns": 4,
            "rollout.multi_turn.max_tool_response_length": 64,
            "rollout.multi_turn.tools": ("calculator",),
            "trainer.output_dir": "outputs/qwen2.5-0.5b-tool",
            "trainer.experiment_name": "qwen2.5-0.5b-tool",
        },
    )


QWEN3_MOE_3B = ModelArch(
    family="qwen3_moe", num_layers=24, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16,
    num_query_groups=4, kv_channels=128, vocab_size=151936, max_position_embeddings=32768,
    rotary_base=1000000.0, add_qkv_bias=False, qk_layernorm=True, share_embeddings_and_output_weights=False,
    num_moe_experts=64, moe_router_topk=8, moe_ffn_hidden_size=512, moe_norm_topk_prob=True,
    moe_aux_loss_coeff=0.001,
)  # fmt: skip
"""Qwen3-MoE's shape (QK-norm, head_dim 128, 64 routed experts, top 8 renormalised, no shared expert)
scaled to one GPU: ~2.9B parameters, ~0.8B active per token."""


def qwen3_moe_grpo() -> RLConfig:
    """GRPO with a KL loss on a Qwen3-MoE-shaped model (random init) on one H200: the 1.5B recipe with the
    expert layers on grouped GEMM; rollout on the embedded engine (MoE layers in its CUDA-graph decode step)."""
    return replace_paths(
        qwen25_05b_grpo(),
        {
            "model.arch": QWEN3_MOE_3B,
            "model.moe_grouped_gemm": True,
            "cluster.device_memory_gib": 139.0,
            "data.train_batch_size": 32,
            "actor.ppo_mini_batch_size": 8,
            # Micro-batches of 24,576 tokens (8 per mini-batch -> 4): the MoE layers' passes are bound by
            # the host launching their small kernels, a cost per micro-batch, so a larger one runs the
            # update 1.40x and the log-prob passes 2.1x faster on the H200 with the same updates
            # (docs/benchmarks.md, 2026-12-05); the update's peak is ~102 GiB of the 139.
            "actor.ppo_max_token_len_per_gpu": 24576,
            # The log-prob passes keep no activations: twice the update's budget (half their micro-batches)
            # took the old log-prob and ref passes from 1.20-1.51 / 1.07-1.20 s to 1.11-1.15 / 1.05-1.06 s on the
            # H200 (log-prob peak 70.6 GiB; docs/benchmarks.md, 2026-12-05, twelfth session).
            "actor.log_prob_max_token_len_per_gpu": 49152,
            "ref.log_prob_max_token_len_per_gpu": 49152,
            "trainer.output_dir": "outputs/qwen3-moe-grpo",
            "trainer.experiment_name": "qwen3-moe-grpo",
        },
    )
