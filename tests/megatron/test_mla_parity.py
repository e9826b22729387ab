"""deepseek_v3 in the megatron engine (multi-head latent attention + DeepSeek's sigmoid group-limited routing,
rltrain.megatron.mla and mla.deepseek_routing) against transformers' DeepseekV3ForCausalLM on tiny random
folders made by transformers (`save_pretrained`, the built-in tokenizer beside): MLA with q_lora_rank set and
unset, DeepSeek's YaRN, 2 dense + 2 MoE layers (first_k_dense_replace = 2), 8 routed experts in 4 groups of which 2 are chosen,
4 experts per token (topk / topk_group = 2: megatron's group score is transformers' top-2 sum), a non-zero
e_score_correction_bias that steers the choice, routed_scaling_factor 2.5 and one shared expert; fp32 CPU.
Log-probs and entropy equal transformers' at TP = 1, EP = 2, TP = 2 (sequence parallel) and PP = 2, and the export
from each is the source folder again (every tensor bit-identical, transformers loads it as deepseek_v3 with
the same logits)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlconf.config import MegatronConfig, ModelConfig
from tests.megatron._common import spawn

from ..tolerance import assert_close
from ._common import actor_cfg, actor_of, batch_from_lengths, free_port, hf_logits, init_groups, run_spawned
from .test_parity import _hf_reference, assert_same_safetensors

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

TINY_MLA = dict(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8,
                v_head_dim=12, qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=4,
                first_k_dense_replace=2, max_position_embeddings=128, num_nextn_predict_layers=0,
                norm_topk_prob=True, rope_interleave=True)  # fmt: skip
# DeepSeek's YaRN (attention factor mscale / mscale_all_dim != 1, softmax scale by mscale_all_dim) over a short
# original context, so the batches' positions (up to 35) reach past it.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 1e4}  # fmt: skip
# case -> (q_lora_rank, DeepseekV3Config arguments beyond TINY_MLA)
CASES: dict[str, tuple[int | None, dict]] = {"q-lora": (24, {}), "no-q-lora": (None, {}),
                                             "yarn-mscale": (24, {"rope_parameters": YARN})}  # fmt: skip
REDUCTION = 128  # the widest sum: the vocabulary padded to 128
DEPTH = 2 * TINY_MLA["num_hidden_layers"] + 2


def make_deepseek_v3(path: Path, q_lora_rank: int | None = 24, seed: int = 0, **changes: object) -> Path:
    """A random tiny DeepseekV3ForCausalLM saved by transformers with the built-in tokenizer beside it; router
    weights and score biases scaled up so that the biases and the group limit change which experts win."""
    import transformers

    from rltrain.tokenizer import CharTokenizer

    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**{**TINY_MLA, **changes}, q_lora_rank=q_lora_rank)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith("mlp.gate.weight") else 0.1) if p.dim() > 1 else p.add_(
                torch.randn_like(p) * 0.05
            )
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.05)
    model.save_pretrained(str(path))
    CharTokenizer().save_pretrained(str(path))
    return Path(path)


def add_mtp_layer(path: Path) -> dict[str, torch.Tensor]:
    """Give a folder saved with num_nextn_predict_layers = 1 the tensors of its multi-token prediction layer
    (model.layers.L.*, after the decoder's L layers; transformers neither builds nor saves them), in a file of
    their own as DeepSeek's release has them; returns them."""
    from safetensors.torch import save_file

    cfg = json.loads((path / "config.json").read_text())
    p, h = f"model.layers.{cfg['num_hidden_layers']}.", cfg["hidden_size"]
    g = torch.Generator().manual_seed(7)
    mtp = {p + "enorm.weight": torch.rand(h, generator=g), p + "hnorm.weight": torch.rand(h, generator=g),
           p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g),
           p + "self_attn.kv_a_proj_with_mqa.weight": torch.randn(24, h, generator=g)}  # fmt: skip
    save_file(mtp, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    names = {**dict.fromkeys(_tensors(path / "model.safetensors"), "model.safetensors"),
             **dict.fromkeys(mtp, "model-mtp.safetensors")}  # fmt: skip
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return mtp


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of every safetensors file of a folder."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def _batches() -> list[dict[str, torch.Tensor]]:
    return [
        batch_from_lengths([(6, 5), (4, 3), (6, 1), (2, 5)], 6, 5, seed=0),
        batch_from_lengths([(20, 16), (3, 16), (12, 2), (20, 9)], 20, 16, seed=1),
    ]


def _actor(path: str | Path, cfg=None):
    return actor_of(ModelConfig(path=str(path), attention_backend="sdpa"), cfg or actor_cfg(), "cpu",
                    trainable=False)  # fmt: skip


def _close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    assert_close(got, want, reduction=REDUCTION, depth=DEPTH, msg=msg)


def assert_source_again(src: Path, out: Path, msg: str) -> None:
    """`out` (an export) is `src` again: config.json equal key for key, every tensor bit-identical, and
    transformers loads it as deepseek_v3 with the same logits."""
    import transformers

    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text()), msg
    assert_same_safetensors(src, out)
    assert transformers.AutoConfig.from_pretrained(str(out)).model_type == "deepseek_v3"
    batch = _batches()[1]
    assert torch.equal(hf_logits(out, batch["input_ids"], batch["attention_mask"]),
                       hf_logits(src, batch["input_ids"], batch["attention_mask"])), msg  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    return {name: make_deepseek_v3(root / name, rank, **args) for name, (rank, args) in CASES.items()}


