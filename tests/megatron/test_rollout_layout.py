"""Rollout in its own layout (rltrain/rollout/reshard.py): the actor's weights resharded into a rollout
replica of another TP size on the same 2 gloo processes, and the whole CLI run of the issue.

Weights are compared through the HF export of the replica (`export_hf_weights` under the rollout's parallel
state gathers its TP shards): a correct reshard gives the source folder's tensors bit for bit, for
TP=2 -> TP=1, TP=1 -> TP=2 and PP=2 -> TP=1 (stages gathered), tied and untied models. After the actor's
weights change, the next refit carries the change; the replica's storage is freed after each generation.
The sampling engine's log-probs equal the actor's recomputation (rollout/logprob_diff_max < 1e-5, fp32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from tests.megatron._common import spawn

from ._common import actor_cfg, actor_of, free_port, init_groups, make_tiny_qwen2, run_spawned, tiny_model_cfg

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
BUCKET = 16 * 1024  # small: the tiny model's refit takes several buckets (the bucketing is exercised)


def _worker(rank: int, world: int, port: int, untied: str, tied: str, out_dir: str) -> None:
    run_spawned(_run, rank, world, port, untied, tied, out_dir)


def _export(replica, folder: str) -> None:
    from rltrain.megatron.hf_weights import export_hf_weights

    with replica.state.active():
        export_hf_weights(replica.modules(), replica.arch, folder)


def _run(rank: int, world: int, port: int, untied: str, tied: str, out_dir: str) -> None:
    from rltrain.megatron.hf_weights import export_hf_weights
    from rltrain.megatron.parallel import destroy_parallel, init_distributed
    from rltrain.rollout.reshard import RolloutReplica

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    out: dict[str, object] = {}
    cases = [("tp2_to_tp1", untied, dict(tp=2), 1), ("tp1_to_tp2", untied, dict(tp=1), 2),
             ("pp2_to_tp1", untied, dict(pp=2), 1), ("tied_pp2_to_tp2", tied, dict(pp=2), 2)]  # fmt: skip
    for label, hf, layout, rollout_tp in cases:
        cfg = actor_cfg(**layout)
        init_groups(cfg.megatron, "cpu")
        actor = actor_of(tiny_model_cfg(hf), cfg, "cpu", trainable=False)
        replica = RolloutReplica(actor, rollout_tp, BUCKET)
        stats = replica.refit()
        out[f"{label}/buckets"] = stats.buckets
        _export(replica, os.path.join(out_dir, label))
        if label == "tp2_to_tp1":
            # Change the actor's weights (as an update would): the next refit carries the change.
            with torch.no_grad():
                for p in actor.chunks[0].parameters():
                    p.add_(0.01 * torch.sign(p))
            export_hf_weights(actor.chunks, actor.arch, os.path.join(out_dir, "updated_actor"))
            replica.release()
            replica.refit()
            _export(replica, os.path.join(out_dir, "updated_replica"))
            # Generate through the replica: each rollout DP rank samples half, every rank gets all rows.
            prompts = torch.randint(1, 100, (4, 6), generator=torch.Generator().manual_seed(0))
            mask = torch.ones_like(prompts)
            mask[1, :2] = 0
            batch = replica.generate(
                prompts, mask, seed=7, actor_dp_rank=0, max_new_tokens=5, temperature=1.0, pad_id=0
            )
            out["allocated_after_generate"] = replica.allocated_bytes()
            out["batch"] = batch
            lp = actor.compute_log_prob(batch, temperature=1.0, with_entropy=False)["log_probs"]
            gap = ((batch["rollout_log_probs"] - lp).abs() * batch["response_mask"]).max().item()
            out["logprob_diff_max"] = gap
            out["rollout_dp"] = (replica.dp_rank, replica.dp_size)
        destroy_parallel(destroy_process_group=False)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def _tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def _assert_same_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], label: str
) -> None:
    assert sorted(actual) == sorted(expected), label
    for name, t in expected.items():
        assert torch.equal(actual[name], t), (label, name)


@pytest.mark.multiproc
@pytest.mark.slow
def test_reshard_to_another_tp_gives_the_actors_weights(tmp_path):
    untied = make_tiny_qwen2(tmp_path / "untied", tie=False, seed=1)
    tied = make_tiny_qwen2(tmp_path / "tied", tie=True, seed=2)
    spawn(_worker, args=(2, free_port(), str(untied), str(tied), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    src = {"untied": _tensors(untied), "tied": _tensors(tied)}
    for label in ("tp2_to_tp1", "tp1_to_tp2", "pp2_to_tp1", "tied_pp2_to_tp2"):
        _assert_same_tensors(_tensors(tmp_path / label), src["tied" if "tied_" in label else "untied"], label)
        assert r0[f"{label}/buckets"] > 1, label  # 16 KiB buckets: the refit ran in several rounds
    # The refit after a weight change carries it (and the change is real).
    updated = _tensors(tmp_path / "updated_actor")
    _assert_same_tensors(_tensors(tmp_path / "updated_replica"), updated, "after update")
    assert not torch.equal(updated["model.norm.weight"], src["untied"]["model.norm.weight"])
    # Generation: two rollout DP ranks, each half of the rows; every rank returns all rows, in order.
    assert (r0["rollout_dp"], r1["rollout_dp"]) == ((0, 2), (1, 2))
    for k, v in r0["batch"].items():
        assert torch.equal(v, r1["batch"][k]), k
    assert r0["batch"]["responses"].shape == (4, 5) and bool(r0["batch"]["response_mask"].any())
    assert r0["allocated_after_generate"] == 0 == r1["allocated_after_generate"]
    # The weights used for sampling are the actor's: sampler log-probs equal the actor's recomputation.
    assert r0["logprob_diff_max"] < 1e-5 and r1["logprob_diff_max"] < 1e-5


@pytest.mark.multiproc
@pytest.mark.slow
def test_cli_run_generates_at_tp1_while_training_at_tp2(tmp_path):
    """The issue's done-when command on CPU: exits 0, and the sampler's log-probs equal the actor's."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--cluster.gpus_per_node", "2",
           "--actor.megatron.tensor_model_parallel_size", "2", "--rollout.tensor_model_parallel_size", "1",
           "--trainer.total_steps", "3", "--trainer.output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["refit"]["mode"] == "reshard" and plan["refit"]["rollout_dp"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-5, r


