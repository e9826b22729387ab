"""PEFT adapter folders <-> the engine's LoRA adapters (rltrain/megatron/lora.py).

A PEFT LoRA folder is `adapter_config.json` + `adapter_model.safetensors` with keys such as
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); `peft.PeftModel.from_pretrained(base, folder)` loads it on the base model. `save_peft_adapter`
gathers each adapter over TP (B by rows on column-parallel linears, A by columns on row-parallel ones) and
writes the folder (collective: every rank calls it; pipeline stages send their layers to rank 0);
`load_peft_adapter` reads one (actor.lora.adapter_path) into this rank's shards. safetensors and JSON only:
nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from safetensors.torch import load_file, save_file

from rlconf.arch import ModelArch
from rlconf.lora import HF_PARENT, LoraPlan
from rltrain.megatron.lora import adapted_linears

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 20


class AdapterError(ValueError):
    """An adapter folder that does not fit this run's actor.lora (message names the file and the fix)."""


def peft_key(layer: int, linear: str, part: str, factor: str) -> str:
    """PEFT's name of one adapter factor (factor: lora_A or lora_B)."""
    return f"{PREFIX}model.layers.{layer}.{HF_PARENT[linear]}.{part}.{factor}.weight"


def _gather(param: torch.Tensor, dim: int) -> torch.Tensor:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    data = param.detach().contiguous()
    if tp == 1:
        return data.cpu()
    parts = [torch.empty_like(data) for _ in range(tp)]
    torch.distributed.all_gather(parts, data, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim).cpu()


def adapter_tensors(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapters as whole (TP-gathered) tensors under PEFT's names (collective over TP)."""
    out: dict[str, torch.Tensor] = {}
    for layer, linear_name, linear in adapted_linears(chunks):
        column = linear._lora.column
        for part in linear._lora.parts:
            a, b = linear.lora_A[part], linear.lora_B[part]
            out[peft_key(layer, linear_name, part, "lora_A")] = a.detach().cpu() if column else _gather(a, 1)
            out[peft_key(layer, linear_name, part, "lora_B")] = _gather(b, 0) if column else b.detach().cpu()
    return out


def adapter_config(plan: LoraPlan, base_model: str | None, num_layers: int) -> dict[str, Any]:
    """adapter_config.json of these adapters (PEFT LoraConfig fields)."""
    per_layer: dict[int, set[str]] = {}
    for m in plan.modules:
        per_layer.setdefault(m.layer, set()).update(m.parts)
    uniform = len(per_layer) == num_layers and len({frozenset(v) for v in per_layer.values()}) == 1
    if uniform:
        targets: list[str] = sorted(plan.hf_targets)
    else:  # excluded modules: name each adapted module (PEFT matches a target as a module-name suffix)
        targets = sorted(m.hf_path(p) for m in plan.modules for p in m.parts)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": plan.rank,
        "lora_alpha": plan.alpha,
        "lora_dropout": plan.dropout,
        "target_modules": targets,
        "layers_to_transform": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "revision": None,
    }


def save_peft_adapter(
    chunks: Sequence[torch.nn.Module],
    plan: LoraPlan,
    arch: ModelArch,
    out_dir: str | os.PathLike,
    base_model: str | None,
) -> None:
    """Write a PEFT adapter folder of these adapters (collective: every rank calls it)."""
    tensors = adapter_tensors(chunks)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:
        gathered: list[Any] = [None] * pp
        torch.distributed.all_gather_object(
            gathered, tensors, group=parallel_state.get_pipeline_model_parallel_group()
        )
        tensors = {k: v for part in gathered for k, v in part.items()}
    if torch.distributed.get_rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS), metadata={"format": "pt"}
        )
        with open(out / CONFIG, "w") as f:
            json.dump(adapter_config(plan, base_model, arch.num_layers), f, indent=2)
    torch.distributed.barrier()


def read_adapter_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise AdapterError(
            f"actor.lora.adapter_path: {path} does not exist; point it at a PEFT adapter folder"
        )
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(
            f"actor.lora.adapter_path: {path} is over {MAX_CONFIG_BYTES} bytes; not an adapter config"
        )
    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        raise AdapterError(f"actor.lora.adapter_path: {path} is not a LoRA adapter config (peft_type LORA)")
    return raw


@torch.no_grad()
def load_peft_adapter(
    chunks: Sequence[torch.nn.Module], plan: LoraPlan, arch: ModelArch, folder: str | os.PathLike
) -> None:
    """Copy a PEFT adapter folder into this rank's adapters; its rank, alpha and adapted modules must be
    this run's (actor.lora)."""
    raw = read_adapter_config(folder)
    if raw.get("r") != plan.rank or float(raw.get("lora_alpha", -1)) != float(plan.alpha):
        raise AdapterError(
            f"actor.lora.adapter_path: {folder} has r {raw.get('r')}, lora_alpha {raw.get('lora_alpha')}; this "
            f"run has rank {plan.rank}, alpha {plan.alpha:g}: set actor.lora.rank / alpha to the adapter's"
        )
    weights = Path(folder) / WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"actor.lora.adapter_path: {weights} does not exist")
    tensors = load_file(str(weights))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    expected = {
        peft_key(m.layer, m.linear, p, f) for m in plan.modules for p in m.parts for f in ("lora_A", "lora_B")
    }
    extra = sorted(set(tensors) - expected)
    if extra:
        raise AdapterError(
            f"actor.lora.adapter_path: {weights} adapts modules this run does not ({extra[0]}, ... {len(extra)} "
            "in all): set actor.lora.target_modules / exclude_modules to the adapter's"
        )
    for layer, linear_name, linear in adapted_linears(chunks):
        column = linear._lora.column
        for part in linear._lora.parts:
            for factor, param in (("lora_A", linear.lora_A[part]), ("lora_B", linear.lora_B[part])):
                key = peft_key(layer, linear_name, part, factor)
                if key not in tensors:
                    raise AdapterError(
                        f"actor.lora.adapter_path: {weights} has no {key}: the adapter does not cover "
                        "actor.lora.target_modules; set them to the adapter's"
                    )
                full = tensors[key]
                split_dim = (
                    0
                    if (column and factor == "lora_B")
                    else 1
                    if (not column and factor == "lora_A")
                    else None
                )
                local = full.chunk(tp, dim=split_dim)[rank] if split_dim is not None and tp > 1 else full
                if local.shape != param.shape:
                    raise AdapterError(
                        f"actor.lora.adapter_path: {key} is {tuple(full.shape)}, this model expects "
                        f"{tuple(param.shape)} on each of {tp} TP ranks"
                    )
                param.data.copy_(local.to(param.dtype))
