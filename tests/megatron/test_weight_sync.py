"""Weight sync to a separate rollout engine (rltrain/rollout/weight_sync.py), 2 gloo processes, one spawn:

* trainer TP=1 (rank 0) -> receiver (rank 1) collecting (name, tensor): exactly the HF folder's tensors,
  bit-identical, whatever the bucket size (1 KiB: one tensor per bucket, 64 KiB, 1 GiB: one bucket);
* the receiver loads the stream into its own (randomly initialised) megatron model through
  `MegatronWeightLoader`: its log-probs equal the trainer's bit for bit;
* trainer TP=2: the TP gather of `iter_hf_weights` gives the HF folder's tensors;
* a TP=1 stream (the HF tensors) resharded into a TP=2 megatron model on both ranks (rank 0 also loads
  locally through `local_load`) gives the TP=1 log-probs (within fp32 TP reduction order).
The model is the untied tiny Qwen2 (lm_head and embedding both travel).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.megatron._common import spawn

from ._common import (
    actor_cfg,
    actor_of,
    assert_tiny_close,
    free_port,
    init_groups,
    make_batch,
    make_tiny_qwen2,
    run_spawned,
    tiny_model_cfg,
)

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
BUCKETS = (1024, 64 * 1024, 2**30)


def _worker(rank: int, world: int, port: int, hf_path: str, out_dir: str) -> None:
    run_spawned(_run, rank, world, port, hf_path, out_dir)


def _run(rank: int, world: int, port: int, hf_path: str, out_dir: str) -> None:
    from safetensors.torch import load_file

    from rltrain.megatron.hf_weights import arch_from_hf
    from rltrain.megatron.parallel import destroy_parallel, init_distributed
    from rltrain.rollout.weight_sync import (
        MegatronWeightLoader,
        iter_hf_weights,
        receive_weights,
        send_weights,
        sync_weights,
    )

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    group = torch.distributed.new_group([0, 1], backend="gloo")
    arch = arch_from_hf(hf_path)
    batch = make_batch()
    out: dict[str, object] = {}

    # ---- phase 1: TP=1 trainer on rank 0, receiver on rank 1
    cfg = actor_cfg()
    init_groups(cfg.megatron, "cpu")
    if rank == 0:
        trainer = actor_of(tiny_model_cfg(hf_path), cfg, "cpu", trainable=False)
        for bucket in BUCKETS:
            sync_weights(trainer.chunks, trainer.arch, group, src=0, bucket_bytes=bucket)
        sync_weights(trainer.chunks, trainer.arch, group, src=0, bucket_bytes=4096)
        out["lp_tp1"] = trainer.compute_log_prob(batch, with_entropy=False)["log_probs"]
    else:
        for bucket in BUCKETS:
            got: dict[str, torch.Tensor] = {}
            stats = receive_weights(
                lambda pairs, got=got: got.update((n, t.clone()) for n, t in pairs), group, src=0
            )
            out[f"recv_{bucket}"] = got
            out[f"buckets_{bucket}"] = stats.buckets
        model_cfg = tiny_model_cfg(None)
        receiver = actor_of(type(model_cfg)(arch=arch, attention_backend="sdpa"), cfg, "cpu", trainable=False)
        before = receiver.compute_log_prob(batch, with_entropy=False)["log_probs"]
        loader = MegatronWeightLoader(receiver.chunks, arch)
        receive_weights(loader, group, src=0)
        loader.finish()
        out["lp_receiver_before"] = before
        out["lp_receiver"] = receiver.compute_log_prob(batch, with_entropy=False)["log_probs"]

    # ---- phase 2: TP=2 on both ranks
    cfg2 = actor_cfg(tp=2)
    init_groups(cfg2.megatron, "cpu")
    tp2 = actor_of(tiny_model_cfg(hf_path), cfg2, "cpu", trainable=False)
    gathered = {n: t.clone() for n, t in iter_hf_weights(tp2.chunks, tp2.arch)}
    if rank == 0:
        out["gathered_tp2"] = gathered
    fresh = actor_of(
        type(tiny_model_cfg())(arch=arch, attention_backend="sdpa"), cfg2, "cpu", trainable=False
    )
    loader = MegatronWeightLoader(fresh.chunks, arch)
    if rank == 0:
        send_weights(
            load_file(os.path.join(hf_path, "model.safetensors")).items(), group, 0, 8192, local_load=loader
        )
    else:
        receive_weights(loader, group, src=0)
    loader.finish()
    lp = fresh.compute_log_prob(batch, with_entropy=False)["log_probs"]
    if rank == 0:
        out["lp_tp2_resharded"] = lp
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_parallel()


def test_weight_sync_two_processes(tmp_path):
    from safetensors.torch import load_file

    hf = make_tiny_qwen2(tmp_path / "untied", tie=False, seed=1)
    spawn(_worker, args=(2, free_port(), str(hf), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    src = load_file(hf / "model.safetensors")
    assert "lm_head.weight" in src
    for bucket in BUCKETS:
        got = r1[f"recv_{bucket}"]
        assert sorted(got) == sorted(src), bucket
        for name, t in src.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), (bucket, name)
    # 1 KiB buckets: most tensors travel alone (norms share one); 1 GiB holds the whole model.
    counts = [r1[f"buckets_{b}"] for b in BUCKETS]
    assert len(src) > counts[0] > counts[1] > counts[2] == 1, counts
    # The receiver's fresh model gave other log-probs before the sync, the trainer's exactly after.
    assert not torch.allclose(r1["lp_receiver_before"], r0["lp_tp1"])
    assert torch.equal(r1["lp_receiver"], r0["lp_tp1"])
    # TP=2 gather -> HF names: the folder's tensors.
    assert sorted(r0["gathered_tp2"]) == sorted(src)
    for name, t in src.items():
        assert torch.equal(r0["gathered_tp2"][name], t), name
    # TP=1 stream resharded into TP=2.
    assert_tiny_close(r0["lp_tp2_resharded"], r0["lp_tp1"])  # the same weights at TP=2: rounding only
