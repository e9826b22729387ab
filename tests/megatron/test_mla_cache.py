"""The embedded rollout's latent KV cache for multi-head latent attention (rltrain.megatron.mla_cache) on a tiny
random DeepseekV3 folder (tests/megatron/test_mla_parity.py's: q_lora_rank set and unset, DeepSeek's YaRN): greedy tokens
equal the no-cache path's (megatron's own MLA forward over the whole sequence at every step), sampled
log-probs equal a recompute pass (compute_log_prob) within fp32 rounding, the static decode step gives the
dynamic path's batch, and what the cache allocates is what the plan's memory estimate counts per token."""

from __future__ import annotations

import pytest
import torch

from rlconf.config import ModelConfig
from tests.megatron._common import spawn

from ..tolerance import assert_close
from ._common import actor_cfg, actor_of, make_batch
from .test_mla_parity import CASES, DEPTH, REDUCTION, make_deepseek_v3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


@pytest.fixture(scope="module", params=list(CASES))
def actor(mp_world, tmp_path_factory, request):
    rank, args = CASES[request.param]
    path = make_deepseek_v3(tmp_path_factory.mktemp("mla") / "hf", rank, **args)
    return actor_of(
        ModelConfig(path=str(path), attention_backend="sdpa"), actor_cfg(), "cpu", trainable=False
    )


def _prompts(b: int = 6) -> torch.Tensor:
    """Left-padded prompts of lengths 6, 5, 4, 6, 5, 4 (pad 0)."""
    return make_batch(b=b)["input_ids"][:, :6]


def _close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    assert_close(got, want, reduction=REDUCTION, depth=DEPTH, msg=msg)


def _same_batch(a: dict, b: dict, msg: str) -> None:
    for key in KEYS:
        assert torch.equal(a[key], b[key]), f"{msg}: {key}\n{a[key]}\n{b[key]}"
    _close(a["rollout_log_probs"], b["rollout_log_probs"], msg)


def test_the_cache_holds_the_compressed_latent(actor, monkeypatch):
    from rlconf.model_count import kv_cache_width
    from rltrain.megatron import inference

    assert inference.kv_cache_unsupported(actor) is None
    shapes: list[list[tuple[int, ...]]] = []
    inner = inference.KVCacheGenerator._allocate

    def allocate(engine, rows):
        inner(engine, rows)
        shapes.append([tuple(t.shape) for layer in engine.cache[0] for t in layer])

    monkeypatch.setattr(inference.KVCacheGenerator, "_allocate", allocate)
    actor.generate(_prompts(), 4, temperature=0.0, pad_id=0)
    arch = actor.arch
    width = sum(shape[-1] for shape in shapes[0][:2])
    assert width == kv_cache_width(arch) == arch.kv_lora_rank + arch.qk_pos_emb_head_dim
    assert len(shapes[0]) == 2 * arch.num_layers and all(s[1:3] == (6, 1) for s in shapes[0])


def test_greedy_matches_the_no_cache_path(actor):
    prompts = _prompts()
    _same_batch(actor.generate(prompts, 8, temperature=0.0, pad_id=0, use_cache=False),
                actor.generate(prompts, 8, temperature=0.0, pad_id=0), "greedy")  # fmt: skip


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_a_recompute(actor, temperature):
    prompts = _prompts()
    kw = dict(temperature=temperature, top_p=0.9, top_k=20, pad_id=0, seed=3)
    out = actor.generate(prompts, 8, **kw)
    recomputed = actor.compute_log_prob(out, temperature=temperature, with_entropy=False)["log_probs"]
    print(
        f"max |rollout - recomputed log-prob| {float((out['rollout_log_probs'] - recomputed).abs().max()):.3g}"
    )
    _close(out["rollout_log_probs"], recomputed, "sampled vs recompute")
    assert (out["rollout_log_probs"] < 0).any()
    _same_batch(actor.generate(prompts, 8, **kw, use_cache=False), out, "sampled")


def test_a_multi_turn_session_reuses_the_latent_cache(actor):
    """A multi-turn session (KVSession) keeps the latent cache between turn calls: a row that goes on after
    its sampled tokens reuses its cached latents, a replaced row only the matching prefix, and both equal a
    call without the session."""
    from rltrain.data import left_pad
    from rltrain.megatron.inference import KVSession, generate_with_kv_cache

    contexts = [[5, 17, 3, 44, 9, 12, 60], [8, 2, 71, 30]]
    kw = dict(temperature=1.0, pad_id=0, row_seeds=[11, 12])
    session = KVSession()
    ids, mask = left_pad(contexts, 0)
    first = generate_with_kv_cache(actor, ids, mask, 6, session=session, row_ids=[0, 1], **kw)
    row0 = contexts[0] + first["responses"][0][first["response_mask"][0].bool()].tolist()[:3] + [21, 22]
    ids, mask = left_pad([row0, [8, 2, 99, 98, 97]], 0)
    cached = generate_with_kv_cache(actor, ids, mask, 6, session=session, row_ids=[0, 1], **kw)
    plain = generate_with_kv_cache(actor, ids, mask, 6, **kw)
    assert session.reused_tokens > 0
    assert torch.equal(cached["responses"], plain["responses"])
    _close(cached["rollout_log_probs"], plain["rollout_log_probs"], "session vs plain")


