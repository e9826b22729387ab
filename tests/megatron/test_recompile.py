"""Every torch.compile'd kernel of an engine with `model.fused_kernels` compiles once per dtype, whatever the
shapes it meets: multi-turn prefills of every [rows, columns], decode steps of one column, packed (one row)
and padded micro-batches, forward-only and training passes (on the H200 the 0.5B tool preset reached
torch._dynamo's recompile limit and fell back to eager kernels).

The compiled functions: megatron's SwiGLU and its backward (`fused.use_unbacked_swiglu`), the training RoPE
(`fused.compiled_rope`, forward and backward), the decode step's RoPE (`fused.fused_rotate`), the static
decode step's attention inputs (`fused.fused_decode_attention_inputs`) and sampler
(`inference.fused_sample_unfiltered`), the static MoE layers' decode glue (`moe_decode.FUSED_GLUE`) and
router (`moe_decode.fused_route`, once per routing too) and the fused log-prob reductions (logprob.py). Each
is called on rows whose count is unbacked, so no size is specialised.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ..tolerance import assert_close
from ._common import actor_cfg, actor_of, batch_from_lengths, tiny_model_cfg

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

# (rows, prompt columns) of 12 prefills: one-row and one-column ones among them.
PREFILLS = [(1, 3), (2, 5), (1, 9), (3, 4), (4, 11), (1, 1), (5, 7), (2, 12), (1, 6), (6, 2), (3, 10), (2, 8)]
# Micro-batches of very different (prompt, response) lengths, an empty response among them.
BATCHES = [
    [(1, 1), (3, 2), (5, 5), (12, 20)],
    [(4, 4)] * 4,
    [(7, 1), (2, 9), (11, 3), (1, 0)],
    [(9, 9), (9, 9), (1, 1), (2, 2)],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rope_forward_and_backward_match_megatron(dtype):
    """The compiled RoPE (megatron's fusion hook) equals megatron's unfused RoPE and its autograd gradient,
    for query / key head counts, one-row and one-column shapes and a partial rotary dimension."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from rltrain.megatron.model import compiled_rope

    gen = torch.Generator().manual_seed(0)
    for s, b, heads, d, rot in ((5, 2, 4, 16, 16), (1, 3, 2, 16, 16), (7, 1, 1, 16, 8), (4, 4, 3, 8, 8)):
        for freq_b in {1, b}:
            t = torch.randn(s, b, heads, d, generator=gen).to(dtype).requires_grad_()
            freqs = torch.rand(s, freq_b, 1, rot, generator=gen) * 20
            grad = torch.randn(s, b, heads, d, generator=gen).to(dtype)
            ref = _apply_rotary_pos_emb_bshd(t, freqs)
            (ref_grad,) = torch.autograd.grad(ref, t, grad)
            out = compiled_rope(t, freqs)
            (out_grad,) = torch.autograd.grad(out, t, grad)
            assert_close(out, ref, reduction=2)
            assert_close(out_grad, ref_grad, reduction=2)


@pytest.mark.slow
def test_engine_kernels_compile_once_across_prefill_and_packed_shapes(mp_world, tiny_hf):
    """12 prefill shapes through the KV-cache sampler, then packed and padded log-prob passes and updates of
    four very different batches: not one compiled function is compiled a second time (a recompile raises)."""
    from torch._dynamo.utils import counters

    model = dataclasses.replace(tiny_model_cfg(str(tiny_hf)), fused_kernels="compiled")
    cfg = actor_cfg(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=48, ppo_mini_batch_size=4)
    engines = {packed: actor_of(dataclasses.replace(model, use_remove_padding=packed), cfg, "cpu", total_steps=8)
               for packed in (True, False)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    # A fresh compile cache: earlier tests in this process may have compiled these functions for other dtypes,
    # which would make this test's first fp32 call a recompile.
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, (rows, cols) in enumerate(PREFILLS):
            prompts = torch.randint(1, 100, (rows, cols), generator=gen)
            # Every other rollout decodes through the static step (its fused attention inputs).
            out = engines[True].generate(prompts, 2 + i % 3, temperature=1.0, seed=i, cuda_graph=bool(i % 2))
            assert out["responses"].shape[0] == rows
        for packed, actor in engines.items():
            for i, lengths in enumerate(BATCHES):
                batch = batch_from_lengths(lengths, 12, 20, seed=i)
                old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
                batch = {**batch, "old_log_probs": old, "advantages": batch["response_mask"].float()}
                metrics = actor.update_policy(batch)
                assert metrics["actor/grad_norm"] == metrics["actor/grad_norm"], (packed, i)  # not nan
    # SwiGLU forward / backward, RoPE forward / backward, the decode RoPE, the static step's attention
    # inputs and sampler, and the fused log-prob functions.
    assert counters["stats"]["unique_graphs"] - before <= 12


@pytest.mark.parametrize("norms", [False, True], ids=["plain", "qk_norm"])
def test_decode_attention_inputs_match_megatrons_modules_and_compile_once(norms):
    """The static decode step's fused attention inputs (split, Qwen3's per-head q/k RMSNorm, RoPE, cache
    write) against megatron's own ops on the same unsplit QKV: eager bit for bit (fp32 and bf16), compiled
    to the dtype's rounding, across row counts (one row: a rollout's last), cache lengths and columns, compiled once per
    dtype; the caches are written in place at the column and nowhere else."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from torch._dynamo.utils import counters

    from rltrain.megatron import fused

    groups, per_group, d, rot = 2, 3, 16, 8
    gen = torch.Generator().manual_seed(1)
    before = counters["stats"]["unique_graphs"]
    for dtype in (torch.float32, torch.bfloat16):
        q_norm = torch.nn.RMSNorm(d, eps=1e-6).to(dtype) if norms else None
        k_norm = torch.nn.RMSNorm(d, eps=1e-6).to(dtype) if norms else None
        if norms:
            with torch.no_grad():
                q_norm.weight.normal_(1.0, 0.2, generator=gen)
                k_norm.weight.normal_(1.0, 0.2, generator=gen)
        weights = (q_norm.weight, k_norm.weight) if norms else (None, None)
        for rows, max_len, col in ((1, 12, 3), (5, 12, 11), (3, 40, 0), (8, 40, 25), (1, 40, 39)):
            mixed = torch.randn(rows, groups, (per_group + 2) * d, generator=gen).to(dtype)
            freqs = torch.rand(rows, 1, rot, generator=gen) * 20
            cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
            # megatron: get_query_key_value_tensors' split and reshape, the norm modules, its RoPE.
            q_ref, k_ref, v_ref = torch.split(mixed[None], [per_group * d, d, d], dim=3)
            q_ref = q_ref.reshape(1, rows, groups * per_group, d)
            if norms:
                q_ref, k_ref = q_norm(q_ref), k_norm(k_ref)
            q_ref = _apply_rotary_pos_emb_bshd(q_ref, freqs[None])[0]
            k_ref = _apply_rotary_pos_emb_bshd(k_ref, freqs[None])[0]
            for fn in (fused.decode_attention_inputs, fused.fused_decode_attention_inputs):
                caches = [torch.randn(max_len, rows, groups, d, generator=gen).to(dtype) for _ in range(2)]
                before_write = [c.clone() for c in caches]
                column = torch.tensor([col])
                with torch.no_grad():
                    query = fn(mixed, cos, sin, *caches, column, *weights, 1e-6)
                exact = fn is fused.decode_attention_inputs
                check = torch.testing.assert_close if not exact else _equal
                kw = {} if exact else {"reduction": d}
                (check if exact else assert_close)(query, q_ref, **kw)
                (check if exact else assert_close)(caches[0][col], k_ref, **kw)
                assert torch.equal(caches[1][col], v_ref[0]), "values are copied as they are"
                for cache, old in zip(caches, before_write, strict=True):
                    others = torch.arange(max_len) != col
                    assert torch.equal(cache[others], old[others]), "only the decode column is written"
    assert counters["stats"]["unique_graphs"] - before <= 2  # one graph per dtype, whatever the rows


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual, expected)


def test_decode_attention_inputs_past_the_recompile_limit_run_eagerly():
    """One graph per attention shape: more shapes in one process than torch compiles (a long GPU test
    session) run the same function eagerly, with a warning, instead of failing."""
    from rltrain.megatron import fused

    fused._warn_eager_once.cache_clear()  # the warning is once per function and process
    gen = torch.Generator().manual_seed(4)
    limit = torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(UserWarning, match="recompile limit"):
        for d in (8, 16, 24, 32):
            mixed = torch.randn(3, 1, 4 * d, generator=gen)
            cos, sin = torch.rand(3, 1, d, generator=gen), torch.rand(3, 1, d, generator=gen)
            caches = [torch.zeros(5, 3, 1, d) for _ in range(2)]
            got = fused.fused_decode_attention_inputs(
                mixed, cos, sin, *caches, torch.tensor([1]), None, None, 0.0
            )
            want = fused.decode_attention_inputs(mixed, cos, sin, *[torch.zeros(5, 3, 1, d) for _ in range(2)],
                                                 torch.tensor([1]), None, None, 0.0)  # fmt: skip
            assert_close(got, want, reduction=1)
    assert torch._dynamo.config.recompile_limit == limit


def _reference_draw(
    logits: torch.Tensor, temperature: float, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling in float64 over the whole vocabulary, written independently of `inverse_cdf`:
    (tokens, log-probs, whether each row's draw is clear of a CDF step by more than fp32 rounding)."""
    scaled = logits.double() / temperature
    cdf = torch.softmax(scaled, -1).cumsum(-1)
    u = uniform.double()[:, None]
    tok = torch.searchsorted(cdf, u).squeeze(1).clamp(max=logits.shape[1] - 1)
    lp = torch.log_softmax(scaled, -1).gather(1, tok[:, None]).squeeze(1)
    clear = (cdf - u).abs().amin(-1) > 1e-4
    return tok, lp, clear


def test_unfiltered_sampler_reads_the_output_layers_logits_and_compiles_once():
    """The static step samples from the output layer's logits as they are (bf16, padded vocabulary):
    `sample_unfiltered` draws what a float64 inverse CDF over the real vocabulary draws (never a padded
    column) with its log-probs; `sample_tokens` on the fp32 copy gives the same bits; compiled, the same
    tokens, with a float temperature or the static step's tensor one; and with the tensor it compiles
    once per dtype across row counts and temperatures (one row: a rollout's last)."""
    from torch._dynamo.utils import counters

    from rltrain.megatron.inference import (
        CDF_BLOCK,
        fused_sample_unfiltered,
        sample_tokens,
        sample_unfiltered,
    )

    vocab, padded = 2 * CDF_BLOCK + 37, 2 * CDF_BLOCK + 64  # a ragged last block, padded columns past it
    gen = torch.Generator().manual_seed(3)
    compared = 0
    for dtype in (torch.float32, torch.bfloat16):
        before = counters["stats"]["unique_graphs"]
        for rows in (1, 6, 17, 1):
            logits = (torch.randn(rows, padded, generator=gen) * 3).to(dtype)
            logits[:, vocab:] = 50.0  # padding that would win every draw if it were read
            uniform = torch.rand(rows, generator=gen)
            for temperature in (1.0, 0.7, 1.3):
                ref_tok, ref_lp, clear = _reference_draw(logits[:, :vocab].float(), temperature, uniform)
                tok, lp = sample_unfiltered(logits, vocab, temperature, uniform)
                assert torch.equal(tok[clear], ref_tok[clear]), (dtype, rows, temperature)
                assert bool((tok < vocab).all())
                assert_close(lp[clear], ref_lp[clear].float(), reduction=vocab)
                compared += int(clear.sum())
                full_tok, full_lp = sample_tokens(logits[:, :vocab].float(), temperature, uniform=uniform)
                assert torch.equal(full_tok, tok) and torch.equal(full_lp, lp)
                as_tensor = torch.tensor(temperature)
                assert all(map(torch.equal, sample_unfiltered(logits, vocab, as_tensor, uniform), (tok, lp)))
                got_tok, got_lp = fused_sample_unfiltered(logits, vocab, as_tensor, uniform)
                assert torch.equal(got_tok, tok), (dtype, rows, temperature)
                assert_close(got_lp, lp, reduction=vocab)
        assert counters["stats"]["unique_graphs"] - before <= 1, dtype  # one graph per dtype
    assert compared >= 60  # (of 72 draws: a draw within 1e-4 of a CDF step is left out)


def test_moe_decode_glue_compiles_once_across_row_counts():
    """The compiled MoE glue (dispatch by rank, SwiGLU-times-probability, combine) over every row count a
    rollout meets (one row, a decode batch, a prefill's) compiles once per function and dtype (a recompile
    raises), and gives the eager reference's integers and rows exactly, its activations to rounding."""
    from torch._dynamo.utils import counters

    from rltrain.megatron import moe_decode

    gen = torch.Generator().manual_seed(6)
    k, experts, hidden, ffn = 4, 6, 16, 8
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (1, 2, 7, 64, 3, 33):
            x = torch.randn(tokens, hidden, generator=gen)
            probs = torch.rand(tokens, experts, generator=gen)
            index = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices
            got = moe_decode.fused_dispatch(x, index, probs)
            want = moe_decode.dispatch(x, index, probs)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and torch.equal(g, w), tokens
            h = torch.randn(tokens * k, 2 * ffn, generator=gen)
            fused_glue, eager_glue = moe_decode.FUSED_GLUE, moe_decode.EAGER_GLUE
            assert_close(fused_glue.swiglu(h, want[1]), eager_glue.swiglu(h, want[1]), reduction=1)
            y = torch.randn(tokens * k, hidden, generator=gen)
            assert_close(
                moe_decode.fused_combine(y, want[2], torch.float32),
                moe_decode.combine(y, want[2], torch.float32),
                reduction=k,
            )
    assert counters["stats"]["unique_graphs"] - before == 3  # dispatch, SwiGLU, combine: once each


def test_moe_decode_router_compiles_once_across_row_counts():
    """The static MoE router (`moe_decode.fused_route`) over the row counts a rollout meets compiles once
    per routing (a new TopkRouting instance of the same values is the same graph) and gives the eager
    reference's experts and, to fp32 rounding, its probabilities."""
    from torch._dynamo.utils import counters

    from rltrain.megatron import moe_decode

    gen = torch.Generator().manual_seed(9)
    experts = 16
    routings = (
        moe_decode.TopkRouting(4, "softmax", False, None, None, None),
        moe_decode.TopkRouting(4, "sigmoid", False, 4, 2, 2.5),
    )
    bias = torch.rand(experts, generator=gen) * 0.1
    for routing in routings:
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        b = bias if routing.score_function == "sigmoid" else None
        with torch._dynamo.config.patch(error_on_recompile=True):
            for tokens in (1, 2, 7, 64, 3):
                logits = torch.randn(tokens, experts, generator=gen)
                got_p, got_i = moe_decode.fused_route(logits, b, dataclasses.replace(routing))
                want_p, want_i = moe_decode.route(logits, b, routing)
                assert torch.equal(got_i, want_i), (tokens, routing)
                torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-6)
        assert counters["stats"]["unique_graphs"] - before == 1


def test_moe_decode_glue_past_the_recompile_limit_runs_eagerly():
    """More MoE shapes in one process than torch compiles run the glue eagerly, with a warning."""
    from rltrain.megatron import fused, moe_decode

    fused._warn_eager_once.cache_clear()  # the warning is once per function and process
    gen = torch.Generator().manual_seed(7)
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(UserWarning, match="recompile limit"):
        for experts in (3, 4, 5):  # the expert count is static: a new graph each
            x = torch.randn(5, 8, generator=gen)
            probs = torch.rand(5, experts, generator=gen)
            index = torch.randint(0, experts, (5, 2), generator=gen)
            got = moe_decode.fused_dispatch(x, index, probs)
            for g, w in zip(got, moe_decode.dispatch(x, index, probs), strict=True):
                assert torch.equal(g, w)
