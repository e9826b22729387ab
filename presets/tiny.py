"""CPU presets on the built-in tiny model and synthetic task: run in minutes on 2 cores, no downloads."""

from __future__ import annotations

from rlconf.config import RLConfig
from rlconf.fields import replace_paths


def tiny_grpo() -> RLConfig:
    """GRPO on the synthetic counting task; the dataclass defaults are this run, stated explicitly here,
    except the micro-batches: 16 responses (a tiny model pays megatron's fixed cost per micro-batch, not
    per token: 0.23 -> 0.12 s per step on 2 cores with one micro-batch instead of eight, the same updates;
    docs/benchmarks.md), so that each of two data-parallel ranks still gets whole micro-batches
    (--cluster.gpus_per_node 2, or 3 with a separate rollout device)."""
    return replace_paths(
        RLConfig(),
        {
            "cluster.device": "cpu",
            "cluster.gpus_per_node": 1,
            "data.synthetic_task": "count",
            "data.train_batch_size": 8,
            "rollout.n": 8,
            "rollout.max_response_length": 16,
            "algorithm.adv_estimator": "grpo",
            "actor.optim.lr": 1e-3,
            "actor.ppo_mini_batch_size": 4,
            "actor.ppo_micro_batch_size_per_gpu": 16,
            "actor.log_prob_micro_batch_size_per_gpu": 64,
            "trainer.total_steps": 100,
            "trainer.test_freq": 25,
            "trainer.save_freq": 50,
            "trainer.max_ckpt_to_keep": 2,
            "trainer.val_before_train": True,
            "trainer.output_dir": "outputs/tiny-grpo",
            "trainer.experiment_name": "tiny-grpo",
        },
    )


def tiny_ppo() -> RLConfig:
    """PPO with GAE and a critic on the same model and task; the KL penalty in the reward uses the ref.

    One response per prompt, so 64 prompts a step give the 64 responses tiny-grpo's 8 x 8 do; lam 1.0 (the
    only reward is at the last token: the advantage is that reward minus the critic's value, not a sum
    discounted through the critic's early, wrong values), the critic at 3e-3 and trained alone for its
    first 5 steps, so that its values mean something before the actor follows them. Measured on 2 cores
    (100 steps, ~40 s of steps): train reward 0.03 -> 0.49 (mean of the first and last 10 steps),
    validation 0.00 -> 0.47; with lam 0.95, critic lr 1e-3, no warmup and 16 prompts a step it was
    0.03 -> 0.15 and validation flat at 0.18 from step 25. An actor lr of 2e-3 reaches 0.70 / 0.75 but with
    a dip (0.67 -> 0.30) where one update's KL jumped to 0.2, so the lr stays tiny-grpo's 1e-3. Micro-batches of 8 responses keep whole
    micro-batches on each of two data-parallel ranks (--cluster.gpus_per_node 2)."""
    return replace_paths(
        tiny_grpo(),
        {
            "algorithm.adv_estimator": "gae",
            "algorithm.lam": 1.0,
            "algorithm.use_kl_in_reward": True,
            "rollout.n": 1,
            "data.train_batch_size": 64,
            "actor.ppo_mini_batch_size": 16,
            "actor.ppo_micro_batch_size_per_gpu": 8,
            "actor.log_prob_micro_batch_size_per_gpu": 64,
            "critic.enable": True,
            "critic.optim.lr": 3e-3,
            "critic.ppo_mini_batch_size": 16,
            "critic.ppo_micro_batch_size_per_gpu": 8,
            "trainer.critic_warmup": 5,
            "trainer.output_dir": "outputs/tiny-ppo",
            "trainer.experiment_name": "tiny-ppo",
        },
    )


def tiny_dapo() -> RLConfig:
    """DAPO (Yu et al. 2025) on the tiny-grpo model and task: clip-higher (0.2 / 0.28), token-mean loss,
    dynamic sampling (groups whose score does not vary are dropped and more prompts generated) and the soft
    overlong penalty over the last 4 of 16 response tokens; no KL, as in the DAPO recipe."""
    return replace_paths(
        tiny_grpo(),
        {
            "actor.clip_ratio_low": 0.2,
            "actor.clip_ratio_high": 0.28,
            "actor.loss_agg_mode": "token-mean",
            "algorithm.filter_groups.enable": True,
            "algorithm.filter_groups.metric": "score",
            "algorithm.filter_groups.max_num_gen_batches": 10,
            "reward.overlong_buffer.enable": True,
            "reward.overlong_buffer.len": 4,
            "reward.overlong_buffer.penalty_factor": 0.5,
            "trainer.output_dir": "outputs/tiny-dapo",
            "trainer.experiment_name": "tiny-dapo",
        },
    )