def test_static_decode_step_matches_the_dynamic_path(actor, monkeypatch):
    from rltrain.megatron import inference

    monkeypatch.setattr(inference, "KEY_BUCKET", 4)  # decode crosses key-length buckets
    monkeypatch.setattr(inference, "BUCKET_ROWS", 1)
    prompts = _prompts()
    for kw in (dict(temperature=0.0), dict(temperature=0.7, top_p=0.9, top_k=20, seed=3)):
        _same_batch(actor.generate(prompts, 8, pad_id=0, **kw),
                    actor.generate(prompts, 8, pad_id=0, cuda_graph=True, **kw), str(kw))  # fmt: skip


# ------------------------------------------------------------------------------------ the preset
@pytest.mark.multiproc
def test_tiny_grpo_mla_learns_and_its_rollout_log_probs_match_the_update(tmp_path):
    """`rltrain tiny-grpo-mla` (built-in DeepSeek-V3-shaped model, one CPU worker) learns like tiny-grpo: the
    mean reward of the last 10 of 80 steps is over twice the first 10's (measured over 100 steps: 0.044 ->
    0.321, ~70 s here); the latent-cache rollout's log-probs equal the update's recompute within fp32 rounding
    on every step (rollout/logprob_diff_max, measured <= 1.9e-6), and the experts stay in use."""
    from ..test_e2e import metrics, rltrain

    out = tmp_path / "mla"
    result = rltrain("tiny-grpo-mla", "--trainer.total_steps", "80", "--trainer.save_freq", "0",
                     "--trainer.output_dir", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first and last > first + 0.1, (first, last)
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4
    assert all(1.0 <= r["actor/moe_expert_load_max"] < 8 / 4 for r in rows[-10:])


# ------------------------------------------------------------------------------------ TP=2, PP=2, EP=2
def _layouts_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    from ._common import run_spawned

    run_spawned(_run_layouts, rank, world, port, path, out)


def _run_layouts(rank: int, world: int, port: int, path: str, out: str) -> None:
    """In each layout: the latent-cache batch equals the no-cache path's (greedy and sampled), and sampled
    log-probs equal the layout's recompute; rank 0 saves its greedy tokens per layout to `out`."""
    from dataclasses import replace

    from rlconf.config import MegatronConfig
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    from ._common import init_groups

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    greedy = {}
    for name, mcfg in (("tp2", MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
                       ("pp2", MegatronConfig(pipeline_model_parallel_size=2)),
                       ("ep2", MegatronConfig(expert_model_parallel_size=2))):  # fmt: skip
        init_groups(mcfg, "cpu")
        actor = actor_of(ModelConfig(path=path, attention_backend="sdpa"), replace(actor_cfg(), megatron=mcfg),
                         "cpu", trainable=False)  # fmt: skip
        prompts = _prompts()
        cached = actor.generate(prompts, 8, temperature=0.0, pad_id=0)
        _same_batch(actor.generate(prompts, 8, temperature=0.0, pad_id=0, use_cache=False), cached, name)
        kw = dict(temperature=1.0, top_p=0.9, top_k=20, pad_id=0, seed=3)
        sampled = actor.generate(prompts, 8, **kw)
        recomputed = actor.compute_log_prob(sampled, with_entropy=False)["log_probs"]
        _close(sampled["rollout_log_probs"], recomputed, f"{name} sampled vs recompute")
        greedy[name] = cached["responses"]
        del actor
    if rank == 0:
        torch.save(greedy, out)
    destroy_parallel()


@pytest.mark.multiproc
def test_the_latent_cache_in_tp2_pp2_and_ep2_layouts(mp_world, tmp_path):
    """Two gloo processes at TP = 2 (latent projections gathered, heads split), PP = 2 (dense and MoE layers on
    two stages) and EP = 2: the cached batch equals the no-cache path's, sampled log-probs equal the recompute,
    and the greedy tokens equal the single-process engine's."""
    from ._common import free_port

    rank, args = CASES["q-lora"]
    path = make_deepseek_v3(tmp_path / "hf", rank, **args)
    out = tmp_path / "greedy.pt"
    spawn(_layouts_worker, args=(2, free_port(), str(path), str(out)), nprocs=2, join=True)
    single = actor_of(
        ModelConfig(path=str(path), attention_backend="sdpa"), actor_cfg(), "cpu", trainable=False
    )
    want = single.generate(_prompts(), 8, temperature=0.0, pad_id=0)["responses"]
    for name, got in torch.load(out).items():
        assert torch.equal(got, want), name
