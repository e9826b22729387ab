"""rollout.engine: vllm through PolicyWorker end to end on CPU, against a LABELLED STAND-IN `vllm` package.

vLLM cannot be installed on these machines (a CUDA-only wheel that needs its own torch), so the worker
runs against a stand-in: a real `vllm` package written to disk and put on sys.path, whose `LLM` builds a
tiny Hugging Face model (transformers) from the config.json it is started with, loads whatever weights
`load_weights` receives, and decodes greedily, reporting the temperature-scaled log-prob of each token.
The production code path is the one a CUDA host runs (PolicyWorker -> ColocatedVLLM -> VLLMRollout); what
the real vLLM does with the same calls is not tested here.

The worker tests use a real MegatronActor on gloo in spawned processes (megatron's state is
process-global). The plan is compiled from a config whose rollout.engine is switched to vllm after
validation: validation refuses vLLM on cpu (tested below), the plan compiler does not look at the device.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.megatron._common import free_port, run_spawned
from tests.tolerance import assert_close

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

STANDIN = '''
"""STAND-IN for vLLM, written by tests/test_vllm_worker.py: vLLM cannot be installed on these machines.
The offline `LLM` surface rlplan uses, over a tiny transformers model; greedy decoding."""

import json

import torch
import transformers

EVENTS = []  # what the adapter asked for, in order: (name, detail)


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


class Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class Completion:
    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs


class RequestOutput:
    def __init__(self, outputs):
        self.outputs = outputs


class _Model:
    def __init__(self, llm):
        self.load_weights = llm._load_weights


class LLM:
    instances = []

    def __init__(self, model, **kwargs):
        self.kwargs = dict(model=model, **kwargs)
        config = transformers.AutoConfig.for_model(**json.loads(open(f"{model}/config.json").read()))
        torch.manual_seed(1234)  # "dummy" weights: anything but the actor's
        self.model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        self.worker = type("Worker", (), {})()
        self.worker.model_runner = type("Runner", (), {})()
        self.worker.model_runner.model = _Model(self)
        self.asleep = False
        EVENTS.append(("init", model))
        LLM.instances.append(self)

    def _load_weights(self, weights):
        params = dict(self.model.named_parameters())
        names = []
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
                names.append(name)
        EVENTS.append(("load_weights", names))

    def collective_rpc(self, method, args=(), kwargs=None):
        return [method(self.worker, *args, **(kwargs or {}))]

    def sleep(self, level=1):
        self.asleep = True
        EVENTS.append(("sleep", level))

    def wake_up(self, tags=None):
        self.asleep = False
        EVENTS.append(("wake_up", None))

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm=True):
        assert not self.asleep, "generate while asleep"
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        EVENTS.append(("generate", [p.kwargs for p in params]))
        out = []
        for prompt, p in zip(prompts, params, strict=True):
            ids = list(prompt["prompt_token_ids"])
            tokens, logprobs = [], []
            for _ in range(p.max_tokens):
                logits = self.model(torch.tensor([ids + tokens])).logits[0, -1].float()
                tok = int(logits.argmax())
                scaled = logits / (p.temperature or 1.0)  # temperature 0: greedy, log-probs at 1
                logprobs.append({tok: Logprob(float(torch.log_softmax(scaled, -1)[tok]))})
                tokens.append(tok)
                if tok in p.stop_token_ids:
                    break
            out.append(RequestOutput([Completion(tokens, logprobs)]))
        return out
'''


@pytest.fixture
def standin_dir(tmp_path: Path) -> Path:
    """A folder holding the stand-in `vllm` package (put it on sys.path to make `import vllm` work)."""
    (tmp_path / "standin" / "vllm").mkdir(parents=True)
    (tmp_path / "standin" / "vllm" / "__init__.py").write_text(STANDIN)
    return tmp_path / "standin"


def _config(*overrides: str):
    from presets import PRESETS
    from rlconf.load import load_config

    return load_config(None, preset="tiny-grpo", overrides=list(overrides), presets=PRESETS)


def _vllm_plan(*overrides: str):
    """The plan of tiny-grpo with rollout.engine: vllm on cpu (validated as embedded, see the docstring)."""
    from rlconf.plan.assemble import compile_parts
    from rlconf.validate import check_config

    cfg = _config(*overrides)
    # Validated as embedded (the validator refuses vLLM on cpu: the stand-in exists only here), then planned
    # as vllm without the run-level rules.
    assert not [i for i in check_config(cfg) if i.severity == "error"]
    return compile_parts(replace(cfg, rollout=replace(cfg.rollout, engine="vllm")), check=False)


# ------------------------------------------------------------------------------------------- the worker
def _left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _check_weights(llm, actor) -> None:
    """The stand-in model holds exactly the actor's weights (HF names, TP shards gathered)."""
    from rltrain.rollout.weight_sync import iter_hf_weights

    params = dict(llm.model.named_parameters())
    streamed = dict(iter_hf_weights(actor.chunks, actor.arch))
    tied = {"lm_head.weight"} if actor.arch.share_embeddings_and_output_weights else set()
    assert set(streamed) == set(params) - tied
    for name, tensor in streamed.items():
        assert torch.equal(params[name], tensor), name


