"""Mixture-of-experts models in the megatron engine (CPU, fp32, gloo), checked against transformers.

Tiny random Qwen3-MoE (norm_topk_prob, a dense layer from mlp_only_layers), Qwen2-MoE (gated shared expert,
unnormalised top-k, a dense first layer) and Mixtral (w1/w2/w3 experts) folders saved by transformers: at
EP=1 the engine's log-probs equal transformers' and HF -> megatron -> HF is bit-identical; in a gloo world of
two processes the same holds at EP=2 (experts split over ranks, tokens exchanged by the alltoall dispatcher)
and TP=2 x EP=2 (expert TP 1), and one PPO update gives the EP=1 result. The rlconf side: the plan puts EP
in the grid and rejects an expert count EP does not divide.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlconf.config import ModelConfig, Optim
from tests.megatron._common import spawn

from ..tolerance import rel_tolerance
from ._common import (
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_export_round_trips,
    assert_tiny_close,
    batch_from_lengths,
    free_port,
    fuse_adam_on_cpu,
    hf_logits,
    init_groups,
    reference_log_probs,
    run_spawned,
)
from .test_parity import assert_same_safetensors

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

# Small enough for 2 CPU cores; 4 experts (2 per EP rank), top-2, three layers of which one is dense.
MOE_BASE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
MOE_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                   "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [0]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}  # fmt: skip
# The widest sum a log-prob passes through (vocabulary padded to 128) and the reductions in sequence.
MOE_REDUCTION = 128
MOE_DEPTH = 2 * MOE_BASE["num_hidden_layers"] + 2
GEN_TOKENS = 6


def make_tiny_moe(path: Path, family: str, seed: int = 0) -> Path:
    """A random tiny MoE model of `family` saved by transformers (weights scaled up so that logits and router
    scores are not flat)."""
    import transformers

    config_cls, model_cls, extra = MOE_CONFIGS[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**MOE_BASE, **extra))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return path


def _close(actual: torch.Tensor, expected: torch.Tensor, msg: str, depth: int = MOE_DEPTH) -> None:
    assert_tiny_close(actual, expected, msg=msg, depth=depth)


def _batch() -> dict[str, torch.Tensor]:
    """8 rows of uneven prompt / response lengths (DP=2 ranks get 4 each)."""
    lens = [(12, 16), (10, 14), (12, 11), (9, 16), (3, 2), (2, 4), (4, 1), (3, 3)]
    return batch_from_lengths(lens, 12, 16, seed=0)


def _layout_cfg(tp: int = 1, ep: int = 1, etp: int | None = None, aux: float | None = None):
    """Actor config of one layout; `aux` overrides the config.json load-balancing coefficient."""
    # lr 1e-4 as in test_multiproc: Adam's first step is lr x sign(grad), a small lr keeps it below rounding.
    cfg = actor_cfg(tp, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, shuffle=False,
                    loss_agg_mode="token-mean", optim=Optim(lr=1e-4, clip_grad=1.0))  # fmt: skip
    ov = replace(cfg.megatron.override_transformer_config, moe_aux_loss_coeff=aux)
    # megatron trains MoE layers at TP > 1 only with sequence parallel (the plan says so too).
    mcfg = replace(cfg.megatron, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                   sequence_parallel=tp > 1, override_transformer_config=ov)  # fmt: skip
    return replace(cfg, megatron=mcfg)


def _actor(path: Path | str, cfg=None, trainable: bool = False):
    return actor_of(ModelConfig(path=str(path), attention_backend="sdpa"), cfg or _layout_cfg(), "cpu",
                         trainable=trainable, total_steps=4)  # fmt: skip


def _update(path: str, cfg, rl: dict, fused: bool = False) -> dict:
    """One update; `fused`: torch's fused AdamW, as on an accelerator, so the step is decided on the device
    (rltrain.megatron.model.steps_on_device)."""
    actor = _actor(path, cfg, trainable=True)
    if fused:
        from rltrain.megatron.model import steps_on_device

        fuse_adam_on_cpu(actor)
        assert steps_on_device(actor._optimizer)
    metrics = actor.update_policy(rl)
    after = actor.compute_log_prob(rl, with_entropy=False)["log_probs"]
    return {"metrics": metrics, "after": after}


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def moe_folder(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_tiny_moe(tmp_path_factory.mktemp(request.param) / "hf", request.param)


# ------------------------------------------------------------------------------------ EP = 1
def test_moe_log_probs_match_transformers(mp_world, moe_folder):
    from rltrain.megatron.model import unwrap

    family, path = moe_folder
    actor = _actor(path)
    model = unwrap(actor.chunks[0])
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    dense = {"qwen3_moe": 1, "qwen2_moe": 0}.get(family)
    assert kinds == ["MLP" if i == dense else "MoELayer" for i in range(3)], family
    if family == "qwen2_moe":
        assert model.decoder.layers[1].mlp.shared_experts.use_shared_expert_gate
    batch = _batch()
    logits = hf_logits(path, batch["input_ids"], batch["attention_mask"])
    got = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    _close(got, reference_log_probs(logits, batch), family)


def test_moe_router_dtype_sets_every_routers_precision(mp_world, tmp_path_factory, monkeypatch):
    """model.moe_router_dtype (verl's override_transformer_config.moe_router_dtype): in a bf16 model every
    MoE layer's router computes its gating product, and so its routing, in fp32 (megatron's
    moe_router_dtype) through rlplan's own router paths (log-probs, an update, the static decode step);
    unset, the router runs in bf16 (transformers' gate)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from rltrain.megatron.model import unwrap

    path = make_tiny_moe(tmp_path_factory.mktemp("router_dtype") / "hf", "qwen3_moe")
    gating_dtypes: list[torch.dtype] = []
    gating = TopKRouter.gating
    monkeypatch.setattr(
        TopKRouter, "gating", lambda self, x: (out := gating(self, x), gating_dtypes.append(out.dtype))[0]
    )
    batch = _batch()
    log_probs = {}
    for setting, dtype in ((None, torch.bfloat16), ("fp32", torch.float32)):
        model = ModelConfig(path=str(path), attention_backend="sdpa", params_dtype="bfloat16",
                            moe_router_dtype=setting)  # fmt: skip
        actor = actor_of(model, _layout_cfg(), "cpu", trainable=True, total_steps=4)
        routers = [m for m in unwrap(actor.chunks[0]).modules() if isinstance(m, TopKRouter)]
        assert routers and {r.config.moe_router_dtype for r in routers} == {setting}
        gating_dtypes.clear()
        log_probs[setting] = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        actor.update_policy(_rl_batch(batch, log_probs[setting]))
        actor.generate(
            batch["input_ids"][:2, :6], 3, temperature=0.0, pad_id=0, cuda_graph=True
        )  # static step
        assert gating_dtypes and set(gating_dtypes) == {dtype}, setting
    assert all(torch.isfinite(lp).all() for lp in log_probs.values())


@pytest.mark.parametrize("grouped", [False, True], ids=["megatron_layer", "grouped_layer"])
def test_moe_metrics_count_each_routing_once_with_full_recompute(mp_world, tmp_path_factory, grouped):
    """Full activation recompute runs every MoE layer's forward twice (without autograd, then again in the
    backward): the update's load-balancing loss and expert-load metrics are those of the same update without
    recompute, each routing counted once."""
    path = make_tiny_moe(tmp_path_factory.mktemp("recompute") / "hf", "qwen3_moe")
    batch = _batch()
    rl = _rl_batch(batch, torch.zeros_like(batch["response_mask"], dtype=torch.float32))
    model = ModelConfig(path=str(path), attention_backend="sdpa", moe_grouped_gemm=grouped)
    metrics = {}
    for recompute in (False, True):
        cfg = _layout_cfg(aux=0.01)
        if recompute:
            ov = replace(cfg.megatron.override_transformer_config, recompute_granularity="full",
                         recompute_method="uniform", recompute_num_layers=1)  # fmt: skip
            cfg = replace(cfg, megatron=replace(cfg.megatron, override_transformer_config=ov))
        metrics[recompute] = actor_of(model, cfg, "cpu", trainable=True, total_steps=4).update_policy(rl)
    for key in ("actor/moe_aux_loss", "actor/moe_expert_load_max"):
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-6), key


