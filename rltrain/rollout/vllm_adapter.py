"""`VLLMRollout`: a thin adapter from rlplan's rollout interface to vLLM's offline `LLM` (rollout.engine: vllm),
and `ColocatedVLLM`, what PolicyWorker runs it through on every actor rank.

Targeted API: vLLM 0.33 offline inference (the `vllm.LLM` / `vllm.SamplingParams` surface that has been
stable since the V1 engine): `LLM(model=..., tensor_parallel_size=..., gpu_memory_utilization=...,
max_num_seqs=..., enforce_eager=..., enable_sleep_mode=True, dtype=..., seed=..., load_format="dummy",
logprobs_mode="processed_logprobs", generation_config="vllm")`,
`LLM.generate(prompts=[{"prompt_token_ids": [...]}, ...], sampling_params=[one per prompt], use_tqdm=False)`
returning one `RequestOutput` per prompt with `.outputs[i].token_ids` and `.outputs[i].logprobs` (a list,
per token, of {token_id: Logprob(logprob=...)}; `SamplingParams(logprobs=0)` returns just the sampled
token's), and `LLM.sleep(level=1)` / `LLM.wake_up()` (level 1: weights to host memory, KV cache dropped).
Weights are updated through `LLM.collective_rpc(fn, args=...)`, which runs `fn(worker, ...)` on every
worker; `fn` calls `worker.model_runner.model.load_weights(weights)` (the HF-named iterable every vLLM
model implements). With a multi-process executor vLLM pickles `fn` (set VLLM_ALLOW_INSECURE_SERIALIZATION=1)
and the tensors; across processes prefer rltrain/rollout/weight_sync.py (a broadcast into `load_weights`).

In a run (PolicyWorker, `plan.refit.mode == "vllm"`), colocated on the actor's devices (`ColocatedVLLM`):
- Layout: the plan's rollout layout decides which ranks host an engine: the rank at rollout tp 0 of each
  rollout DP group (`plan.layout("rollout").grid`) starts vLLM at the plan's rollout TP
  (`plan.refit.rollout_tp`; null resolves to the actor's). vLLM starts from a folder holding only the
  model's config.json (`load_format="dummy"`: no weight files are written or read), because every
  generation is preceded by a full refit. `generation_config="vllm"` keeps a model folder's
  generation_config.json (e.g. a repetition penalty) out of the sampling: only rollout.* settings apply.
- Refit before each generation: the host wakes vLLM and streams the actor's weights in buckets of
  `plan.refit.bucket_mib` (`refit_from_actor`: the TP gather of weight_sync.iter_hf_weights -> bucketed
  `load_weights`); the other ranks take part in the TP gather (`take_part_in_refit`).
- Rows: the controller dispatches rows by the actor's DP layout (the n samples of a prompt are already
  separate rows: vLLM is asked for n = 1 per row). The ranks exchange their prompts (token ids), rollout DP
  rank d generates its contiguous share of all rows, the results are exchanged back and every rank returns
  its actor DP shard's rows in order, as rltrain/rollout/reshard.py does for the embedded engine. Row i of
  the whole call samples with its own seed `derive_seed(call seed, i, "vllm-row")`, so the samples do not
  depend on the rollout layout, and the n copies of a prompt do not share a seed.
- Colocation: with rollout.free_cache_engine the host puts vLLM to sleep after each generation (training
  gets the device memory back) and the next refit wakes it.
Validation (rule rollout-engine) says plainly when vLLM is not importable or the device is not CUDA.
This module was tested only against a stand-in `vllm` module (tests/test_vllm_adapter.py,
tests/test_vllm_worker.py): vLLM cannot be installed on the development machines (CUDA-only wheel, torch
2.14). Check it on a GPU host. On CUDA, a rollout TP > 1 needs vLLM's TP workers to see the devices of
their rollout TP group.

vLLM is imported lazily (only when the adapter is built) and a missing install is a ConfigError naming
`rollout.engine`. `generate` returns the batch layout of `MegatronActor.generate` (rltrain/rollout/batch.py:
prompts left-padded, responses right-padded, `rollout_log_probs` the sampled tokens' log-probs, with
`logprobs_mode="processed_logprobs"`: after temperature, the quantity `compute_log_prob` recomputes when
top-k / top-p / min-p are off; with them on, vLLM renormalises over the kept tokens, unlike the embedded
engine, which reports the distribution before filtering).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rlconf.errors import ConfigError, Issue
from rlconf.files import MAX_MODEL_CONFIG_BYTES, read_json
from rlconf.plan.run import RolloutPlan
from rlconf.seeding import derive_seed
from rltrain.rollout.batch import rollout_batch
from rltrain.rollout.weight_sync import SyncStats

INSTALL_HINT = "pip install 'rlplan[vllm]'"
ROW_SEED = "vllm-row"
"""Purpose of a row's sampling seed: `derive_seed(call seed, row of the whole call, ROW_SEED)`."""


