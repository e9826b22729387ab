"""The rollout role's work, served by the worker process that holds the rollout's weights: the policy
worker (colocated placement: the actor's own weights, or a replica of another TP size on its devices) or
the rollout worker (separate placement: a model of its own, on its own devices, refreshed by weight
pushes from the trainer).

`RolloutServer` is a mixin of those Ray worker classes (rltrain/workers.py). It reads what the worker
sets up: `self.plan` (its `rollout` part: sampling and engine settings), `self.actor` (the engine that generates: `MegatronActor.generate`),
`self.vllm` (a ColocatedVLLM or None) and `self.measured` (the profiler and memory tracker).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rlconf.seeding import DP_SHARD, derive_seed
from rltrain import device as devices


class RolloutServer:
    """Generation for the rollout role (a mixin of a `MegatronWorker`)."""

    plan: Any
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

        r = self.plan.rollout
        max_new_tokens = max_new_tokens or r.max_response_length
        stops = (*r.stop_token_ids, *extra_stop_token_ids)
        sampling = r.sampling(validate)
        graphs = r.cuda_graph and devices.graphs_supported(self.plan.run.cluster.device)
        prompt_ids, prompt_mask = prompts["prompt_ids"], prompts["prompt_mask"]
        tok = self._tokenizer()
        shard_seed = derive_seed(seed, parallel_state.get_data_parallel_rank(), DP_SHARD)
        if self.vllm is not None:
            # vLLM refit from the actor (bucketed), generation on the hosts, sleep until the next refit.
            from rltrain.rollout.vllm_adapter import Sampling

            sampling_v = replace(Sampling.from_rollout(r, tok.eos_token_id, validate=validate, seed=seed),
                                 max_new_tokens=max_new_tokens, stop_token_ids=stops)  # fmt: skip
            with self.measured("generate_sequences"):
                return self.vllm.generate(prompt_ids, prompt_mask, sampling_v, tok.pad_token_id,
                                          parallel_state.get_data_parallel_rank())  # fmt: skip
        if self.plan.refit is not None and self.plan.refit.mode == "reshard":
            # The rollout's own layout (rltrain/rollout/reshard.py): refit, split over rollout DP, regather;
            # actor.router_replay: the replica's routers record each token's experts.
            with self.measured("generate_sequences"):
                return self._rollout_replica().generate(
                    prompt_ids, prompt_mask, seed=seed, actor_dp_rank=parallel_state.get_data_parallel_rank(),
                    record_routing=r.router_replay and not validate,
                    max_new_tokens=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                    top_k=sampling.top_k, min_p=sampling.min_p, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                    stop_token_ids=stops, static_decode=graphs,
                )  # fmt: skip
        # actor.router_replay: record the experts each token was routed to (training replays them).
        replay = r.router_replay and not validate
        recording: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if replay:
            from rltrain.megatron.moe_replay import ROUTED_EXPERTS, record_routing

            recording = record_routing(self.actor)
        with self.measured("generate_sequences"), recording as recorder:
            out = self.actor.generate(
                prompt_ids,
                max_new_tokens=max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                eos_id=tok.eos_token_id,
                pad_id=tok.pad_token_id,
                prompt_mask=prompt_mask,
                stop_token_ids=stops,
                cuda_graph=graphs,
                seed=shard_seed,
            )
        if replay:
            out[ROUTED_EXPERTS] = recorder.routed_experts(out)
        return out

    # -------------------------------------------------------------------------------- multi-turn turns
    def kv_session_unsupported(self) -> str | None:
        """Why this worker cannot keep a multi-turn row's KV cache between turn calls (None: it can).

        Kept by the embedded engine on the actor's own weights (any TP / PP / DP layout it generates in).
        Not kept, and every turn prefills its whole context (correct, only slower), where generation runs
        elsewhere: vLLM (it has its own prefix cache), the rollout resharded to another TP
        (rltrain/rollout/reshard.py: its replica is rebuilt per refit and regathers per call), or a model
        the KV-cache engine does not follow (`inference.kv_cache_unsupported`).
        """
        from rltrain.megatron import inference

        return self._generates_elsewhere() or inference.kv_cache_unsupported(self.actor)

    def _generates_elsewhere(self) -> str | None:
        """Why generation does not run on the actor's own modules (None: it does)."""
        if self.vllm is not None:
            return "vLLM generates (its own prefix cache serves repeated contexts)"
        if self.plan.refit is not None and self.plan.refit.mode == "reshard":
            return "the rollout is resharded to another TP size (rltrain/rollout/reshard.py)"
        return None

    def generate_turn(
        self,
        rows: dict[str, torch.Tensor],
        validate: bool,
        max_new_tokens: int,
        stop_token_ids: tuple[int, ...],
        session: str | None,
        finished: tuple[int, ...] = (),
    ) -> dict[str, torch.Tensor]:
        """One call of a multi-turn rollout (rltrain/rollout/agent.py `WorkerRolloutClient`) for this DP
        rank's rows: `prompt_ids` / `prompt_mask` (each row's whole context, left-padded), `row_ids` (the
        row's index in the rollout, stable over its turns; -1 = a filler row that pads the shards to one
        size: not generated, returned empty) and `row_seeds` (each row samples from its own stream, so its
        tokens do not depend on the other rows of the call).

        `session` (an id; None: no cache kept): the rows' KV cache is kept on this worker between the calls
        of one rollout and each call prefills only what is new in a context (`inference.KVSession`);
        `finished` rows are dropped from it first. Where `kv_session_unsupported()` names a reason the call
        regenerates from the whole contexts instead. Returns `responses`, `response_mask`,
        `rollout_log_probs` [rows, max_new_tokens] (filler rows: empty)."""
        from rltrain.megatron import inference

        r = self.plan.rollout
        sampling = r.sampling(validate)
        tok = self._tokenizer()
        ids, mask, row_ids = rows["prompt_ids"], rows["prompt_mask"], rows["row_ids"]
        real = (row_ids >= 0).nonzero().squeeze(1)
        n = ids.shape[0]
        out = {
            "responses": torch.full((n, max_new_tokens), tok.pad_token_id, dtype=torch.long),
            "response_mask": torch.zeros((n, max_new_tokens), dtype=torch.long),
            "rollout_log_probs": torch.zeros((n, max_new_tokens), dtype=torch.float32),
        }
        sessions: dict[str, inference.KVSession] = self.__dict__.setdefault("_kv_sessions", {})
        kv = None
        if session is not None and self.kv_session_unsupported() is None:
            kv = sessions.get(session)
            if kv is None:
                # One rollout at a time per worker: a new session ends any left by a rollout that failed.
                sessions.clear()
                kv = sessions[session] = inference.KVSession()
            kv.drop(finished)
        if real.numel() == 0:
            return out
        prompts = {"prompt_ids": ids[real], "prompt_mask": mask[real]}
        if self.kv_session_unsupported() is not None:
            # Another engine, or the no-cache path: sampling streams per call, not per row.
            seed = int(rows["row_seeds"][real[0]])
            got = self.generate_sequences(prompts, seed, validate, max_new_tokens, stop_token_ids)
        else:
            stops = (*r.stop_token_ids, *stop_token_ids)
            with self.measured("generate_sequences"):
                got = inference.generate_with_kv_cache(
                    self.actor, prompts["prompt_ids"], prompts["prompt_mask"], max_new_tokens,
                    temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    min_p=sampling.min_p, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                    stop_token_ids=stops,
                    static_decode=r.cuda_graph and devices.graphs_supported(self.plan.run.cluster.device),
                    session=kv, row_ids=row_ids[real].tolist(), row_seeds=rows["row_seeds"][real].tolist(),
                )  # fmt: skip
        for key, value in out.items():
            value[real] = got[key][:, :max_new_tokens]
        return out

    def end_kv_session(self, session: str) -> dict[str, int]:
        """Free a multi-turn rollout's KV cache on this worker; its counts of context tokens reused from
        the cache and prefilled over the rollout (zeros when none was kept)."""
        kv = self.__dict__.get("_kv_sessions", {}).pop(session, None)
        if kv is None:
            return {"reused_tokens": 0, "prefilled_tokens": 0}
        return {"reused_tokens": kv.reused_tokens, "prefilled_tokens": kv.prefilled_tokens}

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

            self._tok = load_tokenizer(self.plan.tokenizer)
        return self._tok