def test_moe_loader_reads_exactly_the_tensors_validate_checks(mp_world, moe_folder, monkeypatch):
    """rlconf.model_files.hf_tensors (what `rlconf validate` checks) is what the loader reads: routers, every
    expert, shared experts and their gate."""
    from rlconf.model_files import hf_tensors
    from rltrain.megatron import hf_weights

    family, path = moe_folder
    read: set[str] = set()
    get = hf_weights._HFReader.get
    monkeypatch.setattr(hf_weights._HFReader, "get", lambda self, name: (read.add(name), get(self, name))[1])
    actor = _actor(path)
    assert read == set(hf_tensors(actor.arch)), family


def test_moe_greedy_generation_matches_transformers(mp_world, moe_folder):
    """The embedded rollout engine (KV cache) generates with MoE layers: greedy tokens equal transformers'
    generate (no EOS)."""
    import transformers

    family, path = moe_folder
    prompts = _batch()["input_ids"][:, :12]
    got = _actor(path).generate(prompts, GEN_TOKENS, temperature=0.0, pad_id=0)["responses"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    expected = model.generate(input_ids=prompts, attention_mask=(prompts != 0).long(), max_new_tokens=GEN_TOKENS,
                              do_sample=False, pad_token_id=0)[:, prompts.shape[1] :]  # fmt: skip
    assert torch.equal(got, expected), family


def test_moe_hf_round_trip_is_bit_identical(mp_world, moe_folder, tmp_path):
    family, src = moe_folder
    keys = ("model_type", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers", "router_aux_loss_coef")  # fmt: skip
    assert_export_round_trips(_actor(src), src, tmp_path, keys, MOE_CONFIGS[family][1], family)


# ------------------------------------------------------------------------------------ EP = 2, TP = 2 x EP = 2
# (name, tp, ep, expert tp); both run in a world of two processes (EP=2 is DP=2 for the dense layers).
EP_LAYOUTS = [("ep2", 1, 2, None), ("tp2_ep2", 2, 2, 1)]
UPDATE_FAMILY = "qwen3_moe"


def _rl_batch(batch: dict, old: torch.Tensor) -> dict:
    n = batch["input_ids"].shape[0]
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)]).unsqueeze(1)
    return {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}


