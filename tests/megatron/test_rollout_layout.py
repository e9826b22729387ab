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

import pytest
import torch

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
    torch.multiprocessing.spawn(
        _worker, args=(2, free_port(), str(untied), str(tied), str(tmp_path)), nprocs=2, join=True
    )
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
    torch.multiprocessing.spawn(
        _lora_worker, args=(2, free_port(), str(hf), str(tmp_path)), nprocs=2, join=True
    )
    for rank in (0, 1):
        r = torch.load(tmp_path / f"lora_rank{rank}.pt")
        assert r["tokens"] > 0 and r["restored"], r
        assert r["adapted_gap"] < 1e-5, r  # fp32: the sampler ran the adapted weights
        assert r["base_gap"] > 1e-3, r  # and the adapter changes the policy (the check can tell them apart)
