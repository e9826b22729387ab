"""Tests of the trainer plan (rlconf.plan): properties over valid configs, hand-computed examples."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlconf.config import (
    ActorConfig,
    ClusterConfig,
    CriticConfig,
    DataConfig,
    MegatronConfig,
    ModelArch,
    ModelConfig,
    Optim,
    OverrideTransformerConfig,
    ProfileConfig,
    RewardConfig,
    RewardModelConfig,
    RLConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlconf.errors import ConfigError
from rlconf.fields import leaf_paths
from rlconf.plan import (
    MISSING,
    TrainerPlan,
    compile_plan,
    diff_plans,
    format_plan,
    lr_at,
    plan_to_dict,
)
from rlconf.plan.compile import _split_layers
from tests.strategies import valid_configs
from tests.typed_strategies import typed_configs

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ============================================================================================ properties
@PROPERTY
@given(valid_configs())
def test_valid_configs_compile_and_layouts_are_exact_grids(config: RLConfig) -> None:
    plan = compile_plan(config)  # never raises on a valid config
    assert plan.roles[:2] == ("actor", "rollout")
    for lay in plan.layouts:
        assert lay.dp * lay.tp * lay.pp * lay.cp == lay.world_size
        assert [g.rank for g in lay.grid] == list(range(lay.world_size))  # every rank exactly once
        coords = {(g.pp, g.tp, g.cp, g.dp) for g in lay.grid}
        assert len(coords) == lay.world_size  # and every coordinate exactly once
        for g in lay.grid:
            assert 0 <= g.tp < lay.tp and 0 <= g.pp < lay.pp and 0 <= g.cp < lay.cp and 0 <= g.dp < lay.dp
            assert g.rank == g.tp + lay.tp * (g.cp + lay.cp * (g.dp + lay.dp * g.pp))
            assert lay.rank_of(g.pp, g.tp, g.cp, g.dp) == g.rank
        assert sum(lay.layers_per_stage) == lay.num_layers
        assert lay.even_layers and len(set(lay.layers_per_stage)) == 1
        covered = sorted(
            i
            for st_ in lay.stages
            for ch in st_.chunks
            for i in range(ch.first_layer, ch.first_layer + ch.num_layers)
        )
        assert covered == list(range(lay.num_layers))  # chunks tile the layers
        # The embedded rollout runs in the actor's processes: the actor's layout, or (rollout tp set) a
        # layout of its own without sequence parallel (one decode token cannot be split over tp ranks).
        owner = "actor" if lay.role == "rollout" else lay.role
        if lay.role == "rollout" and plan.refit.mode != "zero-copy":
            assert not lay.sequence_parallel and lay.pp == 1
        else:
            assert lay.sequence_parallel == (lay.tp > 1 and _megatron(config, owner).sequence_parallel)
        assert (
            lay.padded_vocab_size % (128 * lay.tp) == 0
            and lay.padded_vocab_size >= plan.model(lay.model).arch.vocab_size
        )
    # Pools partition the devices.
    devices = [d for p in plan.resources.pools for d in range(p.first_device, p.first_device + p.num_devices)]
    assert devices == list(range(plan.resources.total_devices))


def _megatron(config: RLConfig, role: str) -> MegatronConfig:
    return {
        "actor": config.actor.megatron,
        "ref": config.ref.megatron,
        "critic": config.critic.megatron,
        "reward_model": config.reward.reward_model.megatron,
    }[role]


@PROPERTY
@given(valid_configs())
def test_batch_schedule_adds_up(config: RLConfig) -> None:
    plan = compile_plan(config)
    for b in plan.batch:
        assert b.even
        assert b.responses_per_step == config.data.train_batch_size * config.rollout.n
        assert b.mini_batches_per_step * b.mini_batch_prompts == b.prompts_per_step
        assert b.responses_per_mini_batch_per_rank * b.dp == b.responses_per_mini_batch
        if b.use_dynamic_bsz:
            assert b.micro_batch_size_per_rank is None and b.max_token_len_per_micro_batch is not None
            assert b.max_token_len_per_micro_batch >= b.max_seq_len
        else:
            assert (
                b.micro_batches_per_mini_batch * b.micro_batch_size_per_rank * b.dp
                == b.responses_per_mini_batch
            )
            if plan.layout(b.role).vpp is not None:
                assert b.micro_batches_per_mini_batch % plan.layout(b.role).pp == 0
        assert b.optimizer_steps_per_training_step == b.mini_batches_per_step * b.ppo_epochs
        assert b.optimizer_steps_total == b.optimizer_steps_per_training_step * b.update_steps


@PROPERTY
@given(valid_configs())
def test_lr_table_follows_warmup_and_bounds(config: RLConfig) -> None:
    plan = compile_plan(config)
    for o in plan.optim:
        assert len(o.table) == config.trainer.total_steps
        assert [r.step for r in o.table] == list(range(1, config.trainer.total_steps + 1))
        warm = [r.lr for r in o.table if r.scheduler_step <= o.warmup_steps]
        assert all(a <= b * (1 + 1e-12) for a, b in itertools.pairwise(warm)), warm
        tol = 1e-12 * o.lr
        for r in o.table:
            assert math.isfinite(r.lr)
            if r.scheduler_step > o.warmup_steps or o.warmup_steps == 0:
                assert o.min_lr - tol <= r.lr <= o.lr + tol, (r, o)
            else:
                assert min(o.lr_warmup_init, o.lr) - tol <= r.lr <= o.lr + tol


@PROPERTY
@given(valid_configs())
def test_plan_dict_is_json_and_stable(config: RLConfig) -> None:
    plan = compile_plan(config)
    d = plan_to_dict(plan)
    text = json.dumps(d, sort_keys=True, allow_nan=False)
    assert json.loads(text) == d  # plain JSON data: nothing is lost in a round trip
    assert json.dumps(plan_to_dict(compile_plan(config)), sort_keys=True) == text  # deterministic
    assert diff_plans(plan, plan) == []
    assert set(d) == {
        "version", "roles", "models", "resources", "layouts", "batch", "optim", "profile", "checkpoint",
        "memory", "run", "rollout", "data", "reward", "tokenizer", "refit", "length", "passes", "lora",
        "algorithm", "engines",
    }  # fmt: skip


@PROPERTY
@given(valid_configs())
def test_profile_checkpoint_and_memory_are_consistent(config: RLConfig) -> None:
    plan = compile_plan(config)
    p = plan.profile
    if p.enabled:
        assert set(p.steps) == set(config.profile.steps)  # valid configs list steps of the run only
        expected = {
            f"{p.save_path}/step_{s}/{t.role}/rank_{r}" for s in p.steps for t in p.targets for r in t.ranks
        }
        assert set(p.folders) == expected
        if p.mode == "continuous":
            assert [t.role for t in p.targets] == ["e2e"]
        for t in p.targets:
            world = 1 if t.worker == "controller" else plan.layout(t.worker).world_size
            assert all(0 <= r < world for r in t.ranks)
            if config.profile.all_ranks and t.worker != "controller":
                assert t.ranks == tuple(range(world))
        assert p.save_path == os.path.normpath(
            os.path.join(config.trainer.output_dir, config.profile.save_path)
        )
    else:
        assert p.folders == ()
    ck = plan.checkpoint
    if config.trainer.save_freq > 0:
        assert ck.save_steps[-1] == config.trainer.total_steps
        assert all(s % config.trainer.save_freq == 0 for s in ck.save_steps[:-1])
    else:
        assert ck.save_steps == ()
    assert [s.step for s in ck.saves] == list(ck.save_steps)
    assert {r.role for r in ck.roles} == {"actor"} | ({"critic"} if config.critic.enable else set())
    m = plan.memory
    assert m.device_memory_gib is None and m.fits is None
    for r in m.roles:
        parts = (r.params_gib, r.grads_gib, r.optimizer_gib, r.activations_gib, r.logits_gib)
        assert all(math.isfinite(x) and x >= 0 for x in parts)
        assert r.params_gib > 0 and r.total_gib == pytest.approx(sum(parts), abs=1e-5)
        assert (r.grads_gib > 0) == r.trained
    assert m.peak_gib == max(pm.peak_gib for pm in m.pools)


@settings(max_examples=50, deadline=None)
@given(valid_configs())
def test_format_plan_renders(config: RLConfig) -> None:
    text = format_plan(compile_plan(config))
    assert text.endswith("\n") and "layouts" in text and "memory estimate" in text


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(typed_configs())
def test_any_typed_config_plans_or_raises_config_error(config: RLConfig) -> None:
    """Configs that skipped validation (random values of the right types) never crash the plan."""
    plan = _plan_or_config_error(config)
    if plan is not None:
        json.dumps(plan_to_dict(plan))


def _plan_or_config_error(config: RLConfig) -> TrainerPlan | None:
    """The plan, or None when compile_plan raised a ConfigError whose errors all name a path."""
    try:
        return compile_plan(config)
    except ConfigError as exc:
        assert exc.errors and all(i.path for i in exc.errors)
        return None


_ODD_INTS = st.sampled_from([0, -1, 1, 2, 3, 7, 64, 1 << 20, 1 << 50])
_ODD_FLOATS = st.sampled_from([0.0, -1.0, 1e-12, 0.5, 2.0, 1e300, -1e300])


@st.composite
def _mutated_configs(draw: st.DrawFn) -> RLConfig:
    """A valid config with 1-3 numeric fields set to odd values (zero, negative, huge): the plan must
    either cope or raise ConfigError."""
    config = draw(valid_configs())
    numeric = [
        p
        for p in leaf_paths(RLConfig)
        if isinstance(_get(config, p), (int, float)) or _get(config, p) is None
    ]
    for path in draw(st.lists(st.sampled_from(numeric), min_size=1, max_size=3, unique=True)):
        value = _get(config, path)
        if isinstance(value, bool):
            new = draw(st.booleans())
        elif isinstance(value, float):
            new = draw(_ODD_FLOATS)
        else:
            new = draw(_ODD_INTS | st.none())
        config = _set(config, path, new)
    return config


def _get(obj: object, path: str) -> object:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(obj: object, path: str, value: object) -> object:
    head, _, rest = path.partition(".")
    return replace(obj, **{head: _set(getattr(obj, head), rest, value) if rest else value})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_configs())
def test_mutated_configs_plan_or_raise_config_error(config: RLConfig) -> None:
    plan = _plan_or_config_error(config)
    if plan is not None:
        json.dumps(plan_to_dict(plan))
        format_plan(plan)


def test_strategy_configs_pass_validation() -> None:
    """valid_configs() is valid by construction: rlconf.validate finds no error in what it draws."""
    validate = pytest.importorskip("rlconf.validate")

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(valid_configs())
    def check(config: RLConfig) -> None:
        errors = [i for i in validate.check_config(config) if i.severity == "error"]
        assert not errors, "\n".join(i.format() for i in errors)

    check()


# ============================================================================================ megatron lr oracle
def _megatron_scheduler_class() -> type | None:
    """megatron-core's OptimizerParamScheduler, loaded from its source without importing megatron.core
    (its package import costs seconds and needs torch); None when megatron-core is not installed."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "core" / "optimizer_param_scheduler.py"
    if not path.is_file():
        return None
    src = path.read_text().replace(
        "from megatron.core.utils import log_single_rank", "def log_single_rank(*args, **kwargs): pass"
    )
    namespace: dict[str, object] = {"__name__": "megatron_optimizer_param_scheduler_copy"}
    exec(compile(src, str(path), "exec"), namespace)
    return namespace["OptimizerParamScheduler"]  # type: ignore[return-value]


