"""Ray worker processes: one per device and role group, each holding its Megatron engine(s).

`PolicyWorker` holds the actor, serves the rollout on the actor's own weights (colocated: no copy, no
weight sync) and, when the run uses one, the frozen reference policy in the same process (megatron's
process groups are per process, so the ref shares the actor's layout; validation enforces it).
`CriticWorker` holds the value model in its own process and process group. `RolloutWorker` (rollout.placement:
separate) holds a frozen copy of the policy in the rollout's own layout on the rollout pool and generates;
the policy workers push their weights to it after every update (rltrain/rollout/push.py).

Workers read the plan, never the config: each engine is built from its role of
the plan (`TrainerPlan.engine(role)`: model, layout, batch schedule, lr table), the reward model from the
plan's reward_model role. Each public method is one role's work
and is wrapped by the profiler (`profiled(ROLE)`), a no-op unless the plan profiles that role and step.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from rlconf.plan import TrainerPlan
from rlconf.seeding import derive_seed
from rltrain import device as devices
from rltrain import quiet
from rltrain.profiling import Profiler
from rltrain.rollout.generation import RolloutServer


def load_initial_weights(engine: Any, path: str | None, prefix: str) -> None:
    """`use_dist_checkpointing`: start from the model weights of a saved rlplan role checkpoint
    (`checkpoints/global_step_N/<role>`, megatron dist format, any TP/PP layout) instead of HF or random.
    `path`: the plan's `EngineSettings.dist_checkpointing_path` of the role (None: nothing to load)."""
    if path is None:
        return
    from rlconf.errors import ConfigError, error
    from rltrain.checkpoint import UnsafeCheckpointError, load_engine
    from rltrain.checkpoint.safe_load import UNSAFE_RULE

    try:
        load_engine(engine, path, ("model",), role=prefix)
    except UnsafeCheckpointError as exc:
        # A setting that names a forged checkpoint: exit 2 naming it, not a worker failure to resume from.
        path = f"{prefix}.megatron.dist_checkpointing_path"
        raise ConfigError([error(path, str(exc), f"point {path} at a checkpoint rlplan wrote and nobody changed",
                                 UNSAFE_RULE)]) from None  # fmt: skip


def check_rows_match_plan(plan: TrainerPlan, role: str, batch: dict[str, torch.Tensor]) -> None:
    """An update's rows on this rank must be the plan's: its mini-batches x their rows per rank. Anything
    else means the controller and the plan disagree, and the update would run another schedule."""
    b = plan.batch_plan(role)
    expected = b.mini_batches_per_step * b.responses_per_mini_batch_per_rank
    rows = int(batch["input_ids"].shape[0])
    if rows != expected:
        raise ValueError(
            f"{role} update got {rows} rows on this rank; the plan's batch schedule is {b.mini_batches_per_step} "
            f"mini-batches x {b.responses_per_mini_batch_per_rank} rows per rank"
        )


