"""`rlconf import-verl`: verl configs and Hydra overrides translate, unmapped keys are reported, our rules judge.

The override lists follow the keys verl documents for its Megatron GRPO examples (Qwen2.5-7B, vLLM
rollout, KL loss); the model folder is a temporary one holding only a Qwen2.5-7B-shaped config.json, which
is all the plan reads.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from presets import PRESETS
from rlconf.config import RLConfig
from rlconf.docs import generated_regions, refresh_regions, write_reference
from rlconf.errors import ConfigError
from rlconf.fields import leaf_paths
from rlconf.plan import compile_plan
from rlconf.plan.run import rollout_plan
from rlconf.verl import (
    VERL_KEYS,
    Translation,
    find_row,
    format_report,
    migration_page,
    parse_override,
    to_yaml,
    translate,
)
from tests.hf_folders import complete_folder

ROOT = Path(__file__).resolve().parent.parent
QWEN25_7B_CONFIG = {
    "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "Qwen2.5-7B-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    complete_folder(folder)  # sparse weights and a tokenizer: rlconf validate checks them (model-files)
    return folder


def grpo_overrides(model: Path, **changes: str) -> list[str]:
    """A verl Megatron GRPO run script's overrides (TP=4, PP=2, 8 GPUs, n=5, micro-batch 4)."""
    items = {
        "algorithm.adv_estimator": "grpo",
        "data.train_files": "['/data/gsm8k/train.parquet','/data/math/train.parquet']",
        "data.val_files": "['/data/gsm8k/test.parquet']",
        "data.train_batch_size": "32",
        "data.max_prompt_length": "1024",
        "data.max_response_length": "1024",
        "data.filter_overlong_prompts": "True",
        "data.truncation": "'error'",
        "actor_rollout_ref.model.path": str(model),
        "actor_rollout_ref.model.use_remove_padding": "True",
        "actor_rollout_ref.actor.optim.lr": "1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size": "8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "4",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "2",
        "actor_rollout_ref.actor.use_kl_loss": "True",
        "actor_rollout_ref.actor.kl_loss_coef": "0.001",
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff": "0",
        "actor_rollout_ref.model.enable_gradient_checkpointing": "True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": "4",
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization": "0.6",
        "actor_rollout_ref.rollout.n": "5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "4",
        "algorithm.use_kl_in_reward": "False",
        "trainer.critic_warmup": "0",
        "trainer.logger": "['console','wandb']",
        "trainer.project_name": "'verl_grpo_example_gsm8k_math'",
        "trainer.experiment_name": "'qwen2_5_7b_megatron'",
        "trainer.n_gpus_per_node": "8",
        "trainer.nnodes": "1",
        "trainer.save_freq": "-1",
        "trainer.test_freq": "5",
        "trainer.total_epochs": "15",
        **changes,
    }
    return [f"{k}={v}" for k, v in items.items()]


def keys_of(overrides: list[str]) -> set[str]:
    return {o.lstrip("+~").partition("=")[0] for o in overrides}


def accounted(tr: Translation) -> set[str]:
    return {m.verl for m in tr.mapped} | {u.verl for u in tr.unmapped}