MEGATRON_SCHEDULER = _megatron_scheduler_class()


class _FakeOptimizer:
    def __init__(self) -> None:
        self.param_groups = [{}]


@pytest.mark.skipif(MEGATRON_SCHEDULER is None, reason="megatron-core is not installed")
@PROPERTY
@given(valid_configs())
def test_lr_table_matches_megatron_scheduler(config: RLConfig) -> None:
    """Row N's lr equals megatron's scheduler after N - 1 steps (one step(1) per training step)."""
    plan = compile_plan(config)
    o = plan.optim_plan("actor")
    sched = MEGATRON_SCHEDULER(
        _FakeOptimizer(),
        init_lr=o.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=o.decay_steps,
        lr_decay_style=o.decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=config.trainer.total_steps,
        wd_incr_style="constant",
        wsd_decay_steps=o.wsd_decay_steps,
        lr_wsd_decay_style=o.wsd_decay_style,
    )
    for row in o.table:
        if row.update:
            group = sched.optimizer.param_groups[0]
            assert row.lr == pytest.approx(group["lr"], rel=1e-9, abs=1e-15), row
            assert row.weight_decay == pytest.approx(group["weight_decay"])
            sched.step(1)


# ============================================================================================ examples
QWEN25_7B = ModelArch(
    num_layers=28,
    hidden_size=3584,
    ffn_hidden_size=18944,
    num_attention_heads=28,
    num_query_groups=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    add_qkv_bias=True,
    share_embeddings_and_output_weights=False,
)


