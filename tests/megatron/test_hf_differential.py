"""A standing differential test of the megatron engine against transformers on config.json quirks.

Tiny random folders saved by transformers' own config and model classes (`save_pretrained`), one per
supported family, in transformers 5 style (rope_parameters, layer_types, dtype) or rewritten to transformers 4
style (rope_scaling, top-level rope_theta, torch_dtype, no layer_types), carrying the quirks real checkpoints
have: both rope forms present and agreeing, llama3 rope scaling, `hidden_act: swish`, sliding windows
declared by layer_types, by max_window_layers and by qwen2_moe's odd-layer rule (each window longer than the
sequences, where rlplan runs them: tests/test_hf_config_json.py shows a shorter one is read and refused), a
null head_dim, decoder_sparse_step / mlp_only_layers, renormalised top-2 and unnormalised top-1 routing.
For each: log-probs and entropy equal transformers' (fp32, CPU) at TP=1, TP=2 and PP=2, and the export from
each layout is the source folder again (config.json equal key for key, every tensor bit-identical, and
transformers' logits from it equal the source's).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from rlconf.config import ModelConfig
from tests.megatron._common import spawn

from ..test_hf_config_json import v4_style
from ..tolerance import assert_close
from ._common import actor_cfg, actor_of, batch_from_lengths, free_port, hf_logits, init_groups, run_spawned
from .test_parity import _hf_reference, assert_same_safetensors

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
WINDOW = 64
"""Longer than every batch row below (prompt 20 + response 16): windowed and full attention agree there."""
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 5e5}  # fmt: skip
_MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
# name -> (config class, model class, config arguments beyond BASE, json style, keys added to the saved json)
CASES: dict[str, tuple[str, str, dict[str, Any], str, dict[str, Any]]] = {
    "llama3-v4-swish": ("LlamaConfig", "LlamaForCausalLM",
                        {"rope_parameters": LLAMA3, "hidden_act": "swish", "tie_word_embeddings": True}, "v4", {}),
    "llama-both-rope-forms": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3}, "v5",
                              {"rope_scaling": LLAMA3, "rope_theta": LLAMA3["rope_theta"]}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW, "head_dim": 16}, "v5", {}),
    "qwen2-v4-max-window-layers": ("Qwen2Config", "Qwen2ForCausalLM",
                                   {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
                                   "v4", {}),
    "qwen3-layer-types": ("Qwen3Config", "Qwen3ForCausalLM",
                          {"head_dim": 32, "use_sliding_window": True, "sliding_window": WINDOW,
                           "layer_types": ["full_attention", "sliding_attention"] * 2}, "v5", {}),
    "qwen2_moe-odd-windows-top1": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                                   {**_MOE, "num_experts_per_tok": 1, "shared_expert_intermediate_size": 48,
                                    "use_sliding_window": True, "sliding_window": WINDOW, "decoder_sparse_step": 2},
                                   "v5", {}),
    "qwen3_moe-v4-norm-topk": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               {**_MOE, "head_dim": 16, "norm_topk_prob": True, "mlp_only_layers": [1]}, "v4", {}),
    "mixtral-head-dim-null": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}, "v5", {}),
}  # fmt: skip
REDUCTION = 128  # the widest sum (vocabulary padded to 128)
DEPTH = 2 * BASE["num_hidden_layers"] + 2


def make_case(path: Path, name: str, seed: int = 0) -> Path:
    """A random tiny model of case `name`, saved by transformers, its config.json then put in the case's
    style (weights scaled up so that logits and router scores are not flat)."""
    import transformers

    config_cls, model_cls, args, style, added = CASES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**BASE, **args))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg = v4_style(cfg) if style == "v4" else cfg
    (path / "config.json").write_text(json.dumps({**cfg, **added}, indent=2))
    return path


def _batches() -> list[dict[str, torch.Tensor]]:
    """Uneven left-padded prompts and right-padded responses; positions up to 35 (past llama3's original
    context of 16, inside the window of 64)."""
    return [
        batch_from_lengths([(6, 5), (4, 3), (6, 1), (2, 5)], 6, 5, seed=0),
        batch_from_lengths([(20, 16), (3, 16), (12, 2), (20, 9)], 20, 16, seed=1),
    ]


def _actor(path: str | Path, cfg=None):
    return actor_of(ModelConfig(path=str(path), attention_backend="sdpa"), cfg or actor_cfg(), "cpu",
                         trainable=False)  # fmt: skip


def _close(got: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    assert_close(got, expected, reduction=REDUCTION, depth=DEPTH, msg=msg)


def _export(actor, src: str | Path, out: str | Path) -> None:
    """What `rltrain export-hf` and a run's hf_model save do: export over the source folder's config.json."""
    from rltrain.megatron.hf_weights import export_hf_weights

    base = json.loads((Path(src) / "config.json").read_text())
    export_hf_weights(actor.chunks, actor.arch, out, base_config=base)


def assert_source_again(src: Path, out: Path, msg: str) -> None:
    """`out` is `src` again: config.json equal key for key (and as transformers reads it), every tensor
    bit-identical, transformers' logits from it equal to the source's."""
    import transformers

    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text()), msg
    before = transformers.AutoConfig.from_pretrained(str(src)).to_dict()
    after = transformers.AutoConfig.from_pretrained(str(out)).to_dict()
    before.pop("_name_or_path"), after.pop("_name_or_path")
    assert after == before, msg
    assert_same_safetensors(src, out)
    batch = _batches()[1]
    assert torch.equal(
        hf_logits(out, batch["input_ids"], batch["attention_mask"]),
        hf_logits(src, batch["input_ids"], batch["attention_mask"]),
    ), msg


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quirks")
    return {name: make_case(root / name, name) for name in CASES}


@pytest.fixture(scope="module")
def references(folders) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """transformers' (log-probs, entropy) of every case on every batch."""
    return {name: [_hf_reference(path, b) for b in _batches()] for name, path in folders.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tp1_log_probs_entropy_and_export_match_transformers(mp_world, folders, references, name, tmp_path):
    from rlconf.model_spec import read_model_arch

    src = folders[name]
    arch = read_model_arch(str(src))
    assert arch.family == json.loads((src / "config.json").read_text())["model_type"]
    if "window" in name:
        assert arch.sliding_window == WINDOW, name  # read, and longer than the rows: runs as full attention
    actor = _actor(src)
    for i, (batch, (lp, ent)) in enumerate(zip(_batches(), references[name], strict=True)):
        out = actor.compute_log_prob(batch, with_entropy=True)
        _close(out["log_probs"], lp, f"{name} batch{i} log-probs")
        _close(out["entropy"], ent, f"{name} batch{i} entropy")
    _export(actor, src, tmp_path / "out")
    assert_source_again(src, tmp_path / "out", name)


# ------------------------------------------------------------------------------------ TP=2, PP=2
LAYOUTS = [("tp2", 2, 1), ("pp2", 1, 2)]


def _layouts_worker(rank: int, world: int, port: int, refs: dict, out_dir: str) -> None:
    run_spawned(_run_layouts, rank, world, port, refs, out_dir)


def _run_layouts(rank: int, world: int, port: int, refs: dict, out_dir: str) -> None:
    """Every case at TP=2 and PP=2: log-probs and entropy vs transformers, and an export into
    out_dir/NAME_LAYOUT; rank 0 writes the largest differences to out_dir/diffs.json."""
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    diffs: dict[str, float] = {}
    for layout, tp, pp in LAYOUTS:
        cfg = actor_cfg(tp, pp)
        # megatron trains MoE layers at TP > 1 only with sequence parallel (the plan says so too).
        cfg = replace(cfg, megatron=replace(cfg.megatron, sequence_parallel=tp > 1))
        init_groups(cfg.megatron, "cpu")
        for name, ref in refs["cases"].items():
            actor = _actor(ref["path"], cfg)
            for i, (batch, (lp, ent)) in enumerate(zip(refs["batches"], ref["expected"], strict=True)):
                out = actor.compute_log_prob(batch, with_entropy=True)
                where = f"{name} {layout} batch{i}"
                diffs[where] = float(
                    max((out["log_probs"] - lp).abs().max(), (out["entropy"] - ent).abs().max())
                )
                _close(out["log_probs"], lp, f"{where} log-probs")
                _close(out["entropy"], ent, f"{where} entropy")
            _export(actor, ref["path"], os.path.join(out_dir, f"{name}_{layout}"))
            del actor
    if rank == 0:
        with open(os.path.join(out_dir, "diffs.json"), "w") as f:
            json.dump(diffs, f, indent=1)
    destroy_parallel()


@pytest.mark.slow
@pytest.mark.multiproc
def test_tp2_and_pp2_match_transformers_and_export_the_source(mp_world, folders, references, tmp_path):
    """Two gloo processes run every case at TP=2 (with sequence parallel) and PP=2: log-probs and entropy
    equal transformers', and each layout's export is the source folder again."""
    refs = {
        "batches": _batches(),
        "cases": {n: {"path": str(p), "expected": references[n]} for n, p in folders.items()},
    }
    out_dir = tmp_path / "exports"
    out_dir.mkdir()
    spawn(_layouts_worker, args=(2, free_port(), refs, str(out_dir)), nprocs=2, join=True)
    for name, src in folders.items():
        for layout, _, _ in LAYOUTS:
            assert_source_again(src, out_dir / f"{name}_{layout}", f"{name} {layout}")
    print(json.dumps(json.loads((out_dir / "diffs.json").read_text()), indent=1))