class MegatronWorker:
    """Common set-up: rank environment, threads, torch.distributed rendezvous, the profiler."""

    def __init__(
        self, role: str, rank: int, world_size: int, master_addr: str, master_port: int, plan: TrainerPlan
    ) -> None:
        self.role, self.rank, self.world_size = role, rank, world_size
        self.plan = plan
        self.run = plan.run
        device = self.run.cluster.device
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            # Ray gives each worker its own device through devices.visible_devices_env(device)
            # (CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES): index 0 of what the process sees.
            LOCAL_RANK="0",
        )
        # megatron's import-time warnings (rltrain.quiet; the driver notes once what they stand for).
        quiet.filter_third_party_warnings()
        # Before anything in this process imports megatron: on npu, MindSpeed's adaptor patches megatron-core
        # when imported (with this role's options); on cuda the GPU is bound, on cpu megatron's redirects.
        devices.prepare_process(device, local_rank=0, engine=self._engine_plan())
        torch.set_num_threads(max(1, int(self.run.cluster.cpus_per_worker)))
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        # Every random draw of a run comes from a stream keyed by (seed, step, purpose) (rlconf.seeding);
        # this only makes anything that draws outside those streams reproducible too.
        torch.manual_seed(derive_seed(self.run.seed, rank, "process"))
        self.profiler = Profiler(plan.profile, worker=role, rank=rank, device=device)
        self._memory_peaks: dict[str, float] = {}
        self.step = 0

    def _engine_plan(self) -> Any:
        """The plan's engine of the model(s) this process holds (the ref shares the actor's layout; a
        separate rollout's process takes the actor's)."""
        return self.plan.engine(self.role if self.role in ("critic", "reward_model") else "actor")

    @contextlib.contextmanager
    def measured(self, phase: str) -> Iterator[None]:
        """One role call: profiled (a no-op unless the plan profiles it) and, on an accelerator, its peak
        device memory recorded for `step_memory` (the allocator's peak is reset when the call starts)."""
        device = self.run.cluster.device
        track = devices.is_accelerator(device)
        if track:
            devices.reset_peak_memory_stats(device)
        with self.profiler.profiled(phase):
            yield
        if track:
            peak = devices.max_memory_allocated(device) / 2**30
            self._memory_peaks[phase] = max(self._memory_peaks.get(phase, 0.0), peak)

    def step_memory(self) -> dict[str, float]:
        """Peak device memory (GiB, `max_memory_allocated`) of each role call since the last call of this
        method, by profile role name (generate_sequences, actor_update, ...); empty on cpu."""
        peaks, self._memory_peaks = self._memory_peaks, {}
        return peaks

    def device_peak_flops(self) -> float | None:
        """Dense peak FLOP/s of this process's device at the model's dtype (rltrain.device.peak_flops)."""
        return devices.peak_flops(self.run.cluster.device, self.run.params_dtype)

    def set_step(self, step: int) -> None:
        """The training step the next calls belong to (profiling folders and schedules use it)."""
        self.step = step
        self.profiler.set_step(step)

    def pid(self) -> int:
        return os.getpid()

    def engines(self) -> dict[str, Any]:
        """The trained engines of this process by role (checkpointed)."""
        return {}

    # ------------------------------------------------------------------ checkpoints (rltrain.checkpoint)
    def weights_finite(self) -> bool:
        """Whether every weight of this rank's trained engines is finite (the controller asks before a save:
        a checkpoint of non-finite weights is never written)."""
        return all(engine.weights_finite() for engine in self.engines().values())

    def save_checkpoint(self, folders: dict[str, str], extra: dict[str, Any]) -> bool:
        """Write this rank's part of each engine's checkpoint; True when complete, False while async."""
        from rltrain.checkpoint import role_contents, save_engine
        from rltrain.storage import storage_errors

        done = True
        for role, engine in self.engines().items():
            contents, _, async_save = role_contents(self.plan, role)
            self._saving_into = folders[role]
            # A full or read-only disk is the config error it is (exit 2, one line), not a worker failure.
            with storage_errors(f"the checkpoint of step {extra.get('step')} could not be written to "
                                f"{folders[role]}", folders[role], self.plan.checkpoint.size_bytes,
                                "the checkpoints before it are intact"):  # fmt: skip
                done &= save_engine(engine, folders[role], contents, extra, async_save)
        return done

    def finalize_checkpoint(self, blocking: bool = False) -> list[str]:
        """Finish background saves (all when blocking); returns the folders that completed."""
        from rltrain.checkpoint import finalize_pending
        from rltrain.storage import storage_errors

        # The folder of the latest save (absolute; the plan's root may be relative to another directory).
        where = getattr(self, "_saving_into", None) or self.plan.checkpoint.root
        with storage_errors(f"a background checkpoint write into {where} failed", where,
                            self.plan.checkpoint.size_bytes, "the checkpoints before it are intact"):  # fmt: skip
            return finalize_pending(blocking)

    def load_checkpoint(self, folders: dict[str, str]) -> dict[str, Any]:
        """Restore each engine from its checkpoint folder; returns the controller's extra state."""
        from rltrain.checkpoint import load_engine, role_contents

        extra: dict[str, Any] = {}
        for role, engine in self.engines().items():
            _, contents, _ = role_contents(self.plan, role)
            extra = load_engine(engine, folders[role], contents)
        return extra

    def finish(self) -> None:
        self.profiler.close()


