"""What `rlconf plan` prints explains itself: sizes that differ from the config say why."""

from __future__ import annotations

import re

from rlconf.cli import main as rlconf


def test_padded_vocab_is_explained_where_it_is_shown(capsys):
    """The model's vocab (32) and the layouts' (256 at tp 2) differ: both places say it is padding."""
    code = rlconf(["plan", "--preset", "tiny-grpo", "--set", "cluster.gpus_per_node=2",
                   "--set", "actor.megatron.tensor_model_parallel_size=2",
                   "--set", "rollout.tensor_model_parallel_size=2"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    assert re.search(r"policy: .* vocab 32 \(padded to 256 in layouts\)", text), text
    assert "vocab 256 = 32 padded to a multiple of 128 x tp 2" in text, text


def test_unpadded_vocab_has_no_padding_note(capsys):
    code = rlconf(["plan", "--preset", "tiny-grpo", "--set", "model.arch.vocab_size=128"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "vocab 128," in text and "padded" not in text, text
