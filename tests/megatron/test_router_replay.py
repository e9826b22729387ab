"""Router replay (actor.router_replay, rltrain/megatron/moe_replay.py) on a tiny random Qwen3-MoE (CPU, fp32).

What a user relies on: the routing recorded during generation is the routing of the generated tokens (a
training forward without replay routes the same tokens to the same experts, up to near-ties); and with
replay on, the old log-prob and update passes route every token to exactly the recorded experts, however
the rows are cut into micro-batches (token budget: rows regrouped by length), shuffled into mini-batches, or
recomputed in backward (activation checkpointing). The recorded routing in these tests is a random one,
so that replay cannot pass by routing as the model would anyway.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlconf.config import OverrideTransformerConfig

from .test_moe import _actor, _batch, _layout_cfg, make_tiny_moe

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

TOPK = 2
EXPERTS = 4
MOE_LAYERS = 2  # the tiny Qwen3-MoE: layers 0 and 2 routed, layer 1 dense


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("replay") / "hf", "qwen3_moe")


def _replay_cfg(**kw):
    """Replay on; log-prob passes cut by a token budget (rows regrouped longest first)."""
    cfg = _layout_cfg()
    return replace(
        cfg, **{"router_replay": True, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 60, **kw}
    )


class RoutingSpy:
    """The experts every router actually used ([tokens, k] sorted, per call), and the micro-batches each
    schedule ran, to map the calls back to batch rows and columns without the replay module's own code."""

    def __init__(self, actor) -> None:
        from rltrain.megatron.moe_replay import routers

        self.actor = actor
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.mbs: list = []
        self.handles = [r.register_forward_hook(self._hook) for r in routers(actor.chunks)]
        original = actor.run_schedule

        def run_schedule(mbs, loss_fn, forward_only):
            self.mbs.append(list(mbs))
            return original(mbs, loss_fn, forward_only)

        actor.run_schedule = run_schedule

    def _hook(self, router, inputs, output) -> None:
        routing_map = output[1]
        used = routing_map.nonzero()[:, 1].view(
            routing_map.shape[0], TOPK
        )  # experts of each token, ascending
        # Recomputations (activation checkpointing) run inside backward: kept apart, in their own order.
        recomputed = torch._C._current_graph_task_id() != -1
        self.calls.setdefault((router.layer_number, recomputed), []).append(used)

    def used_routing(self, n: int, s: int) -> torch.Tensor:
        """[n, s, layers, k] sorted experts of the first forward of every token (-1: none), in batch layout.
        Forwards of each micro-batch in schedule order; a recomputation repeats a forward (checked equal)."""
        out = torch.full((n, s, MOE_LAYERS, TOPK), -1, dtype=torch.long)
        mbs = [mb for run in self.mbs for mb in run]
        layers = sorted({layer for layer, _ in self.calls})
        for (layer, _), calls in self.calls.items():
            m = layers.index(layer)
            assert len(calls) == len(mbs), (len(calls), len(mbs))
            for mb, used in zip(mbs, calls, strict=True):
                b, length = mb.tokens.shape
                used = used.view(length, b, TOPK).transpose(0, 1)  # megatron's [s, b] token order
                # A packed micro-batch (rltrain/megatron/packing.py) holds row j's tokens from cu_seqlens[j] on.
                starts = mb.packed.cu_seqlens_q.tolist() if mb.packed is not None else None
                mask = mb.data["attention_mask"].bool()
                # Rows of an update's mini-batch are a shuffled subset: the batch carries each row's number.
                for j, row in enumerate(mb.data["row_id"].tolist()):
                    cols = mask[j].nonzero().squeeze(1)  # aligned position c is the row's c-th valid token
                    if starts is not None:
                        got = used[0, starts[j] : starts[j] + cols.numel()]
                    else:
                        got = used[j, : cols.numel()]
                    seen = out[row, cols, m]
                    assert bool(((seen == -1).all(-1) | (seen == got).all(-1)).all()), "recomputation differs"
                    out[row, cols, m] = got
        return out


def _numbered(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**batch, "row_id": torch.arange(batch["input_ids"].shape[0])}


def _random_routing(batch: dict[str, torch.Tensor], seed: int = 0) -> torch.Tensor:
    """A routing no model would choose: TOPK distinct random experts per token, -1 on padding."""
    n, s = batch["input_ids"].shape
    g = torch.Generator().manual_seed(seed)
    experts = torch.rand(n, s, MOE_LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK]
    return torch.where(batch["attention_mask"].bool()[:, :, None, None], experts, -1).to(torch.int16)


