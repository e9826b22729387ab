"""Loading: strict types, YAML quirks, paths with list indices, did-you-mean, presets and overrides."""

from __future__ import annotations

import json

import pytest

from presets import PRESETS, get_preset
from rlconf.config import RLConfig
from rlconf.errors import ConfigError
from rlconf.load import (
    apply_overrides,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    parse_yaml,
    read_config_file,
    resolve_config,
)


def load_yaml_text(text: str) -> RLConfig:
    return config_from_dict(parse_yaml(text))


def the_error(exc: pytest.ExceptionInfo[ConfigError], path: str):
    matches = [i for i in exc.value.errors if i.path == path]
    assert matches, f"no error at {path}: {exc.value.format()}"
    return matches[0]


def test_yaml_exponent_without_dot_is_a_float():
    assert load_yaml_text("actor:\n  optim:\n    lr: 1e-6\n").actor.optim.lr == 1e-6


def test_int_is_accepted_for_float():
    cfg = load_yaml_text("actor:\n  optim:\n    lr: 1\n")
    assert cfg.actor.optim.lr == 1.0 and isinstance(cfg.actor.optim.lr, float)


def test_lists_fill_tuples():
    cfg = load_yaml_text("profile:\n  ranks: [0, 1]\nactor:\n  optim:\n    betas: [0.8, 0.9]\n")
    assert cfg.profile.ranks == (0, 1)
    assert cfg.actor.optim.betas == (0.8, 0.9)


def test_bool_is_rejected_for_int():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("trainer:\n  total_steps: true\n")
    assert "integer" in the_error(exc, "trainer.total_steps").message


def test_wrong_list_item_names_its_index():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("profile:\n  ranks: [0, 1, x]\n")
    assert exc.value.path == "profile.ranks[2]"


def test_fixed_length_tuple_checks_length():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("actor:\n  optim:\n    betas: [0.9]\n")
    assert exc.value.path == "actor.optim.betas"


def test_unknown_key_gets_did_you_mean():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("actor:\n  optim:\n    lrr: 1e-6\n")
    issue = the_error(exc, "actor.optim.lrr")
    assert issue.rule == "unknown-key" and "actor.optim.lr" in issue.fix


def test_key_in_wrong_section_points_to_the_right_one():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("actor:\n  lr: 1e-6\n")
    assert "actor.optim.lr" in the_error(exc, "actor.lr").fix


def test_field_of_another_section_is_suggested_over_a_near_name():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("data:\n  max_response_length: 8\n")
    assert "rollout.max_response_length" in the_error(exc, "data.max_response_length").fix


def test_literal_lists_allowed_values_and_suggests():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("algorithm:\n  adv_estimator: grp\n")
    issue = the_error(exc, "algorithm.adv_estimator")
    assert "did you mean `grpo`" in issue.fix and "reinforce_plus_plus" in issue.fix


def test_null_for_required_field():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("trainer:\n  total_steps: null\n")
    assert exc.value.path == "trainer.total_steps"


def test_nan_is_rejected():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("actor:\n  optim:\n    lr: .nan\n")
    assert exc.value.path == "actor.optim.lr"


def test_section_must_be_a_mapping():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("actor: 3\n")
    assert exc.value.path == "actor"


def test_all_structural_errors_are_reported_together():
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("actor:\n  optim:\n    lrr: 1\n  ppo_epochs: x\nrollout:\n  engine: vllmm\n")
    assert set(exc.value.paths) == {"actor.optim.lrr", "actor.ppo_epochs", "rollout.engine"}


def test_yaml_syntax_error_names_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("actor:\n  optim: [1,\n")
    with pytest.raises(ConfigError) as exc:
        read_config_file(f)
    assert "line" in exc.value.errors[0].message and exc.value.source == str(f)


def test_missing_file():
    with pytest.raises(ConfigError) as exc:
        read_config_file("/nonexistent/run.yaml")
    assert "does not exist" in exc.value.errors[0].message


def test_json_file(tmp_path):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"preset": "tiny-grpo", "actor": {"optim": {"lr": 2e-3}}}))
    cfg = load_config(f, presets=PRESETS)
    assert cfg.actor.optim.lr == 2e-3 and cfg.trainer.output_dir == "outputs/tiny-grpo"


def test_file_preset_overlays_preset(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("preset: tiny-ppo\ncritic:\n  optim:\n    lr: 5e-4\n")
    cfg = load_config(f, presets=PRESETS)
    base = get_preset("tiny-ppo")
    assert cfg.critic.optim.lr == 5e-4
    assert cfg.critic.enable and cfg.algorithm == base.algorithm  # everything else from the preset


def test_unknown_preset_suggests(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("preset: tiny-grp\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f, presets=PRESETS)
    assert exc.value.path == "preset" and "tiny-grpo" in exc.value.errors[0].fix


def test_preset_conflict_between_file_and_command(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("preset: tiny-ppo\n")
    with pytest.raises(ConfigError) as exc:
        resolve_config(f, preset="tiny-grpo")
    assert exc.value.errors[0].rule == "preset-conflict"


def test_precedence_overrides_over_file_over_preset(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("actor:\n  optim:\n    lr: 5e-4\n    min_lr: 1e-5\n")
    cfg = load_config(f, preset="tiny-grpo", overrides=["actor.optim.lr=2e-4"], presets=PRESETS)
    assert cfg.actor.optim.lr == 2e-4  # override beats file
    assert cfg.actor.optim.min_lr == 1e-5  # file beats preset
    assert cfg.trainer.output_dir == "outputs/tiny-grpo"  # preset beats defaults


def test_override_parsing():
    data = apply_overrides({}, ["profile.ranks=[0, 1]", "trainer.experiment_name=123", "model.path=null"])
    assert data == {
        "profile": {"ranks": [0, 1]},
        "trainer": {"experiment_name": "123"},
        "model": {"path": None},
    }


def test_override_through_a_value_is_an_error():
    with pytest.raises(ConfigError) as exc:
        load_config(None, preset="tiny-grpo", overrides=["actor.ppo_epochs.x=1"], presets=PRESETS)
    assert exc.value.path == "actor.ppo_epochs"


def test_override_syntax_error():
    with pytest.raises(ConfigError) as exc:
        apply_overrides({}, ["actor.optim.lr"])
    assert exc.value.errors[0].rule == "override-syntax"


def test_dump_then_load_is_identity_for_presets():
    for name in ("tiny-grpo", "tiny-ppo", "qwen2.5-7b-grpo-tp4pp2"):
        cfg = get_preset(name)
        assert load_yaml_text(dump_yaml(config_to_dict(cfg))) == cfg


def test_strings_that_look_like_numbers_survive_yaml():
    cfg = config_from_dict({"trainer": {"experiment_name": "1e5"}})
    assert load_yaml_text(dump_yaml(config_to_dict(cfg))).trainer.experiment_name == "1e5"