def qwen7b_config(**cluster: object) -> RLConfig:
    """Qwen2.5-7B GRPO on 8 GPUs, actor at TP=4 x PP=2 (DP=1); every field the estimate uses is pinned."""
    megatron = MegatronConfig(
        tensor_model_parallel_size=4,
        pipeline_model_parallel_size=2,
        sequence_parallel=True,
        use_distributed_optimizer=True,
        override_transformer_config=OverrideTransformerConfig(recompute_granularity=None),
    )
    return RLConfig(
        model=ModelConfig(arch=QWEN25_7B, params_dtype="bfloat16"),
        data=DataConfig(train_batch_size=64, max_prompt_length=1024),
        actor=ActorConfig(
            megatron=megatron,
            optim=Optim(lr=1e-6),
            ppo_mini_batch_size=16,
            ppo_micro_batch_size_per_gpu=2,
            log_prob_micro_batch_size_per_gpu=2,
        ),
        rollout=RolloutConfig(n=8, max_response_length=3072, tensor_model_parallel_size=4),
        trainer=TrainerConfig(total_steps=20),
        cluster=ClusterConfig(device="cuda", nnodes=1, gpus_per_node=8, **cluster),  # type: ignore[arg-type]
    )


def test_qwen7b_layout_grid_and_stages() -> None:
    plan = compile_plan(qwen7b_config())
    lay = plan.layout("actor")
    assert (lay.world_size, lay.tp, lay.pp, lay.cp, lay.dp) == (8, 4, 2, 1, 1)
    assert lay.sequence_parallel
    # rank = tp + 4 * (cp + 1 * (dp + 1 * pp)): ranks 0-3 are stage 0's TP group, 4-7 stage 1's.
    g = {c.rank: (c.pp, c.tp, c.cp, c.dp) for c in lay.grid}
    assert g[0] == (0, 0, 0, 0)
    assert g[3] == (0, 3, 0, 0)
    assert g[4] == (1, 0, 0, 0)
    assert g[6] == (1, 2, 0, 0)
    assert g[7] == (1, 3, 0, 0)
    assert lay.layers_per_stage == (14, 14)
    assert [(s.chunks[0].first_layer, s.num_layers, s.embedding, s.output_layer) for s in lay.stages] == [
        (0, 14, True, False),
        (14, 14, False, True),
    ]
    assert lay.padded_vocab_size == 152064  # already a multiple of 128 x 4 = 512
    # The embedded rollout generates with the actor's weights: the actor's layout.
    assert plan.layout("rollout").grid == plan.layout("actor").grid
    assert plan.model("policy").params_total == 7_615_616_512  # Qwen2.5-7B: 7.62B


def test_grid_with_context_and_data_parallel() -> None:
    config = qwen7b_config()
    config = replace(
        config,
        actor=replace(
            config.actor,
            megatron=replace(
                config.actor.megatron,
                tensor_model_parallel_size=2,
                context_parallel_size=2,
                pipeline_model_parallel_size=2,
            ),
        ),
        cluster=replace(config.cluster, gpus_per_node=16),
    )
    lay = compile_plan(config).layout("actor")
    assert (lay.tp, lay.cp, lay.dp, lay.pp) == (2, 2, 2, 2)
    g = {c.rank: (c.pp, c.tp, c.cp, c.dp) for c in lay.grid}
    assert g[1] == (0, 1, 0, 0)  # tp fastest
    assert g[2] == (0, 0, 1, 0)  # then cp
    assert g[4] == (0, 0, 0, 1)  # then dp
    assert g[8] == (1, 0, 0, 0)  # pp slowest
    assert g[13] == (1, 1, 0, 1)  # 13 = 1 + 2 * (0 + 2 * (1 + 2 * 1))