# ------------------------------------------------------------------------------------- the done-when case
def test_qwen25_grpo_megatron_overrides_translate_to_the_plan_layout(qwen7b: Path) -> None:
    overrides = grpo_overrides(qwen7b)
    tr = translate(None, overrides)
    assert tr.valid, format_report(tr)
    c = tr.config
    assert (c.actor.megatron.tensor_model_parallel_size, c.actor.megatron.pipeline_model_parallel_size) == (
        4,
        2,
    )
    assert (c.cluster.nnodes, c.cluster.gpus_per_node, c.cluster.device) == (1, 8, "cuda")
    assert (c.rollout.n, c.rollout.max_response_length, c.rollout.engine) == (5, 1024, "embedded")
    assert c.actor.ppo_micro_batch_size_per_gpu == 4 and c.actor.ppo_mini_batch_size == 8
    assert c.actor.optim.lr == 1e-6 and c.actor.use_kl_loss and c.algorithm.adv_estimator == "grpo"
    assert c.model.path == str(qwen7b) and c.model.params_dtype == "bfloat16"
    assert c.data.train_files == ("/data/gsm8k/train.parquet", "/data/math/train.parquet")
    assert c.data.truncation == "filter"  # filter_overlong_prompts=True wins over truncation=error
    assert c.data.answer_key == "reward_model.ground_truth"
    assert c.actor.log_prob_micro_batch_size_per_gpu == 4
    assert c.actor.megatron.override_transformer_config.recompute_granularity == "full"
    if importlib.util.find_spec("wandb") is not None:
        assert c.logging.backends == ("console", "wandb", "jsonl")
    else:  # the run would stop at its first step: the import drops it and says so
        assert c.logging.backends == ("console", "jsonl")
        assert [w.path for w in tr.warnings if w.rule == "logging"] == ["logging.backends"]
    assert (c.trainer.save_freq, c.trainer.test_freq, c.trainer.project_name) == (
        0, 5, "verl_grpo_example_gsm8k_math")  # fmt: skip
    # The ref runs in the actor's processes: it takes the actor's layout (derived, and said so).
    assert (c.ref.megatron.tensor_model_parallel_size, c.ref.megatron.pipeline_model_parallel_size) == (4, 2)
    assert {d.rlplan for d in tr.derived} >= {"ref.megatron.tensor_model_parallel_size", "cluster.device"}

    # The prompt files are the script's /data/...: the plan cannot count total_epochs here and says where.
    with pytest.raises(ConfigError) as exc:
        compile_plan(c)
    assert exc.value.paths == ("data.train_files[0]",)
    plan = compile_plan(dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, total_epochs=None)))
    actor = plan.layout("actor")
    assert (actor.world_size, actor.tp, actor.pp, actor.dp) == (8, 4, 2, 1)
    assert plan.batch_plan("actor").responses_per_step == 32 * 5

    # Every key is accounted for; the unmapped ones with their reasons.
    assert accounted(tr) == keys_of(overrides)
    assert not tr.unmapped, [u.verl for u in tr.unmapped]
    # use_remove_padding=True keeps rlplan's null: packed wherever the engine can (the plan says where).
    assert c.model.use_remove_padding is None
    # total_epochs maps one to one; the prompt files are not on this machine, so the import says the steps
    # are counted where they are (and plans the rest).
    assert c.trainer.total_epochs == 15
    assert [w.path for w in tr.warnings if w.rule == "total-epochs"] == ["trainer.total_epochs"]
    report = format_report(tr)
    for u in tr.unmapped:
        assert u.note and f"{u.verl} = " in report and u.note in report
    assert "validation: ok (rlplan's rules and plan)" in report


def test_rollout_name_vllm_becomes_the_embedded_engine_with_a_note(qwen7b: Path) -> None:
    tr = translate(None, grpo_overrides(qwen7b))
    (m,) = [m for m in tr.mapped if m.verl == "actor_rollout_ref.rollout.name"]
    assert (m.rlplan, m.value) == ("rollout.engine", "embedded") and "embedded" in m.note
    assert "rollout.engine = embedded" in format_report(tr)


def test_rollout_tp_that_differs_from_the_actor_maps_onto_a_rollout_layout_of_its_own(qwen7b: Path) -> None:
    tr = translate(
        None, grpo_overrides(qwen7b, **{"actor_rollout_ref.rollout.tensor_model_parallel_size": "2"})
    )
    assert tr.valid, format_report(tr)
    assert tr.config.rollout.tensor_model_parallel_size == 2
    assert tr.config.actor.megatron.tensor_model_parallel_size == 4


def test_rollout_tp_that_cannot_regroup_the_actors_shards_fails_now_as_an_rlplan_rule(qwen7b: Path) -> None:
    tr = translate(
        None, grpo_overrides(qwen7b, **{"actor_rollout_ref.rollout.tensor_model_parallel_size": "3"})
    )
    assert not tr.valid
    err = next(e for e in tr.errors if e.rule == "rollout-engine")
    assert err.path == "rollout.tensor_model_parallel_size"
    assert err.fix.startswith("use one of 1, 2, 4, 8, 16")
    report = format_report(tr)
    assert "rlplan's own rules (verl runs this; rlplan does not)" in report
    assert "(from actor_rollout_ref.rollout.tensor_model_parallel_size)" in report