@pytest.fixture(scope="module")
def references(folders) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    return {name: [_hf_reference(path, b) for b in _batches()] for name, path in folders.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tp1_log_probs_and_export_match_transformers(mp_world, folders, references, name, tmp_path):
    from rltrain.megatron.hf_weights import export_hf_weights

    src = folders[name]
    actor = _actor(src)
    assert actor.arch.multi_latent_attention and actor.arch.q_lora_rank == CASES[name][0]
    for i, (batch, (lp, ent)) in enumerate(zip(_batches(), references[name], strict=True)):
        out = actor.compute_log_prob(batch, with_entropy=True)
        print(f"{name} batch{i}: max |log-prob diff| {float((out['log_probs'] - lp).abs().max()):.3g}")
        _close(out["log_probs"], lp, f"{name} batch{i} log-probs")
        _close(out["entropy"], ent, f"{name} batch{i} entropy")
    base = json.loads((src / "config.json").read_text())
    export_hf_weights(actor.chunks, actor.arch, tmp_path / "out", base_config=base)
    assert_source_again(src, tmp_path / "out", name)


def test_the_routing_bias_is_frozen_and_kept_in_fp32(mp_world, folders):
    """e_score_correction_bias is megatron's expert_bias buffer, loaded in fp32, with update rate 0 (frozen
    during RL: docs/troubleshooting.md)."""
    from rltrain.megatron.model import unwrap

    actor = _actor(folders["q-lora"])
    model = unwrap(actor.chunks[0])
    assert model.config.moe_router_bias_update_rate == 0.0
    biases = [m.expert_bias for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    assert len(biases) == 2 and all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in biases)


# ------------------------------------------------------------------------------------ EP=2, TP=2
LAYOUTS = [("ep2", MegatronConfig(expert_model_parallel_size=2)),
           ("tp2_sp", MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
           ("pp2", MegatronConfig(pipeline_model_parallel_size=2))]  # fmt: skip


def _layouts_worker(rank: int, world: int, port: int, refs: dict, out_dir: str) -> None:
    run_spawned(_run_layouts, rank, world, port, refs, out_dir)


def _run_layouts(rank: int, world: int, port: int, refs: dict, out_dir: str) -> None:
    from rltrain.megatron.hf_weights import export_hf_weights
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    for layout, mcfg in LAYOUTS:
        cfg = replace(actor_cfg(), megatron=mcfg)
        init_groups(mcfg, "cpu")
        for name, ref in refs["cases"].items():
            actor = _actor(ref["path"], cfg)
            for i, (batch, (lp, ent)) in enumerate(zip(refs["batches"], ref["expected"], strict=True)):
                out = actor.compute_log_prob(batch, with_entropy=True)
                _close(out["log_probs"], lp, f"{name} {layout} batch{i} log-probs")
                _close(out["entropy"], ent, f"{name} {layout} batch{i} entropy")
            base = json.loads((Path(ref["path"]) / "config.json").read_text())
            export_hf_weights(actor.chunks, actor.arch, os.path.join(out_dir, f"{name}_{layout}"), base)
            del actor
    destroy_parallel()


@pytest.mark.slow
@pytest.mark.multiproc
def test_ep2_and_tp2_match_transformers_and_export_the_source(mp_world, folders, references, tmp_path):
    """Two gloo processes: experts split over two expert-parallel ranks (tokens exchanged by megatron's alltoall
    dispatcher), heads and latent projections split over two TP ranks with sequence parallel, and the dense
    and MoE layers on two pipeline stages: log-probs and entropy equal transformers', and each layout's
    export is the source folder again."""
    refs = {"batches": _batches(),
            "cases": {n: {"path": str(p), "expected": references[n]} for n, p in folders.items()}}  # fmt: skip
    out_dir = tmp_path / "exports"
    out_dir.mkdir()
    spawn(_layouts_worker, args=(2, free_port(), refs, str(out_dir)), nprocs=2, join=True)
    for name, src in folders.items():
        for layout, _ in LAYOUTS:
            assert_source_again(src, out_dir / f"{name}_{layout}", f"{name} {layout}")


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.multiproc
def test_tiny_grpo_on_a_deepseek_v3_folder_trains_and_exports(mp_world, tmp_path):
    """`rltrain tiny-grpo --model.path DIR` on a random DeepseekV3 folder with a multi-token prediction layer
    trains 3 steps, saying that the layer is not trained; `rltrain export-hf` of its checkpoint loads in
    transformers as deepseek_v3, its weights trained, the routing bias (frozen) and the MTP layer's tensors
    bit-identical to the source's, and the engine built from the export computes transformers' log-probs."""
    import transformers

    from ..test_e2e import rltrain

    # vocab_size 32: the built-in tokenizer's ids; 256 positions: tiny-grpo's prompt + response fit.
    src = make_deepseek_v3(tmp_path / "hf", 24, vocab_size=32, max_position_embeddings=256,
                           num_nextn_predict_layers=1)  # fmt: skip
    mtp = add_mtp_layer(src)
    out = tmp_path / "run"
    result = rltrain("tiny-grpo", "--model.path", str(src), "--trainer.total_steps", "3", "--trainer.save_freq",
                     "3", "--trainer.output_dir", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "1 multi-token prediction layer(s) (num_nextn_predict_layers, model.layers.4..) are not trained"
        in (result.stdout)
    )
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    exported = tmp_path / "exported"
    result = rltrain("export-hf", str(out / "checkpoints" / "global_step_3"), str(exported))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((exported / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    before, after = _tensors(src), _tensors(exported)
    assert before.keys() == after.keys() and set(mtp) < set(after)
    for name in mtp:
        assert torch.equal(after[name], mtp[name]), name
    assert not torch.equal(before["model.layers.0.self_attn.q_b_proj.weight"],
                           after["model.layers.0.self_attn.q_b_proj.weight"])  # fmt: skip
    for name in (k for k in before if k.endswith("e_score_correction_bias")):
        assert torch.equal(before[name], after[name]), name
    batch = batch_from_lengths([(6, 5), (4, 3), (6, 1), (2, 5)], 6, 5, vocab=32, seed=0)
    lp, _ = _hf_reference(exported, batch)
    _close(_actor(exported).compute_log_prob(batch, with_entropy=False)["log_probs"], lp, "trained export")


def test_bf16_weights_keep_the_routing_bias_exact_in_fp32(mp_world, folders):
    """A 16-bit model (Float16Module casts buffers too) still routes on the fp32 score bias config.json's
    weights hold, bit for bit, and exports it unchanged."""
    from safetensors.torch import load_file

    from rltrain.megatron.model import unwrap

    src = folders["q-lora"]
    actor = actor_of(ModelConfig(path=str(src), attention_backend="sdpa", params_dtype="bfloat16"), actor_cfg(),
                     "cpu", trainable=False)  # fmt: skip
    model = unwrap(actor.chunks[0])
    want = load_file(str(src / "model.safetensors"))
    for layer in (2, 3):
        bias = model.decoder.layers[layer].mlp.router.expert_bias
        assert bias.dtype == torch.float32
        assert torch.equal(bias, want[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])
    batch = _batches()[0]
    assert torch.isfinite(actor.compute_log_prob(batch, with_entropy=False)["log_probs"]).all()
    assert all(
        m.expert_bias.dtype == torch.float32
        for m in model.modules()
        if getattr(m, "expert_bias", None) is not None
    )