def test_qwen7b_memory_estimate_matches_hand_computation() -> None:
    """Hand computation (actor, stage 0 = 14 layers + the embedding, TP=4, bf16, DP=1):

    per layer: qkv 3584 x (3584 + 2 x 512) + bias 4608, out 3584^2, MLP 3 x 3584 x 18944 = 233,050,624
    sharded over tp=4 -> 58,262,656, + 2 x 3584 replicated norm weights = 58,269,824; x 14 = 815,777,536;
    + embedding 152064 x 3584 / 4 = 136,249,344  ->  952,026,880 params on the device.
    weights bf16: 2 B -> 1.773 GiB; fp32 grads: 4 B -> 3.547 GiB; Adam fp32 master + m + v: 12 B, no
    sharding at dp x cp = 1 -> 10.640 GiB.
    activations: micro 2 x (1024 + 3072) = 8192 tokens; per token and layer (bf16, SP splits all by 4):
    norms 4h, attention 4q + 3g (qkv output, rotated q and k, SDPA output and its copy), MLP 3f with the
    fused SwiGLU (cuda: fused kernels) -> (14336 + 14336 + 1536 + 56832) / 4 = 21760 elements x 2 B =
    43,520 B; x 8192 tokens x 14 layers x 2 micro-batches in flight (first of 2 stages, 1F1B) = 9.297 GiB;
    the eager SwiGLU adds its silu output f / 4 = 4736 elements per token and layer.
    Total 1.773 + 3.547 + 10.640 + 9.297 = 25.26 GiB: plausible for 7B on 8 x 80 GB (verl runs it).
    With prompt files a micro-batch's rows may be max_prompt_length + max_response_length long; the
    synthetic task's prompts are 6 tokens (6 + 3072 columns).
    """
    config = qwen7b_config()
    files = replace(config, data=replace(config.data, train_files=("prompts.parquet",)))
    plan = compile_plan(files)
    synthetic = next(r for r in compile_plan(config).memory.roles if r.role == "actor")
    assert synthetic.tokens_per_micro_batch == 2 * (6 + 3072)
    m = next(r for r in plan.memory.roles if r.role == "actor")
    gib = 2**30
    assert m.stage == 0
    assert m.params_per_device == 952_026_880
    assert m.params_gib == pytest.approx(952_026_880 * 2 / gib, rel=1e-4)
    assert m.grads_gib == pytest.approx(952_026_880 * 4 / gib, rel=1e-4)
    assert m.optimizer_gib == pytest.approx(952_026_880 * 12 / gib, rel=1e-4)
    assert m.activations_gib == pytest.approx(43_520 * 8192 * 14 * 2 / gib, rel=1e-4)
    eager_config = replace(files, model=replace(files.model, fused_kernels="eager"))
    eager = next(r for r in compile_plan(eager_config).memory.roles if r.role == "actor")
    assert eager.activations_gib == pytest.approx((43_520 + 2 * 4736) * 8192 * 14 * 2 / gib, rel=1e-4)
    assert m.in_flight_micro_batches == 2
    assert 20 < m.total_gib < 30
    # The last stage holds the untied output layer and the fp32 logits slice: 8192 x 152064/4 x 4 B.
    pool = plan.memory.pools[0]
    assert pool.pool == "actor_pool" and 20 < pool.peak_gib < 40
    assert plan.memory.fits is None


def _update_bound_7b(device_memory_gib: float) -> RLConfig:
    """The 7B layout with one response per prompt (an estimator without groups): the update phase, not the
    rollout's KV cache, peaks."""
    config = qwen7b_config(device_memory_gib=device_memory_gib)
    algorithm = replace(config.algorithm, adv_estimator="reinforce_plus_plus")
    return replace(config, rollout=replace(config.rollout, n=1), algorithm=algorithm)


def test_memory_error_names_device_memory_and_concrete_fixes() -> None:
    with pytest.raises(ConfigError) as info:
        compile_plan(_update_bound_7b(16))
    exc = info.value
    assert exc.path == "cluster.device_memory_gib"
    issue = exc.errors[0]
    assert issue.rule == "memory-exceeds-device"
    assert "16 GiB" in issue.message and "actor optimizer" in issue.message and "GiB" in issue.message
    # Concrete options, each with its own estimate.
    assert "actor.megatron.override_transformer_config.recompute_granularity=full" in issue.fix
    assert "actor.ppo_micro_batch_size_per_gpu=1" in issue.fix
    assert "actor.megatron.tensor_model_parallel_size=" not in issue.fix or "GiB" in issue.fix
    assert "cluster.device_memory_gib" in issue.fix
    # Without the distributed optimizer at dp > 1 the fix suggests turning it on.
    config = _update_bound_7b(16)
    config = replace(
        config,
        actor=replace(
            config.actor,
            megatron=replace(
                config.actor.megatron, pipeline_model_parallel_size=1, use_distributed_optimizer=False
            ),
        ),
    )
    with pytest.raises(ConfigError) as info:
        compile_plan(config)
    assert "actor.megatron.use_distributed_optimizer=true" in info.value.errors[0].fix
    # A big enough device passes and says so.
    assert compile_plan(qwen7b_config(device_memory_gib=80)).memory.fits is True


