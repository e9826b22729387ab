"""`VLLMRollout`: a thin adapter from rlplan's rollout interface to vLLM's offline `LLM` (rollout.engine: vllm).

Targeted API: vLLM 0.33 offline inference (the `vllm.LLM` / `vllm.SamplingParams` surface that has been
stable since the V1 engine): `LLM(model=..., tensor_parallel_size=..., gpu_memory_utilization=...,
max_num_seqs=..., enforce_eager=..., enable_sleep_mode=True, dtype=..., seed=...)`,
`LLM.generate(prompts=[{"prompt_token_ids": [...]}, ...], sampling_params=..., use_tqdm=False)` returning
one `RequestOutput` per prompt with `.outputs[i].token_ids` and `.outputs[i].logprobs` (a list, per token,
of {token_id: Logprob(logprob=...)}; `SamplingParams(logprobs=0)` returns just the sampled token's), and
`LLM.sleep(level=1)` / `LLM.wake_up()` (level 1: weights to host memory, KV cache dropped). Weights are
updated through `LLM.collective_rpc(fn, args=...)`, which runs `fn(worker, ...)` on every worker;
`fn` calls `worker.model_runner.model.load_weights(weights)` (the HF-named iterable every vLLM model
implements). With a multi-process executor vLLM pickles `fn` (set VLLM_ALLOW_INSECURE_SERIALIZATION=1) and
the tensors; across processes prefer rltrain/rollout/weight_sync.py (a broadcast into `load_weights`).
Layout and refit (issue 20): vLLM runs at the plan's rollout TP (`plan.refit`, mode "vllm"; null = the
actor's TP) and is refit before each generation from the actor's weights in buckets
(`refit_from_actor`: the TP gather of weight_sync.iter_hf_weights -> bucketed `load_weights`), waking
from sleep first; after generation `sleep()` hands the device back to training (colocation). Validation
(rule rollout-engine) says plainly when vLLM is not importable or the device is not CUDA.
This adapter was unit-tested only against a stand-in `vllm` module (tests/test_vllm_adapter.py): vLLM
cannot be installed on the development machines (CUDA-only wheel, torch 2.14). Check it on a GPU host.

vLLM is imported lazily (only when the adapter is built) and a missing install is a ConfigError naming
`rollout.engine`. `generate` returns the batch layout of `MegatronActor.generate` (prompts left-padded,
responses right-padded, `rollout_log_probs` the sampled tokens' log-probs; vLLM reports them under its
temperature-scaled distribution before top-k/top-p filtering by default, the quantity
`compute_log_prob` recomputes, as the embedded engine does).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlconf.config import RolloutConfig
from rlconf.errors import ConfigError, Issue
from rltrain.rollout.batch import rollout_batch
from rltrain.rollout.weight_sync import SyncStats

INSTALL_HINT = "pip install 'rlplan[vllm]'"


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
    """One rollout's sampling settings, in rlplan's terms (RolloutConfig's names)."""

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
        cls, r: RolloutConfig, eos_id: int | None, validate: bool = False, seed: int | None = None
    ) -> Sampling:
        """The same choice as PolicyWorker.generate_sequences makes for the embedded engine."""
        return cls(
            max_new_tokens=r.max_response_length,
            temperature=r.val.temperature if validate else r.temperature,
            top_p=r.val.top_p if validate else r.top_p,
            top_k=-1 if validate else r.top_k,
            min_p=0.0 if validate else r.min_p,
            stop_token_ids=tuple(r.stop_token_ids),
            eos_id=eos_id,
            seed=seed,
        )


def sampling_params(vllm: Any, s: Sampling) -> Any:
    """vllm.SamplingParams for `s`: one log-prob per token (the sampled one), token ids only."""
    return vllm.SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        # rlplan's "disabled" is -1; vLLM's is 0 (it also accepts -1 in older releases).
        top_k=s.top_k if s.top_k > 0 else 0,
        min_p=s.min_p,
        max_tokens=s.max_new_tokens,
        stop_token_ids=list(s.stop_token_ids),
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
        rollout: RolloutConfig,
        dtype: str = "bfloat16",
        seed: int = 0,
        tensor_parallel_size: int | None = None,
        **llm_kwargs: Any,
    ) -> None:
        """Start vLLM on a local HF folder (config.json + safetensors; the actor's export works).

        `tensor_parallel_size`: vLLM's own TP, the plan's rollout layout (`plan.refit.rollout_tp`, which
        resolves rollout.tensor_model_parallel_size: null to the actor's); default: the config's, else 1.
        """
        self.vllm = import_vllm()
        self.rollout = rollout
        if tensor_parallel_size is None:
            tensor_parallel_size = rollout.tensor_model_parallel_size or 1
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
        )
        kwargs.update(llm_kwargs)
        self.llm = self.vllm.LLM(**kwargs)
        self.asleep = False

    @classmethod
    def from_actor(
        cls, actor: Any, out_dir: str | os.PathLike, rollout: RolloutConfig, **kw: Any
    ) -> VLLMRollout | None:
        """Export the actor's weights as an HF folder (collective over the actor's ranks), then start vLLM
        from it (on the ranks that host the engine; pass `start=False` on the others to only export)."""
        from rltrain.megatron.hf_weights import export_hf_weights

        start = kw.pop("start", True)
        export_hf_weights(actor.chunks, actor.arch, out_dir)
        dtype = str(next(iter(actor.chunks[0].parameters())).dtype).removeprefix("torch.")
        return cls(out_dir, rollout, dtype=dtype, **kw) if start else None

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
        from rltrain.rollout.weight_sync import _buckets

        stats = SyncStats()
        t0 = time.perf_counter()
        for bucket in _buckets(named_tensors, bucket_bytes):
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
    ) -> dict[str, torch.Tensor]:
        """Sample responses: the batch layout of `MegatronActor.generate` ([B * n] rows; the n samples of
        prompt i are rows i*n .. i*n+n-1, like `repeat_interleave`). Responses end at the stop token
        (included, as in the embedded engine); the rest is `pad_id` with mask 0 and log-prob 0."""
        if self.asleep:
            raise RuntimeError("VLLMRollout.generate while asleep: call wake_up() first")
        if prompt_mask is None:
            prompt_mask = (prompt_ids != pad_id).long()
        prompts = [
            {"prompt_token_ids": row[m.bool()].tolist()}
            for row, m in zip(prompt_ids, prompt_mask, strict=True)
        ]
        outputs = self.llm.generate(
            prompts=prompts, sampling_params=sampling_params(self.vllm, sampling), use_tqdm=False
        )
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


__all__ = [
    "INSTALL_HINT",
    "Sampling",
    "VLLMRollout",
    "import_vllm",
    "sampling_params",
    "take_part_in_refit",
    "to_batch",
]