def test_a_batch_verl_would_reject_late_fails_now_tied_to_its_verl_key(qwen7b: Path) -> None:
    tr = translate(None, grpo_overrides(qwen7b, **{"actor_rollout_ref.actor.ppo_mini_batch_size": "7"}))
    rules = {e.rule: e for e in tr.errors}
    assert "mini-batch-divides-batch" in rules
    assert rules["mini-batch-divides-batch"].path == "actor.ppo_mini_batch_size"
    report = format_report(tr)
    assert "would have failed late (or silently) in verl" in report
    assert "actor.ppo_mini_batch_size (from actor_rollout_ref.actor.ppo_mini_batch_size)" in report


def test_a_hub_model_id_fails_the_plan_with_the_fix(tmp_path: Path) -> None:
    overrides = grpo_overrides(tmp_path, **{"actor_rollout_ref.model.path": "Qwen/Qwen2.5-7B-Instruct"})
    tr = translate(None, overrides)
    assert [e.rule for e in tr.errors] == ["model-config-json"]
    assert "local Hugging Face model folder" in tr.errors[0].fix


def test_untranslatable_value_is_an_error_on_the_rlplan_path(qwen7b: Path) -> None:
    tr = translate(None, grpo_overrides(qwen7b, **{"trainer.logger": "[console,mlflow]"}))
    (err,) = tr.errors
    assert (err.rule, err.path) == ("verl-import", "logging.backends") and "mlflow" in err.message


