"""The parts of one engine's state a checkpoint holds beside the weights' files: sharded state dicts of the
model and optimizer in the formats that reshard (`model_sharded_state_dict`, `optimizer_sharded_state_dict`),
the optimizer state megatron needs before a first step or a load, and each rank's RNG states (`rng_state`,
`set_rng_state`). Used by rltrain.checkpoint.engine_io (save and load).

Megatron is imported inside the functions: importing this module costs torch only.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from rltrain import device as devices
from rltrain.checkpoint.manifest import CheckpointError

if TYPE_CHECKING:
    from rltrain.megatron.engine import MegatronEngine

# The distributed optimizer's format that reloads under any TP / PP / DP layout (model-space tensors).
OPTIM_SHARDING = "fully_reshardable"


def sub_optimizers(engine: MegatronEngine) -> list[Any]:
    from megatron.core.optimizer import ChainedOptimizer

    opt = engine.optimizer
    if opt is None:
        return []
    return list(opt.chained_optimizers) if isinstance(opt, ChainedOptimizer) else [opt]


def uses_distributed_optimizer(engine: MegatronEngine) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in sub_optimizers(engine))


def optim_metadata() -> dict[str, Any]:
    # fully_reshardable stores optimizer state in model space (one tensor per parameter, like the model's
    # own sharded tensors), so TP / PP / DP changes reshard it exactly as they reshard the weights.
    # mem_efficient gathers the DP shards over gloo into DP rank 0 only; the default all-gathers them into
    # every DP rank's host memory (DP copies of the state on one host) although only DP rank 0 writes them
    # (the model's replica ids decide). Same files, same speed (measured on H200 at DP=1), less memory.
    # avoid_prefix keeps keys independent of how many chained optimizers a layout has.
    return {
        "distrib_optim_sharding_type": OPTIM_SHARDING,
        "distrib_optim_fully_reshardable_mem_efficient": True,
        "chained_optim_avoid_prefix": True,
    }


def adapters_only(engine: MegatronEngine) -> bool:
    """A LoRA engine whose base weights come from a Hugging Face folder saves and loads its adapters only."""
    return getattr(engine, "lora", None) is not None and engine.spec.model.weights is not None


def model_sharded_state_dict(engine: MegatronEngine) -> dict[str, Any]:
    """megatron's convention: "model" for one chunk, "model0", "model1", ... for virtual pipeline chunks."""
    modules = engine.modules()
    sds = [m.sharded_state_dict() for m in modules]
    if adapters_only(engine):
        # LoRA: the adapters are the trained content; the frozen base weights reload from model.path.
        from rltrain.megatron.lora import is_adapter_name

        sds = [{k: v for k, v in sd.items() if is_adapter_name(k)} for sd in sds]
    if len(modules) == 1:
        return {"model": sds[0]}
    return {f"model{i}": sd for i, sd in enumerate(sds)}


def ensure_optimizer_state(engine: MegatronEngine) -> None:
    """Give every parameter of a never-stepped torch Adam/AdamW its state (step 0, zero moments).

    The distributed optimizer's `state_dict()` reads the common `step` from the per-parameter state and
    asserts that one exists; torch creates that state lazily at the first step, so a fresh engine (the
    resume case, or an actor saved before its first update) has none. Zeros at step 0 are exactly what
    torch's first step would create, so this changes no update; a load overwrites them.
    """
    for sub in sub_optimizers(engine):
        inner = sub.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def check_optimizer_supported(engine: MegatronEngine, role: str) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in sub_optimizers(engine):
        if isinstance(sub, DistributedOptimizer) and isinstance(sub.optimizer, torch.optim.SGD):
            # megatron-core 0.16.1 gathers exactly (param, exp_avg, exp_avg_sq) for the distributed
            # optimizer: SGD's momentum_buffer has no place there (KeyError deep inside the save).
            raise CheckpointError(
                f"{role}: megatron-core cannot checkpoint the state of {type(sub.optimizer).__name__} under "
                f"the distributed optimizer; set {role}.megatron.use_distributed_optimizer: false or drop "
                f"optimizer from {role}.checkpoint.save_contents"
            )


def optimizer_sharded_state_dict(engine: MegatronEngine, model_sd: dict[str, Any], loading: bool) -> Any:
    # The optimizer finds its parameters' sharded keys in the model's sharded state dict (every chunk; it
    # walks nested dicts, so the model / model0, model1 nesting does not matter).
    return engine.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=optim_metadata())


