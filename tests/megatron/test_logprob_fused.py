"""The fused (torch.compile'd) log-prob / entropy path equals the eager one (rltrain/megatron/logprob.py).

* log-probs, entropy and the gradients w.r.t. the logits agree for fp32 and bf16 logits, temperature 1 and
  0.7, with and without entropy, a padded vocabulary, several chunk sizes (one that does not divide the
  number of rows among them) and a loss that reads both outputs or only one;
* the compiled functions are compiled once: other row counts (one row included), chunk sizes and
  temperatures run without a recompile;
* at TP=2 (gloo, two processes) each rank's fused results and gradients equal the eager ones and the
  full-vocabulary log-softmax.
torch.compile runs on CPU through inductor's C++ backend; the shapes are tiny, compile time dominates.
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron._common import spawn

from ..tolerance import assert_close
from ._common import free_port, init_groups, run_spawned

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

VOCAB, PADDED = 100, 128  # the last 28 logits are megatron's vocabulary padding
# A log-softmax and an entropy sum over the padded vocabulary, then the backward's use of both: the two
# paths sum in different orders (inductor's vectorised reduction vs ATen's), nothing else differs.
DEPTH = 4


def _inputs(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n_rows = 9
    return {
        "logits": (torch.randn(30, PADDED, generator=g) * 3).to(dtype),
        "rows": torch.tensor([0, 3, 4, 5, 9, 17, 18, 22, 29]),
        "labels": torch.randint(0, VOCAB, (n_rows,), generator=g),
        "w_lp": torch.randn(n_rows, generator=g),
        "w_ent": torch.randn(n_rows, generator=g),
    }


def _run(
    x: dict[str, torch.Tensor],
    *,
    fused: bool,
    chunk: int | None,
    temperature: float,
    with_entropy: bool,
    loss_reads: str = "both",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    from rltrain.megatron.logprob import token_log_probs_and_entropy

    logits = x["logits"].clone().requires_grad_(True)
    lp, ent = token_log_probs_and_entropy(
        logits, x["rows"], x["labels"], temperature, VOCAB, with_entropy, chunk_tokens=chunk, fused=fused
    )
    loss = torch.zeros(())
    if loss_reads in ("both", "logp"):
        loss = loss + (lp * x["w_lp"]).sum()
    if loss_reads in ("both", "entropy") and ent is not None:
        loss = loss + (ent * x["w_ent"]).sum()
    loss.backward()
    return lp.detach(), (None if ent is None else ent.detach()), logits.grad


def _assert_same(got: tuple, ref: tuple, msg: str) -> None:
    for name, a, b in zip(("log_probs", "entropy", "grad"), got, ref, strict=True):
        if b is None:
            assert a is None, (msg, name)
            continue
        # Values are fp32 whatever the logits' dtype; the gradient has the logits' dtype, so a bf16 gradient
        # may round an fp32 difference of one ulp to a bf16 ulp: the tolerance follows the compared dtype.
        assert_close(a, b, reduction=PADDED, depth=DEPTH, msg=f"{msg}: {name}")


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_eager(mp_world, dtype, temperature, with_entropy):
    x = _inputs(dtype)
    for loss_reads in ("both", "logp", "entropy") if with_entropy else ("logp",):
        ref = _run(
            x, fused=False, chunk=4, temperature=temperature, with_entropy=with_entropy, loss_reads=loss_reads
        )
        # 9 rows: chunks of 1, of 4 (the last one 1 row), of 7 (not a divisor), one chunk, and the default.
        for chunk in (1, 4, 7, 1000, None):
            got = _run(
                x,
                fused=True,
                chunk=chunk,
                temperature=temperature,
                with_entropy=with_entropy,
                loss_reads=loss_reads,
            )
            _assert_same(
                got, ref, f"{dtype} T={temperature} entropy={with_entropy} {loss_reads} chunk={chunk}"
            )
            grad = got[2]
            # Padded vocabulary entries and rows that were not selected get exactly no gradient.
            assert grad[:, VOCAB:].abs().max() == 0 and grad[[1, 2, 6]].abs().max() == 0
            assert grad.abs().max() > 0
    # And the fused path itself against plain torch on the unpadded vocabulary (so the pair cannot agree on
    # a wrong answer): log-softmax and entropy of logits / T.
    lp, ent, _ = _run(x, fused=True, chunk=None, temperature=temperature, with_entropy=True)
    full = torch.log_softmax(x["logits"][x["rows"], :VOCAB].float() / temperature, -1)
    assert_close(lp, full.gather(1, x["labels"][:, None]).squeeze(1), reduction=PADDED, depth=2)
    assert_close(ent, -(full.exp() * full).sum(-1), reduction=PADDED, depth=2)


def test_fused_compiles_once(mp_world):
    """After one call of each kind, other row counts, chunk sizes, temperatures and a no-grad call reuse the
    compiled kernels: a recompile raises."""
    from rltrain.megatron.logprob import token_log_probs_and_entropy

    x = _inputs(torch.float32, seed=1)
    for with_entropy in (True, False):
        _run(x, fused=True, chunk=4, temperature=1.0, with_entropy=with_entropy)
    g = torch.Generator().manual_seed(2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n, chunk, temperature in ((1, 4, 1.0), (2, 1, 0.7), (5, 3, 1.3), (17, 1000, 1.0), (30, 7, 0.9)):
            rows = torch.randperm(30, generator=g)[:n]
            labels = torch.randint(0, VOCAB, (n,), generator=g)
            y = {**x, "rows": rows, "labels": labels, "w_lp": torch.randn(n), "w_ent": torch.randn(n)}
            for with_entropy in (True, False):
                got = _run(y, fused=True, chunk=chunk, temperature=temperature, with_entropy=with_entropy)
                ref = _run(y, fused=False, chunk=chunk, temperature=temperature, with_entropy=with_entropy)
                _assert_same(got, ref, f"n={n} chunk={chunk} T={temperature} entropy={with_entropy}")
            with torch.no_grad():
                lp, _ = token_log_probs_and_entropy(x["logits"], rows, labels, temperature, VOCAB, fused=True)
            assert_close(lp, ref[0], reduction=PADDED, depth=DEPTH)
            # A plain sum's gradient arrives expanded (stride 0), not as a contiguous [n] tensor.
            logits = x["logits"].clone().requires_grad_(True)
            lp, ent = token_log_probs_and_entropy(logits, rows, labels, temperature, VOCAB, fused=True)
            (lp.sum() + ent.sum()).backward()
            ref_logits = x["logits"].clone().requires_grad_(True)
            lp, ent = token_log_probs_and_entropy(ref_logits, rows, labels, temperature, VOCAB)
            (lp.sum() + ent.sum()).backward()
            assert_close(logits.grad, ref_logits.grad, reduction=PADDED, depth=DEPTH)


# ------------------------------------------------------------------------------------ TP=2
def _tp2_body(rank: int, world: int, port: int, ref: dict) -> None:
    from megatron.core import parallel_state

    from rlconf.config import MegatronConfig
    from rltrain.megatron.logprob import token_log_probs_and_entropy
    from rltrain.megatron.parallel import destroy_parallel

    init_groups(
        MegatronConfig(tensor_model_parallel_size=2), "cpu", rank=rank, world_size=world, master_port=port
    )
    assert parallel_state.get_tensor_model_parallel_rank() == rank
    vocab, shard = ref["vocab"], ref["logits"].shape[-1] // 2
    local = ref["logits"][:, rank * shard : (rank + 1) * shard]  # rank 1's shard ends in 56 padded entries
    out = {}
    for fused in (False, True):
        for with_entropy in (True, False):
            x = local.clone().requires_grad_(True)
            lp, ent = token_log_probs_and_entropy(
                x, ref["rows"], ref["labels"], 0.7, vocab, with_entropy, chunk_tokens=3, fused=fused
            )
            loss = (lp * ref["w_lp"]).sum() + ((ent * ref["w_ent"]).sum() if with_entropy else 0.0)
            loss.backward()
            out[fused, with_entropy] = (lp.detach(), None if ent is None else ent.detach(), x.grad)
    for with_entropy in (True, False):
        _assert_same(out[True, with_entropy], out[False, with_entropy], f"rank {rank} entropy={with_entropy}")
    lp, ent, grad = out[True, True]
    assert_close(lp, ref["lp"], reduction=2 * shard, depth=2)
    assert_close(ent, ref["ent"], reduction=2 * shard, depth=2)
    assert_close(grad, ref["grad"][:, rank * shard : (rank + 1) * shard], reduction=2 * shard, depth=DEPTH)
    destroy_parallel()


def _tp2_worker(rank: int, world: int, port: int, ref: dict) -> None:
    run_spawned(_tp2_body, rank, world, port, ref)


@pytest.mark.multiproc
@pytest.mark.slow
def test_fused_equals_eager_at_tp2():
    g = torch.Generator().manual_seed(3)
    vocab, padded = 200, 256  # shards of 128: rank 1 holds ids 128..199 and 56 padded entries
    logits = torch.randn(20, padded, generator=g) * 3
    rows = torch.tensor([1, 2, 5, 8, 9, 13, 19])
    labels = torch.randint(0, vocab, (rows.numel(),), generator=g)
    labels[:2] = torch.tensor([3, 150])  # one label in each rank's shard, at least
    w_lp, w_ent = torch.randn(rows.numel(), generator=g), torch.randn(rows.numel(), generator=g)
    # Plain torch on the full, unpadded vocabulary.
    full = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(full[rows, :vocab] / 0.7, -1)
    lp = logp.gather(1, labels[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    ref = {
        "vocab": vocab,
        "logits": logits,
        "rows": rows,
        "labels": labels,
        "w_lp": w_lp,
        "w_ent": w_ent,
        "lp": lp.detach(),
        "ent": ent.detach(),
        "grad": full.grad,
    }
    spawn(_tp2_worker, args=(2, free_port(), ref), nprocs=2, join=True)
