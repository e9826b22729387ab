"""The one reader of Hugging Face config.json: a model folder -> `ModelArch` (and back, for exports).

Pure standard library, like all of rlconf: the plan compiler, `rlconf validate` and the megatron engine's
weight import / export (rltrain.megatron.hf_weights) all read a folder through `read_model_arch`, so they
cannot disagree about what a config.json means.

Families (`FAMILIES`, rlconf.model_families): llama (Llama 3 / 3.1 / 3.2), mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral,
deepseek_v3 (DeepSeek-V3, Moonlight-16B-A3B, Kimi-K2: multi-head latent attention, sigmoid group-limited
routing with an expert-score bias, shared experts, first_k_dense_replace dense layers, YaRN with mscale; read,
planned, trained and exported where megatron-core computes what transformers does: `training_gaps` names the
rest).
A key missing from config.json takes the default of that family's transformers config class (e.g. a
missing tie_word_embeddings is false for every family here, a missing Qwen3 head_dim is 128), because that
is what transformers builds from the same file. Everything else, and every feature of a supported family
that rlplan cannot build (vision towers, multi-token prediction, linear attention, MLA, quantized weights,
rope types other than linear / llama3 / yarn, ...), is a ConfigError with rule `model-unsupported` that
names the config path, the model_type and the feature: a model is never silently reduced to a smaller one.

Both json styles are read as transformers 5 reads them (PreTrainedConfig.__post_init__, each family's config
class and modeling code): `rope_scaling` (transformers 4) before `rope_parameters` (5), the rope object's own
rope_theta before the top-level `rope_theta`; per-layer attention from `layer_types` where the family's class
has it, else the family's rule (`Family.windows`); `hidden_act: swish` is SiLU. Where a file holds two forms
of one thing that disagree (the two rope objects, the two thetas, num_experts / num_local_experts, a
`layer_types` the family ignores), the reader refuses it (rule `model-config-json`, naming both keys) rather
than pick one. tests/test_hf_config_json.py checks every case against transformers itself.

Writing (`hf_config`) is the inverse for exports: the source's own config.json back (only its dtype key
rewritten, in the source's style) when it describes the trained model, else a complete transformers 5 file.

Parameter counts (`count_parameters`, rlconf.model_count) are re-exported here: the plan reports them (total and, for MoE, active
per token) and sizes its memory estimate with the same per-layer pieces.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

from rlconf.config import ModelArch, RopeScaling
from rlconf.errors import ConfigError, error
from rlconf.files import MAX_MODEL_CONFIG_BYTES, read_json
from rlconf.model_count import (
    LayerParams,
    count_parameters,
    head_dim,
    is_moe_layer,
    kv_cache_width,
    layer_params,
    num_moe_layers,
)
from rlconf.model_families import FAMILIES, KNOWN_UNSUPPORTED, ROPE_TYPES, SUPPORTED, Family

MAX_SIZE = 1 << 40
"""Bound on any size read from config.json (absurd values become errors, not hours of arithmetic)."""
MAX_LAYERS = 1 << 16
UNSUPPORTED_RULE = "model-unsupported"
READ_RULE = "model-config-json"


# ============================================================================================ reading
def read_model_arch(folder: str, path: str = "model.path") -> ModelArch:
    """The architecture of a local Hugging Face model folder, from its config.json.

    `path` is the config path errors name (model.path, critic.model_path, reward.reward_model.path).
    Raises ConfigError: rule `model-config-json` when the file is missing, unreadable or lacks a field,
    rule `model-unsupported` when it describes a model or feature rlplan cannot build.
    """
    cfg_file = os.path.join(folder, "config.json")
    if not os.path.lexists(cfg_file):
        fix = f"point {path} at a local Hugging Face model folder that contains config.json"
        if path == "model.path":
            fix += ", or set model.path: null to build model.arch"
        raise ConfigError([error(path, f"{cfg_file} does not exist", fix, READ_RULE)])
    # Bounded: a symlink to /dev/zero, a FIFO or a 1 GB file is an error, not the machine's memory.
    raw = read_json(cfg_file, MAX_MODEL_CONFIG_BYTES, key=path, what=f"config.json of {path}", rule=READ_RULE)
    return arch_from_config(raw, cfg_file, path)


def arch_from_config(raw: object, source: str, path: str = "model.path") -> ModelArch:
    """The architecture a parsed config.json describes; `source` names the file in messages."""
    return _Reader(raw, source, path).arch()


class _Reader:
    """One config.json being read: typed getters with the family's defaults and errors naming `path`."""

    def __init__(self, raw: object, source: str, path: str) -> None:
        self.source, self.path = source, path
        if not isinstance(raw, dict):
            raise self.fail("is not a JSON object", "use the config.json written by transformers")
        self.raw: dict[str, Any] = raw
        model_type = raw.get("model_type")
        self.model_type = model_type if isinstance(model_type, str) else None

    # ---------------------------------------------------------------------------------- errors
    def fail(self, message: str, fix: str, rule: str = READ_RULE) -> ConfigError:
        return ConfigError([error(self.path, f"{self.source} {message}", fix, rule)])

    def unsupported(self, feature: str) -> ConfigError:
        return self.fail(
            f"(model_type {self.model_type!r}) has {feature}, which rlplan cannot build",
            f"use a model of a supported family ({SUPPORTED}) without it; rlplan never trains a reduced "
            "version of a model",
            UNSUPPORTED_RULE,
        )

    # ---------------------------------------------------------------------------------- typed access
    def present(self, key: str) -> bool:
        return key in self.raw and self.raw[key] is not None

    def value(self, key: str) -> Any:
        # transformers builds a missing key from its class default; so does this reader.
        return self.raw[key] if key in self.raw else self.family.defaults.get(key)

    def size(self, key: str, *, required: bool = False) -> int | None:
        if required and key not in self.raw:
            raise self.fail(f"lacks {key}", f"use the config.json of a decoder-only model ({SUPPORTED})")
        v = self.value(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE:
            raise self.fail(f": {key} must be a positive integer, got {v!r}", "fix config.json")
        return v

    def sized(self, key: str) -> int:
        """A size transformers' class defaults when the key is missing (Family.defaults) and refuses null."""
        v = self.size(key)
        if v is None:
            raise self.fail(f": {key} is null, which transformers cannot build for model_type {self.model_type!r}",
                            f"set {key} to an integer in config.json (or remove the key)")  # fmt: skip
        return v

    def need(self, key: str) -> int:
        v = self.size(key, required=True)
        assert v is not None
        return v

    def number(
        self, key: str, mapping: Mapping[str, Any] | None = None, default: float | None = None
    ) -> float:
        src = self.raw if mapping is None else mapping
        v = src.get(key, self.family.defaults.get(key) if mapping is None else default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(f": {key} must be a number, got {v!r}", "fix config.json")
        return float(v)

    def flag(self, key: str) -> bool:
        v = self.value(key)
        if not isinstance(v, bool):
            raise self.fail(f": {key} must be true or false, got {v!r}", "fix config.json")
        return v

    # ---------------------------------------------------------------------------------- the model
    def arch(self) -> ModelArch:
        mt = self.model_type
        if mt is None:
            raise self.fail("has no model_type", f"use the config.json written by transformers ({SUPPORTED})")
        if mt in KNOWN_UNSUPPORTED:
            raise self.unsupported(KNOWN_UNSUPPORTED[mt])
        if mt not in FAMILIES:
            raise self.fail(
                f"has model_type {mt!r}, which rlplan does not support",
                f"use a model of a supported family: {SUPPORTED}",
                UNSUPPORTED_RULE,
            )
        self.family = FAMILIES[mt]
        self._reject_features()
        if mt == "deepseek_v3":
            return self._deepseek_v3()
        heads = self.need("num_attention_heads")
        hidden = self.need("hidden_size")
        for key in ("num_key_value_heads", "head_dim"):
            if key in self.raw and self.raw[key] is None and key not in self.family.derives:
                # transformers derives these from null only in some families; elsewhere its config class
                # refuses the null or its model fails to build.
                raise self.fail(f": {key} is null, which transformers cannot build for model_type {self.model_type!r}",
                                f"set {key} to an integer in config.json (or remove the key)")  # fmt: skip
        groups = self.size("num_key_value_heads") or heads
        head_dim = self.size("head_dim")
        if heads % groups:
            raise self.fail(
                f": num_attention_heads = {heads} is not a multiple of num_key_value_heads = {groups}",
                "fix config.json (grouped-query attention needs whole groups)",
            )
        if head_dim is None and hidden % heads:
            raise self.fail(
                f": hidden_size = {hidden} is not divisible by num_attention_heads = {heads} and no head_dim "
                "is given",
                "add head_dim to config.json",
            )
        num_layers = self.need("num_hidden_layers")
        if num_layers > MAX_LAYERS:
            raise self.fail(
                f": num_hidden_layers = {num_layers} is more than {MAX_LAYERS}", "fix config.json"
            )
        max_pos = self.need("max_position_embeddings")
        rope = self._rope()
        qkv_bias = self.family.qkv_bias if self.family.qkv_bias is not None else self.flag("qkv_bias")
        return ModelArch(
            family=mt,  # type: ignore[arg-type]
            num_layers=num_layers,
            hidden_size=hidden,
            ffn_hidden_size=self.need("intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=groups,
            vocab_size=self.need("vocab_size"),
            max_position_embeddings=max_pos,
            kv_channels=None if head_dim is None or head_dim * heads == hidden else head_dim,
            rotary_base=self._rope_theta(rope),
            norm_epsilon=self.number("rms_norm_eps"),
            add_qkv_bias=qkv_bias,
            share_embeddings_and_output_weights=self.flag("tie_word_embeddings"),
            qk_layernorm=self.family.qk_layernorm,
            rope_scaling=self._rope_scaling(rope),
            sliding_window=self._sliding_window(num_layers),
            **self._moe(num_layers),
        )

    def _reject_features(self) -> None:
        raw = self.raw
        for key in ("vision_config", "text_config", "audio_config"):
            if key in raw:
                raise self.unsupported(f"{key} (a multimodal model)")
        mtp = raw.get("num_nextn_predict_layers") or raw.get("mtp_num_hidden_layers")
        if mtp and self.family.model_type != "deepseek_v3":  # deepseek_v3: read into num_mtp_layers
            raise self.unsupported(f"multi-token prediction layers (num_nextn_predict_layers = {mtp})")
        if self.present("quantization_config"):
            method = raw["quantization_config"]
            method = method.get("quant_method", "?") if isinstance(method, dict) else method
            raise self.unsupported(f"quantized weights (quantization_config: {method})")
        if self.value("hidden_act") not in ("silu", "swish"):  # transformers' ACT2FN: both are SiLU
            raise self.unsupported(
                f"hidden_act {self.value('hidden_act')!r} (rlplan builds SwiGLU with silu / swish)"
            )
        if self.family.model_type == "llama" and self.flag("mlp_bias"):
            raise self.unsupported("mlp_bias (biases on the MLP projections)")
        if (
            self.family.qkv_bias is False
            and "attention_bias" in self.family.defaults
            and self.flag("attention_bias")
        ):
            raise self.unsupported("attention_bias (biases on q/k/v and the output projection)")
        if self.family.model_type == "mixtral" and self.number("router_jitter_noise") != 0.0:
            raise self.unsupported("router_jitter_noise (random router noise)")
        types = raw.get("layer_types")
        if isinstance(types, list):
            known = (
                "full_attention",
                "sliding_attention",
                "attention",
            )  # "attention": transformers' old name
            other = sorted({t for t in types if t not in known}, key=str)
            if other:
                raise self.unsupported(f"layer_types {other} (attention other than full / sliding window)")

    # ---------------------------------------------------------------------------------- RoPE
    def _rope_object(self, key: str) -> dict[str, Any] | None:
        v = self.raw.get(key)
        if v is not None and not isinstance(v, dict):
            raise self.fail(f": {key} must be an object, got {v!r}", "fix config.json")
        return v

    def _resolved_rope(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """`params` as transformers completes it (PreTrainedConfig.convert_rope_params_to_dict and
        standardize_rope_params): rope_type from `type`, rope_theta from the top-level key, else the class
        default; partial_rotary_factor likewise; llama3 / yarn's original context from max_position_embeddings."""
        out = dict(params)
        kind = out.pop("type", None)
        out.setdefault("rope_type", kind if kind is not None else "default")
        out.setdefault("rope_theta", self.raw.get("rope_theta", self.family.defaults["rope_theta"]))
        if self.raw.get("partial_rotary_factor") is not None:
            out.setdefault("partial_rotary_factor", self.raw["partial_rotary_factor"])
        if out["rope_type"] in ("llama3", "yarn"):
            out.setdefault("original_max_position_embeddings", self.raw.get("max_position_embeddings"))
        return out

    def _rope(self) -> dict[str, Any]:
        """The RoPE parameters transformers builds: `rope_scaling` (v4 style) when it is a non-empty object,
        else `rope_parameters` (v5 style), with rope_theta from inside that object before the top-level
        `rope_theta`. Two forms that say different things are refused: a later edit of the key transformers
        does not read would otherwise silently change nothing, or change rlplan's reading only."""
        scaling, params = self._rope_object("rope_scaling"), self._rope_object("rope_parameters")
        chosen, name = (scaling, "rope_scaling") if scaling else (params or {}, "rope_parameters")
        if scaling and params and self._resolved_rope(scaling) != self._resolved_rope(params):
            raise self.fail(
                f": rope_scaling {scaling!r} and rope_parameters {params!r} describe different RoPE "
                "(transformers reads rope_scaling and ignores rope_parameters)",
                "keep one of rope_scaling / rope_parameters in config.json, or make them agree",
            )
        if self.family.layer_types and any(k in chosen for k in ("full_attention", "sliding_attention")):
            raise self.unsupported(f"{name} per layer type (different RoPE for full and sliding layers)")
        top = self.raw.get("rope_theta")
        if "rope_theta" in self.raw and "rope_theta" in chosen and top != chosen["rope_theta"]:
            raise self.fail(
                f": rope_theta = {top!r} and {name}.rope_theta = {chosen['rope_theta']!r} disagree "
                f"(transformers uses {name}.rope_theta)",
                f"keep one of rope_theta / {name}.rope_theta in config.json, or make them equal",
            )
        return self._resolved_rope(chosen)

    def _rope_theta(self, rope: Mapping[str, Any]) -> float:
        return self.number("rope_theta", rope)

    def _rope_scaling(self, params: Mapping[str, Any]) -> RopeScaling:
        kind = params["rope_type"]
        if kind not in ROPE_TYPES:
            raise self.unsupported(f"rope scaling {kind!r} (supported: linear, llama3, yarn)")
        if self.number("partial_rotary_factor", params, 1.0) != 1.0:
            raise self.unsupported("partial_rotary_factor (RoPE on part of each head)")
        if ROPE_TYPES[kind] == "none":
            return RopeScaling()
        deepseek = self.family.model_type == "deepseek_v3"  # DeepSeek's YaRN attention factor
        for extra in ("mscale", "mscale_all_dim", "attention_factor", "truncate"):
            if params.get(extra) is not None and not (
                deepseek and kind == "yarn" and extra.startswith("mscale")
            ):
                raise self.unsupported(f"rope scaling {kind!r} with {extra}")
        # transformers refuses (KeyError) a rope type without its required keys rather than default them.
        required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                    "yarn": ("factor",)}[kind]  # fmt: skip
        missing = [k for k in required if k not in params]
        if missing:
            raise self.fail(f": rope scaling {kind!r} lacks {', '.join(missing)}",
                            f"add {', '.join(missing)} to the rope parameters in config.json")  # fmt: skip
        orig = params.get("original_max_position_embeddings")
        if orig is not None and (isinstance(orig, bool) or not isinstance(orig, int) or orig < 1):
            raise self.fail(f": original_max_position_embeddings must be a positive integer, got {orig!r}",
                            "fix config.json")  # fmt: skip
        scaling = RopeScaling(
            type=ROPE_TYPES[kind],
            factor=self.number("factor", params, 1.0),
            low_freq_factor=self.number("low_freq_factor", params, 1.0),
            high_freq_factor=self.number("high_freq_factor", params, 4.0),
            original_max_position_embeddings=orig,
            beta_fast=self.number("beta_fast", params, 32.0),
            beta_slow=self.number("beta_slow", params, 1.0),
            mscale=self.number("mscale", params) if params.get("mscale") is not None else None,
            mscale_all_dim=(
                self.number("mscale_all_dim", params) if params.get("mscale_all_dim") is not None else None
            ),
        )
        if scaling.factor <= 0 or (
            scaling.type == "llama3" and scaling.high_freq_factor <= scaling.low_freq_factor
        ):
            raise self.fail(f": rope scaling {params!r} has a non-positive factor or high_freq_factor <= "
                            "low_freq_factor", "fix config.json")  # fmt: skip
        return scaling

    # ---------------------------------------------------------------------------------- attention windows
    def _window(self) -> int | None:
        """The window a sliding layer uses: the config class's sliding_window after its __post_init__
        (cleared without use_sliding_window; qwen2_moe sets 0, which masks every key)."""
        f = self.family
        if f.windows == "none":
            return None
        if "use_sliding_window" in f.defaults and not self.flag("use_sliding_window"):
            return 0 if f.model_type == "qwen2_moe" else None
        v = self.value("sliding_window")
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > MAX_SIZE:
            raise self.fail(f": sliding_window must be a non-negative integer or null, got {v!r}",
                            "fix config.json")  # fmt: skip
        return v

    def _layer_types(self, num_layers: int) -> list[str] | None:
        types = self.raw.get("layer_types")
        if types is None:
            return None
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise self.fail(f": layer_types must be a list of strings, got {types!r}", "fix config.json")
        types = [{"attention": "full_attention"}.get(t, t) for t in types]  # transformers' legacy name
        if len(types) != num_layers:
            raise self.fail(f": layer_types has {len(types)} entries for num_hidden_layers = {num_layers}",
                            "give one layer type per layer")  # fmt: skip
        return types

    def _sliding_window(self, num_layers: int) -> int | None:
        """The attention window of the layers that slide (None: every layer attends fully), with each layer's
        kind decided as transformers decides it: `layer_types` first where the family's config class has it,
        else the family's rule (Family.windows)."""
        f, window = self.family, self._window()
        declared = self._layer_types(num_layers)
        if f.windows == "none":
            rule = [False] * num_layers
        elif f.windows == "all":
            rule = [window is not None] * num_layers
        else:
            first = self.value("max_window_layers")
            if isinstance(first, bool) or not isinstance(first, int):
                raise self.fail(f": max_window_layers must be an integer, got {first!r}", "fix config.json")
            if f.windows == "from_max_window_layers":
                rule = [window is not None and i >= first for i in range(num_layers)]
            else:  # qwen2_moe: Qwen2MoeConfig.__post_init__
                rule = [bool((i + 1) % 2) and i < first and self.flag("use_sliding_window")
                        for i in range(num_layers)]  # fmt: skip
        if declared is not None and f.layer_types:
            slides = [t == "sliding_attention" for t in declared]
        else:
            slides = rule
            if declared is not None and [t == "sliding_attention" for t in declared] != rule:
                # transformers ignores layer_types for this family: a list that says otherwise misleads.
                raise self.fail(
                    f": layer_types {declared} disagrees with the attention transformers builds for "
                    f"model_type {self.model_type!r}, which ignores layer_types (sliding_window = {window})",
                    "remove layer_types from config.json, or set sliding_window to the window you mean",
                )
        if not any(slides):
            return None
        if window is None or window == 0:
            keys = "use_sliding_window / sliding_window"
            raise self.fail(
                f": layers {[i for i, s in enumerate(slides) if s]} are sliding_attention but the window is "
                f"{window!r} ({keys}): transformers cannot build that mask",
                "set use_sliding_window: true and a sliding_window in config.json, or mark those layers "
                "full_attention in layer_types",
            )
        return window

    def _deepseek_v3(self) -> ModelArch:
        """DeepseekV3Config and DeepseekV3ForCausalLM's reading: MLA widths, routing, dense first layers.
        Keys DeepSeek's own files carry that transformers ignores (it always builds sigmoid scores, the
        noaux_tc bias and experts in every layer from first_k_dense_replace on) are refused when they say
        otherwise, so a file never means two models."""
        for key, built in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
            if key in self.raw and self.raw[key] != built:
                raise self.fail(
                    f": {key} = {self.raw[key]!r}, but transformers' DeepseekV3 ignores {key} and builds "
                    f"{built!r}: the file describes a model transformers does not build",
                    f"set {key}: {built!r} or remove it (a DeepSeek-V2-style model is not deepseek_v3)",
                )
        heads, hidden = self.need("num_attention_heads"), self.need("hidden_size")
        num_layers = self.need("num_hidden_layers")
        if num_layers > MAX_LAYERS:
            raise self.fail(
                f": num_hidden_layers = {num_layers} is more than {MAX_LAYERS}", "fix config.json"
            )
        nope, rope_dim, v = (self.sized(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        if rope_dim % 2:
            raise self.fail(f": qk_rope_head_dim = {rope_dim} is odd (RoPE rotates pairs)", "fix config.json")
        experts, topk = self.sized("n_routed_experts"), self.sized("num_experts_per_tok")
        groups, group_topk = self.sized("n_group"), self.sized("topk_group")
        if experts % groups or group_topk > groups or experts // groups < 2:
            raise self.fail(
                f": n_routed_experts = {experts}, n_group = {groups}, topk_group = {group_topk}: transformers "
                "scores each group by its best two experts, so n_group must divide the experts into groups of "
                "at least 2 and topk_group <= n_group",
                "fix config.json",
            )
        if topk > group_topk * (experts // groups):
            raise self.fail(f": num_experts_per_tok = {topk} is more than the {group_topk} x "
                            f"{experts // groups} experts of the chosen groups", "fix config.json")  # fmt: skip
        dense = self.value("first_k_dense_replace")
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
            raise self.fail(f": first_k_dense_replace must be a non-negative integer, got {dense!r}",
                            "fix config.json")  # fmt: skip
        shared = self.value("n_shared_experts")
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise self.fail(
                f": n_shared_experts must be a non-negative integer, got {shared!r}", "fix config.json"
            )
        mtp = self.value("num_nextn_predict_layers")
        if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
            raise self.fail(f": num_nextn_predict_layers must be a non-negative integer, got {mtp!r}",
                            "fix config.json")  # fmt: skip
        moe_width = self.sized("moe_intermediate_size")
        rope = self._rope()
        scaling = self.number("routed_scaling_factor")
        return ModelArch(
            family="deepseek_v3",
            num_layers=num_layers,
            hidden_size=hidden,
            ffn_hidden_size=self.sized("intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=heads,  # MLA: every head has its own key / value, expanded from the latent
            vocab_size=self.sized("vocab_size"),
            max_position_embeddings=self.sized("max_position_embeddings"),
            kv_channels=nope + rope_dim,
            rotary_base=self._rope_theta(rope),
            norm_epsilon=self.number("rms_norm_eps"),
            add_qkv_bias=False,
            share_embeddings_and_output_weights=self.flag("tie_word_embeddings"),
            qk_layernorm=False,
            rope_scaling=self._rope_scaling(rope),
            num_moe_experts=experts,
            moe_router_topk=topk,
            moe_ffn_hidden_size=moe_width,
            moe_shared_expert_intermediate_size=shared * moe_width if shared else None,
            moe_norm_topk_prob=self.flag("norm_topk_prob"),
            moe_dense_layers=tuple(range(min(dense, num_layers))),
            multi_latent_attention=True,
            q_lora_rank=self.size("q_lora_rank"),
            kv_lora_rank=self.sized("kv_lora_rank"),
            qk_head_dim=nope,
            qk_pos_emb_head_dim=rope_dim,
            v_head_dim=v,
            rotary_interleaved=self.flag("rope_interleave"),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=groups,
            moe_router_group_topk=group_topk,
            moe_router_topk_scaling_factor=scaling,
            num_mtp_layers=mtp,
        )

    def _moe(self, num_layers: int) -> dict[str, Any]:
        if not self.family.moe:
            return {}
        mixtral = self.family.model_type == "mixtral"
        experts_key = "num_local_experts" if mixtral else "num_experts"
        # transformers: MixtralConfig and Qwen3MoeConfig map one name onto the other (attribute_map; the
        # key set last, the mapped one, wins); Qwen2MoeConfig reads num_experts only.
        alias = {"mixtral": "num_experts", "qwen3_moe": "num_local_experts"}.get(self.family.model_type)
        both = [k for k in ("num_experts", "num_local_experts") if k in self.raw]
        if len(both) == 2 and self.raw["num_experts"] != self.raw["num_local_experts"]:
            used = alias if alias is not None else experts_key
            raise self.fail(
                f": num_experts = {self.raw['num_experts']!r} and num_local_experts = "
                f"{self.raw['num_local_experts']!r} disagree (transformers uses {used} for model_type "
                f"{self.model_type!r})",
                "keep one of num_experts / num_local_experts in config.json, or make them equal",
            )
        experts = self.size(alias) if alias is not None and alias in self.raw else self.size(experts_key)
        if experts is None:
            raise self.fail(f"lacks {experts_key}", "fix config.json")
        topk = self.size("num_experts_per_tok")
        if topk is None or topk > experts:
            raise self.fail(
                f": num_experts_per_tok = {topk} must be between 1 and {experts}", "fix config.json"
            )
        norm = True if mixtral else self.flag("norm_topk_prob")
        if topk == 1 and norm:
            # HF weighs the one expert by p / p = 1. megatron-core refuses top-1 without its pre-softmax
            # router, which weighs by p: not the same model, so rlplan does not build it.
            if mixtral:
                key, fix = "num_experts_per_tok: 1 (Mixtral always renormalises)", ""
            else:
                key = "num_experts_per_tok: 1 with norm_topk_prob: true"
                fix = ", or norm_topk_prob: false (weight p, as megatron builds it) if that is the model you mean"
            raise self.fail(
                f"(model_type {self.model_type!r}) routes each token to one expert and renormalises its weight "
                f"to 1 ({key}); megatron-core builds top-1 routing only with weight p, which rlplan cannot build "
                "as transformers does",
                "use a model with num_experts_per_tok >= 2" + fix,
                UNSUPPORTED_RULE,
            )
        dense: tuple[int, ...] = ()
        if not mixtral:
            step = self.size("decoder_sparse_step")
            if step is None:  # transformers' class takes no null here
                raise self.fail(": decoder_sparse_step is null", "set decoder_sparse_step (1: every layer)")
            only = self.value("mlp_only_layers") or []
            if not isinstance(only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in only
            ):
                raise self.fail(
                    f": mlp_only_layers must be a list of layer numbers, got {only!r}", "fix config.json"
                )
            # transformers: layer i has experts iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
            dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
        shared = (
            self.size("shared_expert_intermediate_size") if self.family.model_type == "qwen2_moe" else None
        )
        return {
            "num_moe_experts": experts,
            "moe_router_topk": topk,
            "moe_ffn_hidden_size": None if mixtral else self.size("moe_intermediate_size"),
            "moe_shared_expert_intermediate_size": shared,
            "moe_shared_expert_gate": shared is not None,
            "moe_norm_topk_prob": norm,
            "moe_dense_layers": dense,
            "moe_aux_loss_coeff": self.number("router_aux_loss_coef"),
        }


# ============================================================================================ writing
# Keys the reader interprets (and the dtype keys): a fresh config.json written from a ModelArch replaces them
# all, so none of a mismatched base's survives beside the new ones.
_ARCH_KEYS = frozenset({
    "architectures", "model_type", "hidden_act", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
    "rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "attention_bias", "mlp_bias", "qkv_bias", "use_sliding_window", "sliding_window",
    "max_window_layers", "layer_types", "num_experts", "num_local_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "router_aux_loss_coef", "router_jitter_noise", "dtype", "torch_dtype",
    "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "first_k_dense_replace",
    "rope_interleave", "num_nextn_predict_layers", "scoring_func", "topk_method", "moe_layer_freq", "qk_head_dim",
})  # fmt: skip


def hf_config(arch: ModelArch, dtype: str, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json of `arch` for transformers, with weights of `dtype`.

    `base` is the source folder's config.json. When it reads back to `arch` (the model was trained from it;
    training changes no architecture) the export is that file itself, its own keys and values kept (the rope
    form, layer_types, max_window_layers, decoder_sparse_step, a null head_dim, ...): only the dtype key is
    rewritten, in the source's own style (`dtype`, or `torch_dtype` for a file that has only that). Otherwise
    (no base, or one that describes another model) a complete transformers 5 style config.json is written from
    `arch`, keeping only the base's keys the reader does not interpret (token ids and the like)."""
    if base is not None:
        try:
            same = arch_from_config(dict(base), "base config.json") == arch
        except ConfigError:
            same = False
        if same:
            cfg = deepcopy(dict(base))
            key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
            cfg.pop("torch_dtype", None)
            cfg[key] = dtype
            cfg.setdefault("architectures", [FAMILIES[arch.family].hf_architecture])
            return cfg
    kept = {k: v for k, v in (base or {}).items() if k not in _ARCH_KEYS}
    return {**kept, **_fresh_config(arch, dtype)}


def _fresh_config(arch: ModelArch, dtype: str) -> dict[str, Any]:
    """A transformers 5 config.json (rope_parameters, layer_types, dtype) of `arch`: the keys of its family's
    config class, each written once."""
    family = FAMILIES[arch.family]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": arch.rotary_base}
    rs = arch.rope_scaling
    if rs.type != "none":
        rope.update(rope_type=rs.type, factor=rs.factor)
        if rs.type in ("llama3", "yarn"):
            rope["original_max_position_embeddings"] = (
                rs.original_max_position_embeddings or arch.max_position_embeddings
            )
        if rs.type == "llama3":
            rope.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
        if rs.type == "yarn":
            rope.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow)
            rope.update({k: v for k, v in (("mscale", rs.mscale), ("mscale_all_dim", rs.mscale_all_dim))
                         if v is not None})  # fmt: skip
    cfg: dict[str, Any] = {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "hidden_act": "silu",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups,
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.norm_epsilon,
        "tie_word_embeddings": arch.share_embeddings_and_output_weights,
        "rope_parameters": rope,
        "dtype": dtype,
    }
    if arch.multi_latent_attention:
        return {**cfg, **_deepseek_v3_keys(arch)}
    if "head_dim" in family.defaults or arch.kv_channels is not None:
        # Where the config class has the field (Qwen3's default is 128, not hidden / heads) or the width is
        # not hidden / heads; Qwen2's class derives it. Mixtral keeps a derived width null, as its class does.
        derived = arch.family == "mixtral" and arch.kv_channels is None
        cfg["head_dim"] = None if derived else head_dim(arch)
    if "attention_bias" in family.defaults:
        cfg["attention_bias"] = False
    if family.model_type == "llama":
        cfg["mlp_bias"] = False
    if family.qkv_bias is None:
        cfg["qkv_bias"] = arch.add_qkv_bias
    window = arch.sliding_window
    if "use_sliding_window" in family.defaults:
        cfg["use_sliding_window"] = window is not None
    if family.windows != "none":
        cfg["sliding_window"] = window
    if family.layer_types:
        # A ModelArch's window covers every layer; layer_types says so for every family rule.
        kind = "sliding_attention" if window is not None else "full_attention"
        cfg["layer_types"] = [kind] * arch.num_layers
        if window is not None:
            cfg["max_window_layers"] = 0 if family.windows == "from_max_window_layers" else arch.num_layers
    if family.moe:
        assert arch.num_moe_experts is not None
        cfg["num_experts_per_tok"] = arch.moe_router_topk
        cfg["router_aux_loss_coef"] = arch.moe_aux_loss_coeff
        if family.model_type == "mixtral":
            cfg["num_local_experts"] = arch.num_moe_experts
        else:
            cfg["num_experts"] = arch.num_moe_experts
            cfg["moe_intermediate_size"] = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
            cfg["norm_topk_prob"] = arch.moe_norm_topk_prob
            cfg["decoder_sparse_step"] = 1
            cfg["mlp_only_layers"] = list(arch.moe_dense_layers)
        if arch.moe_shared_expert_intermediate_size is not None:
            cfg["shared_expert_intermediate_size"] = arch.moe_shared_expert_intermediate_size
    return cfg


def _deepseek_v3_keys(arch: ModelArch) -> dict[str, Any]:
    """DeepseekV3Config's own keys of an MLA `arch` (written whole: its class defaults are DeepSeek-V3's)."""
    assert arch.num_moe_experts is not None and arch.moe_ffn_hidden_size is not None
    shared = arch.moe_shared_expert_intermediate_size or 0
    return {
        "num_key_value_heads": arch.num_attention_heads,
        "attention_bias": False,
        "q_lora_rank": arch.q_lora_rank,
        "kv_lora_rank": arch.kv_lora_rank,
        "qk_nope_head_dim": arch.qk_head_dim,
        "qk_rope_head_dim": arch.qk_pos_emb_head_dim,
        "v_head_dim": arch.v_head_dim,
        "rope_interleave": arch.rotary_interleaved,
        "n_routed_experts": arch.num_moe_experts,
        "num_experts_per_tok": arch.moe_router_topk,
        "moe_intermediate_size": arch.moe_ffn_hidden_size,
        "n_shared_experts": shared // arch.moe_ffn_hidden_size,
        "n_group": arch.moe_router_num_groups or 1,  # None: no groups, which transformers spells 1
        "topk_group": arch.moe_router_group_topk or 1,
        "routed_scaling_factor": arch.moe_router_topk_scaling_factor or 1.0,
        "norm_topk_prob": arch.moe_norm_topk_prob,
        "first_k_dense_replace": len(arch.moe_dense_layers),
        "num_nextn_predict_layers": arch.num_mtp_layers,
    }


# ============================================================================================ checks
def family_issues(arch: ModelArch, prefix: str) -> list[tuple[str, str, str]]:
    """(path, message, fix) for every way `arch` contradicts its family (a built-in `model.arch` can say
    anything; an exported checkpoint must mean the same to transformers)."""
    family = FAMILIES.get(arch.family)
    if family is None:
        return [(f"{prefix}.family", f"unknown family {arch.family!r}", f"use one of {SUPPORTED}")]
    out = []
    if family.qkv_bias is not None and arch.add_qkv_bias != family.qkv_bias:
        fix = "set family: qwen2 (q/k/v biases) or llama (none)"
        out.append((f"{prefix}.add_qkv_bias", f"family {arch.family} {'has' if family.qkv_bias else 'has no'} "
                    f"q/k/v biases, add_qkv_bias = {arch.add_qkv_bias}", fix))  # fmt: skip
    if arch.qk_layernorm != family.qk_layernorm:
        out.append((f"{prefix}.qk_layernorm", f"family {arch.family} {'has' if family.qk_layernorm else 'has no'} "
                    f"QK-norm, qk_layernorm = {arch.qk_layernorm}",
                    "set qk_layernorm to match, or a family with (qwen3) / without (qwen2, llama) QK-norm"))  # fmt: skip
    if family.moe != (arch.num_moe_experts is not None):
        out.append((f"{prefix}.num_moe_experts", f"family {arch.family} is {'' if family.moe else 'not '}a "
                    f"mixture of experts, num_moe_experts = {arch.num_moe_experts}",
                    "set num_moe_experts (MoE families) or null (dense families), or change family"))  # fmt: skip
    if arch.num_moe_experts is not None and not 1 <= arch.moe_router_topk <= arch.num_moe_experts:
        out.append((f"{prefix}.moe_router_topk", f"moe_router_topk = {arch.moe_router_topk} is not between 1 "
                    f"and num_moe_experts = {arch.num_moe_experts}", "fix moe_router_topk"))  # fmt: skip
    if arch.num_moe_experts is not None and arch.moe_router_topk == 1 and arch.moe_norm_topk_prob:
        out.append((f"{prefix}.moe_router_topk", "top-1 routing renormalised to weight 1 (moe_norm_topk_prob) is "
                    "not built: megatron-core routes top-1 only with weight p",
                    "use moe_router_topk >= 2, or moe_norm_topk_prob: false"))  # fmt: skip
    if (arch.family == "deepseek_v3") != arch.multi_latent_attention:
        out.append((f"{prefix}.multi_latent_attention", f"family {arch.family} "
                    f"{'has' if arch.family == 'deepseek_v3' else 'has no'} multi-head latent attention, "
                    f"multi_latent_attention = {arch.multi_latent_attention}",
                    "set family: deepseek_v3 with multi_latent_attention: true, or neither"))  # fmt: skip
    if arch.multi_latent_attention and arch.moe_dense_layers != tuple(range(len(arch.moe_dense_layers))):
        out.append((f"{prefix}.moe_dense_layers", "deepseek_v3 has dense layers only first "
                    f"(first_k_dense_replace), moe_dense_layers = {list(arch.moe_dense_layers)}",
                    "list the layers 0 .. k-1"))  # fmt: skip
    if any(not 0 <= i < arch.num_layers for i in arch.moe_dense_layers):
        out.append((f"{prefix}.moe_dense_layers", f"layers {list(arch.moe_dense_layers)} are not all in "
                    f"[0, {arch.num_layers})", "list 0-based layer numbers"))  # fmt: skip
    return out


def engine_gaps(arch: ModelArch) -> list[tuple[str, str]]:
    """(ModelArch field, message) for each feature of `arch` that the plan accepts but the megatron engine
    does not build yet; rlconf.validate's engine-support rule turns them into errors before a run starts."""
    gaps = []
    # MLA: megatron's own YarnRotaryEmbedding, which computes DeepSeek's YaRN as transformers does
    # (tests/megatron/test_mla_parity.py, mscale != mscale_all_dim).
    if arch.rope_scaling.type == "yarn" and not arch.multi_latent_attention:
        gaps.append(("rope_scaling.type", "YaRN rope scaling is not built in the megatron engine yet"))
    return gaps


def training_gaps(arch: ModelArch, from_folder: bool = False) -> list[tuple[str, str]]:
    """(ModelArch field, message naming the config.json key) for each feature of `arch` that the plan reads,
    counts and sizes but the megatron engine cannot train as transformers computes it: `rlconf plan` shows
    such a model, `rltrain` refuses it at start (rltrain.preflight.check_engine, rule model-engine-support)
    before anything is written, never a different model trained in its place.

    deepseek_v3 trains on megatron-core 0.16.1's MLA and router (rltrain.megatron.mla, mla.deepseek_routing)
    where they compute transformers' DeepseekV3 exactly. They do not (moe_utils.topk_routing_with_score_function
    / group_limited_topk, rope_utils._apply_rotary_pos_emb_bshd) when sigmoid top-k weights are not
    renormalised (megatron always renormalises for k > 1 and never for k = 1), when a group is scored by other
    than its top 2 experts (megatron sums its top topk / topk_group), or with non-interleaved rope dims
    (megatron's MLA always de-interleaves them).

    Multi-token prediction layers (num_nextn_predict_layers) are not trained (transformers does not build
    them either): a model read from a folder (`from_folder`) keeps them as the folder holds them, and its
    exports copy them back unchanged (rltrain.megatron.hf_weights.export_hf_weights `mtp_source`); a built-in
    `model.arch` has no such weights to keep, so it is refused."""
    gaps = []
    if arch.multi_latent_attention:
        if arch.moe_router_topk > 1 and not arch.moe_norm_topk_prob:
            gaps.append(("moe_norm_topk_prob", "norm_topk_prob: false with sigmoid routing: megatron-core always "
                         "renormalises sigmoid top-k weights to sum to 1, transformers does not here"))  # fmt: skip
        if arch.moe_router_topk == 1 and arch.moe_norm_topk_prob:
            gaps.append(("moe_norm_topk_prob", "num_experts_per_tok: 1 with norm_topk_prob: true: transformers "
                         "weighs the one expert 1, megatron-core by its sigmoid score"))  # fmt: skip
        groups, group_topk = arch.moe_router_num_groups or 1, arch.moe_router_group_topk or 1
        if groups > 1 and arch.moe_router_topk // group_topk != 2:
            gaps.append(("moe_router_group_topk", f"group-limited routing with num_experts_per_tok / topk_group = "
                         f"{arch.moe_router_topk} / {group_topk}: megatron-core scores each group by its top "
                         f"{arch.moe_router_topk // group_topk} experts, transformers by its top 2 (n_group > 1 "
                         "needs num_experts_per_tok = 2 x topk_group)"))  # fmt: skip
        if not arch.rotary_interleaved:
            gaps.append(("rotary_interleaved", "rope_interleave: false: megatron-core's multi-head latent "
                         "attention always rotates the rope dims de-interleaved (transformers' rope_interleave: "
                         "true)"))  # fmt: skip
    if arch.num_mtp_layers and not from_folder:
        gaps.append(("num_mtp_layers", f"{arch.num_mtp_layers} multi-token prediction layer(s) "
                     "(num_nextn_predict_layers) in a built-in model.arch: rlplan does not build or train them "
                     "(transformers does not either) and has no weights of theirs to export"))  # fmt: skip
    return gaps


def expert_layout_issues(
    arch: ModelArch,
    source: str,
    ep: int,
    etp: int,
    tp: int = 1,
    sequence_parallel: bool = True,
    overlap_param_gather: bool = False,
) -> list[tuple[str, str, str]]:
    """(megatron field, message, fix) for each way expert parallel size `ep` and expert tensor parallel size
    `etp` cannot split `arch`'s experts (`source` names where the architecture comes from), for MoE
    training at tensor parallel size `tp` > 1 without sequence parallel (megatron-core refuses it), and for
    MoE training with the distributed optimizer's overlapped parameter all-gather (`overlap_param_gather`,
    as the plan would run it): megatron waits for a gathered weight only in the forward pre-hook of the
    module that owns it, and rlplan's MoE layers (grouped-GEMM experts, the rollout engine's static MoE
    layers) read the experts' weights without calling those modules, so they could read weights whose
    all-gather has not landed."""
    if arch.num_moe_experts is None:
        if ep > 1:
            return [("expert_model_parallel_size", f"expert parallel needs mixture-of-experts layers, and "
                     f"{source} is a dense {arch.family} model", "use expert_model_parallel_size: 1")]  # fmt: skip
        return []
    out = []
    if arch.num_moe_experts % ep:
        out.append(("expert_model_parallel_size", f"num_moe_experts = {arch.num_moe_experts} ({source}) is not "
                    f"divisible by expert_model_parallel_size = {ep}",
                    "choose an expert parallel size that divides the number of experts"))  # fmt: skip
    width = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
    if width % etp:
        out.append(("expert_tensor_parallel_size", f"the expert width {width} ({source}) is not divisible by "
                    f"expert tensor parallel size {etp}",
                    "choose an expert_tensor_parallel_size that divides it (1 keeps experts whole)"))  # fmt: skip
    if tp > 1 and not sequence_parallel:
        out.append(("sequence_parallel", f"{source} is a mixture of experts and tensor parallel size is {tp}: "
                    "megatron-core trains MoE layers with tensor parallel only with sequence parallel",
                    "set sequence_parallel: true"))  # fmt: skip
    if overlap_param_gather:
        out.append(("override_ddp_config.overlap_param_gather", f"{source} is a mixture of experts: rlplan's MoE "
                    "layers read the expert weights directly, and megatron's overlapped parameter all-gather "
                    "waits for a weight only when the module that owns it runs, so experts could read weights "
                    "before their all-gather lands", "set override_ddp_config.overlap_param_gather: false"))  # fmt: skip
    return out


__all__ = [
    "FAMILIES",
    "MAX_LAYERS",
    "MAX_SIZE",
    "READ_RULE",
    "SUPPORTED",
    "UNSUPPORTED_RULE",
    "Family",
    "LayerParams",
    "arch_from_config",
    "count_parameters",
    "engine_gaps",
    "expert_layout_issues",
    "family_issues",
    "head_dim",
    "hf_config",
    "is_moe_layer",
    "kv_cache_width",
    "layer_params",
    "num_moe_layers",
    "read_model_arch",
    "training_gaps",
]
