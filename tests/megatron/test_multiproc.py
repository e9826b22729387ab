"""Multi-process megatron tests: 2 gloo processes run TP=2, PP=2, PP=2 x VPP=2 and DP=2 (distributed
optimizer) in turn, loading the same HF weights, and compare with the single-process TP=1 results computed
here: log-probs, entropy, greedy generation, one PPO update (grad norm and the log-probs after it), HF
export at TP=2, and the critic. One spawn runs every layout because each process pays ~8 s of imports."""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from ._common import actor_cfg, free_port, hf_logits, make_batch, tiny_model_cfg

# megatron-core warns about missing apex / Transformer Engine and deprecated arguments on every build.
_QUIET = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, *_QUIET]

LAYOUTS = [  # (name, tp, pp, vpp, dp)
    ("tp2", 2, 1, None, 1),
    ("tp2_sp", 2, 1, None, 1),
    ("pp2", 1, 2, None, 1),
    ("pp2_vpp2", 1, 2, 2, 1),
    ("dp2", 1, 1, None, 2),
]


def _update_cfg(tp: int = 1, pp: int = 1, vpp: int | None = None, sequence_parallel: bool = False):
    from dataclasses import replace

    from rlconf.config import Optim

    # seq-mean-token-mean with equal rows per DP rank makes DP=2 exactly the full-batch loss.
    cfg = actor_cfg(
        tp,
        pp,
        vpp,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=2,
        shuffle=False,
        loss_agg_mode="seq-mean-token-mean",
        optim=Optim(lr=1e-4, clip_grad=1.0),
    )
    # Sequence parallel splits norms' inputs over TP ranks; their weight grads must still match TP=1.
    return replace(cfg, megatron=replace(cfg.megatron, sequence_parallel=sequence_parallel))


def _rl_batch(batch, old):
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(batch["input_ids"].shape[0])]).unsqueeze(
        1
    )
    return {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}


def _reference(hf_path: str) -> dict:
    """TP=1 results in this (session) process."""
    from rltrain.megatron.actor import MegatronActor

    batch = make_batch(b=8)
    frozen = MegatronActor(tiny_model_cfg(hf_path), _update_cfg(), "cpu", trainable=False)
    ref = frozen.compute_log_prob(batch)
    gen = frozen.generate(batch["input_ids"][:4, :6], 4, temperature=0.0, pad_id=0)
    actor = MegatronActor(tiny_model_cfg(hf_path), _update_cfg(), "cpu", total_steps=4)
    rl = _rl_batch(batch, ref["log_probs"])
    metrics = actor.update_policy(rl)
    after = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    return {
        "batch": batch,
        **ref,
        "gen": gen["responses"],
        "grad_norm": metrics["actor/grad_norm"],
        "after": after,
    }


def _worker(rank: int, world: int, port: int, hf_path: str, out_dir: str, ref: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        _run_layouts(rank, world, port, hf_path, out_dir, ref)
    except Exception:
        # mp.spawn reports only the exception type of a child otherwise.
        traceback.print_exc()
        raise


def _run_layouts(rank: int, world: int, port: int, hf_path: str, out_dir: str, ref: dict) -> None:
    from megatron.core import parallel_state

    from rlconf.config import CriticConfig, MegatronConfig, Optim
    from rltrain.megatron.actor import MegatronActor
    from rltrain.megatron.critic import MegatronCritic
    from rltrain.megatron.hf_weights import export_hf_weights
    from rltrain.megatron.parallel import destroy_parallel, init_distributed, init_parallel

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    batch = ref["batch"]
    for name, tp, pp, vpp, dp in LAYOUTS:
        cfg = _update_cfg(tp, pp, vpp, sequence_parallel=name.endswith("_sp"))
        init_parallel(cfg.megatron, "cpu")
        assert parallel_state.get_data_parallel_world_size() == dp
        # Every rank of a DP group sees the same rows; DP ranks split the batch.
        dp_rank = parallel_state.get_data_parallel_rank()
        rows = slice(dp_rank * 8 // dp, (dp_rank + 1) * 8 // dp)
        local = {k: v[rows] for k, v in batch.items()}

        frozen = MegatronActor(tiny_model_cfg(hf_path), cfg, "cpu", trainable=False)
        out = frozen.compute_log_prob(local)
        torch.testing.assert_close(out["log_probs"], ref["log_probs"][rows], atol=1e-4, rtol=1e-4, msg=name)
        torch.testing.assert_close(out["entropy"], ref["entropy"][rows], atol=1e-4, rtol=1e-4, msg=name)
        if dp == 1:
            gen = frozen.generate(batch["input_ids"][:4, :6], 4, temperature=0.0, pad_id=0)
            assert torch.equal(gen["responses"], ref["gen"]), name
        if name == "tp2":
            export_hf_weights(frozen.chunks, frozen.arch, os.path.join(out_dir, "export_tp2"))

        actor = MegatronActor(tiny_model_cfg(hf_path), cfg, "cpu", total_steps=4)
        metrics = actor.update_policy(_rl_batch(local, ref["log_probs"][rows]))
        assert metrics["actor/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3), (
            name,
            metrics,
            ref["grad_norm"],
        )
        after = actor.compute_log_prob(local, with_entropy=False)["log_probs"]
        torch.testing.assert_close(after, ref["after"][rows], atol=1e-3, rtol=1e-3, msg=name)

        if name in ("tp2", "pp2"):
            ccfg = CriticConfig(
                enable=True,
                megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                ppo_mini_batch_size=8,
                ppo_micro_batch_size_per_gpu=4,
                optim=Optim(lr=1e-3),
            )
            critic = MegatronCritic(tiny_model_cfg(hf_path), ccfg, "cpu", total_steps=4)
            values = critic.compute_values(local)
            gathered = [torch.empty_like(values) for _ in range(world)]
            torch.distributed.all_gather(gathered, values)
            assert torch.equal(gathered[0], gathered[1]), f"{name}: ranks disagree on values"
            vb = {**local, "values": values, "returns": torch.ones_like(values) * local["response_mask"]}
            m1 = critic.update_critic(vb)
            m2 = critic.update_critic(vb)
            assert m2["critic/vf_loss"] < m1["critic/vf_loss"], name
        del frozen, actor
    destroy_parallel()


def test_layouts_match_single_process(mp_world, tiny_hf, tmp_path):
    ref = _reference(str(tiny_hf))
    torch.multiprocessing.spawn(
        _worker, args=(2, free_port(), str(tiny_hf), str(tmp_path), ref), nprocs=2, join=True
    )
    # The TP=2 export loads in transformers and gives the original model's logits.
    batch = ref["batch"]
    a = hf_logits(tiny_hf, batch["input_ids"], batch["attention_mask"])
    b = hf_logits(tmp_path / "export_tp2", batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
