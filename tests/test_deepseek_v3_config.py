"""The deepseek_v3 family (DeepSeek-V3, Moonlight-16B-A3B, Kimi-K2) in the one config.json reader
(rlconf.model_spec): tiny config.json files written by transformers' DeepseekV3Config (MLA with and without
q_lora_rank, 2 dense + 2 MoE layers, group-limited sigmoid routing, a shared expert, YaRN with mscale) read
into the same model transformers builds (its config object, its parameter count, its safetensors names and
shapes), stand-ins of the published DeepSeek-V3 and Moonlight config.json files planned with their published
total / active parameter counts, the latent KV cache in the plan's memory, the export config.json, and
`rltrain` refusing the model by name (rule model-engine-support) because the megatron engine does not build
MLA yet."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from rlconf.errors import ConfigError
from rlconf.model_files import hf_tensors
from rlconf.model_spec import arch_from_config, count_parameters, hf_config, read_model_arch

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
            qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=2,
            max_position_embeddings=64)  # fmt: skip
"""2 dense + 2 MoE layers, 8 experts in 4 groups (2 chosen), a shared expert, v_head_dim != qk widths."""
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 1e4}  # fmt: skip

# The published config.json files (huggingface.co deepseek-ai/DeepSeek-V3 without its fp8 quantization_config,
# i.e. the bf16 conversion verl scripts train; moonshotai/Moonlight-16B-A3B).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True,
    "hidden_act": "silu", "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
    "use_cache": True, "bos_token_id": 0, "eos_token_id": 1, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
}  # fmt: skip
MOONLIGHT = {
    **DEEPSEEK_V3, "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 2.446, "q_lora_rank": None,
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "bos_token_id": 163584, "eos_token_id": 163585,
    "rope_theta": 50000.0, "rope_scaling": None,
}  # fmt: skip
del MOONLIGHT["num_nextn_predict_layers"]


def saved(**changes: Any) -> dict[str, Any]:
    """The config.json transformers writes for a tiny DeepseekV3 built with `changes`."""
    cfg = transformers.DeepseekV3Config(**{**TINY, **changes})
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


def hf_model(cfg: dict[str, Any], device: str = "meta") -> Any:
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config)


TINY_CASES = {
    "q-lora": saved(),
    "no-q-lora": saved(q_lora_rank=None),
    "yarn-mscale": saved(rope_parameters=YARN),
    "no-shared-no-mtp": saved(n_shared_experts=0, num_nextn_predict_layers=0, rope_interleave=False),
}


@pytest.mark.parametrize("name", TINY_CASES)
def test_tiny_config_reads_as_transformers_builds_it(name: str):
    cfg = TINY_CASES[name]
    arch = arch_from_config(cfg, "config.json")
    hf = transformers.AutoConfig.for_model(**cfg)
    assert arch.family == "deepseek_v3" and arch.multi_latent_attention
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.qk_head_dim, arch.qk_pos_emb_head_dim, arch.v_head_dim) == (
        hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)  # fmt: skip
    assert arch.moe_dense_layers == tuple(range(hf.first_k_dense_replace)) == (0, 1)
    assert (arch.num_moe_experts, arch.moe_router_topk, arch.moe_router_num_groups, arch.moe_router_group_topk) == (
        hf.n_routed_experts, hf.num_experts_per_tok, hf.n_group, hf.topk_group)  # fmt: skip
    assert arch.moe_router_score_function == "sigmoid" and arch.moe_router_enable_expert_bias
    assert arch.moe_router_topk_scaling_factor == hf.routed_scaling_factor
    assert arch.moe_norm_topk_prob == hf.norm_topk_prob and arch.rotary_interleaved == hf.rope_interleave
    shared = hf.n_shared_experts * hf.moe_intermediate_size
    assert arch.moe_shared_expert_intermediate_size == (shared or None)
    assert arch.num_mtp_layers == hf.num_nextn_predict_layers
    if name == "yarn-mscale":
        rs = arch.rope_scaling
        assert (rs.type, rs.factor, rs.mscale, rs.mscale_all_dim) == ("yarn", 4.0, 0.707, 1.0)
    # The parameters transformers' model has, and the tensors it saves, are the ones rlplan counts / checks.
    model = hf_model(cfg)
    total, active = count_parameters(arch, "lm")
    assert total == sum(p.numel() for p in model.parameters())
    per_expert = 3 * arch.hidden_size * arch.moe_ffn_hidden_size
    assert total - active == 2 * (arch.num_moe_experts - arch.moe_router_topk) * per_expert
    with tempfile.TemporaryDirectory() as tmp:
        hf_model(cfg, "cpu").save_pretrained(tmp)
        from safetensors import safe_open

        with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
            saved_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    assert saved_shapes == hf_tensors(arch)


@pytest.mark.parametrize(
    ("cfg", "total", "active", "published"),
    [(DEEPSEEK_V3, 671_026_404_352, 37_552_282_624, (671e9, 37e9)),
     (MOONLIGHT, 15_960_108_544, 2_914_774_528, (16e9, 3e9))],
    ids=["deepseek-v3", "moonlight-16b-a3b"],
)  # fmt: skip
def test_published_models_count_as_transformers_builds_them(cfg, total, active, published):
    """Total and active parameters: exactly transformers' model (on the meta device), within 2 % / 10 % of the
    published totals (671B / 37B, 16B / 3B: rounded; MTP layers are not in them, nor in transformers')."""
    arch = arch_from_config(cfg, "config.json")
    assert count_parameters(arch, "lm") == (total, active)
    assert sum(p.numel() for p in hf_model(cfg).parameters()) == total
    assert abs(total / published[0] - 1) < 0.02 and abs(active / published[1] - 1) < 0.1


def model_folder(tmp_path: Path, name: str, cfg: dict[str, Any], weights: bool = False) -> Path:
    from rltrain.tokenizer import CharTokenizer

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    if weights:
        torch.manual_seed(0)
        hf_model(cfg, "cpu").save_pretrained(folder)
    CharTokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("cfg", [DEEPSEEK_V3, MOONLIGHT], ids=["deepseek-v3", "moonlight-16b-a3b"])
def test_rlconf_plan_json_reports_the_counts(tmp_path: Path, cfg: dict[str, Any]):
    folder = model_folder(tmp_path, "m", cfg)
    run = subprocess.run([sys.executable, "-m", "rlconf.cli", "plan", "--preset", "tiny-grpo", "--set",
                          f"model.path={folder}", "--set", "cluster.device_memory_gib=100000", "--json"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    policy = json.loads(run.stdout)["models"]["policy"]
    arch = arch_from_config(cfg, "config.json")
    assert (policy["params_total"], policy["params_active"]) == count_parameters(arch, "lm")


def test_plan_sizes_the_latent_kv_cache(tmp_path: Path):
    """The rollout KV cache of an MLA model holds kv_lora_rank + qk_rope_head_dim per token and layer (the
    compressed latent), not 2 x heads x head_dim: 576 vs 32768 elements for DeepSeek-V3."""
    from presets import PRESETS
    from rlconf.load import load_config
    from rlconf.plan import compile_plan
    from rlconf.plan.memory import rollout_prompt_tokens

    folder = model_folder(tmp_path, "m", MOONLIGHT)
    c = load_config(None, preset="tiny-grpo", presets=PRESETS,
                    overrides=[f"model.path={folder}", "cluster.device_memory_gib=100000"])  # fmt: skip
    plan = compile_plan(c)
    gen = next(ph for p in plan.memory.pools for ph in p.phases if ph.phase == "generate_sequences")
    kv = next(part.gib for part in gen.parts if part.label == "rollout kv cache")
    rows = c.data.train_batch_size * c.rollout.n  # one DP rank in tiny-grpo
    seq = rollout_prompt_tokens(c) + c.rollout.max_response_length
    expected = 27 * (512 + 64) * seq * rows * 4 / 2**30
    assert kv == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("changes", "named"),
    [({"scoring_func": "softmax"}, "scoring_func"), ({"topk_method": "greedy"}, "topk_method"),
     ({"moe_layer_freq": 2}, "moe_layer_freq"), ({"n_group": 3}, "n_group"), ({"first_k_dense_replace": None},
     "first_k_dense_replace"), ({"v_head_dim": None}, "v_head_dim"), ({"num_experts_per_tok": 7},
     "num_experts_per_tok"), ({"qk_rope_head_dim": 7}, "qk_rope_head_dim")],
    ids=lambda v: v if isinstance(v, str) else next(iter(v)),
)  # fmt: skip
def test_contradicting_or_unbuildable_keys_are_named_errors(changes: dict[str, Any], named: str):
    with pytest.raises(ConfigError) as info:
        arch_from_config({**saved(), **changes}, "config.json")
    (issue,) = info.value.errors
    assert issue.path == "model.path" and issue.rule == "model-config-json" and named in issue.message


def test_quantized_deepseek_v3_is_refused_by_name():
    fp8 = {**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    with pytest.raises(ConfigError) as info:
        arch_from_config(fp8, "config.json")
    assert info.value.errors[0].rule == "model-unsupported" and "fp8" in info.value.errors[0].message


@pytest.mark.parametrize("name", TINY_CASES)
def test_export_config_loads_in_transformers_as_deepseek_v3(name: str):
    """The source's own config.json back (dtype rewritten); without a source, a fresh one that reads back to
    the same arch and that transformers builds into the same model (same parameter count)."""
    cfg = {**TINY_CASES[name], "dtype": "bfloat16"}
    arch = arch_from_config(cfg, "config.json")
    assert hf_config(arch, "float32", cfg) == {
        **cfg,
        "dtype": "float32",
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    fresh = hf_config(arch, "float32")
    assert fresh["model_type"] == "deepseek_v3" and arch_from_config(fresh, "exported") == arch
    hf, ref = transformers.AutoConfig.for_model(**fresh), transformers.AutoConfig.for_model(**cfg)
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "routed_scaling_factor", "first_k_dense_replace", "n_shared_experts",
                "rope_interleave", "num_nextn_predict_layers", "rope_parameters"):  # fmt: skip
        assert getattr(hf, key) == getattr(ref, key), key
    assert sum(p.numel() for p in hf_model(fresh).parameters()) == count_parameters(arch, "lm")[0]


def test_rltrain_refuses_routing_megatron_computes_otherwise_before_writing_anything(tmp_path: Path):
    """norm_topk_prob: false (sigmoid weights not renormalised, which megatron-core always does): refused by
    the config.json key (rule model-engine-support) before anything is written, never a different model;
    the folder's multi-token prediction layer alone would only be noted (kept untrained, exported back)."""
    folder = model_folder(tmp_path, "tiny", saved(num_experts_per_tok=4, norm_topk_prob=False), weights=True)
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--model.path", str(folder),
                          "--trainer.output_dir", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "[model-engine-support] model.path" in run.stderr and "norm_topk_prob: false" in run.stderr
    assert "multi-token prediction" not in run.stderr and "multi-head latent attention" not in run.stderr
    assert "Traceback" not in run.stderr and not out.exists()
    assert read_model_arch(str(folder)).num_mtp_layers == 1


def test_a_built_in_arch_with_mtp_layers_is_refused_and_a_folder_s_are_noted():
    """A built-in model.arch has no multi-token prediction weights to keep: refused by name; a folder's are kept
    untrained (training_gaps names nothing, the preflight notes them)."""
    from rlconf.model_spec import training_gaps

    arch = arch_from_config(saved(num_experts_per_tok=4), "config.json")
    assert arch.num_mtp_layers == 1
    assert [f for f, _ in training_gaps(arch)] == ["num_mtp_layers"]
    assert training_gaps(arch, from_folder=True) == []


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"norm_topk_prob": False}, "moe_norm_topk_prob"),
        ({"num_experts_per_tok": 2}, "moe_router_group_topk"),
        ({"rope_interleave": False}, "rotary_interleaved"),
    ],
    ids=["no-renormalisation", "group-score-width", "rope-not-interleaved"],
)
def test_routing_megatron_builds_differently_is_named(changes: dict[str, Any], field: str):
    """Where megatron-core's router would compute another model than transformers' (sigmoid weights always
    renormalised; a group scored by its top topk / topk_group experts, not 2), the gap is named; DeepSeek-V3
    (8 / 4 = 2, renormalised) and Moonlight (one group) have none of them."""
    from rlconf.model_spec import training_gaps

    assert field in {f for f, _ in training_gaps(arch_from_config({**saved(), **changes}, "config.json"))}
    for cfg in (DEEPSEEK_V3, MOONLIGHT, saved(num_experts_per_tok=4)):
        fields = {f for f, _ in training_gaps(arch_from_config(cfg, "config.json"))}
        assert not fields & {"moe_norm_topk_prob", "moe_router_group_topk"}