def test_lr_values_cosine_linear_wsd() -> None:
    def table(optim: Optim, total: int) -> list[float]:
        config = RLConfig(actor=ActorConfig(optim=optim), trainer=TrainerConfig(total_steps=total))
        return [r.lr for r in compile_plan(config).optim_plan("actor").table]

    # cosine: warmup 2 from 0, decay over 12 steps. Step N uses the scheduler after N - 1 increments.
    lrs = table(Optim(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_style="cosine"), 12)
    assert lrs[0] == pytest.approx(0.0)  # step 1: lr_warmup_init
    assert lrs[1] == pytest.approx(5e-4)  # step 2: half-way through warmup
    assert lrs[2] == pytest.approx(1e-3)  # step 3: warmup done
    assert lrs[7] == pytest.approx(5.5e-4)  # step 8: decay ratio (7-2)/(12-2) = 0.5 -> min + 0.5 * 9e-4
    assert lrs[11] == pytest.approx(1e-4 + 0.5 * (math.cos(math.pi * 0.9) + 1) * 9e-4)  # step 12
    # linear, no warmup, over 10 steps: 1e-3 * (1 - (N - 1) / 10)
    lrs = table(Optim(lr=1e-3, min_lr=0.0, lr_decay_style="linear"), 10)
    assert lrs[0] == pytest.approx(1e-3) and lrs[5] == pytest.approx(5e-4) and lrs[9] == pytest.approx(1e-4)
    # WSD: stable until scheduler step 15 of 20, then a linear tail of 5 steps.
    lrs = table(Optim(lr=1e-3, lr_decay_style="WSD", lr_wsd_decay_steps=5), 20)
    assert lrs[15] == pytest.approx(1e-3)  # step 16: anneal starts after scheduler step 15
    assert lrs[16] == pytest.approx(8e-4)  # step 17
    assert lrs[19] == pytest.approx(2e-4)  # step 20
    # WSD tail defaults to 10% of the decay steps; warmup by ratio uses round(ratio x total_steps).
    plan = compile_plan(
        RLConfig(
            actor=ActorConfig(optim=Optim(lr_decay_style="WSD", lr_warmup_steps_ratio=0.25)),
            trainer=TrainerConfig(total_steps=20),
        )
    )
    o = plan.optim_plan("actor")
    assert (o.wsd_decay_steps, o.warmup_steps, o.granularity) == (2, 5, "training_step")
    assert o.warmup_steps == 5 and o.decay_steps == 20
    # inverse square root after 4 warmup steps: lr x sqrt(4 / 9) at step 10
    assert lr_at(
        Optim(lr=1e-3, lr_warmup_steps=4, lr_decay_style="inverse-square-root"), 9, 20
    ) == pytest.approx(1e-3 * 2 / 3)


def test_actor_lr_waits_for_critic_warmup() -> None:
    config = RLConfig(
        critic=CriticConfig(enable=True),
        actor=ActorConfig(optim=Optim(lr=1e-3, lr_warmup_steps=2)),
        trainer=TrainerConfig(total_steps=6, critic_warmup=2),
    )
    plan = compile_plan(config)
    rows = plan.optim_plan("actor").table
    assert [r.update for r in rows] == [False, False, True, True, True, True]
    assert [r.scheduler_step for r in rows] == [0, 0, 0, 1, 2, 3]
    assert plan.batch_plan("actor").first_update_step == 3 and plan.batch_plan("actor").update_steps == 4
    assert [r.update for r in plan.optim_plan("critic").table] == [True] * 6


_DROP = object()  # a config.json key to leave out


def _write_config_json(folder: Path, **overrides: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "model_type": "qwen2",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
    }
    data.update(overrides)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not _DROP}))
    return folder


def test_model_path_reads_config_json(tmp_path: Path) -> None:
    folder = _write_config_json(tmp_path / "tiny")
    plan = compile_plan(RLConfig(model=ModelConfig(path=str(folder))))
    arch = plan.model("policy").arch
    assert (arch.num_layers, arch.hidden_size, arch.ffn_hidden_size) == (4, 64, 128)
    assert (arch.num_attention_heads, arch.num_query_groups, arch.vocab_size) == (4, 2, 300)
    assert arch.rotary_base == 1e6 and arch.share_embeddings_and_output_weights and arch.add_qkv_bias
    assert plan.model("policy").source == str(folder / "config.json")
    assert plan.model("policy").arch == arch  # the plan carries the architecture read
    assert plan.layout("actor").layers_per_stage == (4,)
    # A missing num_key_value_heads means multi-head attention.
    folder = _write_config_json(tmp_path / "mha", num_key_value_heads=_DROP, model_type="llama")
    arch = compile_plan(RLConfig(model=ModelConfig(path=str(folder)))).model("policy").arch
    assert arch.num_query_groups == 4 and not arch.add_qkv_bias


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (lambda p: p, "does not exist"),
        (lambda p: (p.mkdir(), (p / "config.json").write_text("{not json"), p)[-1], "cannot read"),
        (lambda p: _write_config_json(p, hidden_size=_DROP), "hidden_size"),
        (lambda p: _write_config_json(p, num_hidden_layers="four"), "num_hidden_layers"),
    ],
)
def test_model_path_errors_name_model_path(tmp_path: Path, setup, needle: str) -> None:
    folder = setup(tmp_path / "model")
    with pytest.raises(ConfigError) as info:
        compile_plan(RLConfig(model=ModelConfig(path=str(folder))))
    assert info.value.path == "model.path"
    assert needle in info.value.errors[0].message


def test_config_json_architecture_is_checked_against_layouts(tmp_path: Path) -> None:
    """validate.py cannot see config.json: heads / layers vs tp / pp are checked by the plan."""
    # 12 heads over 3 KV heads at tp 4: 4 neither divides 3 nor is a multiple of it (megatron replicates
    # KV heads only when tp is a multiple of their count).
    folder = _write_config_json(tmp_path / "m", num_hidden_layers=3, num_attention_heads=12, num_key_value_heads=3,
                                hidden_size=96)  # fmt: skip
    config = RLConfig(
        model=ModelConfig(path=str(folder)),
        actor=ActorConfig(
            megatron=MegatronConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
        ),
        cluster=ClusterConfig(gpus_per_node=8),
        data=DataConfig(train_batch_size=8),
        rollout=RolloutConfig(n=4),
    )
    with pytest.raises(ConfigError) as info:
        compile_plan(config)
    rules = {(i.rule, i.path) for i in info.value.errors}
    assert ("heads-divisible-by-tp", "actor.megatron.tensor_model_parallel_size") in rules  # 3 groups, tp 4
    assert (
        "layers-divisible-by-pp",
        "actor.megatron.pipeline_model_parallel_size",
    ) in rules  # 3 layers, pp 2


def test_critic_model_path_error_names_critic_path(tmp_path: Path) -> None:
    config = RLConfig(critic=CriticConfig(enable=True, model_path=str(tmp_path / "nope")))
    with pytest.raises(ConfigError) as info:
        compile_plan(config)
    assert info.value.path == "critic.model_path"