def import_vllm() -> Any:
    """The `vllm` module, or a ConfigError on `rollout.engine` saying how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(
            [
                Issue(
                    "rollout.engine",
                    f"rollout.engine is 'vllm' but vLLM cannot be imported ({exc})",
                    f"{INSTALL_HINT} (CUDA only), or use rollout.engine: embedded",
                    "rollout-engine",
                )
            ]
        ) from exc
    return vllm


@dataclass(frozen=True)
class Sampling:
    """One rollout's sampling settings, in rlplan's terms (the plan's RolloutPlan names)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    eos_id: int | None = None
    n: int = 1
    seed: int | None = None

    @classmethod
    def from_rollout(
        cls, r: RolloutPlan, eos_id: int | None, validate: bool = False, seed: int | None = None
    ) -> Sampling:
        """The same choice as RolloutServer.generate_sequences makes for the embedded engine."""
        s = r.sampling(validate)
        return cls(
            max_new_tokens=r.max_response_length,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            stop_token_ids=tuple(r.stop_token_ids),
            eos_id=eos_id,
            seed=seed,
        )


def sampling_params(vllm: Any, s: Sampling) -> Any:
    """vllm.SamplingParams for `s`: one log-prob per token (the sampled one), token ids only. The EOS id
    is a stop token like the embedded engine's (vLLM started without a tokenizer knows no EOS of its own)."""
    stops = list(s.stop_token_ids)
    if s.eos_id is not None and s.eos_id not in stops:
        stops.append(s.eos_id)
    return vllm.SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        # rlplan's "disabled" is -1; vLLM's is 0 (it also accepts -1 in older releases).
        top_k=s.top_k if s.top_k > 0 else 0,
        min_p=s.min_p,
        max_tokens=s.max_new_tokens,
        stop_token_ids=stops,
        # No EOS given: generate the full length (as the embedded engine with eos_id=None).
        ignore_eos=s.eos_id is None,
        logprobs=0,
        seed=s.seed,
        detokenize=False,
    )


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside every vLLM worker (collective_rpc): copy HF-named tensors into its model shard."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMRollout:
    """A vLLM engine for rollouts: start, generate in rlplan's batch layout, sleep/wake, update weights."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        rollout: RolloutPlan,
        dtype: str = "bfloat16",
        seed: int = 0,
        tensor_parallel_size: int | None = None,
        **llm_kwargs: Any,
    ) -> None:
        """Start vLLM on a local HF folder (config.json, and safetensors unless load_format="dummy").

        `tensor_parallel_size`: vLLM's own TP; default: the plan's (`RolloutPlan.tensor_parallel_size`,
        the rollout layout's tp: rollout.tensor_model_parallel_size, null meaning the actor's).
        """
        self.vllm = import_vllm()
        self.rollout = rollout
        if tensor_parallel_size is None:
            tensor_parallel_size = rollout.tensor_parallel_size
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_num_seqs=rollout.max_num_seqs,
            enforce_eager=not rollout.cuda_graph,
            # Sleep mode is what lets a colocated engine hand the device back to training.
            enable_sleep_mode=rollout.free_cache_engine,
            dtype=dtype,
            seed=seed,
            skip_tokenizer_init=True,  # token ids in, token ids out
            # Log-probs after temperature, as compute_log_prob recomputes them (vLLM's default is the raw
            # distribution, temperature 1).
            logprobs_mode="processed_logprobs",
            # Sampling is rollout.*'s alone: a model folder's generation_config.json does not apply.
            generation_config="vllm",
        )
        kwargs.update(llm_kwargs)
        self.llm = self.vllm.LLM(**kwargs)
        self.asleep = False

    @classmethod
    def for_actor(
        cls,
        actor: Any,
        rollout: RolloutPlan,
        folder: str | os.PathLike,
        tensor_parallel_size: int,
        seed: int,
        base_config: dict[str, Any] | None = None,
        **llm_kwargs: Any,
    ) -> VLLMRollout:
        """Start vLLM for the actor's model without writing its weights: `folder` gets the actor's
        config.json only (over `base_config`, a model folder's own config.json, when given) and vLLM
        initialises dummy weights, which the refit before every generation overwrites. dtype: the actor's."""
        from rltrain.megatron.hf_weights import hf_config_from_arch

        dtype = next(iter(actor.chunks[0].parameters())).dtype
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(hf_config_from_arch(actor.arch, dtype, base_config)))
        llm_kwargs.setdefault("load_format", "dummy")
        return cls(folder, rollout, dtype=str(dtype).removeprefix("torch."), seed=seed,
                   tensor_parallel_size=tensor_parallel_size, **llm_kwargs)  # fmt: skip

    # --------------------------------------------------------------------------------- colocation
    def sleep(self, level: int = 1) -> None:
        """Free the device for training: level 1 offloads the weights to host memory and drops the KV
        cache (level 2 also drops the weights: only when `update_weights` reloads all of them)."""
        if not self.asleep:
            self.llm.sleep(level=level)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # --------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors (e.g. `weight_sync.iter_hf_weights(actor.chunks, arch)`, or a bucket from
        `weight_sync.receive_weights`) into every worker's model shard; vLLM slices each full tensor for
        its own TP rank. Returns the number of tensors. Use as the `load_weights` callback of
        `receive_weights`."""
        weights = list(named_tensors)
        self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        return len(weights)

    __call__ = update_weights  # so the adapter itself is a weight_sync `load_weights` callback

    def update_weights_bucketed(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> SyncStats:
        """Load HF-named tensors in buckets of at most `bucket_bytes` (one `collective_rpc` each), so the
        extra memory of a refit is one bucket, not a model copy: the same bucketing as weight_sync."""
        from rltrain.rollout.weight_sync import buckets

        stats = SyncStats()
        t0 = time.perf_counter()
        for bucket in buckets(named_tensors, bucket_bytes):
            self.update_weights(bucket)
            stats.tensors += len(bucket)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            stats.buckets += 1
        stats.seconds = time.perf_counter() - t0
        return stats

    def refit_from_actor(self, actor: Any, bucket_bytes: int) -> SyncStats:
        """Colocated refit before a generation: wake vLLM, then stream the actor's weights (TP shards
        gathered, HF names: `weight_sync.iter_hf_weights`). The gather is collective over the actor's TP
        group: actor ranks that host no vLLM engine call `take_part_in_refit(actor)` at the same time."""
        from rltrain.rollout.weight_sync import iter_hf_weights

        self.wake_up()
        return self.update_weights_bucketed(iter_hf_weights(actor.chunks, actor.arch), bucket_bytes)

    # --------------------------------------------------------------------------------- generate
    def generate(
        self,
        prompt_ids: torch.Tensor,
        sampling: Sampling,
        pad_id: int = 0,
        prompt_mask: torch.Tensor | None = None,
        first_row: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Sample responses: the batch layout of `MegatronActor.generate` ([B * n] rows; the n samples of
        prompt i are rows i*n .. i*n+n-1, like `repeat_interleave`). Responses end at the stop token
        (included, as in the embedded engine); the rest is `pad_id` with mask 0 and log-prob 0.

        With `sampling.seed` set, prompt i samples with seed `derive_seed(sampling.seed, first_row + i,
        ROW_SEED)` (`first_row`: this call's offset in a larger batch split over engines)."""
        if self.asleep:
            raise RuntimeError("VLLMRollout.generate while asleep: call wake_up() first")
        if prompt_mask is None:
            prompt_mask = (prompt_ids != pad_id).long()
        prompts = [
            {"prompt_token_ids": row[m.bool()].tolist()}
            for row, m in zip(prompt_ids, prompt_mask, strict=True)
        ]
        if sampling.seed is None:
            params: Any = sampling_params(self.vllm, sampling)
        else:
            params = [
                sampling_params(
                    self.vllm, replace(sampling, seed=derive_seed(sampling.seed, first_row + i, ROW_SEED))
                )
                for i in range(len(prompts))
            ]
        outputs = self.llm.generate(prompts=prompts, sampling_params=params, use_tqdm=False)
        completions = []
        for out in outputs:
            if len(out.outputs) != sampling.n:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} completions, expected n = {sampling.n}")
            completions.extend(out.outputs)
        return to_batch(
            prompt_ids.repeat_interleave(sampling.n, 0),
            prompt_mask.long().repeat_interleave(sampling.n, 0),
            [list(c.token_ids) for c in completions],
            [_sampled_log_probs(c) for c in completions],
            sampling.max_new_tokens,
            pad_id,
        )