def test_the_plan_names_the_attention_kind_and_the_routing():
    """`rlconf plan` of tiny-grpo-mla says multi-head latent attention (which latent is cached) and DeepSeek's
    routing (group limit, frozen score bias, scaling); a GQA model keeps its heads / groups."""
    from presets import PRESETS
    from rlconf.plan import compile_plan, format_plan

    text = format_plan(compile_plan(PRESETS["tiny-grpo-mla"].build()))
    assert ("multi-head latent attention: heads 4, q latent 32, kv latent 32 (cached) + rope 8, values 16; "
            "sigmoid routing, 2 of 4 expert groups, score bias frozen, weights x 2.5") in text  # fmt: skip
    assert "heads 4/2 groups" in format_plan(compile_plan(PRESETS["tiny-grpo"].build()))


def test_lora_on_mla_is_refused_by_name():
    """The adapters are built for q/k/v/o projections MLA does not have: rule lora, not adapters on nothing."""
    import dataclasses

    from presets import PRESETS
    from rlconf.errors import ConfigError
    from rlconf.plan import compile_plan

    c = PRESETS["tiny-grpo-mla"].build()
    c = dataclasses.replace(
        c, actor=dataclasses.replace(c.actor, lora=dataclasses.replace(c.actor.lora, rank=4))
    )
    with pytest.raises(ConfigError, match=r"\[lora\] actor.lora.rank: LoRA on a deepseek_v3 model"):
        compile_plan(c)


def test_mla_with_context_parallel_is_refused_by_name():
    from presets import PRESETS
    from rlconf.errors import ConfigError
    from rlconf.fields import replace_paths
    from rlconf.plan import compile_plan

    c = replace_paths(PRESETS["tiny-grpo-mla"].build(),
                      {"cluster.gpus_per_node": 2, "actor.megatron.context_parallel_size": 2})  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"actor.megatron.context_parallel_size: model.arch: multi-head latent"
    ):
        compile_plan(c)
