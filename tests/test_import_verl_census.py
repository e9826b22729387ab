"""verl's own 46 launch scripts (bench/verl_scripts.json) through `rlconf import-verl` on stand-in model folders
and verl-format parquet files: none is silently mistranslated (every key mapped or reported, no warning about
a value the import derived, the checked values are the script's, every refusal a named rule at a named
path), and the census recorded for docs/migrating-from-verl.md is today's."""

from __future__ import annotations

import json

import pytest

from bench.verl_scripts_census import RECORD, census, load_scripts, record

# Refusals the census expects, by the reason rlplan cannot run the script (issue 35's list): a change here is a
# behaviour change users see on the migration page.
EXPECTED_REFUSALS = {
    "examples/grpo_trainer/run_qwen2_5_vl-7b-megatron.sh": "model-unsupported",  # vision-language
    "examples/grpo_trainer/run_qwen3_vl-235b-megatron.sh": "model-unsupported",
    "examples/grpo_trainer/run_qwen3_vl-30b-megatron.sh": "model-unsupported",
    "examples/grpo_trainer/run_qwen3_vl-8b-megatron.sh": "model-unsupported",
    "examples/sglang_multiturn/geo3k/run_qwen2.5-3b_megatron_geo3k_multiturn.sh": "model-unsupported",
    "examples/mtp_trainer/test_dapo_mimo_7b_with_mtp_math_megatron.sh": "verl-import",  # MTP heads
    "examples/ppo_trainer/run_moonlight16b_a3b_gsm8k_megatron.sh": "layers-divisible-by-pp",  # megatron rejects
    "examples/router_replay/run_qwen30_a3b_megatron_sglang.sh": "moe",  # R3 into another rollout tp
    "examples/router_replay/run_qwen30_a3b_megatron_vllm.sh": "verl-import",  # R2
    "tests/special_e2e/run_fully_async_policy.sh": "verl-import",  # fully async streaming
    "verl/experimental/fully_async_policy/shell/geo3k_qwen25vl_7b_megatron_4_4.sh": "verl-import",
    "verl/experimental/fully_async_policy/shell/grpo_30b_a3b_base_math_megatron_96_32.sh": "verl-import",
    "verl/experimental/fully_async_policy/shell/grpo_30b_a3b_base_math_megatron_96_32_mis.sh": "verl-import",
}


@pytest.fixture(scope="module")
def outcomes() -> list:
    return census()


def test_the_table_holds_46_distinct_scripts_with_their_overrides() -> None:
    scripts = load_scripts()
    assert len(scripts) == 46 == len({s["script"] for s in scripts})
    for s in scripts:
        assert s["overrides"] and all("=" in o or o.startswith("~") for o in s["overrides"]), s["script"]
        assert any(o.startswith("actor_rollout_ref.model.path={models}/") for o in s["overrides"]), s[
            "script"
        ]


@pytest.mark.slow
def test_no_verl_script_is_silently_mistranslated(outcomes: list) -> None:
    unclean = [o.line() for o in outcomes if not o.clean]
    assert not unclean, "\n".join(unclean)
    refused = {o.script: o.rule for o in outcomes if not o.plans}
    assert refused == EXPECTED_REFUSALS
    for o in outcomes:
        assert o.plans or (o.rule and o.path and o.reason), o.line()


@pytest.mark.slow
def test_planned_deepseek_v3_scripts_are_marked_not_trainable(outcomes: list) -> None:
    marked = {o.script for o in outcomes if o.plans and o.not_trainable}
    assert marked == {
        "examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh",
        "examples/grpo_trainer/run_deepseek671b_math_megatron_96gb.sh",
        "examples/grpo_trainer/run_moonlight16b_math_megatron.sh",
    }


@pytest.mark.slow
def test_the_census_on_the_migration_page_is_todays(outcomes: list) -> None:
    committed = json.loads(RECORD.read_text(encoding="utf-8"))
    assert committed == record(outcomes), (
        "run: python bench/verl_scripts_census.py --write && rlconf docs docs/reference"
    )
