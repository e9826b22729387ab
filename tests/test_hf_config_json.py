"""rlconf.model_spec reads config.json as transformers does: a table of tiny config.json files, each written by
transformers' own config classes (`save_pretrained`) for every supported family, in both json styles
(transformers 5: `rope_parameters`, `layer_types`, `dtype`; 4: `rope_scaling`, top-level `rope_theta`,
`torch_dtype`) and with the quirks real checkpoints carry. What each file means is read back from
transformers itself (its config object and the model it builds; the attention window from the logits that
model computes), never from rlplan's reading; rlplan must either read the same model or refuse the file
with a named error (rule model-config-json / model-unsupported, `rlconf validate` exit 2 naming model.path).
The export half: `hf_config` writes the source's own config.json back (only its dtype key rewritten).
Log-probs against transformers on these folders: tests/megatron/test_hf_differential.py."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlconf.errors import ConfigError
from rlconf.model_spec import FAMILIES, head_dim, hf_config, read_model_arch

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
# (config class, its arguments beyond TINY) per family; every family rlplan supports.
FAMILY_ARGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                     "shared_expert_intermediate_size": 24}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}  # fmt: skip
WINDOW = 8
"""The sliding window of the windowed cases (shorter than PROBE_LEN, so transformers' logits show it)."""
PROBE_LEN = 20


def test_every_supported_family_is_in_the_table():
    assert set(FAMILY_ARGS) | {"deepseek_v3"} == set(FAMILIES)  # MLA: tests/test_deepseek_v3_config.py


def saved_config(family: str, **changes: Any) -> dict[str, Any]:
    """The config.json transformers writes for a tiny model of `family` built with `changes`."""
    import tempfile

    cls, extra = FAMILY_ARGS[family]
    cfg = getattr(transformers, cls)(**{**TINY, **extra, **changes})
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


def v4_style(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same config.json as transformers 4 wrote it: rope_theta at the top, rope_scaling (null for plain
    RoPE), torch_dtype, no layer_types."""
    out = copy.deepcopy(cfg)
    rope = out.pop("rope_parameters")
    out["rope_theta"] = rope.pop("rope_theta")
    out["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    out.pop("layer_types", None)
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    return out


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    json: dict[str, Any]
    refused_naming: tuple[str, ...] = ()
    """Refused cases: config.json keys the error must name (empty: rlplan reads the same model)."""
    rule: str = "model-config-json"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _cases() -> list[Case]:
    cases: list[Case] = []
    for family in FAMILY_ARGS:
        v5 = saved_config(family)
        cases += [Case("v5", family, v5), Case("v4", family, v4_style(v5))]
        # Both rope forms, agreeing: transformers reads rope_scaling / rope_parameters.rope_theta, same model.
        both = {**v5, "rope_theta": v5["rope_parameters"]["rope_theta"],
                "rope_scaling": dict(v5["rope_parameters"])}  # fmt: skip
        cases.append(Case("both-rope-forms-agree", family, both))
        # Top-level rope_theta 1e6 beside rope_parameters' 1e4: transformers uses 1e4 (the issue's case).
        theta = {**v5, "rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
        cases.append(
            Case("rope-theta-disagrees", family, theta, ("rope_theta", "rope_parameters.rope_theta"))
        )
        # rope_scaling linear beside rope_parameters default: transformers uses rope_scaling.
        scal = {**v5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
        cases.append(Case("rope-forms-disagree", family, scal, ("rope_scaling", "rope_parameters")))
        cases.append(Case("swish", family, {**v5, "hidden_act": "swish"}))
        cases.append(Case("linear-rope-v4", family, v4_style(saved_config(
            family, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}))))  # fmt: skip
    # Llama 3.1 rope scaling, both styles, and a llama3 block without its required keys (transformers: KeyError).
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 5e5}  # fmt: skip
    llama3 = saved_config("llama", rope_parameters=l3)
    cases += [Case("llama3-v5", "llama", llama3), Case("llama3-v4", "llama", v4_style(llama3))]
    short = {**v4_style(llama3), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    cases.append(Case("llama3-missing-keys", "llama", short, ("low_freq_factor", "high_freq_factor")))
    # Sliding windows, each family's own way.
    for family in ("qwen2", "qwen3"):
        win = dict(use_sliding_window=True, sliding_window=WINDOW)
        cases.append(Case("window-max-window-layers-v4", family,
                          v4_style(saved_config(family, **win, max_window_layers=1))))  # fmt: skip
        cases.append(Case("window-max-window-layers-all-full", family,
                          v4_style(saved_config(family, **win, max_window_layers=4))))  # fmt: skip
        types = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
        # layer_types first: max_window_layers 4 would slide nothing.
        cases.append(Case("window-layer-types-v5", family,
                          saved_config(family, **win, max_window_layers=4, layer_types=types)))  # fmt: skip
        off = saved_config(family, use_sliding_window=False, layer_types=types)
        cases.append(
            Case("sliding-layer-without-window", family, off, ("use_sliding_window", "sliding_window"))
        )
        cases.append(Case("head-dim-null", family, {**saved_config(family), "head_dim": None}, ("head_dim",)))
        cases.append(
            Case("legacy-layer-type-name", family, {**saved_config(family), "layer_types": ["attention"] * 4})
        )
    odd = saved_config("qwen2_moe", use_sliding_window=True, sliding_window=WINDOW)  # layers 0, 2 slide
    cases += [Case("window-odd-layers-v5", "qwen2_moe", odd), Case("window-odd-layers-v4", "qwen2_moe", v4_style(odd)),
              Case("window-odd-layers-mwl1-v4", "qwen2_moe", v4_style(
                  saved_config("qwen2_moe", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))),
              Case("window-v4", "qwen3_moe", v4_style(
                  saved_config("qwen3_moe", use_sliding_window=True, sliding_window=WINDOW))),
              Case("window", "mistral", saved_config("mistral", sliding_window=WINDOW)),
              Case("window", "mixtral", saved_config("mixtral", sliding_window=WINDOW)),
              Case("head-dim-null", "mixtral", {**saved_config("mixtral"), "head_dim": None}),
              Case("head-dim-null", "qwen2_moe", {**saved_config("qwen2_moe"), "head_dim": None}, ("head_dim",)),
              Case("kv-heads-null", "qwen2_moe", {**saved_config("qwen2_moe"), "num_key_value_heads": None},
                   ("num_key_value_heads",)),
              Case("kv-heads-null", "llama", {**saved_config("llama"), "num_key_value_heads": None})]  # fmt: skip
    # Mixture-of-experts layouts and routing.
    for family in ("qwen2_moe", "qwen3_moe"):
        cases.append(Case("sparse-step-2-mlp-only", family,
                          saved_config(family, decoder_sparse_step=2, mlp_only_layers=[3])))  # fmt: skip
        cases.append(Case("top1-unnormalised", family, saved_config(family, num_experts_per_tok=1)))
        cases.append(Case("top1-renormalised", family,
                          saved_config(family, num_experts_per_tok=1, norm_topk_prob=True),
                          ("num_experts_per_tok", "norm_topk_prob"), "model-unsupported"))  # fmt: skip
        cases.append(Case("experts-keys-disagree", family, {**saved_config(family), "num_experts": 4, "num_local_experts": 2},
                          ("num_experts", "num_local_experts")))  # fmt: skip
    cases.append(Case("top1", "mixtral", saved_config("mixtral", num_experts_per_tok=1), ("num_experts_per_tok",),
                      "model-unsupported"))  # fmt: skip
    return cases


CASES = _cases()


def write(tmp_path: Path, case: Case) -> Path:
    folder = tmp_path / f"{case.family}-{case.name}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(case.json))
    return folder


def hf_window(model, cfg) -> int | None:
    """The shortest attention window any layer of transformers' `model` applies: the first position whose
    logits differ from the same weights with every layer attending fully (None: none within PROBE_LEN)."""
    full_cfg = copy.deepcopy(cfg)
    full_cfg.sliding_window = 10**6
    if getattr(full_cfg, "layer_types", None) is not None:
        full_cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    full = type(model)(full_cfg).eval()
    full.load_state_dict(model.state_dict())
    ids = torch.randint(1, cfg.vocab_size, (1, PROBE_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids).logits - full(ids).logits).abs().amax(-1)[0]
    # Default-init logits move by ~1e-2 once a key leaves the window; the two mask paths agree to ~1e-7.
    moved = (diff > 1e-5).nonzero()
    return int(moved[0]) if len(moved) else None


def hf_facts(folder: Path) -> dict[str, Any]:
    """What transformers builds from `folder`'s config.json, from its config object and model."""
    cfg = transformers.AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    attn = model.model.layers[0].self_attn
    rope = cfg.rope_parameters
    facts = {
        "family": cfg.model_type,
        "layers": len(model.model.layers),
        "head_dim": attn.head_dim,
        "heads": attn.q_proj.out_features // attn.head_dim,
        "groups": attn.k_proj.out_features // attn.head_dim,
        "qkv_bias": attn.q_proj.bias is not None,
        "qk_norm": hasattr(attn, "q_norm"),
        "rope_theta": float(rope["rope_theta"]),
        "rope_type": rope["rope_type"],
        "rope_factor": rope.get("factor"),
        "tie": cfg.tie_word_embeddings,
        "eps": cfg.rms_norm_eps,
        "window": hf_window(model, cfg),
    }
    if rope["rope_type"] == "llama3":
        facts["llama3"] = (rope["low_freq_factor"], rope["high_freq_factor"],
                           rope["original_max_position_embeddings"])  # fmt: skip
    sparse = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    if any(sparse):
        block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
        facts |= {
            "dense_layers": tuple(i for i, s in enumerate(sparse) if not s),
            "experts": block.experts.num_experts,
            "topk": cfg.num_experts_per_tok,
            "norm_topk": getattr(cfg, "norm_topk_prob", True),  # Mixtral always renormalises
            "shared_expert": hasattr(block, "shared_expert"),
        }
    return facts


def rlplan_facts(folder: Path) -> dict[str, Any]:
    a = read_model_arch(str(folder))
    rs = a.rope_scaling
    facts = {
        "family": a.family,
        "layers": a.num_layers,
        "head_dim": head_dim(a),
        "heads": a.num_attention_heads,
        "groups": a.num_query_groups,
        "qkv_bias": a.add_qkv_bias,
        "qk_norm": a.qk_layernorm,
        "rope_theta": a.rotary_base,
        "rope_type": "default" if rs.type == "none" else rs.type,
        "rope_factor": None if rs.type == "none" else rs.factor,
        "tie": a.share_embeddings_and_output_weights,
        "eps": a.norm_epsilon,
        "window": a.sliding_window,
    }
    if rs.type == "llama3":
        facts["llama3"] = (rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings)
    if a.num_moe_experts is not None:
        facts |= {
            "dense_layers": a.moe_dense_layers,
            "experts": a.num_moe_experts,
            "topk": a.moe_router_topk,
            "norm_topk": a.moe_norm_topk_prob,
            "shared_expert": a.moe_shared_expert_intermediate_size is not None,
        }
    return facts


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_rlplan_reads_every_case_as_transformers_builds_it_or_refuses_it(tmp_path: Path):
    """One test over the whole table (~60 tiny transformers models, a few seconds): each accepted case reads
    to the model transformers builds, each refused one names the keys involved."""
    seen_windows, problems = set(), []
    for case in CASES:
        folder = write(tmp_path, case)
        where = f"{case.family} {case.name}"
        if case.refused_naming:
            try:
                read_model_arch(str(folder))
            except ConfigError as exc:
                (issue,) = exc.errors
                named = all(key in issue.message for key in case.refused_naming)
                if (issue.path, issue.rule) != ("model.path", case.rule) or not named or not issue.fix:
                    problems.append(f"{where}: {issue.rule} {issue.path}: {issue.message}")
            else:
                problems.append(f"{where}: accepted, should be refused naming {case.refused_naming}")
            continue
        hf, ours = hf_facts(folder), rlplan_facts(folder)
        if ours != hf:
            problems.append(f"{where}: " + ", ".join(
                f"{k} rlplan {ours.get(k)!r} transformers {hf.get(k)!r}" for k in hf if ours.get(k) != hf[k]))  # fmt: skip
        seen_windows.add((case.family, hf["window"]))
    assert not problems, "\n".join(problems)
    # The table exercises windows that transformers really applies, and configs where it applies none.
    assert {w for _, w in seen_windows} == {None, WINDOW}
    assert ("qwen2_moe", WINDOW) in seen_windows


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_what_rlplan_refuses_transformers_reads_differently_or_cannot_build(tmp_path: Path):
    """The refusals are not arbitrary: for the two-forms cases transformers picks one form (the one the
    familiar key does not say), and for the null / sliding-without-window cases it cannot build the model."""
    theta = next(c for c in CASES if c.name == "rope-theta-disagrees" and c.family == "qwen2")
    assert hf_facts(write(tmp_path, theta))["rope_theta"] == 1e4  # not the top-level 1e6
    forms = next(c for c in CASES if c.name == "rope-forms-disagree" and c.family == "llama")
    assert hf_facts(write(tmp_path, forms))["rope_type"] == "linear"  # rope_scaling wins
    for name, family in (("sliding-layer-without-window", "qwen2"), ("head-dim-null", "qwen3"),
                         ("kv-heads-null", "qwen2_moe")):  # fmt: skip
        case = next(c for c in CASES if (c.name, c.family) == (name, family))
        with pytest.raises(Exception):  # noqa: B017 - transformers' own error, whichever it raises
            hf_facts(write(tmp_path, case))


def model_folder(tmp_path: Path, name: str, cfg: dict[str, Any]) -> Path:
    """A model folder `rlconf validate` reads: config.json and a tokenizer (the built-in one's files)."""
    from rltrain.tokenizer import CharTokenizer

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    CharTokenizer().save_pretrained(folder)
    return folder


def test_validate_refuses_disagreeing_forms_with_exit_2_naming_model_path(tmp_path: Path):
    bad = {
        **saved_config("qwen2"),
        "rope_theta": 1e6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    }
    folder = model_folder(tmp_path, "m", bad)
    run = subprocess.run([sys.executable, "-m", "rlconf.cli", "validate", "--preset", "tiny-grpo", "--set",
                          f"model.path={folder}"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "[model-config-json] model.path" in run.stderr
    assert "rope_theta = 1000000.0 and rope_parameters.rope_theta = 10000.0" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_yarn_is_refused_by_plan_as_by_validate(tmp_path: Path, command: str):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e6}
    folder = model_folder(tmp_path, "yarn", saved_config("qwen2", rope_parameters=rope))
    run = subprocess.run([sys.executable, "-m", "rlconf.cli", command, "--preset", "tiny-grpo", "--set",
                          f"model.path={folder}"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "[model-engine-support] model.path" in run.stderr and "YaRN" in run.stderr


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_builtin_yarn_is_refused_by_plan_as_by_validate(command: str):
    run = subprocess.run([sys.executable, "-m", "rlconf.cli", command, "--preset", "tiny-grpo", "--set",
                          "model.arch.rope_scaling.type=yarn", "--set", "model.arch.rope_scaling.factor=2.0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "[model-engine-support] model.arch.rope_scaling.type" in run.stderr


def test_validate_refuses_top1_renormalised_routing_naming_the_keys(tmp_path: Path):
    folder = model_folder(
        tmp_path, "top1", saved_config("qwen3_moe", num_experts_per_tok=1, norm_topk_prob=True)
    )
    run = subprocess.run([sys.executable, "-m", "rlconf.cli", "validate", "--preset", "tiny-grpo", "--set",
                          f"model.path={folder}"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "[model-unsupported] model.path" in run.stderr
    assert "num_experts_per_tok: 1 with norm_topk_prob: true" in run.stderr


def test_builtin_arch_with_top1_renormalised_routing_is_refused():
    from rlconf.config import ModelArch, ModelConfig, RLConfig
    from rlconf.validate import check_config

    arch = ModelArch(family="qwen3_moe", add_qkv_bias=False, qk_layernorm=True, num_moe_experts=4,
                     moe_router_topk=1, moe_norm_topk_prob=True)  # fmt: skip
    errors = [i for i in check_config(RLConfig(model=ModelConfig(arch=arch))) if i.severity == "error"]
    assert [(i.path, i.rule) for i in errors] == [("model.arch.moe_router_topk", "model-unsupported")]
    unnormalised = ModelConfig(arch=ModelArch(**{**arch.__dict__, "moe_norm_topk_prob": False}))
    assert not [i for i in check_config(RLConfig(model=unnormalised)) if i.severity == "error"]


# ============================================================================================ writing back
@pytest.mark.parametrize(
    "case", [c for c in CASES if not c.refused_naming], ids=lambda c: f"{c.family}-{c.name}"
)
def test_export_config_is_the_source_config_with_its_own_dtype_key(case: Case):
    """hf_config over the source it was read from writes the source back: the same keys and values (rope
    form, layer_types, max_window_layers, decoder_sparse_step, a null head_dim), one dtype key in the
    source's style and nothing stale."""
    from rlconf.model_spec import arch_from_config

    src = {
        **case.json,
        **({"torch_dtype": "bfloat16"} if "rope_scaling" in case.json else {"dtype": "bfloat16"}),
    }
    src.pop("dtype" if "torch_dtype" in src else "torch_dtype", None)
    arch = arch_from_config(src, "config.json")
    out = hf_config(arch, "float32", src)
    key = "torch_dtype" if "torch_dtype" in src else "dtype"
    assert out[key] == "float32" and ({"dtype", "torch_dtype"} - {key}).isdisjoint(out)
    assert {k: v for k, v in out.items() if k != key} == {k: v for k, v in src.items() if k != key} | {
        "architectures": src.get("architectures", [FAMILIES[case.family].hf_architecture])
    }


def test_export_without_a_matching_source_writes_one_consistent_config():
    """A source that no longer describes the trained model (or none at all): a fresh transformers 5
    config.json from the arch, with none of the old architecture keys left beside it."""
    from rlconf.model_spec import arch_from_config

    arch = arch_from_config(v4_style(saved_config("qwen2", use_sliding_window=True, sliding_window=WINDOW,
                                                  max_window_layers=1)), "config.json")  # fmt: skip
    stale = {
        **v4_style(saved_config("qwen2")),
        "torch_dtype": "bfloat16",
        "bos_token_id": 7,
        "hidden_size": 64,
    }
    out = hf_config(arch, "float32", stale)
    assert out["bos_token_id"] == 7 and out["dtype"] == "float32"
    assert not {"torch_dtype", "rope_theta", "rope_scaling"} & set(out)
    assert arch_from_config(out, "exported") == arch
    cfg = transformers.Qwen2Config.from_dict(out)
    assert cfg.layer_types == ["sliding_attention"] * 4 and cfg.sliding_window == WINDOW
