"""Rules of where the run executes: model sources and attention backends, the cluster, model folder paths, output path lengths and LoRA.

Each rule registers itself in rlconf.rules with `@rule(name, fields...)` when this module is imported
(rlconf.validate imports every check module, in the order the docs list the rules).
"""

from __future__ import annotations

from collections.abc import Iterator

from rlconf.config import (
    RLConfig,
)
from rlconf.errors import Issue, error
from rlconf.folder_rules import model_folder_paths
from rlconf.lora import config_issues as lora_config_issues
from rlconf.plan.roles import (
    actor_world,
    configured_roles,
    megatron_roles,
    packing_blocker,
    packing_issue,
    rollout_tp,
)
from rlconf.rules import rule
from rlconf.run_paths import RULE as OUTPUT_DIR_LENGTH_RULE
from rlconf.run_paths import output_dir_length
from rlconf.safe_paths import FOLDER_PATHS_RULE


@rule(
    "model-source",
    "*.use_dist_checkpointing",
    "*.dist_checkpointing_path",
    "*.override_transformer_config.*_dropout",
    "model.attention_backend",
    "model.fused_kernels",
    "model.use_remove_padding",
    "*.context_parallel_size",
    "*.virtual_pipeline_model_parallel_size",
    "actor.router_replay",
    "model.arch.kv_channels",
    "model.arch.hidden_size",
)
def model_source(c: RLConfig) -> Iterator[Issue]:
    """A model path and dist checkpoint path are consistent; TE attention is not available on npu/cpu,
    compiled fused kernels not on npu; dropout probabilities are in [0, 1); model.use_remove_padding: true
    only where every megatron role can run packed sequences."""
    for prefix, m, _ in megatron_roles(c):
        if m.use_dist_checkpointing and not m.dist_checkpointing_path:
            yield error(f"{prefix}.megatron.dist_checkpointing_path", "use_dist_checkpointing needs a path",
                        "set dist_checkpointing_path or use_dist_checkpointing: false", "model-source")  # fmt: skip
        ov = m.override_transformer_config
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(ov, name) < 1.0:
                yield error(f"{prefix}.megatron.override_transformer_config.{name}",
                            f"a dropout probability must be in [0, 1), got {getattr(ov, name)}",
                            "use 0.0 (RL fine-tuning usually trains without dropout)", "model-source")  # fmt: skip
    if c.model.attention_backend == "te" and c.cluster.device != "cuda":
        yield error("model.attention_backend", f"Transformer Engine needs cuda, cluster.device = {c.cluster.device}",
                    "use attention_backend: sdpa", "model-source")  # fmt: skip
    if c.model.fused_kernels == "compiled" and c.cluster.device == "npu":
        # torch.compile's generated kernels target cuda (Triton) and cpu (C++); none was run on Ascend.
        yield error("model.fused_kernels", "compiled kernels were never run on npu",
                    "use fused_kernels: eager (or auto)", "model-source")  # fmt: skip
    if c.model.use_remove_padding:
        yield from _packing_issues(c)
    a = c.model.arch
    heads = max(a.num_attention_heads, 1)
    if a.kv_channels is None and c.model.path is None and a.hidden_size % heads:
        yield error(
            "model.arch.kv_channels",
            "hidden_size is not divisible by num_attention_heads, so the head width is undefined",
            "set kv_channels, or make hidden_size a multiple of the head count",
            "model-source",
        )


@rule("cluster", "cluster.*", "rollout.tensor_model_parallel_size")
def cluster(c: RLConfig) -> Iterator[Issue]:
    """Device memory, if given, is positive; CPU workers and rollout TP fit."""
    if c.cluster.device_memory_gib is not None and c.cluster.device_memory_gib <= 0:
        yield error(
            "cluster.device_memory_gib", "must be > 0", "give the device memory in GiB, or null", "cluster"
        )
    if c.cluster.cpus_per_worker <= 0:
        yield error("cluster.cpus_per_worker", "must be > 0", "use 1", "cluster")
    if not 0 < c.cluster.connect_timeout_s <= 3600:
        yield error(
            "cluster.connect_timeout_s", "must be > 0 and at most 3600 (seconds)", "use 30", "cluster"
        )
    aw = actor_world(c)
    tp = rollout_tp(c)
    # A separate rollout has a pool of its own (rule rollout-placement checks that one).
    if c.rollout.placement == "colocated" and aw >= 1 and tp >= 1 and aw % tp:
        yield error("rollout.tensor_model_parallel_size", f"the actor pool of {aw} devices is not divisible by {tp}",
                    "use a rollout tp that divides the actor pool", "cluster")  # fmt: skip


# Rules whose checks live in modules of their own (which never import this one: no import cycle).
rule(FOLDER_PATHS_RULE, "model.path", "model.tokenizer_path", "critic.model_path", "reward.reward_model.path",
     filesystem=True)(model_folder_paths)  # fmt: skip
rule(OUTPUT_DIR_LENGTH_RULE, "trainer.output_dir", "profile.save_path", filesystem=True)(output_dir_length)


@rule("lora", "actor.lora.*", "rollout.placement", "rollout.engine", "rollout.tensor_model_parallel_size",
      "model.attention_backend", "actor.megatron.use_dist_checkpointing", "actor.checkpoint.save_contents")  # fmt: skip
def lora(c: RLConfig) -> Iterator[Issue]:
    """actor.lora: rank >= 0 (0 is off), alpha > 0, dropout in [0, 1), known target names; LoRA runs with the
    embedded rollout engine in the actor's layout on the actor's devices (adapter refits to a separate pool,
    vLLM or a resharded rollout are not built yet), megatron-core's own linears (not Transformer Engine), and
    exports adapters with `rltrain export-hf` rather than the in-run hf_model. Targets the model cannot take
    (MLP targets on a MoE model, exclude patterns matching nothing) are reported when the plan reads the
    architecture (rlconf/lora.py)."""
    yield from lora_config_issues(c)


def _packing_issues(c: RLConfig) -> Iterator[Issue]:
    """model.use_remove_padding: true with a role that cannot pack (the plan's `packing_blocker`; a model
    folder's architecture is checked when the plan reads its config.json)."""
    arch = c.model.arch if c.model.path is None else None
    for role in configured_roles(c):
        if role == "rollout":
            continue
        if (blocker := packing_blocker(c, role, arch)) is not None:
            yield packing_issue(role, blocker)
            return
