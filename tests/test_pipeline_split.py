"""rlconf.pipeline_split against megatron-core itself: for every small layout (num_layers, pp, vpp and the
uneven options) megatron's TransformerConfig accepts exactly the layouts `split_errors` accepts, and its
`get_num_layers_to_build` / `get_transformer_layer_offset` give the counts and starts rlconf computes."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from rlconf.pipeline_split import PipelineSplit, chunk_layer_counts, chunk_starts, split_errors


def _layouts():
    for n, pp, vpp in itertools.product(range(1, 11), (1, 2, 3, 4), (None, 2, 3)):
        if vpp is not None and pp == 1:
            continue  # rlplan's layers-divisible-by-pp refuses it before megatron sees it
        for first, last in itertools.product((None, 0, 1, 2, 3, 4), (None, 1, 2, 4)):
            yield PipelineSplit(n, pp, vpp, first, last)
        for emb, loss in ((True, False), (False, True), (True, True)):
            yield PipelineSplit(n, pp, vpp, embedding=emb, loss=loss)
        yield PipelineSplit(n, pp, vpp)


def _megatron(s: PipelineSplit):
    """(config, None) or (None, error text) from megatron's own checks, including get_num_layers_to_build's."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = TransformerConfig(
                num_layers=s.num_layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=s.pp,
                virtual_pipeline_model_parallel_size=s.vpp, num_layers_in_first_pipeline_stage=s.first,
                num_layers_in_last_pipeline_stage=s.last, account_for_embedding_in_pipeline_split=s.embedding,
                account_for_loss_in_pipeline_split=s.loss, pipeline_dtype=torch.float32,
            )  # fmt: skip
        vs = s.vpp or 1
        counts, starts = [], []
        for p in range(s.pp):
            vp = [k if s.vpp is not None else None for k in range(vs)]
            counts.append([get_num_layers_to_build(cfg, vp_stage=k, pp_rank=p) for k in vp])
            starts.append([get_transformer_layer_offset(cfg, vp_stage=k, pp_rank=p) for k in vp])
        if any(c < 0 for row in counts for c in row):
            return None, "negative layer count"
        return (counts, starts), None
    except (ValueError, AssertionError, ZeroDivisionError) as e:
        return None, str(e)


def test_split_matches_megatron_on_every_small_layout():
    pytest.importorskip("megatron.core")
    checked = accepted = 0
    for s in _layouts():
        got, why = _megatron(s)
        ours = split_errors(s)
        if s.pp == 1 and (s.first is not None or s.last is not None):
            assert ours, s  # megatron takes it and counts stage 0 as both first and last; rlconf refuses
            continue
        assert (got is None) == bool(ours), f"{s}: megatron says {why!r}, rlconf says {ours}"
        checked += 1
        if got is None:
            continue
        accepted += 1
        counts, starts = got
        assert chunk_layer_counts(s) == counts, s
        assert sum(map(sum, counts)) == s.num_layers, s
        if s.pp > 1:  # megatron's offset is 0 everywhere at pp = 1
            assert chunk_starts(chunk_layer_counts(s)) == starts, s
    assert checked > 1000 and 100 < accepted < checked  # both outcomes were exercised


def test_qwen3_235b_split_at_pp8_with_embedding_and_loss():
    s = PipelineSplit(94, 8, embedding=True, loss=True)
    assert split_errors(s) == []
    assert [sum(r) for r in chunk_layer_counts(s)] == [11, 12, 12, 12, 12, 12, 12, 11]
    assert split_errors(PipelineSplit(94, 8)) == [
        "num_layers = 94 is not divisible by pipeline_model_parallel_size = 8"
    ]
