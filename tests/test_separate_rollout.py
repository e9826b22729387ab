"""A separate rollout pool and off-policy training (issue 24): the plan's pools, layouts, push and passes;
the producer pipeline's rules (bounded staleness, one weight version per batch, failures reach the
trainer); the push protocol's version / checksum / bucket-count checks. The runs themselves are in
tests/test_separate_rollout_e2e.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from presets import PRESETS
from rlconf.load import load_config
from rlconf.plan import compile_plan
from rltrain.rollout.pipeline import RolloutPipeline
from rltrain.rollout.weight_sync import Channel, WeightSyncError, receive_weights, send_weights

SEPARATE = ["cluster.gpus_per_node=3", "rollout.placement=separate", "rollout.num_devices=1"]


def _plan(*overrides: str):
    return compile_plan(load_config(None, preset="tiny-grpo", overrides=list(overrides), presets=PRESETS))


# ------------------------------------------------------------------------------------------------ plan
def test_plan_gives_the_rollout_its_own_pool_layout_and_push():
    plan = _plan(*SEPARATE, "algorithm.off_policy_steps=1")
    pools = {p.name: p for p in plan.resources.pools}
    assert pools["actor_pool"].num_devices == 2 and "rollout" not in pools["actor_pool"].roles
    assert pools["rollout_pool"].num_devices == 1 and pools["rollout_pool"].roles == ("rollout",)
    assert pools["rollout_pool"].first_device == 2  # devices 0-1 train, device 2 generates
    assert plan.layout("actor").dp == 2 and plan.layout("rollout").world_size == 1
    assert plan.refit.mode == "push" and plan.refit.senders == 1 and plan.refit.push_gib > 0
    # The rollout's engine: the policy's model, frozen, in the rollout's layout.
    engine = plan.engine("rollout")
    assert engine.optim is None and engine.layout.pool == "rollout_pool"
    assert engine.layout.pp == 1 and engine.settings.dist_checkpointing_path is None
    # The trainer's pool holds no KV cache; the rollout pool has its own estimate.
    mem = {p.pool: p for p in plan.memory.pools}
    assert not any("kv" in part.label for ph in mem["actor_pool"].phases for part in ph.parts)
    gen = next(ph for ph in mem["rollout_pool"].phases if ph.phase == "generate_sequences")
    assert {"rollout weights", "rollout kv cache"} <= {part.label for part in gen.parts}


def test_plan_push_has_one_sender_per_pipeline_stage():
    plan = _plan("cluster.gpus_per_node=4", "rollout.placement=separate", "rollout.num_devices=2",
                 "actor.megatron.pipeline_model_parallel_size=2", "rollout.tensor_model_parallel_size=2",
                 "actor.ppo_micro_batch_size_per_gpu=8")  # fmt: skip
    assert plan.refit.senders == 2 and plan.refit.actor_pp == 2
    assert plan.layout("rollout").tp == 2 and plan.layout("rollout").dp == 1


def test_colocated_rollout_has_no_engine_of_its_own():
    plan = _plan()
    assert plan.refit.mode == "zero-copy"
    with pytest.raises(KeyError):
        plan.engine("rollout")


def test_off_policy_recomputes_old_log_probs_and_weighs_by_the_behaviour_policy():
    on = _plan(*SEPARATE).passes
    assert on.off_policy_steps == 0 and on.rollout_is is None  # on-policy: as colocated
    off = _plan(*SEPARATE, "algorithm.off_policy_steps=2").passes
    assert off.off_policy_steps == 2 and not off.actor_on_policy
    assert off.old_log_prob == "recompute" and off.rollout_is == "token" and "off-policy" in off.reason
    chosen = _plan(*SEPARATE, "algorithm.off_policy_steps=1",
                   "algorithm.rollout_correction.rollout_is=sequence").passes  # fmt: skip
    assert chosen.rollout_is == "sequence"
    bypass = _plan(*SEPARATE, "algorithm.off_policy_steps=1",
                   "algorithm.rollout_correction.bypass_mode=true").passes  # fmt: skip
    assert bypass.old_log_prob == "rollout" and bypass.rollout_is is None
    # A one-mini-batch step is on-policy only when generation does not run ahead.
    one = ["actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=32"]
    assert _plan(*SEPARATE, *one).passes.old_log_prob == "update"
    assert _plan(*SEPARATE, *one, "algorithm.off_policy_steps=1").passes.old_log_prob == "recompute"


def test_plan_text_shows_both_pools_and_the_push():
    from rlconf.plan import format_plan

    text = format_plan(_plan(*SEPARATE, "algorithm.off_policy_steps=1"))
    assert "rollout_pool" in text and "actor_pool" in text
    assert "rollout weight push" in text and "1 step ahead" in text


# ------------------------------------------------------------------------------------------------ pipeline
class _Rollout:
    """Records what the pipeline lets the two threads do to the (simulated) rollout workers."""

    def __init__(self, gen_s: float) -> None:
        self.gen_s = gen_s
        self.weights = 0  # the version the rollout workers hold
        self.active = 0  # calls using the rollout workers right now
        self.overlaps = 0
        self.log: list[tuple[int, int, int]] = []  # (step, version tagged, version used)
        self.lock = threading.Lock()

    def _enter(self) -> None:
        with self.lock:
            self.active += 1
            self.overlaps += self.active > 1

    def _leave(self) -> None:
        with self.lock:
            self.active -= 1

    def produce(self, step: int, version: int) -> int:
        self._enter()
        used = self.weights
        time.sleep(self.gen_s)
        self.log.append((step, version, used))
        self._leave()
        return step

    def push(self, version: int) -> None:
        self._enter()
        time.sleep(0.001)
        self.weights = version
        self._leave()


@settings(max_examples=12, deadline=None)
@given(ahead=st.integers(0, 3), steps=st.integers(1, 6), gen_ms=st.integers(0, 4), train_ms=st.integers(0, 4))
def test_pipeline_bounds_staleness_and_tags_each_batch_with_the_weights_it_used(
    ahead, steps, gen_ms, train_ms
):
    rollout = _Rollout(gen_ms / 1000)
    pipe = RolloutPipeline(rollout.produce, 1, steps, ahead, version=0)
    try:
        for step in range(1, steps + 1):
            batch, version = pipe.take(step)
            assert batch == step
            assert step - 1 - ahead <= version <= step - 1  # bounded staleness
            time.sleep(train_ms / 1000)  # the update
            pipe.push(step, lambda s=step: rollout.push(s))
    finally:
        pipe.close()
    assert rollout.overlaps == 0  # a push never ran during a generation, nor two generations at once
    assert [s for s, _, _ in rollout.log] == list(range(1, steps + 1))
    assert all(tagged == used for _, tagged, used in rollout.log)


def test_pipeline_generates_ahead_while_the_step_trains():
    rollout = _Rollout(0.05)
    pipe = RolloutPipeline(rollout.produce, 1, 3, 1, version=0)
    try:
        pipe.take(1)
        time.sleep(0.2)  # step 1 "trains": the batch of step 2 is generated meanwhile, with version 0
        assert [s for s, _, _ in rollout.log] == [1, 2]
        pipe.push(1, lambda: rollout.push(1))
        assert pipe.take(2)[1] == 0 and pipe.take(3)[1] == 1
    finally:
        pipe.close()


def test_pipeline_hands_the_producer_failure_to_the_trainer():
    def produce(step: int, version: int) -> int:
        if step == 2:
            raise RuntimeError("rollout worker rank 0 died")
        return step

    pipe = RolloutPipeline(produce, 1, 4, 1, version=0)
    try:
        assert pipe.take(1) == (1, 0)
        with pytest.raises(RuntimeError, match="rank 0 died"):
            pipe.take(2)
    finally:
        pipe.close()


# ------------------------------------------------------------------------------------------------ protocol
class _Loopback(Channel):
    """Records what a sender broadcasts and replays it to a receiver in the same process (the transport is
    torch.distributed in the runs; here the checks of the protocol itself are under test)."""

    def __init__(self, corrupt_bucket: int | None = None, drop_bucket: int | None = None) -> None:
        super().__init__(None)
        self.sent: list[object] = []
        self.corrupt, self.drop = corrupt_bucket, drop_bucket

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.replaying is None:
            self.sent.append(tensor.clone())
        else:
            tensor.copy_(self.replaying.pop(0))

    def broadcast_object(self, obj: object, src: int) -> object:
        if self.replaying is None:
            self.sent.append(obj)
            return obj
        return self.replaying.pop(0)

    replaying: list | None = None

    def replay(self) -> None:
        msgs, buckets = [], 0
        it = iter(self.sent)
        for msg in it:
            if "header" in msg:
                buf = next(it).clone()
                if buckets == self.drop:
                    buckets += 1
                    continue
                if buckets == self.corrupt:
                    buf[len(buf) // 2] ^= 1
                msgs += [msg, buf]
                buckets += 1
            else:
                msgs.append(msg)
        self.replaying = msgs


def _push(channel: _Loopback, version: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    weights = {f"w{i}": torch.randn(64, 32) for i in range(6)}
    send_weights(weights.items(), channel, 0, bucket_bytes=3 * 64 * 32 * 4, version=version)
    channel.replay()
    return weights


def test_protocol_delivers_every_tensor_with_its_version():
    channel = _Loopback()
    weights = _push(channel)
    got: dict[str, torch.Tensor] = {}
    stats = receive_weights(lambda b: got.update({n: t.clone() for n, t in b}), channel, 0, version=3)
    assert stats.buckets == 2 and got.keys() == weights.keys()
    assert all(torch.equal(got[n], weights[n]) for n in weights)


@pytest.mark.parametrize(
    ("channel", "version", "message"),
    [
        (_Loopback(corrupt_bucket=1), 3, "checksum mismatch"),
        (_Loopback(drop_bucket=0), 3, "2 buckets sent, 1 received"),
        (_Loopback(), 4, "version 3, expected 4"),
    ],
    ids=["corrupt", "lost", "stale"],
)
def test_protocol_refuses_corrupt_lost_or_stale_pushes(channel, version, message):
    _push(channel)
    with pytest.raises(WeightSyncError, match=message):
        receive_weights(lambda b: None, channel, 0, version=version)
