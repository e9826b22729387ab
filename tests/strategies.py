"""Hypothesis strategies for rlplan configs.

`valid_configs()` draws `RLConfig`s that pass `rlconf.validate.check_config` BY CONSTRUCTION (no
filtering, so drawing stays fast): the parallel layouts are drawn first and everything that must divide
or be divided by them is derived from them.

    from hypothesis import given
    from tests.strategies import valid_configs

    @given(valid_configs())
    def test_something(config): ...

What is varied: the advantage estimator; ref on/off (through actor.use_kl_loss / use_kl_in_reward);
critic on/off, colocated or in its own pool, with its own layout; a reward model (rarely) colocated or
separate; tp / pp / cp / dp of every role, vpp, sequence parallel, the distributed optimizer, recompute and
offload flags; fixed or dynamic micro-batches; rollout.n and tp; the architecture (heads and query groups
multiples of every tp, layers a multiple of every pp x vpp); params dtype; every lr decay style (WSD with
its tail), warmup by steps or ratio; checkpoint cadence, contents and retention; resume mode; profiling
(tool, discrete or continuous, steps, ranks, roles, save path); cpu or cuda, nodes.

Invariants the strategy guarantees (beyond validation), so property tests can rely on them:
- cluster.device_memory_gib is None (the memory check never fires), trainer.total_steps <= 50, and at
  most `max_devices` devices (16 by default);
- lr warmup < the decay steps (megatron's OptimizerParamScheduler asserts this), min_lr <= lr, lr > 0;
- responses per mini-batch divide evenly over dp x micro-batch (or dp with dynamic batch sizes), and
  the gradient-accumulation count is a multiple of pp when vpp is set (megatron's interleaved schedule);
- data.train_batch_size x rollout.n is a multiple of the actor pool size (rollout dp splits evenly);
- expert parallelism stays 1 (the built-in architecture is dense); model.path is None.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from rlconf.config import (
    ROLES,
    ActorConfig,
    AlgorithmConfig,
    Checkpoint,
    ClusterConfig,
    CriticConfig,
    DataConfig,
    MegatronConfig,
    ModelArch,
    ModelConfig,
    Optim,
    OverrideTransformerConfig,
    ProfileConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    RLConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = ["valid_configs"]


def _divisors(n: int, at_most: int) -> list[int]:
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


@st.composite
def _layout_in(draw: st.DrawFn, world: int) -> tuple[int, int, int | None, int]:
    """(tp, pp, vpp, cp) whose product divides `world`."""
    tp = draw(st.sampled_from(_divisors(world, 4)))
    pp = draw(st.sampled_from(_divisors(world // tp, 4)))
    cp = 1  # context parallel is rejected by validation until the engine supports it
    vpp = draw(st.sampled_from([None, 2])) if pp > 1 else None
    return tp, pp, vpp, cp


@st.composite
def _fresh_layout(draw: st.DrawFn, max_world: int) -> tuple[int, int, int | None, int, int]:
    """(tp, pp, vpp, cp, dp) with tp x pp x cp x dp <= max_world."""
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if t <= max_world]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if tp * p <= max_world]))
    cp = 1  # context parallel is rejected by validation until the engine supports it
    dp = draw(st.integers(1, max(1, min(4, max_world // (tp * pp * cp)))))
    vpp = draw(st.sampled_from([None, 2])) if pp > 1 else None
    return tp, pp, vpp, cp, dp


@st.composite
def _megatron(draw: st.DrawFn, tp: int, pp: int, vpp: int | None, cp: int) -> MegatronConfig:
    granularity = draw(st.sampled_from([None, "selective", "full"]))
    method = draw(st.sampled_from(["uniform", "block"])) if granularity == "full" else None
    override = OverrideTransformerConfig(
        recompute_granularity=granularity,
        recompute_method=method,
        recompute_num_layers=draw(st.sampled_from([None, 1, 2])) if granularity == "full" else None,
        recompute_modules=draw(
            st.sampled_from([("core_attn",), ("mlp",), ("core_attn", "mlp", "layernorm")])
        ),
    )
    return MegatronConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        sequence_parallel=draw(st.booleans()),
        use_distributed_optimizer=draw(st.booleans()),
        param_offload=draw(st.booleans()),
        grad_offload=draw(st.booleans()),
        optimizer_offload=draw(st.booleans()),
        override_transformer_config=override,
    )


@st.composite
def _optim(draw: st.DrawFn, total_steps: int) -> Optim:
    lr = draw(st.sampled_from([1e-6, 1e-5, 3e-4, 1e-3, 0.5]))
    min_lr = lr * draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    # Warmup strictly below the decay steps (megatron asserts it); by steps or by ratio.
    by_ratio = draw(st.booleans())
    if by_ratio:
        ratio = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5]))
        warmup_steps, warmup = None, round(ratio * total_steps)
    else:
        ratio = 0.0
        warmup_steps = warmup = draw(st.integers(0, total_steps - 1))
    decay = draw(st.one_of(st.none(), st.integers(warmup + 1, max(warmup + 1, total_steps + 5))))
    if decay is None and warmup >= total_steps:  # only possible by ratio with total_steps == 1
        decay = warmup + 1
    style = draw(st.sampled_from(["constant", "linear", "cosine", "inverse-square-root", "WSD"]))
    decay_span = decay if decay is not None else total_steps
    return Optim(
        optimizer=draw(st.sampled_from(["adam", "sgd"])),
        lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps,
        lr_warmup_steps_ratio=ratio,
        lr_warmup_init=lr * draw(st.sampled_from([0.0, 0.1])),
        lr_decay_steps=decay,
        lr_decay_style=style,
        lr_wsd_decay_steps=draw(st.one_of(st.none(), st.integers(1, max(1, decay_span)))),
        lr_wsd_decay_style=draw(st.sampled_from(["linear", "cosine", "exponential", "minus_sqrt"])),
        weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])),
    )


@st.composite
def _checkpoint(draw: st.DrawFn) -> Checkpoint:
    extra = draw(st.lists(st.sampled_from(["optimizer", "extra", "hf_model"]), unique=True, max_size=3))
    save = ("model", *extra)
    load = tuple(x for x in save if draw(st.booleans()))
    return Checkpoint(save_contents=save, load_contents=load, async_save=draw(st.booleans()))


def _mini_unit(dp: int, micro: int, n: int, accum_multiple: int) -> int:
    """Smallest prompts-per-mini-batch m with m x n a multiple of dp x micro x accum_multiple."""
    q = dp * micro * accum_multiple
    return q // math.gcd(q, n)


@st.composite
def valid_configs(draw: st.DrawFn, max_devices: int = 16) -> RLConfig:
    """An RLConfig that passes validation, drawn from small sizes (see the module docstring)."""
    total_steps = draw(st.integers(1, 50))

    # --- layouts first: everything else is derived from them
    a_tp, a_pp, a_vpp, a_cp, a_dp = draw(_fresh_layout(max(1, max_devices // 2)))
    actor_world = a_tp * a_pp * a_cp * a_dp
    use_kl_loss = draw(st.booleans())
    use_kl_in_reward = draw(st.booleans())
    uses_ref = use_kl_loss or use_kl_in_reward
    # The reference policy runs in the actor's processes, so it shares the actor's layout.
    r_tp, r_pp, r_vpp, r_cp = a_tp, a_pp, a_vpp, a_cp

    critic_enable = draw(st.booleans())
    critic_separate = critic_enable and draw(st.booleans())
    if critic_separate:
        c_tp, c_pp, c_vpp, c_cp, c_dp = draw(_fresh_layout(max(1, max_devices - actor_world)))
        critic_world = c_tp * c_pp * c_cp * c_dp
    else:
        c_tp, c_pp, c_vpp, c_cp = draw(_layout_in(actor_world))
        critic_world = actor_world
        c_dp = actor_world // (c_tp * c_pp * c_cp)

    rm_enable = draw(st.integers(0, 9)) == 0
    room = max_devices - actor_world - (critic_world if critic_separate else 0)
    rm_separate = rm_enable and room >= 1 and draw(st.booleans())
    if rm_separate:
        m_tp, m_pp, m_vpp, m_cp, m_dp = draw(_fresh_layout(room))
        rm_world = m_tp * m_pp * m_cp * m_dp
    else:
        m_tp, m_pp, m_vpp, m_cp = draw(_layout_in(actor_world))
        rm_world = 0
    rollout_tp = a_tp  # the embedded rollout runs in the actor's layout

    total_devices = actor_world + (critic_world if critic_separate else 0) + rm_world
    nnodes = draw(st.sampled_from(_divisors(total_devices, 4)))

    # --- architecture: heads and groups multiples of every tp, layers of every pp x vpp
    tps = [a_tp, rollout_tp] + ([r_tp] if uses_ref else []) + ([c_tp] if critic_enable else [])
    tps += [m_tp] if rm_enable else []
    t = math.lcm(*tps)
    chunks = [a_pp * (a_vpp or 1)] + ([r_pp * (r_vpp or 1)] if uses_ref else [])
    chunks += [c_pp * (c_vpp or 1)] if critic_enable else []
    chunks += [m_pp * (m_vpp or 1)] if rm_enable else []
    groups = t * draw(st.integers(1, 2))
    heads = groups * draw(st.integers(1, 2))
    max_prompt = draw(st.integers(1, 32))
    max_response = draw(st.integers(1, 32))
    # q/k/v biases come with the family: qwen2 has them, llama has none.
    family, qkv_bias = draw(st.sampled_from([("qwen2", True), ("llama", False)]))
    arch = ModelArch(
        family=family,
        num_layers=math.lcm(*chunks) * draw(st.integers(1, 2)),
        hidden_size=heads * draw(st.sampled_from([4, 8])),
        ffn_hidden_size=t * draw(st.integers(1, 6)) * 8,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=draw(st.integers(16, 300)),
        max_position_embeddings=max_prompt + max_response + draw(st.integers(0, 64)),
        add_qkv_bias=qkv_bias,
        share_embeddings_and_output_weights=draw(st.booleans()),
    )

    # --- batches
    estimator = draw(st.sampled_from(["gae"] if critic_enable else ["grpo", "rloo", "reinforce_plus_plus"]))
    n = draw(st.integers(2, 4)) if estimator in ("grpo", "rloo") else draw(st.integers(1, 4))
    a_dynamic = a_vpp is None and draw(st.booleans())
    c_dynamic = c_vpp is None and draw(st.booleans())
    a_micro = draw(st.integers(1, 4))
    c_micro = draw(st.integers(1, 4))
    # With dynamic batch sizes only dp must divide a mini-batch's responses.
    a_unit = _mini_unit(a_dp, 1 if a_dynamic else a_micro, n, a_pp if a_vpp else 1)
    c_unit = _mini_unit(c_dp, 1 if c_dynamic else c_micro, n, c_pp if c_vpp else 1)
    a_mini = a_unit * draw(st.integers(1, 2))
    c_mini = c_unit * draw(st.integers(1, 2)) if critic_enable else 1
    rollout_unit = actor_world // math.gcd(actor_world, n)
    train_batch = math.lcm(a_mini, c_mini, rollout_unit) * draw(st.integers(1, 2))
    seq = max_prompt + max_response

    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    device = draw(st.sampled_from(["cpu", "cuda"]))

    actor = ActorConfig(
        megatron=draw(_megatron(a_tp, a_pp, a_vpp, a_cp)),
        optim=draw(_optim(total_steps)),
        checkpoint=draw(_checkpoint()),
        ppo_mini_batch_size=a_mini,
        ppo_micro_batch_size_per_gpu=a_micro,
        use_dynamic_bsz=a_dynamic,
        ppo_max_token_len_per_gpu=seq * draw(st.integers(1, 3)),
        log_prob_micro_batch_size_per_gpu=draw(st.integers(1, 8)),
        ppo_epochs=draw(st.integers(1, 2)),
        use_kl_loss=use_kl_loss,
    )
    ref = RefConfig(megatron=draw(_megatron(r_tp, r_pp, r_vpp, r_cp)))
    critic = CriticConfig(
        enable=critic_enable,
        placement="separate" if critic_separate else "colocated",
        num_devices=critic_world if critic_separate else 0,
        megatron=draw(_megatron(c_tp, c_pp, c_vpp, c_cp)) if critic_enable else MegatronConfig(),
        optim=draw(_optim(total_steps)) if critic_enable else Optim(),
        checkpoint=draw(_checkpoint()) if critic_enable else Checkpoint(),
        ppo_mini_batch_size=c_mini,
        ppo_micro_batch_size_per_gpu=c_micro,
        use_dynamic_bsz=c_dynamic,
        ppo_max_token_len_per_gpu=seq * draw(st.integers(1, 3)),
        ppo_epochs=draw(st.integers(1, 2)),
    )
    reward = RewardConfig(
        reward_model=RewardModelConfig(
            enable=rm_enable,
            placement="separate" if rm_separate else "colocated",
            num_devices=rm_world,
            megatron=draw(_megatron(m_tp, m_pp, m_vpp, m_cp)) if rm_enable else MegatronConfig(),
        )
    )

    # --- run, profile
    save_freq = draw(st.integers(0, total_steps))
    resume_mode = draw(st.sampled_from(["auto", "disable", "resume_path"]))
    trainer = TrainerConfig(
        total_steps=total_steps,
        output_dir=draw(st.sampled_from(["outputs/run", "/tmp/rlplan-out", "out"])),
        save_freq=save_freq,
        resume_mode=resume_mode,
        resume_from_path="outputs/run/checkpoints/global_step_1" if resume_mode == "resume_path" else None,
        max_ckpt_to_keep=draw(st.sampled_from([None, 1, 2, 3])),
        critic_warmup=draw(st.integers(0, min(2, total_steps - 1))),
    )
    present = {"generate_sequences", "actor_compute_log_prob", "actor_update", "reward_compute"}
    present |= {"ref_compute_log_prob"} if uses_ref else set()
    present |= {"critic_compute_values", "critic_update"} if critic_enable else set()
    tool = draw(st.sampled_from(["none", "torch", "nsys"] if device == "cuda" else ["none", "torch"]))
    profile = ProfileConfig(
        tool=tool,
        discrete=draw(st.booleans()),
        steps=tuple(draw(st.lists(st.integers(1, total_steps), min_size=1, max_size=3, unique=True))),
        ranks=tuple(draw(st.lists(st.integers(0, total_devices - 1), min_size=1, max_size=3, unique=True))),
        all_ranks=draw(st.booleans()),
        roles=tuple(
            draw(st.lists(st.sampled_from([r for r in ROLES if r in present]), unique=True, max_size=3))
        ),
        save_path=draw(st.sampled_from(["profile", "/tmp/rlplan-profile", "traces/run"])),
    )
    return RLConfig(
        model=ModelConfig(arch=arch, params_dtype=dtype),
        data=DataConfig(train_batch_size=train_batch, max_prompt_length=max_prompt),
        actor=actor,
        ref=ref,
        critic=critic,
        rollout=RolloutConfig(n=n, max_response_length=max_response, tensor_model_parallel_size=rollout_tp),
        reward=reward,
        algorithm=AlgorithmConfig(adv_estimator=estimator, use_kl_in_reward=use_kl_in_reward),
        trainer=trainer,
        cluster=ClusterConfig(device=device, nnodes=nnodes, gpus_per_node=total_devices // nnodes),
        profile=profile,
    )
