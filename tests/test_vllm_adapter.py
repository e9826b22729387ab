"""The vLLM adapter (rltrain/rollout/vllm_adapter.py) at its boundary, against a STAND-IN `vllm` module
injected into sys.modules (vLLM itself cannot be installed here): it records what the adapter passes to
`LLM`, `SamplingParams`, `generate`, `sleep` / `wake_up` and `collective_rpc`, and answers with scripted
completions. What the real vLLM does with those calls is not tested here."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import pytest
import torch

from rlconf.config import RolloutConfig
from rlconf.errors import ConfigError
from rlconf.plan.run import rollout_plan


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob]] | None


@dataclass
class _RequestOutput:
    outputs: list[_Completion]


@dataclass
class _SamplingParams:  # the stand-in keeps every keyword it is given
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Worker:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=self._load))

    def _load(self, weights) -> None:
        self.loaded.extend(weights)


class _LLM:
    """Stand-in for vllm.LLM: completion j of prompt i is tokens [100*i + 10*j + 1, ...] up to a length
    given by `lengths` (cycled), log-prob of token t = -t / 1000."""

    lengths = (3, 1)
    instances: ClassVar[list[_LLM]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[str, Any]] = []
        self.workers = [_Worker(), _Worker()]  # e.g. two TP ranks
        _LLM.instances.append(self)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append(("generate", (prompts, sampling_params.kwargs, use_tqdm)))
        out = []
        k = 0
        for i, _ in enumerate(prompts):
            comps = []
            for j in range(sampling_params.kwargs["n"]):
                n = min(self.lengths[k % len(self.lengths)], sampling_params.kwargs["max_tokens"])
                k += 1
                toks = [100 * i + 10 * j + t + 1 for t in range(n)]
                comps.append(_Completion(toks, [{t: _Logprob(-t / 1000)} for t in toks]))
            out.append(_RequestOutput(comps))
        return out

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method))
        return [method(w, *args, **(kwargs or {})) for w in self.workers]


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM = _LLM  # type: ignore[attr-defined]
    mod.SamplingParams = lambda **kw: _SamplingParams(kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", mod)
    _LLM.instances.clear()
    return mod


def test_missing_vllm_is_a_config_error_on_rollout_engine(monkeypatch):
    from rltrain.rollout.vllm_adapter import VLLMRollout

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ConfigError) as info:
        VLLMRollout("/nowhere", rollout_plan(RolloutConfig()))
    issue = info.value.errors[0]
    assert issue.path == "rollout.engine" and "pip install 'rlplan[vllm]'" in issue.fix


def test_engine_arguments_from_rollout_config(fake_vllm):
    from rltrain.rollout.vllm_adapter import VLLMRollout

    r = RolloutConfig(
        tensor_model_parallel_size=2, gpu_memory_utilization=0.4, max_num_seqs=64, cuda_graph=False
    )
    VLLMRollout("/models/qwen", rollout_plan(r), dtype="bfloat16", seed=3)
    kw = _LLM.instances[-1].kwargs
    assert kw["model"] == "/models/qwen" and kw["tensor_parallel_size"] == 2
    assert kw["gpu_memory_utilization"] == 0.4 and kw["max_num_seqs"] == 64
    assert kw["enforce_eager"] is True and kw["enable_sleep_mode"] is True
    assert kw["dtype"] == "bfloat16" and kw["seed"] == 3


def test_sampling_param_mapping(fake_vllm):
    from rltrain.rollout.vllm_adapter import Sampling, sampling_params

    r = RolloutConfig(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, stop_token_ids=(7, 8), max_response_length=12
    )
    kw = sampling_params(
        fake_vllm, replace(Sampling.from_rollout(rollout_plan(r), eos_id=2, seed=5), n=4)
    ).kwargs
    assert kw == dict(
        n=4, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens=12, stop_token_ids=[7, 8, 2],
        ignore_eos=False, logprobs=0, seed=5, detokenize=False,
    )  # fmt: skip
    # EOS is a stop token (included in the response, as in the embedded engine), listed once.
    kw = sampling_params(fake_vllm, Sampling(max_new_tokens=3, stop_token_ids=(2,), eos_id=2)).kwargs
    assert kw["stop_token_ids"] == [2]
    # Disabled top-k (-1 in rlplan) is 0 in vLLM; no EOS id: generate the full length.
    kw = sampling_params(fake_vllm, Sampling(max_new_tokens=3, top_k=-1)).kwargs
    assert kw["top_k"] == 0 and kw["ignore_eos"] is True
    # Validation uses rollout.val and no top-k / min-p, as the embedded engine does.
    val = Sampling.from_rollout(rollout_plan(r), eos_id=2, validate=True)
    assert (val.temperature, val.top_p, val.top_k, val.min_p) == (r.val.temperature, r.val.top_p, -1, 0.0)


def test_generate_returns_the_embedded_engine_layout(fake_vllm):
    from rltrain.rollout.vllm_adapter import Sampling, VLLMRollout

    rollout = VLLMRollout("/m", rollout_plan(RolloutConfig()))
    # Row 0 right-padded (length 2), row 1 full (length 3); pad 0.
    prompts = torch.tensor([[5, 6, 0], [7, 8, 9]])
    out = rollout.generate(prompts, Sampling(max_new_tokens=4, n=2), pad_id=0)
    _, (sent, params, tqdm) = rollout.llm.calls[-1]
    assert sent == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9]}] and tqdm is False
    assert params["n"] == 2 and params["logprobs"] == 0
    # 2 prompts x n=2 -> 4 rows, samples of a prompt adjacent; completion lengths cycle 3, 1, 3, 1.
    assert torch.equal(
        out["responses"], torch.tensor([[1, 2, 3, 0], [11, 0, 0, 0], [101, 102, 103, 0], [111, 0, 0, 0]])
    )
    assert torch.equal(out["response_mask"], (out["responses"] != 0).long())
    assert torch.equal(out["input_ids"][:, :3], torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]))
    assert torch.equal(out["input_ids"][:, 3:], out["responses"])
    assert torch.equal(
        out["attention_mask"][:, :3], torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    )
    assert torch.equal(out["attention_mask"][:, 3:], out["response_mask"])
    assert torch.equal(out["position_ids"][0], torch.tensor([0, 0, 1, 2, 3, 4, 4]))
    assert torch.equal(out["position_ids"][3], torch.tensor([0, 1, 2, 3, 3, 3, 3]))
    expected_lp = torch.where(
        out["response_mask"].bool(), -out["responses"].float() / 1000, torch.tensor(0.0)
    )
    torch.testing.assert_close(out["rollout_log_probs"], expected_lp)
    assert set(out) == {
        "input_ids",
        "attention_mask",
        "position_ids",
        "responses",
        "response_mask",
        "rollout_log_probs",
    }


def test_sleep_wake_and_weight_streaming(fake_vllm):
    from rltrain.rollout.vllm_adapter import Sampling, VLLMRollout

    rollout = VLLMRollout("/m", rollout_plan(RolloutConfig()))
    llm = rollout.llm
    rollout.sleep()
    rollout.sleep()  # idempotent: one call reaches vLLM
    with pytest.raises(RuntimeError, match="wake_up"):
        rollout.generate(torch.tensor([[1, 2]]), Sampling(max_new_tokens=2))
    rollout.wake_up()
    rollout.wake_up()
    assert [c for c in llm.calls if c[0] in ("sleep", "wake_up")] == [("sleep", 1), ("wake_up", None)]
    weights = [("model.embed_tokens.weight", torch.ones(4, 2)), ("model.norm.weight", torch.zeros(2))]
    assert rollout.update_weights(iter(weights)) == 2
    # Every worker got every tensor (vLLM shards them itself), through collective_rpc.
    for w in llm.workers:
        assert [n for n, _ in w.loaded] == ["model.embed_tokens.weight", "model.norm.weight"]
    # The adapter is itself a weight_sync `load_weights` callback.
    rollout(weights[:1])
    assert len(llm.workers[0].loaded) == 3


def test_bucketed_weight_load_and_rollout_tp_from_the_plan(fake_vllm):
    """Refit in buckets: one collective_rpc per bucket, every tensor once; vLLM's TP is the plan's rollout
    TP when given, else the config's (null: 1 here, the plan resolves it to the actor's in a run)."""
    from rltrain.rollout.vllm_adapter import VLLMRollout

    rollout = VLLMRollout("/m", rollout_plan(RolloutConfig()), tensor_parallel_size=2)
    assert _LLM.instances[-1].kwargs["tensor_parallel_size"] == 2
    VLLMRollout("/m", rollout_plan(RolloutConfig()))
    assert _LLM.instances[-1].kwargs["tensor_parallel_size"] == 1
    weights = [(f"model.layers.{i}.mlp.down_proj.weight", torch.full((4, 4), float(i))) for i in range(5)]
    stats = rollout.update_weights_bucketed(iter(weights), bucket_bytes=2 * 4 * 4 * 4)  # two fp32 tensors
    rpcs = [c for c in rollout.llm.calls if c[0] == "collective_rpc"]
    assert (stats.buckets, stats.tensors, len(rpcs)) == (3, 5, 3)
    loaded = rollout.llm.workers[0].loaded
    assert [n for n, _ in loaded] == [n for n, _ in weights]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded, weights, strict=True))