def test_resources_pools_and_placement() -> None:
    config = RLConfig(
        cluster=ClusterConfig(nnodes=2, gpus_per_node=4),
        actor=ActorConfig(use_kl_loss=True, ppo_mini_batch_size=5, ppo_micro_batch_size_per_gpu=1),
        data=DataConfig(train_batch_size=5),
        rollout=RolloutConfig(n=4),
        critic=CriticConfig(
            enable=True,
            placement="separate",
            num_devices=2,
            ppo_mini_batch_size=5,
            ppo_micro_batch_size_per_gpu=1,
        ),
        reward=RewardConfig(reward_model=RewardModelConfig(enable=True, placement="separate", num_devices=1)),
    )
    plan = compile_plan(config)
    assert plan.roles == ("actor", "rollout", "ref", "critic", "reward_model")
    pools = {p.name: (p.first_device, p.num_devices, p.nodes, p.roles) for p in plan.resources.pools}
    assert pools == {
        "actor_pool": (0, 5, (0, 1), ("actor", "rollout", "ref")),
        "critic_pool": (5, 2, (1,), ("critic",)),
        "reward_model_pool": (7, 1, (1,), ("reward_model",)),
    }
    assert plan.placement("ref").world_size == 5 and plan.placement("ref").colocated_with == (
        "actor",
        "rollout",
    )
    assert plan.placement("critic").world_size == 2 and plan.placement("critic").num_processes == 2
    assert [p.pool for p in plan.memory.pools] == ["actor_pool", "critic_pool", "reward_model_pool"]
    # No ref without a KL term; no pools left for the actor is a ConfigError naming the pool rule.
    assert "ref" not in compile_plan(RLConfig()).roles
    with pytest.raises(ConfigError) as info:
        compile_plan(replace(config, critic=replace(config.critic, num_devices=7)))
    assert info.value.errors[0].rule == "device-pools"


def test_profile_folders_discrete_and_continuous() -> None:
    base = RLConfig(
        cluster=ClusterConfig(gpus_per_node=2),
        trainer=TrainerConfig(total_steps=5, output_dir="out"),
        profile=ProfileConfig(tool="torch", steps=(2,), ranks=(1,), roles=("actor_update", "reward_compute")),
    )
    p = compile_plan(base).profile
    assert p.enabled and p.save_path == os.path.join("out", "profile")
    assert p.folders == ("out/profile/step_2/actor_update/rank_1", "out/profile/step_2/reward_compute/rank_0")
    assert [(t.role, t.worker) for t in p.targets] == [
        ("actor_update", "actor"),
        ("reward_compute", "controller"),
    ]
    cont = replace(base, profile=replace(base.profile, discrete=False, all_ranks=True, save_path="/abs/prof"))
    p = compile_plan(cont).profile
    assert p.folders == ("/abs/prof/step_2/e2e/rank_0", "/abs/prof/step_2/e2e/rank_1")
    # Empty roles: every role present in the run.
    p = compile_plan(replace(base, profile=replace(base.profile, roles=()))).profile
    assert p.roles == ("generate_sequences", "actor_compute_log_prob", "actor_update", "reward_compute")
    assert not compile_plan(replace(base, profile=replace(base.profile, tool="none"))).profile.enabled


def test_checkpoint_steps_paths_and_retention() -> None:
    config = RLConfig(
        trainer=TrainerConfig(total_steps=10, save_freq=3, max_ckpt_to_keep=2, output_dir="runs/a"),
        actor=ActorConfig(use_kl_loss=True),
        critic=CriticConfig(enable=True),
    )
    config = replace(config, actor=replace(config.actor, checkpoint=replace(config.actor.checkpoint, save_contents=("model", "hf_model"), load_contents=("model",))))  # fmt: skip
    ck = compile_plan(config).checkpoint
    assert ck.save_steps == (3, 6, 9, 10) and ck.retained_steps == (9, 10)
    assert ck.latest_file == "runs/a/checkpoints/latest_checkpointed_iteration.txt"
    last = ck.saves[-1]
    assert last.path == "runs/a/checkpoints/global_step_10"
    paths = {r.role: (r.path, r.hf_path) for r in last.roles}
    assert paths == {
        "actor": (
            "runs/a/checkpoints/global_step_10/actor",
            "runs/a/checkpoints/global_step_10/actor/huggingface",
        ),
        "critic": ("runs/a/checkpoints/global_step_10/critic", None),
    }
    assert compile_plan(RLConfig()).checkpoint.save_steps == ()


def test_effective_config_and_diff() -> None:
    config = RLConfig(actor=ActorConfig(megatron=MegatronConfig(sequence_parallel=True)))
    plan = compile_plan(config)
    assert plan.layout("actor").sequence_parallel is False  # tp = 1: megatron switches it off
    assert plan.layout("actor").etp == 1
    other = replace(config, cluster=ClusterConfig(gpus_per_node=2), actor=replace(config.actor, megatron=MegatronConfig(tensor_model_parallel_size=2)))  # fmt: skip
    diff = dict((path, (a, b)) for path, a, b in diff_plans(plan, compile_plan(other)))
    assert diff["layouts[role=actor].tp"] == (1, 2)
    assert diff["resources.total_devices"] == (1, 2)
    assert diff["layouts[role=actor].grid[rank=1].tp"] == (MISSING, 1)
    assert isinstance(plan, TrainerPlan)


def test_format_plan_big_world_is_compact() -> None:
    config = qwen7b_config()
    config = replace(
        config,
        cluster=replace(config.cluster, nnodes=16),
        data=replace(config.data, train_batch_size=256),
        profile=ProfileConfig(tool="nsys", steps=(1, 2), all_ranks=True),
    )
    text = format_plan(compile_plan(config))
    assert len(text.splitlines()) < 150
    assert "pp=1 dp=15: 124 125 126 127" in text and "more" in text