def _ep_worker(rank: int, world: int, port: int, refs: dict, out_dir: str) -> None:
    run_spawned(_run_ep_layouts, rank, world, port, refs, out_dir)


def _run_ep_layouts(rank: int, world: int, port: int, refs: dict, out_dir: str) -> None:
    """Every family at every EP_LAYOUTS layout: log-probs vs transformers, an export per family and layout,
    and a PPO update of UPDATE_FAMILY vs EP=1; rank 0 writes the largest differences to out_dir/diffs.json."""
    from megatron.core import parallel_state

    from rltrain.megatron.hf_weights import export_hf_weights
    from rltrain.megatron.model import unwrap
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    batch = refs["batch"]
    diffs: dict[str, float] = {}
    for name, tp, ep, etp in EP_LAYOUTS:
        cfg = _layout_cfg(tp, ep, etp)
        init_groups(cfg.megatron, "cpu")
        assert parallel_state.get_expert_model_parallel_world_size() == ep
        dp = parallel_state.get_data_parallel_world_size()
        rows = slice(
            parallel_state.get_data_parallel_rank() * 8 // dp,
            (parallel_state.get_data_parallel_rank() + 1) * 8 // dp,
        )
        local = {k: v[rows] for k, v in batch.items()}
        for family, path in refs["paths"].items():
            where = f"{family} {name}"
            actor = _actor(path, cfg)
            experts = unwrap(actor.chunks[0]).decoder.layers[-1].mlp.experts.local_experts
            assert len(experts) == 4 // ep, where  # each EP rank holds its share of the experts
            got = actor.compute_log_prob(local, with_entropy=False)["log_probs"]
            expected = refs["log_probs"][family][rows]
            diffs[f"{where} log_probs"] = float((got - expected).abs().max())
            _close(got, expected, where)
            # Generation exchanges tokens between the EP ranks at every decode step, as training does.
            gen = actor.generate(local["input_ids"][:, :12], GEN_TOKENS, temperature=0.0, pad_id=0)
            assert torch.equal(gen["responses"], refs["gen"][family][rows]), f"{where}: greedy tokens"
            export_hf_weights(actor.chunks, actor.arch, os.path.join(out_dir, f"{family}_{name}"))
            del actor
        # One PPO update (token-mean over the whole mini-batch) equals EP=1's. The load-balancing loss is
        # computed per micro-batch on each rank's own tokens, so it matches EP=1 only where the ranks see the
        # same tokens (TP=2 x EP=2 is DP=1); at EP=2 (DP=2) the update is compared without it.
        path = refs["paths"][UPDATE_FAMILY]
        rl = {k: v[rows] for k, v in refs["rl"].items()}
        # Also with the step decided on the device (fused AdamW): the same norm over the EP ranks' shards.
        runs = [(0.0, False), (0.0, True), (None, False)] if dp == 1 else [(0.0, False), (0.0, True)]
        for aux, fused in runs:
            res = _update(path, _layout_cfg(tp, ep, etp, aux), rl, fused)
            expected = refs["updates"][str(aux)]
            where = f"{name} update aux={aux}" + (" (step on the device)" if fused else "")
            diffs[f"{where} after"] = float((res["after"] - expected["after"][rows]).abs().max())
            rel = rel_tolerance(torch.float32, MOE_REDUCTION, UPDATE_DEPTH)
            assert res["metrics"]["actor/grad_norm"] == pytest.approx(expected["grad_norm"], rel=rel), where
            _close(res["after"], expected["after"][rows], where, depth=UPDATE_DEPTH)
            if aux is None:
                assert res["metrics"]["actor/moe_aux_loss"] == pytest.approx(expected["aux_loss"], rel=rel), (
                    where,
                    res["metrics"]["actor/moe_aux_loss"],
                    expected["aux_loss"],
                )
    if rank == 0:
        with open(os.path.join(out_dir, "diffs.json"), "w") as f:
            json.dump(diffs, f, indent=1)
    destroy_parallel()


