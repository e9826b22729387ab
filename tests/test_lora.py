"""LoRA (actor.lora, issue 34) as users see it: the rule `lora`, the plan (trainable parameters, memory, the
ref for free), verl's LoRA keys, and end to end runs of the `rltrain` command (tiny-grpo learns with
adapters; an HF folder trains with LoRA + KL, its adapter-only checkpoints resume exactly, and
`rltrain export-hf` writes a PEFT folder and a merged model that agree with each other and with peft).

The engine's own tests (TP layouts, PEFT logits, MoE) are tests/megatron/test_lora*.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from presets import PRESETS
from rlconf.config import LoraConfig, RLConfig
from rlconf.errors import ConfigError
from rlconf.plan import compile_plan
from rlconf.plan.diff import plan_to_dict
from rlconf.validate import check_config

ROOT = Path(__file__).resolve().parent.parent


def _tiny(**lora) -> RLConfig:
    c = PRESETS["tiny-grpo"].build()
    actor = dataclasses.replace(c.actor, lora=LoraConfig(**lora), use_kl_loss=True)
    return dataclasses.replace(c, actor=actor)


def _errors(c: RLConfig) -> dict[str, str]:
    return {i.path: i.message for i in check_config(c) if i.severity == "error" and i.rule == "lora"}


# ------------------------------------------------------------------------------------------------ rules
@pytest.mark.parametrize(
    ("lora", "path"),
    [
        ({"rank": -1}, "actor.lora.rank"),
        ({"rank": 8, "alpha": 0.0}, "actor.lora.alpha"),
        ({"rank": 8, "dropout": 1.0}, "actor.lora.dropout"),
        ({"rank": 8, "target_modules": ("q_prj",)}, "actor.lora.target_modules"),
        ({"rank": 8, "target_modules": ()}, "actor.lora.target_modules"),
    ],
)
def test_bad_lora_values_are_named_errors(lora, path):
    assert path in _errors(_tiny(**lora))


def test_rank_zero_is_off_and_checks_nothing_else():
    assert _errors(_tiny(rank=0, alpha=-1.0, target_modules=("nonsense",))) == {}


@pytest.mark.parametrize(
    ("section", "changes", "path"),
    [
        ("rollout", {"placement": "separate", "num_devices": 1}, "rollout.placement"),
        ("rollout", {"engine": "vllm"}, "rollout.engine"),
        ("model", {"attention_backend": "te"}, "model.attention_backend"),
    ],
)
def test_combinations_lora_cannot_run_yet_are_refused(section, changes, path):
    c = _tiny(rank=8)
    c = dataclasses.replace(c, **{section: dataclasses.replace(getattr(c, section), **changes)})
    errors = _errors(c)
    assert path in errors and errors[path].startswith("actor.lora:")


def test_a_rollout_tp_of_its_own_plans_with_lora_and_reshards_the_merged_weights():
    """verl's Megatron LoRA scripts generate at another tp than they train (e.g. train tp 4, rollout tp 2): the
    replica gets the adapted weights (tests/megatron/test_rollout_layout.py runs it), so the rule allows it."""
    c = _tiny(rank=8)
    c = dataclasses.replace(
        c,
        cluster=dataclasses.replace(c.cluster, gpus_per_node=2),
        actor=dataclasses.replace(c.actor, megatron=dataclasses.replace(c.actor.megatron,
                                                                        tensor_model_parallel_size=2)),
        rollout=dataclasses.replace(c.rollout, tensor_model_parallel_size=1),
    )  # fmt: skip
    assert _errors(c) == {}
    assert compile_plan(c).refit.mode == "reshard"


def test_hf_model_in_save_contents_is_refused_with_the_export_command():
    c = _tiny(rank=8)
    ck = dataclasses.replace(c.actor.checkpoint, save_contents=("model", "optimizer", "extra", "hf_model"))
    c = dataclasses.replace(c, actor=dataclasses.replace(c.actor, checkpoint=ck))
    issue = next(i for i in check_config(c) if i.path == "actor.checkpoint.save_contents")
    assert issue.rule == "lora" and "export-hf" in issue.message


def test_cli_validate_exits_2_naming_the_path():
    r = subprocess.run([sys.executable, "-m", "rlconf.cli", "validate", "--preset", "tiny-grpo", "--set",
                        "actor.lora.rank=8", "--set", "actor.lora.dropout=1.5"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "actor.lora.dropout" in r.stdout + r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------- plan
def test_plan_counts_trainable_parameters_and_drops_the_ref_worker():
    full = compile_plan(dataclasses.replace(_tiny(rank=0)))
    lora = compile_plan(_tiny(rank=8, alpha=16.0))
    pf, pl = full.model("policy"), lora.model("policy")
    assert pf.params_trainable == pf.params_total
    # tiny-grpo: 2 layers, h 64, 4 heads / 2 groups of 16, ffn 176; per layer r x (in + out) per projection.
    per_layer = 8 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 176) * 2 + (176 + 64))
    assert pl.params_trainable == 2 * per_layer == lora.lora.params
    assert pl.params_total == pf.params_total
    assert "ref" in full.roles and "ref" not in lora.roles
    assert full.passes.ref_log_prob and lora.passes.ref_log_prob
    assert (full.passes.ref_from, lora.passes.ref_from) == ("ref", "adapters-off")
    data = plan_to_dict(lora)
    assert data["models"]["policy"]["params_trainable"] == pl.params_trainable


def _gib(plan, role: str, part: str) -> float:
    return sum(getattr(r, part) for r in plan.memory.roles if r.role == role)


def test_memory_shows_adapter_only_state_and_no_ref_copy(tmp_path):
    """On a 7B-shaped config.json: gradients and optimizer state shrink to the adapters', the ref's copy of
    the weights disappears, the weights grow by the adapters only."""
    folder = tmp_path / "qwen7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}))  # fmt: skip
    base = _tiny(rank=0)
    base = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, path=str(folder), params_dtype="bfloat16"),
        cluster=dataclasses.replace(base.cluster, device_memory_gib=1e6),  # sized, not run, on this CPU
    )
    full = compile_plan(base)
    lora_cfg = dataclasses.replace(
        base, actor=dataclasses.replace(base.actor, lora=LoraConfig(rank=64, alpha=128.0))
    )
    lora = compile_plan(lora_cfg)
    assert _gib(lora, "actor", "grads_gib") < 0.03 * _gib(full, "actor", "grads_gib")
    assert _gib(lora, "actor", "optimizer_gib") < 0.03 * _gib(full, "actor", "optimizer_gib")
    adapters = lora.lora.params * 2 / 2**30
    assert _gib(lora, "actor", "params_gib") == pytest.approx(
        _gib(full, "actor", "params_gib") + adapters, rel=1e-3
    )
    assert _gib(full, "ref", "params_gib") > 10 and not any(r.role == "ref" for r in lora.memory.roles)
    assert lora.memory.peak_gib < full.memory.peak_gib / 2
    assert any("LoRA" in n and "no reference copy" in n for n in lora.memory.notes)


def test_partial_and_excluded_targets():
    plan = compile_plan(_tiny(rank=4, target_modules=("q_proj", "linear_fc2"),
                              exclude_modules=("decoder.layers.1.mlp.linear_fc2",)))  # fmt: skip
    mods = {(m.layer, m.linear, m.parts) for m in plan.lora.modules}
    assert mods == {
        (0, "linear_qkv", ("q_proj",)),
        (1, "linear_qkv", ("q_proj",)),
        (0, "linear_fc2", ("down_proj",)),
    }
    with pytest.raises(ConfigError) as exc:
        compile_plan(_tiny(rank=4, exclude_modules=("decoder.layers.7.*",)))
    assert exc.value.paths == ("actor.lora.exclude_modules",)


def test_mlp_targets_on_a_moe_model_are_refused_and_all_linear_adapts_attention():
    c = PRESETS["tiny-grpo-moe"].build()
    explicit = dataclasses.replace(
        c, actor=dataclasses.replace(c.actor, lora=LoraConfig(rank=4, target_modules=("linear_fc1",)))
    )
    with pytest.raises(ConfigError) as exc:
        compile_plan(explicit)
    assert exc.value.paths == ("actor.lora.target_modules",) and exc.value.errors[0].rule == "lora"
    plan = compile_plan(dataclasses.replace(c, actor=dataclasses.replace(c.actor, lora=LoraConfig(rank=4))))
    assert {m.linear for m in plan.lora.modules} == {"linear_qkv", "linear_proj"}


# ------------------------------------------------------------------------------------------------- verl
@pytest.fixture()
def qwen7b(tmp_path: Path) -> Path:
    from .test_import_verl import QWEN25_7B_CONFIG

    folder = tmp_path / "Qwen2.5-7B-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    return folder


def test_verl_megatron_lora_keys_import_and_plan(qwen7b):
    """verl's Megatron LoRA script (Megatron-Bridge `model.lora.*`) imports to a LoRA config that plans."""
    from rlconf.verl import translate

    from .test_import_verl import grpo_overrides

    overrides = [*grpo_overrides(qwen7b), "actor_rollout_ref.model.lora.rank=64",
                 "actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
                 "actor_rollout_ref.model.lora.merge=True", "trainer.total_epochs=null", "trainer.total_training_steps=10"]  # fmt: skip
    tr = translate(None, overrides)
    lo = tr.config.actor.lora
    assert (lo.rank, lo.alpha, lo.target_modules) == (
        64,
        32.0,
        ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
    )
    assert "actor.lora.alpha" in {d.rlplan for d in tr.derived}  # verl's Megatron default, said so
    plan = compile_plan(tr.config)
    assert "ref" not in plan.roles and plan.passes.ref_from == "adapters-off"
    assert plan.model("policy").params_trainable == plan.lora.params < plan.model("policy").params_total / 40


