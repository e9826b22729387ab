"""The RL controller: a short loop that drives Ray worker groups through generate -> reward -> log-probs
-> advantages -> update, step after step, and logs what happened.

Read top to bottom: `Trainer.__init__` builds everything from the plan (run folder, tokenizer, reward,
data, Ray pools and workers), `Trainer.fit` is the loop, `Trainer.train_step` is one RL step:
`generate_batch` (prompts, generation, rewards) then the log-prob passes, advantages and updates. Data moves
as dicts of tensors with one row per response; `_dispatch` cuts rows by the data-parallel coordinate of
each rank (from the plan's rank grid) and gathers results from one rank per data-parallel group.

With a separate rollout pool (the plan's refit mode `push`), the rollout workers generate on devices of
their own: after every update the policy workers push their weights to them (`_push_weights`), and a
producer thread (rltrain/rollout/pipeline.py) makes the batches, up to algorithm.off_policy_steps ahead of
the weights, while the main thread trains.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from rlconf.errors import ConfigError, error
from rlconf.plan import TrainerPlan
from rlconf.plan.roles import role_spec
from rlconf.run_config import ConfigDocument
from rlconf.seeding import ROLLOUT, VAL_SAMPLES, VALIDATE, derive_seed
from rltrain import algorithms, generations
from rltrain import device as devices
from rltrain import metrics as metrics_lib
from rltrain.checkpoint import CheckpointError, Resume
from rltrain.data import PromptBatch, left_pad
from rltrain.generations import GENERATIONS_KEY
from rltrain.guard import CAUSE_KEY, DIVERGED_EXIT, DivergedError, DivergenceGuard, bad_update, first_bad
from rltrain.metrics import REWARD_PLOT, MetricsLogger, plot_reward_curve
from rltrain.profiling import Profiler, nsys_command, write_summary
from rltrain.ray_group import (
    Pool,
    WorkerError,
    WorkerGroup,
    local_cluster_down,
    nsight_runtime_env,
    start_ray,
)
from rltrain.rollout.agent import STAT_KEYS as AGENT_STAT_KEYS
from rltrain.runfolder import RunFolder, StopSignals
from rltrain.storage import check_free_space, storage_errno, storage_error

# Batch keys the controller keeps to itself (rewards, grouping, the rollout's log-probs, multi-turn row
# statistics); the rest go to workers.
_CONTROLLER_KEYS = ("scores", "group_index", "rollout_log_probs", "overlong_penalty", "weight_version",
                    *AGENT_STAT_KEYS)  # fmt: skip


def _timed(timing: dict[str, float], name: str, fn: Any, *args: Any) -> Any:
    """fn(*args), its seconds recorded as timing/{name}_s."""
    t0 = time.perf_counter()
    result = fn(*args)
    timing[f"timing/{name}_s"] = time.perf_counter() - t0
    return result


class Trainer:
    """Owns the run: plan, workers, data, reward, KL controller, logger."""

    def __init__(
        self,
        plan: TrainerPlan,
        document: ConfigDocument,
        ray_temp_dir: str | None = None,
        run_folder: RunFolder | None = None,
        stop_signals: StopSignals | None = None,
    ) -> None:
        """`document`: the run's config as the run folder records it (config.yaml, the resume check).
        `run_folder`: the folder `run_training` locked and checked (opened here when not given; its
        checkpoints were cleaned and the resume point found under the lock). `stop_signals` are put back in
        place once Ray has started (ray.init installs its own SIGTERM handler)."""
        from rltrain.data import ListPromptSource, build_dataloaders
        from rltrain.rewards import check_data_sources, load_reward_function
        from rltrain.tokenizer import load_tokenizer
        from rltrain.workers import CriticWorker, PolicyWorker, RewardModelWorker, RolloutWorker

        self.plan = plan
        self.run = run = plan.run
        self._own_folder = run_folder is None
        self.run_folder = run_folder if run_folder is not None else RunFolder.open(document, plan)
        self.out = self.run_folder.path
        self.run_folder.record_start(document, plan)
        self.ckpt, self.resume = self.run_folder.ckpt, self.run_folder.resume
        # The last step whose metrics line is written: a stop keeps only saves of steps up to it.
        self._logged_step = 0
        self.guard = DivergenceGuard(run.max_bad_steps)

        self.tokenizer = load_tokenizer(plan.tokenizer)
        self.reward_fn = load_reward_function(plan.reward.function)
        self.train_data, self.val_data = build_dataloaders(plan.data, self.tokenizer)
        for loader in (self.train_data, self.val_data):  # before Ray starts: rows no scorer can score
            if loader is not None and isinstance(loader.source, ListPromptSource):
                check_data_sources(self.reward_fn, [e.data_source for e in loader.source.examples])
        self.agent = None
        if plan.rollout.multi_turn is not None:  # tools run here, between the turns the workers generate
            from rltrain.rollout.agent import build_agent_loop

            self.agent = build_agent_loop(self.tokenizer, plan.rollout.multi_turn)
        self.kl_ctrl = algorithms.build_kl_controller(plan.algorithm.kl_reward)
        self.logger = MetricsLogger(self.out, run.logging.backends, run.total_steps, run.project_name,
                                    run.experiment_name)  # fmt: skip
        # Rule rewards run here in the controller; they are profiled as rank 0 of the `reward_compute` role.
        self.reward_profiler = Profiler(plan.profile, worker="controller", rank=0, device="cpu")

        # Ray: one placement group per plan pool; each process-role (policy = actor + rollout + ref, critic,
        # reward model) puts rank r on device r of its pool, so colocated roles share devices.
        device, cpus = run.cluster.device, run.cluster.cpus_per_worker
        process_roles = {"actor": PolicyWorker, "critic": CriticWorker, "reward_model": RewardModelWorker}
        assert plan.refit is not None and plan.passes is not None
        self.separate_rollout = plan.refit.mode == "push"
        if self.separate_rollout:  # the rollout's own processes, on its own pool
            process_roles["rollout"] = RolloutWorker
        present = [r for r in process_roles if r in plan.roles]
        sharing = {p.name: sum(1 for r in present if r in p.roles) for p in plan.resources.pools}
        need = sum(p.num_devices * sharing[p.name] for p in plan.resources.pools)
        # ray.init replaces the SIGTERM handler: ours goes back at once (start_ray's on_started).
        start_ray(run.cluster.ray_address, num_cpus=max(int(need * cpus), 1), temp_dir=ray_temp_dir,
                  on_started=stop_signals.install if stop_signals is not None else None)  # fmt: skip
        pools = {p.name: Pool.for_plan(p, plan.resources, cpus, sharing[p.name])
                 for p in plan.resources.pools if sharing[p.name]}  # fmt: skip
        self.pools = list(pools.values())
        self.groups: dict[str, WorkerGroup] = {}
        for role in present:
            place = plan.placement(role)
            # nsys wraps the whole worker process (it records only between the profiler's start/stop).
            envs = [nsight_runtime_env(nsys_command(plan.profile, role, r)) for r in range(place.world_size)]
            self.groups[role] = WorkerGroup(role, process_roles[role], pools[place.pool], place.world_size, device,
                                            cpus, {"plan": plan}, envs)  # fmt: skip

        self.policy = self.groups["actor"]
        # The workers that generate: the policy workers (colocated) or the separate rollout pool's.
        self.rollout_group = self.groups.get("rollout", self.policy)
        self.critic = self.groups.get("critic")
        self.reward_model = self.groups.get("reward_model")
        # Build the models in parallel: every process imports megatron at the same time.
        pending = [(g, [w.init_model.remote() for w in g.workers]) for g in self.groups.values()]
        for group, refs in pending:
            group.wait(refs)
            group.release_rendezvous_port()  # its rank 0's store listens on it now
        # MFU's denominator: the device's dense peak (None on cpu or an unlisted device: no MFU is logged).
        self.peak_flops = self.policy.call("device_peak_flops")[0]
        self.start_step = 1
        # Prompt-order state after each generated batch (a batch may be generated steps ahead of its
        # training step; a checkpoint of step s stores the state after batch s).
        self._data_states: dict[int, dict[str, Any]] = {}
        if self.resume is not None:
            self._load(self.resume)
        self.pipeline = None
        if self.separate_rollout:
            from rltrain.rollout.pipeline import RolloutPipeline

            self._join_push_groups()
            version = self.start_step - 1  # the weights after that many updates (the checkpoint's)
            self._push_weights(version)
            self.pipeline = RolloutPipeline(self._produce, self.start_step, run.total_steps,
                                            plan.passes.off_policy_steps, version)  # fmt: skip

    # ------------------------------------------------------------------------------------ checkpoints
    def _trained_groups(self) -> dict[str, WorkerGroup]:
        return {role: g for role, g in self.groups.items() if role_spec(role).trained}

    def _load(self, resume: Resume) -> None:
        folders = {role: str(resume.role_folder(role)) for role in self._trained_groups()}
        extras = [g.call("load_checkpoint", per_rank_args=[(folders,)] * g.world_size)[0]
                  for g in self._trained_groups().values()]  # fmt: skip
        extra = extras[0]
        self.train_data.load_state_dict(extra["dataloader"])
        self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        self.start_step = int(extra["step"]) + 1
        print(f"resumed from {resume.folder} (step {extra['step']})", flush=True)

    def _weights_finite(self) -> bool:
        """Whether every rank's trained weights are finite (checked before each save: a checkpoint of
        non-finite weights is never written)."""
        return all(all(g.call("weights_finite")) for g in self._trained_groups().values())

    def _save(self, step: int) -> None:
        # Before anything is staged: a save that cannot fit stops the run with the checkpoints it has.
        done = self.ckpt.complete_steps()
        check_free_space(self.ckpt.root, self.plan.checkpoint.size_bytes,
                         f"the checkpoint of step {step} does not fit in {self.ckpt.root}",
                         f"the checkpoints before it are intact (newest: step {done[-1]})" if done else "")  # fmt: skip
        staging = self.ckpt.begin(step)
        extra = {
            "step": step,
            "dataloader": self._data_states.pop(step, None) or self.train_data.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
        }
        try:
            for group in self._trained_groups().values():
                group.call("save_checkpoint", per_rank_args=[(staging, extra)] * group.world_size)
        except WorkerError:
            self.ckpt.abort(step)
            raise

    def _finalize_saves(self, blocking: bool) -> None:
        """Commit every staged save whose roles all finished writing (wait for them when blocking)."""
        if not self.ckpt.pending_steps():
            return
        for group in self._trained_groups().values():
            group.call("finalize_checkpoint", per_rank_args=[(blocking,)] * group.world_size)
        for step in self.ckpt.pending_steps():
            if self.ckpt.ready(step):
                self.ckpt.commit(step)
                self.ckpt.apply_retention(self.plan.checkpoint.max_ckpt_to_keep)

    # ------------------------------------------------------------------------------------ dispatch
    def _dispatch(
        self, group: WorkerGroup, role: str, method: str, batch: dict[str, torch.Tensor], *extra: Any
    ) -> list[Any]:
        """Call `method` on every rank with its data-parallel shard of `batch`; return the results of the
        rank that represents each data-parallel group (tp 0, cp 0, last pipeline stage), in dp order."""
        layout = self.plan.layout(role)
        rows = next(iter(batch.values())).shape[0]
        bounds = [rows * d // layout.dp for d in range(layout.dp + 1)]
        shards = [{k: v[bounds[d] : bounds[d + 1]] for k, v in batch.items()} for d in range(layout.dp)]
        results = group.call(method, per_rank_args=[(shards[c.dp], *extra) for c in layout.grid])
        reps = {c.dp: c.rank for c in layout.grid if c.tp == 0 and c.cp == 0 and c.pp == layout.pp - 1}
        return [results[reps[d]] for d in range(layout.dp)]

    def _dispatch_cat(
        self, group: WorkerGroup, role: str, method: str, batch: dict[str, torch.Tensor], *extra: Any
    ) -> Any:
        parts = self._dispatch(group, role, method, batch, *extra)
        if isinstance(parts[0], torch.Tensor):
            return torch.cat(parts, 0)
        return {k: torch.cat([p[k] for p in parts], 0) for k in parts[0]}

    def _dispatch_rows(
        self, group: WorkerGroup, role: str, method: str, batch: dict[str, torch.Tensor], *extra: Any
    ) -> Any:
        """`_dispatch_cat` of a per-row forward pass (log-probs, values, reward scores) with the rows spread
        over the data-parallel ranks by tokens (rltrain/token_balance.py): every shard gets a balanced share
        of the batch's tokens and the same rows as the contiguous split, and the results come back in the
        batch's row order. A row's results do not depend on which rank computes it (up to the rounding of
        kernels that block another number of rows differently), so this changes timing, not the run;
        outputs that are not per row (a rank's seconds) are left as the ranks return them. Updates use
        `_dispatch_update`, which keeps each row's position in its shard."""
        from rltrain.token_balance import dp_balanced_order

        dp = self.plan.layout(role).dp
        rows = batch["attention_mask"].shape[0]
        if dp == 1 or rows < 2:
            return self._dispatch_cat(group, role, method, batch, *extra)
        sizes = [rows * (d + 1) // dp - rows * d // dp for d in range(dp)]
        order, inverse = dp_balanced_order(batch["attention_mask"].sum(-1).tolist(), sizes)
        out = self._dispatch_cat(group, role, method, {k: v[order] for k, v in batch.items()}, *extra)

        def back(t: torch.Tensor) -> torch.Tensor:
            return t[inverse] if t.dim() and t.shape[0] == rows else t

        return back(out) if isinstance(out, torch.Tensor) else {k: back(v) for k, v in out.items()}

    def _dispatch_update(
        self, group: WorkerGroup, role: str, method: str, batch: dict[str, torch.Tensor], *extra: Any
    ) -> list[Any]:
        """`_dispatch` of an update with the rows exchanged between data-parallel ranks, at the same position
        in each rank's shard, so that every rank gets a balanced share of the tokens
        (`token_balance.dp_balanced_columns`): each mini-batch keeps its rows, so the update is the one the
        contiguous split gives (up to summation order), with less waiting on the slowest rank."""
        from rltrain.token_balance import dp_balanced_columns

        dp = self.plan.layout(role).dp
        if dp > 1:
            order = dp_balanced_columns(batch["attention_mask"].sum(-1).tolist(), dp)
            batch = {k: v[order] for k, v in batch.items()}
        return self._dispatch(group, role, method, batch, *extra)

    def _set_step(self, step: int) -> None:
        self.reward_profiler.set_step(step)
        if not self.plan.profile.enabled:
            return  # only the profilers use the step; skip a round trip to every worker
        for group in self.groups.values():
            if self.pipeline is not None and group is self.rollout_group:
                continue  # busy generating ahead: the producer sets its step (`_produce`)
            group.call("set_step", per_rank_args=[(step,)] * group.world_size)

    # ------------------------------------------------------------------------------------ one step
    def rollout(
        self, prompts: PromptBatch, n: int, seed: int, validate: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Generate n responses per prompt with the sampling stream `seed` (rlconf.seeding) and score
        them. Returns the batch and the reward metrics."""
        from rltrain.rewards import score_rows

        ids = [p for p in prompts.input_ids for _ in range(n)]
        prompt_ids, prompt_mask = left_pad(ids, self.tokenizer.pad_token_id)
        inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
        agent_metrics: dict[str, float] = {}
        if self.agent is not None:
            batch, agent_metrics = self._agent_rollout(prompts, n, seed, validate)
        else:
            batch = self._dispatch_cat(
                self.rollout_group, "rollout", "generate_sequences", inputs, seed, validate
            )
        # The reward reads the whole response, tool observations included (attended, not trained on).
        present = batch["attention_mask"][:, -batch["responses"].shape[1] :]
        texts = [
            self.tokenizer.decode(row[mask.bool()].tolist())
            for row, mask in zip(batch["responses"], present, strict=True)
        ]
        truths = [g for g in prompts.ground_truths for _ in range(n)]
        prompt_texts = [p for p in prompts.prompts for _ in range(n)]
        sources = [d for d in prompts.data_sources for _ in range(n)]
        t0 = time.perf_counter()
        with self.reward_profiler.profiled("reward_compute"):
            scores, reward_extras = score_rows(
                self.reward_fn, texts, truths, prompt_texts, sources,
                [e for e in prompts.extra_infos for _ in range(n)],
            )  # fmt: skip
        batch["scores"] = torch.tensor(scores, dtype=torch.float32)
        if "multi_turn_reward" in batch:  # an interaction's per-turn and final rewards
            batch["scores"] = batch["scores"] + batch["multi_turn_reward"]
        if self.reward_model is not None:
            rm_batch = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses",
                                              "response_mask")}  # fmt: skip
            rm_scores = self._dispatch_rows(self.reward_model, "reward_model", "compute_rm_score", rm_batch)
            batch["scores"] = batch["scores"] + rm_scores
            rule_mean = float(sum(scores) / len(scores))
        batch["group_index"] = torch.arange(len(prompts)).repeat_interleave(n)
        lengths = batch["response_mask"].sum(-1).float()
        overlong = self.plan.reward.overlong
        max_response_length = self.plan.rollout.max_response_length
        if overlong is not None and not validate:  # DAPO reward shaping: training rewards only
            batch["overlong_penalty"] = algorithms.overlong_penalty(
                lengths, max_response_length, overlong.length, overlong.penalty_factor
            )
            task_mean = batch["scores"].mean().item()
            batch["scores"] = batch["scores"] + batch["overlong_penalty"]
        metrics: dict[str, Any] = {
            "reward/mean": batch["scores"].mean().item(),
            "reward/max": batch["scores"].max().item(),
            "reward/min": batch["scores"].min().item(),
            "response/length_mean": lengths.mean().item(),
            # Responses cut at the length limit (no EOS): what the overlong buffer penalises.
            "response/clip_ratio": (lengths >= max_response_length).float().mean().item(),
            "timing/reward_s": time.perf_counter() - t0,
        }
        if "overlong_penalty" in batch:
            metrics["reward/score_mean"] = task_mean
            metrics["reward/overlong_penalty_mean"] = batch["overlong_penalty"].mean().item()
        if self.reward_model is not None:
            metrics["reward/rule_mean"], metrics["reward/model_mean"] = rule_mean, rm_scores.mean().item()
        metrics.update(agent_metrics)
        metrics.update(reward_extras)  # verl-style dict results: their other numeric keys (e.g. acc)
        if not validate:
            metrics["perf/total_num_tokens"] = int(batch["attention_mask"].sum())  # prompts + responses
            metrics["sample/prompt"] = prompts.prompts[0]
            metrics["sample/response"] = texts[0]
        log = self.run.logging
        if (log.validation_data_dir or log.val_generations) if validate else log.rollout_data_dir:
            metrics[GENERATIONS_KEY] = generations.text_rows(
                prompt_texts, texts, truths, batch["scores"].tolist(), sources
            )  # the caller pops them: it knows the step
        return batch, metrics

    def _agent_rollout(
        self, prompts: PromptBatch, n: int, seed: int, validate: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Multi-turn rollout (rltrain/rollout/agent.py): the agent loop here, each turn generated by the
        rollout workers on the rows ready for it (each row on one DP rank, its KV cache kept there between
        turns where the workers can keep it: WorkerRolloutClient)."""
        from rltrain.rollout.agent import WorkerRolloutClient

        assert self.agent is not None
        group = self.rollout_group
        texts = [p for p in prompts.prompts for _ in range(n)]
        client = WorkerRolloutClient(
            lambda batch, *extra: self._dispatch_cat(group, "rollout", "generate_turn", batch, *extra),
            lambda method, *args: group.call(method, per_rank_args=[args] * group.world_size),
            dp=self.plan.layout("rollout").dp, pad_id=self.tokenizer.pad_token_id, validate=validate,
        )  # fmt: skip
        truths = [g for g in prompts.ground_truths for _ in range(n)]
        result = self.agent.run(client, self.agent.prompt_ids(texts), seed, texts, truths)
        return result.batch, result.metrics

    def generate_batch(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The rollout part of step `step`: its prompts, generated responses and rewards (timing/generate_s)."""
        prompts = next(self.train_data)
        t0 = time.perf_counter()
        # Each random stream of the step is keyed by (seed, step, purpose), never by what ran before (a
        # validation pass, a restart): a resumed run repeats the uninterrupted one exactly.
        seed = derive_seed(self.run.seed, step, ROLLOUT)
        if self.plan.algorithm.filter_groups.enabled:
            batch, metrics = self.dynamic_sampling(step, prompts)
        else:
            batch, metrics = self.rollout(prompts, self.plan.batch_plan("actor").responses_per_prompt, seed)
        if (rows := metrics.pop(GENERATIONS_KEY, None)) is not None:
            generations.write_step_file(self.run.logging.rollout_data_dir, step, rows)
        self._data_states[step] = self.train_data.state_dict()
        metrics["timing/generate_s"] = time.perf_counter() - t0
        return batch, metrics

    def _produce(self, step: int, version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The producer thread's batch of `step` on the separate rollout pool (rltrain/rollout/pipeline.py),
        generated with the rollout's weights of `version`; every row must say it used them."""
        if self.plan.profile.enabled:
            self.rollout_group.call("set_step", per_rank_args=[(step,)] * self.rollout_group.world_size)
        batch, metrics = self.generate_batch(step)
        if devices.is_accelerator(
            self.run.cluster.device
        ):  # the rollout pool's peaks, read here (it is ours)
            metrics["_rollout_memory"] = self.rollout_group.call("step_memory")
        if "weight_version" in batch and bool((batch["weight_version"] != version).any()):
            raise WorkerError("rollout", 0, f"the batch of step {step} was generated with weight versions "
                              f"{sorted(set(batch['weight_version'].tolist()))}, not the pushed {version}",
                              died=False)  # fmt: skip
        return batch, metrics

    def _join_push_groups(self) -> None:
        """Set up the weight push: the first trainer rank hosts the store, then the senders (one per
        pipeline stage) and every rollout rank join their push groups together."""
        from rltrain.ray_group import wait_all
        from rltrain.rollout.push import PushEndpoint

        timeout = self.plan.rollout.push_timeout_s
        host, port = self.policy.wait([self.policy.workers[0].push_endpoint.remote(timeout)])[0]
        endpoint = PushEndpoint(host, port, timeout, self.plan.refit.senders, self.rollout_group.world_size)
        wait_all([(self.policy, self.policy.submit("join_push", [(endpoint,)] * self.policy.world_size)),
                  (self.rollout_group, self.rollout_group.submit("join_push", [(endpoint,)] *
                                                                self.rollout_group.world_size))])  # fmt: skip

    def _push_weights(self, version: int) -> dict[str, float]:
        """Send the trainer's weights (after `version` updates) to the rollout pool; both sides at once, the
        first failure on either side raises naming its role and rank."""
        from rltrain.ray_group import wait_all

        t0 = time.perf_counter()
        sent, _ = wait_all([
            (self.policy, self.policy.submit("push_weights", [(version,)] * self.policy.world_size)),
            (self.rollout_group, self.rollout_group.submit("receive_weights",
                                                           [(version,)] * self.rollout_group.world_size)),
        ])  # fmt: skip
        nbytes = sum(r.get("bytes", 0.0) for r in sent)
        return {"timing/weight_push_s": time.perf_counter() - t0, "rollout/weight_push_gib": nbytes / 2**30}

    def train_step(self, step: int) -> dict[str, Any]:
        """One RL step as a sequence of passes: generate and score, the log-prob passes, the critic's values,
        advantages and updates (rltrain.algorithms.step does the math between them), the weight sync.
        Returns the step's metrics."""
        timing: dict[str, float] = {}
        self._set_step(step)
        generated, metrics = self._generated(step, timing)
        batch = algorithms.StepBatch.from_rollout(generated, _CONTROLLER_KEYS)
        metrics.update(self._log_prob_passes(batch, timing))
        if self.critic is not None:
            batch.values = _timed(timing, "values", self._dispatch_rows, self.critic, "critic", "compute_values",
                                  batch.worker_batch())  # fmt: skip
        # The divergence guard (rltrain/guard.py): an update with a non-finite input is not run.
        bad = first_bad(batch.guarded())
        if bad is None:
            bad = self._advantages_and_updates(step, batch, metrics, timing)
        if bad is not None:
            metrics[CAUSE_KEY] = bad
        if self.pipeline is not None:
            # The rollout gets the new weights; batches waiting for them start generating after the push.
            metrics.update(self.pipeline.push(step, lambda: self._push_weights(step)))
        metrics.update(timing)
        # Throughput and MFU of the batch as generated (before rejection sampling).
        metrics.update(self._step_perf(generated, metrics))
        return metrics

    def _generated(
        self, step: int, timing: dict[str, float]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The generated and scored batch of step `step`: made here, or taken from the separate rollout pool's
        producer (maybe generated while the previous steps trained) with the weight version it used
        (off_policy/staleness: the updates it missed)."""
        if self.pipeline is None:
            return self.generate_batch(step)
        (batch, metrics), version = _timed(timing, "wait_rollout", self.pipeline.take, step)
        metrics["rollout/weight_version"] = version
        metrics["off_policy/staleness"] = step - 1 - version
        return batch, metrics

    def _log_prob_passes(self, batch: algorithms.StepBatch, timing: dict[str, float]) -> dict[str, Any]:
        """The plan's old and ref log-prob passes (StepPasses) into `batch`, with the rollout correction on a
        recomputed old log-prob; returns their metrics."""
        passes = self.plan.passes
        assert passes is not None
        metrics: dict[str, Any] = {}
        if passes.old_log_prob == "rollout":  # bypass mode: the rollout's own log-probs are the old policy
            batch.old_log_probs = batch.rollout_log_probs
        elif passes.old_log_prob == "recompute":  # ("update": the update's own forward gives them)
            if passes.fused:  # old and ref log-probs on one scatter of the batch, in one worker call
                t0 = time.perf_counter()
                old = self._dispatch_rows(
                    self.policy, "actor", "compute_old_and_ref_log_prob", batch.worker_batch()
                )
                ref_s = float(old.pop("ref_seconds").max())
                timing["timing/old_log_prob_s"] = time.perf_counter() - t0 - ref_s
                timing["timing/ref_s"] = ref_s
                batch.ref_log_probs = old["ref_log_probs"]
            else:
                old = _timed(timing, "old_log_prob", self._dispatch_rows, self.policy, "actor", "compute_log_prob",
                             batch.worker_batch())  # fmt: skip
            batch.old_log_probs, batch.entropy = old["log_probs"], old["entropy"]
            metrics.update(algorithms.old_log_prob_metrics(batch))
            metrics.update(algorithms.apply_rollout_correction(batch, passes, self.plan.algorithm))
        if passes.ref_log_prob and batch.ref_log_probs is None:
            ref = _timed(timing, "ref", self._dispatch_rows, self.policy, "actor", "compute_ref_log_prob",
                         batch.worker_batch())  # fmt: skip
            batch.ref_log_probs = ref["log_probs"]
        return metrics

    def _advantages_and_updates(
        self, step: int, batch: algorithms.StepBatch, metrics: dict[str, Any], timing: dict[str, float]
    ) -> str | None:
        """Rewards (KL penalty) and advantages, then the critic and actor updates of step `step` into
        `metrics`; returns the first non-finite quantity (None: all finite), and runs no update after it.
        The updates' losses are over the accepted tokens when rejection sampling removed some."""
        alg, passes = self.plan.algorithm, self.plan.passes
        assert alg is not None and passes is not None
        metrics.update(algorithms.rewards_and_advantages(batch, alg, self.kl_ctrl))
        mask = batch.response_mask
        bad = first_bad([("advantages", batch.advantages, mask),
                         ("returns", batch.returns if self.critic is not None else None, mask)])  # fmt: skip
        if bad is not None:
            return bad
        if self.critic is not None:
            critic_batch = batch.worker_batch("values", "returns")
            metrics.update(_timed(timing, "update_critic", self._dispatch_update, self.critic, "critic", "update_critic",
                                  critic_batch, step)[0])  # fmt: skip
        if step > alg.critic_warmup:
            on_policy = ("rollout_log_probs",) if passes.old_log_prob == "update" else ()
            actor_batch = batch.worker_batch("old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights",
                                             *on_policy)  # fmt: skip
            metrics.update(_timed(timing, "update_actor", self._dispatch_update, self.policy, "actor", "update_actor",
                                  actor_batch, step)[0])  # fmt: skip
        return bad_update(metrics)

    def _step_perf(self, model_batch: dict[str, torch.Tensor], metrics: dict[str, Any]) -> dict[str, Any]:
        """perf/mfu/actor_update and perf/mfu/log_prob (model FLOPs of the policy over the actor's devices'
        peak; only where the peak is known), perf/rollout_tokens_per_s (response tokens over the generation
        time, all rollout devices together) and the step's peak device memory per role call."""
        out: dict[str, Any] = {}
        spec, lay = self.plan.model("policy"), self.plan.layout("actor")
        a = spec.arch
        tokens = float(model_batch["attention_mask"].sum())
        mean_len = tokens / max(int(model_batch["attention_mask"].shape[0]), 1)
        gen_s = metrics.get("timing/generate_s", 0.0) - metrics.get("timing/reward_s", 0.0)
        if not self.plan.algorithm.filter_groups.enabled and self.agent is None and gen_s > 0:
            # (Dynamic sampling and multi-turn generate more than the batch holds, or wait on tools.)
            out["perf/rollout_tokens_per_s"] = float(model_batch["response_mask"].sum()) / gen_s
        active = metrics_lib.matmul_params(a, spec.params_active)
        per_token = {train: metrics_lib.flops_per_token(active, a.num_layers, metrics_lib.attention_width(a),
                                                        mean_len, train) for train in (True, False)}  # fmt: skip
        update_s = metrics.get("timing/update_actor_s", 0.0)
        epochs = self.plan.batch_plan("actor").ppo_epochs
        mfu = metrics_lib.model_flops_utilization(
            tokens * per_token[True] * epochs, update_s, self.peak_flops, lay.world_size
        )
        if mfu is not None:
            out["perf/mfu/actor_update"] = mfu
        passes = [k for k in ("old_log_prob", "ref") if f"timing/{k}_s" in metrics]
        log_prob_s = sum(metrics[f"timing/{k}_s"] for k in passes)
        mfu = metrics_lib.model_flops_utilization(
            tokens * per_token[False] * len(passes), log_prob_s, self.peak_flops, lay.world_size
        )
        if mfu is not None:
            out["perf/mfu/log_prob"] = mfu
        if devices.is_accelerator(self.plan.resources.device):
            # A separate rollout pool is busy generating ahead: its peaks came with the batch.
            ranks = [m for g in self.groups.values() if self.pipeline is None or g is not self.rollout_group
                     for m in g.call("step_memory")]  # fmt: skip
            ranks += metrics.pop("_rollout_memory", [])
            out.update(metrics_lib.memory_metrics(ranks))
        return out

    def dynamic_sampling(
        self, step: int, prompts: PromptBatch
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """DAPO dynamic sampling (algorithm.filter_groups): generate batches of prompts, keep the groups whose
        metric has spread (`algorithms.groups_with_spread`), until data.train_batch_size groups are kept;
        the batch is their first train_batch_size groups. Generation batch i > 1 samples from
        (seed, step, "rollout/i"). Reward and length metrics cover every generated response (the policy's
        quality, not the filter's selection); filter/* count the groups and batches."""
        fg, sizes = self.plan.algorithm.filter_groups, self.plan.batch_plan("actor")
        n, want = sizes.responses_per_prompt, sizes.prompts_per_step
        kept: list[dict[str, torch.Tensor]] = []
        generated: list[dict[str, torch.Tensor]] = []
        n_kept = 0
        metrics: dict[str, Any] = {}
        while True:
            if generated:
                prompts = next(self.train_data)
            seed = derive_seed(
                self.run.seed, step, ROLLOUT if not generated else f"{ROLLOUT}/{len(generated) + 1}"
            )
            batch, batch_metrics = self.rollout(prompts, n, seed)
            if not generated:
                metrics = batch_metrics
            else:
                metrics["perf/total_num_tokens"] += batch_metrics["perf/total_num_tokens"]
                metrics["timing/reward_s"] += batch_metrics["timing/reward_s"]
                if GENERATIONS_KEY in metrics:  # every generated response is recorded, kept or not
                    metrics[GENERATIONS_KEY] += batch_metrics[GENERATIONS_KEY]
            generated.append(batch)
            rows = algorithms.groups_with_spread(
                algorithms.filter_metric(batch, fg.metric), batch["group_index"]
            )
            kept.append(algorithms.select_rows(batch, rows))
            n_kept += int(rows.sum()) // n
            if n_kept >= want:
                break
            if fg.max_num_gen_batches and len(generated) >= fg.max_num_gen_batches:
                raise ConfigError([error(
                    "algorithm.filter_groups.max_num_gen_batches",
                    f"step {step}: {len(generated)} generation batches gave {n_kept} prompt groups whose "
                    f"{fg.metric} varies, fewer than data.train_batch_size = {want}",
                    "raise max_num_gen_batches (0: no bound), use easier prompts, or raise rollout.n",
                    "filter-groups")])  # fmt: skip
        pad = self.tokenizer.pad_token_id
        batch = algorithms.select_rows(algorithms.concat_batches(kept, pad), slice(0, want * n))
        everything = algorithms.concat_batches(generated, pad)
        lengths = everything["response_mask"].sum(-1).float()
        metrics.update({
            "reward/mean": everything["scores"].mean().item(),
            "reward/max": everything["scores"].max().item(),
            "reward/min": everything["scores"].min().item(),
            "response/length_mean": lengths.mean().item(),
            "response/clip_ratio": (lengths >= self.plan.rollout.max_response_length).float().mean().item(),
            "filter/kept_groups": n_kept,
            "filter/gen_batches": len(generated),
            "filter/kept_ratio": n_kept / (len(generated) * want),
            "filter/kept_reward_mean": batch["scores"].mean().item(),
        })  # fmt: skip
        if "overlong_penalty" in everything:
            metrics["reward/score_mean"] = (
                (everything["scores"] - everything["overlong_penalty"]).mean().item()
            )
            metrics["reward/overlong_penalty_mean"] = everything["overlong_penalty"].mean().item()
        return batch, metrics

    def validate(self, step: int) -> dict[str, Any]:
        """Mean reward of the validation prompts (one pass, validation sampling) with the weights after
        `step` training steps (0: before training); batch i samples from (seed, step, "validate/i")."""
        if self.val_data is None:
            return {}
        scores, lengths, rows = [], [], []
        for i, prompts in enumerate(self.val_data):
            seed = derive_seed(self.run.seed, step, f"{VALIDATE}/{i}")
            batch, metrics = self.rollout(
                prompts, self.plan.rollout.val_responses_per_prompt, seed, validate=True
            )
            scores.append(batch["scores"])
            lengths.append(batch["response_mask"].sum(-1).float())
            rows += metrics.pop(GENERATIONS_KEY, [])
        log = self.run.logging
        if log.validation_data_dir:
            generations.write_step_file(log.validation_data_dir, step, rows)
        if log.val_generations:
            # The same rows at every validation (the set and its order are fixed): read through training.
            chosen = generations.fixed_sample(len(rows), log.val_generations, derive_seed(
                self.run.seed, 0, VAL_SAMPLES))  # fmt: skip
            self.logger.log_generations(step, [{**rows[i], "row": i} for i in chosen])
        return {
            "val/reward/mean": torch.cat(scores).mean().item(),
            "val/response/length_mean": torch.cat(lengths).mean().item(),
        }

    # ------------------------------------------------------------------------------------ the loop
    def fit(self) -> None:
        run = self.run
        start = self.start_step
        # A resumed run redoes the steps after its checkpoint: their old lines go, so no step appears twice.
        self.logger.truncate_after(start - 1)
        save_steps = set(self.plan.checkpoint.save_steps)
        # Validation before training is logged with the first step, as `val_before/...`, so every line of
        # metrics.jsonl is a training step.
        before = {f"val_before/{k.removeprefix('val/')}": v for k, v in self.validate(start - 1).items()} if (
            run.val_before_train) else {}  # fmt: skip
        for step in range(start, run.total_steps + 1):
            t0 = time.perf_counter()
            metrics = self.train_step(step)
            if step == start:
                metrics.update(before)
            if run.test_freq and (step % run.test_freq == 0 or step == run.total_steps):
                with self.pipeline.exclusive() if self.pipeline is not None else contextlib.nullcontext():
                    metrics.update(self.validate(step))
            self._finalize_saves(blocking=False)  # commit background saves that finished meanwhile
            if step in save_steps and CAUSE_KEY not in metrics and not self._weights_finite():
                metrics[CAUSE_KEY] = "weights"
            # A bad step is not checkpointed: the newest checkpoint stays the last finite step's.
            metrics.update(self.guard.record(step, metrics.get(CAUSE_KEY)))
            if step in save_steps and CAUSE_KEY not in metrics:
                t_save = time.perf_counter()
                self._save(step)
                metrics["timing/save_checkpoint_s"] = time.perf_counter() - t_save
            metrics["timing/step_s"] = time.perf_counter() - t0
            # tokens per second per device over the whole step (generation, log-probs, updates, saves)
            tokens_per_s = metrics["perf/total_num_tokens"] / metrics["timing/step_s"]
            metrics["perf/throughput"] = tokens_per_s / self.plan.resources.total_devices
            metrics.update(metrics_lib.phase_shares(metrics))
            self.logger.log(step, metrics)
            self._logged_step = step
            # Prompt-order states of logged steps are no longer needed (a save of the step took its own).
            for done in [s for s in list(self._data_states) if s <= step]:  # list(): one atomic copy
                del self._data_states[done]
            # Commit only after the step's metrics line is written: a crash in between redoes the step, a
            # crash after it resumes after the step; metrics.jsonl never has a gap.
            self._finalize_saves(blocking=False)
            if self.guard.diverged:
                self._finalize_saves(blocking=True)
                self.logger.close()
                raise self.guard.error(step, self.ckpt.read_latest_file())
        self._finalize_saves(blocking=True)  # never exit with a save still being written
        self.reward_profiler.close()
        self.logger.close()
        if self.plan.profile.enabled:
            for group in self.groups.values():
                group.call("finish")  # flush continuous profiles before the summary reads them
            summary = write_summary(self.plan.profile.save_path)
            print(f"profile summary: {summary}\n{summary.read_text()}", flush=True)
        if run.logging.plot_reward:
            plot_reward_curve(self.out / "metrics.jsonl", self.out / REWARD_PLOT, title=run.experiment_name)

    def _settle_saves(self) -> None:
        """On a stop: staged saves of steps whose metrics line is written are finished (each worker first
        ends the call the stop abandoned) and committed; any other staged save is removed by `shutdown`."""
        keep = [step for step in self.ckpt.pending_steps() if step <= self._logged_step]
        if not keep:
            return
        print(f"stopping: finishing the checkpoint of step {keep[-1]}", file=sys.stderr, flush=True)
        try:
            for group in self._trained_groups().values():
                group.call("finalize_checkpoint", per_rank_args=[(True,)] * group.world_size)
            for step in keep:
                if self.ckpt.ready(step):
                    self.ckpt.commit(step)
                    self.ckpt.apply_retention(self.plan.checkpoint.max_ckpt_to_keep)
        except (WorkerError, CheckpointError) as exc:
            print(f"stopping: the checkpoint could not be finished ({exc}); it is removed", file=sys.stderr)

    def shutdown(self, stopping: bool = False, failed: bool = False, settle: bool = True) -> None:
        """End the workers and give their devices back. `stopping` (SIGINT / SIGTERM): the step in flight is
        abandoned, a save is committed or removed (`_settle_saves`), and workers are not asked to flush
        profiles (that call would wait behind the abandoned one). `failed` (a worker failed or died): no call
        reaches the workers at all, since the ranks that did not fail may wait in a collective for the one
        that did, and a call queued behind that wait would hang until the collective's timeout. `settle`:
        False when the caller already settled the saves (run_training does, before bounding the rest)."""
        if settle and stopping and not failed and not local_cluster_down():
            self._settle_saves()
        if self.pipeline is not None:
            self.pipeline.close()
        if self.agent is not None:
            self.agent.close()
        # On a stop or a failure Ray itself may be going down (a signal reaches its processes too): a failed
        # kill or release RPC then changes nothing, and must not turn a clean stop into an internal error.
        # If the signal also ended the local cluster's GCS / raylet, no Ray call can be answered (each would
        # wait 60 s, then abort the process): the workers die with the cluster (the reaper) and none is made.
        ray_down = contextlib.suppress(Exception) if stopping or failed else contextlib.nullcontext()
        reachable = not ((stopping or failed) and local_cluster_down())
        for group in self.groups.values() if reachable else ():
            if not (stopping or failed):
                with contextlib.suppress(WorkerError):
                    group.call("finish")
            with ray_down:
                group.shutdown()
        # The workers are gone, so nothing writes into a staged save any more: remove what was not committed.
        self.ckpt.abort_pending()
        for pool in self.pools if reachable else ():
            with ray_down:
                pool.release()
        if stopping:
            self.logger.close()
        if self._own_folder:
            self.run_folder.close()


RELEASE_TIMEOUT_S = 20.0
"""After a worker failure, the longest the driver waits for Ray to end the workers and the local cluster."""
STOP_RELEASE_TIMEOUT_S = 2.5
"""After SIGINT / SIGTERM (once the saves are settled), the longest the driver waits for Ray to end the
workers and the local cluster: a run must stop within 5 s, as `timeout`, Slurm and Kubernetes expect. A
SIGTERM sent to the whole process group reaches Ray's GCS too, which then stops answering at once but
takes ~10 s to exit (Ray 2.60, measured): `remove_placement_group` waits on it, and the run took 21 s to
stop. Whatever is left when the wait ends goes with the driver (rltrain.ray_reaper kills the cluster)."""


def _release(trainer: Trainer | None, stopping: bool, failed: bool) -> bool:
    """End the workers and the local Ray cluster; True when done. On a stop this waits at most
    STOP_RELEASE_TIMEOUT_S, after a failure RELEASE_TIMEOUT_S, and not at all once the local cluster's
    GCS or raylet is gone (a signal sent to the whole process group reaches them too, and every Ray call
    would then wait for them); errors of Ray going down are ignored there."""

    def release() -> None:
        if trainer is not None:
            trainer.shutdown(stopping=stopping, failed=failed, settle=False)
        import ray

        if ray.is_initialized() and not os.environ.get("RAY_ADDRESS") and not local_cluster_down():
            with contextlib.suppress(Exception) if stopping or failed else contextlib.nullcontext():
                ray.shutdown()

    def release_reporting() -> None:
        try:
            release()
        except Exception as exc:  # the run is stopping anyway: one line, not a traceback
            print(f"stopping: releasing the workers failed ({type(exc).__name__}: {exc})", file=sys.stderr)

    if not (stopping or failed):
        release()
        return True
    if stopping and not failed and trainer is not None and trainer.ckpt.pending_steps():
        # A save of a logged step is finished (unbounded: a large model's save takes what it takes), unless
        # the signal ended Ray's own processes too (a moment for them to go, then they are checked).
        time.sleep(1.0)
        if not local_cluster_down():
            trainer._settle_saves()
    worker = threading.Thread(target=release_reporting, name="rlplan-release", daemon=True)
    worker.start()
    deadline = time.monotonic() + (RELEASE_TIMEOUT_S if failed else STOP_RELEASE_TIMEOUT_S)
    while worker.is_alive() and time.monotonic() < deadline and not local_cluster_down():
        worker.join(0.1)
    released = not worker.is_alive()
    if not released and stopping and trainer is not None:
        # Ray did not answer in time and the driver exits next, taking the cluster and its workers along:
        # drop an uncommitted staged save now rather than leave it for the next start's cleanup (a worker
        # still writing as it dies can only leave scratch that cleanup_incomplete removes).
        trainer.ckpt.abort_pending()
    return released


def _worker_failure_fix(exc: WorkerError, folder: RunFolder | None) -> str:
    """What to do after a worker failure. A process that died (killed, out of memory, a lost node) may well
    run on a rerun; an exception a worker raised is met again by a rerun unless its cause is fixed first."""
    steps = folder.ckpt.complete_steps() if folder is not None else []
    where = (
        f"the last complete checkpoint (step {steps[-1]})" if steps else "step 1 (there is no checkpoint yet)"
    )
    if exc.died:
        return (f"see the worker's log above for why the process ended (out of memory, killed, a lost node); "
                f"rerun the same command to resume from {where}")  # fmt: skip
    return (f"the worker's log above shows the cause; a rerun as is meets it again. Once it is fixed, the same "
            f"command resumes from {where} (trainer.resume_mode: auto)")  # fmt: skip


def run_training(plan: TrainerPlan, document: ConfigDocument) -> int:
    """Run a whole training job; returns the process exit code (0 done or nothing to do, 1 a worker failed,
    3 (DIVERGED_EXIT) trainer.max_bad_steps bad steps in a row, 130 / 143 stopped by SIGINT / SIGTERM; a
    ConfigError, exit 2, propagates).

    Before Ray starts: the device check, then the run folder is locked and checked (`RunFolder.open`: another
    run holding it, a changed config, a finished run). The lock is held until the process exits.
    `document`: the run's config as the run folder records and compares it (the CLI layer makes it)."""
    run = plan.run
    if not (run.cluster.ray_address or os.environ.get("RAY_ADDRESS")):
        # The local Ray cluster's workers run on this machine: a device it lacks (no GPU, no torch_npu /
        # CANN / MindSpeed) is a config error with what to install (exit 2), found before Ray starts, not
        # a placement group that never fills. A remote cluster's nodes are other machines.
        devices.check_available(run.cluster.device)
    # Before the run folder is touched: a cluster that does not answer or is too small (rltrain --dry-run
    # checks the same, and the disk).
    from rltrain.preflight import check_cluster, check_disk, check_engine

    for note in check_engine(plan):  # a model the plan sizes but the engine cannot train exactly
        print(f"note: {note}", flush=True)
    check_cluster(plan)
    stop = StopSignals()
    stop.install()
    folder = trainer = None
    code = 0
    failed = False
    released = True
    diverged: DivergedError | None = None
    try:
        try:
            folder = RunFolder.open(document, plan)
            if folder.finished:
                print(folder.finished, flush=True)
                return 0
            check_disk(plan)  # room for a checkpoint, before config.yaml / plan.json are written
            trainer = Trainer(plan, document, run_folder=folder, stop_signals=stop)
            trainer.fit()
        except KeyboardInterrupt:
            code = stop.exit_code()
        except DivergedError as exc:  # the run stopped itself: workers are healthy, a normal release
            diverged = exc
        except ConfigError:
            failed = trainer is not None  # raised by a worker: the other ranks may wait for it
            raise
        except OSError as exc:  # the run folder's filesystem (full, read-only): one line, not a crash
            if (errno_ := storage_errno(exc, run.output_dir)) is None:
                raise
            failed = trainer is not None
            raise storage_error(errno_, f"a file of the run could not be written to {run.output_dir}",
                                run.output_dir, plan.checkpoint.size_bytes,
                                "every complete checkpoint is intact") from None  # fmt: skip
        except WorkerError as exc:
            if stop.signum is not None:  # a worker ended by the same signal (Ctrl-C reaches the whole group)
                code = stop.exit_code()
            else:
                failed = True
                print(f"error: {exc}\n    fix: {_worker_failure_fix(exc, folder)}", file=sys.stderr)
                return 1
        finally:
            released = _release(trainer, stopping=code != 0, failed=failed)
    finally:
        if folder is not None:
            if code:
                print(folder.stop_message(stop.signum or signal.SIGINT), file=sys.stderr, flush=True)
            folder.close()
        stop.restore()
        if not released:
            # Ray's own processes did not answer (the signal reached them too: `timeout`, Slurm's scancel):
            # exit now, as atexit's ray.shutdown would wait for them and then abort. The run folder is
            # consistent (every save is committed atomically or not at all); the cluster goes with us.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 1)
    if code:
        return code
    if diverged is not None:
        print(f"error: {diverged}", file=sys.stderr, flush=True)
        return DIVERGED_EXIT
    print(f"done: {run.output_dir}/metrics.jsonl, {run.output_dir}/{REWARD_PLOT}")
    return 0
