"""LoRA across layouts: 2 gloo processes run TP=2, TP=2 + sequence parallel, PP=2 and DP=2 (distributed
optimizer) with the same PEFT adapter (random A and B, loaded through actor.lora.adapter_path) and compare
with one process at TP=1: log-probs before the update, the grad norm, the log-probs after one update, and
the adapter exported after it (gathered over TP / PP into PEFT's whole tensors)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from rlconf.config import LoraConfig, Optim
from tests.megatron._common import spawn

from ..tolerance import rel_tolerance
from ._common import (
    TINY_REDUCTION,
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    batch_from_lengths,
    free_port,
    init_groups,
    run_spawned,
    tiny_model_cfg,
)

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

LAYOUTS = [
    ("tp2", 2, 1, 1, False),
    ("tp2_sp", 2, 1, 1, True),
    ("pp2", 1, 2, 1, False),
    ("dp2", 1, 1, 2, False),
]
GRAD_NORM_REL = rel_tolerance(torch.float32, TINY_REDUCTION, UPDATE_DEPTH)


def _cfg(adapter: str, tp: int = 1, pp: int = 1, sp: bool = False):
    cfg = actor_cfg(tp, pp, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, shuffle=False,
                    optim=Optim(lr=1e-4, clip_grad=1.0))  # fmt: skip
    lora = LoraConfig(rank=4, alpha=8.0, adapter_path=adapter)
    return replace(cfg, lora=lora, megatron=replace(cfg.megatron, sequence_parallel=sp))


def _batch():
    lens = [(12, 16), (10, 14), (12, 11), (9, 16), (3, 2), (2, 4), (4, 1), (3, 3)]
    b = batch_from_lengths(lens, 12, 16, seed=0)
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
    return b, sign * b["response_mask"]


def _run(hf: str, cfg, batch, adv, rows=slice(None)) -> dict:

    actor = actor_of(tiny_model_cfg(hf), cfg, "cpu", total_steps=2)
    local = {k: v[rows] for k, v in batch.items()}
    before = actor.compute_log_prob(local, with_entropy=False)["log_probs"]
    m = actor.update_policy({**local, "old_log_probs": before.detach(), "advantages": adv[rows]})
    after = actor.compute_log_prob(local, with_entropy=False)["log_probs"]
    return {"actor": actor, "before": before, "after": after, "grad_norm": m["actor/grad_norm"]}


def _worker(rank: int, world: int, port: int, hf: str, adapter: str, out_dir: str, ref: dict) -> None:
    run_spawned(_layouts, rank, world, port, hf, adapter, out_dir, ref)


def _layouts(rank: int, world: int, port: int, hf: str, adapter: str, out_dir: str, ref: dict) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed
    from rltrain.megatron.peft_io import save_peft_adapter

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    batch, adv = _batch()
    diffs = {}
    for name, tp, pp, dp, sp in LAYOUTS:
        cfg = _cfg(adapter, tp, pp, sp)
        init_groups(cfg.megatron, "cpu")
        dp_rank = parallel_state.get_data_parallel_rank()
        rows = slice(dp_rank * 8 // dp, (dp_rank + 1) * 8 // dp)
        res = _run(hf, cfg, batch, adv, rows)
        assert_tiny_close(res["before"], ref["before"][rows], msg=name)
        assert res["grad_norm"] == pytest.approx(ref["grad_norm"], rel=GRAD_NORM_REL), name
        assert_tiny_close(res["after"], ref["after"][rows], msg=name, depth=UPDATE_DEPTH)
        diffs[name] = float((res["after"] - ref["after"][rows]).abs().max())
        save_peft_adapter(res["actor"].chunks, res["actor"].spec.lora, res["actor"].arch,
                          os.path.join(out_dir, f"after_{name}"), hf)  # fmt: skip
        del res
    if rank == 0:
        with open(os.path.join(out_dir, "diffs.json"), "w") as f:
            json.dump(diffs, f)
    destroy_parallel()


def test_lora_layouts_match_tp1(mp_world, tiny_hf, tmp_path):
    from safetensors.torch import load_file

    # A non-trivial adapter (B != 0) made at TP=1 and saved as a PEFT folder.
    from rltrain.megatron.lora import adapted_linears
    from rltrain.megatron.peft_io import save_peft_adapter

    seed_actor = actor_of(tiny_model_cfg(str(tiny_hf)), replace(_cfg(None), lora=LoraConfig(rank=4, alpha=8.0)),
                               "cpu", total_steps=1)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, _, lin in adapted_linears(seed_actor.chunks):
            for p in lin.lora_B.values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    adapter = str(tmp_path / "adapter")
    save_peft_adapter(seed_actor.chunks, seed_actor.spec.lora, seed_actor.arch, adapter, str(tiny_hf))
    del seed_actor
    batch, adv = _batch()
    ref = _run(str(tiny_hf), _cfg(adapter), batch, adv)
    save_peft_adapter(
        ref["actor"].chunks, ref["actor"].spec.lora, ref["actor"].arch, tmp_path / "after_tp1", str(tiny_hf)
    )
    # The loaded adapter moves the policy away from the base model (the test compares a real adapter).
    assert (ref["before"] - ref["after"]).abs().max() > 1e-3
    payload = {"before": ref["before"], "after": ref["after"], "grad_norm": ref["grad_norm"]}
    del ref
    spawn(_worker, args=(2, free_port(), str(tiny_hf), adapter, str(tmp_path), payload), nprocs=2, join=True)
    expected = load_file(str(tmp_path / "after_tp1" / "adapter_model.safetensors"))
    for name, *_ in LAYOUTS:
        got = load_file(str(tmp_path / f"after_{name}" / "adapter_model.safetensors"))
        assert got.keys() == expected.keys(), name
        for k in expected:
            assert_tiny_close(got[k], expected[k], msg=f"{name} {k}", depth=UPDATE_DEPTH)
    print(json.loads((tmp_path / "diffs.json").read_text()))
