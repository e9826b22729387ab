"""The rollout role's work, served by the worker process that holds the rollout's weights: the policy
worker (colocated placement: the actor's own weights, or a replica of another TP size on its devices) or
the rollout worker (separate placement: a model of its own, on its own devices, refreshed by weight
pushes from the trainer).

`RolloutServer` is a mixin of those Ray worker classes (rltrain/workers.py). It reads what the worker
sets up: `self.plan`, `self.cfg`, `self.actor` (the engine that generates: `MegatronActor.generate`),
`self.vllm` (a ColocatedVLLM or None) and `self.measured` (the profiler and memory tracker).
"""

from __future__ import annotations

from typing import Any

import torch

from rlconf.seeding import DP_SHARD, derive_seed
from rltrain import device as devices


class RolloutServer:
    """Generation for the rollout role (a mixin of a `MegatronWorker`)."""

    plan: Any
    cfg: Any
    actor: Any
    vllm: Any
    measured: Any

    def generate_sequences(
        self,
        prompts: dict[str, torch.Tensor],
        seed: int,
        validate: bool = False,
        max_new_tokens: int | None = None,
        extra_stop_token_ids: tuple[int, ...] = (),
    ) -> dict:
        """Sample responses for this data-parallel rank's prompts. `seed` is the controller's seed of this
        call (rlconf.seeding: (trainer.seed, step, "rollout" | "validate/i")); each DP rank samples from its
        own stream derived from it, the TP / PP ranks of one DP rank from the same. A multi-turn turn
        (rltrain/rollout/agent.py) passes its token budget and its tool-call stop tokens."""
        from dataclasses import replace

        from megatron.core import parallel_state

        r = self.cfg.rollout
        if max_new_tokens is not None or extra_stop_token_ids:
            r = replace(r, max_response_length=max_new_tokens or r.max_response_length,
                        stop_token_ids=(*r.stop_token_ids, *extra_stop_token_ids))  # fmt: skip
        prompt_ids, prompt_mask = prompts["prompt_ids"], prompts["prompt_mask"]
        tok = self._tokenizer()
        shard_seed = derive_seed(seed, parallel_state.get_data_parallel_rank(), DP_SHARD)
        if self.vllm is not None:
            # vLLM refit from the actor (bucketed), generation on the hosts, sleep until the next refit.
            from rltrain.rollout.vllm_adapter import Sampling

            sampling = Sampling.from_rollout(r, tok.eos_token_id, validate=validate, seed=seed)
            with self.measured("generate_sequences"):
                return self.vllm.generate(prompt_ids, prompt_mask, sampling, tok.pad_token_id,
                                          parallel_state.get_data_parallel_rank())  # fmt: skip
        if self.plan.refit is not None and self.plan.refit.mode == "reshard":
            # The rollout's own layout (rltrain/rollout/reshard.py): refit, split over rollout DP, regather.
            with self.measured("generate_sequences"):
                return self._rollout_replica().generate(
                    prompt_ids, prompt_mask, seed=seed, actor_dp_rank=parallel_state.get_data_parallel_rank(),
                    max_new_tokens=r.max_response_length,
                    temperature=r.val.temperature if validate else r.temperature,
                    top_p=r.val.top_p if validate else r.top_p, top_k=-1 if validate else r.top_k,
                    min_p=0.0 if validate else r.min_p, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                    stop_token_ids=r.stop_token_ids,
                    static_decode=r.cuda_graph and devices.graphs_supported(self.cfg.cluster.device),
                )  # fmt: skip
        with self.measured("generate_sequences"):
            return self.actor.generate(
                prompt_ids,
                max_new_tokens=r.max_response_length,
                temperature=r.val.temperature if validate else r.temperature,
                top_p=r.val.top_p if validate else r.top_p,
                top_k=-1 if validate else r.top_k,
                min_p=0.0 if validate else r.min_p,
                eos_id=tok.eos_token_id,
                pad_id=tok.pad_token_id,
                prompt_mask=prompt_mask,
                stop_token_ids=r.stop_token_ids,
                cuda_graph=r.cuda_graph and devices.graphs_supported(self.cfg.cluster.device),
                seed=shard_seed,
            )

    def _rollout_replica(self) -> Any:
        """The rollout-layout replica of the actor (built at the first generation, kept between steps)."""
        if not hasattr(self, "_replica"):
            from rltrain.rollout.reshard import RolloutReplica

            refit = self.plan.refit
            self._replica = RolloutReplica(self.actor, refit.rollout_tp, refit.bucket_mib * 2**20)
        return self._replica

    def _tokenizer(self):
        if not hasattr(self, "_tok"):
            from rltrain.tokenizer import load_tokenizer

            self._tok = load_tokenizer(self.cfg.model)
        return self._tok
