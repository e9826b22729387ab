"""Ops per MoE layer of one static decode call on the CPU (issue 36: the captured MoE decode step is bound
by its kernel count), split into router / dispatch / experts / combine, for the generation glue eager and
compiled and the static decode router off and on (`moe_decode.moe_forward`'s `route`).

What is counted: from torch.profiler, the aten ops that launch work (views, empties and other metadata ops
left out), each once at the top of its nesting (aten::softmax, not also its aten::_softmax), and inside a
compiled region each generated kernel and each extern call: a proxy for the device kernels of the GPU step,
which the GPU benchmark (bench/moe_decode_gpu.py) counts itself.

The layer is qwen3-moe-shaped where the count depends on it (64 experts, top 8, normalised top-k, softmax
router) and tiny elsewhere (hidden 64, expert FFN 32); 32 decode rows (one column of a 32-row batch).

    OMP_NUM_THREADS=1 .venv/bin/python bench/moe_layer_ops.py
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.megatron._common import actor_of, init_groups

# Ops that launch no kernel: views, allocations, metadata.
NO_KERNEL = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::unsqueeze", "aten::squeeze", "aten::expand",
    "aten::t", "aten::transpose", "aten::permute", "aten::select", "aten::slice", "aten::as_strided",
    "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::split", "aten::chunk", "aten::narrow",
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh", "aten::resolve_conj",
    "aten::resolve_neg", "aten::view_as", "aten::contiguous", "aten::unbind", "aten::split_with_sizes",
    "aten::result_type", "aten::is_nonzero", "aten::_has_compatible_shallow_copy_type",
}  # fmt: skip
# Conversions that copy only when the dtype or device changes (then they have a child op, the copy).
CONVERSIONS = {"aten::to", "aten::type_as"}
PHASES = ("router", "dispatch", "experts", "combine")


def _phase(name: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.profiler.record_function(f"phase:{name}"):
            return fn(*args, **kwargs)

    return run


def _launches(e) -> bool:
    """Whether op event `e` does work: a conversion only where some op below it does (a copy)."""
    if e.name in NO_KERNEL:
        return False
    return e.name not in CONVERSIONS or any(_launches(c) for c in e.cpu_children)


def _ancestor(e, prefix: str) -> str | None:
    """The name of the nearest of `e` and the events enclosing it that starts with `prefix` (None: none)."""
    while e is not None:
        if e.name.startswith(prefix):
            return e.name
        e = e.cpu_parent
    return None


def _phase_of(e) -> str:
    """The phase whose record_function encloses op event `e` ("other" outside them)."""
    name = _ancestor(e.cpu_parent, "phase:")
    return "other" if name is None else name.removeprefix("phase:")


def _count(events, names: dict | None = None) -> Counter:
    """Kernel-launching ops per phase (see the module docstring); a grouped product counts once (on the CPU
    `moe_experts.grouped_mm` loops over the experts, on CUDA it is one torch._grouped_mm). `names`: each
    phase's op names, filled in."""
    counts: Counter = Counter()
    for e in events:
        if e.name == "phase:grouped_mm":
            counts["experts"] += 1
            continue
        parent = e.cpu_parent
        in_graph = parent is not None and parent.name.startswith("## Call CompiledFxGraph")
        if not (in_graph or e.name.startswith("aten::")) or e.name in NO_KERNEL:
            continue
        if not _launches(e):
            continue
        if not in_graph and parent is not None and parent.name.startswith("aten::"):
            continue  # counted at the top of its nesting
        phase = _phase_of(e)
        if phase == "grouped_mm":
            continue
        counts[phase] += 1
        if names is not None:
            names.setdefault(phase, []).append(e.name.removeprefix("aten::"))
    return counts


def _train_counts(events, names: dict | None = None) -> dict[str, Counter]:
    """Kernel-launching ops of one training forward + backward per phase: forward ops as `_count` (phase by
    the record_function around them), backward ops by the phase of the forward op that made their autograd
    node (its sequence number)."""

    node = "autograd::engine::evaluate_function:"
    forward = _count([e for e in events if _ancestor(e, node) is None], names)
    phase_of_seq: dict[int, str] = {}
    for e in events:
        if e.sequence_nr < 0 or not e.name.startswith("aten::") or "evaluate_function" in e.name:
            continue
        phase = _phase_of(e)
        phase_of_seq.setdefault(e.sequence_nr, "experts" if phase == "grouped_mm" else phase)
    backward: Counter = Counter()
    for e in events:
        if not e.name.startswith(node):
            continue
        phase = phase_of_seq.get(e.sequence_nr, "other")
        stack = list(e.cpu_children)
        while stack:  # the launching ops below the node, each once at the top of its nesting
            c = stack.pop()
            if c.name.startswith("aten::") and c.name not in NO_KERNEL and _launches(c):
                backward[phase] += 1
                if names is not None:
                    names.setdefault(f"{phase} (backward)", []).append(c.name.removeprefix("aten::"))
            else:
                stack.extend(c.cpu_children)
    return {"forward": forward, "backward": backward}