@pytest.mark.slow
@pytest.mark.multiproc
def test_moe_at_ep2_and_tp2_ep2_match_transformers_and_ep1(mp_world, tmp_path):
    """Two gloo processes run the three families at EP=2 and TP=2 x EP=2 (one spawn): log-probs equal
    transformers', greedy generation equals EP=1's, exports are bit-identical to the source folder, and a
    PPO update of Qwen3-MoE equals the EP=1 update in this process (grad norm, log-probs after the step, the
    load-balancing loss)."""
    folders = {f: make_tiny_moe(tmp_path / f, f) for f in MOE_CONFIGS}
    batch = _batch()
    log_probs = {
        f: reference_log_probs(hf_logits(p, batch["input_ids"], batch["attention_mask"]), batch)
        for f, p in folders.items()
    }
    rl = _rl_batch(batch, log_probs[UPDATE_FAMILY])
    gen = {
        f: _actor(p).generate(batch["input_ids"][:, :12], GEN_TOKENS, temperature=0.0, pad_id=0)["responses"]
        for f, p in folders.items()
    }
    updates = {}
    for aux in (0.0, None):
        res = _update(str(folders[UPDATE_FAMILY]), _layout_cfg(aux=aux), rl)
        updates[str(aux)] = {"grad_norm": res["metrics"]["actor/grad_norm"], "after": res["after"],
                             "aux_loss": res["metrics"].get("actor/moe_aux_loss")}  # fmt: skip
        if aux is None:
            assert res["metrics"]["actor/moe_aux_loss"] > 0
    assert not torch.equal(updates["0.0"]["after"], updates["None"]["after"])  # the aux loss moves weights
    refs = {"paths": {f: str(p) for f, p in folders.items()}, "batch": batch, "log_probs": log_probs, "rl": rl,
            "updates": updates, "gen": gen}  # fmt: skip
    out_dir = tmp_path / "exports"
    out_dir.mkdir()
    spawn(_ep_worker, args=(2, free_port(), refs, str(out_dir)), nprocs=2, join=True)
    for family, src in folders.items():
        for name, *_ in EP_LAYOUTS:
            assert_same_safetensors(src, out_dir / f"{family}_{name}")
    print(json.dumps(json.loads((out_dir / "diffs.json").read_text()), indent=1))


