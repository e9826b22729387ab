"""Helpers shared by the megatron tests, the processes they spawn and the benchmarks: a tiny random Qwen2 on
disk, synthetic RL batches, config sections for the tiny model, and engines built from config sections
through a compiled plan (`rlconf.plan.small_plan` + `from_plan`, the path a run takes)."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from rlconf.config import ActorConfig, CriticConfig, MegatronConfig, ModelArch, ModelConfig, Optim
from rlconf.lora import LoraPlan
from rlconf.plan import TrainerPlan, small_plan
from rlconf.seeding import run_seed
from rltrain.megatron.parallel import GroupSizes, init_parallel
from rltrain.megatron.parallel import free_port as free_port  # re-exported for the tests

from ..tolerance import assert_close

# Small enough for 2 CPU cores, large enough to exercise GQA (4 heads / 2 groups), TP=2 and PP=2
# (4 layers), a vocabulary that is not a multiple of 128 (padding) and untied lm_head variants.
TINY = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
# What a log-prob of the tiny model passes through, for tolerances (tests/tolerance.py): its widest sum
# (the MLP's inner dimension, or the vocabulary padded to 128) and the reductions in sequence (attention and
# MLP per layer, the final norm and the output layer). An update adds a backward pass and another forward.
TINY_REDUCTION = max(TINY["hidden_size"], TINY["intermediate_size"], 128)
TINY_DEPTH = 2 * TINY["num_hidden_layers"] + 2
UPDATE_DEPTH = 3 * TINY_DEPTH


def make_tiny_qwen2(path: str | os.PathLike, tie: bool = True, seed: int = 0) -> Path:
    """Save a random tiny Qwen2ForCausalLM to `path` (weights scaled up so logits are not flat)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**TINY, tie_word_embeddings=tie)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return Path(path)


def hf_logits(path: str | os.PathLike, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits


# Tensor methods that read a value back to the host: on a GPU each waits for all work queued before it.
HOST_READS = ("item", "tolist", "__float__", "__int__", "cpu", "numpy")


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Any read of a tensor's value on the host (`HOST_READS`) fails the test inside this block."""
    import pytest

    with monkeypatch.context() as m:
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host read: Tensor.{_n}"))
        yield


def batch_from_lengths(
    lens: list[tuple[int, int]], p: int, r: int, vocab: int = 100, seed: int = 0
) -> dict[str, torch.Tensor]:
    """verl layout from (prompt length, response length) per row: prompts left-padded to p, responses
    right-padded to r, random token ids in [1, vocab)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    input_ids = torch.zeros(b, p + r, dtype=torch.long)
    attention_mask = torch.zeros(b, p + r, dtype=torch.long)
    response_mask = torch.zeros(b, r, dtype=torch.long)
    for i, (pl, rl) in enumerate(lens):
        input_ids[i, p - pl : p] = torch.randint(1, vocab, (pl,), generator=g)
        input_ids[i, p : p + rl] = torch.randint(1, vocab, (rl,), generator=g)
        attention_mask[i, p - pl : p + rl] = 1
        response_mask[i, :rl] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, p:].clone(),
        "response_mask": response_mask,
    }


def make_batch(
    b: int = 4, p: int = 6, r: int = 5, vocab: int = 100, seed: int = 0
) -> dict[str, torch.Tensor]:
    """verl layout: prompts left-padded to p, responses right-padded to r (lengths vary per row)."""
    return batch_from_lengths([(p - (i % 3), r - (i % 2) * 2) for i in range(b)], p, r, vocab, seed)


def assert_tiny_close(
    actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None, depth: int = TINY_DEPTH
) -> None:
    """Two computations of a tiny-model quantity (fp32 log-probs, entropy, values) agree to the rounding of
    their reductions; pass depth=UPDATE_DEPTH for values computed after an optimizer step."""
    assert_close(actual, expected, reduction=TINY_REDUCTION, depth=depth, msg=msg)


def assert_export_round_trips(
    actor, src: str | os.PathLike, out: str | os.PathLike, config_keys, hf_class: str, msg: str = ""
) -> None:
    """`actor`'s export of the weights it loaded from the HF folder `src`: every tensor bit-identical to the
    source, the config values under `config_keys` unchanged, and transformers loads it as `hf_class`."""
    import transformers

    from rltrain.megatron.hf_weights import export_hf_weights

    from .test_parity import assert_same_safetensors

    export_hf_weights(actor.chunks, actor.arch, out)
    assert_same_safetensors(src, out)
    before = transformers.AutoConfig.from_pretrained(str(src)).to_dict()
    after = transformers.AutoConfig.from_pretrained(str(out)).to_dict()
    for key in config_keys:
        assert after.get(key) == before.get(key), (msg, key)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(loaded).__name__ == hf_class, msg


# What every spawned test process imports anyway (torch, megatron-core, transformers, rltrain's engine): the
# fork server imports it once per test session and forks each child from there, so a child starts in
# milliseconds instead of re-importing ~10 s of modules (on 2 cores, the bulk of a multi-process test).
FORKSERVER_PRELOAD = [
    "torch",
    "megatron.core",
    "transformers",
    "rltrain.megatron.engine",
    "tests.megatron._common",
]


def spawn(fn: Callable[..., None], args: tuple = (), nprocs: int = 1, join: bool = True) -> object:
    """torch.multiprocessing.spawn's contract (fn(rank, *args) in `nprocs` processes, a child's failure
    raised here) with children forked from a fork server that preloaded FORKSERVER_PRELOAD. A fork server
    is a fresh single-threaded process (not this one, with its threads and gloo groups), so each child is
    as clean as a spawned one."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")


