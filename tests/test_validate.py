"""Cross-field rules: one example per rule, each asserting the config path the error names."""

from __future__ import annotations

import pytest

from presets import PRESETS, get_preset
from rlconf.errors import ConfigError
from rlconf.fields import replace_paths
from rlconf.load import load_config
from rlconf.validate import RULES, check_config

# (overrides on top of tiny-grpo, path that must be reported, rule, severity)
CASES = [
    # world size divisible by tp x pp x cp (4 devices, tp 3)
    (["cluster.gpus_per_node=4", "actor.megatron.tensor_model_parallel_size=3"],
     "actor.megatron.tensor_model_parallel_size", "world-divisible-by-model-parallel", "error"),
    (["cluster.gpus_per_node=4", "actor.megatron.context_parallel_size=3"],
     "actor.megatron.tensor_model_parallel_size", "world-divisible-by-model-parallel", "error"),
    # expert layout
    (["cluster.gpus_per_node=4", "actor.megatron.expert_model_parallel_size=3"],
     "actor.megatron.expert_model_parallel_size", "world-divisible-by-model-parallel", "error"),
    # MoE training with the overlapped parameter all-gather: rlplan's MoE layers read expert weights directly
    (["model.arch.num_moe_experts=4", "model.arch.family=qwen3_moe", "model.arch.moe_ffn_hidden_size=64",
      "actor.megatron.override_ddp_config.overlap_param_gather=true"],
     "actor.megatron.override_ddp_config.overlap_param_gather", "engine-support", "error"),
    # heads divisible by tp; query groups divide tp or are divisible by it (heads 6, groups 3, tp 2)
    (["cluster.gpus_per_node=2", "actor.megatron.tensor_model_parallel_size=2", "model.arch.num_attention_heads=6",
      "model.arch.num_query_groups=3", "model.arch.hidden_size=96"],
     "actor.megatron.tensor_model_parallel_size", "heads-divisible-by-tp", "error"),
    (["model.arch.num_query_groups=3"], "model.arch.num_query_groups", "heads-divisible-by-tp", "error"),
    (["cluster.gpus_per_node=2", "rollout.tensor_model_parallel_size=2", "model.arch.num_attention_heads=6",
      "model.arch.num_query_groups=3", "model.arch.hidden_size=96"],
     "rollout.tensor_model_parallel_size", "heads-divisible-by-tp", "error"),
    (["cluster.gpus_per_node=4", "actor.megatron.tensor_model_parallel_size=2", "rollout.tensor_model_parallel_size=3"],
     "rollout.tensor_model_parallel_size", "rollout-engine", "error"),
    # layers divisible by pp (x vpp); vpp needs pp > 1
    (["model.arch.num_layers=3", "cluster.gpus_per_node=2", "actor.megatron.pipeline_model_parallel_size=2"],
     "actor.megatron.pipeline_model_parallel_size", "layers-divisible-by-pp", "error"),
    (["cluster.gpus_per_node=2", "actor.megatron.pipeline_model_parallel_size=2",
      "actor.megatron.virtual_pipeline_model_parallel_size=2"],
     "actor.megatron.pipeline_model_parallel_size", "layers-divisible-by-pp", "error"),
    (["actor.megatron.virtual_pipeline_model_parallel_size=2"],
     "actor.megatron.virtual_pipeline_model_parallel_size", "layers-divisible-by-pp", "error"),
    # megatron's uneven split: (4 layers + the embedding) / pp 2 does not divide; first + last > layers
    (["cluster.gpus_per_node=2", "actor.megatron.pipeline_model_parallel_size=2",
      "actor.megatron.account_for_embedding_in_pipeline_split=true"],
     "actor.megatron.pipeline_model_parallel_size", "layers-divisible-by-pp", "error"),
    (["cluster.gpus_per_node=2", "actor.megatron.pipeline_model_parallel_size=2",
      "actor.megatron.num_layers_in_first_pipeline_stage=3", "actor.megatron.num_layers_in_last_pipeline_stage=3"],
     "actor.megatron.pipeline_model_parallel_size", "layers-divisible-by-pp", "error"),
    # sequence parallel with tp = 1: a warning
    (["actor.megatron.sequence_parallel=true"], "actor.megatron.sequence_parallel", "sequence-parallel-needs-tp", "warning"),
    # batches
    (["actor.ppo_micro_batch_size_per_gpu=3", "actor.ppo_mini_batch_size=8"],
     "actor.ppo_micro_batch_size_per_gpu", "batch-divisible-by-dp-micro", "error"),
    (["actor.ppo_mini_batch_size=3"], "actor.ppo_mini_batch_size", "mini-batch-divides-batch", "error"),
    (["actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=16"],
     "actor.ppo_micro_batch_size_per_gpu", "mini-batch-covers-micro", "error"),
    (["actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=16", "data.train_batch_size=32",
      "rollout.n=12"], "actor.ppo_mini_batch_size", "mini-batch-covers-micro", "error"),
    (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=20"],
     "actor.ppo_max_token_len_per_gpu", "token-budget-fits-sequence", "error"),
    # estimators
    (["rollout.n=1"], "rollout.n", "estimator-needs", "error"),
    (["algorithm.adv_estimator=rloo", "rollout.n=1"], "rollout.n", "estimator-needs", "error"),
    (["algorithm.adv_estimator=gae"], "critic.enable", "estimator-needs", "error"),
    (["critic.enable=true"], "critic.enable", "estimator-needs", "warning"),
    (["algorithm.adv_estimator=grpo_passk", "rollout.n=1"], "rollout.n", "estimator-needs", "error"),
    # issue 23: loss modes, DAPO, rollout correction
    (["actor.policy_loss.tau_neg=0"], "actor.policy_loss.tau_neg", "policy-loss", "error"),
    (["actor.policy_loss.clip_cov_lb=6"], "actor.policy_loss.clip_cov_lb", "policy-loss", "error"),
    (["algorithm.filter_groups.max_num_gen_batches=-1"], "algorithm.filter_groups.max_num_gen_batches",
     "filter-groups", "error"),
    (["algorithm.filter_groups.enable=true", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"],
     "algorithm.filter_groups.enable", "filter-groups", "warning"),
    (["reward.overlong_buffer.enable=true"], "reward.overlong_buffer.len", "overlong-buffer", "error"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=17"], "reward.overlong_buffer.len",
     "overlong-buffer", "error"),
    (["algorithm.rollout_correction.rollout_is_threshold=0.5"],
     "algorithm.rollout_correction.rollout_is_threshold", "rollout-correction", "error"),
    (["actor.router_replay=true"], "actor.router_replay", "moe", "error"),
    # issue 24: a separate rollout pool, generation ahead of the update
    (["algorithm.off_policy_steps=1"], "algorithm.off_policy_steps", "rollout-placement", "error"),
    (["algorithm.off_policy_steps=-1"], "algorithm.off_policy_steps", "rollout-placement", "error"),
    (["rollout.placement=separate"], "rollout.num_devices", "device-pools", "error"),
    (["rollout.num_devices=1"], "rollout.num_devices", "device-pools", "warning"),
    (["rollout.placement=separate", "rollout.num_devices=1"], "cluster.gpus_per_node", "device-pools", "error"),
    (["cluster.gpus_per_node=4", "rollout.placement=separate", "rollout.num_devices=3",
      "rollout.tensor_model_parallel_size=2"], "rollout.num_devices", "rollout-placement", "error"),
    (["cluster.gpus_per_node=2", "rollout.placement=separate", "rollout.num_devices=1",
      "rollout.push_timeout_s=0.5"], "rollout.push_timeout_s", "rollout-placement", "error"),
    (["cluster.gpus_per_node=3", "rollout.placement=separate", "rollout.num_devices=1",
      "actor.megatron.expert_model_parallel_size=2", "model.arch.num_moe_experts=4", "model.arch.family=qwen3_moe",
      "model.arch.moe_ffn_hidden_size=64"], "actor.megatron.expert_model_parallel_size", "rollout-placement", "error"),
    (["cluster.gpus_per_node=2", "rollout.placement=separate", "rollout.num_devices=1", "rollout.engine=vllm"],
     "rollout.engine", "rollout-placement", "error"),
    # optimizer
    (["actor.optim.lr=0"], "actor.optim.lr", "optim", "error"),
    (["actor.optim.min_lr=0.1"], "actor.optim.min_lr", "optim", "error"),
    (["trainer.total_steps=30", "actor.optim.lr_warmup_steps=31"], "actor.optim.lr_warmup_steps", "optim", "error"),
    (["actor.optim.lr_warmup_steps_ratio=1.5"], "actor.optim.lr_warmup_steps_ratio", "optim", "error"),
    (["actor.optim.betas=[0.9, 1.0]"], "actor.optim.betas[1]", "optim", "error"),
    (["algorithm.adv_estimator=gae", "critic.enable=true", "rollout.n=1", "critic.optim.lr=-1"],
     "critic.optim.lr", "optim", "error"),
    # checkpoint contents
    (["actor.checkpoint.save_contents=[model]"], "actor.checkpoint.load_contents", "checkpoint-contents", "error"),
    (["actor.checkpoint.save_contents=[optimizer]", "actor.checkpoint.load_contents=[optimizer]", "trainer.save_freq=5"],
     "actor.checkpoint.save_contents", "checkpoint-contents", "error"),
    (["actor.checkpoint.save_contents=[model, model]", "actor.checkpoint.load_contents=[model]"],
     "actor.checkpoint.save_contents[1]", "checkpoint-contents", "warning"),
    # profile
    (["profile.ranks=[0, 1, 7]", "profile.tool=torch", "profile.steps=[1]"], "profile.ranks[1]", "profile", "error"),
    (["profile.tool=torch", "profile.steps=[999]"], "profile.steps[0]", "profile", "error"),
    (["profile.roles=[critic_update]"], "profile.roles[0]", "profile", "warning"),
    (["profile.tool=nsys", "profile.steps=[1]"], "profile.tool", "profile", "error"),
    (["profile.tool=npu", "profile.steps=[1]"], "profile.tool", "profile", "error"),
    (["profile.tool=torch", "profile.steps=[1]", "profile.torch.activities=[cpu, npu]"],
     "profile.torch.activities[1]", "profile", "error"),
    (["profile.tool=torch", "profile.steps=[1]", "profile.npu.level=level2"], "profile.npu", "profile", "warning"),
    (["profile.tool=torch"], "profile.steps", "profile", "warning"),
    # ref / critic layouts valid for their own world
    (["actor.use_kl_loss=true", "cluster.gpus_per_node=2", "actor.ppo_micro_batch_size_per_gpu=2",
      "ref.megatron.tensor_model_parallel_size=3"],
     "ref.megatron.tensor_model_parallel_size", "world-divisible-by-model-parallel", "error"),
    (["algorithm.adv_estimator=gae", "rollout.n=1", "critic.enable=true", "critic.placement=separate",
      "critic.num_devices=1", "cluster.gpus_per_node=2", "critic.megatron.tensor_model_parallel_size=2"],
     "critic.megatron.tensor_model_parallel_size", "world-divisible-by-model-parallel", "error"),
    (["algorithm.adv_estimator=gae", "rollout.n=1", "critic.enable=true", "critic.placement=separate"],
     "critic.num_devices", "device-pools", "error"),
    (["algorithm.adv_estimator=gae", "rollout.n=1", "critic.enable=true", "critic.placement=separate",
      "critic.num_devices=1"], "cluster.gpus_per_node", "device-pools", "error"),
    (["actor.use_kl_loss=true", "cluster.gpus_per_node=2", "actor.ppo_micro_batch_size_per_gpu=2",
      "ref.megatron.tensor_model_parallel_size=2"],
     "ref.megatron.tensor_model_parallel_size", "ref-layout-matches-actor", "error"),
    (["actor.megatron.context_parallel_size=2", "cluster.gpus_per_node=2", "model.attention_backend=local"],
     "actor.megatron.context_parallel_size", "engine-support", "error"),
    (["actor.megatron.expert_model_parallel_size=2", "cluster.gpus_per_node=2"],
     "actor.megatron.expert_model_parallel_size", "engine-support", "error"),
    # positivity, sampling, trainer, reward, data, model, cluster
    (["data.train_batch_size=0"], "data.train_batch_size", "positive-size", "error"),
    (["actor.megatron.tensor_model_parallel_size=0"], "actor.megatron.tensor_model_parallel_size", "positive-size", "error"),
    (["rollout.temperature=0"], "rollout.temperature", "sampling", "error"),
    (["rollout.top_k=0"], "rollout.top_k", "sampling", "error"),
    # issue 31: a temperature that overflows logits / temperature, or that samples noise
    (["rollout.temperature=1e-300"], "rollout.temperature", "sampling", "error"),
    (["rollout.temperature=1e6"], "rollout.temperature", "sampling", "error"),
    (["rollout.temperature=.nan"], "rollout.temperature", "type", "error"),
    (["rollout.val.temperature=1e-9"], "rollout.val.temperature", "sampling", "error"),
    (["rollout.top_p=0"], "rollout.top_p", "sampling", "error"),
    (["rollout.top_k=-2"], "rollout.top_k", "sampling", "error"),
    (["rollout.val.top_k=0"], "rollout.val.top_k", "sampling", "error"),
    (["trainer.max_bad_steps=0"], "trainer.max_bad_steps", "trainer", "error"),
    (["trainer.output_dir="], "trainer.output_dir", "trainer", "error"),
    (["trainer.output_dir=  "], "trainer.output_dir", "trainer", "error"),
    (["rollout.engine=vllm"], "rollout.engine", "rollout-engine", "error"),
    (["rollout.engine=vllm", "cluster.device=cuda"], "rollout.engine", "rollout-engine", "error"),
    (["rollout.max_response_length=1000"], "rollout.max_response_length", "sampling", "error"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "trainer", "error"),
    (["trainer.max_ckpt_to_keep=0"], "trainer.max_ckpt_to_keep", "trainer", "error"),
    (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c", "ppo-loss", "error"),
    (["actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"], "actor.use_kl_loss", "ppo-loss", "warning"),
    (["algorithm.gamma=1.5"], "algorithm.gamma", "ppo-loss", "error"),
    (["reward.function=exact_matc"], "reward.function", "reward-function", "error"),
    # multi-turn tool use (issue 25)
    (["rollout.multi_turn.max_total_tokens=17"], "rollout.multi_turn.max_total_tokens", "multi-turn", "error"),
    (["rollout.multi_turn.tools=[calc]"], "rollout.multi_turn.tools[0]", "multi-turn", "error"),
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[]"], "rollout.multi_turn.tools", "multi-turn",
     "error"),
    (["rollout.multi_turn.max_assistant_turns=0"], "rollout.multi_turn.max_assistant_turns", "multi-turn", "error"),
    (["data.train_files=[prompts.csv]"], "data.train_files[0]", "data-files", "error"),
    (["data.val_files=[prompts.json]"], "data.val_files[0]", "data-files", "error"),  # the loader reads no .json
    # what a run reads and writes before its workers start (filesystem rules)
    (["data.train_files=[/nonexistent/prompts.jsonl]"], "data.train_files[0]", "data-files-exist", "error"),
    (["trainer.resume_mode=resume_path", "trainer.resume_from_path=/nonexistent/checkpoints/global_step_3"],
     "trainer.resume_from_path", "resume-path", "error"),
    (["trainer.output_dir=/dev/null"], "trainer.output_dir", "output-dir", "error"),
    (["reward.function=/nonexistent/reward.py:compute_score"], "reward.function", "reward-function-file", "error"),
    (["model.tokenizer_path=/nonexistent/tokenizer"], "model.tokenizer_path", "tokenizer-load", "error"),
    (["model.arch.family=qwen2_moe", "model.arch.num_moe_experts=3", "actor.megatron.expert_model_parallel_size=2",
      "cluster.gpus_per_node=2"], "actor.megatron.expert_model_parallel_size", "engine-support", "error"),
    (["model.arch.rope_scaling.type=yarn", "model.arch.rope_scaling.factor=2.0"], "model.arch.rope_scaling.type",
     "model-engine-support", "error"),
    (["trainer.output_dir=/dev/null/run"], "trainer.output_dir", "output-dir", "error"),
    ([f"trainer.output_dir=/tmp/{'n' * 256}"], "trainer.output_dir", "output-dir-length", "error"),  # NAME_MAX
    (["cluster.connect_timeout_s=0"], "cluster.connect_timeout_s", "cluster", "error"),
    (["profile.tool=torch", "profile.steps=[1]", "profile.save_path=/dev/null/prof"],
     "profile.save_path", "output-dir", "error"),
    (["logging.rollout_data_dir=/dev/null/gens"], "logging.rollout_data_dir", "output-dir", "error"),
    (["trainer.output_dir=/dev/null", "logging.validation_data_dir=gens"], "logging.validation_data_dir",
     "output-dir", "error"),  # relative: under the run folder, which cannot be made
    # generation records (verl's trainer.log_val_generations, rollout_data_dir, validation_data_dir)
    (["logging.val_generations=-1"], "logging.val_generations", "generation-records", "error"),
    (["logging.val_generations=4", "trainer.test_freq=0", "trainer.val_before_train=false"],
     "logging.val_generations", "generation-records", "warning"),
    (["logging.validation_data_dir=gens", "trainer.test_freq=0", "trainer.val_before_train=false"],
     "logging.validation_data_dir", "generation-records", "warning"),
    # numbers the plan and the workers cannot handle
    (["trainer.seed=-1"], "trainer.seed", "seed-range", "error"),
    (["trainer.seed=100000000000000000000000000000"], "trainer.seed", "seed-range", "error"),
    (["actor.megatron.seed=4611686018427387904"], "actor.megatron.seed", "seed-range", "error"),  # 2**62
    (["trainer.total_steps=100001"], "trainer.total_steps", "plan-limits", "error"),
    # trainer.total_epochs: instead of total_steps, over prompt files (total-epochs-prompts: test_run_length.py)
    (["trainer.total_epochs=2", "trainer.total_steps=30"], "trainer.total_steps", "total-epochs", "error"),
    (["trainer.total_epochs=2"], "trainer.total_epochs", "total-epochs", "error"),  # synthetic: no epochs
    (["trainer.total_epochs=0"], "trainer.total_epochs", "total-epochs", "error"),
    (["cluster.nnodes=1024", "cluster.gpus_per_node=1024"], "cluster.nnodes", "plan-limits", "error"),
    (["trainer.save_freq=100000000000000000000000000000"], "trainer.save_freq", "plan-limits", "error"),
    (["model.attention_backend=te"], "model.attention_backend", "model-source", "error"),
    (["cluster.device=npu", "model.fused_kernels=compiled"], "model.fused_kernels", "model-source", "error"),
    (["actor.megatron.use_dist_checkpointing=true"], "actor.megatron.dist_checkpointing_path", "model-source", "error"),
    (["model.arch.hidden_size=66"], "model.arch.kv_channels", "model-source", "error"),
    (["cluster.device_memory_gib=0"], "cluster.device_memory_gib", "cluster", "error"),
    (["cluster.gpus_per_node=3", "rollout.tensor_model_parallel_size=2", "model.arch.num_query_groups=2",
      "actor.ppo_micro_batch_size_per_gpu=1", "data.train_batch_size=6", "actor.ppo_mini_batch_size=3"],
     "rollout.tensor_model_parallel_size", "cluster", "error"),
    (["actor.megatron.override_transformer_config.hidden_dropout=-0.1"],
     "actor.megatron.override_transformer_config.hidden_dropout", "model-source", "error"),
    (["actor.megatron.override_transformer_config.attention_dropout=1.0"],
     "actor.megatron.override_transformer_config.attention_dropout", "model-source", "error"),
    # the built-in model.arch is a model rlplan runs (a config.json is checked as the plan reads it)
    (["model.arch.family=qwen3", "model.arch.add_qkv_bias=false"], "model.arch.qk_layernorm",
     "model-unsupported", "error"),
    (["model.arch.num_moe_experts=4"], "model.arch.num_moe_experts", "model-unsupported", "error"),
    (["model.arch.sliding_window=8"], "model.arch.sliding_window", "model-unsupported", "error"),
    (["model.arch.sliding_window=0"], "model.arch.sliding_window", "positive-size", "error"),
    (["model.arch.family=qwen2_moe", "model.arch.num_moe_experts=0"], "model.arch.num_moe_experts",
     "positive-size", "error"),
    # LoRA: values, and what it cannot combine with yet (tests/test_lora.py has the rest)
    (["actor.lora.rank=8", "actor.lora.alpha=0"], "actor.lora.alpha", "lora", "error"),
    (["actor.lora.rank=8", "rollout.engine=vllm"], "rollout.engine", "lora", "error"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "path", "rule_name", "severity"), CASES, ids=[c[1] + ":" + c[2] for c in CASES]
)
def test_rule_reports_its_path(overrides, path, rule_name, severity):
    cfg_issues = _issues(overrides)
    hits = [i for i in cfg_issues if i.path == path and i.rule == rule_name]
    assert hits, "\n".join(i.format() for i in cfg_issues) or "no issues"
    assert hits[0].severity == severity
    assert hits[0].fix  # every issue tells the user what to do


def _issues(overrides):
    try:
        cfg = load_config(None, preset="tiny-grpo", overrides=overrides, filesystem=True, presets=PRESETS)
    except ConfigError as exc:
        return exc.issues
    return check_config(cfg, filesystem=True)


def test_every_rule_has_an_example():
    covered = {c[2] for c in CASES}
    covered |= {"batch-layout"}  # batch-layout reports under the specific names used above
    covered |= {"total-epochs-prompts"}  # needs prompt files: tests/test_run_length.py
    covered |= {"model-folder-paths"}  # needs a hostile model folder on disk: tests/test_safe_paths.py
    covered |= {"type"}  # files are typed by the loader: test_a_config_built_in_python_is_typed_by_a_rule
    covered |= {"model-files"}  # needs a damaged model folder: tests/test_model_files.py
    covered |= {"tool-sandbox"}  # needs a machine that cannot isolate: tests/test_sandbox.py
    assert set(RULES) - covered == set()


def test_presets_are_clean():
    for name in PRESETS:
        issues = check_config(get_preset(name))
        assert not [i for i in issues if i.severity == "error"], name


def test_three_independent_mistakes_are_all_reported():
    with pytest.raises(ConfigError) as exc:
        load_config(
            None,
            preset="tiny-grpo",
            overrides=["actor.optim.lr=0", "rollout.n=1", "profile.ranks=[3]"],
            presets=PRESETS,
        )
    assert {"actor.optim.lr", "rollout.n", "profile.ranks[0]"} <= set(exc.value.paths)


def test_a_config_built_in_python_is_typed_by_a_rule():
    """A config that skipped the loader (built in Python) gets the loader's type errors from the `type` rule,
    alone (the other rules do arithmetic on the values), instead of a TypeError from a comparison."""
    base = get_preset("tiny-grpo")
    cfg = replace_paths(base, {"trainer.total_steps": None, "actor.optim.lr": float("nan"),
                               "data.train_files": ("a.jsonl", 3), "model.params_dtype": "fp8",
                               "rollout.tensor_model_parallel_size": None})  # fmt: skip
    issues = check_config(cfg)
    assert {(i.path, i.rule, i.severity) for i in issues} == {
        ("trainer.total_steps", "type", "error"),
        ("actor.optim.lr", "type", "error"),
        ("data.train_files[1]", "type", "error"),
        ("model.params_dtype", "type", "error"),
    }
    assert all(i.fix for i in issues)
    assert "integer" in next(i for i in issues if i.path == "trainer.total_steps").message
    assert "finite" in next(i for i in issues if i.path == "actor.optim.lr").message
    section = replace_paths(base, {"model.arch": None})
    assert [(i.path, i.rule) for i in check_config(section)] == [("model.arch", "type")]
    # An int where a float is declared is a number, as the loader reads it.
    assert not [i for i in check_config(replace_paths(base, {"actor.optim.lr": 1})) if i.rule == "type"]


def test_the_log_prob_passes_token_budget_fits_a_sequence():
    """actor / ref.log_prob_max_token_len_per_gpu (verl's rollout / ref.log_prob_*): where a log-prob pass
    cuts its micro-batches by tokens, its budget (its own, else the actor's update budget) fits one full
    sequence; the error names the field that gave it, once (the actor's and the rollout's passes share it),
    and an update budget that also cuts the update is reported by the update's check alone."""

    def budget_errors(overrides):
        return [i.path for i in _issues(overrides) if i.rule == "token-budget-fits-sequence"]

    own = ["actor.log_prob_use_dynamic_bsz=true", "actor.log_prob_max_token_len_per_gpu=20"]
    assert budget_errors(own) == ["actor.log_prob_max_token_len_per_gpu"]
    ref = [
        "actor.use_kl_loss=true",
        "ref.log_prob_use_dynamic_bsz=true",
        "ref.log_prob_max_token_len_per_gpu=20",
    ]
    assert budget_errors(ref) == ["ref.log_prob_max_token_len_per_gpu"]
    borrowed = ["actor.log_prob_use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=20"]
    assert budget_errors(borrowed) == ["actor.ppo_max_token_len_per_gpu"]
    both = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=20", "actor.use_kl_loss=true"]
    assert budget_errors(both) == ["actor.ppo_max_token_len_per_gpu"]
    larger = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096",
              "actor.log_prob_max_token_len_per_gpu=100000"]  # fmt: skip
    assert budget_errors(larger) == []
    fixed = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096",
             "actor.log_prob_use_dynamic_bsz=false", "actor.log_prob_max_token_len_per_gpu=20"]  # fmt: skip
    assert budget_errors(fixed) == []  # rows, not tokens: the budget is not used


def test_a_reference_budget_lora_would_not_use_is_reported():
    """With LoRA the reference log-probs come from the actor's engine (adapters off), cut by the actor's
    log-prob budget: a ref.log_prob_* the user set is a warning naming the field and the actor's twin."""
    overrides = ["actor.use_kl_loss=true", "actor.lora.rank=4", "ref.log_prob_max_token_len_per_gpu=8192"]
    hits = [i for i in _issues(overrides) if i.rule == "log-prob-budget-unused"]
    assert [(i.path, i.severity) for i in hits] == [("ref.log_prob_max_token_len_per_gpu", "warning")]
    assert "actor.log_prob_max_token_len_per_gpu" in hits[0].fix
    assert not [i for i in _issues(overrides[:2]) if i.rule == "log-prob-budget-unused"]