def test_gae_enables_the_critic_and_verl_defaults_fill_unset_keys() -> None:
    tr = translate(None, ["algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=1", "data.train_batch_size=8",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2"])  # fmt: skip
    c = tr.config
    assert c.critic.enable and c.critic.ppo_mini_batch_size == 4  # verl: ${actor...ppo_mini_batch_size}
    assert c.critic.optim.lr == 1e-5 and c.data.max_prompt_length == 512 and c.cluster.device == "cuda"
    derived = {d.rlplan: d.note for d in tr.derived}
    assert "critic.enable" in derived and "verl's default" in derived["data.max_prompt_length"]


# -------------------------------------------------------------------------------------- unmapped keys
def test_unknown_key_is_reported_with_did_you_mean() -> None:
    tr = translate(None, ["actor_rollout_ref.actor.ppo_mini_bach_size=8", "trainer.nnodes=1"])
    (u,) = tr.unmapped
    assert u.reason == "unknown" and "`actor_rollout_ref.actor.ppo_mini_batch_size`" in u.note
    assert "unknown (unknown verl key):" in format_report(tr)


def test_keys_verl_itself_ignores_are_reported_and_not_applied() -> None:
    tr = translate(None, ["actor_rollout_ref.actor.megatron.grad_offload=True",
                          "actor_rollout_ref.actor.optim.betas=[0.9,0.95]"])  # fmt: skip
    assert {u.verl: u.reason for u in tr.unmapped} == {
        "actor_rollout_ref.actor.megatron.grad_offload": "ignored-by-verl",
        "actor_rollout_ref.actor.optim.betas": "ignored-by-verl",
    }
    assert tr.config.actor.megatron.grad_offload is False and tr.config.actor.optim.betas == (0.9, 0.999)
    assert "verl itself ignores this key" in format_report(tr)


# ----------------------------------------------------------------------------------------- Hydra syntax
@pytest.mark.parametrize(
    ("text", "op", "key", "value"),
    [
        ("a.b=1", "set", "a.b", 1),
        ("+a.b=1e-6", "add", "a.b", 1e-6),
        ("++a.b=x", "force", "a.b", "x"),
        ("~a.b", "delete", "a.b", None),
        ("~a.b=3", "delete", "a.b", 3),
        ("a.devices=[0,1]", "set", "a.devices", [0, 1]),
        ("a.logger=['console','wandb']", "set", "a.logger", ["console", "wandb"]),
        ("a.logger=[console,wandb]", "set", "a.logger", ["console", "wandb"]),
        ("a.b=null", "set", "a.b", None),
        ("a.b=True", "set", "a.b", True),
        ("a.b='1e-6'", "set", "a.b", "1e-6"),
        ('a.b="two words"', "set", "a.b", "two words"),
        ("a.b=", "set", "a.b", ""),
        ("a.b=yes", "set", "a.b", "yes"),
        ("a.b=c: d", "set", "a.b", "c: d"),
        ("a.b={x: 1}", "set", "a.b", {"x": 1}),
    ],
)
def test_hydra_override_syntax(text: str, op: str, key: str, value: object) -> None:
    ov = parse_override(text)
    assert (ov.op, ov.key, ov.value) == (op, key, value)
    assert type(ov.value) is type(value)


@pytest.mark.parametrize("text", ["=5", "a.b", "a b=1", "+=1"])
def test_unreadable_override_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError) as exc:
        translate(None, [text])
    assert exc.value.issues[0].rule == "override-syntax"


def test_overrides_add_force_and_delete_on_top_of_a_file() -> None:
    data = {"data": {"train_batch_size": 64, "max_prompt_length": 256}, "trainer": {"nnodes": 2}}
    tr = translate(
        data, ["~data.train_batch_size", "+trainer.seed=7", "++trainer.nnodes=1", "~trainer.nosuch"]
    )
    c = tr.config
    assert c.data.train_batch_size == 1024  # deleted: verl's default applies
    assert (c.data.max_prompt_length, c.trainer.seed, c.cluster.nnodes) == (256, 7, 1)
    assert any("deletes a key that is not set" in n for n in tr.notes)


VERL_YAML = """\
defaults:
  - actor@actor_rollout_ref.actor: megatron_actor
  - _self_
algorithm:
  adv_estimator: grpo
data:
  train_batch_size: 16
  max_prompt_length: 64
  max_response_length: 128
  train_files: ~/data/gsm8k/train.parquet
actor_rollout_ref:
  model:
    path: null
  actor:
    _target_: verl.workers.config.McoreActorConfig
    ppo_mini_batch_size: 4
    ppo_micro_batch_size_per_gpu: 2
    megatron:
      tensor_model_parallel_size: 2
      seed: 7
      override_transformer_config:
        recompute_granularity: selective
        recompute_modules: [core_attn, mlp]
    checkpoint:
      save_contents: [model, optimizer, extra, hf_model]
      load_contents: ${.save_contents}
  ref:
    megatron:
      seed: ${oc.select:actor_rollout_ref.actor.megatron.seed,42}
      override_transformer_config: ${oc.select:actor_rollout_ref.actor.megatron.override_transformer_config,{}}
  rollout:
    name: ???
    n: 4
    response_length: ${data.max_response_length}
    tensor_model_parallel_size: 2
    engine_kwargs:
      vllm: {}
    prometheus:
      served_model_name: ${oc.env:HOSTNAME}
trainer:
  n_gpus_per_node: 4
  device: cpu
  default_local_dir: checkpoints/${trainer.project_name}/${trainer.experiment_name}
  project_name: p
  experiment_name: e
global_profiler:
  tool: null
  steps: [1, 2]
"""


def test_yaml_file_with_nested_layout_interpolations_and_defaults(tmp_path: Path) -> None:
    tr = translate(yaml.safe_load(VERL_YAML), ["trainer.total_training_steps=10"])
    c = tr.config
    assert tr.valid, format_report(tr)
    assert (c.actor.megatron.tensor_model_parallel_size, c.rollout.n, c.cluster.device) == (2, 4, "cpu")
    assert c.actor.checkpoint.load_contents == (
        "model",
        "optimizer",
        "extra",
        "hf_model",
    )  # ${.save_contents}
    assert c.ref.megatron.seed == 7 and c.ref.megatron.override_transformer_config.recompute_modules == (
        "core_attn", "mlp")  # fmt: skip
    assert c.rollout.max_response_length == 128 and c.trainer.output_dir == "checkpoints/p/e"
    assert c.data.train_files[0].endswith("/data/gsm8k/train.parquet") and "~" not in c.data.train_files[0]
    assert c.profile.steps == (1, 2) and c.profile.tool == "none" and c.trainer.total_steps == 10
    assert c.model.path is None
    unmapped = {u.verl: u for u in tr.unmapped}
    assert unmapped["actor_rollout_ref.rollout.prometheus.served_model_name"].reason == "unresolved"
    assert unmapped["actor_rollout_ref.actor._target_"].reason == "not-needed"
    assert any("`defaults` list" in n for n in tr.notes)
    assert any("actor_rollout_ref.rollout.name" in n and "???" in n for n in tr.notes)


# ------------------------------------------------------------------------------------------ properties
def _row_key(row_verl: str) -> str:
    return row_verl[:-2] + ".some_field" if row_verl.endswith(".*") else row_verl


_VALUE_TEXT = st.one_of(
    st.integers(-2, 64).map(str),
    st.sampled_from(["0.5", "1e-6", "-1", "true", "false", "null", "vllm", "megatron", "grpo", "cuda", "'x y'",
                     "[1,2]", "[console,wandb]", "[model,optimizer]", "gae", "fsdp", "${data.train_batch_size}",
                     "${nosuch.key}", "???", ""]),
)  # fmt: skip
_KEYS = st.sampled_from([*sorted({_row_key(r.verl) for r in VERL_KEYS}), "nosuch.key", "trainer.nosuch"])


@given(st.dictionaries(_KEYS, _VALUE_TEXT, max_size=12))
def test_any_override_list_from_the_table_loses_no_key(items: dict[str, str]) -> None:
    overrides = [f"{k}={v}" for k, v in items.items()]
    tr = translate(None, overrides)  # raises nothing (ConfigError only for unreadable syntax)
    errored = {m.group(1) for i in tr.issues if (m := re.match(r"^(\S+) = ", i.message))}
    missing = {k for k, v in items.items() if v == "???"}
    assert keys_of(overrides) - missing <= accounted(tr) | errored
    assert isinstance(to_yaml(tr), str) and isinstance(format_report(tr), str)


# ------------------------------------------------------------------------------------------- the table
def test_table_rows_are_unique_and_name_real_rlplan_paths() -> None:
    keys = [r.verl for r in VERL_KEYS]
    assert len(keys) == len(set(keys))
    leaves = set(leaf_paths(RLConfig))
    for row in VERL_KEYS:
        assert row.rlplan is None or row.rlplan in leaves, row
        assert row.rlplan is not None or (row.reason and row.note), row
        assert find_row(_row_key(row.verl)) is not None


# ------------------------------------------------------------------------------------------------- docs
def test_committed_migration_page_is_generated_from_the_table(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "migrating-from-verl.md").read_text()
    # The walk-through's output regions are filled from its record (bench/docs_run.py --verl).
    regions = generated_regions(ROOT / "docs", PRESETS)
    assert page == refresh_regions(migration_page(), regions), "run: rlconf docs docs/reference"
    assert "<!-- generated:verl-run -->\n```text\nstep    1" in page, (
        "run: .venv/bin/python bench/docs_run.py --verl"
    )
    for row in VERL_KEYS:
        key = row.verl.partition(f".{row.family}.")[2] if row.family else row.verl
        assert f"`{key}`" in page, row.verl
    written = write_reference(tmp_path / "reference", PRESETS)
    assert (tmp_path / "migrating-from-verl.md") in written


# -------------------------------------------------------------------------------------------------- CLI
def rlconf(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlconf.cli", *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def test_cli_writes_a_config_that_validates_and_plans_the_layout(qwen7b: Path, tmp_path: Path) -> None:
    out = tmp_path / "rlplan.yaml"
    # rlconf validate checks that prompt files exist, as the run does: point the import at real files.
    files = [tmp_path / "train.parquet", tmp_path / "test.parquet"]
    for f in files:  # 70 prompts: 2 batches of 32 per epoch (verl's total_epochs = 15 gives 30 steps)
        pq.write_table(pa.table({"prompt": ["1 + 1 ="] * 70, "answer": ["2"] * 70}), f)
    data = {"data.train_files": f"['{files[0]}']", "data.val_files": f"['{files[1]}']"}
    result = rlconf("import-verl", *grpo_overrides(qwen7b, **data), "-o", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"wrote {out}" in result.stdout and "trainer.total_epochs = 15" in result.stdout
    text = out.read_text()
    assert (
        "tensor_model_parallel_size: 4  # actor_rollout_ref.actor.megatron.tensor_model_parallel_size" in text
    )
    check = rlconf("validate", str(out))
    assert check.returncode == 0, check.stderr
    plan = rlconf("plan", str(out))
    assert plan.returncode == 0, plan.stderr
    assert "run: total_steps 30 = 15 epochs x 2 batches of 32 prompts" in plan.stdout, plan.stdout
    assert re.search(r"^\s+actor\s+actor_pool\s+8\s+4\s+2\s+-\s+1\s+1\s+4\s+1\s", plan.stdout, re.M), (
        plan.stdout
    )


def test_cli_invalid_translation_exits_2_and_still_writes_the_file(qwen7b: Path, tmp_path: Path) -> None:
    out = tmp_path / "bad.yaml"
    overrides = grpo_overrides(qwen7b, **{"actor_rollout_ref.rollout.tensor_model_parallel_size": "3"})
    result = rlconf("import-verl", *overrides, "-o", str(out))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "(invalid: fix the errors above" in result.stdout and out.read_text().count("# INVALID") == 1
    check = rlconf("validate", str(out))
    assert check.returncode == 2 and "rollout.tensor_model_parallel_size" in check.stderr


def test_cli_file_input_json_and_stdout(tmp_path: Path) -> None:
    verl = tmp_path / "verl.yaml"
    verl.write_text(VERL_YAML)
    result = rlconf("import-verl", str(verl), "trainer.total_training_steps=10", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["valid"] and report["settings"]["actor.megatron.tensor_model_parallel_size"] == 2
    assert {u["verl"] for u in report["unmapped"]} >= {"actor_rollout_ref.actor._target_"}
    plain = rlconf("import-verl", str(verl))  # no -o: the config on stdout, the report on stderr
    assert yaml.safe_load(plain.stdout)["rollout"]["n"] == 4 and "not mapped" in plain.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [((), "nothing to import"), (("/no/such/verl.yaml",), "does not exist"), (("a b=1",), "cannot read")],
)
def test_cli_bad_input_exits_2_without_traceback(args: tuple[str, ...], message: str) -> None:
    result = rlconf("import-verl", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------------- DAPO / GSPO (issue 23)
def test_dapo_overrides_map_to_rlplan_fields(qwen7b: Path) -> None:
    dapo = {
        "actor_rollout_ref.actor.clip_ratio_low": "0.2",
        "actor_rollout_ref.actor.clip_ratio_high": "0.28",
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "algorithm.filter_groups.enable": "True",
        "algorithm.filter_groups.metric": "acc",
        "algorithm.filter_groups.max_num_gen_batches": "10",
        "reward_model.reward_manager": "dapo",
        "reward_model.overlong_buffer.enable": "True",
        "reward_model.overlong_buffer.len": "256",
        "reward_model.overlong_buffer.penalty_factor": "1.0",
        "data.gen_batch_size": "96",
    }
    overrides, tr = _translated(qwen7b, dapo)
    c = tr.config
    assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high, c.actor.loss_agg_mode) == (
        0.2,
        0.28,
        "token-mean",
    )
    assert (c.algorithm.filter_groups.enable, c.algorithm.filter_groups.metric) == (True, "score")
    assert c.algorithm.filter_groups.max_num_gen_batches == 10
    ob = c.reward.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 256, 1.0)
    unsupported = {u.verl for u in tr.unmapped if u.reason == "unsupported"}
    assert not unsupported & set(dapo), unsupported
    assert accounted(tr) == keys_of(overrides)


def test_dapo_overlong_buffer_longer_than_the_response_fails_validation(qwen7b: Path) -> None:
    # data.max_response_length 1024: a 4096-token buffer cannot fit (the rule names the rlplan path).
    tr = translate(None, grpo_overrides(qwen7b, **{"reward_model.overlong_buffer.enable": "True",
                                                   "reward_model.overlong_buffer.len": "4096"}))  # fmt: skip
    assert not tr.valid
    assert "reward.overlong_buffer.len" in {i.path for i in tr.errors}


def test_gspo_and_newer_overlong_keys_map(qwen7b: Path) -> None:
    changes = {
        "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
        "actor_rollout_ref.actor.clip_ratio_low": "3e-4",
        "actor_rollout_ref.actor.clip_ratio_high": "4e-4",
        "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable": "True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len": "128",
        "+reward_model.reward_kwargs.max_resp_len": "1024",
        "algorithm.rollout_correction.rollout_is": "token",
    }
    tr = translate(None, grpo_overrides(qwen7b, **changes))
    assert tr.valid, format_report(tr)
    c = tr.config
    assert (c.actor.policy_loss.loss_mode, c.actor.clip_ratio_low, c.actor.clip_ratio_high) == (
        "gspo",
        3e-4,
        4e-4,
    )
    assert (c.reward.overlong_buffer.enable, c.reward.overlong_buffer.len) == (True, 128)
    assert c.algorithm.rollout_correction.rollout_is == "token"
    assert not {u.verl for u in tr.unmapped if u.reason == "unsupported"} - {"trainer.total_epochs"}


def test_filter_metric_without_rlplan_equivalent_is_reported(qwen7b: Path) -> None:
    tr = translate(None, grpo_overrides(qwen7b, **{"algorithm.filter_groups.metric": "seq_final_reward"}))
    assert not tr.valid
    assert "seq_final_reward" in format_report(tr)


def test_multi_turn_keys_map_and_tool_configs_are_reported(qwen7b: Path) -> None:
    changes = {
        "actor_rollout_ref.rollout.multi_turn.enable": "True",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "3",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": "64",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "4",
        "actor_rollout_ref.rollout.multi_turn.format": "hermes",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": "tools.yaml",
    }
    tr = translate(None, grpo_overrides(qwen7b, **changes))
    mt = tr.config.rollout.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.max_tool_response_length, mt.max_parallel_tools) == (
        True,
        3,
        64,
        4,
    )
    reasons = {u.verl: u.reason for u in tr.unmapped}
    assert reasons["actor_rollout_ref.rollout.multi_turn.tool_config_path"] == "unsupported"
    assert reasons["actor_rollout_ref.rollout.multi_turn.format"] == "not-needed"
    # verl's null turn bound keeps rlplan's default instead of failing the int field.
    tr = translate(
        None, grpo_overrides(qwen7b, **{"actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "null"})
    )
    assert tr.config.rollout.multi_turn.max_assistant_turns == 4


def test_log_prob_token_budgets_map_to_the_log_prob_passes(qwen7b: Path) -> None:
    """verl's rollout.log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu (its actor's old log-prob
    pass) and ref.log_prob_* (17 of verl's 46 Megatron scripts set them): the plan's actor and ref engines
    cut their forward micro-batches by those budgets while the update keeps its own; unset, both passes take
    the actor's, as verl interpolates them."""
    budgets = {
        "actor_rollout_ref.actor.use_dynamic_bsz": "True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "4096",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "True",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "18432",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "True",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "10240",
    }
    overrides, tr = _translated(qwen7b, budgets)
    assert not {u.verl for u in tr.unmapped} & set(budgets)
    plan = _steps_plan(tr.config)
    actor, ref = plan.engine("actor").settings, plan.engine("ref").settings
    assert (actor.forward_use_dynamic_bsz, actor.forward_max_token_len) == (True, 18432)
    assert (ref.forward_use_dynamic_bsz, ref.forward_max_token_len) == (True, 10240)
    assert plan.batch_plan("actor").max_token_len_per_micro_batch == 4096
    unset = {k: v for k, v in budgets.items() if "log_prob" not in k}
    plan = _steps_plan(translate(None, grpo_overrides(qwen7b, **unset)).config)
    for role in ("actor", "ref"):
        assert plan.engine(role).settings.forward_max_token_len == 4096, role
    assert accounted(tr) == keys_of(overrides)


def _translated(model: Path, changes: dict[str, str]):
    """(the GRPO script's overrides with `changes`, their valid translation)."""
    overrides = grpo_overrides(model, **changes)
    tr = translate(None, overrides)
    assert tr.valid, format_report(tr)
    return overrides, tr


def _steps_plan(c: RLConfig):
    """The plan of a translated script run by steps (its prompt files, /data/..., do not exist here)."""
    return compile_plan(dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, total_epochs=None)))


def test_moe_router_dtype_maps_to_the_models_one_setting(qwen7b: Path) -> None:
    """verl's actor override_transformer_config.moe_router_dtype (12 of verl's 46 Megatron scripts set fp32)
    is model.moe_router_dtype, the precision of every role's routers; the ref's own key is reported as
    covered by it."""
    key = "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype"
    ref_key = "+actor_rollout_ref.ref.megatron.override_transformer_config.moe_router_dtype"
    overrides, tr = _translated(qwen7b, {key: "fp32", ref_key: "fp32"})
    assert tr.config.model.moe_router_dtype == "fp32"
    assert {u.verl: u.reason for u in tr.unmapped}[ref_key.lstrip("+")] == "not-needed"
    assert accounted(tr) == keys_of(overrides)


# ------------------------------------------------------------------------------------- validation sampling
@pytest.mark.parametrize(
    ("do_sample", "temperature"),
    [(None, 0.0), ("False", 0.0), ("True", 0.6)],
    ids=["default", "false", "true"],
)
def test_verl_validates_greedily_unless_do_sample(do_sample, temperature):
    """verl's validation samples only with val_kwargs.do_sample = true (default false); otherwise it decodes
    greedily and its val_kwargs.temperature is unused: rlplan validates the same way, and says so."""
    overrides = [
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
        "actor_rollout_ref.rollout.val_kwargs.top_k=20",
    ]
    if do_sample is not None:
        overrides.append(f"actor_rollout_ref.rollout.val_kwargs.do_sample={do_sample}")
    tr = translate(None, overrides, check_plan=False)
    val = tr.config.rollout.val
    assert (val.temperature, val.top_k) == (temperature, 20)
    greedy = [d for d in tr.derived if d.rlplan == "rollout.val.temperature"]
    assert bool(greedy) == (temperature == 0.0)
    assert rollout_plan(tr.config.rollout).val.top_k == 20  # the validation sampler's top-k is the script's


def test_verl_use_remove_padding_false_pads():
    tr = translate(None, ["actor_rollout_ref.model.use_remove_padding=False"], check_plan=False)
    assert tr.config.model.use_remove_padding is False


@pytest.mark.parametrize("manager", ["naive", "dapo", "prime", "batch", "my_manager"])
def test_reward_managers_that_call_the_function_another_way_are_refused(manager):
    """verl's batch manager calls compute_score once with lists: rlplan's per-response calls would hand
    a batch function strings. Refused by name, as is a custom manager; the per-response ones translate."""
    for key in ("reward_model.reward_manager", "reward.reward_manager.name"):
        tr = translate(None, [f"{key}={manager}"], check_plan=False)
        refused = [i for i in tr.errors if i.path == key and i.rule == "verl-import"]
        assert bool(refused) == (manager not in ("naive", "dapo", "prime")), (key, manager)
        if manager == "batch":
            assert "once with lists" in refused[0].message and "per-response" in refused[0].fix


def test_megatron_kernel_switches_are_rlplans_choice_and_grouped_gemm_maps():
    """override_transformer_config's fusion and dispatcher switches (set by 4-12 of verl's 46 scripts) change
    kernels, not the math: reported as rlplan's own choice, not as an unsupported feature; moe_grouped_gemm is
    rlplan's model.moe_grouped_gemm."""
    prefix = "actor_rollout_ref.actor.megatron.override_transformer_config"
    switches = ("gradient_accumulation_fusion", "moe_permute_fusion", "apply_rope_fusion", "bias_activation_fusion",
                "masked_softmax_fusion", "bias_dropout_fusion", "persist_layer_norm", "moe_token_dispatcher_type",
                "moe_enable_deepep", "moe_shared_expert_overlap", "use_flash_attn")  # fmt: skip
    overrides = [f"+{prefix}.{name}=True" for name in switches] + [f"+{prefix}.moe_grouped_gemm=True"]
    tr = translate(None, overrides, check_plan=False)
    reasons = {u.verl.rpartition(".")[2]: u.reason for u in tr.unmapped}
    assert reasons == dict.fromkeys(switches, "not-needed")
    assert tr.config.model.moe_grouped_gemm is True
