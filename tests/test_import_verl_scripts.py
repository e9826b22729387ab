"""A table of representative verl run scripts (Megatron and FSDP, GRPO / PPO / DAPO / GSPO, multi-turn, custom
reward, rollout correction) through `rlconf import-verl`, on verl-format stand-in parquet files: each one
translates with the right values, or is refused with a named rule on a named path. Nothing is silently
mistranslated: every key is mapped or reported, and no warning names a value the import derived itself.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlconf.fields import get_path
from rlconf.verl import Translation, format_report, translate
from tests.hf_folders import complete_folder
from tests.test_import_verl import QWEN25_7B_CONFIG


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A Qwen2.5-7B-shaped model folder and verl-format GSM8K stand-ins (data_source, chat prompt,
    reward_model.ground_truth), 64 train rows and 16 test rows."""
    root = tmp_path_factory.mktemp("verl_scripts")
    model = root / "Qwen2.5-7B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    complete_folder(model)
    files = {}
    for split, rows in (("train", 64), ("test", 16)):
        table = pa.table({
            "data_source": ["openai/gsm8k"] * rows,
            "prompt": [[{"role": "user", "content": f"What is {i} + 1? Put the answer after ####."}]
                       for i in range(rows)],
            "ability": ["math"] * rows,
            "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(rows)],
            "extra_info": [{"split": split, "index": i} for i in range(rows)],
        })  # fmt: skip
        files[split] = str(root / f"{split}.parquet")
        pq.write_table(table, files[split])
    return {"model": str(model), "train": files["train"], "test": files["test"]}