def run_spawned(fn: Callable[..., None], *args: object) -> None:
    """Body of a torch.multiprocessing.spawn child on CPU: one thread, and the child's traceback printed
    (mp.spawn reports only the exception type of a child otherwise)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        fn(*args)
    except Exception:
        traceback.print_exc()
        raise


def in_triton_interpreter(script: str) -> None:
    """Run `script` (Python that raises on a failed check) in a child process with triton's interpreter on
    (TRITON_INTERPRET=1, read when triton decorates the kernels, hence a fresh process): the Triton kernels
    run on CPU tensors. Skips where triton is not installed (CI's CPU install has none); the interpreter
    rounds 16-bit stores toward zero where the GPU rounds to nearest, so checks allow one step of the dtype."""
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton", reason="needs triton (its interpreter runs the kernels on the CPU)")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(repo), *sys.path])}
    code = f"{script}\nprint('interpreted ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "interpreted ok" in done.stdout, done.stderr[-3000:]


def check_kernels_where(where: str, module: str) -> None:
    """Run `module`'s `_check_all(device, exact_rounding)` (its Triton kernels against their reference over its
    cases) on a CUDA GPU (`where` "cuda"; skips without one, as in CI) or in triton's interpreter on CPU
    tensors ("interpreter"; skips without triton, as in CI), where 16-bit stores round toward zero."""
    import importlib

    import pytest

    if where == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (the Triton kernels)")
        importlib.import_module(module)._check_all("cuda", exact_rounding=True)
    else:
        in_triton_interpreter(f"from {module} import _check_all; _check_all('cpu', exact_rounding=False)")


def reference_log_probs(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Plain recomputation: log softmax of full-vocabulary logits [B, S, V] at the response positions."""
    r = batch["responses"].shape[1]
    s = batch["input_ids"].shape[1]
    lp = torch.log_softmax(logits.float(), -1)[:, s - r - 1 : s - 1]
    out = lp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return out * batch["response_mask"]


def tiny_model_cfg(path: str | None = None, attention_backend: str = "sdpa") -> ModelConfig:
    arch = ModelArch(num_layers=4, vocab_size=100, max_position_embeddings=128)
    return ModelConfig(path=path, arch=arch, attention_backend=attention_backend)  # type: ignore[arg-type]


def actor_cfg(tp: int = 1, pp: int = 1, vpp: int | None = None, **kw) -> ActorConfig:
    mcfg = MegatronConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    defaults = dict(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        log_prob_micro_batch_size_per_gpu=2,
        optim=Optim(lr=1e-3, clip_grad=1.0),
    )
    defaults.update(kw)
    return ActorConfig(megatron=mcfg, **defaults)  # type: ignore[arg-type]


class CountForwards:
    """Records (rows, columns, start column) of every cached forward of the embedded engine
    (rltrain/megatron/inference.py `KVCacheGenerator.forward`), for tests of what is prefilled when."""

    def __init__(self, monkeypatch) -> None:
        from rltrain.megatron.inference import KVCacheGenerator

        self.calls: list[tuple[int, int, int]] = []
        inner = KVCacheGenerator.forward

        def forward(engine, tokens, start, rows, mask):
            self.calls.append((tokens.shape[0], tokens.shape[1], start))
            return inner(engine, tokens, start, rows, mask)

        monkeypatch.setattr(KVCacheGenerator, "forward", forward)

    def prefill_tokens(self) -> int:
        """Tokens fed by multi-column (prefill) forwards: rows x columns."""
        return sum(rows * cols for rows, cols, _ in self.calls if cols > 1)


# ------------------------------------------------------------------------------------ engines from sections
def world_size() -> int:
    """Ranks of the torch.distributed world (1 before it is initialised)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def group_sizes(mcfg: MegatronConfig) -> GroupSizes:
    """The process-group sizes a megatron section asks for."""
    return GroupSizes(
        tp=mcfg.tensor_model_parallel_size,
        pp=mcfg.pipeline_model_parallel_size,
        vpp=mcfg.virtual_pipeline_model_parallel_size,
        cp=mcfg.context_parallel_size,
        ep=mcfg.expert_model_parallel_size,
        etp=mcfg.expert_tensor_parallel_size,
    )


def init_groups(mcfg: MegatronConfig, device: str, **dist_kwargs: object) -> None:
    """torch.distributed and megatron's groups of a megatron section (its seed, or the default)."""
    init_parallel(group_sizes(mcfg), device, seed=run_seed(mcfg.seed), **dist_kwargs)