def test_non_divisible_world_is_a_config_error() -> None:
    config = RLConfig(
        cluster=ClusterConfig(gpus_per_node=3),
        actor=ActorConfig(megatron=MegatronConfig(tensor_model_parallel_size=2)),
    )
    with pytest.raises(ConfigError) as info:
        compile_plan(config)
    assert info.value.errors[0].rule == "world-divisible-by-model-parallel"


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 200), st.integers(1, 4), st.sampled_from([None, 2, 3]))
def test_uneven_layers_are_refused_and_the_split_copes_with_them(
    layers: int, pp: int, vpp: int | None
) -> None:
    """Layers not divisible by pp x vpp are refused (the validator's layers-divisible-by-pp, which compiling
    runs); the split itself copes with them (earlier chunks get one more layer) and says it is uneven."""
    vpp = vpp if pp > 1 else None
    config = RLConfig(
        model=ModelConfig(arch=replace(ModelArch(), num_layers=layers)),
        actor=ActorConfig(
            megatron=MegatronConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
        ),
        cluster=ClusterConfig(gpus_per_node=pp),
        data=DataConfig(train_batch_size=pp * 4),
    )
    even = layers % (pp * (vpp or 1)) == 0
    if even:
        assert compile_plan(config).layout("actor").even_layers
    else:
        with pytest.raises(ConfigError) as info:
            compile_plan(config)
        assert ("actor.megatron.pipeline_model_parallel_size", "layers-divisible-by-pp") in {
            (i.path, i.rule) for i in info.value.errors
        }
    stages, split_even = _split_layers(layers, pp, vpp)
    per_stage = [s.num_layers for s in stages]
    assert sum(per_stage) == layers
    assert split_even == even
    assert max(per_stage) - min(per_stage) <= (vpp or 1)


def test_memory_counts_embedded_rollout_kv_cache() -> None:
    """generate_sequences holds the embedded engine's KV cache on the actor's devices. Qwen2.5-7B at TP=4
    x PP=2 (DP=1), 64 prompts x n=8 = 512 rows, 1024 + 3072 tokens, bf16, 14 layers per stage:
    2 x 14 x (4 kv heads / 4) x 128 x 4096 x 512 x 2 B = 15_032_385_536 B = 14.0 GiB, plus one of the
    stage's 14 layers while the cache is compacted (copied a layer at a time). The prompt width is
    data.max_prompt_length with prompt files (the loader pads a batch to its longest prompt); the synthetic
    task's prompts are <bos> + 5 characters: 6 + 3072 columns."""
    from rlconf.plan.memory import _rollout_kv_bytes

    synthetic = compile_plan(qwen7b_config()).memory.pools[0]
    kv = next(p for p in synthetic.phases if p.phase == "generate_sequences").parts
    assert {p.label: p.gib for p in kv}["rollout kv cache"] == pytest.approx(14.0 * 3078 / 4096, abs=1e-5)
    config = qwen7b_config()
    config = replace(config, data=replace(config.data, train_files=("prompts.parquet",)))
    plan = compile_plan(config)
    pool = plan.memory.pools[0]
    gen = next(p for p in pool.phases if p.phase == "generate_sequences")
    parts = {p.label: p.gib for p in gen.parts}
    assert parts["rollout kv cache"] == pytest.approx(15_032_385_536 / 2**30, abs=1e-5)
    # Compaction replaces the cache a layer at a time: one of the stage's 14 layers on top of it.
    assert parts["rollout kv compaction"] == pytest.approx(1.0, abs=1e-5)
    # The actor's weights (and its grads/optimizer state unless offloaded) stay resident meanwhile.
    assert parts["actor params"] == pytest.approx(952_026_880 * 2 / 2**30, rel=1e-4)
    assert gen.total_gib == pytest.approx(sum(parts.values()), abs=1e-4)
    assert pool.peak_gib >= gen.total_gib
    assert any("rollout.gpu_memory_utilization" in n for n in plan.memory.notes)
    # Halving the rows per DP rank halves it; vLLM's cache is its own (rollout.gpu_memory_utilization).
    lay = plan.layout("actor")
    half = replace(config, data=replace(config.data, train_batch_size=32))
    assert _rollout_kv_bytes(half, lay, QWEN25_7B, 14) == 15_032_385_536 / 2
    vllm = replace(config, rollout=replace(config.rollout, engine="vllm"))
    assert _rollout_kv_bytes(vllm, lay, QWEN25_7B, 14) == 0.0


def _policy_pool_parts(config, phase: str) -> dict[str, float]:
    """{part label: GiB} of one phase of the first pool's memory estimate."""
    pool = compile_plan(config).memory.pools[0]
    return {p.label: p.gib for p in next(p for p in pool.phases if p.phase == phase).parts}


def _at_ep2(moe):
    """A MoE preset on 2 GPUs with its actor's and ref's experts split over them (ep = 2)."""
    cluster = replace(moe.cluster, gpus_per_node=2)
    mcfg = replace(moe.actor.megatron, expert_model_parallel_size=2)
    return replace(moe, cluster=cluster, actor=replace(moe.actor, megatron=mcfg),
                   ref=replace(moe.ref, megatron=replace(moe.ref.megatron, expert_model_parallel_size=2)))  # fmt: skip


def test_memory_counts_the_engines_stacked_expert_weights() -> None:
    """A MoE actor generating on the embedded engine at ep = etp = 1 holds a stacked copy of its routed
    expert weights (rltrain/megatron/moe_decode.py) through generate_sequences: qwen3-moe-grpo's 24 MoE
    layers x 64 experts x 3 x 1024 x 512 bf16 = 4.5 GiB; at ep = 2 the engine's own MoE layers do not run
    (megatron's MoELayer does) and nothing is stacked; a dense actor stacks nothing either."""
    from presets import get_preset

    def parts(config, phase="generate_sequences"):
        return _policy_pool_parts(config, phase)

    moe = get_preset("qwen3-moe-grpo")
    assert parts(moe)["rollout stacked experts"] == pytest.approx(
        24 * 64 * 3 * 1024 * 512 * 2 / 2**30, abs=1e-5
    )
    assert "rollout stacked experts" not in parts(moe, "actor_update")
    assert "rollout stacked experts" not in parts(_at_ep2(moe))
    assert "rollout stacked experts" not in parts(get_preset("qwen2.5-1.5b-grpo"))


