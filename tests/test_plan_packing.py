"""model.use_remove_padding is decided in the plan: each megatron role's `EngineSettings.remove_padding` says
whether its log-prob / value / update passes run packed (THD) micro-batches, with the reason; `rlconf plan`
prints it; true where a role cannot pack is a named error, null falls back to padded rows and says why."""

from __future__ import annotations

import pytest

from rlconf.cli import main as rlconf
from rlconf.errors import ConfigError
from rlconf.fields import replace_paths
from rlconf.plan import compile_plan
from rlconf.validate import check_config


def _preset(name: str, **updates):
    from presets import get_preset

    return replace_paths(get_preset(name), updates)


def _layouts(cfg) -> dict[str, tuple[bool, str]]:
    plan = compile_plan(cfg)
    return {s.role: (s.remove_padding, s.remove_padding_reason) for s in plan.engines}


def test_null_packs_where_supported():
    layouts = _layouts(_preset("tiny-ppo"))
    packed = {role: packed for role, (packed, _) in layouts.items()}
    assert packed == {"actor": True, "ref": True, "critic": True, "rollout": False}
    assert (
        layouts["rollout"][1]
        == "model.use_remove_padding null: a generation engine (no micro-batched passes)"
    )
    assert layouts["actor"][1] == "model.use_remove_padding null: supported here"
    gpu = _layouts(_preset("qwen2.5-1.5b-grpo"))
    assert gpu["actor"][0] and gpu["ref"][0]


@pytest.mark.parametrize(
    ("updates", "why"),
    [
        ({"model.attention_backend": "local"}, "megatron's unfused attention has no packed-sequence path"),
        ({"actor.megatron.context_parallel_size": 2, "ref.megatron.context_parallel_size": 2,
          "cluster.gpus_per_node": 2}, "context parallel"),
        ({"actor.megatron.pipeline_model_parallel_size": 2, "actor.megatron.virtual_pipeline_model_parallel_size": 2,
          "model.arch.num_layers": 4, "cluster.gpus_per_node": 2}, "virtual pipeline parallel"),
    ],
    ids=["local_attention", "context_parallel", "virtual_pipeline_parallel"],
)  # fmt: skip
def test_null_falls_back_to_padded_and_says_why_true_is_refused(updates, why):
    cfg = _preset("tiny-grpo", **updates)
    packed, reason = _layouts(cfg)["actor"]
    assert not packed and reason.startswith("model.use_remove_padding null: ") and why in reason
    strict = replace_paths(cfg, {"model.use_remove_padding": True})
    issues = [
        i for i in check_config(strict) if i.path == "model.use_remove_padding" and i.severity == "error"
    ]
    assert len(issues) == 1 and issues[0].rule == "model-source" and why in issues[0].message
    assert "model.use_remove_padding: null" in issues[0].fix
    with pytest.raises(ConfigError) as err:
        compile_plan(strict)
    assert "model.use_remove_padding" in err.value.paths


def test_moe_packs_unless_routing_is_replayed_and_mla_runs_padded():
    """Mixture-of-experts models pack (the router's padding mask covers the packed padding), except the actor
    with routing replay (its recorded routes follow padded rows); MLA models run padded. `true` there is
    refused by validation and by the plan."""
    moe = _preset("tiny-grpo-moe")
    assert _layouts(moe)["actor"] == (True, "model.use_remove_padding null: supported here")
    for cfg, why in (
        (replace_paths(moe, {"actor.router_replay": True}), "actor.router_replay"),
        (_preset("tiny-grpo-mla"), "multi-head latent attention"),
    ):
        packed, reason = _layouts(cfg)["actor"]
        assert not packed and why in reason
        strict = replace_paths(cfg, {"model.use_remove_padding": True})
        assert [i.rule for i in check_config(strict) if i.path == "model.use_remove_padding"] == [
            "model-source"
        ]
        with pytest.raises(ConfigError) as err:
            compile_plan(strict)
        assert err.value.errors[0].rule == "model-source"


def test_pipeline_parallel_packs():
    """Pipeline stages pass each packed micro-batch's activations on (tests/megatron/test_packing.py)."""
    cfg = _preset(
        "tiny-grpo", **{"actor.megatron.pipeline_model_parallel_size": 2, "cluster.gpus_per_node": 2}
    )
    assert _layouts(cfg)["actor"] == (True, "model.use_remove_padding null: supported here")


def test_false_pads_everywhere():
    layouts = _layouts(_preset("tiny-ppo", **{"model.use_remove_padding": False}))
    assert layouts == {
        r: (False, "model.use_remove_padding false") for r in ("actor", "ref", "critic", "rollout")
    }


def test_plan_text_names_the_layout(capsys):
    assert rlconf(["plan", "--preset", "qwen2.5-1.5b-grpo"]) == 0
    text = capsys.readouterr().out
    assert (
        "sequences: actor, ref packed (THD, no padding): model.use_remove_padding null: supported here"
        in text
    )
    assert rlconf(["plan", "--preset", "tiny-grpo-mla"]) == 0
    text = capsys.readouterr().out
    assert "sequences: actor padded: model.use_remove_padding null: multi-head latent attention" in text
