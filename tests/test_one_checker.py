"""One checker: rlconf.validate decides what a config alone gets refused for, and compiling the plan agrees.

For any config whose check needs no file (no config.json to read, no prompt files to count), the validator
reports an error iff `compile_plan` raises ConfigError, and both name the same errors (path, rule, message,
fix). A config the validator passes compiles; the plan's own checks are left to what it alone can know (a
config.json's architecture against the layouts, the memory estimate), under the validator's rule names, and
`rlconf validate` reaches them. rlconf.validate imports nothing of rlconf.plan (the plan calls it), and each
module imports on its own.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import rlconf.plan
import rlconf.plan.assemble
import rlconf.validate
from presets import get_preset
from rlconf.cli import main as rlconf_main
from rlconf.config import RLConfig
from rlconf.errors import ConfigError, Issue, error
from rlconf.fields import get_path, iter_leaves, replace_paths
from rlconf.model_spec import family_issues
from rlconf.plan import compile_plan
from rlconf.validate import RULES, check_config
from tests.hf_folders import complete_folder
from tests.strategies import valid_configs
from tests.typed_strategies import for_type, typed_configs

ROOT = Path(__file__).resolve().parents[1]
PROPERTY = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# The one check the plan makes on a config without files: its memory estimate against the device's memory.
PLAN_DERIVED = {("cluster.device_memory_gib", "memory-exceeds-device")}


def _without_files(config: RLConfig) -> RLConfig:
    """The config with no check that reads a file: no config.json (model, critic, reward model) and no
    prompt files for trainer.total_epochs to count."""
    rm = replace(config.reward.reward_model, path=None)
    config = replace(
        config,
        model=replace(config.model, path=None),
        critic=replace(config.critic, model_path=None),
        reward=replace(config.reward, reward_model=rm),
    )
    if config.trainer.total_epochs is not None:
        config = replace(config, data=replace(config.data, train_files=()))
    return config


_LEAVES = [leaf for leaf in iter_leaves(RLConfig)]
_EDGE_INTS = st.sampled_from([-1, 0, 1, 2, 3, 4, 8, 1 << 41])
_EDGE_FLOATS = st.sampled_from([-1.0, 0.0, 1e-9, 0.5, 1.0, 2.0, 1e300])


@st.composite
def _near_valid(draw: st.DrawFn) -> RLConfig:
    """A valid config with 1-3 fields set to any value of their type, or to an edge value (0, -1, 1, huge):
    the configs on the border between what the validator passes and refuses."""
    config = draw(valid_configs())
    for leaf in draw(st.lists(st.sampled_from(_LEAVES), min_size=1, max_size=3, unique_by=lambda x: x.path)):
        current = get_path(config, leaf.path)
        if isinstance(current, bool):
            value = draw(for_type(leaf.type))
        elif isinstance(current, int):
            value = draw(_EDGE_INTS | for_type(leaf.type))
        elif isinstance(current, float):
            value = draw(_EDGE_FLOATS | for_type(leaf.type))
        else:
            value = draw(for_type(leaf.type))
        config = replace_paths(config, {leaf.path: value})
    return config


def _key(issues: tuple[Issue, ...] | list[Issue]) -> list[tuple[str, str, str, str]]:
    return [(i.path, i.rule, i.message, i.fix) for i in issues]


def _disagreement(config: RLConfig) -> str | None:
    """How the validator and the plan disagree on `config`, or None when they agree."""
    found = [i for i in check_config(config) if i.severity == "error"]
    try:
        compile_plan(config)
        raised: list[Issue] = []
    except ConfigError as exc:
        raised = list(exc.errors)
    if found:
        if _key(raised) != _key(found):
            return f"validate: {_key(found)}\nplan: {_key(raised)}"
        return None
    only_plan = [(i.path, i.rule) for i in raised if (i.path, i.rule) not in PLAN_DERIVED]
    return f"the validator passes it, the plan refuses it: {only_plan}" if only_plan else None


def _assert_agree(config: RLConfig) -> None:
    problem = _disagreement(_without_files(config))
    assert problem is None, problem


@PROPERTY
@given(typed_configs())
def test_validator_and_plan_agree_on_any_typed_config(config: RLConfig) -> None:
    _assert_agree(config)


@PROPERTY
@given(_near_valid())
def test_validator_and_plan_agree_next_to_valid_configs(config: RLConfig) -> None:
    _assert_agree(config)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_configs())
def test_a_config_the_validator_passes_compiles(config: RLConfig) -> None:
    assert not [i for i in check_config(config) if i.severity == "error"]
    compile_plan(config)


def _plan_only_group_check(c: RLConfig) -> None:
    if c.rollout.n > 2:
        raise ConfigError(
            [error("rollout.n", "the plan refuses groups of more than 2", "use 2", "plan-only")]
        )


def test_the_property_fails_when_the_plan_checks_something_of_its_own(monkeypatch):
    """The guarantee has teeth: a check made only in the plan (here: a made-up limit on rollout.n) makes the
    property above fail on configs the validator passes."""
    original = rlconf.plan.assemble.present_roles

    def present_roles_with_a_check(c: RLConfig) -> tuple[str, ...]:
        _plan_only_group_check(c)
        return original(c)

    monkeypatch.setattr(rlconf.plan.assemble, "present_roles", present_roles_with_a_check)

    @settings(max_examples=200, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(valid_configs())
    def property_(config: RLConfig) -> None:
        _assert_agree(config)

    with pytest.raises(AssertionError, match="the validator passes it, the plan refuses it"):
        property_()


def test_a_family_check_left_in_the_plan_alone_would_disagree(monkeypatch):
    """Before this change the plan alone checked model.arch against its family; that state (the rule gone
    from the validator, the check made while compiling) is a disagreement the comparison reports."""
    cfg = replace_paths(
        get_preset("tiny-grpo"), {"model.arch.family": "qwen3", "model.arch.add_qkv_bias": False}
    )
    assert _disagreement(cfg) is None  # today: both refuse it with model-unsupported
    original = rlconf.plan.assemble.present_roles

    def with_family_check(c: RLConfig) -> tuple[str, ...]:
        if issues := family_issues(c.model.arch, "model.arch"):
            raise ConfigError([error(p, m, f, "model-unsupported") for p, m, f in issues])
        return original(c)

    # The rule switched off in place (deleting it would re-add it last, changing RULES' order for later tests).
    monkeypatch.setitem(
        RULES, "model-unsupported", replace(RULES["model-unsupported"], fn=lambda c: iter(()))
    )
    monkeypatch.setattr(rlconf.plan.assemble, "present_roles", with_family_check)
    assert "the validator passes it, the plan refuses it" in (_disagreement(cfg) or "")


# ============================================================================ what only the plan knows
QWEN_SMALL = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 96,
    "intermediate_size": 176, "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 64,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}  # fmt: skip


def _model_folder(tmp_path: Path, cfg: dict) -> str:

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return complete_folder(tmp_path)  # weights and tokenizer too: rlconf validate checks them (model-files)


def test_a_config_json_check_stays_in_the_plan_under_the_validators_rule_and_rlconf_validate_reaches_it(
    tmp_path, capsys
):
    """6 heads (read from config.json) over tp 4: the validator cannot know the heads, the plan refuses it
    with the validator's rule name and path, and `rlconf validate` exits 2 with it."""
    flags = ["cluster.gpus_per_node=4", "actor.megatron.tensor_model_parallel_size=4",
             "actor.ppo_micro_batch_size_per_gpu=1"]  # fmt: skip
    folder = _model_folder(tmp_path, QWEN_SMALL)
    cfg = replace_paths(
        get_preset("tiny-grpo"),
        {"model.path": folder, "cluster.gpus_per_node": 4, "actor.megatron.tensor_model_parallel_size": 4,
         "actor.ppo_micro_batch_size_per_gpu": 1},
    )  # fmt: skip
    assert not [i for i in check_config(cfg) if i.severity == "error"]
    with pytest.raises(ConfigError) as exc:
        compile_plan(cfg)
    assert {(i.path, i.rule) for i in exc.value.errors} == {
        ("actor.megatron.tensor_model_parallel_size", "heads-divisible-by-tp")
    }
    assert "heads-divisible-by-tp" in RULES  # the same rule documents the built-in architecture's case
    code = rlconf_main(["validate", "--preset", "tiny-grpo", "--set", f"model.path={folder}",
                        *[a for f in flags for a in ("--set", f)]])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "heads-divisible-by-tp" in err and "actor.megatron.tensor_model_parallel_size" in err


