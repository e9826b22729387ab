"""Settings a run does not read are not offered: actor.strategy is gone (megatron is the one engine), and the
rollout fields only the vLLM adapter reads say so when the embedded engine would ignore them."""

from __future__ import annotations

import pytest

from presets import PRESETS
from rlconf.errors import ConfigError
from rlconf.load import load_config, resolve_config
from rlconf.validate import check_config
from rlconf.verl import translate


def _warnings(*overrides: str) -> dict[str, str]:
    # resolve_config: no rules run yet, so a machine without vLLM still shows the warnings of a vllm config.
    config = resolve_config(None, preset="tiny-grpo", overrides=list(overrides), presets=PRESETS)
    return {i.path: i.fix for i in check_config(config) if i.severity == "warning"}


def test_actor_strategy_is_not_a_setting():
    with pytest.raises(ConfigError) as exc:
        load_config({"actor": {"strategy": "megatron"}})
    assert exc.value.path == "actor.strategy"


@pytest.mark.parametrize(
    "override",
    ["rollout.gpu_memory_utilization=0.9", "rollout.max_num_seqs=64", "rollout.free_cache_engine=false"],
)
def test_vllm_only_rollout_fields_warn_under_the_embedded_engine(override):
    path = override.partition("=")[0]
    warned = _warnings(override)
    assert path in warned and "rollout.engine: vllm" in warned[path]
    # The same value under vLLM is read by the adapter: no warning.
    assert path not in _warnings(override, "rollout.engine=vllm", "cluster.device=cuda")


def test_defaults_do_not_warn():
    assert not any(p.startswith("rollout.") for p in _warnings())


def test_verl_strategy_is_not_needed():
    tr = translate(None, ["actor_rollout_ref.actor.strategy=megatron"])
    (row,) = [u for u in tr.unmapped if u.verl == "actor_rollout_ref.actor.strategy"]
    assert row.reason == "not-needed" and "megatron" in row.note


def test_verl_default_notes_state_rlplans_current_defaults():
    """Every `(rlplan's: X)` in the verl table's notes is the dataclass default of the row's rlplan path
    (generated, so a changed default cannot leave a stale note)."""
    import re

    from rlconf.config import RLConfig
    from rlconf.fields import get_path
    from rlconf.verl import VERL_KEYS
    from rlconf.verl.table import _note_value

    checked = 0
    for row in VERL_KEYS:
        for said in re.findall(r"\(rlplan's: ([^)]*)\)", row.note):
            assert row.rlplan is not None, row.verl
            assert said == _note_value(get_path(RLConfig(), row.rlplan)), row.verl
            checked += 1
    assert checked >= 10
