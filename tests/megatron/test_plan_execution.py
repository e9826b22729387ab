"""Engines execute the compiled plan: the lr of every update is the plan's `OptimPlan.table` row of that
training step, and the mini-/micro-batches an update runs are the plan's `BatchPlan`, for constant, linear,
cosine and WSD schedules with warmup, fixed and token-budget micro-batches, a critic warm-up that delays
the actor, and the layouts TP=1 (here), DP=2 and TP=2 (two spawned gloo processes, each building its engines
through `PolicyWorker` / `CriticWorker` exactly as a run does). The plan is compiled here from a config,
independently of the engine; the engine only ever sees the plan.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from rlconf.config import (
    ActorConfig,
    ClusterConfig,
    CriticConfig,
    DataConfig,
    MegatronConfig,
    ModelArch,
    ModelConfig,
    Optim,
    RLConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlconf.plan import TrainerPlan, compile_plan
from tests.megatron._common import spawn

from ._common import batch_from_lengths, free_port, run_spawned

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

TOTAL_STEPS = 6
SCHEDULES = {  # a warm-up and a decay that reaches its end within the run
    "constant": Optim(lr=1e-3, lr_warmup_steps=2, lr_warmup_init=1e-4, lr_decay_style="constant"),
    "linear": Optim(lr=1e-3, min_lr=1e-5, lr_warmup_steps=2, lr_decay_style="linear", lr_decay_steps=5),
    "cosine": Optim(lr=1e-3, min_lr=1e-4, lr_warmup_steps_ratio=0.34, lr_decay_style="cosine"),
    "wsd": Optim(
        lr=1e-3, min_lr=1e-5, lr_warmup_steps=1, lr_decay_style="WSD", lr_wsd_decay_steps=3,
        lr_wsd_decay_style="cosine",
    ),
}  # fmt: skip


def _config(
    optim: Optim = SCHEDULES["linear"],
    *,
    devices: int = 1,
    tp: int = 1,
    prompts: int = 4,
    n: int = 2,
    mini: int = 2,
    micro: int = 2,
    epochs: int = 2,
    dynamic: bool = False,
    critic_warmup: int | None = None,
) -> RLConfig:
    """A tiny random model (model.arch) whose update runs `prompts / mini` x `epochs` optimizer steps."""
    actor = ActorConfig(
        megatron=MegatronConfig(tensor_model_parallel_size=tp),
        optim=optim,
        ppo_mini_batch_size=mini,
        ppo_micro_batch_size_per_gpu=micro,
        log_prob_micro_batch_size_per_gpu=micro,
        ppo_epochs=epochs,
        use_dynamic_bsz=dynamic,
        ppo_max_token_len_per_gpu=40,
    )
    config = RLConfig(
        model=ModelConfig(arch=ModelArch(num_layers=2, vocab_size=100, max_position_embeddings=128)),
        data=DataConfig(train_batch_size=prompts, max_prompt_length=8),
        actor=actor,
        rollout=RolloutConfig(n=n, max_response_length=8),
        trainer=TrainerConfig(total_steps=TOTAL_STEPS),
        cluster=ClusterConfig(device="cpu", gpus_per_node=devices),
    )
    if critic_warmup is not None:
        critic = CriticConfig(
            enable=True,
            megatron=actor.megatron,
            optim=SCHEDULES["cosine"],
            ppo_mini_batch_size=mini,
            ppo_micro_batch_size_per_gpu=micro,
            ppo_epochs=1,
        )
        config = replace(config, critic=critic, trainer=replace(config.trainer, critic_warmup=critic_warmup))
    return config


def _rows(plan: TrainerPlan, role: str, seed: int) -> dict[str, torch.Tensor]:
    """One rank's rows of one training step (the plan's count), lengths varying per row, as an RL batch."""
    b = plan.batch_plan(role)
    rows = b.mini_batches_per_step * b.responses_per_mini_batch_per_rank
    g = torch.Generator().manual_seed(seed)
    lens = [
        (int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
        for _ in range(rows)
    ]
    batch = batch_from_lengths(lens, 8, 8, seed=seed)
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(rows)]).unsqueeze(1)
    mask = batch["response_mask"]
    return {
        **batch,
        "old_log_probs": torch.zeros(mask.shape),
        "advantages": sign * mask,
        "values": torch.zeros(mask.shape),
        "returns": sign * mask,
    }


class Recorder:
    """What an engine really runs: the param groups' lr and weight decay at each optimizer step and the
    rows of every micro-batch of every update (read from the calls, so nothing here restates the plan)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.opt_steps: list[list[tuple[float, float, float]]] = []  # per optimizer step: (lr, wd, wd_mult)
        self.mini_batches: list[list[int]] = []  # per optimizer step: rows of each micro-batch
        self.tokens: list[list[int]] = []  # per optimizer step: padded tokens of each micro-batch
        optimizer = engine._optimizer
        # The engine's guarded step (rltrain.megatron.model.guarded_optimizer_step) applies an update through
        # megatron's step_with_ready_grads: one call per optimizer step that is applied.
        inner_step = optimizer.step_with_ready_grads

        def step():
            self.opt_steps.append(
                [(g["lr"], g["weight_decay"], g.get("wd_mult", 1.0)) for g in optimizer.param_groups]
            )
            return inner_step()

        optimizer.step_with_ready_grads = step
        inner_run = engine.run_schedule

        def run_schedule(micro_batches, loss_fn, forward_only):
            if not forward_only:
                self.mini_batches.append([int(mb.rows.numel()) for mb in micro_batches])
                self.tokens.append([int(mb.tokens.numel()) for mb in micro_batches])
            return inner_run(micro_batches, loss_fn, forward_only)

        engine.run_schedule = run_schedule

    def take(self) -> tuple[list, list, list]:
        out = (self.opt_steps, self.mini_batches, self.tokens)
        self.opt_steps, self.mini_batches, self.tokens = [], [], []
        return out


