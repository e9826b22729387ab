"""The policy on megatron-core: log-probs, PPO/GRPO updates and a simple sampler on the actor's own weights.

`MegatronActor` is built from the plan (`from_plan`: the role's model, layout, batch schedule and lr table;
tests and benchmarks compile a small plan first, `rlconf.plan.small_plan`) and works on one
data-parallel rank's share of a batch (layout: rltrain/megatron/engine.py). Every method runs through
megatron's pipeline schedules (`get_forward_backward_func`), so TP, PP and virtual PP behave alike, and
returns its results on every rank. The losses come from rltrain.algorithms (one tested definition shared
with the controller). The same class serves the frozen reference policy (`trainable=False`: parameters
only, no DDP gradient buffer, no optimizer; `init_from=actor` starts it from the actor's weights).
Log-probs and entropy are computed from the vocabulary-parallel logits in token chunks (logprob.py).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from rlconf.seeding import GENERATE, derive_seed
from rltrain import algorithms
from rltrain.megatron import context_parallel as cp
from rltrain.megatron.engine import MegatronEngine, MicroBatch
from rltrain.megatron.inference import sample_tokens
from rltrain.megatron.logprob import token_log_probs_and_entropy
from rltrain.megatron.lora import generation_weights
from rltrain.megatron.model import MoeRoutingStats
from rltrain.megatron.update import TrainedEngine
from rltrain.rollout.batch import rollout_batch

if TYPE_CHECKING:
    from rlconf.plan import EnginePlan, TrainerPlan
    from rlconf.plan.algorithm import LossPlan


def _loss_plan(plan: TrainerPlan) -> LossPlan:
    return plan.algorithm.loss


class MegatronActor(TrainedEngine):
    """Policy (or reference policy when `optim` is None) on this rank."""

    @classmethod
    def from_plan(
        cls,
        plan: TrainerPlan,
        role: str = "actor",
        init_from: MegatronEngine | None = None,
        frozen: bool = False,
    ) -> MegatronActor:
        """The actor (role "actor") or the frozen reference policy (role "ref") of a compiled plan; `frozen`:
        the actor's engine without optimizer (a reference policy on the actor's layout). Its loss settings are
        the plan's LossPlan; router replay is the rollout plan's."""
        spec = plan.engine(role)
        actor = cls.__new__(cls)
        actor._build_actor(spec.frozen("ref") if frozen else spec, plan.rollout.router_replay, init_from)
        actor.loss = _loss_plan(plan)
        return actor

    def _build_actor(self, spec: EnginePlan, router_replay: bool, init_from: MegatronEngine | None) -> None:
        # Sizes come from `spec`; the loss settings are set by the caller (`self.loss`, the plan's LossPlan).
        self.router_replay = router_replay
        self._build(spec, init_from)
        self.vocab_size = self.arch.vocab_size
        self._sample_calls = 0
        # Response tokens per chunk of the log-prob / entropy computation; None: a fixed fp32 working-set
        # budget (rltrain.megatron.logprob.DEFAULT_CHUNK_ELEMENTS / (V / tp)).
        self.logprob_chunk_tokens: int | None = None

    def use_batch_settings(self, plan: TrainerPlan) -> None:
        """Benchmarks that vary batching on one engine: later calls use the batch schedule and forward
        sizes of `plan`'s actor (a plan compiled for other batch settings, `rlconf.plan.small_plan`) and its
        loss settings; the weights, optimizer and lr table stay."""
        planned = plan.engine("actor")
        self.router_replay = plan.rollout.router_replay
        self.loss = _loss_plan(plan)
        forward = ("forward_micro_batch_size", "forward_use_dynamic_bsz", "forward_max_token_len",
                   "remove_padding", "remove_padding_reason")  # fmt: skip
        settings = replace(self.spec.settings, **{k: getattr(planned.settings, k) for k in forward})
        self.spec = replace(self.spec, batch=planned.batch, settings=settings)

    # --------------------------------------------------------------------------------- log-probs
    def _token_log_probs(
        self, mb: MicroBatch, logits: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) [b, R] of the response tokens, 0 on padding, from logits [b, L, V/tp]
        (with context parallel: this CP rank's [b, L / CP, V/tp] chunks; the loss functions are
        `context_parallel.CpLocalLoss`es; a packed micro-batch: [1, T, V/tp] of all its rows).

        Only the valid response positions are evaluated, in token chunks (logprob.py): no [b, R, V/tp]
        copy and no fp32 copy of the whole micro-batch's logits is made. With context parallel each rank
        evaluates the response tokens whose predicting position it holds, and only the [b, R] results are
        summed over the CP group.
        """
        b, length, shard = logits.shape
        shape = mb.data["response_mask"].shape
        if mb.response_index is not None and self.cp_size == 1:
            # The valid tokens by their indices found on the host: a boolean mask here would read its count
            # back (a wait for the whole forward), and masked_scatter's backward another.
            flat = mb.response_index
            rows = mb.flat_index().reshape(-1).index_select(0, flat)
            responses = mb.data["responses"].reshape(-1).index_select(0, flat)

            def place(values: torch.Tensor) -> torch.Tensor:
                zeros = torch.zeros(shape.numel(), dtype=torch.float32, device=logits.device)
                return zeros.index_copy(0, flat, values).view(shape)
        else:
            local, held = cp.to_local(mb.gather_index, length * self.cp_size)
            mask = mb.data["response_mask"].bool() & held
            rows = (torch.arange(b, device=logits.device).unsqueeze(1) * length + local)[mask]
            responses = mb.data["responses"][mask]

            def place(values: torch.Tensor) -> torch.Tensor:
                return torch.zeros(shape, dtype=torch.float32, device=logits.device).masked_scatter(
                    mask, values
                )

        logp, ent = token_log_probs_and_entropy(
            logits.reshape(b * length, shard),
            rows,
            responses,
            temperature,
            self.vocab_size,
            with_entropy=with_entropy,
            chunk_tokens=self.logprob_chunk_tokens,
            fused=self.fused_kernels,
        )
        if ent is None:
            return cp.sum_over_cp(place(logp)), None
        both = cp.sum_over_cp(torch.stack([place(logp), place(ent)]))
        return both[0], both[1]

    def compute_log_prob(
        self, batch: dict[str, torch.Tensor], temperature: float = 1.0, with_entropy: bool = True
    ) -> dict[str, torch.Tensor]:
        """Per-token log-probs ([B, R], 0 on padding) of `responses` and, optionally, the entropy.

        Micro-batches are the plan's (`EnginePlan.forward_micro_batch_size` rows, or with dynamic batch size
        at most `forward_max_token_len` tokens: padded, or packed with `EnginePlan.remove_padding`); outputs
        are in the batch's row order either way.
        """
        with self._ctx():
            self.eval()
            mbs = self.forward_micro_batches(batch)

            @cp.CpLocalLoss
            def loss_fn(mb: MicroBatch, logits: torch.Tensor):
                logp, ent = self._token_log_probs(mb, logits, temperature, with_entropy)
                out = {"log_probs": logp}
                if ent is not None:
                    out["entropy"] = ent
                return logp.new_zeros(()), out

            with self._routing_replay(mbs):
                outputs = self.run_schedule(mbs, loss_fn, forward_only=True)
            r = batch["responses"].shape[1]
            keys = ["log_probs", "entropy"] if with_entropy else ["log_probs"]
            return {k: self.rows_in_order(mbs, outputs, k, (r,)) for k in keys}

    # --------------------------------------------------------------------------------- update
    def update_policy(
        self,
        batch: dict[str, torch.Tensor],
        temperature: float = 1.0,
        step: int | None = None,
        on_policy: bool = False,
    ) -> dict[str, float]:
        """PPO/GRPO update on this rank's batch: ppo_epochs x mini-batches x micro-batches, one optimizer
        step per mini-batch, as the plan's BatchPlan schedules them, at the lr of the plan's table for
        training step `step`. Returns mean metrics (actor/loss, actor/pg_clipfrac, actor/ppo_kl,
        actor/entropy, actor/grad_norm, actor/lr, ...).

        `temperature` must be the one `old_log_probs` were computed with (rollout.temperature), so that the
        PPO ratio compares like with like. Each mini-batch's loss is aggregated over the whole mini-batch
        across all DP ranks (`loss_agg_mode`; see `MegatronEngine.micro_batch_weight`): the update does
        not depend on how rows fall into micro-batches or onto DP ranks. Every DP rank must hold the same
        number of rows. `step` (the training step) picks the lr row and keys the update's dropout and
        shuffle streams (`seed_update`; None outside a run: the engine's next update).

        `on_policy` (the plan's `StepPasses.old_log_prob == "update"`: one mini-batch, one epoch): the batch
        has no `old_log_probs`; the update's own log-probs, detached, stand in for them (the ratio is
        exactly 1), so no separate pass is needed. With `rollout_log_probs` in the batch it also reports
        what that pass would have: rollout/logprob_diff_max and actor/entropy_rollout.
        """
        assert self.trainable, "update_policy on a frozen (reference) actor"
        if on_policy:
            assert "old_log_probs" not in batch, "on-policy update: the old log-probs are the update's own"
            assert self.spec.batch is not None and self.spec.batch.optimizer_steps_per_training_step == 1, (
                "on-policy update with more than one optimizer step per training step"
            )
        use_kl = self.loss.use_kl_loss and "ref_log_probs" in batch
        names = ["actor/loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/ppo_kl_k3",
                 "actor/entropy"] + (["actor/kl_loss"] if use_kl else [])  # fmt: skip
        # On-policy: [largest |rollout - update log-prob|, entropy sum, response tokens] of this rank.
        rollout_stats = [0.0, 0.0, 0.0] if on_policy and "rollout_log_probs" in batch else None
        routing = MoeRoutingStats(self.chunks, self.torch_device)  # MoE metrics; none for a dense model

        def loss_for(totals: tuple[float, float]) -> cp.CpLocalLoss:
            return cp.CpLocalLoss(functools.partial(self._policy_loss, use_kl=use_kl, totals=totals,
                                                    temperature=temperature, on_policy=on_policy,
                                                    rollout_stats=rollout_stats))  # fmt: skip

        result = self.run_update(batch, step, prefix="actor", names=names, shuffle=self.loss.shuffle,
                                 loss_for=loss_for, around=routing, per_mini_batch=self._routing_replay)  # fmt: skip
        metrics = result.metrics
        metrics.update(routing.metrics)
        if rollout_stats is not None:
            metrics.update(self._reduce_rollout_stats(rollout_stats))
        # Tokens (prompt + response) processed by forward+backward per second on this rank.
        metrics["perf/actor_update_tokens_per_s"] = result.tokens / max(result.seconds, 1e-9)
        return metrics

    def _policy_loss(
        self,
        mb: MicroBatch,
        logits: torch.Tensor,
        use_kl: bool,
        totals: tuple[float, float],
        temperature: float,
        on_policy: bool = False,
        rollout_stats: list[float] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lp = self.loss
        d = mb.data
        mask = d["response_mask"].float()
        need_entropy_grad = lp.entropy_coeff != 0.0
        # The entropy is always computed (a metric); it adds to the gradient only with an entropy bonus.
        logp, ent = self._token_log_probs(mb, logits, temperature, with_entropy=True)
        assert ent is not None
        # On-policy the weights being updated are the old policy: their own log-probs are the old ones.
        old_log_probs = logp.detach() if on_policy else d["old_log_probs"].float()
        if rollout_stats is not None:
            with torch.no_grad():
                gap = (d["rollout_log_probs"].to(logp.device).float() - logp).abs() * mask
                rollout_stats[0] = max(rollout_stats[0], float(gap.max()))
                rollout_stats[1] += float((ent * mask).sum())
                rollout_stats[2] += float(mask.sum())
        pg_loss, pg_metrics = algorithms.compute_policy_loss(
            old_log_probs,
            logp,
            d["advantages"].float(),
            mask,
            lp.clip_ratio_low,
            lp.clip_ratio_high,
            lp.clip_ratio_c,
            lp.loss_agg_mode,
            lp.loss_mode,
            lp.options,
            d.get("rollout_is_weights"),
        )
        entropy = algorithms.agg_loss(ent if need_entropy_grad else ent.detach(), mask, lp.loss_agg_mode)
        # Each term is weighted by its own aggregation's share of the mini-batch: the policy term may use the
        # loss mode's own (GSPO, SAPO: seq-mean-token-mean) while entropy and KL follow actor.loss_agg_mode,
        # as verl aggregates them.
        pg_mode = algorithms.policy_loss_agg_mode(lp.loss_mode, lp.loss_agg_mode)
        pg_weight = self.micro_batch_weight(d["response_mask"], pg_mode, totals)
        weight = self.micro_batch_weight(d["response_mask"], lp.loss_agg_mode, totals)
        scaled = pg_loss * pg_weight
        loss = pg_loss - lp.entropy_coeff * entropy if need_entropy_grad else pg_loss
        if need_entropy_grad:
            scaled = scaled - lp.entropy_coeff * entropy * weight
        extra = {
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": pg_metrics["pg_clipfrac"],
            "actor/ppo_kl": pg_metrics["ppo_kl"],
            # KL(pi_old || pi) by k3 = r - 1 - log r (r = pi / pi_old, samples from pi_old): >= 0 token by token,
            # unlike ppo_kl's k1 mean, so the plot's KL panel can show it.
            "actor/ppo_kl_k3": algorithms.masked_mean(
                algorithms.kl_penalty(old_log_probs, logp.detach(), "low_var_kl"), mask
            ),
            "actor/entropy": entropy.detach(),
        }
        if use_kl:
            kl = algorithms.kl_penalty(logp, d["ref_log_probs"].float(), lp.kl_loss_type)
            kl_loss = algorithms.agg_loss(kl, mask, lp.loss_agg_mode)
            loss = loss + lp.kl_loss_coef * kl_loss
            scaled = scaled + lp.kl_loss_coef * kl_loss * weight
            extra["actor/kl_loss"] = kl_loss.detach()
        extra["actor/loss"] = loss.detach()
        return scaled, extra

    def _routing_replay(self, mbs: list[MicroBatch]) -> contextlib.AbstractContextManager[object]:
        """With `actor.router_replay`, the policy's forward passes over `mbs` route each token to the experts
        the rollout recorded (rltrain/megatron/moe_replay.py); the reference model routes on its own (its
        weights are not the ones that generated)."""
        if not (self.trainable and self.router_replay):
            return contextlib.nullcontext()
        from rltrain.megatron.moe_replay import replay_routing

        return replay_routing(self.chunks, mbs, self.arch, self.config)

    def _reduce_rollout_stats(self, stats: list[float]) -> dict[str, float]:
        """The on-policy update's rollout metrics over all ranks (the loss ran on the last pipeline stage):
        the largest sampler / trainer log-prob gap and the token-mean entropy of the batch."""
        from megatron.core import parallel_state

        vals = torch.tensor(stats, dtype=torch.float64)
        vals = self.broadcast_from_last_stage(vals if self.is_last_stage else None, (3,), torch.float64).cpu()
        if self.dp_size > 1:
            group = parallel_state.get_data_parallel_group()
            gap = vals[:1].to(self.torch_device)
            sums = vals[1:].to(self.torch_device)
            torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX, group=group)
            torch.distributed.all_reduce(sums, group=group)
            vals = torch.cat([gap.cpu(), sums.cpu()])
        return {
            "rollout/logprob_diff_max": vals[0].item(),
            "actor/entropy_rollout": vals[1].item() / max(vals[2].item(), 1.0),
        }

    def compute_log_probs_with_ref(
        self, batch: dict[str, torch.Tensor], ref: MegatronActor, temperature: float = 1.0
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
        """The old log-probs (and entropy) of this actor and the log-probs of `ref` over one batch, in one
        call: (actor outputs, ref outputs, seconds of each pass as `actor` / `ref`)."""
        t0 = time.perf_counter()
        old = self.compute_log_prob(batch, temperature=temperature)
        t1 = time.perf_counter()
        ref_out = ref.compute_log_prob(batch, temperature=temperature, with_entropy=False)
        return old, ref_out, {"actor": t1 - t0, "ref": time.perf_counter() - t1}

    # --------------------------------------------------------------------------------- sampling
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        eos_id: int | None = None,
        pad_id: int = 0,
        prompt_mask: torch.Tensor | None = None,
        stop_token_ids: tuple[int, ...] = (),
        seed: int | None = None,
        min_p: float = 0.0,
        use_cache: bool = True,
        cuda_graph: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Sample responses with the actor's weights.

        prompt_ids [B, P] (left or right padded; `prompt_mask` 1 on real tokens, default prompt_ids != pad_id).
        temperature 0 is greedy. Returns a batch in the engine layout: `input_ids`, `attention_mask`,
        `position_ids` [B, P + N] (prompt left-padded, response right-padded), `responses`,
        `response_mask`, `rollout_log_probs` [B, N]. Every rank returns the same tensors.

        `use_cache` (default): the KV-cache engine of rltrain/megatron/inference.py (prefill once, then one
        token per step). `use_cache=False`, or a model the engine does not follow (`kv_cache_unsupported`:
        context parallel, Transformer Engine attention, ...): the reference path that re-runs the whole
        sequence for every token (no min_p). Both draw the same uniforms for a given seed.
        `cuda_graph`: the KV-cache engine decodes with static shapes, captured in CUDA graphs on a CUDA
        device (`inference.StaticDecodeStep`; eager elsewhere, and not with pipeline parallel).
        """
        from rltrain.megatron import inference

        if seed is None:  # outside a run (the controller passes each call's seed): a per-call stream
            seed = derive_seed(self.seed, self._sample_calls, GENERATE)
        if use_cache and inference.kv_cache_unsupported(self) is None:
            self._sample_calls += 1
            return inference.generate_with_kv_cache(
                self,
                prompt_ids,
                prompt_mask,
                max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                eos_id=eos_id,
                pad_id=pad_id,
                stop_token_ids=stop_token_ids,
                seed=seed,
                static_decode=cuda_graph,
            )
        if min_p > 0.0:
            raise NotImplementedError("min_p needs the KV-cache path (use_cache=True)")
        if prompt_mask is None:
            prompt_mask = (prompt_ids != pad_id).long()
        prompt_mask = prompt_mask.long()
        b, p = prompt_ids.shape
        stops = set(stop_token_ids) | ({eos_id} if eos_id is not None else set())
        # Left-pad prompts so responses start at column P for every row.
        plen = prompt_mask.sum(-1)
        start = prompt_mask.int().argmax(-1)
        cols = torch.arange(p)
        src = (start.unsqueeze(1) + cols - (p - plen).unsqueeze(1)).clamp(0, p - 1)
        left = torch.gather(prompt_ids, 1, src)
        left_mask = (cols.unsqueeze(0) >= (p - plen).unsqueeze(1)).long()
        left = torch.where(left_mask.bool(), left, torch.full_like(left, pad_id))
        responses = torch.full((b, max_new_tokens), pad_id, dtype=torch.long)
        resp_mask = torch.zeros((b, max_new_tokens), dtype=torch.long)
        logps = torch.zeros((b, max_new_tokens), dtype=torch.float32)
        done = torch.zeros(b, dtype=torch.bool)
        self._sample_calls += 1
        gen = torch.Generator().manual_seed(seed)
        with self._ctx(), generation_weights(self):
            self.eval()
            for t in range(max_new_tokens):
                batch = {
                    "input_ids": torch.cat([left, responses[:, :t]], 1),
                    "attention_mask": torch.cat([left_mask, resp_mask[:, :t]], 1),
                    "response_mask": resp_mask[:, :t],
                }
                # Rows that finished keep decoding on padding; their samples are discarded.
                tok, lp = self._sample_step(batch, temperature, top_p, top_k, gen)
                tok = torch.where(done, torch.full_like(tok, pad_id), tok)
                responses[:, t] = tok
                resp_mask[:, t] = (~done).long()
                logps[:, t] = torch.where(done, torch.zeros_like(lp), lp)
                if stops:
                    done = done | torch.isin(tok, torch.tensor(sorted(stops)))
                if bool(done.all()):
                    break
        return rollout_batch(left, left_mask, responses, resp_mask, logps)

    def _sample_step(
        self,
        batch: dict[str, torch.Tensor],
        temperature: float,
        top_p: float,
        top_k: int,
        gen: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token for every row from the logits at its last valid position; same result on all ranks."""
        b = batch["input_ids"].shape[0]
        mbs = self.micro_batches(batch, self.spec.forward_micro_batch_size)

        @cp.CpLocalLoss
        def loss_fn(mb: MicroBatch, logits: torch.Tensor):
            last = mb.data["attention_mask"].sum(-1) - 1
            # [b, V/tp] at each row's last position (from the CP rank that holds it).
            shard = cp.select_positions(logits, last.to(logits.device).view(-1, 1)).squeeze(1)
            # Only [b, V/tp] per step is gathered: sampling needs the whole distribution of one position.
            full = gather_from_tensor_model_parallel_region(shard.float().contiguous())
            return full.new_zeros(()), {"logits": full[:, : self.vocab_size]}

        outputs = self.run_schedule(mbs, loss_fn, forward_only=True)
        if self.is_last_stage:
            logits = torch.cat([o["logits"] for o in outputs], 0).cpu()
            tok, lp = sample_tokens(logits, temperature, top_p, top_k, generator=gen)
            packed = torch.stack([tok.double(), lp.double()], 0)
        else:
            packed = None
            # Keep the generator in step with the last stage (it draws one uniform per row).
            sample_tokens(torch.zeros(b, 1), 1.0, 1.0, -1, generator=gen)
        packed = self.broadcast_from_last_stage(packed, (2, b), torch.float64).cpu()
        return packed[0].long(), packed[1].float()


__all__ = ["MegatronActor"]