def test_verl_fsdp_lora_keys_import(qwen7b):
    from rlconf.verl import translate

    from .test_import_verl import grpo_overrides

    overrides = [*grpo_overrides(qwen7b), "actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=16",
                 "actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.rollout.load_format=safetensors",
                 "actor_rollout_ref.rollout.layered_summon=True"]  # fmt: skip
    lo = translate(None, overrides).config.actor.lora
    assert (lo.rank, lo.alpha, lo.target_modules) == (32, 16.0, ("all-linear",))


# ------------------------------------------------------------------------------------------- end to end
def rltrain(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "rltrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.multiproc
def test_tiny_grpo_with_lora_learns(tmp_path):
    """tiny-grpo with rank-8 adapters (lr 1e-2, LoRA's usual 10x) learns as full fine-tuning does.

    The built-in model starts from a random init; at megatron's init_method_std 0.02 its frozen, tied
    embeddings keep every logit within about +-1.3 whatever the adapters do (entropy stayed at ln 30 over
    80 steps, reward 0.04 -> 0.05), so the base is drawn at std 0.2, as a pretrained model's larger
    weights would be: measured 0.16 -> 0.58 over 80 steps (full fine-tuning of that base 0.15 -> 0.58)."""
    out = tmp_path / "learn"
    r = rltrain("tiny-grpo", "--actor.lora.rank", "8", "--actor.optim.lr", "0.01", "--model.init_method_std", "0.2",
                "--trainer.total_steps", "80", "--trainer.output_dir", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rewards = [row["reward/mean"] for row in metrics(out)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first and last > first + 0.1, (first, last)


@pytest.mark.slow
@pytest.mark.multiproc
def test_hf_folder_lora_kl_resume_exact_and_export(tmp_path):
    """A tiny Qwen2 HF folder trains with LoRA and the KL loss (ref = adapters off, no ref worker); its
    checkpoints hold the adapters only; stopped at step 2 and resumed to 4 it equals the straight run bit for
    bit; export-hf writes a PEFT folder that peft loads on the source folder, and --merge a model whose
    weights are base + alpha / r B A and whose logits equal the PEFT model's."""
    import torch
    from safetensors.torch import load_file

    from rltrain.tokenizer import CharTokenizer

    from .megatron._common import make_tiny_qwen2
    from .test_e2e import comparable

    src = make_tiny_qwen2(tmp_path / "qwen2")
    CharTokenizer().save_pretrained(src)
    common = ["--model.path", str(src), "--actor.lora.rank", "8", "--actor.lora.alpha", "16",
              "--actor.use_kl_loss", "true", "--trainer.save_freq", "2", "--actor.optim.lr", "0.01",
              # no validation: a segment's last step and a resumed start validate (test_e2e's resume test
              # shows those passes equal); here every row must be the straight run's
              "--trainer.test_freq", "0", "--trainer.val_before_train", "false"]  # fmt: skip
    out, ref = tmp_path / "resumed", tmp_path / "straight"
    for steps, folder in (("2", out), ("4", out), ("4", ref)):
        r = rltrain("tiny-grpo", "--trainer.total_steps", steps, "--trainer.output_dir", str(folder), *common)
        assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((ref / "plan.json").read_text())
    assert "ref" not in plan["roles"] and plan["passes"]["ref_from"] == "adapters-off"
    rows, straight = metrics(out), metrics(ref)
    assert [comparable(x) for x in rows] == [comparable(x) for x in straight]
    assert rows[-1]["actor/kl_loss"] > 0  # the policy moved away from the base model it is held to
    ck = out / "checkpoints" / "global_step_4"
    meta = json.loads((ck / "actor" / "meta.json").read_text())
    assert meta["lora_adapters_only"] is True
    dist_bytes = sum(f.stat().st_size for f in (ck / "actor" / "dist_ckpt").rglob("*") if f.is_file())
    # Full fine-tuning saves the weights and two Adam moments, >= 3x the model (3.4 MB here, measured); the
    # adapters with their optimizer state and the checkpoint's metadata are 1.0 MB.
    assert dist_bytes < 2 * (src / "model.safetensors").stat().st_size

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    for args in ((str(ck), str(adapter)), (str(ck), str(merged), "--merge")):
        r = rltrain("export-hf", *args)
        assert r.returncode == 0, r.stderr[-3000:]
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["r"] == 8 and conf["lora_alpha"] == 16 and conf["base_model_name_or_path"] == str(src)
    lora_t, base_t, merged_t = (load_file(str(p)) for p in (adapter / "adapter_model.safetensors",
                                                             src / "model.safetensors", merged / "model.safetensors"))  # fmt: skip
    for name, w in base_t.items():
        module = name.removesuffix(".weight")
        a = lora_t.get(f"base_model.model.{module}.lora_A.weight")
        expected = w if a is None else w + 2.0 * lora_t[f"base_model.model.{module}.lora_B.weight"] @ a
        torch.testing.assert_close(merged_t[name], expected, rtol=1e-6, atol=1e-6, msg=name)
    assert any(not torch.equal(merged_t[n], base_t[n]) for n in base_t)
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    ids = torch.randint(1, 30, (2, 10), generator=torch.Generator().manual_seed(0))
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32),
                                           str(adapter)).eval()  # fmt: skip
    flat = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, flat(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )


def test_adapter_path_is_checked_when_the_plan_compiles(tmp_path):
    missing = _tiny(rank=8, adapter_path=str(tmp_path / "nothing"))
    with pytest.raises(ConfigError) as exc:
        compile_plan(missing)
    assert exc.value.paths == ("actor.lora.adapter_path",)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 16}))
    with pytest.raises(ConfigError) as exc:
        compile_plan(_tiny(rank=8, alpha=16.0, adapter_path=str(folder)))
    assert "rank 8" in exc.value.errors[0].message and exc.value.errors[0].rule == "lora"
    assert compile_plan(_tiny(rank=16, alpha=16.0, adapter_path=str(folder))).lora.adapter_path == str(folder)


def test_profiling_the_ref_pass_of_a_lora_run_profiles_the_actor_worker():
    c = _tiny(rank=8)
    c = dataclasses.replace(
        c, profile=dataclasses.replace(c.profile, tool="torch", steps=(2,), roles=("ref_compute_log_prob",))
    )
    targets = compile_plan(c).profile.targets
    assert [(t.role, t.worker) for t in targets] == [("ref_compute_log_prob", "actor")]


def test_ref_layout_is_not_checked_without_a_ref_engine():
    """The tiny MoE preset's ref section keeps EP 1 while the actor runs EP 2: with LoRA (no ref engine) the
    run plans; without it the ref-layout rule still asks for the actor's layout."""
    c = PRESETS["tiny-grpo-moe"].build()
    c = dataclasses.replace(c, actor=dataclasses.replace(c.actor, use_kl_loss=True))
    assert any(i.rule == "ref-layout-matches-actor" for i in check_config(c))
    lora = dataclasses.replace(c, actor=dataclasses.replace(c.actor, lora=LoraConfig(rank=4)))
    assert not any(i.rule == "ref-layout-matches-actor" for i in check_config(lora))
    assert "ref" not in compile_plan(lora).roles