def check_step(plan: TrainerPlan, role: str, step: int, recorder: Recorder, reported_lr: float) -> None:
    """The update of training step `step` ran the plan's lr row and the plan's batch schedule."""
    b, row = plan.batch_plan(role), plan.optim_plan(role).table[step - 1]
    assert row.step == step and row.update
    opt_steps, minis, tokens = recorder.take()
    assert reported_lr == row.lr, f"{role} step {step}: reported lr {reported_lr} != plan {row.lr}"
    assert len(opt_steps) == b.optimizer_steps_per_training_step == b.mini_batches_per_step * b.ppo_epochs
    for groups in opt_steps:
        for lr, wd, wd_mult in groups:
            assert lr == row.lr, f"{role} step {step}: optimizer lr {lr} != plan {row.lr}"
            assert wd == row.weight_decay * wd_mult
    for micro_rows, micro_tokens in zip(minis, tokens, strict=True):
        assert sum(micro_rows) == b.responses_per_mini_batch_per_rank
        if b.use_dynamic_bsz:
            assert len(micro_rows) <= b.max_micro_batches_per_mini_batch
            for rows, toks in zip(micro_rows, micro_tokens, strict=True):
                assert toks <= b.max_token_len_per_micro_batch or rows == 1
        else:
            assert len(micro_rows) == b.micro_batches_per_mini_batch
            assert set(micro_rows) == {b.micro_batch_size_per_rank}


# ------------------------------------------------------------------------------------ TP = 1, one process
@pytest.mark.slow
@pytest.mark.parametrize("style", list(SCHEDULES))
def test_actor_lr_of_every_step_is_the_plans(mp_world, style):
    from rltrain.megatron.actor import MegatronActor

    plan = compile_plan(_config(SCHEDULES[style]))
    lrs = [row.lr for row in plan.optim_plan("actor").table]
    assert len(set(lrs)) >= 3  # the schedule moves: warm-up, then decay (or the constant peak)
    actor = MegatronActor.from_plan(plan, "actor")
    recorder = Recorder(actor)
    for step in range(1, TOTAL_STEPS + 1):
        metrics = actor.update_policy(_rows(plan, "actor", step), step=step)
        check_step(plan, "actor", step, recorder, metrics["actor/lr"])
    assert actor.lr_scheduler.num_steps == TOTAL_STEPS
    with pytest.raises(ValueError, match="outside the plan's lr table"):
        actor.update_policy(_rows(plan, "actor", 0), step=TOTAL_STEPS + 1)


@pytest.mark.slow
def test_token_budget_micro_batches_follow_the_plan(mp_world):
    from rltrain.megatron.actor import MegatronActor

    plan = compile_plan(_config(SCHEDULES["cosine"], dynamic=True, micro=1, mini=4, prompts=8, epochs=1))
    b = plan.batch_plan("actor")
    assert b.use_dynamic_bsz and b.max_token_len_per_micro_batch == 40
    actor = MegatronActor.from_plan(plan, "actor")
    recorder = Recorder(actor)
    for step in (1, 2):
        metrics = actor.update_policy(_rows(plan, "actor", step), step=step)
        assert len(recorder.mini_batches[0]) > 1  # the budget really splits: 8 rows of up to 16 tokens
        check_step(plan, "actor", step, recorder, metrics["actor/lr"])


