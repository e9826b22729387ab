"""model.fused_kernels: the engine with torch.compile'd kernels (megatron's fused SwiGLU, the compiled RoPE
of the decode step, the fused log-prob reductions) computes what the eager engine computes.

CPU runs the same production path as a GPU (torch.compile's C++ backend instead of Triton): one engine is
built eager and one compiled from the same weights, and they must agree on sampled tokens, rollout
log-probs, recomputed log-probs / entropy and the update, to fp32 rounding. Compiling takes seconds, so the
module is marked slow.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rltrain.megatron.triton_rms_norm import TritonRMSNorm

from ..tolerance import assert_close
from ._common import UPDATE_DEPTH, actor_cfg, actor_of, assert_tiny_close, make_batch, tiny_model_cfg

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(mp_world, tiny_hf):

    eager = actor_of(tiny_model_cfg(str(tiny_hf)), actor_cfg(), "cpu", total_steps=4)
    model = replace(tiny_model_cfg(str(tiny_hf)), fused_kernels="compiled")
    fused = actor_of(model, actor_cfg(), "cpu", total_steps=4)
    return eager, fused


def test_the_plan_turns_fused_kernels_on_for_the_compiled_engine(engines):
    eager, fused = engines
    assert not eager.spec.fused_kernels
    assert fused.spec.fused_kernels
    assert fused.modules()[0].config.bias_activation_fusion  # megatron's compiled SwiGLU
    assert not eager.modules()[0].config.bias_activation_fusion

    def norm_types(engine):
        return {type(m) for m in engine.modules()[0].modules() if isinstance(m, torch.nn.RMSNorm)}

    assert norm_types(fused) == {TritonRMSNorm}  # its kernels on CUDA (test_rms_norm_kernels.py)
    assert norm_types(eager) == {torch.nn.RMSNorm}


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_compiled_engine_samples_what_the_eager_engine_samples(engines, cuda_graph):
    eager, fused = engines
    prompts = make_batch(b=6)["input_ids"][:, :6]
    kw = dict(temperature=1.0, pad_id=0, eos_id=None, seed=7, cuda_graph=cuda_graph)
    a = eager.generate(prompts, 8, **kw)
    b = fused.generate(prompts, 8, **kw)
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["response_mask"], b["response_mask"])
    assert_tiny_close(b["rollout_log_probs"], a["rollout_log_probs"])


def test_compiled_engine_log_probs_and_update_match_eager(engines):
    eager, fused = engines
    batch = make_batch(b=4)
    a = eager.compute_log_prob(batch)
    b = fused.compute_log_prob(batch)
    assert_tiny_close(b["log_probs"], a["log_probs"])
    assert_tiny_close(b["entropy"], a["entropy"])
    gen = torch.Generator().manual_seed(3)
    adv = torch.randn(4, 1, generator=gen).expand_as(a["log_probs"]) * batch["response_mask"]
    rl = {**batch, "old_log_probs": a["log_probs"], "advantages": adv.contiguous()}
    ma = eager.update_policy(rl)
    mb = fused.update_policy(rl)
    assert ma["actor/pg_loss"] == pytest.approx(mb["actor/pg_loss"], rel=1e-5, abs=1e-6)
    after_a = eager.compute_log_prob(batch)["log_probs"]
    after_b = fused.compute_log_prob(batch)["log_probs"]
    assert not torch.equal(after_a, a["log_probs"])  # the update moved the policy
    assert_tiny_close(after_b, after_a, depth=UPDATE_DEPTH)


def test_compiled_engine_sums_weight_gradients_in_their_products(engines, monkeypatch):
    """megatron's gradient accumulation fusion (`wgrad.use_fused_wgrad`): every trained linear of the compiled
    engine accumulates its weight gradient into its main_grad through `fused_weight_gradient_mlp_cuda`
    (rlplan's addmm), once per linear per micro-batch, none through DDP's hook; after one update on the same
    batch the main_grads equal the eager engine's (its products' gradients added by DDP's hooks)."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel import layers

    eager, fused = engines

    def linears(engine):
        kinds = layers.ColumnParallelLinear | layers.RowParallelLinear
        return [m for c in engine.chunks for m in c.modules() if isinstance(m, kinds)]

    trained = [m for m in linears(fused) if m.weight is not None and m.weight.requires_grad]
    assert trained and all(m.gradient_accumulation_fusion for m in trained)
    assert not any(m.gradient_accumulation_fusion for m in linears(eager))
    shim = layers.fused_weight_gradient_mlp_cuda
    calls = []

    def accumulate(x, g, main_grad):
        calls.append(main_grad.data_ptr())
        shim.wgrad_gemm_accum_fp32(x, g, main_grad)

    monkeypatch.setattr(
        layers, "fused_weight_gradient_mlp_cuda", SimpleNamespace(wgrad_gemm_accum_fp32=accumulate)
    )
    batch = make_batch(b=4)
    lp = eager.compute_log_prob(batch)["log_probs"]
    adv = torch.randn(4, 1, generator=torch.Generator().manual_seed(5)).expand_as(lp) * batch["response_mask"]
    rl = {**batch, "old_log_probs": lp, "advantages": adv.contiguous()}
    eager.update_policy(rl)
    fused.update_policy(rl)
    mains = {m.weight.main_grad.data_ptr() for m in trained}
    assert set(calls) == mains and len(calls) % len(mains) == 0  # every linear, once per micro-batch
    for (name, a), (_, b) in zip(
        eager.modules()[0].named_parameters(), fused.modules()[0].named_parameters(), strict=True
    ):
        assert_tiny_close(b.main_grad, a.main_grad, msg=name)


def test_weight_gradients_accumulate_into_main_grad_for_each_dtype():
    """`wgrad.accumulate_wgrad` (apex's wgrad_gemm_accum_*): main_grad += grad_output^T @ input, for inputs in
    main_grad's dtype (one addmm) and in a 16-bit dtype (CPU: the product added; CUDA's mixed addmm is
    checked on the device by bench/grpo_step_gpu.py's update)."""
    from rltrain.megatron.wgrad import accumulate_wgrad

    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(40, 6, generator=gen), torch.randn(40, 3, generator=gen)
    start = torch.randn(3, 6, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        main = start.clone()
        accumulate_wgrad(x.to(dtype), g.to(dtype), main)
        want = start + g.to(dtype).double().t() @ x.to(dtype).double()
        assert main.dtype == torch.float32
        assert_close(main.to(dtype), want.to(dtype), reduction=40)  # the tolerance of the inputs' dtype


def test_compiled_engine_uses_the_compiled_rope(engines):
    """The compiled engine's attention goes through megatron's RoPE fusion hook, served by `rope_bshd`,
    which is megatron's unfused RoPE bit for bit when run eagerly."""
    from megatron.core.models.common.embeddings import rope_utils

    from rltrain.megatron.model import rope_bshd

    eager, fused = engines
    assert fused.modules()[0].config.apply_rope_fusion
    assert not eager.modules()[0].config.apply_rope_fusion
    assert rope_utils.fused_apply_rotary_pos_emb is not None
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(5, 2, 3, 8, generator=gen).to(dtype)
        freqs = torch.rand(5, 1, 1, 8, generator=gen) * 30
        assert torch.equal(rope_bshd(t, freqs), rope_utils._apply_rotary_pos_emb_bshd(t, freqs))


def test_logits_come_out_batch_first_without_a_copy(engines):
    """GPTModel's closing `logits.transpose(0, 1).contiguous()` returns the output layer's own storage: the
    layer writes [b, s, V] memory (batch_first_logits), so the largest tensor of a pass is not copied."""
    eager, _ = engines
    model = eager.modules()[0]
    seen = []
    hook = model.output_layer.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    try:
        ids = make_batch(b=3)["input_ids"]
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        with torch.no_grad():
            logits = model(ids, pos, None)
    finally:
        hook.remove()
    assert logits.shape[:2] == ids.shape
    assert logits.data_ptr() == seen[0].data_ptr()


def test_a_machine_that_cannot_compile_stops_at_start_up_with_the_fix(tmp_path):
    """A broken torch.compile toolchain (here: no C++ compiler, the cpu backend's) fails the engine's start-up
    probe with a FusedKernelsError naming model.fused_kernels and the eager fallback, before any model is
    built. A fresh interpreter and inductor cache, so nothing compiled earlier is reused."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from rltrain.megatron.model import check_fused_kernels\n"
        "check_fused_kernels('cpu', torch.float32)\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c"),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "FusedKernelsError: model.fused_kernels: torch.compile cannot build kernels" in done.stderr, (
        done.stderr
    )
    assert "--model.fused_kernels eager" in done.stderr, done.stderr


def test_the_engine_picks_its_attention_inputs_once(engines, monkeypatch):
    """The static step's attention inputs: the eager plan takes the reference function, the compiled plan
    torch.compile's on CPU (the Triton kernel names the device); where the kernel can run (its predicate
    stubbed, as on a CUDA machine) the compiled plan takes it, asked once per layer shape, unless the class
    switch is off or the predicate refuses a shape (its reason kept for benchmarks)."""
    from rltrain.megatron import decode_kernels, fused
    from rltrain.megatron.inference import KVCacheGenerator

    eager, compiled = engines
    pos = torch.arange(8).expand(2, 8)
    assert KVCacheGenerator(eager, pos).attention_inputs is fused.decode_attention_inputs
    engine = KVCacheGenerator(compiled, pos)
    assert engine.attention_inputs is fused.fused_decode_attention_inputs
    assert engine.triton_inputs_unsupported.startswith("device cpu")

    asked = []
    monkeypatch.setattr(decode_kernels, "unsupported", lambda *shape: asked.append(shape))  # None: it can
    engine = KVCacheGenerator(compiled, pos)
    assert engine.attention_inputs is decode_kernels.attention_inputs
    assert engine.triton_inputs_unsupported is None
    attn = compiled.modules()[0].decoder.layers[0].self_attention
    per_group = attn.num_attention_heads_per_partition // attn.num_query_groups_per_partition
    shape = (torch.device("cpu"), compiled.modules()[0].config.params_dtype,
             attn.hidden_size_per_attention_head, per_group, engine.cos.shape[-1])  # fmt: skip
    assert asked == [shape]  # every layer has the same shape: asked once
    assert KVCacheGenerator(eager, pos).attention_inputs is fused.decode_attention_inputs

    monkeypatch.setattr(decode_kernels, "unsupported", lambda *shape: "refused")
    engine = KVCacheGenerator(compiled, pos)
    assert engine.attention_inputs is fused.fused_decode_attention_inputs
    assert engine.triton_inputs_unsupported == "refused"

    monkeypatch.setattr(decode_kernels, "unsupported", lambda *shape: None)
    monkeypatch.setattr(KVCacheGenerator, "triton_attention_inputs", False)
    assert KVCacheGenerator(compiled, pos).attention_inputs is fused.fused_decode_attention_inputs


def test_the_triton_kernel_names_the_shapes_it_cannot_run(monkeypatch):
    """`decode_kernels.unsupported`: the 1.5B's and Qwen3-MoE's layers (partial rotary and a head dim that
    is no power of two too) run on CUDA with triton; other dtypes, odd or too wide rotary dims, tiles past
    the registers, another device or no triton each give their reason."""
    from rltrain.megatron import decode_kernels

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(decode_kernels, "triton", object())  # installed, as with torch's CUDA wheels
    for d, per_group, rot in ((128, 6, 128), (128, 8, 128), (128, 6, 64), (80, 4, 80), (64, 1, 32)):
        assert decode_kernels.unsupported(cuda, bf16, d, per_group, rot) is None, (d, per_group, rot)
    assert decode_kernels.unsupported(cuda, torch.float64, 128, 6, 128).startswith("dtype")
    for rot in (0, 63, 130):
        assert decode_kernels.unsupported(cuda, bf16, 128, 6, rot).startswith("rotary dimension")
    assert "tile of 16384" in decode_kernels.unsupported(cuda, bf16, 256, 40, 256)
    assert decode_kernels.unsupported(torch.device("cpu"), bf16, 128, 6, 128).startswith("device cpu")
    monkeypatch.setattr(decode_kernels, "triton", None)
    assert decode_kernels.unsupported(cuda, bf16, 128, 6, 128) == "triton is not installed"
    powers = [decode_kernels.next_power_of_2(x) for x in (1, 2, 3, 8, 10, 80, 128)]
    assert powers == [1, 2, 4, 8, 16, 128, 128]


def test_the_engine_picks_its_decode_attention_once(engines, monkeypatch):
    """The static step's attention: SDPA over key buckets on the eager plan and here (the kernel names the
    fp32 dtype); where the kernel can run (its predicate stubbed, as on a CUDA machine) the compiled plan takes
    `decode_kernels.decode_attention`, asked once per layer shape, unless the class switch is off, a layer's
    core attention is not SdpaAttention or the predicate refuses a shape (each reason kept for benchmarks)."""
    from rltrain.megatron import decode_kernels, inference
    from rltrain.megatron.inference import KVCacheGenerator

    eager, compiled = engines
    pos = torch.arange(8).expand(2, 8)
    engine = KVCacheGenerator(eager, pos)
    assert (
        engine.decode_attention is None
        and engine.triton_attention_unsupported == "the plan's kernels are eager"
    )
    engine = KVCacheGenerator(compiled, pos)
    assert engine.decode_attention is None
    assert engine.triton_attention_unsupported.startswith("dtype torch.float32")  # the CPU tests' dtype

    asked = []
    monkeypatch.setattr(decode_kernels, "attention_unsupported", lambda *shape: asked.append(shape))
    engine = KVCacheGenerator(compiled, pos)
    assert engine.decode_attention is decode_kernels.decode_attention
    assert engine.triton_attention_unsupported is None
    attn = compiled.modules()[0].decoder.layers[0].self_attention
    per_group = attn.num_attention_heads_per_partition // attn.num_query_groups_per_partition
    config = compiled.modules()[0].config
    assert asked == [
        (torch.device("cpu"), config.params_dtype, attn.hidden_size_per_attention_head, per_group)
    ]

    monkeypatch.setattr(decode_kernels, "attention_unsupported", lambda *shape: "refused")
    assert KVCacheGenerator(compiled, pos).triton_attention_unsupported == "refused"
    monkeypatch.setattr(decode_kernels, "attention_unsupported", lambda *shape: None)
    monkeypatch.setattr(KVCacheGenerator, "triton_decode_attention", False)
    assert KVCacheGenerator(compiled, pos).decode_attention is None
    monkeypatch.setattr(KVCacheGenerator, "triton_decode_attention", True)
    # A core attention other than the exact class whose math the kernel computes (a subclass would do too).
    monkeypatch.setattr(inference, "SdpaAttention", type("OtherAttention", (), {}))
    engine = KVCacheGenerator(compiled, pos)
    assert engine.decode_attention is None
    assert engine.triton_attention_unsupported.startswith("core attention SdpaAttention")


def test_the_attention_kernel_names_the_shapes_it_cannot_run_and_splits_few_rows(monkeypatch):
    """`decode_kernels.attention_unsupported`: the 1.5B's and Qwen3-MoE's layers (and MQA, a head dim that is
    no power of two) run on CUDA with triton; fp32 / fp64, head dims or groups out of range, another device
    or no triton give their reason. `attention_splits`: columns split so that few rows still fill the SMs,
    a power of two, never past MAX_SPLITS, none where the rows alone do."""
    from rltrain.megatron import decode_kernels

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(decode_kernels, "triton", object())
    for d, per_group in ((128, 6), (128, 4), (64, 1), (80, 8), (256, 64)):
        assert decode_kernels.attention_unsupported(cuda, bf16, d, per_group) is None, (d, per_group)
        assert decode_kernels.attention_unsupported(cuda, torch.float16, d, per_group) is None
    for dtype in (torch.float32, torch.float64):
        assert decode_kernels.attention_unsupported(cuda, dtype, 128, 6).startswith("dtype")
    for d in (8, 512):
        assert decode_kernels.attention_unsupported(cuda, bf16, d, 6).startswith("head dimension")
    assert "query heads per KV group" in decode_kernels.attention_unsupported(cuda, bf16, 128, 65)
    assert decode_kernels.attention_unsupported(torch.device("cpu"), bf16, 128, 6).startswith("device cpu")
    monkeypatch.setattr(decode_kernels, "triton", None)
    assert decode_kernels.attention_unsupported(cuda, bf16, 128, 6) == "triton is not installed"
    splits = {rows: decode_kernels.attention_splits(rows, 2, 132) for rows in (1, 8, 64, 128, 256, 512)}
    assert splits == {1: 16, 8: 16, 64: 4, 128: 2, 256: 1, 512: 1}


def test_the_engine_picks_its_moe_experts_once(engines, monkeypatch):
    """The static MoE glue's experts: the compiled glue's grouped products unless the Triton kernels can run
    (CUDA, the plan's fused kernels, the class switch on, a 16-bit dtype); each reason kept, and with the
    glue off (the argsort path) there is no glue at all."""
    from rltrain.megatron import decode_kernels, moe_decode
    from rltrain.megatron.inference import KVCacheGenerator

    eager, compiled = engines
    pos = torch.arange(8).expand(2, 8)
    engine = KVCacheGenerator(eager, pos)
    assert engine.moe_glue is moe_decode.EAGER_GLUE
    assert engine.triton_experts_unsupported == "the plan's kernels are eager"
    engine = KVCacheGenerator(compiled, pos)
    assert engine.moe_glue is moe_decode.FUSED_GLUE and engine.moe_glue.experts is None
    assert engine.triton_experts_unsupported.startswith("dtype torch.float32")
    asked = []
    monkeypatch.setattr(decode_kernels, "experts_unsupported", lambda *a: asked.append(a))
    engine = KVCacheGenerator(compiled, pos)
    assert engine.moe_glue.experts is decode_kernels.expert_swiglu
    assert (
        engine.moe_glue.dispatch is moe_decode.FUSED_GLUE.dispatch
        and engine.triton_experts_unsupported is None
    )
    assert asked == [(torch.device("cpu"), compiled.modules()[0].config.params_dtype)]
    monkeypatch.setattr(KVCacheGenerator, "triton_moe_experts", False)
    assert KVCacheGenerator(compiled, pos).moe_glue is moe_decode.FUSED_GLUE
    monkeypatch.setattr(KVCacheGenerator, "fuse_moe_glue", False)
    engine = KVCacheGenerator(compiled, pos)
    assert engine.moe_glue is None and "fuse_moe_glue is off" in engine.triton_experts_unsupported


def test_the_experts_kernel_names_what_it_cannot_run_and_sizes_its_row_tiles(monkeypatch):
    """`decode_kernels.experts_unsupported`: bf16 / fp16 on CUDA with triton; fp32, another device or no triton
    give their reason. `expert_block_m`: EXPERT_ROWS_OVER_MEAN x the mean rows per expert as a power of two
    within 16..64."""
    from rltrain.megatron import decode_kernels

    cuda = torch.device("cuda")
    monkeypatch.setattr(decode_kernels, "triton", object())
    for dtype in (torch.bfloat16, torch.float16):
        assert decode_kernels.experts_unsupported(cuda, dtype) is None
    assert decode_kernels.experts_unsupported(cuda, torch.float32).startswith("dtype")
    assert decode_kernels.experts_unsupported(torch.device("cpu"), torch.bfloat16).startswith("device cpu")
    monkeypatch.setattr(decode_kernels, "triton", None)
    assert decode_kernels.experts_unsupported(cuda, torch.bfloat16) == "triton is not installed"
    blocks = {
        pairs: decode_kernels.expert_block_m(pairs, 64) for pairs in (8, 64 * 8, 256 * 8, 512 * 8, 10**6)
    }
    assert blocks == {8: 16, 512: 16, 2048: 64, 4096: 64, 10**6: 64}
    monkeypatch.setattr(decode_kernels, "EXPERT_ROWS_OVER_MEAN", 1)
    assert decode_kernels.expert_block_m(2048, 64) == 32 and decode_kernels.expert_block_m(64 * 20, 64) == 32


def test_the_engine_picks_its_residual_add_and_norm_once(engines, monkeypatch):
    """The static step's residual add with the next norm as one Triton kernel (`decode_kernels.add_rms_norm`)
    where it can run, and None with the reason otherwise: the eager plan, the class switch off, biases on
    the attention's and MLP's outputs, an fp32 residual stream, a norm that is not torch.nn.RMSNorm, and the
    kernel's own (device, triton, dtype, width). The static step calls it twice a layer."""
    from rltrain.megatron import decode_kernels
    from rltrain.megatron.inference import KVCacheGenerator

    eager, compiled = engines
    pos = torch.arange(8).expand(2, 8)
    assert KVCacheGenerator(eager, pos).add_norm_unsupported == "the plan's kernels are eager"
    engine = KVCacheGenerator(compiled, pos)
    assert engine.add_norm is None
    assert engine.add_norm_unsupported == "device cpu (the Triton kernel runs on CUDA)"
    asked = []
    monkeypatch.setattr(decode_kernels, "add_norm_unsupported", lambda *a: asked.append(a))
    engine = KVCacheGenerator(compiled, pos)
    assert engine.add_norm is decode_kernels.add_rms_norm and engine.add_norm_unsupported is None
    cfg = compiled.modules()[0].config
    assert asked == [(torch.device("cpu"), cfg.params_dtype, cfg.hidden_size)]
    for field, why in (("add_bias_linear", "biases"), ("fp32_residual_connection", "an fp32 residual")):
        with monkeypatch.context() as m:
            m.setattr(cfg, field, True)
            engine = KVCacheGenerator(compiled, pos)
            assert engine.add_norm is None and engine.add_norm_unsupported.startswith(why), field
    layer = compiled.modules()[0].decoder.layers[-1]
    with monkeypatch.context() as m:
        m.setitem(layer._modules, "pre_mlp_layernorm", torch.nn.LayerNorm(cfg.hidden_size))
        assert KVCacheGenerator(compiled, pos).add_norm_unsupported == (
            "a norm LayerNorm (the kernel is torch.nn.RMSNorm's)"
        )
    with monkeypatch.context() as m:
        m.setattr(KVCacheGenerator, "fuse_add_norm", False)
        assert KVCacheGenerator(compiled, pos).add_norm_unsupported == "KVCacheGenerator.fuse_add_norm is off"
    calls = []

    def counted(*args):
        calls.append(1)
        return decode_kernels.add_rms_norm_reference(*args)

    monkeypatch.setattr(decode_kernels, "add_rms_norm", counted)
    compiled.generate(make_batch(b=2)["input_ids"][:, :6], 3, temperature=0.0, pad_id=0, cuda_graph=True)
    assert len(calls) == 2 * len(compiled.modules()[0].decoder.layers) * 2  # two static steps of 3 tokens


def test_the_add_and_norm_kernel_names_what_it_cannot_run(monkeypatch):
    """`decode_kernels.add_norm_unsupported`: 16- and 32-bit floats on CUDA with triton, rows up to
    ADD_NORM_MAX_WIDTH wide; each other case names its reason."""
    from rltrain.megatron import decode_kernels

    cuda = torch.device("cuda")
    monkeypatch.setattr(decode_kernels, "triton", object())
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert decode_kernels.add_norm_unsupported(cuda, dtype, 1536) is None
    assert decode_kernels.add_norm_unsupported(cuda, torch.float64, 1536).startswith("dtype")
    assert decode_kernels.add_norm_unsupported(cuda, torch.bfloat16, 16384) is None
    assert decode_kernels.add_norm_unsupported(cuda, torch.bfloat16, 16385).startswith("hidden size 16385")
    assert decode_kernels.add_norm_unsupported(torch.device("cpu"), torch.bfloat16, 64).startswith(
        "device cpu"
    )
    monkeypatch.setattr(decode_kernels, "triton", None)
    assert decode_kernels.add_norm_unsupported(cuda, torch.bfloat16, 64) == "triton is not installed"


def test_megatrons_swiglu_and_its_backward_are_the_triton_kernels_where_they_can_run(monkeypatch):
    """`fused.use_unbacked_swiglu(device, dtype)` serves megatron's `swiglu` and `swiglu_back` by
    `triton_swiglu`'s kernels of those names where `triton_swiglu.unsupported` names no reason (here
    recording stand-ins for the CUDA kernels, whose parity bench/decode_kernels_tune.py --swiglu checks on
    the device), the compiled functions for mixed dtypes and where the kernels cannot run; `unsupported`
    names the device, a missing triton and a dtype."""
    from megatron.core.fusions import fused_bias_swiglu as fbs

    from rltrain.megatron import decode_kernels, fused, triton_swiglu

    def original(name):
        current = getattr(fbs, name)
        return getattr(current, "_rlplan_original", current)

    monkeypatch.setattr(decode_kernels, "triton", object())
    assert triton_swiglu.unsupported("cuda", torch.bfloat16) is None
    assert triton_swiglu.unsupported("cuda", torch.float64).startswith("dtype")
    assert triton_swiglu.unsupported("cpu", torch.bfloat16).startswith("device cpu")
    monkeypatch.setattr(decode_kernels, "triton", None)
    assert triton_swiglu.unsupported("cuda", torch.bfloat16) == "triton is not installed"

    gen = torch.Generator().manual_seed(0)
    g, y = torch.randn(5, 16, generator=gen), torch.randn(5, 32, generator=gen)
    want = {"swiglu": original("swiglu")(y), "swiglu_back": original("swiglu_back")(g, y)}
    args = {"swiglu": (y,), "swiglu_back": (g, y)}
    seen = []
    for name in want:
        stand_in = lambda *t, name=name: (seen.append((name, t[0].shape)), want[name])[1]  # noqa: E731
        monkeypatch.setattr(triton_swiglu, name, stand_in)
    for can_run in (True, False):
        for name in want:
            monkeypatch.setattr(fbs, name, original(name))  # megatron's own, restored after the test
        monkeypatch.setattr(triton_swiglu, "unsupported", lambda *a, ok=can_run: None if ok else "no")
        fused.use_unbacked_swiglu("cuda", torch.bfloat16)
        for name in want:
            seen.clear()
            torch.testing.assert_close(getattr(fbs, name)(*args[name]), want[name])
            assert seen == ([(name, args[name][0].shape)] if can_run else [])
        seen.clear()
        torch.testing.assert_close(fbs.swiglu_back(g.double(), y), want["swiglu_back"].double())  # mixed
        assert seen == []


def _rope_kernel_math(t, cos, sin, backward=False):
    """What `triton_rope.rope`'s kernel computes (checked against it in Triton's interpreter and on the device),
    in torch: the rotary half-pairs in fp32 from the fp32 tables, one rounding, the rest passed through."""
    s, b = t.shape[:2]
    rot = cos.shape[-1]
    c = cos.float().expand(s, b, rot).unsqueeze(2)
    n = sin.float().expand(s, b, rot).unsqueeze(2)
    x = t.float()
    x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
    c1, c2, s1, s2 = c[..., : rot // 2], c[..., rot // 2 :], n[..., : rot // 2], n[..., rot // 2 :]
    if backward:
        o = torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), -1)
    else:
        o = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), -1)
    return torch.cat((o, x[..., rot:]), -1).to(t.dtype)


