"""Context parallel with mixture-of-experts layers (rltrain/megatron/context_parallel.py + megatron's MoE with
the alltoall dispatcher): two gloo processes at CP=2 (experts replicated, EP=1) and CP=2 x EP=2 (the CP pair
is also the EP pair: each rank routes its own half of every sequence and holds two of the four experts)
against one process at CP=1 x EP=1, on a tiny random Qwen3-MoE with rows of uneven length:

* compute_log_prob (log-probs and entropy) equals CP=1's;
* one PPO update equals CP=1's with and without the load-balancing loss: the grad norm, the log-probs after
  the step, and the routing metrics `actor/moe_aux_loss` (megatron sums the per-expert token counts over
  the TP x CP group; each CP rank's loss is its share) and `actor/moe_expert_load_max`.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from tests.megatron._common import spawn

from ..tolerance import rel_tolerance
from ._common import UPDATE_DEPTH, assert_tiny_close, free_port, init_groups, run_spawned
from .test_moe import MOE_DEPTH, MOE_REDUCTION, _actor, _batch, _layout_cfg, _rl_batch, make_tiny_moe

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

FAMILY = "qwen3_moe"
# (name, ep) at CP=2 in a world of two processes (data parallel 1: both ranks hold the whole batch).
CP_LAYOUTS = [("cp2", 1), ("cp2_ep2", 2)]
# None: config.json's load-balancing coefficient (router_aux_loss_coef 0.001).
AUX = (0.0, None)
REL = rel_tolerance(torch.float32, MOE_REDUCTION, UPDATE_DEPTH)


def _cfg(cp: int, ep: int, aux: float | None = 0.0):
    # Micro-batches of 4 rows pad to 28 and 8 tokens (multiples of 2 x CP = 4): chunk boundaries fall
    # mid-prompt, mid-response and inside the padding.
    cfg = replace(
        _layout_cfg(ep=ep, aux=aux), ppo_micro_batch_size_per_gpu=4, log_prob_micro_batch_size_per_gpu=4
    )
    return replace(cfg, megatron=replace(cfg.megatron, context_parallel_size=cp))


def _run(path: str, cp: int, ep: int, rl: dict) -> dict:
    """What is compared, at context parallel size `cp` and expert parallel size `ep` on this rank."""
    from rltrain.megatron.model import unwrap

    out: dict = {}
    frozen = _actor(path, _cfg(cp, ep))
    # Each EP rank holds its share of the experts.
    assert len(unwrap(frozen.chunks[0]).decoder.layers[-1].mlp.experts.local_experts) == 4 // ep
    lp = frozen.compute_log_prob(rl)
    out["log_probs"], out["entropy"] = lp["log_probs"], lp["entropy"]
    del frozen
    for aux in AUX:
        actor = _actor(path, _cfg(cp, ep, aux), trainable=True)
        metrics = actor.update_policy(rl)
        out[f"metrics_{aux}"] = metrics
        out[f"after_{aux}"] = actor.compute_log_prob(rl, with_entropy=False)["log_probs"]
        del actor
    return out


def _worker(rank: int, port: int, path: str, rl: dict, out_dir: str) -> None:
    run_spawned(_cp_layouts, rank, port, path, rl, out_dir)


def _cp_layouts(rank: int, port: int, path: str, rl: dict, out_dir: str) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=2, master_port=port)
    results = {}
    for name, ep in CP_LAYOUTS:
        init_groups(_cfg(2, ep).megatron, "cpu")
        assert parallel_state.get_context_parallel_world_size() == 2
        assert parallel_state.get_data_parallel_world_size() == 1
        assert parallel_state.get_expert_model_parallel_world_size() == ep
        # The experts' data-parallel group spans the CP ranks when they do not split the experts.
        assert parallel_state.get_expert_data_parallel_world_size() == 2 // ep
        results[name] = _run(path, 2, ep, rl)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_parallel()


@pytest.mark.slow
@pytest.mark.multiproc
def test_cp2_with_moe_matches_cp1(mp_world, tmp_path):
    path = str(make_tiny_moe(tmp_path / "hf", FAMILY))
    batch = _batch()
    old = _actor(path, _cfg(1, 1)).compute_log_prob(batch, with_entropy=False)["log_probs"]
    rl = _rl_batch(batch, old)
    cp1 = _run(path, 1, 1, rl)
    assert cp1["metrics_None"]["actor/moe_aux_loss"] > 0
    assert "actor/moe_aux_loss" not in cp1["metrics_0.0"]
    # The load-balancing loss moves the weights: the two updates differ, so each comparison below checks it.
    assert not torch.equal(cp1["after_0.0"], cp1["after_None"])
    assert float((cp1["after_0.0"] - cp1["log_probs"]).abs().max()) > 1e-4  # the update moved the policy
    spawn(_worker, args=(free_port(), path, rl, str(tmp_path)), nprocs=2)
    diffs: dict[str, float] = {}
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, _ in CP_LAYOUTS:
            res, where = got[name], f"rank {rank} {name}"
            assert_tiny_close(res["log_probs"], cp1["log_probs"], msg=f"{where}: log-probs", depth=MOE_DEPTH)
            assert_tiny_close(res["entropy"], cp1["entropy"], msg=f"{where}: entropy", depth=MOE_DEPTH)
            for aux in AUX:
                m, ref = res[f"metrics_{aux}"], cp1[f"metrics_{aux}"]
                assert m["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=REL), (where, aux)
                assert_tiny_close(res[f"after_{aux}"], cp1[f"after_{aux}"], msg=f"{where} aux={aux}: after",
                                  depth=UPDATE_DEPTH)  # fmt: skip
                for key in ("actor/moe_aux_loss", "actor/moe_expert_load_max", "actor/loss", "actor/entropy"):
                    assert (key in m) == (key in ref), (where, aux, key)
                    if key in ref:
                        assert m[key] == pytest.approx(ref[key], rel=REL), (where, aux, key, m[key], ref[key])
                diffs[f"{where} aux={aux} after"] = float(
                    (res[f"after_{aux}"] - cp1[f"after_{aux}"]).abs().max()
                )
            diffs[f"{where} log_probs"] = float((res["log_probs"] - cp1["log_probs"]).abs().max())
    print(json.dumps(diffs, indent=1))


def test_plan_runs_tiny_grpo_moe_at_cp2_ep2():
    """The done-when layout passes validation: tiny-grpo-moe on four devices at CP=2 x EP=2 is dp 2 for the
    dense layers, and each CP pair (ranks 0, 1 and 2, 3) is also an expert-parallel pair."""
    from presets import PRESETS
    from rlconf.load import load_config
    from rlconf.plan import compile_plan, format_plan

    c = load_config(None, preset="tiny-grpo-moe", presets=PRESETS,
                    overrides=["cluster.gpus_per_node=4", "actor.megatron.context_parallel_size=2"])  # fmt: skip
    plan = compile_plan(c)
    actor = next(lay for lay in plan.layouts if lay.role == "actor")
    assert (actor.cp, actor.ep, actor.dp, actor.expert_dp) == (2, 2, 2, 2)
    text = format_plan(plan)
    assert "pp=0 dp=0: 0 | 1" in text and "pp=0 dp=1: 2 | 3" in text  # CP groups
    assert "pp=0 edp=0: ep0: 0 | ep1: 1" in text and "pp=0 edp=1: ep0: 2 | ep1: 3" in text  # EP groups
