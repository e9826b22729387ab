"""Context parallel without Transformer Engine (rltrain/megatron/context_parallel.py): two gloo processes at
CP=2 against one process at CP=1 and transformers, on rows of uneven length (so padding and the 2 x CP
chunk boundaries fall mid-row):

* compute_log_prob (log-probs and entropy) equals transformers' and CP=1's;
* one PPO update gives the CP=1 grad norm and the CP=1 log-probs after it (the loss normalisation and the
  K/V gather's backward are right; megatron DDP averages over the data-parallel-with-CP group);
* the critic's values equal CP=1's, and its update its CP=1 update;
* greedy generation (which runs through the same CP forward) gives CP=1's tokens;
* no rank holds the logits of the whole sequence: the widest vocabulary-wide tensor any operation makes in
  compute_log_prob and in an update is this rank's [b, L / CP, V] chunk (the log-probs are computed on the
  local chunks and only [b, R] results cross the CP group);
* the done-when run: `rltrain tiny-grpo` at CP=2 over two CPU workers exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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
    reference_log_probs,
    run_spawned,
    tiny_model_cfg,
)

_QUIET = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, *_QUIET]

GRAD_NORM_REL = rel_tolerance(torch.float32, TINY_REDUCTION, UPDATE_DEPTH)


def _cfg(cp: int):
    from rlconf.config import Optim

    cfg = actor_cfg(
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=4,
        log_prob_micro_batch_size_per_gpu=4,
        shuffle=False,
        optim=Optim(lr=1e-4, clip_grad=1.0),
    )
    return replace(cfg, megatron=replace(cfg.megatron, context_parallel_size=cp))


def _critic_cfg(cp: int):
    from rlconf.config import CriticConfig, MegatronConfig, Optim

    return CriticConfig(
        enable=True,
        megatron=MegatronConfig(context_parallel_size=cp),
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=4,
        optim=Optim(lr=1e-4),
    )


def _batch() -> dict[str, torch.Tensor]:
    # Valid lengths 28, 24, 23, 25, 5, 6, 5, 6: micro-batches pad to 28 and 8 (multiples of 2 x CP = 4),
    # so at CP=2 chunk boundaries cut rows mid-prompt, mid-response and inside the padding.
    lens = [(12, 16), (10, 14), (12, 11), (9, 16), (3, 2), (2, 4), (4, 1), (3, 3)]
    return batch_from_lengths(lens, 12, 16, seed=0)


def _rl(batch: dict, old: torch.Tensor) -> dict:
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
    return {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}


def _run_engines(hf_path: str, cp: int, rl: dict) -> dict:
    """Everything compared, computed at context parallel size `cp` on this rank."""

    out: dict = {}
    frozen = actor_of(tiny_model_cfg(hf_path), _cfg(cp), "cpu", trainable=False)
    lp = frozen.compute_log_prob(rl)
    out["log_probs"], out["entropy"] = lp["log_probs"], lp["entropy"]
    out["gen"] = frozen.generate(rl["input_ids"][:4, :12], 4, temperature=0.0, pad_id=0)["responses"]
    del frozen
    actor = actor_of(tiny_model_cfg(hf_path), _cfg(cp), "cpu", total_steps=4)
    out["grad_norm"] = actor.update_policy(rl)["actor/grad_norm"]
    out["after"] = actor.compute_log_prob(rl, with_entropy=False)["log_probs"]
    del actor
    critic = critic_of(tiny_model_cfg(hf_path), _critic_cfg(cp), "cpu", total_steps=4)
    values = critic.compute_values(rl)
    out["values"] = values
    returns = torch.ones_like(values) * rl["response_mask"]
    out["vf_grad_norm"] = critic.update_critic({**rl, "values": values, "returns": returns})[
        "critic/grad_norm"
    ]
    out["values_after"] = critic.compute_values(rl)
    return out


def _worker(rank: int, port: int, hf_path: str, rl: dict, out_dir: str) -> None:
    run_spawned(_cp2, rank, port, hf_path, rl, out_dir)


def _cp2(rank: int, port: int, hf_path: str, rl: dict, out_dir: str) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=2, master_port=port)
    init_groups(_cfg(2).megatron, "cpu")
    assert parallel_state.get_context_parallel_world_size() == 2
    assert parallel_state.get_data_parallel_world_size() == 1
    out = _run_engines(hf_path, 2, rl)
    torch.save(out, os.path.join(out_dir, f"cp2_rank{rank}.pt"))
    destroy_parallel()


def test_cp2_matches_cp1_and_transformers(mp_world, tiny_hf, tmp_path):
    batch = _batch()
    logits = hf_logits(tiny_hf, batch["input_ids"], batch["attention_mask"])
    hf_lp = reference_log_probs(logits, batch)
    r, s = batch["responses"].shape[1], batch["input_ids"].shape[1]
    lp_all = torch.log_softmax(logits, -1)[:, s - r - 1 : s - 1]
    hf_ent = -(lp_all.exp() * lp_all).sum(-1) * batch["response_mask"]
    rl = _rl(batch, hf_lp)
    cp1 = _run_engines(str(tiny_hf), 1, rl)
    spawn(_worker, args=(free_port(), str(tiny_hf), rl, str(tmp_path)), nprocs=2)
    diffs = {}
    for rank in range(2):
        cp2 = torch.load(tmp_path / f"cp2_rank{rank}.pt")
        assert_tiny_close(cp2["log_probs"], hf_lp, msg=f"rank {rank}: log-probs vs transformers")
        assert_tiny_close(cp2["entropy"], hf_ent, msg=f"rank {rank}: entropy vs transformers")
        assert_tiny_close(cp2["log_probs"], cp1["log_probs"], msg=f"rank {rank}: log-probs vs CP=1")
        assert torch.equal(cp2["gen"], cp1["gen"]), f"rank {rank}: greedy tokens differ from CP=1"
        assert cp2["grad_norm"] == pytest.approx(cp1["grad_norm"], rel=GRAD_NORM_REL), rank
        assert_tiny_close(cp2["after"], cp1["after"], msg=f"rank {rank}: after update", depth=UPDATE_DEPTH)
        assert_tiny_close(cp2["values"], cp1["values"], msg=f"rank {rank}: values")
        assert cp2["vf_grad_norm"] == pytest.approx(cp1["vf_grad_norm"], rel=GRAD_NORM_REL), rank
        assert_tiny_close(
            cp2["values_after"], cp1["values_after"], msg=f"rank {rank}: values after", depth=UPDATE_DEPTH
        )
        diffs[rank] = {
            k: float((cp2[k].float() - cp1[k].float()).abs().max())
            for k in ("log_probs", "entropy", "after", "values", "values_after")
        }
        diffs[rank]["log_probs_vs_hf"] = float((cp2["log_probs"] - hf_lp).abs().max())
        diffs[rank]["grad_norm_rel"] = abs(cp2["grad_norm"] / cp1["grad_norm"] - 1)
    # The update moved the policy (otherwise "after" would compare the initial weights again).
    assert float((cp1["after"] - cp1["log_probs"]).abs().max()) > 1e-4
    print(json.dumps(diffs, indent=1))


def test_tiny_grpo_cli_at_cp2(tmp_path):
    """The issue's done-when command: tiny-grpo over two CPU workers at context parallel size 2."""
    rltrain = os.path.join(os.path.dirname(sys.executable), "rltrain")
    cmd = [
        rltrain, "tiny-grpo", "--cluster.gpus_per_node", "2",
        "--actor.megatron.context_parallel_size", "2", "--trainer.total_steps", "3",
        "--trainer.output_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


class _LogitsRows(TorchDispatchMode):
    """Records the largest number of positions (numel / V) of any floating [b, *, V] tensor an operation
    returns, V the padded vocabulary and b the micro-batch's rows: the logits (megatron returns them
    batch-first) and everything made from them. (Activations are sequence-first [s, b, ...]: left out.)"""

    def __init__(self, rows: int, vocab: int) -> None:
        super().__init__()
        self.shape = (rows, vocab)
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            batch_first = (
                isinstance(t, torch.Tensor) and t.dim() == 3 and (t.shape[0], t.shape[-1]) == self.shape
            )
            if batch_first and t.is_floating_point():
                self.rows = max(self.rows, t.numel() // self.shape[1])
        return out


def _logits_worker(rank: int, port: int, hf_path: str, rl: dict, out_dir: str) -> None:
    run_spawned(_cp2_logits_rows, rank, port, hf_path, rl, out_dir)


def _cp2_logits_rows(rank: int, port: int, hf_path: str, rl: dict, out_dir: str) -> None:
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=2, master_port=port)
    init_groups(_cfg(2).megatron, "cpu")
    actor = actor_of(tiny_model_cfg(hf_path), _cfg(2), "cpu", total_steps=4)
    shape = (_cfg(2).ppo_micro_batch_size_per_gpu, actor.spec.layout.padded_vocab_size)
    rows = {}
    with _LogitsRows(*shape) as rec:
        actor.compute_log_prob(rl)
    rows["log_prob"] = rec.rows
    with _LogitsRows(*shape) as rec:
        actor.update_policy(rl)
    rows["update"] = rec.rows
    torch.save(rows, os.path.join(out_dir, f"rows_rank{rank}.pt"))
    destroy_parallel()


def test_cp2_holds_only_its_own_chunk_of_the_logits(mp_world, tiny_hf, tmp_path):
    """The log-prob and loss path at CP=2 never makes a vocabulary-wide tensor of more than this rank's
    [b, L / CP] positions (a gather of the logits over the CP group would make [b, L]), and the local
    logits themselves are seen (the recorder works). With micro-batches of 4 rows padded to 28 tokens,
    that is 4 x 14 = 56 positions of V; the whole sequence would be 112."""
    batch = _batch()
    rl = _rl(batch, _cp1_log_probs(str(tiny_hf), batch))
    spawn(_logits_worker, args=(free_port(), str(tiny_hf), rl, str(tmp_path)), nprocs=2)
    local_rows = 4 * 28 // 2
    for rank in range(2):
        rows = torch.load(tmp_path / f"rows_rank{rank}.pt")
        assert rows == {"log_prob": local_rows, "update": local_rows}, (rank, rows)


def _cp1_log_probs(hf_path: str, batch: dict) -> torch.Tensor:

    actor = actor_of(tiny_model_cfg(hf_path), _cfg(1), "cpu", trainable=False)
    return actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
