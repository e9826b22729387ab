"""The one config.json reader (rlconf.model_spec) on the model families people train, as users meet it:
`rlconf plan --json` parameter counts, `rlconf validate` refusing what the engine cannot run, and named
`model-unsupported` errors for models that would otherwise be silently reduced."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rlconf.config import MegatronConfig, ModelArch, ModelConfig, RLConfig, RopeScaling
from rlconf.errors import ConfigError
from rlconf.model_spec import FAMILIES, arch_from_config, count_parameters, hf_config, read_model_arch
from rlconf.plan import compile_plan, plan_to_dict
from rltrain.tokenizer import CharTokenizer

from .hf_folders import complete_folder

# Real config.json values (Hugging Face hub, abridged to what the architecture depends on).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 48,
    "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 48, "attention_bias": False, "hidden_act": "silu",
}  # fmt: skip
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_hidden_layers": 24,
    "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1,
    "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 8192,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001, "use_sliding_window": False,
    "sliding_window": 32768, "max_window_layers": 21, "hidden_act": "silu",
}  # fmt: skip
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096,
    "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "rope_theta": 1000000, "rope_scaling": None, "rms_norm_eps": 1e-06, "attention_bias": False,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36, "hidden_act": "silu",
}  # fmt: skip
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "attention_bias": False,
    "mlp_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_hidden_layers": 32,
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "sliding_window": None,
    "router_aux_loss_coef": 0.02, "hidden_act": "silu",
}  # fmt: skip


def folder(tmp_path: Path, name: str, cfg: dict, **changes: object) -> str:
    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))
    CharTokenizer().save_pretrained(path)  # rule tokenizer-load: a model folder has its tokenizer
    return str(path)


# These tests size real models, not this machine: a budget no plan here exceeds (on cpu the memory check
# would otherwise use this machine's RAM).
ANY_MACHINE = replace(RLConfig().cluster, device_memory_gib=1e6)


def plan_json(path: str, **model: object) -> dict:
    return plan_to_dict(compile_plan(RLConfig(model=ModelConfig(path=path, **model), cluster=ANY_MACHINE)))


def rlconf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlconf.cli", *args], capture_output=True, text=True, timeout=120
    )


# ============================================================================================ counts
@pytest.mark.parametrize(
    ("cfg", "total", "active"),
    [
        (QWEN3_30B_A3B, 30.5e9, 3.3e9),  # the model card: 30.5B total, 3.3B activated
        (QWEN15_MOE_A27B, 14.3e9, 2.7e9),  # the model card: 14.3B total, 2.7B activated
        (QWEN3_8B, 8.2e9, 8.2e9),
        (MIXTRAL_8X7B, 46.7e9, 12.9e9),  # Mistral's numbers: 46.7B total, 12.9B active
    ],
    ids=["qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "qwen3-8b", "mixtral-8x7b"],
)
def test_plan_json_reports_total_and_active_parameters(
    tmp_path: Path, cfg: dict, total: float, active: float
):
    models = plan_json(folder(tmp_path, "m", cfg))["models"]
    policy = models["policy"]
    # Model cards round to 0.1B: a dropped expert or shared expert would be off by far more.
    assert policy["params_total"] == pytest.approx(total, abs=0.06e9)
    assert policy["params_active"] == pytest.approx(active, abs=0.06e9)
    assert policy["arch"]["family"] == cfg["model_type"]


def test_experts_are_in_the_memory_estimate_and_sharded_by_expert_parallel(tmp_path: Path):
    path = folder(tmp_path, "m", QWEN3_30B_A3B)

    def actor_params(ep: int) -> int:
        config = RLConfig(
            model=ModelConfig(path=path, params_dtype="bfloat16"),
            cluster=replace(ANY_MACHINE, gpus_per_node=8),
        )
        config = replace(
            config, actor=replace(config.actor, megatron=MegatronConfig(expert_model_parallel_size=ep))
        )
        plan = compile_plan(config)
        return next(r.params_per_device for r in plan.memory.roles if r.role == "actor")

    one, eight = actor_params(1), actor_params(8)
    arch = read_model_arch(path)
    total, _ = count_parameters(arch, "lm")
    assert one >= total  # every expert on every device at ep = 1 (plus vocabulary padding)
    experts = 48 * 128 * 3 * 2048 * 768
    assert one - eight == pytest.approx(experts * 7 / 8, rel=1e-6)


# ============================================================================================ reading
def test_a_missing_tie_word_embeddings_is_untied_as_in_transformers(tmp_path: Path):
    cfg = {k: v for k, v in QWEN3_8B.items() if k != "tie_word_embeddings"}
    arch = read_model_arch(folder(tmp_path, "m", cfg))
    assert not arch.share_embeddings_and_output_weights
    # and a Qwen3 config.json without head_dim gets Qwen3Config's 128, not hidden / heads
    cfg = {k: v for k, v in QWEN3_8B.items() if k != "head_dim"} | {
        "hidden_size": 1024,
        "num_attention_heads": 16,
    }
    assert read_model_arch(folder(tmp_path, "n", cfg)).kv_channels == 128


def test_qwen3_and_llama31_features_are_read(tmp_path: Path):
    q3 = read_model_arch(folder(tmp_path, "q3", QWEN3_8B))
    assert (q3.family, q3.qk_layernorm, q3.add_qkv_bias, q3.num_moe_experts) == ("qwen3", True, False, None)
    llama = read_model_arch(folder(tmp_path, "l", LLAMA_31_8B))
    assert llama.rope_scaling == RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=8192)
    assert (llama.rotary_base, llama.norm_epsilon, llama.qk_layernorm) == (500000.0, 1e-5, False)
    moe = read_model_arch(folder(tmp_path, "m", QWEN15_MOE_A27B, mlp_only_layers=[0], decoder_sparse_step=2))
    assert moe.add_qkv_bias and moe.moe_shared_expert_gate and moe.moe_shared_expert_intermediate_size == 5632
    # transformers: experts where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
    assert moe.moe_dense_layers == tuple(range(0, 24, 2))


@pytest.mark.parametrize(
    ("cfg", "feature"),
    [
        ({**QWEN3_8B, "model_type": "qwen2_5_vl", "vision_config": {}}, "vision"),
        ({**QWEN3_8B, "model_type": "qwen3_vl", "text_config": QWEN3_8B}, "vision"),
        ({**QWEN3_8B, "num_nextn_predict_layers": 1}, "multi-token prediction"),
        ({**QWEN3_30B_A3B, "model_type": "qwen3_next"}, "linear attention"),
        ({**QWEN3_30B_A3B, "model_type": "gpt_oss"}, "attention sinks"),
        ({**QWEN3_8B, "model_type": "deepseek_v2"}, "latent attention"),
        ({**QWEN3_8B, "model_type": "falcon"}, "falcon"),
        ({**QWEN3_8B, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({**QWEN3_8B, "quantization_config": {"quant_method": "fp8"}}, "fp8"),
        ({**LLAMA_31_8B, "mlp_bias": True}, "mlp_bias"),
        ({**LLAMA_31_8B, "hidden_act": "gelu"}, "gelu"),
    ],
    ids=["qwen2_5_vl", "qwen3_vl", "mtp", "qwen3_next", "gpt_oss", "deepseek_v2", "unknown", "rope-dynamic",
         "fp8", "mlp-bias", "gelu"],
)  # fmt: skip
def test_unsupported_models_are_named_errors_never_reduced(tmp_path: Path, cfg: dict, feature: str):
    path = folder(tmp_path, "m", cfg)
    with pytest.raises(ConfigError) as info:
        compile_plan(RLConfig(model=ModelConfig(path=path)))
    (issue,) = info.value.errors
    assert (issue.path, issue.rule) == ("model.path", "model-unsupported")
    assert repr(cfg["model_type"]) in issue.message and feature in issue.message
    assert issue.fix


def test_sliding_window_shorter_than_the_sequences_is_refused(tmp_path: Path):
    mistral = {**LLAMA_31_8B, "model_type": "mistral", "sliding_window": 8, "rope_scaling": None}
    path = folder(tmp_path, "m", mistral)
    with pytest.raises(ConfigError) as info:
        compile_plan(
            RLConfig(model=ModelConfig(path=path))
        )  # the defaults run longer sequences than 8 tokens
    assert (
        info.value.errors[0].rule == "model-unsupported"
        and "sliding window of 8" in info.value.errors[0].message
    )
    # A window as long as the sequences is full causal attention: planned.
    assert plan_json(folder(tmp_path, "w", mistral, sliding_window=4096))["models"]["policy"]["arch"][
        "sliding_window"
    ]


def test_builtin_arch_must_agree_with_its_family():
    with pytest.raises(ConfigError) as info:
        compile_plan(RLConfig(model=ModelConfig(arch=ModelArch(family="qwen2", add_qkv_bias=False))))
    assert info.value.errors[0].path == "model.arch.add_qkv_bias"
    with pytest.raises(ConfigError) as info:
        compile_plan(RLConfig(model=ModelConfig(arch=ModelArch(family="qwen3", add_qkv_bias=False))))
    assert info.value.errors[0].path == "model.arch.qk_layernorm"


@pytest.mark.parametrize("cfg", [QWEN3_30B_A3B, QWEN15_MOE_A27B, QWEN3_8B, LLAMA_31_8B, MIXTRAL_8X7B])
def test_exported_config_reads_back_to_the_same_arch(cfg: dict):
    arch = arch_from_config(cfg, "config.json")
    assert arch_from_config(hf_config(arch, "bfloat16"), "exported") == arch


def test_family_defaults_are_transformers_class_defaults():
    """A key missing from config.json means what transformers builds from the file."""
    transformers = pytest.importorskip("transformers")
    for model_type, family in FAMILIES.items():
        hf = transformers.AutoConfig.for_model(model_type)
        for key, default in family.defaults.items():
            if key == "rope_theta":
                value = hf.rope_parameters["rope_theta"]
            elif key == "head_dim" and default is None:
                continue  # None: derived from hidden / heads, as transformers does
            elif key == "sliding_window" and not getattr(hf, "use_sliding_window", True):
                continue  # transformers clears it when use_sliding_window is off; the reader does too
            else:
                value = getattr(hf, key)
            if key == "num_key_value_heads" and default is None:
                assert value == hf.num_attention_heads, model_type
            else:
                assert value == default, (model_type, key)


# ============================================================================================ commands
def test_rlconf_plan_and_validate_accept_moe_and_check_expert_parallel(tmp_path: Path):
    ANY = ("--set", "cluster.device_memory_gib=1e6")  # sizes real models, not this machine
    path = complete_folder(folder(tmp_path, "Qwen3-30B-A3B", QWEN3_30B_A3B))
    planned = rlconf("plan", "--preset", "tiny-grpo", "--set", f"model.path={path}", "--json", *ANY)
    assert planned.returncode == 0, planned.stderr
    policy = json.loads(planned.stdout)["models"]["policy"]
    assert policy["params_total"] > 9 * policy["params_active"]
    checked = rlconf("validate", "--preset", "tiny-grpo", "--set", f"model.path={path}", *ANY)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # 6 experts do not split over 4 expert-parallel ranks: named, with the config.json it came from.
    six = complete_folder(
        folder(tmp_path, "six-experts", QWEN3_30B_A3B | {"num_experts": 6, "num_experts_per_tok": 2})
    )
    checked = rlconf("validate", "--preset", "tiny-grpo", "--set", f"model.path={six}", "--set",
                     "cluster.gpus_per_node=4", "--set", "actor.megatron.expert_model_parallel_size=4", "--set",
                     "actor.ppo_micro_batch_size_per_gpu=8", *ANY)  # fmt: skip
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "[engine-support] actor.megatron.expert_model_parallel_size" in checked.stderr
    assert "num_moe_experts = 6" in checked.stderr
    dense = complete_folder(folder(tmp_path, "Qwen3-8B", QWEN3_8B))
    assert rlconf("validate", "--preset", "tiny-grpo", "--set", f"model.path={dense}", *ANY).returncode == 0