@pytest.mark.slow
def test_critic_warmup_delays_the_actor_as_planned(mp_world):
    """With trainer.critic_warmup = 2 the actor's first update is step 3 at the table's first lr (warm-up
    from lr_warmup_init); an update the plan does not have is refused. The critic updates from step 1."""
    from rltrain.megatron.actor import MegatronActor
    from rltrain.megatron.critic import MegatronCritic

    plan = compile_plan(_config(SCHEDULES["linear"], critic_warmup=2))
    table = plan.optim_plan("actor").table
    assert [r.update for r in table] == [False, False, True, True, True, True]
    actor = MegatronActor.from_plan(plan, "actor")
    critic = MegatronCritic.from_plan(plan, "critic")
    actor_rec, critic_rec = Recorder(actor), Recorder(critic)
    with pytest.raises(ValueError, match="critic_warmup"):
        actor.update_policy(_rows(plan, "actor", 0), step=1)
    for step in range(1, TOTAL_STEPS + 1):
        metrics = critic.update_critic(_rows(plan, "critic", step), step=step)
        check_step(plan, "critic", step, critic_rec, metrics["critic/lr"])
        if table[step - 1].update:
            metrics = actor.update_policy(_rows(plan, "actor", step), step=step)
            check_step(plan, "actor", step, actor_rec, metrics["actor/lr"])
    assert table[2].lr == 0.0  # linear warm-up starts at lr_warmup_init = 0 on the actor's first update


@pytest.mark.slow
def test_engine_is_built_from_the_plans_model_and_layout(mp_world, tiny_hf):
    """The architecture is the plan's ModelSpec (config.json read once, by the plan) and the weights load
    from its folder; the parallel sizes are the plan's layout."""
    from rltrain.megatron import model as mmodel
    from rltrain.megatron.actor import MegatronActor

    config = replace(_config(), model=ModelConfig(path=str(tiny_hf)))
    plan = compile_plan(config)
    spec = plan.engine("actor")
    assert spec.model.weights == str(tiny_hf) and spec.model.arch.hidden_size == 64
    actor = MegatronActor.from_plan(plan, "actor")
    tc = mmodel.unwrap(actor.chunks[0]).config
    arch = plan.model("policy").arch
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (
        arch.num_layers, arch.hidden_size, arch.ffn_hidden_size,
    )  # fmt: skip
    assert actor.spec.batch == plan.batch_plan("actor") and actor.spec.optim == plan.optim_plan("actor")
    # The parallel sizes are the layout's (megatron's groups are built from it; nothing re-derives them).
    lay = plan.layout("actor")
    assert (actor.tp_size, actor.dp_size, actor.cp_size) == (lay.tp, lay.dp, lay.cp)


# ------------------------------------------------------------------------------------ DP = 2 and TP = 2
LAYOUTS = {"dp2": 1, "tp2": 2}  # name -> tp on two devices


def _run_workers(rank: int, port: int, out_dir: str) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed
    from rltrain.workers import CriticWorker, PolicyWorker

    init_distributed("cpu", rank=rank, world_size=2, master_port=port)
    results = {}
    for name, tp in LAYOUTS.items():
        plan = compile_plan(_config(SCHEDULES["wsd"], devices=2, tp=tp, prompts=4, mini=2, critic_warmup=1))
        lay = plan.layout("actor")
        assert (lay.tp, lay.dp) == (tp, 2 // tp)
        policy = PolicyWorker("actor", rank, 2, "127.0.0.1", port, plan)
        info = policy.init_model()
        critic = CriticWorker("critic", rank, 2, "127.0.0.1", port, plan)
        critic.init_model()
        assert info["dp_size"] == lay.dp == parallel_state.get_data_parallel_world_size()
        actor_rec, critic_rec = Recorder(policy.actor), Recorder(critic.critic)
        dp_rank = parallel_state.get_data_parallel_rank()
        for step in range(1, TOTAL_STEPS + 1):
            # Every DP rank gets its own rows (the controller's shards); TP ranks of one DP rank the same.
            metrics = critic.update_critic(_rows(plan, "critic", 100 * step + dp_rank), step)
            check_step(plan, "critic", step, critic_rec, metrics["critic/lr"])
            if step > 1:
                metrics = policy.update_actor(_rows(plan, "actor", 100 * step + dp_rank), step)
                check_step(plan, "actor", step, actor_rec, metrics["actor/lr"])
        with pytest.raises(ValueError, match="plan's batch schedule"):
            rows = _rows(plan, "actor", 0)
            policy.update_actor({k: v[:-1] for k, v in rows.items()}, TOTAL_STEPS)
        results[name] = {"dp": lay.dp, "steps": TOTAL_STEPS}
        del policy, critic
        destroy_parallel(destroy_process_group=False)
    if rank == 0:
        with open(os.path.join(out_dir, "layouts.json"), "w") as f:
            json.dump(results, f)
    destroy_parallel()


def _spawned(rank: int, port: int, out_dir: str) -> None:
    run_spawned(_run_workers, rank, port, out_dir)


@pytest.mark.multiproc
@pytest.mark.slow
def test_workers_run_the_plan_at_dp2_and_tp2(tmp_path):
    spawn(_spawned, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    assert json.loads((tmp_path / "layouts.json").read_text()) == {
        "dp2": {"dp": 2, "steps": TOTAL_STEPS},
        "tp2": {"dp": 1, "steps": TOTAL_STEPS},
    }
