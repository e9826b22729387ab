"""Tensor parallel above the KV-head count (rlconf.tp_heads): a tiny Qwen2 with 4 attention heads over ONE
KV head on two gloo processes. megatron-core 0.16.1 builds attention at tp > num_query_groups by
replicating the KV head: each rank gathers the fused q/k/v activations, keeps its query group's K/V (one
head) and its own 4 / tp query heads.

* actor at TP = 2 (over 1 KV head): log-probs, entropy and one update equal TP = 1's (training);
* rollout resharded from an actor at TP = 1 to TP = 2 (over 1 KV head): the replica's weights are the
  source folder's bit for bit (through its HF export), each rank's attention holds one KV head (the
  embedded engine's KV cache is sized by it: [len, rows, 1, head_dim] per layer) and 2 query heads;
* generated log-probs: greedy generation at rollout TP = 2 gives the tokens of rollout TP = 1 (= the KV
  heads) with the same log-probs, and both equal the actor's recomputation.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.megatron._common import spawn

from ._common import (
    TINY,
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    free_port,
    init_groups,
    run_spawned,
    tiny_model_cfg,
)
from .test_context_parallel import GRAD_NORM_REL, _batch, _rl

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
BUCKET = 16 * 1024
PROMPTS = torch.randint(1, 100, (4, 6), generator=torch.Generator().manual_seed(0))


def _make_hf(path: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return path


def _model_cfg(hf: str):
    cfg = tiny_model_cfg(hf)
    return replace(cfg, arch=replace(cfg.arch, num_query_groups=1))


def _actor_cfg(tp: int):
    from rlconf.config import Optim

    return actor_cfg(tp, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4,
                     log_prob_micro_batch_size_per_gpu=4, shuffle=False, optim=Optim(lr=1e-4, clip_grad=1.0))  # fmt: skip


def _train(hf: str, tp: int, rl: dict) -> dict:

    frozen = actor_of(_model_cfg(hf), _actor_cfg(tp), "cpu", trainable=False)
    out = dict(frozen.compute_log_prob(rl))
    del frozen
    actor = actor_of(_model_cfg(hf), _actor_cfg(tp), "cpu", total_steps=4)
    out["grad_norm"] = actor.update_policy(rl)["actor/grad_norm"]
    out["after"] = actor.compute_log_prob(rl, with_entropy=False)["log_probs"]
    return out


def _generate(hf: str, actor_tp: int, rollout_tp: int, out_dir: Path) -> dict:
    """Greedy generation of PROMPTS through a rollout replica; returns this rank's rows and the actor's
    recomputation of their log-probs."""
    from megatron.core import parallel_state

    from rltrain.megatron.hf_weights import export_hf_weights
    from rltrain.rollout.reshard import RolloutReplica

    actor = actor_of(_model_cfg(hf), _actor_cfg(actor_tp), "cpu", trainable=False)
    replica = RolloutReplica(actor, rollout_tp, BUCKET)
    replica.refit()
    with replica.state.active():
        attn = replica.gpt.decoder.layers[0].self_attention
        # the query heads the core attention runs on this rank, and the KV heads it keeps (the KV cache's)
        heads = (attn.core_attention.num_attention_heads_per_partition, attn.num_query_groups_per_partition)
        export_hf_weights(replica.modules(), replica.arch, str(out_dir / f"replica_tp{rollout_tp}"))
    dp, d = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    rows = slice(d * 4 // dp, (d + 1) * 4 // dp)
    prompts = PROMPTS[rows]
    mask = torch.ones_like(prompts)
    if rows.start == 0:
        mask[1, :2] = 0
        prompts = prompts * mask
    batch = replica.generate(
        prompts, mask, seed=7, actor_dp_rank=d, max_new_tokens=5, temperature=0.0, pad_id=0
    )
    lp = actor.compute_log_prob(batch, temperature=1.0, with_entropy=False)["log_probs"]
    return {"batch": batch, "recomputed": lp, "first_row": rows.start, "heads_per_rank": heads}


def _worker(rank: int, port: int, hf: str, rl: dict, out_dir: str) -> None:
    run_spawned(_spawned, rank, port, hf, rl, Path(out_dir))


def _spawned(rank: int, port: int, hf: str, rl: dict, out: Path) -> None:
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=2, master_port=port)
    res = {}
    init_groups(_actor_cfg(2).megatron, "cpu")
    res["train_tp2"] = _train(hf, 2, rl)
    res["gen_tp2_to_tp1"] = _generate(hf, 2, 1, out)  # rollout TP = the KV heads
    destroy_parallel(destroy_process_group=False)
    init_groups(_actor_cfg(1).megatron, "cpu")
    res["gen_tp1_to_tp2"] = _generate(hf, 1, 2, out)  # rollout TP = 2 x the KV heads
    destroy_parallel(destroy_process_group=False)
    torch.save(res, out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(str(folder / f)))
    return out


def _all_rows(ranks: list[dict], key: str) -> dict[str, torch.Tensor]:
    """The 4 generated rows in order (each rank returns its actor DP shard's rows)."""
    parts = {}
    for r in ranks:
        g = r[key]
        parts.setdefault(g["first_row"], {**g["batch"], "recomputed": g["recomputed"]})
    return {k: torch.cat([parts[s][k] for s in sorted(parts)]) for k in parts[0]}


def test_tp_above_the_kv_heads_matches_tp_equal_to_them(mp_world, tmp_path):

    hf = _make_hf(tmp_path / "hf")
    batch = _batch()
    old = actor_of(_model_cfg(str(hf)), _actor_cfg(1), "cpu", trainable=False).compute_log_prob(
        batch, with_entropy=False
    )["log_probs"]
    rl = _rl(batch, old)
    ref = _train(str(hf), 1, rl)
    spawn(_worker, args=(free_port(), str(hf), rl, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    report: dict[str, float] = {}
    # training at TP = 2 over one KV head
    for r, res in enumerate(ranks):
        got = res["train_tp2"]
        assert_tiny_close(got["log_probs"], ref["log_probs"], msg=f"rank {r}: log-probs at actor tp 2")
        assert_tiny_close(got["entropy"], ref["entropy"], msg=f"rank {r}: entropy at actor tp 2")
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=GRAD_NORM_REL)
        assert_tiny_close(got["after"], ref["after"], msg=f"rank {r}: after update", depth=UPDATE_DEPTH)
        report[f"rank{r} actor tp2 log-probs"] = float((got["log_probs"] - ref["log_probs"]).abs().max())
        report[f"rank{r} actor tp2 after update"] = float((got["after"] - ref["after"]).abs().max())
    # the replica at TP = 2 holds the source weights, one KV head and 2 query heads per rank
    src = _tensors(hf)
    for tp in (1, 2):
        exported = _tensors(tmp_path / f"replica_tp{tp}")
        assert sorted(exported) == sorted(src)
        for name, t in src.items():
            assert torch.equal(exported[name], t), (tp, name)
    assert ranks[0]["gen_tp1_to_tp2"]["heads_per_rank"] == (2, 1)
    assert ranks[0]["gen_tp2_to_tp1"]["heads_per_rank"] == (4, 1)
    # generated log-probs: rollout TP = 2 over 1 KV head against rollout TP = 1
    at_kv = _all_rows(ranks, "gen_tp2_to_tp1")
    above = _all_rows(ranks, "gen_tp1_to_tp2")
    assert torch.equal(above["responses"], at_kv["responses"])
    mask = above["response_mask"].bool()
    assert mask.any()
    gap = (above["rollout_log_probs"] - at_kv["rollout_log_probs"])[mask].abs().max().item()
    assert_tiny_close(
        above["rollout_log_probs"][mask], at_kv["rollout_log_probs"][mask], msg="rollout tp 2 vs 1"
    )
    for name, g in (("rollout tp1", at_kv), ("rollout tp2", above)):
        own = (g["rollout_log_probs"] - g["recomputed"])[mask].abs().max().item()
        assert own < 1e-5, name
        report[f"{name} vs actor recompute"] = own
    report["rollout tp2 vs tp1 log-probs"] = gap
    print(json.dumps(report, indent=1))