def _run_worker(rank: int, world: int, port: int, standin: str, overrides: list[str], out_dir: str) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import destroy_parallel, init_distributed
    from rltrain.workers import PolicyWorker

    sys.path.insert(0, standin)
    vllm = importlib.import_module("vllm")  # the stand-in, as the adapter will import it
    assert vllm.__file__.startswith(standin)
    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    plan = _vllm_plan(*overrides)
    assert plan.refit is not None and plan.refit.mode == "vllm"
    policy = PolicyWorker("actor", rank, world, "127.0.0.1", port, plan)
    policy.init_model()
    host = plan.layout("rollout").grid[rank].tp == 0
    assert (policy.vllm.engine is not None) == host
    tok = policy._tokenizer()
    r = plan.rollout
    dp_rank = parallel_state.get_data_parallel_rank()
    # 2 prompts x n = 2 per actor DP shard, as the controller sends them (n copies are separate rows).
    prompts = [[5 + dp_rank, 6, 7], [8, 9, 10, 11, 12 + dp_rank]]
    ids, mask = _left_padded([p for p in prompts for _ in range(2)], tok.pad_token_id)
    report: dict[str, object] = {"host": host}
    arch = plan.model("policy").arch
    reduction, depth = max(arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size), 2 * arch.num_layers + 2
    for call in range(2):
        if call == 1:  # the actor's weights change (as an update would): the next refit carries them
            g = torch.Generator().manual_seed(5)  # the same change on every DP replica, as an update makes
            with torch.no_grad():
                for p in policy.actor.chunks[0].parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        out = policy.generate_sequences({"prompt_ids": ids, "prompt_mask": mask}, seed=77)
        n = r.max_response_length
        assert set(out) == {"input_ids", "attention_mask", "position_ids", "responses", "response_mask",
                            "rollout_log_probs"}  # fmt: skip
        assert out["input_ids"].shape == (4, ids.shape[1] + n) and out["responses"].shape == (4, n)
        assert torch.equal(out["input_ids"][:, : ids.shape[1]], ids)  # this shard's own rows, in order
        assert torch.equal(out["attention_mask"][:, : ids.shape[1]], mask)
        assert out["response_mask"].sum() > 0
        # The stand-in's log-probs of its tokens are the actor's recomputation at the rollout temperature:
        # the weights it generated with are the actor's and the batch layout is the engine layout.
        recomputed = policy.compute_log_prob(out)["log_probs"] * out["response_mask"]
        assert_close(out["rollout_log_probs"], recomputed, reduction=reduction, depth=depth)
        if host:
            _check_weights(vllm.LLM.instances[-1], policy.actor)
    if host:
        report["events"] = [(name, detail if name in ("sleep",) else None) for name, detail in vllm.EVENTS]
        report["buckets"] = sum(1 for name, _ in vllm.EVENTS if name == "load_weights")
        generate = [d for name, d in vllm.EVENTS if name == "generate"]
        report["params"] = generate[0]
        report["llm_kwargs"] = {k: v for k, v in vllm.LLM.instances[-1].kwargs.items() if k != "model"}
        # Validation settings and a multi-turn turn's budget / stop tokens reach vLLM's sampling params.
        vllm.EVENTS.clear()
    policy.generate_sequences({"prompt_ids": ids, "prompt_mask": mask}, seed=78, validate=True,
                              max_new_tokens=3, extra_stop_token_ids=(41,))  # fmt: skip
    if host:
        report["validate_params"] = next(d for name, d in vllm.EVENTS if name == "generate")
    report.update(eos=tok.eos_token_id, temperature=r.train.temperature, val_temperature=r.val.temperature,
                  max_response_length=r.max_response_length, rollout_tp=plan.refit.rollout_tp)  # fmt: skip
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    destroy_parallel()


def _spawned(rank: int, world: int, port: int, standin: str, overrides: list[str], out_dir: str) -> None:
    run_spawned(_run_worker, rank, world, port, standin, overrides, out_dir)