def _sampled_log_probs(completion: Any) -> list[float]:
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no log-probs: SamplingParams(logprobs=0) is required")
    return [
        float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


def to_batch(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    max_new_tokens: int,
    pad_id: int,
) -> dict[str, torch.Tensor]:
    """rlplan's rollout batch from per-row token lists: prompts left-padded to P, responses right-padded
    to `max_new_tokens` ([B, P + N] input_ids / attention_mask / position_ids, [B, N] responses /
    response_mask / rollout_log_probs)."""
    b, p = prompt_ids.shape
    lengths = prompt_mask.sum(-1)
    cols = torch.arange(p)
    left_mask = (cols.unsqueeze(0) >= (p - lengths).unsqueeze(1)).long()
    left = torch.full_like(prompt_ids, pad_id)
    for i in range(b):
        left[i, left_mask[i].bool()] = prompt_ids[i, prompt_mask[i].bool()]
    resp = torch.full((b, max_new_tokens), pad_id, dtype=torch.long)
    resp_mask = torch.zeros((b, max_new_tokens), dtype=torch.long)
    logps = torch.zeros((b, max_new_tokens), dtype=torch.float32)
    for i, (toks, lps) in enumerate(zip(responses, log_probs, strict=True)):
        if len(toks) > max_new_tokens or len(lps) != len(toks):
            raise ValueError(f"row {i}: {len(toks)} tokens / {len(lps)} log-probs for max {max_new_tokens}")
        n = len(toks)
        resp[i, :n] = torch.tensor(toks, dtype=torch.long)
        resp_mask[i, :n] = 1
        logps[i, :n] = torch.tensor(lps, dtype=torch.float32)
    return rollout_batch(left, left_mask, resp, resp_mask, logps)


def take_part_in_refit(actor: Any) -> None:
    """The TP gather of a refit on an actor rank that hosts no vLLM engine (the tensors are dropped)."""
    from rltrain.rollout.weight_sync import iter_hf_weights

    for _ in iter_hf_weights(actor.chunks, actor.arch):
        pass


class ColocatedVLLM:
    """rollout.engine: vllm on the actor's own ranks, laid out by the plan (see the module docstring): the
    rank at rollout tp 0 of each rollout DP group hosts a `VLLMRollout`; every rank takes part in the
    refit (the actor's TP gather) and in the exchange of prompts and results. Built by PolicyWorker."""

    def __init__(self, actor: Any, plan: Any, rank: int) -> None:
        refit, layout = plan.refit, plan.layout("rollout")
        if refit is None or refit.mode != "vllm":
            raise ValueError(f"the plan's rollout refit is {refit and refit.mode!r}, not 'vllm'")
        coord = layout.grid[rank]
        self.actor = actor
        self.rollout_dp_rank, self.rollout_dp_size = coord.dp, layout.dp
        self.bucket_bytes = refit.bucket_mib * 2**20
        self.free_cache_engine = plan.rollout.free_cache_engine
        self.last_refit = SyncStats()
        self.engine: VLLMRollout | None = None
        if coord.tp == 0:
            weights = plan.model("policy").weights
            base = (
                read_json(
                    Path(weights) / "config.json",
                    MAX_MODEL_CONFIG_BYTES,
                    key="model.path",
                    what="config.json",
                )
                if weights
                else None
            )  # bounded, as the plan read it (rlconf.files)
            # config.json only (vLLM loads dummy weights): local to this process, removed with it.
            self._folder = tempfile.TemporaryDirectory(prefix=f"rlplan-vllm-rank{rank}-")
            self.engine = VLLMRollout.for_actor(
                actor, plan.rollout, self._folder.name, tensor_parallel_size=refit.rollout_tp,
                seed=derive_seed(plan.run.seed, coord.dp, "vllm-engine"), base_config=base,
            )  # fmt: skip

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
        pad_id: int,
        actor_dp_rank: int,
    ) -> dict[str, torch.Tensor]:
        """Refit, generate this rollout DP rank's share of every actor DP shard's rows on its host, put
        vLLM to sleep (rollout.free_cache_engine), and return this actor DP shard's rows in order.
        Collective over the actor's world: every rank calls it with its own shard."""
        if self.engine is not None:
            self.last_refit = self.engine.refit_from_actor(self.actor, self.bucket_bytes)
        else:
            take_part_in_refit(self.actor)
        shards = _all_gather((actor_dp_rank, prompt_ids.cpu(), prompt_mask.cpu()))
        by_dp: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for d, ids, mask in shards:
            by_dp.setdefault(d, (ids, mask))  # the TP / PP ranks of one actor DP rank hold the same rows
        order = sorted(by_dp)
        counts = [by_dp[d][0].shape[0] for d in order]
        all_ids = torch.cat([by_dp[d][0] for d in order])
        all_mask = torch.cat([by_dp[d][1] for d in order])
        rows = torch.tensor_split(torch.arange(all_ids.shape[0]), self.rollout_dp_size)[self.rollout_dp_rank]
        out = None
        if self.engine is not None:
            try:
                if len(rows):
                    out = self.engine.generate(all_ids[rows], sampling, pad_id, all_mask[rows],
                                               first_row=int(rows[0]))  # fmt: skip
            finally:
                if self.free_cache_engine:
                    self.engine.sleep()  # colocated: training gets the device memory back
        parts = {d: o for d, o in _all_gather((self.rollout_dp_rank, out)) if o is not None}
        full = {k: torch.cat([parts[d][k] for d in sorted(parts)]) for k in next(iter(parts.values()))}
        i = order.index(actor_dp_rank)
        start = sum(counts[:i])
        return {k: v[start : start + counts[i]] for k, v in full.items()}


def _all_gather(obj: Any) -> list[Any]:
    """`obj` of every rank of the world, in rank order (no collective in a world of one)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


__all__ = [
    "INSTALL_HINT",
    "ColocatedVLLM",
    "Sampling",
    "VLLMRollout",
    "import_vllm",
    "sampling_params",
    "take_part_in_refit",
    "to_batch",
]
