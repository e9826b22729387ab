"""The run's random streams: (seed, step, purpose) -> seed, and trainer.seed reaching every None seed."""

from __future__ import annotations

import pytest

from presets import get_preset
from rlconf.config import RLConfig
from rlconf.fields import replace_paths
from rlconf.plan import compile_plan
from rlconf.seeding import derive_seed, run_seed


def test_derive_seed_is_a_fixed_63_bit_function_of_its_key():
    # A constant: the streams of a run must not change between Python versions, machines or processes
    # (hash() is salted per process; this is not).
    assert derive_seed(1, 5, "rollout") == derive_seed(1, 5, "rollout") == 1149630429065747455
    seeds = {
        derive_seed(s, t, p) for s in (1, 2) for t in range(50) for p in ("rollout", "validate/0", "dropout")
    }
    assert len(seeds) == 2 * 50 * 3  # every key its own stream
    assert all(0 <= s < 2**63 for s in seeds)


def test_trainer_seed_reaches_every_seed_left_none_in_the_plan():
    config = replace_paths(get_preset("tiny-ppo"), {"trainer.seed": 1234})
    plan = compile_plan(config)
    assert plan.engine("actor").settings.seed == plan.engine("ref").settings.seed == 1234
    assert plan.engine("critic").settings.seed == plan.data.seed == 1234
    explicit = compile_plan(replace_paths(config, {"actor.megatron.seed": 5, "data.seed": 6}))
    assert (
        explicit.engine("actor").settings.seed,
        explicit.data.seed,
        explicit.engine("critic").settings.seed,
    ) == (
        5,
        6,
        1234,
    )


def test_engines_outside_a_run_use_the_default_trainer_seed():
    assert run_seed(None) == RLConfig().trainer.seed and run_seed(9) == 9
    assert compile_plan(RLConfig()).engine("actor").settings.seed == run_seed(None)


@pytest.mark.parametrize("seed", [0, -3, 2**62])
def test_any_integer_seed_gives_a_valid_stream(seed):
    assert 0 <= derive_seed(seed, 0, "shuffle") < 2**63