# ------------------------------------------------------------------------------------ the preset
@pytest.mark.slow
@pytest.mark.multiproc
def test_tiny_grpo_moe_learns_with_expert_parallel(tmp_path):
    """`rltrain tiny-grpo-moe` (two CPU workers, EP=2) learns like tiny-grpo: the mean reward of the last 10
    steps is over twice the first 10's (measured over 100 steps: 0.033 -> 0.240), and every update reports
    the load-balancing loss and the expert load."""
    from ..test_e2e import metrics, rltrain

    out = tmp_path / "moe"
    result = rltrain("tiny-grpo-moe", "--trainer.total_steps", "80", "--trainer.save_freq", "0",
                     "--trainer.output_dir", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    actor = next(lay for lay in plan["layouts"] if lay["role"] == "actor")
    assert (actor["ep"], actor["dp"], actor["world_size"]) == (2, 2, 2)
    rows = metrics(out)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first and last > first + 0.1, (first, last)
    for row in rows:
        assert row["actor/moe_aux_loss"] > 0
        assert 1.0 <= row["actor/moe_expert_load_max"] <= 4 / 2  # at most num_experts / topk


# ------------------------------------------------------------------------------------ checkpoints across EP
CKPT_CONTENTS = ("model", "optimizer", "extra")


def _random_init_actor(path: str, cfg):
    """An actor of `path`'s architecture with random weights: everything must come from the checkpoint."""
    from rlconf.model_spec import read_model_arch

    arch = read_model_arch(path)
    return actor_of(ModelConfig(path=None, arch=arch, attention_backend="sdpa"), cfg, "cpu", total_steps=4)


def _train_save_continue(path: str, cfg, rl: dict, folder: Path) -> dict[str, torch.Tensor]:
    """One update, save (model, optimizer, extra), one more update: log-probs at the save and after it."""
    from rltrain.checkpoint import save_engine

    actor = _actor(path, cfg, trainable=True)
    actor.update_policy(rl)
    saved = actor.compute_log_prob(rl, with_entropy=False)["log_probs"]
    assert save_engine(actor, folder, CKPT_CONTENTS, {"step": 1})
    actor.update_policy(rl)
    return {"saved": saved, "cont": actor.compute_log_prob(rl, with_entropy=False)["log_probs"]}


def _load_and_continue(path: str, cfg, rl: dict, folder: Path) -> dict[str, torch.Tensor]:
    from rltrain.checkpoint import load_engine

    actor = _random_init_actor(path, cfg)
    assert load_engine(actor, folder, CKPT_CONTENTS) == {"step": 1}
    loaded = actor.compute_log_prob(rl, with_entropy=False)["log_probs"]
    actor.update_policy(rl)
    return {"loaded": loaded, "cont": actor.compute_log_prob(rl, with_entropy=False)["log_probs"]}


def _ckpt_worker(rank: int, world: int, port: int, path: str, out: str, rl: dict, ref: dict) -> None:
    run_spawned(_run_ckpt, rank, world, port, path, Path(out), rl, ref)


def _run_ckpt(rank: int, world: int, port: int, path: str, out: Path, rl: dict, ref: dict) -> None:
    """At EP=2: load the EP=1 checkpoint and continue (vs this test's EP=1 run), then train, save and continue
    from the same start for the EP=1 load in the test process."""
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    cfg = _layout_cfg(ep=2, aux=0.0)
    init_groups(cfg.megatron, "cpu")
    d = parallel_state.get_data_parallel_rank()
    rows = slice(d * 4, (d + 1) * 4)
    local = {k: v[rows] for k, v in rl.items()}
    got = _load_and_continue(path, cfg, local, out / "ep1" / "actor")
    _close(got["loaded"], ref["saved"][rows], "EP=1 checkpoint loaded at EP=2", depth=UPDATE_DEPTH)
    _close(got["cont"], ref["cont"][rows], "update after the EP=1 -> EP=2 load", depth=2 * UPDATE_DEPTH)
    results = _train_save_continue(path, cfg, local, out / "ep2" / "actor")
    gathered: list = [None, None]
    torch.distributed.all_gather_object(gathered, {k: v for k, v in results.items()})
    if rank == 0:
        torch.save({k: torch.cat([g[k] for g in gathered]) for k in results}, out / "ep2_results.pt")
    destroy_parallel()


@pytest.mark.slow
@pytest.mark.multiproc
def test_moe_checkpoints_reshard_across_expert_parallel(mp_world, tmp_path):
    """A Qwen3-MoE actor saved at EP=1 (model, distributed optimizer, extra) loads at EP=2 in two gloo
    processes with the same log-probs and the same next update as the uninterrupted EP=1 run, and the EP=2
    save loads back at EP=1 likewise (the load-balancing loss is off: its per-rank value depends on DP)."""
    path = str(make_tiny_moe(tmp_path / "hf", UPDATE_FAMILY))
    batch = _batch()
    old = _actor(path).compute_log_prob(batch, with_entropy=False)["log_probs"]
    rl = _rl_batch(batch, old)
    cfg = _layout_cfg(aux=0.0)
    ref = _train_save_continue(path, cfg, rl, tmp_path / "ep1" / "actor")
    spawn(_ckpt_worker, args=(2, free_port(), path, str(tmp_path), rl, ref), nprocs=2,
                                join=True)  # fmt: skip
    ep2 = torch.load(tmp_path / "ep2_results.pt")
    # The EP=2 run started from the same weights and batch: its own save / continuation equal EP=1's ...
    _close(ep2["saved"], ref["saved"], "EP=2 training vs EP=1", depth=UPDATE_DEPTH)
    # ... and its checkpoint loads back at EP=1 into the EP=2 continuation.
    got = _load_and_continue(path, cfg, rl, tmp_path / "ep2" / "actor")
    _close(got["loaded"], ep2["saved"], "EP=2 checkpoint loaded at EP=1", depth=UPDATE_DEPTH)
    _close(got["cont"], ep2["cont"], "update after the EP=2 -> EP=1 load", depth=2 * UPDATE_DEPTH)


# ------------------------------------------------------------------------------------ offload
def test_moe_offload_releases_expert_weights_grads_and_optimizer_state(mp_world, moe_folder):
    """param / grad / optimizer offload takes the routed experts too: their weights, their gradient buffer
    (megatron DDP's expert buffers) and the expert optimizer's Adam state leave the device and come back
    bit-identical."""
    from rltrain.megatron.model import unwrap

    family, path = moe_folder
    cfg = _layout_cfg(aux=0.0)
    mcfg = replace(cfg.megatron, param_offload=True, grad_offload=True, optimizer_offload=True)
    actor = _actor(path, replace(cfg, megatron=mcfg), trainable=True)
    batch = _batch()
    actor.update_policy(_rl_batch(batch, actor.compute_log_prob(batch, with_entropy=False)["log_probs"]))
    experts = [p for name, p in unwrap(actor.chunks[0]).named_parameters() if ".local_experts." in name]
    assert experts
    chunk = actor._chunks[0]
    expert_grads = [b.grad_data for b in chunk.expert_parallel_buffers]
    assert expert_grads  # the experts' gradients live in DDP's expert buffers
    expert_opt = actor._sub_optimizers()[-1]  # megatron chains the experts' optimizer last
    adam = [v for st in expert_opt.optimizer.state.values() for k, v in st.items() if k != "step"]
    assert adam
    before = [t.clone() for t in experts + expert_grads + adam]
    actor.offload(params=True, grads=True, optimizer=True)
    assert actor.device_memory() == {"params": 0, "grads": 0, "optimizer": 0}
    assert all(t.untyped_storage().nbytes() == 0 for t in experts + expert_grads + adam), family
    actor.reload()
    after = experts + expert_grads + adam
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), family


