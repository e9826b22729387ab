"""verl's GSM8K quickstart in small: the files a verl user brings, made on a CPU in about a minute.

    .venv/bin/python bench/verl_gsm8k_small.py OUT

writes, under OUT:

- `models/tiny-qwen2/`: a Hugging Face folder shaped like Qwen2 (config.json, model.safetensors), with a
  byte-level BPE tokenizer trained with `tokenizers` on the task's own text, Qwen's special tokens and a
  ChatML chat template (tokenizer.json, tokenizer_config.json). Its weights are warmed up by a short
  supervised pass on worked answers, so that the policy writes `#### N` answers, some of them right (a
  random model never writes one, and GSM8K's strict scorer gives it nothing). The warm-up teaches the
  format and the answers' spread, not the sums (measured: ~19% of sampled answers right, about what
  answering by the spread alone gives); a 2-layer model learns the sums slowly.
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
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
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    folder = out / "models" / "tiny-qwen2"
    folder.mkdir(parents=True, exist_ok=True)
    train = rows("sft", 512, 2)
    prompts = [r["prompt"] for r in train]
    answers = [f"#### {r['reward_model']['ground_truth']}" for r in train]
    chat = [CHAT_TEMPLATE.replace("\\n", "\n")]  # the template's literal text teaches its pieces too
    tok = train_tokenizer(folder, [p[0]["content"] for p in prompts] + answers + chat)
    # The warm-up encodes as the run will: AutoTokenizer of the saved folder (transformers 5 builds its
    # Qwen2Tokenizer for a qwen2 folder, whose pre-tokenizer splits digits: ' 12' is 'Ġ', '1', '2').
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(seed)
    config = Qwen2Config(**{k: v for k, v in CONFIG.items() if k != "architectures"}, vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    if warmup_steps:
        # Worked answers, the loss on the answer only. Few steps on purpose: the format is learnt, the sums
        # only partly, so rewards vary within a group and RL has something to improve.
        seqs, masks = [], []
        for p, a in zip(prompts, answers, strict=True):
            head = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
            head = list(head if isinstance(head, list) else head["input_ids"])
            tail = [*tok.encode(a, add_special_tokens=False), tok.eos_token_id]
            seqs.append(head + tail)
            masks.append([0] * len(head) + [1] * len(tail))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(warmup_steps):
            batch = torch.randint(0, len(seqs), (64,), generator=gen)
            logits = model(input_ids=ids[batch], attention_mask=attention[batch]).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[batch][:, 1:].reshape(-1), reduction="none"
            )
            mask = loss_mask[batch][:, 1:].reshape(-1)
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
    parser.add_argument("--warmup-steps", type=int, default=60, help="supervised warm-up steps (0: random)")
    parser.add_argument("--train-rows", type=int, default=256)
    parser.add_argument("--test-rows", type=int, default=32)
    args = parser.parse_args(argv)
    write_data(args.out, args.train_rows, args.test_rows)
    folder = write_model(args.out, args.warmup_steps)
    print(f"wrote {folder} and {args.out / 'data' / 'gsm8k'}/{{train,test}}.parquet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