def _moe_layer(dtype: str, trainable: bool, **arch: object) -> tuple[object, torch.nn.Module, int]:
    """(the actor, its one MoE layer's MLP, the hidden size): a one-layer qwen3-moe-shaped model (its routing,
    tiny widths; `arch` overrides) in a gloo world of one, with `model.moe_grouped_gemm` as the presets."""
    from presets.gpu import QWEN3_MOE_3B
    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig
    from rltrain.megatron.model import unwrap
    from rltrain.megatron.parallel import free_port

    init_groups(MegatronConfig(), "cpu", rank=0, world_size=1, master_port=free_port())
    shape = replace(QWEN3_MOE_3B, num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    num_query_groups=2, kv_channels=16, vocab_size=128, moe_ffn_hidden_size=32, **arch)  # fmt: skip
    model = ModelConfig(arch=shape, params_dtype=dtype, attention_backend="sdpa", moe_grouped_gemm=True)
    actor = actor_of(model, ActorConfig(megatron=MegatronConfig()), "cpu", trainable=trainable)
    (layer,) = unwrap(actor.chunks[0]).decoder.layers
    return actor, layer.mlp, shape.hidden_size


def train_main(a: argparse.Namespace) -> int:
    """One MoE layer's training forward + backward (autograd on, the load-balancing loss on), ops per phase:
    the router (`moe_decode.train_route`, or megatron's with the bench switch `router` off), the dispatch
    (expert positions, rows), the experts and the combine of `moe_decode.moe_forward`."""
    from rltrain.megatron import moe_decode, moe_experts

    actor, mlp, width = _moe_layer(a.dtype, trainable=True, moe_aux_loss_coeff=0.001)
    hidden = torch.randn(a.rows, 1, width, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(getattr(torch, a.dtype)).requires_grad_()
    with contextlib.ExitStack() as stack:
        mlp.router.forward = _phase("router", mlp.router.forward)
        stack.callback(mlp.router.__dict__.pop, "forward")
        for obj, attr, phase in (
            (moe_decode, "train_route", "router"),
            (moe_decode, "expert_positions", "dispatch"),
            (moe_decode._ExpertRows, "apply", "dispatch"),
            (moe_decode, "expert_swiglu", "experts"),
            (moe_decode._Combine, "apply", "combine"),
        ):
            stack.callback(setattr, obj, attr, getattr(obj, attr))
            setattr(obj, attr, _phase(phase, getattr(obj, attr)))
        grouped = moe_experts.grouped_mm
        moe_experts.grouped_mm = _phase("grouped_mm", grouped)
        stack.callback(setattr, moe_experts, "grouped_mm", grouped)
        actor.train()

        def call() -> None:
            out, _ = mlp(hidden)
            out.float().sum().backward()

        call()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
    names: dict = {}
    report: dict = {}
    for part, c in _train_counts(prof.events(), names).items():
        _report_row(report, part, c, names if a.names and part == "backward" else None)
    print(json.dumps(report))
    return 0


def _report_row(report: dict, key: str, counts: Counter, names: dict | None) -> None:
    """One row of `report`: ops per phase and their total, printed (with each phase's ops, `names`)."""
    row = {p: counts.get(p, 0) for p in (*PHASES, "other")}
    row["total"] = sum(row.values())
    report[key] = row
    print(f"{key}: {row}", flush=True)
    for phase, ops in (names or {}).items():
        print(f"    {phase}: {' '.join(ops)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument(
        "--train", action="store_true", help="a training forward + backward (GroupedMoELayer's moe_forward)"
    )
    ap.add_argument("--names", action="store_true", help="print the ops of each phase")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="params and activations"
    )
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    if a.train:
        return train_main(a)
    from rltrain.megatron import moe_decode, moe_experts

    actor, mlp, width = _moe_layer(a.dtype, trainable=False)
    hidden = torch.randn(1, a.rows, width, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(getattr(torch, a.dtype))
    weights = moe_decode.ExpertWeights()
    routes = {"off": None, "eager": moe_decode.route, "compiled": moe_decode.fused_route}
    report = {}
    router = mlp.router
    with contextlib.ExitStack() as stack, torch.no_grad():
        actor.eval()
        router.forward = _phase("router", router.forward)
        router.gating = _phase("router", router.gating)
        stack.callback(lambda: (router.__dict__.pop("forward"), router.__dict__.pop("gating")))
        grouped = moe_experts.grouped_mm
        moe_experts.grouped_mm = _phase("grouped_mm", grouped)
        stack.callback(setattr, moe_experts, "grouped_mm", grouped)
        for glue_name, glue in (("eager", moe_decode.EAGER_GLUE), ("compiled", moe_decode.FUSED_GLUE)):
            glue = moe_decode.DecodeGlue(_phase("dispatch", glue.dispatch), _phase("experts", glue.swiglu),
                                         _phase("combine", glue.combine))  # fmt: skip
            for route_name, route in routes.items():
                if route_name not in ("off", glue_name):
                    continue  # the engine pairs the compiled router with the compiled glue
                kw = {} if route is None else {"route": _phase("router", route)}
                call = functools.partial(
                    moe_decode.moe_forward, mlp, hidden, weights, silent=True, glue=glue, **kw
                )
                call()  # compile, stack the experts
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    call()
                names: dict = {}
                counts = _count(prof.events(), names)
                key = f"glue_{glue_name}/router_{'on' if route else 'off'}"
                _report_row(report, key, counts, names if a.names else None)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # each generated kernel a profiler event
    raise SystemExit(main())