# ------------------------------------------------------------------------------------------- config and plan
def _load(*overrides: str):
    from presets import PRESETS
    from rlconf.load import load_config

    return load_config(None, preset="tiny-grpo", overrides=list(overrides), presets=PRESETS)


def test_setting_only_the_actors_tp_validates_and_the_rollout_follows_it():
    from rlconf.plan import compile_plan

    cfg = _load("cluster.gpus_per_node=8", "actor.megatron.tensor_model_parallel_size=2",
                "actor.ppo_micro_batch_size_per_gpu=8")  # fmt: skip
    assert cfg.rollout.tensor_model_parallel_size is None
    plan = compile_plan(cfg)
    rollout = plan.layout("rollout")
    assert (rollout.tp, rollout.pp, rollout.dp) == (2, 1, 4)
    assert plan.refit.mode == "zero-copy" and plan.refit.extra_gib == 0.0


def test_plan_shows_the_rollout_grid_and_the_refits_memory_and_time():
    from rlconf.plan import compile_plan, format_plan, plan_to_dict

    cfg = _load("cluster.gpus_per_node=4", "actor.megatron.tensor_model_parallel_size=2",
                "actor.megatron.pipeline_model_parallel_size=2", "rollout.tensor_model_parallel_size=1",
                "actor.ppo_micro_batch_size_per_gpu=8")  # fmt: skip
    plan = compile_plan(cfg)
    rollout = plan.layout("rollout")
    assert (rollout.tp, rollout.pp, rollout.dp) == (1, 1, 4)
    refit = plan_to_dict(plan)["refit"]
    assert (refit["mode"], refit["actor_tp"], refit["actor_pp"], refit["rollout_dp"]) == ("reshard", 2, 2, 4)
    # The replica holds the whole model at tp 1 plus one bucket (capped by the model's size).
    full_gib = plan.model("policy").params_total * 4 / 2**30
    assert refit["extra_gib"] == pytest.approx(3 * full_gib, rel=1e-3)
    assert refit["estimated_s"] > 0
    text = format_plan(plan)
    assert "rollout grid (ranks by tp):" in text and "    pp=0 dp=3: 3" in text
    assert "rollout refit: resharded on the actor's devices, actor tp 2 x pp 2 -> rollout tp 1 x dp 4" in text
    gen = next(p for pool in plan.memory.pools for p in pool.phases if p.phase == "generate_sequences")
    assert "rollout weights (resharded)" in {part.label for part in gen.parts}