def test_megatrons_rope_is_the_triton_kernel_where_it_can_run(monkeypatch):
    """`fused.use_compiled_rope(device, dtype)` serves megatron's RoPE hooks (padded bshd and packed thd) by
    `fused.triton_rope_hook` where `triton_rope.unsupported` names no reason, else by the compiled function.
    Triton cannot run on this CPU machine, so `triton_rope.rope` is a torch stand-in of its math here (the
    kernel itself is checked in Triton's interpreter and on the device); what runs for real is the rest:
    the hook's choice, the autograd wiring (forward and backward from one cached table), and the result
    against megatron's unfused RoPE and its autograd gradient. `tables` computes a table's cos and sin
    once and again when the angles change; shapes the kernel does not take go to the compiled function."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from rltrain.megatron import decode_kernels, fused, triton_rope

    monkeypatch.setattr(decode_kernels, "triton", object())
    assert triton_rope.unsupported("cuda", torch.bfloat16) is None
    assert triton_rope.unsupported("cuda", torch.float64).startswith("dtype")
    assert triton_rope.unsupported("cpu", torch.float32).startswith("device cpu")
    for name in ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"):
        monkeypatch.setattr(rope_utils, name, None)  # megatron's own (no Transformer Engine), restored after
    calls = []
    monkeypatch.setattr(triton_rope, "rope", lambda *a, **k: (calls.append(k), _rope_kernel_math(*a, **k))[1])
    monkeypatch.setattr(triton_rope, "unsupported", lambda *a: None)
    fused.use_compiled_rope("cuda", torch.float32)
    assert rope_utils.fused_apply_rotary_pos_emb is fused.triton_rope_hook
    assert rope_utils.fused_apply_rotary_pos_emb_thd.keywords["rotate"] is fused.triton_rope_hook

    gen = torch.Generator().manual_seed(0)
    for s, b, heads, d, rot, fb in ((5, 2, 4, 16, 16, 1), (4, 3, 2, 20, 12, 3), (1, 1, 1, 8, 8, 1)):
        t = torch.randn(s, b, heads, d, generator=gen).requires_grad_()
        freqs = torch.rand(s, fb, 1, rot, generator=gen) * 20
        grad = torch.randn(s, b, heads, d, generator=gen)
        ref = _apply_rotary_pos_emb_bshd(t, freqs)
        (ref_grad,) = torch.autograd.grad(ref, t, grad)
        calls.clear()
        out = rope_utils.fused_apply_rotary_pos_emb(t, freqs)
        (out_grad,) = torch.autograd.grad(out, t, grad)
        assert calls == [{}, {"backward": True}]
        assert_close(out, ref, reduction=2)
        assert_close(out_grad, ref_grad, reduction=2)

    freqs = torch.rand(3, 1, 1, 8, generator=gen)
    cos, _ = triton_rope.tables(freqs)
    assert triton_rope.tables(freqs)[0] is cos  # every layer's query and key: one table
    assert torch.equal(cos, torch.cos(freqs).view(3, 1, 8))
    freqs.mul_(2)  # new angles in the same tensor: computed again
    assert torch.equal(triton_rope.tables(freqs)[1], torch.sin(freqs).view(3, 1, 8))
    other = freqs.clone()  # the same angles in another tensor (another forward's table): computed again
    assert triton_rope.tables(other)[0] is not triton_rope.tables(freqs)[0]
    with torch.inference_mode():  # no version counter to check: computed every time, not cached
        frozen = torch.rand(3, 1, 1, 8, generator=gen)
        assert torch.equal(triton_rope.tables(frozen)[0], torch.cos(frozen).view(3, 1, 8))
    assert torch.equal(triton_rope.tables(frozen)[1], torch.sin(frozen).view(3, 1, 8))

    t = torch.randn(3, 2, 2, 8, generator=gen)
    odd = torch.rand(3, 1, 1, 7, generator=gen)
    assert triton_rope.args_unsupported(t, odd).startswith("rotary dimension 7")
    assert triton_rope.args_unsupported(t, torch.rand(4, 1, 1, 8)).startswith("freqs")
    assert triton_rope.args_unsupported(t.double(), torch.rand(3, 1, 1, 8)).startswith("dtype")
    calls.clear()
    assert_close(fused.triton_rope_hook(t[..., :7].contiguous(), odd[..., :6]), _apply_rotary_pos_emb_bshd(
        t[..., :7].contiguous(), odd[..., :6]), reduction=2)  # fmt: skip
    assert calls == [{}]