def _assert_used(spy: RoutingSpy, routed: torch.Tensor, batch: dict, what: str) -> None:
    used = spy.used_routing(*batch["input_ids"].shape)
    valid = routed[..., 0] >= 0
    assert bool(valid.any())
    expected = routed.long().sort(-1).values
    assert torch.equal(used[valid], expected[valid]), what


def test_replay_routes_log_prob_and_update_passes_to_the_recorded_experts(mp_world, qwen3_moe):
    cfg = _replay_cfg(ppo_micro_batch_size_per_gpu=3, shuffle=True)
    actor = _actor(qwen3_moe, cfg, trainable=True)
    batch = _numbered(_batch())
    routed = _random_routing(batch)
    actor.router_replay = False  # replay off for the reference pass
    plain = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    actor.router_replay = True
    with pytest.raises(KeyError, match="routed_experts"):  # replay on, and the rollout recorded nothing
        actor.compute_log_prob(batch, with_entropy=False)
    spy = RoutingSpy(actor)
    replayed = actor.compute_log_prob({**batch, "routed_experts": routed}, with_entropy=False)["log_probs"]
    assert len(spy.mbs[0]) > 1 and not torch.equal(torch.cat([mb.rows for mb in spy.mbs[0]]), torch.arange(8))
    _assert_used(spy, routed, batch, "old log-prob pass")
    assert not torch.allclose(replayed, plain), "a random routing left the log-probs unchanged"

    spy = RoutingSpy(actor)
    sign = torch.tensor([1.0 if i % 2 else -1.0 for i in range(8)]).unsqueeze(1)
    rl = {
        **batch,
        "routed_experts": routed,
        "old_log_probs": replayed,
        "advantages": sign * batch["response_mask"],
    }
    metrics = actor.update_policy(rl)
    _assert_used(spy, routed, batch, "update pass")
    # The replayed experts' probabilities come from the current router: the ratio starts at 1 exactly.
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)


def test_replay_follows_recomputation_in_backward(mp_world, qwen3_moe):
    """Full activation recomputation re-runs every router in backward: it takes the same recorded experts."""
    ov = OverrideTransformerConfig(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    cfg = _replay_cfg()
    cfg = replace(cfg, megatron=replace(cfg.megatron, override_transformer_config=ov))
    actor = _actor(qwen3_moe, cfg, trainable=True)
    batch = _numbered(_batch())
    routed = _random_routing(batch, seed=1)
    old = actor.compute_log_prob({**batch, "routed_experts": routed}, with_entropy=False)["log_probs"]
    spy = RoutingSpy(actor)
    actor.update_policy({**batch, "routed_experts": routed, "old_log_probs": old,
                         "advantages": batch["response_mask"].float()})  # fmt: skip
    assert sorted(spy.calls) == [(1, False), (1, True), (3, False), (3, True)]  # forward + recomputation
    _assert_used(spy, routed, batch, "update with recomputation")


def test_generation_records_the_routing_of_the_generated_tokens(mp_world, qwen3_moe):
    """The recorded routing is aligned with the rollout batch: a training forward without replay routes the
    same tokens to the same experts (up to near-ties between the KV-cache and whole-sequence rounding), on
    duplicate prompts (prefilled once) and with rows that stop early (cache compaction)."""
    from rltrain.megatron.moe_replay import record_routing

    actor = _actor(qwen3_moe, _replay_cfg(router_replay=False), trainable=True)
    prompts = _batch()["input_ids"][:4, :12].repeat(2, 1)  # every prompt twice, as rollout.n = 2
    with record_routing(actor) as recorder:
        out = actor.generate(prompts, 8, temperature=1.0, pad_id=0, eos_id=7, stop_token_ids=(11, 13, 17, 19),
                             seed=3)  # fmt: skip
    routed = recorder.routed_experts(out)
    n, s = out["input_ids"].shape
    assert routed.shape == (n, s, MOE_LAYERS, TOPK) and routed.dtype == torch.int16
    mask = out["attention_mask"].bool()
    assert bool((routed[~mask] == -1).all())
    # Every fed token is recorded: the prompt and all response tokens but the last (a row that stops while
    # others run may still feed its stop token, recorded too; rows of a finished batch never do).
    last = mask.cumsum(-1).argmax(-1)
    fed = mask.clone()
    fed[torch.arange(n), last] = False
    assert bool((routed[fed] >= 0).all())
    assert bool((out["response_mask"].sum(-1) < 8).any()), "no row stopped early: compaction not exercised"

    spy = RoutingSpy(actor)
    actor.compute_log_prob(_numbered(out), with_entropy=False)
    used = spy.used_routing(n, s)
    rec = routed.long().sort(-1).values
    same = (used[fed] == rec[fed]).all(-1).float().mean()
    assert same >= 0.99, float(same)
