"""verl's GSM8K quickstart in small: the files a verl user brings, made on a CPU in about a minute.

    .venv/bin/python bench/verl_gsm8k_small.py OUT

writes, under OUT:

- `models/tiny-qwen2/`: a Hugging Face folder shaped like Qwen2 (config.json, model.safetensors), with a
  byte-level BPE tokenizer trained with `tokenizers` on the task's own text (Qwen2's pre-tokenizer: NFC,
  its split pattern with one digit per piece, byte-level), Qwen's special tokens and a ChatML chat template
  (tokenizer.json, tokenizer_config.json). Its weights stand in for an instruct model that knows the
  format and half knows the task: a supervised warm-up on worked answers of which half are right and half
  are guesses in the answers' range. The warm-up converges to that mix (measured: ~48% of sampled answers
  right after 400-600 steps, whatever the step count in that range), so the start is stable and RL has a
  clear job: stop guessing (the recorded walk-through goes from ~0.5 to ~0.85 in 40 GRPO steps at lr 1e-3; at 2e-3 it rose to ~0.9 on an Intel CPU but fell back after step 20 on an AMD one).
- `data/gsm8k/{train,test}.parquet`: arithmetic word problems in the layout verl's
  `examples/data_preprocess/gsm8k.py` writes: `data_source: openai/gsm8k`, `prompt` as chat messages (the
  question and verl's "Let's think step by step and output the final answer after \"####\"."),
  `ability`, `reward_model: {style: rule, ground_truth}` and `extra_info: {split, index, answer, question}`.

docs/migrating-from-verl.md walks through it (import-verl of a verl GSM8K command line, then
`rltrain --config`); tests/test_verl_quickstart.py runs the same steps.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ("Tom", "Ann", "Bo", "Eve", "Max", "Mia")
THINGS = ("apples", "pens", "cards", "books")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split: contractions, words, one digit per piece, punctuation runs, newlines, spaces.
# transformers 5 rebuilds a qwen2 folder's tokenizer with this split whatever tokenizer.json says, so the
# trained tokenizer uses it too: the `tokenizers`-only reader (rlconf validate) and the run then agree.
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GUESS_SHARE = 0.5
"""Share of the warm-up's worked answers that are guesses (uniform over the answers' range), not sums."""
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "float32", "use_sliding_window": False,
}  # fmt: skip


def problem(rng: random.Random) -> tuple[str, str]:
    """(question, answer): `a + b` in words, a and b in 1-4 (answers 2-8)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, 4), rng.randint(1, 4)
    return f"{name} has {a} {thing} and gets {b} more. How many {thing}?", str(a + b)


def rows(split: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        question, answer = problem(rng)
        out.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "answer": f"#### {answer}", "question": question},
        })  # fmt: skip
    return out


def write_data(out: Path, train: int, test: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = out / "data" / "gsm8k"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows("train", train, 0)), folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows("test", test, 1)), folder / "test.parquet")


def train_tokenizer(folder: Path, texts: list[str]) -> object:
    """A byte-level BPE (GPT-2 / Qwen style) trained on `texts`, saved with the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def write_model(out: Path, warmup_steps: int, seed: int = 0) -> Path:
    """The model folder; `warmup_steps` supervised steps on worked answers (0: random init)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the walk-through's output
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other (and one is repeatable)
    folder = out / "models" / "tiny-qwen2"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(2)
    train = rows("sft", 512, 2)
    prompts = [r["prompt"] for r in train]
    sums = [int(r["reward_model"]["ground_truth"]) for r in train]
    answers = [f"#### {n}" for n in range(min(sums), max(sums) + 1)]
    chat = [CHAT_TEMPLATE.replace("\\n", "\n")]  # the template's literal text teaches its pieces too
    train_tokenizer(folder, [p[0]["content"] for p in prompts] + answers + chat)
    # The warm-up encodes as the run will: AutoTokenizer of the folder *with its config.json*, since
    # transformers picks the tokenizer class by model_type (Qwen2Tokenizer for qwen2).
    (folder / "config.json").write_text(json.dumps({"model_type": CONFIG["model_type"]}))
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(seed)
    config = Qwen2Config(**{k: v for k, v in CONFIG.items() if k != "architectures"}, vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    if warmup_steps:
        # Worked answers, the loss on the answer only. A GUESS_SHARE of them are guesses drawn afresh each
        # time a row is used, so the model learns the format and the sums but hedges: it converges to
        # answering right about half the time, a stable start that RL's reward can only improve.
        heads = []
        for p in prompts:
            head = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
            heads.append(list(head if isinstance(head, list) else head["input_ids"]))
        low, high = min(sums), max(sums)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(warmup_steps):
            seqs, masks = [], []
            for i in torch.randint(0, len(heads), (64,), generator=gen).tolist():
                answer = rng.randint(low, high) if rng.random() < GUESS_SHARE else sums[i]
                tail = [*tok.encode(f"#### {answer}", add_special_tokens=False), tok.eos_token_id]
                seqs.append(heads[i] + tail)
                masks.append([0] * len(heads[i]) + [1] * len(tail))
            width = max(map(len, seqs))
            ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
            loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
            attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            )
            mask = loss_mask[:, 1:].reshape(-1)
            loss = (nll * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.save_pretrained(folder, safe_serialization=True)
    # Only the keys a Qwen2 config.json of the hub carries (no transformers-version extras).
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**saved, "architectures": CONFIG["architectures"]}, indent=2)
    )
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write models/ and data/ into")
    parser.add_argument("--warmup-steps", type=int, default=500, help="supervised warm-up steps (0: random)")
    parser.add_argument("--train-rows", type=int, default=256)
    parser.add_argument("--test-rows", type=int, default=32)
    args = parser.parse_args(argv)
    write_data(args.out, args.train_rows, args.test_rows)
    folder = write_model(args.out, args.warmup_steps)
    print(f"wrote {folder} and {args.out / 'data' / 'gsm8k'}/{{train,test}}.parquet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