def tiny_tool() -> RLConfig:
    """Multi-turn tool use on CPU: the tiny model learns to call the calculator for a product it cannot
    compute (synthetic task `mul`, "47*8=" -> "376"), with the exact answer as the reward (numeric_match on
    the whole response, tool answers included). In the built-in tokenizer's call syntax
    (rltrain.tokenizer.CHAR_TOOL_CALL_FORMAT) a bare `>` asks the calculator about the question; its answer
    comes back as observation tokens `=376` and a newline, masked out of the loss, and the model should then
    stop: 8 response tokens leave room for the call, the answer and two more tokens (a digit there changes
    the last number, so stopping is part of what is learnt). The `python` tool is offered too, as a run
    with a real model would: its calls run in the sandbox (rltrain/tools/sandbox.py), so validation checks
    that this machine can build it (rule tool-sandbox); the tiny model's bare calls go to the calculator."""
    return replace_paths(
        tiny_grpo(),
        {
            "data.synthetic_task": "mul",
            "reward.function": "numeric_match",
            "rollout.max_response_length": 8,
            "rollout.multi_turn.enable": True,
            "rollout.multi_turn.max_assistant_turns": 2,
            "rollout.multi_turn.tools": ("calculator", "python"),
            "trainer.output_dir": "outputs/tiny-tool",
            "trainer.experiment_name": "tiny-tool",
        },
    )


def tiny_grpo_moe() -> RLConfig:
    """GRPO on the counting task with a tiny Qwen3-MoE-shaped model (QK-norm, 4 experts of width 64, top-2
    with renormalised routing) split over two CPU workers by expert parallel (EP=2: two experts per worker,
    tokens exchanged by megatron's alltoall dispatcher; the dense layers are data parallel over the two)."""
    return replace_paths(
        tiny_grpo(),
        {
            "cluster.gpus_per_node": 2,
            "model.arch.family": "qwen3_moe",
            "model.arch.add_qkv_bias": False,
            "model.arch.qk_layernorm": True,
            "model.arch.num_moe_experts": 4,
            "model.arch.moe_router_topk": 2,
            "model.arch.moe_ffn_hidden_size": 64,
            "model.arch.moe_norm_topk_prob": True,
            "model.arch.moe_aux_loss_coeff": 0.001,
            "actor.megatron.expert_model_parallel_size": 2,
            # Each of the two data-parallel ranks gets 16 of a mini-batch's 32 responses: one micro-batch.
            "actor.ppo_micro_batch_size_per_gpu": 16,
            "actor.log_prob_micro_batch_size_per_gpu": 32,
            "trainer.output_dir": "outputs/tiny-grpo-moe",
            "trainer.experiment_name": "tiny-grpo-moe",
        },
    )


def tiny_grpo_mla() -> RLConfig:
    """GRPO on the counting task with a tiny DeepSeek-V3-shaped model (family deepseek_v3): multi-head latent
    attention (q latent 32, kv latent 32, 16 + 8 rope dims per query / key head, values 16 wide), one dense
    layer first (first_k_dense_replace 1), then 8 routed experts of width 32 in 4 groups (a token picks 2
    groups, then its top 4 experts in them, on sigmoid scores plus a frozen score bias, weights renormalised
    and scaled by 2.5) beside one shared expert, a load-balancing loss (coefficient 0.01); one CPU worker, the
    embedded rollout on the latent KV cache."""
    return replace_paths(
        tiny_grpo(),
        {
            "model.arch.family": "deepseek_v3",
            "model.arch.add_qkv_bias": False,
            "model.arch.num_query_groups": 4,
            "model.arch.multi_latent_attention": True,
            "model.arch.q_lora_rank": 32,
            "model.arch.kv_lora_rank": 32,
            "model.arch.qk_head_dim": 16,
            "model.arch.qk_pos_emb_head_dim": 8,
            "model.arch.v_head_dim": 16,
            "model.arch.kv_channels": 24,
            "model.arch.rotary_interleaved": True,
            "model.arch.num_moe_experts": 8,
            "model.arch.moe_router_topk": 4,
            "model.arch.moe_ffn_hidden_size": 32,
            "model.arch.moe_shared_expert_intermediate_size": 32,
            "model.arch.moe_norm_topk_prob": True,
            "model.arch.moe_dense_layers": (0,),
            "model.arch.moe_router_score_function": "sigmoid",
            "model.arch.moe_router_enable_expert_bias": True,
            "model.arch.moe_router_num_groups": 4,
            "model.arch.moe_router_group_topk": 2,
            "model.arch.moe_router_topk_scaling_factor": 2.5,
            # The score bias is frozen during RL; without a balancing term this tiny router sends every token
            # to the same two groups within ten steps (expert load max 2.0 = experts / topk).
            "model.arch.moe_aux_loss_coeff": 0.01,
            "trainer.output_dir": "outputs/tiny-grpo-mla",
            "trainer.experiment_name": "tiny-grpo-mla",
        },
    )
