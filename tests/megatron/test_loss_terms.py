"""The actor's loss terms on the real engine (gloo world of 1): each term is weighted across micro-batches by
its own aggregation, and rejection sampling's accepted mask is the update's loss mask."""

from __future__ import annotations

import pytest
import torch

from rlconf.config import Optim, PolicyLossConfig

from ..tolerance import rel_tolerance
from ._common import (
    TINY_REDUCTION,
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    batch_from_lengths,
    tiny_model_cfg,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

# Response lengths that make micro-batches of 2 rows hold 10, 2, 6 and 5 tokens: a token-mean term and a
# row-mean term then weigh each micro-batch differently.
_LENGTHS = [(6, 5), (6, 5), (5, 1), (6, 1), (4, 5), (6, 1), (5, 3), (6, 2)]


def _batch(actor) -> dict[str, torch.Tensor]:
    batch = batch_from_lengths(_LENGTHS, 6, 5)
    old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    mask = batch["response_mask"].float()
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
    batch["old_log_probs"] = old
    batch["advantages"] = sign * mask
    batch["ref_log_probs"] = (old - 0.3 * torch.linspace(-1, 1, 5)) * mask
    return batch


@pytest.mark.parametrize("loss_mode", ["gspo", "sapo"])
def test_policy_term_of_its_own_aggregation_and_token_mean_kl_entropy_do_not_depend_on_micro_batches(
    mp_world, tiny_hf, loss_mode
):
    """GSPO / SAPO aggregate their policy term seq-mean-token-mean while the KL loss and the entropy bonus
    follow actor.loss_agg_mode (token-mean): one micro-batch of 8 rows or four of 2 (holding different token
    counts) give the same update, because each term is weighted by its own share of the mini-batch."""

    results = []
    for micro in (8, 2):
        cfg = actor_cfg(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=micro, shuffle=False,
                        policy_loss=PolicyLossConfig(loss_mode=loss_mode), loss_agg_mode="token-mean",
                        use_kl_loss=True, kl_loss_coef=2.0, entropy_coeff=0.5, optim=Optim(lr=1e-3, clip_grad=1e9))  # fmt: skip
        actor = actor_of(tiny_model_cfg(str(tiny_hf)), cfg, "cpu", total_steps=10)
        batch = _batch(actor)
        m = actor.update_policy(batch)
        results.append((m["actor/grad_norm"], actor.compute_log_prob(batch, with_entropy=False)["log_probs"]))
    assert results[0][0] == pytest.approx(
        results[1][0], rel=rel_tolerance(torch.float32, TINY_REDUCTION, UPDATE_DEPTH)
    )
    assert_tiny_close(results[0][1], results[1][1], depth=UPDATE_DEPTH)