def test_a_rollout_tp_that_cannot_regroup_the_actors_shards_is_a_named_error():
    from rlconf.errors import ConfigError
    from rlconf.validate import check_config

    try:
        issues = check_config(_load("cluster.gpus_per_node=6", "actor.megatron.tensor_model_parallel_size=2",
                                    "rollout.tensor_model_parallel_size=3"))  # fmt: skip
    except ConfigError as exc:
        issues = exc.issues
    (err,) = [i for i in issues if i.rule == "rollout-engine"]
    assert err.path == "rollout.tensor_model_parallel_size" and "use one of 1, 2, 4, 8" in err.fix


def test_vllm_that_is_not_installed_is_said_plainly(monkeypatch):
    import importlib.util

    from rlconf.errors import ConfigError
    from rlconf.validate import check_config

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    try:
        issues = check_config(_load("rollout.engine=vllm", "cluster.device=cuda"))
    except ConfigError as exc:
        issues = exc.issues
    (err,) = [i for i in issues if i.rule == "rollout-engine"]
    assert err.path == "rollout.engine" and "vLLM is not installed here" in err.message
    assert "pip install 'rlplan[vllm]'" in err.fix


# ------------------------------------------------------------------------------------------- LoRA actor
def _lora_worker(rank: int, world: int, port: int, hf: str, out_dir: str) -> None:
    run_spawned(_lora_run, rank, world, port, hf, out_dir)


