"""Multi-process megatron tests: 2 gloo processes run TP=2, TP=2 + sequence parallel, PP=2, PP=2 x VPP=2,
DP=2 (distributed optimizer) and DP=2 (plain optimizer) in turn, loading the same HF weights, and compare
with results computed here in one process (fp32 throughout):

* log-probs and entropy equal transformers' in every layout (to the rounding of the model's reductions,
  tests/tolerance.py: about 3e-5 for these fp32 log-probs); greedy generation is identical;
* one PPO update (token-mean) gives the TP=1 grad norm and log-probs after it in every layout (same rule); the batch gives the two DP ranks very different token counts, so DP=2 only matches when the
  loss is normalised by the mini-batch's tokens over all DP ranks (also checked for seq-mean-token-mean);
* the distributed optimizer's update equals the plain optimizer's;
* HF -> megatron (TP=2, and PP=2) -> HF export is bit-identical to the source folder, tied and untied;
* offload round trips the distributed optimizer's DP shards bit-identically;
* the critic trains at TP=2 and PP=2 with ranks agreeing.
One spawn runs every layout because each process pays ~8 s of imports.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from tests.megatron._common import spawn

from ..tolerance import rel_tolerance
from ._common import (
    TINY_REDUCTION,
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    batch_from_lengths,
    critic_of,
    free_port,
    hf_logits,
    init_groups,
    make_tiny_qwen2,
    reference_log_probs,
    run_spawned,
    tiny_model_cfg,
)

# megatron-core warns about missing apex / Transformer Engine and deprecated arguments on every build.
_QUIET = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, *_QUIET]

LAYOUTS = [  # (name, tp, pp, vpp, dp, distributed optimizer)
    ("tp2", 2, 1, None, 1, True),
    ("tp2_sp", 2, 1, None, 1, True),
    ("pp2", 1, 2, None, 1, True),
    ("pp2_vpp2", 1, 2, 2, 1, True),
    ("dp2", 1, 1, None, 2, True),
    ("dp2_plain", 1, 1, None, 2, False),
]
# A grad norm sums squares over every parameter after a forward and backward pass.
GRAD_NORM_REL = rel_tolerance(torch.float32, TINY_REDUCTION, UPDATE_DEPTH)
GROUPS = ("params", "grads", "optimizer")


def _update_cfg(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    sequence_parallel: bool = False,
    distributed: bool = True,
    loss_agg_mode: str = "token-mean",
):
    from rlconf.config import Optim

    # lr 1e-4: Adam's first step is about lr x sign(grad), so a gradient that is zero up to rounding moves
    # its weight by a full lr either way; a small lr keeps that below the rounding tolerance.
    cfg = actor_cfg(
        tp,
        pp,
        vpp,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=2,
        shuffle=False,
        loss_agg_mode=loss_agg_mode,
        optim=Optim(lr=1e-4, clip_grad=1.0),
    )
    # Sequence parallel splits norms' inputs over TP ranks; their weight grads must still match TP=1.
    mcfg = replace(cfg.megatron, sequence_parallel=sequence_parallel, use_distributed_optimizer=distributed)
    return replace(cfg, megatron=mcfg)


def _uneven_batch() -> dict[str, torch.Tensor]:
    """8 rows; rows 0-3 (DP rank 0 at DP=2) have long prompts and responses, rows 4-7 short ones."""
    lens = [(12, 16), (10, 14), (12, 11), (9, 16), (3, 2), (2, 4), (4, 1), (3, 3)]
    return batch_from_lengths(lens, 12, 16, seed=0)


def _rl_batch(batch, old):
    n = batch["input_ids"].shape[0]
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)]).unsqueeze(1)
    return {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}


def _update(hf_path: str, cfg, rl: dict) -> dict:

    actor = actor_of(tiny_model_cfg(hf_path), cfg, "cpu", total_steps=4)
    metrics = actor.update_policy(rl)
    after = actor.compute_log_prob(rl, with_entropy=False)["log_probs"]
    return {"grad_norm": metrics["actor/grad_norm"], "after": after, "actor": actor}


def _reference(hf_path: str) -> dict:
    """transformers' log-probs and the TP=1 megatron results in this (session) process."""

    batch = _uneven_batch()
    logits = hf_logits(hf_path, batch["input_ids"], batch["attention_mask"])
    r, s = batch["responses"].shape[1], batch["input_ids"].shape[1]
    lp_all = torch.log_softmax(logits, -1)[:, s - r - 1 : s - 1]
    hf_lp = reference_log_probs(logits, batch)
    hf_ent = -(lp_all.exp() * lp_all).sum(-1) * batch["response_mask"]
    frozen = actor_of(tiny_model_cfg(hf_path), _update_cfg(), "cpu", trainable=False)
    gen = frozen.generate(batch["input_ids"][:4, :12], 4, temperature=0.0, pad_id=0)
    rl = _rl_batch(batch, hf_lp)
    out = {"batch": batch, "rl": rl, "log_probs": hf_lp, "entropy": hf_ent, "gen": gen["responses"]}
    for mode in ("token-mean", "seq-mean-token-mean"):
        res = _update(hf_path, _update_cfg(loss_agg_mode=mode), rl)
        out[mode] = {"grad_norm": res["grad_norm"], "after": res["after"]}
    return out