def actor_plan(
    model_cfg: ModelConfig,
    actor_cfg: ActorConfig,
    device: str,
    total_steps: int = 1,
    rollout_n: int = 1,
    megatron_cfg: MegatronConfig | None = None,
    optim: Optim | None = None,
    arch: ModelArch | None = None,
) -> TrainerPlan:
    """The small plan of one actor from config sections (one mini-batch of `actor_cfg.ppo_mini_batch_size`
    x `rollout_n` rows per step, `total_steps` steps); `megatron_cfg` / `optim` replace the actor's own."""
    from dataclasses import replace

    if megatron_cfg is not None:
        actor_cfg = replace(actor_cfg, megatron=megatron_cfg)
    if optim is not None:
        actor_cfg = replace(actor_cfg, optim=optim)
    return small_plan(
        model_cfg, device, world_size(), total_steps, arch=arch, actor=actor_cfg, rollout_n=rollout_n
    )


def actor_of(
    model_cfg: ModelConfig,
    actor_cfg: ActorConfig,
    device: str,
    total_steps: int = 1,
    rollout_n: int = 1,
    megatron_cfg: MegatronConfig | None = None,
    optim: Optim | None = None,
    trainable: bool = True,
    arch: ModelArch | None = None,
    init_from=None,
):
    """The actor (or, `trainable=False`, a frozen reference policy) of `actor_plan`'s plan."""
    from rltrain.megatron.actor import MegatronActor

    plan = actor_plan(model_cfg, actor_cfg, device, total_steps, rollout_n, megatron_cfg, optim, arch)
    return MegatronActor.from_plan(plan, "actor", init_from=init_from, frozen=not trainable)


def tiny_moe_actor(
    layers: int,
    micro_batch: int,
    params_dtype: str = "float32",
    mini_batch: int = 4,
    optim: Optim | None = None,
    total_steps: int = 2,
):
    """A tiny qwen3-moe-routed actor (8 experts, top 2, grouped experts) of `layers` layers on the CPU, `mini_batch`
    rows per mini-batch in micro-batches of `micro_batch`."""
    from dataclasses import replace

    from presets.gpu import QWEN3_MOE_3B

    arch = replace(QWEN3_MOE_3B, num_layers=layers, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=16, vocab_size=128, moe_ffn_hidden_size=32,
                   num_moe_experts=8, moe_router_topk=2)  # fmt: skip
    model = ModelConfig(arch=arch, params_dtype=params_dtype, attention_backend="sdpa", moe_grouped_gemm=True)
    cfg = ActorConfig(
        ppo_mini_batch_size=mini_batch, ppo_micro_batch_size_per_gpu=micro_batch, use_dynamic_bsz=False
    )
    return actor_of(model, cfg, "cpu", total_steps=total_steps, optim=optim)


def fuse_adam_on_cpu(engine) -> None:
    """Give a CPU engine's AdamW torch's fused kernel, as `model.use_fused_torch_adam` does on accelerators (CPU
    parameters keep the foreach path there): the optimizer step is then decided on the device
    (`model.steps_on_device`, unless a bench switched it off), which the tests check on the CPU this way."""
    for sub in engine._sub_optimizers():
        for group in sub.optimizer.param_groups:
            group["fused"], group["foreach"] = True, False


def critic_of(
    model_cfg: ModelConfig,
    critic_cfg: CriticConfig,
    device: str,
    total_steps: int = 1,
    rollout_n: int = 1,
    loss_agg_mode: str = "token-mean",
    arch: ModelArch | None = None,
):
    """The critic of a small plan from config sections (one mini-batch of `critic_cfg.ppo_mini_batch_size`
    x `rollout_n` rows per step, `total_steps` steps; `loss_agg_mode` is the actor's, which the critic's
    value loss follows)."""
    from rltrain.megatron.critic import MegatronCritic

    plan = small_plan(
        model_cfg, device, world_size(), total_steps, arch=arch, critic=critic_cfg, rollout_n=rollout_n,
        actor=ActorConfig(loss_agg_mode=loss_agg_mode),  # type: ignore[arg-type]
    )  # fmt: skip
    return MegatronCritic.from_plan(plan, "critic")


def engine_of(
    model_cfg: ModelConfig,
    megatron_cfg: MegatronConfig,
    optim: Optim | None,
    device: str,
    total_steps: int = 1,
    value_head: bool = False,
    arch: ModelArch | None = None,
    init_from=None,
    lora: LoraPlan | None = None,
):
    """A bare engine of a one-role small plan (the critic's with `value_head`), frozen without `optim`,
    with `lora`'s adapters when given."""
    from dataclasses import replace

    from rltrain.megatron.engine import MegatronEngine

    plan = small_plan(
        model_cfg, device, world_size(), total_steps, megatron=megatron_cfg, optim=optim, arch=arch,
        critic=value_head,
    )  # fmt: skip
    spec = plan.engine("critic" if value_head else "actor")
    if lora is not None:
        spec = replace(spec, lora=lora)
    return MegatronEngine.from_spec(spec if optim is not None else spec.frozen(spec.role), init_from)
