"""Typed Python presets: complete, validated configs that users start from (`rltrain PRESET`).

Presets derive from each other with `replace_paths` (dataclasses.replace on dotted paths), so each one
states only what differs from its parent. `rlconf diff preset:A preset:B` shows those differences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from presets import gpu, tiny
from rlconf.config import RLConfig


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: Callable[[], RLConfig]


_ALL = (
    Preset(
        "tiny-grpo",
        "CPU, built-in 2-layer model, synthetic counting task, GRPO (the README's main job)",
        tiny.tiny_grpo,
    ),
    Preset(
        "tiny-ppo",
        "CPU, the tiny-grpo model and task with PPO: GAE, a critic, KL in the reward",
        tiny.tiny_ppo,
    ),
    Preset(
        "tiny-dapo",
        "CPU, the tiny-grpo model and task with DAPO: clip-higher, dynamic sampling, overlong penalty",
        tiny.tiny_dapo,
    ),
    Preset(
        "tiny-grpo-moe",
        "CPU, tiny-grpo with a tiny Qwen3-MoE-shaped model (4 experts, top-2) over two workers, EP=2",
        tiny.tiny_grpo_moe,
    ),
    Preset(
        "tiny-grpo-mla",
        "CPU, tiny-grpo with a tiny DeepSeek-V3-shaped model: multi-head latent attention, 8 sigmoid-routed "
        "experts in 4 groups, a shared expert",
        tiny.tiny_grpo_mla,
    ),
    Preset(
        "tiny-tool",
        "CPU, the tiny model learns to call a calculator tool (multi-turn agent loop, masked observations)",
        tiny.tiny_tool,
    ),
    Preset("qwen2.5-0.5b-grpo", "1 GPU, Qwen2.5-0.5B shape, GRPO with KL loss, bf16", gpu.qwen25_05b_grpo),
    Preset(
        "qwen2.5-0.5b-dapo",
        "1 GPU, Qwen2.5-0.5B shape, DAPO: clip-higher, dynamic sampling, overlong penalty, bf16",
        gpu.qwen25_05b_dapo,
    ),
    Preset(
        "qwen2.5-0.5b-tool",
        "1 GPU, Qwen2.5-0.5B shape, multi-turn GRPO with the calculator tool (mul task)",
        gpu.qwen25_05b_tool,
    ),
    Preset("qwen2.5-1.5b-grpo", "1 GPU, Qwen2.5-1.5B shape, GRPO with KL loss, bf16", gpu.qwen25_15b_grpo),
    Preset(
        "qwen2.5-1.5b-ppo-tp2", "2 GPUs, Qwen2.5-1.5B shape, PPO with a critic, TP=2", gpu.qwen25_15b_ppo_tp2
    ),
    Preset(
        "qwen3-moe-grpo",
        "1 H200, Qwen3-MoE shape (~2.9B, 64 experts, top 8), GRPO with KL loss, grouped-GEMM experts, bf16",
        gpu.qwen3_moe_grpo,
    ),
    Preset(
        "qwen2.5-7b-grpo-tp4pp2", "8 GPUs, Qwen2.5-7B shape, GRPO, TP=4 x PP=2", gpu.qwen25_7b_grpo_tp4pp2
    ),
)
PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}


def get_preset(name: str) -> RLConfig:
    """The config of a preset by name (KeyError for an unknown name; the loaders turn that into a ConfigError)."""
    return PRESETS[name].build()
