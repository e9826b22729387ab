"""A tiny-grpo training step vs TRL's GRPOTrainer on the same tiny model shape and batch, on this CPU machine.

Both sides in one run of this script (issue 10 item 4). The workload is the `tiny-grpo` preset's: the
2-layer, 64-wide Qwen2-shaped random model with the 32-character vocabulary, the synthetic `count` task,
8 prompts x 8 samples = 64 completions of up to 16 tokens at temperature 1, the `digit_match` reward, no KL,
lr 1e-3, and two optimizer steps of 32 completions per rollout.

- rlplan: `rltrain tiny-grpo` as users run it (Ray, one megatron worker, embedded KV-cache rollout),
  validation and checkpoints off; seconds per step = the median of `timing/step_s` in metrics.jsonl over
  steps 3.. (the first steps warm up).
- TRL: `GRPOTrainer` on the same shape (an HF Qwen2 with that config, random init, and a character-level
  HF tokenizer over the same vocabulary), `num_generations=8`, `per_device_train_batch_size=32`,
  `steps_per_generation=2` (one generation of 64 completions feeds two optimizer steps, as above),
  `max_completion_length=16`, `beta=0`, CPU. Seconds per rlplan-equivalent step = the median time of two
  consecutive TRL optimizer steps over steps 3.. (a callback timestamps every step end).

Threads: each side computes on one thread (rlplan's worker gets `cluster.cpus_per_worker: 1`; TRL runs with
`torch.set_num_threads(1)`), so the comparison is per core, not a race for the machine's two cores.

Needs a benchmark venv with trl (not a project dependency):
    python3 -m venv /tmp/benchvenv && /tmp/benchvenv/bin/pip install -q torch==2.13.0 -e . trl
    /tmp/benchvenv/bin/python bench/trl_cpu.py --steps 12 --out /tmp/trl_cpu
Prints both figures and the ratio, and writes trl_cpu.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_rlplan(steps: int, out: Path) -> dict[str, float]:
    """`rltrain tiny-grpo` for `steps` steps; median seconds per step after warm-up."""
    folder = out / "rlplan"
    cmd = [
        sys.executable, "-m", "rltrain.cli", "tiny-grpo",
        "--trainer.total_steps", str(steps), "--trainer.output_dir", str(folder),
        "--trainer.test_freq", "0", "--trainer.save_freq", "0", "--trainer.val_before_train", "false",
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["timing/step_s"] for r in rows][2:]
    return {
        "s_per_step": statistics.median(step_s),
        "wall_s_incl_startup": wall,
        "reward_first": rows[0]["reward/mean"],
        "steps_timed": len(step_s),
    }


def char_tokenizer(folder: Path):
    """An HF fast tokenizer over rlplan's built-in character vocabulary (same ids)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rltrain.tokenizer import BOS, CHAR_VOCAB, EOS, PAD, UNK

    vocab = {tok: i for i, tok in enumerate(CHAR_VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK
    )
    tok.save_pretrained(str(folder))
    return tok


def run_trl(steps: int, folder: Path) -> dict[str, float]:
    """TRL GRPOTrainer on the tiny-grpo workload; median seconds per rollout of 64 + two optimizer steps."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Qwen2Config, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from presets import get_preset
    from rltrain.data import synthetic_sample
    from rltrain.megatron.hf_weights import hf_config_from_arch
    from rltrain.rewards import digit_match

    torch.set_num_threads(1)
    cfg = get_preset("tiny-grpo")
    arch = cfg.model.arch
    tok = char_tokenizer(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**hf_config_from_arch(arch, torch.float32)))
    prompts = [
        synthetic_sample("count", cfg.trainer.seed, i) for i in range(steps * cfg.data.train_batch_size)
    ]
    data = Dataset.from_list([{"prompt": p, "answer": a} for p, a in prompts])

    def reward(completions, answer, **_):
        return [digit_match(c, a, "") for c, a in zip(completions, answer, strict=True)]

    n = cfg.rollout.n
    per_update = cfg.actor.ppo_mini_batch_size * n
    args = GRPOConfig(
        output_dir=str(folder / "out"),
        use_cpu=True,
        max_steps=steps * 2,
        learning_rate=cfg.actor.optim.lr,
        num_generations=n,
        per_device_train_batch_size=per_update,
        steps_per_generation=cfg.data.train_batch_size * n // per_update,
        max_completion_length=cfg.rollout.max_response_length,
        temperature=cfg.rollout.temperature,
        beta=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=cfg.trainer.seed,
    )
    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
        callbacks=[StepTimes()],
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    # One rlplan step = one generation + two optimizer steps = two consecutive TRL steps.
    pairs = [ends[i + 1] - ends[i - 1] for i in range(1, len(ends) - 1, 2)]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "s_per_step": statistics.median(pairs[2:]),
        "wall_s": wall,
        "reward_first": rewards[0] if rewards else float("nan"),
        "steps_timed": len(pairs[2:]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/trl_cpu"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers
    import trl

    report: dict[str, object] = {
        "steps": args.steps,
        "torch": torch.__version__,
        "trl_version": trl.__version__,
    }
    report["transformers"] = transformers.__version__
    report["rlplan"] = run_rlplan(args.steps, out)
    with tempfile.TemporaryDirectory() as tmp:
        report["trl"] = run_trl(args.steps, Path(tmp))
    ours, theirs = report["rlplan"]["s_per_step"], report["trl"]["s_per_step"]  # type: ignore[index]
    report["trl_over_rlplan"] = theirs / ours
    print(json.dumps(report, indent=2))
    print(
        f"tiny-grpo step: rlplan {ours:.3f} s, TRL GRPOTrainer {theirs:.3f} s -> rlplan is {theirs / ours:.2f}x"
    )
    (out / "trl_cpu.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
