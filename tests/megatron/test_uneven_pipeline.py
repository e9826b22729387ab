"""Uneven pipeline stages (megatron's num_layers_in_first/last_pipeline_stage and
account_for_embedding/loss_in_pipeline_split, rlconf.pipeline_split): a tiny 6-layer Qwen2 on two gloo
processes at PP = 2 split 1 | 5 (first stage 1 layer), 4 | 2 (last stage 2 layers) and, with VPP = 2 and
the embedding and the loss each counted as a layer, chunks of 1, 2 | 2, 1 layers (8 / 2 stages / 2 chunks;
6 layers alone do not split into 4 even chunks), against one process at PP = 1 on rows of uneven length:

* every stage builds the layers rlconf's plan says (megatron's own count, by global layer number);
* compute_log_prob (log-probs, entropy) and one PPO update (grad norm, log-probs after it) equal PP = 1's;
* the rollout resharded from each layout to TP = 1 holds the source weights bit for bit;
* checkpoints reshard across these layouts: each uneven layout's save loads here at PP = 1, and the PP = 1
  save loads at each uneven layout, with the log-probs of the saved weights.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.megatron._common import spawn

from ._common import UPDATE_DEPTH, actor_of, assert_tiny_close, free_port, init_groups, run_spawned
from .test_context_parallel import GRAD_NORM_REL, _batch, _cfg, _rl

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

NUM_LAYERS = 6
# (name, vpp, first, last, embedding, loss, layers of each [stage][chunk])
LAYOUTS = [
    ("first1", None, 1, None, False, False, [[1], [5]]),
    ("last2", None, None, 2, False, False, [[4], [2]]),
    ("emb_loss_vpp2", 2, None, None, True, True, [[1, 2], [2, 1]]),
]


def _make_hf(path: Path, seed: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ._common import TINY

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(
        Qwen2Config(**{**TINY, "num_hidden_layers": NUM_LAYERS}, tie_word_embeddings=True)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return path


def _model_cfg(path: str):
    from rlconf.config import ModelArch, ModelConfig

    arch = ModelArch(num_layers=NUM_LAYERS, vocab_size=100, max_position_embeddings=128)
    return ModelConfig(path=path, arch=arch, attention_backend="sdpa")


def _layout(pp: int = 1, vpp=None, first=None, last=None, emb=False, loss=False):
    cfg = _cfg(1)
    mcfg = replace(
        cfg.megatron,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=emb,
        account_for_loss_in_pipeline_split=loss,
    )
    return replace(cfg, megatron=mcfg)


def _run(hf: str, cfg, rl: dict, save_to: Path, replica_to: Path | None = None) -> dict:
    from rltrain.checkpoint import save_engine

    frozen = actor_of(_model_cfg(hf), cfg, "cpu", trainable=False)
    out = dict(frozen.compute_log_prob(rl))
    if replica_to is not None:  # the rollout resharded from these stages to TP = 1 (one stage)
        from rltrain.megatron.hf_weights import export_hf_weights
        from rltrain.rollout.reshard import RolloutReplica

        replica = RolloutReplica(frozen, 1, 16 * 1024)
        replica.refit()
        with replica.state.active():
            export_hf_weights(replica.modules(), replica.arch, str(replica_to))
        replica.release()
    out["layer_numbers"] = [
        [layer.layer_number for layer in _unwrap(m).decoder.layers] for m in frozen.chunks
    ]
    del frozen
    actor = actor_of(_model_cfg(hf), cfg, "cpu", total_steps=4)
    out["grad_norm"] = actor.update_policy(rl)["actor/grad_norm"]
    out["after"] = actor.compute_log_prob(rl, with_entropy=False)["log_probs"]
    assert save_engine(actor, save_to, ("model",), {"step": 1})
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.iterdir()):
        if f.suffix == ".safetensors":
            out.update(load_file(str(f)))
    return out


def _unwrap(m):
    from rltrain.megatron.model import unwrap

    return unwrap(m)


def _load(other_hf: str, cfg, folder: Path, rl: dict) -> torch.Tensor:
    """Log-probs of the checkpoint in `folder`, loaded into an actor built from other weights."""
    from rltrain.checkpoint import load_engine

    actor = actor_of(_model_cfg(other_hf), cfg, "cpu", trainable=False)
    load_engine(actor, folder, ("model",))
    return actor.compute_log_prob(rl, with_entropy=False)["log_probs"]


def _worker(rank: int, port: int, hf: str, other: str, rl: dict, out_dir: str) -> None:
    run_spawned(_spawned, rank, port, hf, other, rl, Path(out_dir))


def _spawned(rank: int, port: int, hf: str, other: str, rl: dict, out: Path) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=2, master_port=port)
    results = {}
    for name, vpp, first, last, emb, loss, _ in LAYOUTS:
        cfg = _layout(2, vpp, first, last, emb, loss)
        init_groups(cfg.megatron, "cpu")
        assert parallel_state.get_pipeline_model_parallel_world_size() == 2
        results[name] = _run(hf, cfg, rl, out / name / "actor", out / name / "replica")
        results[name]["loaded_pp1"] = _load(other, cfg, out / "pp1" / "actor", rl)
    torch.save(results, out / f"rank{rank}.pt")
    destroy_parallel()


def test_uneven_stages_match_pp1_and_reshard_checkpoints(mp_world, tmp_path):
    from rlconf.pipeline_split import PipelineSplit, chunk_layer_counts, chunk_starts

    hf = str(_make_hf(tmp_path / "hf", seed=3))
    other = str(_make_hf(tmp_path / "other", seed=4))  # same shape, other weights: loads must overwrite them
    batch = _batch()

    old = actor_of(_model_cfg(hf), _layout(), "cpu", trainable=False).compute_log_prob(
        batch, with_entropy=False
    )["log_probs"]
    rl = _rl(batch, old)
    ref = _run(hf, _layout(), rl, tmp_path / "pp1" / "actor")
    assert float((ref["after"] - ref["log_probs"]).abs().max()) > 1e-4  # the update moved the policy
    spawn(_worker, args=(free_port(), hf, other, rl, str(tmp_path)), nprocs=2)
    diffs = {}
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, vpp, first, last, emb, loss, counts in LAYOUTS:
        split = PipelineSplit(NUM_LAYERS, 2, vpp, first, last, emb, loss)
        assert chunk_layer_counts(split) == counts, name
        starts = chunk_starts(counts)
        for rank, res in enumerate(ranks):
            got, where = res[name], f"rank {rank} {name}"
            # megatron built what the plan says: this stage's chunks, by global layer number (1-based)
            want = [list(range(s + 1, s + n + 1)) for s, n in zip(starts[rank], counts[rank], strict=True)]
            assert got["layer_numbers"] == want, where
            assert_tiny_close(got["log_probs"], ref["log_probs"], msg=f"{where}: log-probs")
            assert_tiny_close(got["entropy"], ref["entropy"], msg=f"{where}: entropy")
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=GRAD_NORM_REL), where
            assert_tiny_close(got["after"], ref["after"], msg=f"{where}: after update", depth=UPDATE_DEPTH)
            # PP = 1's save (after its update) loaded at this uneven layout
            assert_tiny_close(
                got["loaded_pp1"], ref["after"], msg=f"{where}: PP=1 checkpoint", depth=UPDATE_DEPTH
            )
            diffs[where] = {
                k: float((got[k] - ref[k]).abs().max()) for k in ("log_probs", "entropy", "after")
            }
            diffs[where]["grad_norm_rel"] = abs(got["grad_norm"] / ref["grad_norm"] - 1)
        # this uneven layout's save loaded here at PP = 1
        loaded = _load(other, _layout(), tmp_path / name / "actor", rl)
        assert_tiny_close(
            loaded, ranks[0][name]["after"], msg=f"{name} checkpoint at PP=1", depth=UPDATE_DEPTH
        )
        diffs[f"{name} checkpoint at PP=1"] = float((loaded - ranks[0][name]["after"]).abs().max())
    # the rollout replica resharded from each uneven layout holds the source weights bit for bit
    src = _tensors(Path(hf))
    for name, *_ in LAYOUTS:
        exported = _tensors(tmp_path / name / "replica")
        assert sorted(exported) == sorted(src), name
        for key, t in src.items():
            assert torch.equal(exported[key], t), (name, key)
    # the other weights really differ (a load that did nothing would fail above)
    other_lp = actor_of(_model_cfg(other), _layout(), "cpu", trainable=False).compute_log_prob(
        rl, with_entropy=False
    )["log_probs"]
    assert float((other_lp - ref["after"]).abs().max()) > 1e-2
    print(json.dumps(diffs, indent=1))