def _run(world: int, standin: Path, out_dir: Path, *overrides: str) -> list[dict]:
    torch.multiprocessing.spawn(
        _spawned,
        args=(world, free_port(), str(standin), list(overrides), str(out_dir)),
        nprocs=world,
        join=True,
    )
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_policy_worker_generates_through_vllm_with_the_actors_weights(standin_dir, tmp_path):
    """World of 1: the worker builds vLLM, refits it from the actor in buckets before each generation
    (weights compared tensor by tensor, after an update too), generates through it, returns the engine
    layout with vLLM's log-probs, and sleeps after each generation / wakes before the next."""
    (rep,) = _run(1, standin_dir, tmp_path, "actor.megatron.tensor_model_parallel_size=1")
    names = [name for name, _ in rep["events"]]
    buckets = rep["buckets"] // 2  # two refits
    assert buckets >= 1
    assert names == ["init", *["load_weights"] * buckets, "generate", "sleep", "wake_up",
                     *["load_weights"] * buckets, "generate", "sleep"]  # fmt: skip
    assert rep["llm_kwargs"]["load_format"] == "dummy" and rep["llm_kwargs"]["enable_sleep_mode"] is True
    assert rep["llm_kwargs"]["tensor_parallel_size"] == rep["rollout_tp"] == 1
    assert rep["llm_kwargs"]["logprobs_mode"] == "processed_logprobs"
    params = rep["params"]
    assert len(params) == 4 and all(p["n"] == 1 for p in params)  # one request per row
    assert len({p["seed"] for p in params}) == 4  # the n copies of a prompt do not share a seed
    assert all(p["temperature"] == rep["temperature"] for p in params)
    assert all(p["max_tokens"] == rep["max_response_length"] for p in params)
    assert all(p["stop_token_ids"] == [rep["eos"]] and p["logprobs"] == 0 for p in params)
    val = rep["validate_params"]
    assert all(p["temperature"] == rep["val_temperature"] and p["max_tokens"] == 3 for p in val)
    assert all(p["stop_token_ids"] == [41, rep["eos"]] for p in val)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_plans_rollout_layout_decides_which_ranks_host_vllm(standin_dir, tmp_path):
    """Actor DP = 2 with rollout tp 2: the plan's rollout grid makes rank 0 the only vLLM host (at vLLM
    TP 2); rank 1 takes part in the refit and gets its own shard's rows back, generated by rank 0."""
    reps = _run(
        2,
        standin_dir,
        tmp_path,
        "cluster.gpus_per_node=2",
        "rollout.tensor_model_parallel_size=2",
        "actor.ppo_micro_batch_size_per_gpu=16",
    )
    assert [r["host"] for r in reps] == [True, False]
    assert reps[0]["llm_kwargs"]["tensor_parallel_size"] == 2
    assert len(reps[0]["params"]) == 8  # both actor DP shards' rows, generated on the host


# ------------------------------------------------------------------------------------------- validation
def test_vllm_on_cpu_is_a_named_error_even_when_vllm_imports(standin_dir, monkeypatch):
    from rlconf.errors import ConfigError

    monkeypatch.syspath_prepend(str(standin_dir))
    assert importlib.util.find_spec("vllm") is not None
    with pytest.raises(ConfigError) as info:
        _config("rollout.engine=vllm")
    (err,) = info.value.errors  # one error, not one per rule
    assert (err.path, err.rule) == ("rollout.engine", "rollout-engine")
    assert "CUDA devices only" in err.message and "cluster.device = cpu" in err.message
    assert "not installed" not in err.message and "rollout.engine: embedded" in err.fix


def test_vllm_refit_from_a_pipeline_parallel_actor_is_a_named_error(standin_dir, monkeypatch):
    from rlconf.errors import ConfigError

    monkeypatch.syspath_prepend(str(standin_dir))
    with pytest.raises(ConfigError) as info:
        _config("rollout.engine=vllm", "cluster.device=cuda", "cluster.gpus_per_node=2",
                "actor.megatron.pipeline_model_parallel_size=2")  # fmt: skip
    errs = [i for i in info.value.errors if i.rule == "rollout-engine"]
    assert [e.path for e in errs] == ["actor.megatron.pipeline_model_parallel_size"]
    assert "pipeline parallel" in errs[0].message and "rollout.engine: embedded" in errs[0].fix


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_rlconf_validate_says_vllm_is_an_optional_extra(tmp_path, device):
    """`rlconf validate` where vLLM is not installed (this venv): exit 2, and the message says plainly
    that vLLM is an optional extra, on either device."""
    assert importlib.util.find_spec("vllm") is None
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text(f"preset: tiny-grpo\nrollout:\n  engine: vllm\ncluster:\n  device: {device}\n")
    rlconf = Path(sys.executable).with_name("rlconf")
    proc = subprocess.run([str(rlconf), "validate", str(cfg)], capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text
    assert "rollout.engine" in text and "optional extra" in text, text
    if device == "cuda":
        assert "pip install 'rlplan[vllm]'" in text