def test_memory_counts_a_forward_passs_stacked_expert_weights() -> None:
    """A forward-only pass with grouped-GEMM experts holds every MoE layer's stacked expert weights for the
    whole pass (rltrain/megatron/moe_experts.py cached_expert_stacks): qwen3-moe-grpo's 4.5 GiB in both
    log-prob phases, the local experts' share at ep = 2; not with megatron's sequential experts, not where
    megatron recomputes the MoE layer (stacked per call), and never for a dense model."""
    from presets import get_preset

    parts = _policy_pool_parts
    moe = get_preset("qwen3-moe-grpo")
    whole = 24 * 64 * 3 * 1024 * 512 * 2 / 2**30
    assert parts(moe, "actor_compute_log_prob")["actor stacked experts"] == pytest.approx(whole, abs=1e-5)
    assert parts(moe, "ref_compute_log_prob")["ref stacked experts"] == pytest.approx(whole, abs=1e-5)
    assert "actor stacked experts" not in parts(moe, "actor_update")  # the update's are in its activations
    assert parts(_at_ep2(moe), "actor_compute_log_prob")["actor stacked experts"] == pytest.approx(
        whole / 2, abs=1e-5
    )
    sequential = replace(moe, model=replace(moe.model, moe_grouped_gemm=False))
    assert "actor stacked experts" not in parts(sequential, "actor_compute_log_prob")
    ov = replace(moe.actor.megatron.override_transformer_config, recompute_granularity="full",
                 recompute_method="uniform", recompute_num_layers=1)  # fmt: skip
    recomputed = replace(
        moe, actor=replace(moe.actor, megatron=replace(moe.actor.megatron, override_transformer_config=ov))
    )
    assert "actor stacked experts" not in parts(recomputed, "actor_compute_log_prob")
    assert "actor stacked experts" not in parts(get_preset("qwen2.5-1.5b-grpo"), "actor_compute_log_prob")


def test_the_log_prob_passes_take_their_own_token_budget() -> None:
    """actor.log_prob_* (the old log-prob pass) and ref.log_prob_* (the reference pass), verl's rollout /
    ref.log_prob_use_dynamic_bsz and log_prob_max_token_len_per_gpu: unset, the actor's update budget
    (verl's interpolation); set, each engine cuts its forward micro-batches by its own, the memory estimate
    sizes each log-prob phase's logits by it, and `rlconf plan` prints them. The update keeps its budget."""
    from presets import get_preset
    from rlconf.plan.render import format_plan

    preset = get_preset("qwen3-moe-grpo")  # actor.use_dynamic_bsz, 24,576 tokens per micro-batch
    moe = replace(preset, actor=replace(preset.actor, log_prob_max_token_len_per_gpu=None),
                  ref=replace(preset.ref, log_prob_max_token_len_per_gpu=None))  # fmt: skip
    plan = compile_plan(moe)
    for role in ("actor", "ref"):
        s = plan.engine(role).settings
        assert (s.forward_use_dynamic_bsz, s.forward_max_token_len) == (True, 24576), role
    larger = replace(moe, actor=replace(moe.actor, log_prob_max_token_len_per_gpu=49152),
                     ref=replace(moe.ref, log_prob_max_token_len_per_gpu=36864))  # fmt: skip
    plan2 = compile_plan(larger)
    assert plan2.engine("actor").settings.forward_max_token_len == 49152
    assert plan2.engine("ref").settings.forward_max_token_len == 36864
    assert plan2.batch_plan("actor") == plan.batch_plan("actor")  # the update's schedule is its own
    logits = {p: _policy_pool_parts(moe, p) for p in ("actor_compute_log_prob", "ref_compute_log_prob")}
    logits2 = {p: _policy_pool_parts(larger, p) for p in logits}
    assert logits2["actor_compute_log_prob"]["actor logits"] == pytest.approx(
        2 * logits["actor_compute_log_prob"]["actor logits"], rel=1e-6
    )
    assert logits2["ref_compute_log_prob"]["ref logits"] == pytest.approx(
        1.5 * logits["ref_compute_log_prob"]["ref logits"], rel=1e-6
    )
    assert "forward passes' micro-batches: actor budget 49152 tok, ref budget 36864 tok" in format_plan(plan2)
    rows = replace(larger, actor=replace(larger.actor, log_prob_use_dynamic_bsz=False))
    s = compile_plan(rows).engine("actor").settings
    assert (s.forward_use_dynamic_bsz, s.forward_max_token_len) == (False, None)
    assert s.forward_micro_batch_size == moe.actor.log_prob_micro_batch_size_per_gpu


def test_moe_router_dtype_is_every_roles_and_the_plan_says_so() -> None:
    """model.moe_router_dtype reaches every MoE engine's settings (the actor's, which generates, and the
    ref's) and the models line of `rlconf plan`; unset, none of them sets a precision (the family's own)."""
    from presets import get_preset
    from rlconf.plan.render import format_plan

    moe = get_preset("qwen3-moe-grpo")
    fp32 = replace(moe, model=replace(moe.model, moe_router_dtype="fp32"))
    for config, want in ((moe, None), (fp32, "fp32")):
        plan = compile_plan(config)
        assert {plan.engine(r).settings.moe.router_dtype for r in ("actor", "ref")} == {want}
        assert ("routing in fp32" in format_plan(plan)) == (want is not None)