def _worker(rank: int, world: int, port: int, paths: dict, out_dir: str, ref: dict) -> None:
    run_spawned(_run_layouts, rank, world, port, paths, out_dir, ref)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _storage_bytes(engine) -> dict[str, list[torch.Tensor]]:
    from rltrain.megatron.offload import unique_storages

    return {
        g: [
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()
            for t in unique_storages(engine.state_tensors(g))
        ]
        for g in GROUPS
    }


def _run_layouts(rank: int, world: int, port: int, paths: dict, out_dir: str, ref: dict) -> None:
    from megatron.core import parallel_state

    from rlconf.config import CriticConfig, MegatronConfig, Optim
    from rltrain.megatron.hf_weights import export_hf_weights
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    hf_path = paths["tied"]
    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    batch, rl = ref["batch"], ref["rl"]
    diffs: dict[str, dict[str, float]] = {}
    after_by_layout: dict[str, torch.Tensor] = {}
    for name, tp, pp, vpp, dp, distributed in LAYOUTS:
        cfg = _update_cfg(tp, pp, vpp, sequence_parallel=name.endswith("_sp"), distributed=distributed)
        init_groups(cfg.megatron, "cpu")
        assert parallel_state.get_data_parallel_world_size() == dp
        # Every rank of a DP group sees the same rows; DP ranks split the batch.
        dp_rank = parallel_state.get_data_parallel_rank()
        rows = slice(dp_rank * 8 // dp, (dp_rank + 1) * 8 // dp)
        local = {k: v[rows] for k, v in batch.items()}
        d = diffs[name] = {}

        frozen = actor_of(tiny_model_cfg(hf_path), cfg, "cpu", trainable=False)
        out = frozen.compute_log_prob(local)
        d["log_probs_vs_hf"] = _maxdiff(out["log_probs"], ref["log_probs"][rows])
        d["entropy_vs_hf"] = _maxdiff(out["entropy"], ref["entropy"][rows])
        assert_tiny_close(out["log_probs"], ref["log_probs"][rows], msg=name)
        assert_tiny_close(out["entropy"], ref["entropy"][rows], msg=name)
        if dp == 1:
            gen = frozen.generate(batch["input_ids"][:4, :12], 4, temperature=0.0, pad_id=0)
            assert torch.equal(gen["responses"], ref["gen"]), name
        if name in ("tp2", "pp2"):
            export_hf_weights(frozen.chunks, frozen.arch, os.path.join(out_dir, f"export_{name}"))
        if name == "tp2":
            untied = actor_of(tiny_model_cfg(paths["untied"]), cfg, "cpu", trainable=False)
            export_hf_weights(untied.chunks, untied.arch, os.path.join(out_dir, "export_tp2_untied"))
            del untied
        del frozen

        local_rl = {k: v[rows] for k, v in rl.items()}
        modes = ["token-mean", "seq-mean-token-mean"] if dp > 1 else ["token-mean"]
        for mode in modes:
            res = _update(hf_path, replace(cfg, loss_agg_mode=mode), local_rl)
            expected = ref[mode]
            d[f"grad_norm_rel_{mode}"] = abs(res["grad_norm"] / expected["grad_norm"] - 1)
            d[f"after_update_{mode}"] = _maxdiff(res["after"], expected["after"][rows])
            assert res["grad_norm"] == pytest.approx(expected["grad_norm"], rel=GRAD_NORM_REL), (name, mode)
            assert_tiny_close(res["after"], expected["after"][rows], msg=f"{name} {mode}", depth=UPDATE_DEPTH)
            if mode == "token-mean":
                after_by_layout[name] = res["after"]
                actor = res["actor"]
        if name == "dp2_plain":
            d["after_update_vs_distributed_optimizer"] = _maxdiff(
                after_by_layout["dp2"], after_by_layout[name]
            )
            # The two optimizers reduce gradients in other orders (reduce-scatter of buckets vs all-reduce):
            # equal up to rounding, which on Intel CPUs was 3 ulps where AMD gave 0.
            assert_tiny_close(after_by_layout["dp2"], after_by_layout["dp2_plain"], depth=UPDATE_DEPTH)
        if name == "dp2":
            # Offload round trip of the distributed optimizer's DP shards (each rank holds half).
            before = _storage_bytes(actor)
            mem = actor.device_memory()
            assert all(v > 0 for v in mem.values()), mem
            actor.offload(params=True, grads=True, optimizer=True)
            assert actor.device_memory() == dict.fromkeys(GROUPS, 0)
            actor.reload()
            after = _storage_bytes(actor)
            for g in GROUPS:
                assert all(torch.equal(a, b) for a, b in zip(before[g], after[g], strict=True)), g
        del actor

        if name in ("tp2", "pp2"):
            ccfg = CriticConfig(
                enable=True,
                megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                ppo_mini_batch_size=8,
                ppo_micro_batch_size_per_gpu=4,
                optim=Optim(lr=1e-3),
            )
            critic = critic_of(tiny_model_cfg(hf_path), ccfg, "cpu", total_steps=4)
            values = critic.compute_values(local)
            gathered = [torch.empty_like(values) for _ in range(world)]
            torch.distributed.all_gather(gathered, values)
            assert torch.equal(gathered[0], gathered[1]), f"{name}: ranks disagree on values"
            vb = {**local, "values": values, "returns": torch.ones_like(values) * local["response_mask"]}
            m1 = critic.update_critic(vb)
            m2 = critic.update_critic(vb)
            assert m2["critic/vf_loss"] < m1["critic/vf_loss"], name
            del critic
    gathered_diffs: list = [None] * world
    torch.distributed.all_gather_object(gathered_diffs, diffs)
    if rank == 0:
        worst = {n: {k: max(g[n][k] for g in gathered_diffs) for k in diffs[n]} for n in diffs}
        with open(os.path.join(out_dir, "diffs.json"), "w") as f:
            json.dump(worst, f, indent=1)
    destroy_parallel()


def test_layouts_match_single_process(mp_world, tiny_hf, tmp_path):
    from .test_parity import assert_same_safetensors

    untied = make_tiny_qwen2(tmp_path / "untied", tie=False, seed=1)
    ref = _reference(str(tiny_hf))
    paths = {"tied": str(tiny_hf), "untied": str(untied)}
    spawn(_worker, args=(2, free_port(), paths, str(tmp_path), ref), nprocs=2, join=True)
    # HF -> megatron at TP=2 / PP=2 -> HF: every tensor bit-identical to the source folder.
    assert_same_safetensors(tiny_hf, tmp_path / "export_tp2")
    assert_same_safetensors(tiny_hf, tmp_path / "export_pp2")
    assert_same_safetensors(untied, tmp_path / "export_tp2_untied")
    assert (tmp_path / "export_pp2" / "model.safetensors.index.json").exists()
    # And transformers loads the export (the sharded PP=2 folder through its index).
    batch = ref["batch"]
    a = hf_logits(tiny_hf, batch["input_ids"], batch["attention_mask"])
    b = hf_logits(tmp_path / "export_pp2", batch["input_ids"], batch["attention_mask"])
    assert torch.equal(a, b)
    print(json.dumps(json.loads((tmp_path / "diffs.json").read_text()), indent=1))
