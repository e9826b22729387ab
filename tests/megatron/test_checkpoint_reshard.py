"""Checkpoints across parallel layouts: a save at one TP / PP / DP layout loads at another with identical
log-probs, and with the optimizer state (fully_reshardable) the next update matches an uninterrupted run.

One spawn of 2 gloo processes: each saves at TP=2, PP=2 x VPP=2 and DP=2 (then takes one more update, the
uninterrupted reference), and loads the TP=1 checkpoint saved here at TP=2, PP=2 and DP=2 (distributed
optimizer sharded over DP) and checks it against this process's uninterrupted continuation. This process
then loads the workers' checkpoints at TP=1 and checks them against the workers' continuations. A spawn of 4
processes runs issue 12's layouts: TP=2 x PP=2 against TP=1, its save resumed at TP=2 x DP=2.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.megatron._common import spawn

from ._common import (
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    free_port,
    init_groups,
    make_batch,
    run_spawned,
    tiny_model_cfg,
)

# Log-probs after a second update: two forward + backward passes and their optimizer steps.
CONTINUED_DEPTH = 2 * UPDATE_DEPTH

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CONTENTS = ("model", "optimizer", "extra")
# (name, tp, pp, vpp): saved by the 2 workers, loaded here at TP=1 (virtual pipeline chunks are saved
# under megatron's model0 / model1 keys).
SAVE_LAYOUTS = [("tp2", 2, 1, None), ("pp2_vpp2", 1, 2, 2), ("dp2", 1, 1, None)]
LOAD_LAYOUTS = [("tp2", 2, 1, 1), ("pp2", 1, 2, 1), ("dp2", 1, 1, 2)]  # TP=1 checkpoint loaded by the workers


def _cfg(tp: int = 1, pp: int = 1, vpp: int | None = None):
    from rlconf.config import Optim

    # seq-mean-token-mean with equal rows per DP rank makes DP=2 exactly the full-batch loss; no shuffle so
    # that the update does not depend on the generator.
    return actor_cfg(
        tp,
        pp,
        vpp,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=2,
        shuffle=False,
        loss_agg_mode="seq-mean-token-mean",
        optim=Optim(lr=1e-2, clip_grad=1.0),
    )


def _rl_batch(batch: dict, old: torch.Tensor) -> dict:
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(batch["input_ids"].shape[0])])
    return {**batch, "old_log_probs": old, "advantages": sign.unsqueeze(1) * batch["response_mask"]}


def _train_save_continue(hf_path: str, cfg, rl: dict, folder: Path, rows: slice) -> dict[str, torch.Tensor]:
    """One update, save, one more update. Returns log-probs (full batch rows of this DP rank) at the save and
    after the uninterrupted second update."""
    from rltrain.checkpoint import save_engine

    local = {k: v[rows] for k, v in rl.items()}
    actor = actor_of(tiny_model_cfg(hf_path), cfg, "cpu", total_steps=4)
    actor.update_policy(local)
    saved = actor.compute_log_prob(local, with_entropy=False)["log_probs"]
    assert save_engine(actor, folder, CONTENTS, {"step": 1})
    actor.update_policy(local)
    cont = actor.compute_log_prob(local, with_entropy=False)["log_probs"]
    return {"saved": saved, "cont": cont}


def _load_and_continue(hf_path: str, cfg, rl: dict, folder: Path, rows: slice) -> dict[str, torch.Tensor]:
    from rltrain.checkpoint import load_engine

    local = {k: v[rows] for k, v in rl.items()}
    # Built from random init (not the HF weights): everything must come from the checkpoint.
    actor = actor_of(tiny_model_cfg(None), cfg, "cpu", total_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = load_engine(actor, folder, CONTENTS)
    # RNG streams belong to ranks: another layout starts fresh ones, and rank 0 says so.
    if torch.distributed.get_rank() == 0:
        assert any("RNG states not restored" in str(w.message) for w in caught)
    assert extra == {"step": 1}
    assert actor.lr_scheduler.num_steps == 1
    loaded = actor.compute_log_prob(local, with_entropy=False)["log_probs"]
    actor.update_policy(local)
    cont = actor.compute_log_prob(local, with_entropy=False)["log_probs"]
    return {"loaded": loaded, "cont": cont}


def _dp_rows() -> slice:
    """This rank's rows of the 8-row batch: data-parallel ranks split it."""
    from megatron.core import parallel_state

    dp, d = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    return slice(d * 8 // dp, (d + 1) * 8 // dp)


def _worker(rank: int, world: int, port: int, hf_path: str, out_dir: str, rl: dict, ref: dict) -> None:
    run_spawned(_run, rank, world, port, hf_path, Path(out_dir), rl, ref)


def _run(rank: int, world: int, port: int, hf_path: str, out: Path, rl: dict, ref: dict) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    results = {}
    for name, tp, pp, vpp in SAVE_LAYOUTS:
        cfg = _cfg(tp, pp, vpp)
        init_groups(cfg.megatron, "cpu")
        rows = _dp_rows()
        results[name] = {
            **_train_save_continue(hf_path, cfg, rl, out / name / "actor", rows),
            "rows": rows,
        }
    for name, tp, pp, dp in LOAD_LAYOUTS:
        cfg = _cfg(tp, pp)
        init_groups(cfg.megatron, "cpu")
        assert parallel_state.get_data_parallel_world_size() == dp
        rows = _dp_rows()
        got = _load_and_continue(hf_path, cfg, rl, out / "tp1" / "actor", rows)
        assert_tiny_close(got["loaded"], ref["saved"][rows], msg=f"load at {name}", depth=UPDATE_DEPTH)
        assert_tiny_close(got["cont"], ref["cont"][rows], msg=f"update at {name}", depth=CONTINUED_DEPTH)
    if rank == 0:
        torch.save(results, out / "worker_results.pt")
    destroy_parallel()


def test_reshard_tp_pp_dp_with_optimizer(mp_world, tiny_hf, tmp_path):
    from rltrain.checkpoint import read_role_meta

    rl_rows = make_batch(b=8)

    frozen = actor_of(tiny_model_cfg(str(tiny_hf)), _cfg(), "cpu", trainable=False)
    rl = _rl_batch(rl_rows, frozen.compute_log_prob(rl_rows, with_entropy=False)["log_probs"])
    del frozen
    ref = _train_save_continue(str(tiny_hf), _cfg(), rl, tmp_path / "tp1" / "actor", slice(None))
    assert read_role_meta(tmp_path / "tp1" / "actor")["optimizer_sharding"] == "fully_reshardable"

    spawn(_worker, args=(2, free_port(), str(tiny_hf), str(tmp_path), rl, ref), nprocs=2, join=True)

    # TP=2 and PP=2 checkpoints at TP=1: the same log-probs, and the next update continues their run.
    results = torch.load(tmp_path / "worker_results.pt", weights_only=False)
    for name, *_ in SAVE_LAYOUTS:
        meta = read_role_meta(tmp_path / name / "actor")
        assert meta["layout"]["world_size"] == 2
        got = _load_and_continue(str(tiny_hf), _cfg(), rl, tmp_path / name / "actor", slice(None))
        rows = results[name]["rows"]  # rank 0's rows (all of them unless the save was at DP=2)
        assert_tiny_close(got["loaded"][rows], results[name]["saved"], msg=name, depth=UPDATE_DEPTH)
        assert_tiny_close(got["cont"][rows], results[name]["cont"], msg=name, depth=CONTINUED_DEPTH)


# ------------------------------------------------------------------------------------ 4 processes
def _four_worker(rank: int, world: int, port: int, hf_path: str, out_dir: str, rl: dict, ref: dict) -> None:
    run_spawned(_four_layouts, rank, world, port, hf_path, Path(out_dir), rl, ref)


def _four_layouts(rank: int, world: int, port: int, hf_path: str, out: Path, rl: dict, ref: dict) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    # TP=2 x PP=2: log-prob parity with TP=1 on the same weights, then train, save, continue.
    cfg = _cfg(tp=2, pp=2)
    assert cfg.megatron.use_distributed_optimizer
    init_groups(cfg.megatron, "cpu")
    assert parallel_state.get_data_parallel_world_size() == 1
    fresh = actor_of(tiny_model_cfg(hf_path), cfg, "cpu", trainable=False)
    initial = fresh.compute_log_prob(rl, with_entropy=False)["log_probs"]
    assert_tiny_close(initial, ref["initial"], msg="TP2xPP2 log-probs")
    del fresh
    got = _train_save_continue(hf_path, cfg, rl, out / "tp2pp2" / "actor", slice(None))
    assert_tiny_close(got["saved"], ref["saved"], msg="TP2xPP2 update", depth=UPDATE_DEPTH)
    assert_tiny_close(got["cont"], ref["cont"], msg="TP2xPP2 continued", depth=CONTINUED_DEPTH)
    # TP=2 x DP=2 (distributed optimizer sharded over DP): resume the TP2xPP2 save and continue its run.
    cfg = _cfg(tp=2)
    init_groups(cfg.megatron, "cpu")
    assert parallel_state.get_data_parallel_world_size() == 2
    rows = _dp_rows()
    got = _load_and_continue(hf_path, cfg, rl, out / "tp2pp2" / "actor", rows)
    assert_tiny_close(got["loaded"], ref["saved"][rows], msg="load at TP2xDP2", depth=UPDATE_DEPTH)
    assert_tiny_close(got["cont"], ref["cont"][rows], msg="resume at TP2xDP2", depth=CONTINUED_DEPTH)
    destroy_parallel()


def test_four_processes_tp2pp2_save_resumes_at_tp2dp2(mp_world, tiny_hf, tmp_path):
    """Issue 12's layouts on 4 gloo processes (the 4-GPU machine is not lent): TP=2 x PP=2 matches TP=1
    log-probs on the same weights and its update; its checkpoint (distributed optimizer) resumes at
    TP=2 x DP=2 and continues exactly as the uninterrupted TP=1 run."""

    rl_rows = make_batch(b=8)
    frozen = actor_of(tiny_model_cfg(str(tiny_hf)), _cfg(), "cpu", trainable=False)
    initial = frozen.compute_log_prob(rl_rows, with_entropy=False)["log_probs"]
    rl = _rl_batch(rl_rows, initial)
    del frozen
    ref = _train_save_continue(str(tiny_hf), _cfg(), rl, tmp_path / "tp1" / "actor", slice(None))
    ref["initial"] = initial
    spawn(_four_worker, args=(4, free_port(), str(tiny_hf), str(tmp_path), rl, ref), nprocs=4, join=True)