def test_the_memory_check_is_the_plans_and_rlconf_validate_reaches_it(capsys):
    cfg = replace_paths(get_preset("tiny-grpo"), {"cluster.device_memory_gib": 1e-6})
    assert not [i for i in check_config(cfg) if i.severity == "error"]
    with pytest.raises(ConfigError) as exc:
        compile_plan(cfg)
    assert {(i.path, i.rule) for i in exc.value.errors} <= PLAN_DERIVED
    assert rlconf_main(["validate", "--preset", "tiny-grpo", "--set", "cluster.device_memory_gib=1e-6"]) == 2
    assert "memory-exceeds-device" in capsys.readouterr().err


# ============================================================================ imports
def _rlconf_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return {m for m in out if m.startswith("rlconf")}


# The plan's modules that derive the facts both sides check and import nothing of the compiler.
PLAN_FACTS = {"rlconf.plan.roles", "rlconf.plan.model_fit"}


def test_the_validator_imports_nothing_of_the_compiler():
    """The plan calls the validator; the reverse import of the compiler would be a cycle. The validator and
    its checks import from rlconf.plan only the modules of the facts both derive (the role table, what an
    architecture must fit), and importing it loads no compiler module (rlconf.plan loads its names lazily)."""
    for path in [
        ROOT / "rlconf" / "validate.py",
        ROOT / "rlconf" / "rules.py",
        *(ROOT / "rlconf" / "checks").glob("*.py"),
    ]:
        imported = _rlconf_imports(path)
        plan = {m for m in imported if m == "rlconf.plan" or m.startswith("rlconf.plan.")}
        assert plan <= PLAN_FACTS, (path.name, plan)
    for fact in PLAN_FACTS:
        imported = _rlconf_imports(ROOT / Path(*fact.split(".")).with_suffix(".py"))
        assert not [m for m in imported if m.startswith("rlconf.plan") or m.startswith("rlconf.validate")], (
            fact
        )
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, rlconf.validate; print(sorted(m for m in sys.modules if m.startswith('rlconf.plan')))"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=True,
    ).stdout  # fmt: skip
    assert not [
        m for m in ("assemble", "compile", "memory", "advice", "types") if f"rlconf.plan.{m}'" in loaded
    ], loaded
    assert "rlconf.validate" in _rlconf_imports(ROOT / "rlconf" / "plan" / "assemble.py")
    # The limits the validator enforces are the ones the plan exports.
    assert rlconf.plan.MAX_DEVICES == rlconf.validate.MAX_DEVICES
    assert rlconf.plan.MAX_TOTAL_STEPS == rlconf.validate.MAX_TOTAL_STEPS
    assert rlconf.plan.MAX_INT == rlconf.validate.MAX_INT
    assert rlconf.plan.rollout_tp is rlconf.validate.rollout_tp


IMPORT_ALONE = """\
import importlib, sys
for name in NAMES:
    for loaded in [m for m in sys.modules if m == "rlconf" or m.startswith("rlconf.")]:
        del sys.modules[loaded]
    importlib.import_module(name)
print("ok")
"""


def test_each_rlconf_module_imports_on_its_own():
    """Every rlconf module imports first, in a process where no other rlconf module was loaded (an import
    cycle through a module's top level fails here, whichever end is imported first)."""
    names = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "rlconf").rglob("*.py")
    )
    script = IMPORT_ALONE.replace("NAMES", repr(names))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
