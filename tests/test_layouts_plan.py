"""Plans of issue 35's layouts (the verl scripts people run): context parallel with virtual pipeline
parallel (CP = 2 x PP = 2 x VPP = 2), Qwen3-235B-A22B's 94 layers at PP = 8 with the embedding and the loss
counted as layers (96 / 8 = 12 per stage), and a rollout at TP = 8 over 4 KV heads (megatron and vLLM
replicate each KV head over 2 ranks). The model is a config.json folder built from Qwen3-235B-A22B's
published shape (num_hidden_layers 94, hidden 4096, 64 heads, 4 KV heads, 128 experts top-8,
moe_intermediate 1536, vocab 151936)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from presets import PRESETS
from rlconf.errors import ConfigError
from rlconf.load import load_config
from rlconf.plan import compile_plan, format_plan

QWEN3_235B_A22B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 94,
    "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 94, "attention_bias": False, "hidden_act": "silu",
}  # fmt: skip


def _load(*overrides: str):
    return load_config(None, preset="tiny-grpo", overrides=list(overrides), presets=PRESETS)


def _qwen235b(tmp_path: Path, *overrides: str):
    folder = tmp_path / "qwen3-235b-a22b"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN3_235B_A22B))
    base = (
        f"model.path={folder}", "model.params_dtype=bfloat16", "cluster.device=cuda", "cluster.nnodes=4",
        "cluster.gpus_per_node=8", "actor.megatron.tensor_model_parallel_size=4",
        "actor.megatron.sequence_parallel=true", "actor.megatron.pipeline_model_parallel_size=8",
        "actor.megatron.expert_model_parallel_size=4", "actor.megatron.expert_tensor_parallel_size=1",
    )  # fmt: skip
    return _load(*base, *overrides)


def test_cp2_pp2_vpp2_plans():
    cfg = _load("cluster.gpus_per_node=8", "model.arch.num_layers=4", "actor.megatron.context_parallel_size=2",
                "actor.megatron.pipeline_model_parallel_size=2",
                "actor.megatron.virtual_pipeline_model_parallel_size=2")  # fmt: skip
    lay = compile_plan(cfg).layout("actor")
    assert (lay.cp, lay.pp, lay.vpp, lay.dp) == (2, 2, 2, 2)
    # interleaved: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3 (one layer per model chunk)
    assert [[(ch.first_layer, ch.num_layers) for ch in st.chunks] for st in lay.stages] == [
        [(0, 1), (2, 1)],
        [(1, 1), (3, 1)],
    ]


def test_qwen3_235b_at_pp8_with_embedding_and_loss_counted_plans(tmp_path):
    cfg = _qwen235b(tmp_path, "actor.megatron.account_for_embedding_in_pipeline_split=true",
                    "actor.megatron.account_for_loss_in_pipeline_split=true")  # fmt: skip
    plan = compile_plan(cfg)
    lay = plan.layout("actor")
    assert lay.layers_per_stage == (11, 12, 12, 12, 12, 12, 12, 11)
    assert [st.chunks[0].first_layer for st in lay.stages] == [0, 11, 23, 35, 47, 59, 71, 83]
    text = format_plan(plan)
    assert "11, 12, 12, 12, 12, 12, 12, 11 (uneven)" in text
    # the memory estimate per stage: the first and last stages hold a layer fewer (and the embedding / the
    # output layer); the middle stages are the most loaded
    actor = next(m for m in plan.memory.roles if m.role == "actor")
    totals = actor.stage_totals_gib
    assert (
        len(totals) == 8 and max(totals) == totals[1] == actor.total_gib and totals[0] < totals[1] > totals[7]
    )
    assert "actor per stage (layers, GiB): 0: 11 layers" in text


def test_qwen3_235b_at_pp8_without_the_flags_is_refused_with_megatrons_rule(tmp_path):
    with pytest.raises(ConfigError) as info:
        compile_plan(_qwen235b(tmp_path))
    e = next(i for i in info.value.errors if i.rule == "layers-divisible-by-pp")
    assert e.path == "actor.megatron.pipeline_model_parallel_size"
    assert "num_layers = 94 is not divisible by pipeline_model_parallel_size = 8" in e.message
    assert "account_for_embedding" in e.fix


def test_qwen3_235b_first_and_last_stage_form_plans(tmp_path):
    # 94 = 10 + 6 x 12 + 12: the other form of the same split
    cfg = _qwen235b(tmp_path, "actor.megatron.num_layers_in_first_pipeline_stage=10",
                    "actor.megatron.num_layers_in_last_pipeline_stage=12")  # fmt: skip
    assert compile_plan(cfg).layout("actor").layers_per_stage == (10, 12, 12, 12, 12, 12, 12, 12)
    with pytest.raises(ConfigError) as info:  # 94 - 11 - 12 = 71 middle layers over 6 stages
        compile_plan(_qwen235b(tmp_path.parent / "b", "actor.megatron.num_layers_in_first_pipeline_stage=11",
                               "actor.megatron.num_layers_in_last_pipeline_stage=12"))  # fmt: skip
    assert any("71 middle layers" in i.message for i in info.value.errors)


def test_rollout_tp8_over_4_kv_heads_plans(tmp_path):
    cfg = _qwen235b(tmp_path, "actor.megatron.account_for_embedding_in_pipeline_split=true",
                    "actor.megatron.account_for_loss_in_pipeline_split=true",
                    "rollout.tensor_model_parallel_size=8")  # fmt: skip
    plan = compile_plan(cfg)
    ro = plan.layout("rollout")
    assert (ro.tp, ro.dp) == (8, 4)
    assert plan.refit.mode == "reshard"


def test_rollout_tp_must_be_a_multiple_of_the_kv_heads(tmp_path):
    # 64 heads, 4 KV heads: tp 8 replicates each KV head twice; tp 16 four times; tp 6 fits neither way
    # (and does not divide the 64 heads either)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN3_235B_A22B, "num_attention_heads": 48,
                                                     "num_hidden_layers": 4}))  # fmt: skip
    base = (f"model.path={folder}", "cluster.device=cuda", "actor.ppo_micro_batch_size_per_gpu=1",
            "actor.log_prob_micro_batch_size_per_gpu=1", "data.train_batch_size=24", "actor.ppo_mini_batch_size=6")  # fmt: skip
    plan = compile_plan(_load(*base, "cluster.gpus_per_node=8", "rollout.tensor_model_parallel_size=8"))
    assert plan.layout("rollout").tp == 8
    with pytest.raises(ConfigError) as info:
        compile_plan(_load(*base, "cluster.gpus_per_node=6", "rollout.tensor_model_parallel_size=6"))
    e = next(i for i in info.value.errors if i.rule == "heads-divisible-by-tp")
    assert e.path == "rollout.tensor_model_parallel_size" and "num_query_groups = 4" in e.message