def common(env: dict[str, str], **extra: str) -> list[str]:
    items = {
        "data.train_files": env["train"],
        "data.val_files": env["test"],
        "data.train_batch_size": "16",
        "data.max_prompt_length": "512",
        "data.max_response_length": "1024",
        "actor_rollout_ref.model.path": env["model"],
        "actor_rollout_ref.actor.ppo_mini_batch_size": "8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "2",
        "trainer.n_gpus_per_node": "8",
        "trainer.nnodes": "1",
        "trainer.total_epochs": "2",
        "trainer.logger": "['console']",
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


MEGATRON_GRPO = {
    "algorithm.adv_estimator": "grpo",
    "actor_rollout_ref.actor.strategy": "megatron",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "4",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "4",
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.n": "4",
    "actor_rollout_ref.actor.use_kl_loss": "True",
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.kl_loss_coef": "0.001",
}
FSDP_GRPO = {
    "algorithm.adv_estimator": "grpo",
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "True",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": "-1",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "True",
    "actor_rollout_ref.rollout.n": "4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "2",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "0.6",
    "actor_rollout_ref.actor.optim.betas": "[0.9,0.95]",
    "actor_rollout_ref.model.enable_activation_offload": "True",
}


@dataclass(frozen=True)
class Script:
    """One verl command line: its overrides, the rlplan values it must give (path -> value) or the
    (rule, path) of the error it must be refused with, and the reasons of keys it must report unmapped."""

    name: str
    overrides: dict[str, str]
    values: dict[str, Any] = field(default_factory=dict)
    refused: tuple[str, str] | None = None
    unmapped: dict[str, str] = field(default_factory=dict)
    note: str = ""


SCRIPTS = (
    Script(
        "grpo-megatron-qwen2",
        MEGATRON_GRPO,
        {
            "algorithm.adv_estimator": "grpo",
            "actor.megatron.tensor_model_parallel_size": 4,
            "actor.megatron.pipeline_model_parallel_size": 2,
            "ref.megatron.pipeline_model_parallel_size": 2,
            "rollout.engine": "embedded",
            "rollout.n": 4,
            "actor.kl_loss_type": "low_var_kl",
            "rollout.max_num_seqs": 256,
            "critic.enable": False,
            "cluster.gpus_per_node": 8,
            "data.answer_key": "reward_model.ground_truth",
            "trainer.total_epochs": 2,
        },
    ),
    Script(
        "ppo-megatron-critic",
        {
            "algorithm.adv_estimator": "gae",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "2",
            "critic.megatron.tensor_model_parallel_size": "2",
            "critic.optim.lr": "1e-5",
            "critic.ppo_micro_batch_size_per_gpu": "2",
            "critic.model.path": "${actor_rollout_ref.model.path}",
            "trainer.critic_warmup": "0",
            "algorithm.kl_ctrl.kl_coef": "0.001",
        },
        {
            "critic.enable": True,
            "critic.optim.lr": 1e-5,
            "critic.megatron.tensor_model_parallel_size": 2,
            "critic.ppo_mini_batch_size": 8,
            "algorithm.gamma": 1.0,
            "critic.megatron.sequence_parallel": True,
        },
    ),
    Script(
        "dapo-current-reward-names",
        {
            **MEGATRON_GRPO,
            "actor_rollout_ref.actor.clip_ratio_low": "0.2",
            "actor_rollout_ref.actor.clip_ratio_high": "0.28",
            "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
            "algorithm.filter_groups.enable": "True",
            "algorithm.filter_groups.metric": "acc",
            "algorithm.filter_groups.max_num_gen_batches": "10",
            "reward.reward_manager.name": "dapo",
            "+reward.reward_kwargs.overlong_buffer_cfg.enable": "True",
            "+reward.reward_kwargs.overlong_buffer_cfg.len": "256",
            "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": "1.0",
            "+reward.reward_kwargs.overlong_buffer_cfg.log": "False",
            "+reward.reward_kwargs.max_resp_len": "1024",
        },
        {
            "actor.clip_ratio_high": 0.28,
            "algorithm.filter_groups.enable": True,
            "algorithm.filter_groups.metric": "score",
            "algorithm.filter_groups.max_num_gen_batches": 10,
            "reward.overlong_buffer.enable": True,
            "reward.overlong_buffer.len": 256,
            "reward.overlong_buffer.penalty_factor": 1.0,
            "actor.loss_agg_mode": "token-mean",
        },
        unmapped={
            "reward.reward_manager.name": "not-needed",
            "reward.reward_kwargs.max_resp_len": "not-needed",
        },
    ),
    Script(
        "dapo-older-reward-names",
        {
            **MEGATRON_GRPO,
            "algorithm.filter_groups.enable": "True",
            "reward_model.reward_manager": "dapo",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable": "True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len": "256",
        },
        {"reward.overlong_buffer.enable": True, "reward.overlong_buffer.len": 256},
    ),
    Script(
        "fsdp-grpo-offloads",
        FSDP_GRPO,
        {
            "actor.megatron.param_offload": True,
            "actor.megatron.optimizer_offload": True,
            "ref.megatron.param_offload": True,
            "actor.megatron.tensor_model_parallel_size": 1,
            "actor.optim.betas": (0.9, 0.95),
            "rollout.gpu_memory_utilization": 0.5,
        },
        unmapped={
            "actor_rollout_ref.actor.strategy": "not-needed",
            "actor_rollout_ref.actor.fsdp_config.fsdp_size": "not-needed",
            "actor_rollout_ref.model.enable_activation_offload": "unsupported",
        },
        note="translated from FSDP to megatron",
    ),
    Script(
        "fsdp-ppo-critic-offload",
        {
            "algorithm.adv_estimator": "gae",
            "actor_rollout_ref.actor.strategy": "fsdp",
            "critic.strategy": "fsdp",
            "actor_rollout_ref.rollout.n": "4",
            "critic.model.fsdp_config.param_offload": "True",
            "critic.model.fsdp_config.optimizer_offload": "True",
            "critic.optim.betas": "[0.9,0.99]",
            "critic.ppo_micro_batch_size_per_gpu": "2",
        },
        {
            "critic.enable": True,
            "critic.megatron.param_offload": True,
            "critic.megatron.optimizer_offload": True,
            "critic.optim.betas": (0.9, 0.99),
        },
        note="translated from FSDP to megatron",
    ),
    Script(
        "megatron-betas-ignored",
        {
            **MEGATRON_GRPO,
            "actor_rollout_ref.actor.optim.betas": "[0.9,0.95]",
        },
        {"actor.optim.betas": (0.9, 0.999)},
        unmapped={"actor_rollout_ref.actor.optim.betas": "ignored-by-verl"},
    ),
    Script(
        "multi-turn-tools",
        {
            **MEGATRON_GRPO,
            "actor_rollout_ref.rollout.multi_turn.enable": "True",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "3",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": "examples/tools/gsm8k_tool_config.yaml",
            "data.return_raw_chat": "True",
        },
        {"rollout.multi_turn.enable": True, "rollout.multi_turn.max_assistant_turns": 3},
        unmapped={
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": "unsupported",
            "data.return_raw_chat": "not-needed",
        },
    ),
    Script(
        "rollout-rs-token-k1",
        {
            **MEGATRON_GRPO,
            "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.rollout_rs": "token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold": "0.5_2.0",
        },
        {
            "algorithm.rollout_correction.rollout_rs": "token",
            "algorithm.rollout_correction.rollout_rs_threshold": 2.0,
        },
    ),
    Script(
        "rollout-rs-seq-sum-k1",
        {
            **MEGATRON_GRPO,
            "algorithm.rollout_correction.rollout_rs": "seq_sum_k1",
            "algorithm.rollout_correction.rollout_rs_threshold": "3.0",
        },
        {
            "algorithm.rollout_correction.rollout_rs": "sequence",
            "algorithm.rollout_correction.rollout_rs_threshold": 3.0,
        },
    ),
    Script(
        "rollout-rs-token-k2",
        {
            **MEGATRON_GRPO,
            "algorithm.rollout_correction.rollout_rs": "token_k2",
            "algorithm.rollout_correction.rollout_rs_threshold": "0.5",
        },
        {
            "algorithm.rollout_correction.rollout_rs": "token",
            "algorithm.rollout_correction.rollout_rs_threshold": math.e,
        },
    ),
    Script(
        "rollout-rs-k3-refused",
        {
            **MEGATRON_GRPO,
            "algorithm.rollout_correction.rollout_rs": "seq_mean_k3",
            "algorithm.rollout_correction.rollout_rs_threshold": "0.01",
        },
        refused=("verl-import", "algorithm.rollout_correction.rollout_rs"),
    ),
    Script(
        "rollout-rs-asymmetric-refused",
        {
            **MEGATRON_GRPO,
            "algorithm.rollout_correction.rollout_rs": "token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold": "0.5_3.0",
        },
        refused=("verl-import", "algorithm.rollout_correction.rollout_rs_threshold"),
    ),
    Script(
        "router-replay-r3-rollout-tp-written-out",
        {
            **MEGATRON_GRPO,
            "actor_rollout_ref.actor.router_replay.mode": "R3",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay": "True",
        },
        {"actor.router_replay": True, "rollout.tensor_model_parallel_size": 4},
    ),
    Script(
        "router-replay-r3-rollout-tp-of-its-own-refused",
        {
            **MEGATRON_GRPO,
            "actor_rollout_ref.actor.router_replay.mode": "R3",
            "actor_rollout_ref.rollout.tensor_model_parallel_size": "2",
        },
        refused=("moe", "actor.router_replay"),
    ),
    Script(
        "router-replay-r2-refused",
        {**MEGATRON_GRPO, "actor_rollout_ref.actor.router_replay.mode": "R2"},
        refused=("verl-import", "actor.router_replay"),
    ),
    Script(
        "verl-converted-mcore-checkpoint-not-read",
        {
            **MEGATRON_GRPO,
            "actor_rollout_ref.actor.megatron.use_dist_checkpointing": "True",
            "actor_rollout_ref.actor.megatron.dist_checkpointing_path": "/data/mcore_ckpt/Qwen2.5-7B",
            "actor_rollout_ref.ref.megatron.use_dist_checkpointing": "True",
        },
        {"actor.megatron.use_dist_checkpointing": False, "actor.megatron.dist_checkpointing_path": None},
        unmapped={
            "actor_rollout_ref.actor.megatron.use_dist_checkpointing": "not-needed",
            "actor_rollout_ref.actor.megatron.dist_checkpointing_path": "not-needed",
            "actor_rollout_ref.ref.megatron.use_dist_checkpointing": "not-needed",
        },
    ),
    Script(
        "fully-async-streaming-refused",
        {
            **MEGATRON_GRPO,
            "data.train_batch_size": "0",
            "data.gen_batch_size": "1",
            "async_training.staleness_threshold": "0.1",
            "async_training.require_batches": "1",
            "rollout.nnodes": "1",
            "rollout.n_gpus_per_node": "4",
            "actor_rollout_ref.actor.use_rollout_log_probs": "True",
        },
        refused=("verl-import", "data.train_batch_size"),
    ),
    Script(
        "one-step-off-pool-on-the-same-nodes",
        {**MEGATRON_GRPO, "rollout.nnodes": "1", "rollout.n_gpus_per_node": "4"},
        {
            "rollout.placement": "separate",
            "rollout.num_devices": 4,
            "cluster.nnodes": 1,
            "cluster.gpus_per_node": 12,
            "algorithm.off_policy_steps": 1,
        },
        unmapped={"rollout.nnodes": "not-needed"},
    ),
    Script(
        "one-step-off-pool-on-more-nodes",
        {**MEGATRON_GRPO, "trainer.nnodes": "2", "rollout.nnodes": "1", "rollout.n_gpus_per_node": "8"},
        {"rollout.num_devices": 8, "cluster.nnodes": 3, "cluster.gpus_per_node": 8},
    ),
    Script(
        "one-step-off-pools-of-two-shapes-refused",
        {**MEGATRON_GRPO, "trainer.nnodes": "2", "rollout.nnodes": "1", "rollout.n_gpus_per_node": "4"},
        refused=("verl-import", "rollout.num_devices"),
    ),
    Script(
        "mtp-refused",
        {
            **MEGATRON_GRPO,
            "actor_rollout_ref.model.mtp.enable": "True",
            "actor_rollout_ref.model.mtp.mtp_loss_scaling_factor": "0.1",
        },
        refused=("verl-import", "actor_rollout_ref.model.mtp.enable"),
    ),
    Script(
        "critic-lora-off-accepted",
        {
            **MEGATRON_GRPO,
            "algorithm.adv_estimator": "gae",
            "critic.model.lora.rank": "0",
            "critic.model.lora.alpha": "0",
            "critic.ppo_micro_batch_size_per_gpu": "2",
        },
        {"critic.enable": True, "actor.lora.rank": 0},
        unmapped={"critic.model.lora.rank": "unsupported", "critic.model.lora.alpha": "unsupported"},
    ),
    Script(
        "critic-lora-refused",
        {
            **MEGATRON_GRPO,
            "algorithm.adv_estimator": "gae",
            "critic.model.lora.rank": "16",
            "critic.ppo_micro_batch_size_per_gpu": "2",
        },
        refused=("verl-import", "critic.model.lora.rank"),
    ),
    Script(
        "fsdp-ulysses-to-context-parallel",
        {
            **FSDP_GRPO,
            "data.max_prompt_length": "2048",
            "data.max_response_length": "6144",
            "actor_rollout_ref.actor.use_dynamic_bsz": "True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "2048",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "4",
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "4",
        },
        {
            "actor.megatron.context_parallel_size": 4,
            "ref.megatron.context_parallel_size": 4,
            "actor.ppo_max_token_len_per_gpu": 8192,
            "actor.megatron.param_offload": True,
        },
        note="translated from FSDP to megatron",
    ),
    Script(
        "megatron-ulysses-still-unsupported",
        {
            **MEGATRON_GRPO,
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "2",
            "actor_rollout_ref.actor.use_dynamic_bsz": "True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "4096",
        },
        {"actor.megatron.context_parallel_size": 1, "actor.ppo_max_token_len_per_gpu": 4096},
        unmapped={"actor_rollout_ref.actor.ulysses_sequence_parallel_size": "unsupported"},
        note="FSDP only; megatron context parallel is *.megatron.context_parallel_size",
    ),
    Script(
        "profiler-no-role-enabled-profiles-nothing",
        {
            **MEGATRON_GRPO,
            "global_profiler.tool": "nsys",
            "global_profiler.steps": "[1]",
            "actor_rollout_ref.actor.profiler.enable": "False",
            "actor_rollout_ref.actor.profiler.all_ranks": "True",
        },
        {"profile.tool": "none"},
        unmapped={"actor_rollout_ref.actor.profiler.enable": "not-needed"},
    ),
    Script(
        "profiler-default-flags-profile-nothing",
        {**MEGATRON_GRPO, "global_profiler.tool": "torch", "global_profiler.steps": "[1]"},
        {"profile.tool": "none"},
    ),
    Script(
        "profiler-actor-enabled-profiles-its-worker",
        {
            **MEGATRON_GRPO,
            "algorithm.adv_estimator": "gae",
            "critic.ppo_micro_batch_size_per_gpu": "2",
            "global_profiler.tool": "torch",
            "global_profiler.steps": "[1]",
            "actor_rollout_ref.actor.profiler.enable": "True",
        },
        {
            "profile.tool": "torch",
            "profile.roles": (
                "generate_sequences",
                "actor_compute_log_prob",
                "ref_compute_log_prob",
                "actor_update",
            ),
        },
    ),
    Script(
        "reward-model-score-alone",
        {
            **MEGATRON_GRPO,
            "reward_model.enable": "True",
            "reward_model.model.path": "${actor_rollout_ref.model.path}",
        },
        {"reward.reward_model.enable": True, "reward.function": "none"},
    ),
    Script(
        "reward-model-ignores-custom-function",
        {
            **MEGATRON_GRPO,
            "reward_model.enable": "True",
            "reward_model.model.path": "${actor_rollout_ref.model.path}",
            "custom_reward_function.path": "examples/reward_fn.py",
        },
        {"reward.function": "none"},
        note="is not called by verl while reward_model.enable is true",
    ),
    Script(
        "gspo-megatron",
        {
            **MEGATRON_GRPO,
            "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
            "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
            "actor_rollout_ref.actor.clip_ratio_low": "0.0003",
            "actor_rollout_ref.actor.clip_ratio_high": "0.0004",
        },
        {"actor.policy_loss.loss_mode": "gspo", "actor.clip_ratio_low": 0.0003},
    ),
)


def run(env: dict[str, str], script: Script) -> Translation:
    return translate(None, common(env, **script.overrides))


def check_no_silent_changes(tr: Translation, script: Script) -> None:
    given = {o.lstrip("+").partition("=")[0] for o in common({"model": "", "train": "", "test": ""},
                                                              **script.overrides)}  # fmt: skip
    refused = {e.message.partition(" = ")[0] for e in tr.errors if e.rule == "verl-import"}
    assert {m.verl for m in tr.mapped} | {u.verl for u in tr.unmapped} | refused == given
    derived = {d.rlplan for d in tr.derived}
    about_derived = [w for w in tr.warnings if w.path.split("[")[0] in derived]
    assert not about_derived, "the import warns about values it derived itself"
    assert not [u for u in tr.unmapped if u.reason == "unknown"], [u.verl for u in tr.unmapped]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_verl_script_translates_with_the_right_values_or_a_named_refusal(
    env: dict[str, str], script: Script
) -> None:
    tr = run(env, script)
    check_no_silent_changes(tr, script)
    if script.refused is not None:
        rule, path = script.refused
        assert [(e.rule, e.path) for e in tr.errors] == [(rule, path)], format_report(tr)
        return
    assert tr.valid and tr.plan_checked, format_report(tr)
    for path, want in script.values.items():
        got = get_path(tr.config, path)
        if isinstance(want, float):
            assert got == pytest.approx(want), path
        else:
            assert got == want, path
    reasons = {u.verl: u.reason for u in tr.unmapped}
    for key, reason in script.unmapped.items():
        assert reasons.get(key) == reason, key
    report = format_report(tr)
    if script.note:
        assert script.note in report
    else:
        assert "FSDP" not in report.split("\nnotes\n")[-1]


def test_vllm_only_keys_keep_the_default_and_say_why(env: dict[str, str]) -> None:
    tr = translate(None, common(env, **MEGATRON_GRPO, **{"actor_rollout_ref.rollout.max_num_seqs": "512"}))
    (row,) = [m for m in tr.mapped if m.verl == "actor_rollout_ref.rollout.max_num_seqs"]
    assert not row.applied and "vllm only" in row.note
    assert tr.config.rollout.max_num_seqs == 256
    assert not [w for w in tr.warnings if w.path.startswith("rollout.")]


def test_a_logger_that_is_not_installed_is_reported_and_dropped(env: dict[str, str]) -> None:
    tr = translate(None, common(env, **MEGATRON_GRPO, **{"trainer.logger": "['console','wandb']"}))
    if importlib.util.find_spec("wandb") is not None:
        assert tr.config.logging.backends == ("console", "wandb", "jsonl")
        return
    assert tr.config.logging.backends == ("console", "jsonl")
    (warn,) = [w for w in tr.warnings if w.rule == "logging"]
    assert warn.path == "logging.backends" and "wandb" in warn.message and "pip install wandb" in warn.fix
    assert "(from trainer.logger)" in format_report(tr)


def test_old_and_current_custom_reward_names_translate_alike(env: dict[str, str]) -> None:
    """verl's current schema moved custom_reward_function under reward.: both spellings give one result."""

    def outcome(prefix: str) -> tuple[Any, ...]:
        tr = translate(None, common(env, **MEGATRON_GRPO, **{f"{prefix}custom_reward_function.path":
                                                             "./reward_function.py",
                                                             f"{prefix}custom_reward_function.name": "compute_score"}))  # fmt: skip
        unmapped = sorted((u.verl.removeprefix(prefix), u.reason) for u in tr.unmapped)
        mapped = sorted((m.verl.removeprefix(prefix), m.rlplan, str(m.value)) for m in tr.mapped)
        return tr.settings.get("reward.function"), unmapped, mapped, [(e.rule, e.path) for e in tr.errors]

    assert outcome("reward.") == outcome("")
