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


def test_plan_says_which_kernels_the_engines_run(capsys):
    """model.fused_kernels is decided in the plan and shown with its reason: auto means compiled on cuda and
    eager elsewhere; an explicit choice wins."""
    cases = [
        (["--preset", "tiny-grpo"], "kernels: eager (one torch op at a time; model.fused_kernels auto: cpu)"),
        (["--preset", "qwen2.5-1.5b-grpo"], "kernels: fused (SwiGLU, RoPE, log-prob / entropy, weight gradients "
                                             "summed in their products; model.fused_kernels auto: cuda)"),
        (["--preset", "qwen2.5-1.5b-grpo", "--set", "model.fused_kernels=eager"],
         "kernels: eager (one torch op at a time; model.fused_kernels eager)"),
        (["--preset", "tiny-grpo", "--set", "model.fused_kernels=compiled"],
         "kernels: fused (SwiGLU, RoPE, log-prob / entropy, weight gradients summed in their products; "
         "model.fused_kernels compiled)"),
    ]  # fmt: skip
    for args, line in cases:
        code = rlconf(["plan", *args])
        text = capsys.readouterr().out
        assert code == 0, text
        assert line in text, (args, text)