class PolicyWorker(MegatronWorker, RolloutServer):
    """Actor + rollout (+ reference policy) on one rank of the actor pool."""

    def init_model(self) -> dict[str, Any]:
        from rltrain.megatron.actor import MegatronActor

        self.actor = MegatronActor.from_plan(self.plan, "actor")
        load_initial_weights(self.actor, self._engine_plan().settings.dist_checkpointing_path, "actor")
        self.ref = None
        if "ref" in self.plan.roles:
            # The reference policy is the actor's starting point: its weights are copied from the actor
            # (parameters only, no optimizer or gradient buffers).
            self.ref = MegatronActor.from_plan(self.plan, "ref", init_from=self.actor)
            self.ref.offload_for_other_roles()
        # rollout.engine: vllm: the plan's rollout layout decides which ranks host a vLLM engine; every rank
        # takes part in its refits and row exchanges (rltrain/rollout/vllm_adapter.py).
        self.vllm = None
        if self.plan.refit is not None and self.plan.refit.mode == "vllm":
            from rltrain.rollout.vllm_adapter import ColocatedVLLM

            self.vllm = ColocatedVLLM(self.actor, self.plan, self.rank)
        return {"vocab_size": self.actor.vocab_size, "dp_size": self.actor.dp_size}

    def compute_log_prob(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with self.measured("actor_compute_log_prob"):
            return self.actor.compute_log_prob(batch, temperature=self.plan.rollout.train.temperature)

    def _ref_log_prob(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        temperature = self.plan.rollout.train.temperature
        if self.ref is not None:
            return self.ref.compute_log_prob(batch, temperature=temperature, with_entropy=False)
        # LoRA (the plan's StepPasses.ref_from adapters-off): the base model is the actor's engine with its
        # adapters off, so no reference copy of the weights exists.
        assert self.plan.passes is not None and self.plan.passes.ref_from == "adapters-off", (
            "this run has no reference policy"
        )
        from rltrain.megatron.lora import adapters_disabled

        with adapters_disabled(self.actor.chunks):
            return self.actor.compute_log_prob(batch, temperature=temperature, with_entropy=False)

    def compute_ref_log_prob(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with self.measured("ref_compute_log_prob"):
            return self._ref_log_prob(batch)

    def compute_old_and_ref_log_prob(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Both passes on one scatter of the batch (the plan's `StepPasses.fused`): the actor's log-probs and
        entropy, the ref's log-probs as `ref_log_probs`, and the ref pass's seconds as `ref_seconds` [1, 1]."""
        temperature = self.plan.rollout.train.temperature
        with self.measured("actor_compute_log_prob"):
            old = self.actor.compute_log_prob(batch, temperature=temperature)
        t_ref = time.perf_counter()
        with self.measured("ref_compute_log_prob"):
            ref = self._ref_log_prob(batch)
        seconds = torch.tensor([[time.perf_counter() - t_ref]], dtype=torch.float64)
        return {**old, "ref_log_probs": ref["log_probs"], "ref_seconds": seconds}

    def update_actor(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        check_rows_match_plan(self.plan, "actor", batch)
        passes = self.plan.passes
        assert passes is not None
        with self.measured("actor_update"):
            # Old log-probs were computed at the rollout temperature: the PPO ratio must use the same.
            metrics = self.actor.update_policy(batch, temperature=self.plan.rollout.train.temperature, step=step,
                                               on_policy=passes.old_log_prob == "update")  # fmt: skip
            # Grads and optimizer state may leave the device; the weights stay for the next rollout.
            self.actor.offload_for_other_roles(keep_params=True)
            return metrics

    def engines(self) -> dict[str, Any]:
        return {"actor": self.actor}

    # ------------------------------------------------------------------ weight push (separate rollout)
    def push_endpoint(self, timeout_s: float) -> tuple[str, int]:
        """Host the push groups' store here (the first sending rank): this node's address and the port."""
        import ray

        from rltrain.rollout.push import host_store

        self._push_store, port = host_store(timeout_s)
        return ray.util.get_node_ip_address(), port

    def join_push(self, endpoint: Any) -> bool:
        """Senders (tp 0, cp 0, dp 0 of each pipeline stage) join their stage's push group (collective with
        the rollout ranks); the other ranks only take part in their stage's TP gather. True on a sender."""
        from megatron.core import parallel_state as ps

        from rltrain.rollout.push import PushGroup, connect_store

        self._push = None
        if (
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
            and (ps.get_data_parallel_rank() == 0)
        ):
            store = getattr(self, "_push_store", None) or connect_store(endpoint)
            self._push = PushGroup(store, ps.get_pipeline_model_parallel_rank(), 0, 1 + endpoint.receivers,
                                   self.run.cluster.device, endpoint.timeout_s)  # fmt: skip
        return self._push is not None

    def push_weights(self, version: int) -> dict[str, float]:
        """Send the weights after `version` updates to the rollout pool (every trainer rank calls it: the TP
        gather is collective); returns the sender's seconds and bytes (empty on the other ranks)."""
        from rltrain.rollout.weight_sync import iter_hf_weights, send_weights

        assert self.plan.refit is not None
        with self.measured("weight_push"):
            named = iter_hf_weights(self.actor.chunks, self.actor.arch)
            if self._push is None:
                for _ in named:
                    pass
                return {}
            stats = send_weights(named, self._push, 0, self.plan.refit.bucket_mib * 2**20,
                                 self._push.tensor_device, version=version)  # fmt: skip
        return {"seconds": stats.seconds, "bytes": float(stats.bytes), "buckets": float(stats.buckets)}


class RolloutWorker(MegatronWorker, RolloutServer):
    """One rank of a separate rollout pool: the policy's model, frozen, in the rollout's own layout (the
    plan's `rollout` engine: its tp, no pipeline parallel), generating with the weights of the last push."""

    def init_model(self) -> dict[str, Any]:
        from rltrain.megatron.actor import MegatronActor

        self.actor = MegatronActor.from_plan(self.plan, "rollout")
        self.vllm = None
        self.weight_version: int | None = None  # no push yet: generation refuses to run
        return {"vocab_size": self.actor.vocab_size, "dp_size": self.actor.dp_size}

    def join_push(self, endpoint: Any) -> None:
        """Join every stage's push group (collective with the trainer's senders)."""
        from rltrain.rollout.push import PushGroup, connect_store
        from rltrain.rollout.weight_sync import MegatronWeightLoader

        store = connect_store(endpoint)
        self._push = [
            PushGroup(
                store,
                stage,
                1 + self.rank,
                1 + endpoint.receivers,
                self.run.cluster.device,
                endpoint.timeout_s,
            )
            for stage in range(endpoint.senders)
        ]
        self._loader = MegatronWeightLoader(self.actor.chunks, self.actor.arch)

    def receive_weights(self, version: int) -> dict[str, float]:
        """Receive the push of weight version `version` from every trainer stage, in stage order; every
        parameter must arrive, in the expected version, with its buckets' checksums."""
        from rltrain.rollout.push import receiver_fault
        from rltrain.rollout.weight_sync import receive_weights

        receiver_fault(self.rank, version)
        t0 = time.perf_counter()
        nbytes = 0
        with self.measured("weight_push"), torch.no_grad():
            for group in self._push:
                nbytes += receive_weights(self._loader, group, 0, group.tensor_device, version=version).bytes
            self._loader.finish()
        self.weight_version = version
        return {"seconds": time.perf_counter() - t0, "bytes": float(nbytes)}

    def generate_sequences(
        self, prompts: dict[str, torch.Tensor], seed: int, *args: Any, **kwargs: Any
    ) -> dict:
        """Generation (RolloutServer) with the pushed weights; every row carries their version."""
        if self.weight_version is None:
            raise RuntimeError("rollout rank has received no weights yet (the first push must come first)")
        out = super().generate_sequences(prompts, seed, *args, **kwargs)
        rows = out["responses"].shape[0]
        out["weight_version"] = torch.full((rows,), self.weight_version, dtype=torch.int64)
        return out


class CriticWorker(MegatronWorker):
    """The value model on one rank of its pool."""

    def init_model(self) -> dict[str, Any]:
        from rltrain.megatron.critic import MegatronCritic

        self.critic = MegatronCritic.from_plan(self.plan, "critic")
        load_initial_weights(self.critic, self._engine_plan().settings.dist_checkpointing_path, "critic")
        return {"dp_size": self.critic.dp_size}

    def compute_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.measured("critic_compute_values"):
            values = self.critic.compute_values(batch)
            self.critic.offload_for_other_roles()
            return values

    def update_critic(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        check_rows_match_plan(self.plan, "critic", batch)
        with self.measured("critic_update"):
            metrics = self.critic.update_critic(batch, step=step)
            self.critic.offload_for_other_roles()
            return metrics

    def engines(self) -> dict[str, Any]:
        return {"critic": self.critic}


class RewardModelWorker(MegatronWorker):
    """A learned reward model: the critic's value-head model read at each response's last token."""

    def init_model(self) -> dict[str, Any]:
        from rltrain.megatron.critic import MegatronCritic

        # The plan's reward_model role: its model (reward.reward_model.path), layout and micro-batch size.
        self.model = MegatronCritic.from_plan(self.plan, "reward_model")
        return {"dp_size": self.model.dp_size}

    def compute_rm_score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One score per row: the value head at the last response token (after reading all of it)."""
        with self.measured("reward_compute"):
            # The value model reads position t to value token t+1; appending one token per row makes the
            # position of the last real token the one that "predicts" the appended token.
            rows = batch["responses"].shape[0]
            resp_len = batch["response_mask"].sum(-1)
            prompt_cols = batch["input_ids"].shape[1] - batch["responses"].shape[1]
            ext = {k: torch.cat([v, torch.zeros_like(v[:, :1])], 1) for k, v in batch.items() if v.dim() == 2}
            idx = torch.arange(rows)
            ext["response_mask"][idx, resp_len] = 1
            ext["attention_mask"][idx, prompt_cols + resp_len] = 1
            values = self.model.compute_values(ext)
            return values[idx, resp_len].float()
