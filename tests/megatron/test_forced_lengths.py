"""The benchmarks' forced response lengths (rltrain/megatron/inference.py FORCE_EOS_ENV, bench/grpo_step_gpu.py's
realistic workload): a random model's rows end at lengths with the requested mean share and a long tail, on
the dynamic and the static decode path alike; unset, nothing changes."""

from __future__ import annotations

import pytest
import torch

from ._common import actor_of


def test_forced_lengths_have_the_share_as_mean_and_a_long_tail(monkeypatch):
    from rltrain.megatron.inference import FORCE_EOS_ENV, forced_lengths

    assert forced_lengths(8, 100, 0) is None
    monkeypatch.setenv(FORCE_EOS_ENV, "0.4")
    n = forced_lengths(4096, 1024, 0)
    assert n.dtype == torch.long and int(n.min()) >= 1 and int(n.max()) == 1024
    assert float(n.float().mean()) == pytest.approx(0.4 * 1024, rel=0.01)
    assert float(n.float().median()) < 0.4 * 1024  # skewed right: most rows short, a few long
    assert torch.equal(n, forced_lengths(4096, 1024, 0)) and not torch.equal(n, forced_lengths(4096, 1024, 1))


def test_generation_stops_at_the_forced_lengths(mp_world, tiny_hf, monkeypatch):
    from rlconf.config import ModelConfig
    from rltrain.megatron.inference import FORCE_EOS_ENV, forced_lengths

    from ._common import actor_cfg

    actor = actor_of(ModelConfig(path=str(tiny_hf), attention_backend="sdpa"), actor_cfg(), "cpu")
    prompts = torch.randint(1, 90, (6, 5), generator=torch.Generator().manual_seed(0))
    free = actor.generate(prompts, 12, temperature=1.0, eos_id=99, pad_id=0, seed=5)
    monkeypatch.setenv(FORCE_EOS_ENV, "0.4")
    want = forced_lengths(6, 12, 5)
    for graph in (False, True):
        out = actor.generate(prompts, 12, temperature=1.0, eos_id=99, pad_id=0, seed=5, cuda_graph=graph)
        lengths = out["response_mask"].sum(-1)
        # A row ends at its drawn length, or earlier where the model sampled the stop token itself.
        assert bool((lengths <= want).all()) and bool((lengths < 12).any())
        ends = out["responses"][torch.arange(6), lengths - 1]
        assert bool((ends == 99).all())
        same = lengths == want
        assert bool(same.any())
        # Up to the forced token the rows sample what they sample without forcing.
        for i in torch.nonzero(same).squeeze(1).tolist():
            k = int(lengths[i]) - 1
            assert torch.equal(out["responses"][i, :k], free["responses"][i, :k])