# ------------------------------------------------------------------------------------ the plan
def test_plan_puts_expert_parallel_in_the_grid_and_checks_the_expert_count():
    """`rlconf plan` shows ep / etp in the layout and the expert grid (megatron's etp-ep-edp-pp order); an ep
    that does not divide the experts, and MoE at TP > 1 without sequence parallel, are named errors."""
    from presets import PRESETS
    from rlconf.errors import ConfigError
    from rlconf.load import load_config
    from rlconf.plan import compile_plan, format_plan

    def plan(*overrides: str):
        return compile_plan(
            load_config(None, preset="tiny-grpo-moe", overrides=list(overrides), presets=PRESETS)
        )

    text = format_plan(plan())
    assert "actor expert grid (ranks by expert tp, per expert-parallel rank):" in text
    assert "pp=0 edp=0: ep0: 0 | ep1: 1" in text
    wide = plan("cluster.gpus_per_node=8", "actor.megatron.expert_model_parallel_size=4",
                "actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true",
                "actor.megatron.expert_tensor_parallel_size=1", "actor.ppo_micro_batch_size_per_gpu=8")  # fmt: skip
    actor = next(lay for lay in wide.layouts if lay.role == "actor")
    assert (actor.tp, actor.ep, actor.etp, actor.dp, actor.expert_dp) == (2, 4, 1, 4, 2)
    assert "pp=0 edp=1: ep0: 4 | ep1: 5 | ep2: 6 | ep3: 7" in format_plan(wide)
    with pytest.raises(ConfigError) as exc:
        plan("model.arch.num_moe_experts=6", "cluster.gpus_per_node=4", "actor.megatron.expert_model_parallel_size=4",
             "actor.ppo_micro_batch_size_per_gpu=8")  # fmt: skip
    assert "actor.megatron.expert_model_parallel_size" in exc.value.paths
    with pytest.raises(ConfigError) as exc:
        plan("actor.megatron.tensor_model_parallel_size=2", "actor.megatron.expert_model_parallel_size=1",
             "actor.ppo_micro_batch_size_per_gpu=32")  # fmt: skip
    assert "actor.megatron.sequence_parallel" in exc.value.paths