@contextlib.contextmanager
def restore_step_per_param(engine: MegatronEngine) -> Iterator[None]:
    """Work around two defects of megatron-core 0.16.1 when it loads torch Adam/AdamW state:

    * `fully_reshardable` load copies every per-parameter state tensor from the checkpoint, but the
      checkpoint (by design) has no per-parameter `step` (it is kept once, in param_groups):
      `KeyError: 'step'` in `_set_main_param_and_optimizer_states`. Here a missing `step` is taken from the
      state the load has just restored from param_groups, i.e. it is left as is.
    * the distributed optimizer's `load_state_dict` gives every parameter the *same* step tensor object;
      torch AdamW increments each parameter's step in place, so one shared tensor advances once per
      parameter per step and bias correction goes wrong after a resume. Each parameter gets its own copy.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = []
    for sub in sub_optimizers(engine):
        if not isinstance(sub, DistributedOptimizer):
            continue
        original = sub._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _sub=sub, _original=original):
            if "step" not in tensors:
                current = _sub._get_main_param_and_optimizer_states(model_param)
                if "step" in current:
                    tensors = {**tensors, "step": current["step"]}
            return _original(model_param, tensors)

        # An instance attribute shadows the method for this load only (removed in `finally`).
        sub._set_main_param_and_optimizer_states = set_states
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states
        for sub in sub_optimizers(engine):
            seen: set[int] = set()
            for state in sub.optimizer.state.values():
                step = state.get("step") if isinstance(state, dict) else None
                if isinstance(step, torch.Tensor):
                    if id(step) in seen:
                        state["step"] = step.clone()
                    seen.add(id(state["step"]))


def fill_missing_common_step(obj: Any) -> None:
    """Put back the step of a never-stepped plain (non-distributed) optimizer before megatron loads it.

    megatron-core 0.16.1 saves the Adam step shared by all parameters only when it is truthy (`if step:` in
    the mixed-precision and fp32 optimizers' `sharded_state_dict`), so a save before the first update (step
    0, from `ensure_optimizer_state`) has per-parameter state without any step, and torch's
    `load_state_dict` fails with `KeyError: 'step'`. Step 0 is exactly what was saved.
    """
    if isinstance(obj, dict):
        state = obj.get("state")
        if isinstance(state, dict) and "param_groups" in obj:
            per_param = [v for k, v in state.items() if k != "common_step" and isinstance(v, dict)]
            if "common_step" not in state and any("step" not in v for v in per_param):
                state["common_step"] = torch.tensor(0.0, dtype=torch.float32)
            return
        for value in obj.values():
            fill_missing_common_step(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            fill_missing_common_step(value)


# ------------------------------------------------------------------------------------ RNG
def rng_state(engine: MegatronEngine) -> dict[str, Any]:
    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = {}
    for name, state in get_cuda_rng_tracker().get_states().items():
        tracker[name] = state.get_state() if isinstance(state, torch.Generator) else state.clone()
    # Tensors and plain Python data only, so that a load needs nothing but torch.load(weights_only=True)
    # (safe_load.py): numpy's key array travels as a tensor.
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "tracker": tracker,
    }
    # The accelerator's generator of the current device, under the device's name ("cuda", "npu").
    if devices.is_accelerator(engine.device) and devices.is_available(engine.device):
        out[engine.device] = devices.get_rng_state(engine.device)
    # The actor's sampler seeds each generate() call from a call counter: part of its random stream.
    if hasattr(engine, "_sample_calls"):
        out["sample_calls"] = int(engine._sample_calls)
    return out


def set_rng_state(engine: MegatronEngine, state: dict[str, Any]) -> None:
    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    # A tensor since RNG files hold only tensors; an ndarray in files of older rlplan versions.
    np.random.set_state((kind, keys.numpy() if isinstance(keys, torch.Tensor) else keys, *rest))
    torch.set_rng_state(state["torch"])
    if (
        engine.device in state
        and devices.is_accelerator(engine.device)
        and devices.is_available(engine.device)
    ):
        devices.set_rng_state(engine.device, state[engine.device])
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    restored = {}
    for name, saved in state["tracker"].items():
        if isinstance(current.get(name), torch.Generator):
            current[name].set_state(saved)
            restored[name] = current[name]
        else:
            restored[name] = saved.clone()
    tracker.set_states(restored)
    if "sample_calls" in state and hasattr(engine, "_sample_calls"):
        engine._sample_calls = int(state["sample_calls"])