def _lora_run(rank: int, world: int, port: int, hf: str, out_dir: str) -> None:
    from dataclasses import replace

    from rlconf.config import LoraConfig
    from rltrain.megatron.lora import adapted_linears, adapters_disabled
    from rltrain.megatron.parallel import destroy_parallel, init_distributed
    from rltrain.rollout.reshard import RolloutReplica

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    cfg = replace(actor_cfg(tp=2), lora=LoraConfig(rank=4, alpha=8.0))
    init_groups(cfg.megatron, "cpu")
    actor = actor_of(tiny_model_cfg(hf), cfg, "cpu")
    g = torch.Generator().manual_seed(10)  # one seed on both ranks: a row-parallel B is replicated over TP
    with torch.no_grad():  # a real adapter: B != 0 (it starts at zero)
        for _, _, lin in adapted_linears(actor.chunks):
            for p in lin.lora_B.values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    base = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    replica = RolloutReplica(actor, 1, BUCKET)
    prompts = torch.randint(1, 100, (4, 6), generator=torch.Generator().manual_seed(0))
    batch = replica.generate(prompts, torch.ones_like(prompts), seed=7, actor_dp_rank=0, max_new_tokens=5,
                             temperature=1.0, pad_id=0)  # fmt: skip
    mask = batch["response_mask"]
    adapted = actor.compute_log_prob(batch, temperature=1.0, with_entropy=False)["log_probs"]
    with adapters_disabled(actor.chunks):
        plain = actor.compute_log_prob(batch, temperature=1.0, with_entropy=False)["log_probs"]
    out = {
        "adapted_gap": float(((batch["rollout_log_probs"] - adapted).abs() * mask).max()),
        "base_gap": float(((batch["rollout_log_probs"] - plain).abs() * mask).max()),
        "restored": all(torch.equal(p, base[n]) for n, p in actor.chunks[0].named_parameters()),
        "tokens": int(mask.sum()),
    }
    destroy_parallel(destroy_process_group=False)
    torch.save(out, os.path.join(out_dir, f"lora_rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_lora_actor_resharded_to_another_tp_samples_from_its_adapted_policy(tmp_path):
    """TP=2 actor with a non-zero adapter -> TP=1 replica: the sampler's log-probs are the adapted policy's (not
    the base model's), and the actor's base weights come back bit for bit after the merged refit."""
    hf = make_tiny_qwen2(tmp_path / "hf", tie=False, seed=3)
    spawn(_lora_worker, args=(2, free_port(), str(hf), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"lora_rank{rank}.pt")
        assert r["tokens"] > 0 and r["restored"], r
        assert r["adapted_gap"] < 1e-5, r  # fp32: the sampler ran the adapted weights
        assert r["base_gap"] > 1e-3, r  # and the adapter changes the policy (the check can tell them apart)


# ------------------------------------------------------------------------------------------- MoE actor
MOE_CASES = [  # (label, family, actor layout, rollout tp)
    ("qwen3_moe_ep2_to_tp2", "qwen3_moe", dict(ep=2), 2),
    ("qwen3_moe_tp2_to_tp1", "qwen3_moe", dict(tp=2), 1),
    ("qwen3_moe_tp2_ep2_etp1_to_tp1", "qwen3_moe", dict(tp=2, ep=2, etp=1), 1),  # experts whole, over EP
    ("qwen3_moe_pp2_to_tp2", "qwen3_moe", dict(pp=2, num_layers_in_first_pipeline_stage=2), 2),  # 3 layers
    ("qwen2_moe_tp2_to_tp1", "qwen2_moe", dict(tp=2), 1),  # shared experts: fused gate/up per TP shard
]


def _moe_worker(rank: int, world: int, port: int, folders: dict, out_dir: str) -> None:
    run_spawned(_moe_run, rank, world, port, folders, out_dir)


def _moe_run(rank: int, world: int, port: int, folders: dict, out_dir: str) -> None:
    from dataclasses import replace

    from rltrain.megatron.parallel import destroy_parallel, init_distributed
    from rltrain.rollout.reshard import RolloutReplica

    from .test_moe import _layout_cfg

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    out: dict[str, float] = {}
    for label, family, layout, rollout_tp in MOE_CASES:
        cfg = _layout_cfg(tp=layout.get("tp", 1), ep=layout.get("ep", 1), etp=layout.get("etp"), aux=0.0)
        stages = {k: v for k, v in layout.items() if k.startswith("num_layers")}
        cfg = replace(
            cfg, megatron=replace(cfg.megatron, pipeline_model_parallel_size=layout.get("pp", 1), **stages)
        )
        init_groups(cfg.megatron, "cpu")
        actor = actor_of(tiny_model_cfg(folders[family]), cfg, "cpu", trainable=False)
        replica = RolloutReplica(actor, rollout_tp, BUCKET)
        replica.refit()
        _export(replica, os.path.join(out_dir, label))
        if label == "qwen3_moe_ep2_to_tp2":
            prompts = torch.randint(1, 100, (4, 6), generator=torch.Generator().manual_seed(0))
            batch = replica.generate(prompts, torch.ones_like(prompts), seed=7, actor_dp_rank=0,
                                     max_new_tokens=5, temperature=1.0, pad_id=0)  # fmt: skip
            lp = actor.compute_log_prob(batch, temperature=1.0, with_entropy=False)["log_probs"]
            out["logprob_diff_max"] = float(
                ((batch["rollout_log_probs"] - lp).abs() * batch["response_mask"]).max()
            )
        destroy_parallel(destroy_process_group=False)
    torch.save(out, os.path.join(out_dir, f"moe_rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.slow
def test_moe_reshard_to_another_tp_gives_every_expert(tmp_path):
    """Routed experts split over expert parallel (EP=2), tensor parallel (TP=2, expert-TP 2) or pipeline stages
    (PP=2), and qwen2_moe's shared experts, resharded into a replica at another tp: its HF export is the source
    folder bit for bit, and (EP=2) the sampler's log-probs equal the actor's recomputation."""
    from .test_moe import make_tiny_moe

    folders = {f: str(make_tiny_moe(tmp_path / f, f, seed=4)) for f in ("qwen3_moe", "qwen2_moe")}
    spawn(_moe_worker, args=(2, free_port(), folders, str(tmp_path)), nprocs=2, join=True)
    for label, family, _, _ in MOE_CASES:
        _assert_same_tensors(_tensors(tmp_path / label), _tensors(folders[family]), label)
    for rank in (0, 1):
        assert torch.load(tmp_path / f"moe_rank{rank}.pt")["logprob_diff_max"] < 1e-5


def _replay_worker(rank: int, world: int, port: int, hf: str, out_dir: str) -> None:
    run_spawned(_replay_run, rank, world, port, hf, out_dir)


def _replay_run(rank: int, world: int, port: int, hf: str, out_dir: str) -> None:
    from rltrain.megatron.moe_replay import ROUTED_EXPERTS
    from rltrain.megatron.parallel import destroy_parallel, init_distributed
    from rltrain.rollout.reshard import RolloutReplica

    from .test_moe import _layout_cfg

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    # Router replay in the plan (as a run has it): the plan then runs the actor's passes padded, the layout
    # the recorded routes follow.
    cfg = replace(_layout_cfg(ep=2, aux=0.0), router_replay=True)
    init_groups(cfg.megatron, "cpu")
    actor = actor_of(tiny_model_cfg(hf), cfg, "cpu", trainable=True)
    assert not actor.spec.settings.remove_padding
    actor.router_replay = False  # the free pass first
    replica = RolloutReplica(actor, 2, BUCKET)
    prompts = torch.randint(1, 100, (4, 6), generator=torch.Generator().manual_seed(0))
    batch = replica.generate(prompts, torch.ones_like(prompts), seed=7, actor_dp_rank=0, record_routing=True,
                             max_new_tokens=5, temperature=1.0, pad_id=0)  # fmt: skip
    routed = batch[ROUTED_EXPERTS]
    free = actor.compute_log_prob(batch, temperature=1.0, with_entropy=False)["log_probs"]
    actor.router_replay = True  # the training passes replay the recorded routing
    replayed = actor.compute_log_prob(batch, temperature=1.0, with_entropy=False)["log_probs"]
    # Every replayed token routed where the replica routed it: a wrong expert for one token of a row changes
    # that row's later log-probs far beyond fp32 rounding. Break the record to show the check can tell.
    broken = {**batch, ROUTED_EXPERTS: torch.where(routed >= 0, (routed + 1) % 4, routed)}
    wrong = actor.compute_log_prob(broken, temperature=1.0, with_entropy=False)["log_probs"]
    mask = batch["response_mask"]
    out = {
        "shape": tuple(routed.shape),
        "recorded": int((routed >= 0).sum()),
        "replay_gap": float(((replayed - free).abs() * mask).max()),
        "broken_gap": float(((wrong - free).abs() * mask).max()),
        "sampler_gap": float(((batch["rollout_log_probs"] - replayed).abs() * mask).max()),
    }
    destroy_parallel(destroy_process_group=False)
    torch.save(out, os.path.join(out_dir, f"replay_rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.slow
def test_router_replay_records_the_resharded_rollouts_routing(tmp_path):
    """actor.router_replay with the rollout resharded to another tp (verl's R3 scripts generate at their own
    tp): the replica's routers record every token's experts, and the actor's passes replaying them give its
    own log-probs (fp32, no near-ties), which a shifted record does not."""
    from .test_moe import make_tiny_moe

    hf = str(make_tiny_moe(tmp_path / "hf", "qwen3_moe", seed=4))
    spawn(_replay_worker, args=(2, free_port(), hf, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"replay_rank{rank}.pt")
        rows, seq, layers, k = r["shape"]
        assert (rows, seq) == (4, 11) and layers == 2 and k == 2, r  # layer 1 is dense (mlp_only_layers)
        # every token but each row's last (which no step feeds back) was routed in a generation step
        assert r["recorded"] == rows * (seq - 1) * layers * k, r
        assert r["replay_gap"] < 1e-5 and r["sampler_gap"] < 1e-5, r
        assert r["broken_gap"] > 1e-3, r


@pytest.mark.multiproc
@pytest.mark.slow
def test_cli_moe_run_with_router_replay_generates_at_another_tp(tmp_path):
    """tiny-grpo-moe (EP=2 over two workers) generating at tp 2 with router replay, as verl's R3 scripts do:
    exits 0, the refit is a reshard, and the sampler's log-probs equal the actor's replayed recomputation."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rltrain.cli", "tiny-grpo-moe", "--actor.router_replay", "true",
           "--rollout.tensor_model_parallel_size", "2", "--trainer.total_steps", "2",
           "--trainer.output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "plan.json").read_text())["refit"]["mode"] == "reshard"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-5, r


# ------------------------------------------------------------------------------------------- deepseek_v3
def _mla_worker(rank: int, world: int, port: int, hf: str, out_dir: str) -> None:
    run_spawned(_mla_run, rank, world, port, hf, out_dir)


def _mla_run(rank: int, world: int, port: int, hf: str, out_dir: str) -> None:
    from dataclasses import replace

    from rlconf.config import ModelConfig
    from rltrain.megatron.parallel import destroy_parallel, init_distributed
    from rltrain.rollout.reshard import RolloutReplica

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    out: dict[str, float] = {}
    for label, layout, rollout_tp in (("mla_ep2_to_tp2", dict(ep=2), 2), ("mla_tp2_to_tp1", dict(tp=2), 1)):
        cfg = actor_cfg(layout.get("tp", 1))
        mcfg = replace(cfg.megatron, expert_model_parallel_size=layout.get("ep", 1),
                       sequence_parallel=layout.get("tp", 1) > 1)  # fmt: skip
        cfg = replace(cfg, megatron=mcfg)
        init_groups(cfg.megatron, "cpu")
        actor = actor_of(ModelConfig(path=hf, attention_backend="sdpa"), cfg, "cpu", trainable=True)
        replica = RolloutReplica(actor, rollout_tp, BUCKET)
        prompts = torch.randint(1, 30, (4, 6), generator=torch.Generator().manual_seed(0))
        batch = replica.generate(prompts, torch.ones_like(prompts), seed=7, actor_dp_rank=0, max_new_tokens=5,
                                 temperature=1.0, pad_id=0)  # fmt: skip
        replica.refit()  # generate freed the replica's weights: refit again to export them
        _export(replica, os.path.join(out_dir, label))
        lp = actor.compute_log_prob(batch, temperature=1.0, with_entropy=False)["log_probs"]
        out[label] = float(((batch["rollout_log_probs"] - lp).abs() * batch["response_mask"]).max())
        destroy_parallel(destroy_process_group=False)
    # bf16 weights over two pipeline stages: the fp32 score bias travels in a bucket of its own dtype.
    cfg = replace(actor_cfg(pp=2), megatron=replace(actor_cfg(pp=2).megatron, pipeline_model_parallel_size=2))
    init_groups(cfg.megatron, "cpu")
    actor = actor_of(ModelConfig(path=hf, attention_backend="sdpa", params_dtype="bfloat16"), cfg, "cpu",
                     trainable=False)  # fmt: skip
    replica = RolloutReplica(actor, 2, BUCKET)
    replica.refit()
    biases = {n: t.detach().clone() for n, t in replica.params.items() if n.endswith("expert_bias")}
    out["bf16_pp2_bias_dtypes"] = sorted({str(t.dtype) for t in biases.values()})  # type: ignore[assignment]
    torch.save({"out": out, "biases": biases}, os.path.join(out_dir, f"mla_rank{rank}.pt"))
    destroy_parallel(destroy_process_group=False)
    torch.distributed.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.slow
def test_deepseek_v3_reshard_carries_mla_experts_and_the_score_bias(tmp_path):
    """A deepseek_v3 actor (MLA, routed experts, a non-zero e_score_correction_bias: a buffer, not a parameter)
    at EP=2 or TP=2 resharded into a replica at another tp: its export is the source's tensors, the score bias
    included, and the sampler's log-probs equal the actor's recomputation; in bf16 over two pipeline stages the
    replica's score bias is the source's fp32 one, bit for bit."""
    from .test_mla_parity import make_deepseek_v3

    hf = make_deepseek_v3(tmp_path / "hf")
    spawn(_mla_worker, args=(2, free_port(), str(hf), str(tmp_path)), nprocs=2, join=True)
    src = _tensors(hf)
    assert any(k.endswith("e_score_correction_bias") for k in src)
    for label in ("mla_ep2_to_tp2", "mla_tp2_to_tp1"):
        got = _tensors(tmp_path / label)
        assert got, label
        for name, t in got.items():
            assert torch.equal(t, src[name]), (label, name)
        assert {k for k in src if k.endswith("e_score_correction_bias")} <= set(got), label
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"mla_rank{rank}.pt")
        gaps = saved["out"]
        assert gaps["mla_ep2_to_tp2"] < 1e-5 and gaps["mla_tp2_to_tp1"] < 1e-5, gaps
        assert gaps["bf16_pp2_bias_dtypes"] == ["torch.float32"], gaps
        # decoder.layers.N.mlp.router.expert_bias = HF's model.layers.N.mlp.gate.e_score_correction_bias
        assert len(saved["biases"]) == 2  # layers 2 and 3 (first_k_dense_replace 2), on two stages
        for name, t in saved["biases"].items():
            n = name.split(".")[2]
            assert torch.equal(t, src[f"model.layers.{n}.mlp.gate.e_score_correction_bias"]), name