def test_memory_estimate_shards_expert_optimizer_state_over_expert_data_parallel():
    """With the distributed optimizer, megatron shards the routed experts' optimizer state over the expert
    data-parallel group (world / (etp x ep x pp)), the rest over dp x cp. On 8 devices a rank holds all
    experts at EP=1 (state sharded 8 ways) or 1/8 of them at EP=8 (state not sharded): the same expert
    state per device, while the weights shrink by 7/8 of the experts."""
    from presets import PRESETS
    from rlconf.load import load_config
    from rlconf.model_spec import layer_params
    from rlconf.plan import compile_plan

    def actor_memory(ep: int):
        c = load_config(None, preset="tiny-grpo-moe", overrides=[
            "cluster.gpus_per_node=8", f"actor.megatron.expert_model_parallel_size={ep}",
            "model.arch.num_moe_experts=8", "actor.ppo_micro_batch_size_per_gpu=4"], presets=PRESETS)  # fmt: skip
        return next(r for r in compile_plan(c).memory.roles if r.role == "actor"), c.model.arch

    one, arch = actor_memory(1)
    eight, _ = actor_memory(8)
    experts = arch.num_layers * layer_params(arch, True).experts
    assert one.params_per_device - eight.params_per_device == experts * 7 // 8
    assert eight.optimizer_gib == pytest.approx(one.optimizer_gib, rel=1e-9)
