"""Tokenizers, prompt loading (parquet / jsonl / synthetic), truncation, the resumable loader, and a guard
that the default synthetic task + reward is learnable by a tiny random-init model with GRPO."""

from __future__ import annotations

import json
import statistics

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from rlconf.config import DataConfig, ModelArch, ModelConfig
from rlconf.errors import ConfigError
from rlconf.plan.run import data_plan, tokenizer_plan
from rltrain.algorithms import compute_grpo_outcome_advantage, compute_policy_loss, outcome_to_token_level
from rltrain.data import (
    SYNTHETIC_VAL_SIZE,
    DataError,
    ListPromptSource,
    PromptDataloader,
    build_dataloaders,
    fit_prompt,
    left_pad,
    load_prompt_files,
    synthetic_sample,
)
from rltrain.rewards import digit_match, score_batch
from rltrain.tokenizer import CHAR_VOCAB, CharTokenizer, HFTokenizer, load_tokenizer

TOK = CharTokenizer()


# ----------------------------------------------------------------------------------------- tokenizer
def test_char_tokenizer_vocabulary_fits_default_arch():
    assert TOK.vocab_size == len(CHAR_VOCAB) == ModelArch().vocab_size == 32
    assert len(set(CHAR_VOCAB)) == 32
    assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id) == (0, 1, 2)


def test_char_tokenizer_roundtrip_and_specials():
    text = "12+7=19 #### 3,4.5 <answer>6</answer>\n"
    assert TOK.decode(TOK.encode(text)) == text
    assert TOK.encode("3 4") == [CHAR_VOCAB.index("3"), CHAR_VOCAB.index(" "), CHAR_VOCAB.index("4")]
    # Unknown characters become <unk> and decode as U+FFFD; out-of-range ids too.
    assert TOK.decode(TOK.encode("3?")) == "3\ufffd"
    assert TOK.decode([99]) == "\ufffd"
    # pad/bos/eos are dropped by default, shown on request.
    ids = [TOK.bos_token_id, *TOK.encode("7"), TOK.eos_token_id, TOK.pad_token_id]
    assert TOK.decode(ids) == "7"
    assert TOK.decode(ids, skip_special_tokens=False) == "<bos>7<eos><pad>"


def test_char_tokenizer_chat_template_is_a_noop():
    messages = [{"role": "system", "content": "1"}, {"role": "user", "content": "2 3"}]
    assert TOK.apply_chat_template("4 5") == "4 5"
    assert TOK.apply_chat_template(messages) == "1\n2 3"
    assert TOK.apply_chat_template("4", tokenize=True) == TOK.encode("4")
    assert TOK.encode_prompt("4 5") == [TOK.bos_token_id, *TOK.encode("4 5")]
    assert TOK.encode_prompt(messages) == [TOK.bos_token_id, *TOK.encode("1\n2 3")]


def test_load_tokenizer_builtin_and_errors(tmp_path):
    assert isinstance(load_tokenizer(tokenizer_plan(ModelConfig())), CharTokenizer)
    with pytest.raises(ConfigError) as info:
        load_tokenizer(tokenizer_plan(ModelConfig(arch=ModelArch(vocab_size=16))))
    assert info.value.path == "model.arch.vocab_size"
    with pytest.raises(ConfigError) as info:
        load_tokenizer(tokenizer_plan(ModelConfig(path=str(tmp_path / "missing"))))
    assert info.value.path == "model.path"
    with pytest.raises(ConfigError) as info:
        load_tokenizer(tokenizer_plan(ModelConfig(path="/elsewhere", tokenizer_path=str(tmp_path))))
    assert info.value.path == "model.tokenizer_path"


def test_load_tokenizer_hf_folder(tmp_path):
    # A local word-level HF tokenizer with a chat template: no download involved.
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5, "user": 6, ":": 7}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}</s>{% endif %}"
    )
    hf.save_pretrained(tmp_path)
    tok = load_tokenizer(tokenizer_plan(ModelConfig(tokenizer_path=str(tmp_path))))
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.vocab_size) == (0, 2, 1, 8)
    assert tok.encode("hello world") == [4, 5]
    assert tok.decode([4, 5, 2]) == "hello world"
    # The chat template goes through the HF tokenizer; a plain string is one user message.
    assert tok.encode_prompt("hello world") == [6, 7, 4, 5, 2]
    assert tok.encode_prompt([{"role": "user", "content": "hello"}]) == [6, 7, 4, 2]
    assert tok.encode_prompt("hello", apply_chat_template=False) == [4]
    assert tok.apply_chat_template("hello") == "user : hello </s>"


# ------------------------------------------------------------------------------------ synthetic tasks
def _digits(text: str) -> list[int]:
    return [int(c) for c in text.split()]


def test_synthetic_count_task():
    for i in range(50):
        prompt, answer = synthetic_sample("count", seed=3, index=i)
        p, a = _digits(prompt), _digits(answer)
        assert len(p) == len(a) == 3
        assert 1 <= p[0] <= 4
        assert p + a == list(range(p[0], p[0] + 6))  # one run of consecutive digits
    assert ("3 4 5", "6 7 8") in {synthetic_sample("count", 1, i) for i in range(50)}


def test_synthetic_copy_and_add_tasks():
    for i in range(50):
        prompt, answer = synthetic_sample("copy", seed=1, index=i)
        assert prompt == answer and len(_digits(prompt)) == 3
        prompt, answer = synthetic_sample("add", seed=1, index=i)
        a, b = prompt.rstrip("=").split("+")
        assert int(answer) == int(a) + int(b) and 0 <= int(b) <= 9
    with pytest.raises(DataError) as info:
        synthetic_sample("sort", 1, 0)
    assert info.value.path == "data.synthetic_task"


def test_synthetic_stream_is_deterministic_and_seeded():
    first = [synthetic_sample("copy", 1, i) for i in range(20)]
    assert first == [synthetic_sample("copy", 1, i) for i in range(20)]
    assert first != [synthetic_sample("copy", 2, i) for i in range(20)]
    assert first != [synthetic_sample("copy", 1, i, split="val") for i in range(20)]


def test_synthetic_loaders_and_validation_split():
    cfg = data_plan(DataConfig(synthetic_task="add", train_batch_size=5, val_batch_size=16))
    train, val = build_dataloaders(cfg, TOK)
    batch = next(train)
    assert len(batch) == 5 and batch.indices == [0, 1, 2, 3, 4]
    assert batch.input_ids[0] == TOK.encode_prompt(batch.prompts[0])
    assert batch.ground_truths[0] == synthetic_sample("add", 1, 0)[1]
    assert next(train).indices == [5, 6, 7, 8, 9]
    assert val is not None and len(val) == SYNTHETIC_VAL_SIZE // 16
    passes = [[b.indices for b in val], [b.indices for b in val]]
    assert passes[0] == passes[1]  # validation is stateless: every pass is the same
    assert sum(len(i) for i in passes[0]) == SYNTHETIC_VAL_SIZE
    val_prompts = [p for b in val for p in b.prompts]
    assert val_prompts != [synthetic_sample("add", 1, i)[0] for i in range(SYNTHETIC_VAL_SIZE)]


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


# --------------------------------------------------------------------------------------------- files
def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_jsonl_with_strings_and_chat_messages(tmp_path):
    path = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"question": "1+2=", "label": 3},
            {
                "question": [{"role": "system", "content": "0"}, {"role": "user", "content": "4+4="}],
                "label": "8",
            },
        ],
    )
    cfg = data_plan(DataConfig(train_files=(path,), prompt_key="question", answer_key="label"))
    examples = load_prompt_files(cfg.train_files, cfg, TOK)
    assert [e.prompt for e in examples] == ["1+2=", "0\n4+4="]
    assert [e.ground_truth for e in examples] == ["3", "8"]  # numbers become strings
    assert examples[1].input_ids == TOK.encode_prompt("0\n4+4=")


def test_load_parquet_with_nested_answer(tmp_path):
    # verl's layout: chat-message prompts and the ground truth inside a `reward_model` struct column.
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": "2+2="}], [{"role": "user", "content": "3+3="}]],
            "reward_model": [{"ground_truth": "4", "style": "rule"}, {"ground_truth": "6", "style": "rule"}],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    cfg = data_plan(
        DataConfig(train_files=(str(path),), answer_key="reward_model.ground_truth", train_batch_size=2)
    )
    train, val = build_dataloaders(cfg, TOK)
    assert val is None  # training files without data.val_files: no validation
    batch = next(train)
    assert sorted(zip(batch.prompts, batch.ground_truths, strict=True)) == [("2+2=", "4"), ("3+3=", "6")]


def test_missing_parquet_column_names_key_and_file(tmp_path):
    path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"question": ["1"], "answer": ["1"]}), path)
    cfg = data_plan(DataConfig(train_files=(str(path),)))
    with pytest.raises(DataError) as info:
        load_prompt_files(cfg.train_files, cfg, TOK)
    err = info.value
    assert err.path == "data.prompt_key"
    assert str(path) in err.message and "question" in err.message  # the file and its columns
    assert "data.prompt_key" in str(err)


def test_missing_jsonl_keys_name_key_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1", "answer": "1"}, {"prompt": "2"}])
    cfg = data_plan(DataConfig(train_files=(path,)))
    with pytest.raises(DataError) as info:
        load_prompt_files(cfg.train_files, cfg, TOK)
    assert info.value.path == "data.answer_key"
    assert f"{path}:2" in info.value.message
    path = _write_jsonl(tmp_path / "r.jsonl", [{"text": "1", "answer": "1"}])
    with pytest.raises(DataError) as info:
        load_prompt_files((path,), data_plan(DataConfig()), TOK)
    assert info.value.path == "data.prompt_key" and "r.jsonl" in info.value.message


@pytest.mark.parametrize(
    ("name", "content", "path_key"),
    [
        ("missing.jsonl", None, "data.train_files"),
        ("p.csv", "prompt,answer\n1,1\n", "data.train_files"),
        ("bad.jsonl", '{"prompt": "1", "answer": "1"}\n{not json\n', "data.train_files"),
        ("list.jsonl", "[1, 2]\n", "data.train_files"),
        ("empty.jsonl", "\n", "data.train_files"),
        ("null.jsonl", '{"prompt": "1", "answer": null}\n', "data.answer_key"),
        ("type.jsonl", '{"prompt": 5, "answer": "1"}\n', "data.prompt_key"),
    ],
)
def test_file_errors(tmp_path, name, content, path_key):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError) as info:
        load_prompt_files((str(path),), data_plan(DataConfig()), TOK)
    assert info.value.path == path_key
    assert name in info.value.message


def test_validation_files(tmp_path):
    train = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": str(i), "answer": str(i)} for i in range(4)])
    val = _write_jsonl(tmp_path / "v.jsonl", [{"prompt": "9", "answer": "9"}])
    cfg = data_plan(DataConfig(train_files=(train,), val_files=(val,), train_batch_size=2, val_batch_size=4))
    _, val_loader = build_dataloaders(cfg, TOK)
    assert [b.prompts for b in val_loader] == [["9"]]
    with pytest.raises(DataError) as info:
        build_dataloaders(
            data_plan(DataConfig(train_files=(train,), val_files=(str(tmp_path / "nope.jsonl"),))), TOK
        )
    assert info.value.path == "data.val_files"


# ---------------------------------------------------------------------------------------- truncation
def test_fit_prompt_modes():
    ids = [1, 2, 3, 4, 5]
    assert fit_prompt(ids, 5, "error", "x") == ids
    assert fit_prompt(ids, 3, "filter", "x") is None
    assert fit_prompt(ids, 3, "left", "x") == [3, 4, 5]
    assert fit_prompt(ids, 3, "right", "x") == [1, 2, 3]
    with pytest.raises(DataError) as info:
        fit_prompt(ids, 3, "error", "f.jsonl:7")
    assert info.value.path == "data.max_prompt_length" and "f.jsonl:7" in info.value.message


def test_truncation_modes_on_files(tmp_path):
    # Prompts of 3 and 9 tokens (bos + characters) against max_prompt_length 5.
    path = _write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "12", "answer": "a"}, {"prompt": "12345678", "answer": "b"}]
    )
    base = {"train_files": (path,), "max_prompt_length": 5}

    kept = load_prompt_files((path,), data_plan(DataConfig(**base, truncation="filter")), TOK)
    assert [e.ground_truth for e in kept] == ["a"]
    left = load_prompt_files((path,), data_plan(DataConfig(**base, truncation="left")), TOK)
    assert left[1].input_ids == TOK.encode("45678")
    right = load_prompt_files((path,), data_plan(DataConfig(**base, truncation="right")), TOK)
    assert right[1].input_ids == [TOK.bos_token_id, *TOK.encode("1234")]
    with pytest.raises(DataError) as info:
        load_prompt_files((path,), data_plan(DataConfig(**base, truncation="error")), TOK)
    assert info.value.path == "data.max_prompt_length" and "p.jsonl:2" in info.value.message
    with pytest.raises(DataError) as info:  # everything filtered
        load_prompt_files((path,), data_plan(DataConfig(train_files=(path,), max_prompt_length=2)), TOK)
    assert info.value.path == "data.max_prompt_length"


def test_truncation_on_synthetic_stream():
    # add prompts ("7+3=", "42+3=") are 5-6 tokens with bos: with max 5, filter skips the two-digit ones
    # and right-truncation cuts them.
    cfg = data_plan(
        DataConfig(synthetic_task="add", max_prompt_length=5, truncation="filter", train_batch_size=8)
    )
    batch = next(build_dataloaders(cfg, TOK)[0])
    assert len(batch) == 8 and all(len(ids) == 5 for ids in batch.input_ids)
    assert batch.indices[-1] > 8  # stream samples were skipped
    cfg = data_plan(DataConfig(synthetic_task="add", max_prompt_length=5, truncation="right"))
    assert all(len(ids) == 5 for ids in next(build_dataloaders(cfg, TOK)[0]).input_ids)
    with pytest.raises(DataError) as info:
        next(build_dataloaders(data_plan(DataConfig(max_prompt_length=2)), TOK)[0])
    assert info.value.path == "data.max_prompt_length"


# ------------------------------------------------------------------------------------------- loader
def _file_loader(tmp_path, n=10, batch_size=4, shuffle=True):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i % 10), "answer": str(i)} for i in range(n)])
    cfg = data_plan(DataConfig(train_files=(path,), train_batch_size=batch_size, shuffle=shuffle, seed=7))
    return build_dataloaders(cfg, TOK)[0]


def test_file_loader_epochs_shuffle_and_drop_last(tmp_path):
    loader = _file_loader(tmp_path)
    assert len(loader) == 2  # 10 prompts, batches of 4: the last 2 of each epoch are dropped
    epoch0 = [next(loader).indices for _ in range(2)]
    epoch1 = [next(loader).indices for _ in range(2)]
    assert all(len(b) == 4 for b in epoch0 + epoch1)
    assert len({i for b in epoch0 for i in b}) == 8  # no repeats within an epoch
    assert epoch0 != epoch1  # a new permutation each epoch
    ordered = _file_loader(tmp_path, shuffle=False)
    assert [next(ordered).indices for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    with pytest.raises(DataError) as info:
        _file_loader(tmp_path, n=3, batch_size=4)
    assert info.value.path == "data.train_batch_size"


@pytest.mark.parametrize("source", ["file", "synthetic"])
def test_resume_yields_the_same_next_batch(tmp_path, source):
    def make():
        if source == "file":
            return _file_loader(tmp_path)
        return build_dataloaders(
            data_plan(DataConfig(synthetic_task="count", train_batch_size=3, seed=5)), TOK
        )[0]

    uninterrupted = make()
    for _ in range(3):  # crosses an epoch boundary for the file source
        next(uninterrupted)
    state = json.loads(json.dumps(uninterrupted.state_dict()))  # checkpoints store it as JSON
    expected = [next(uninterrupted) for _ in range(3)]

    resumed = make()
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(3)] == expected


def test_load_state_warns_on_changed_setup(tmp_path, caplog):
    loader = _file_loader(tmp_path)
    state = loader.state_dict() | {"num_prompts": 99}
    other = _file_loader(tmp_path)
    other.load_state_dict(state)
    assert "num_prompts 99 -> 10" in caplog.text


def test_validation_loader_needs_finite_source():
    loader = PromptDataloader(ListPromptSource([]), 2, repeat=False)
    assert list(loader) == []
    with pytest.raises(TypeError):
        next(loader)


# ------------------------------------------------------------------------------------- learnability
class _TinyPolicy(nn.Module):
    """The shape of the built-in model (2 layers, hidden 64, 4 heads, FFN 176, vocab 32, tied embeddings,
    std-0.02 init as megatron does) on nn.TransformerEncoder; no position embedding (the causal mask gives
    order), padding keys masked."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 64)
        nn.init.normal_(self.emb.weight, std=0.02)
        layer = nn.TransformerEncoderLayer(64, 4, 176, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        for name, p in self.enc.named_parameters():
            if p.dim() == 2:  # megatron: std 0.02, output projections scaled by 1/sqrt(2 * layers)
                nn.init.normal_(p, std=0.01 if ("out_proj" in name or "linear2" in name) else 0.02)
            elif "norm" not in name:
                nn.init.zeros_(p)
        self.norm = nn.LayerNorm(64)

    def forward(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        allowed = torch.tril(torch.ones(n, n, dtype=torch.bool)) & valid.bool()[:, None, :]
        allowed |= torch.eye(n, dtype=torch.bool)  # a padding query attends to itself (no all -inf rows)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).repeat_interleave(4, 0)
        return self.norm(self.enc(self.emb(ids), mask=mask)) @ self.emb.weight.T


def _response_logp(policy: nn.Module, ids: torch.Tensor, valid: torch.Tensor, plen: int) -> torch.Tensor:
    """Log-probs of the response tokens ids[:, plen:] under the policy (teacher forcing)."""
    logits = policy(ids[:, :-1], valid[:, :-1])[:, plen - 1 :]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, plen:, None]).squeeze(-1)


def _grpo_rewards(steps: int, lr: float, seed: int, n: int = 4, response_len: int = 16) -> list[float]:
    """Mean digit_match reward per step of a minimal GRPO loop on the default synthetic task."""
    torch.manual_seed(seed)
    loader, _ = build_dataloaders(data_plan(DataConfig(seed=seed)), TOK)
    policy = _TinyPolicy()
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.01)
    curve = []
    for _ in range(steps):
        batch = next(loader)
        ids, valid = batch.left_padded(TOK.pad_token_id)
        n_prompts, plen = ids.shape
        ids, valid = ids.repeat_interleave(n, 0), valid.repeat_interleave(n, 0)
        with torch.no_grad():  # sample; tokens after eos are padding
            alive = torch.ones(len(ids), dtype=torch.bool)
            for _ in range(response_len):
                nxt = torch.multinomial(torch.softmax(policy(ids, valid)[:, -1], -1), 1).squeeze(-1)
                nxt = torch.where(alive, nxt, torch.full_like(nxt, TOK.pad_token_id))
                ids, valid = torch.cat([ids, nxt[:, None]], 1), torch.cat([valid, alive[:, None].long()], 1)
                alive &= nxt != TOK.eos_token_id
        resp, mask = ids[:, plen:], valid[:, plen:].float()
        texts = [TOK.decode(r[m.bool()].tolist()) for r, m in zip(resp, mask, strict=True)]
        truths = [g for g in batch.ground_truths for _ in range(n)]
        scores = torch.tensor(score_batch(digit_match, texts, truths, [""] * len(texts)))
        curve.append(float(scores.mean()))
        groups = torch.arange(n_prompts).repeat_interleave(n)
        adv, _ = compute_grpo_outcome_advantage(outcome_to_token_level(scores, mask), mask, groups, True)

        with torch.no_grad():
            old = _response_logp(policy, ids, valid, plen)
        for rows in torch.arange(len(ids)).chunk(2):  # two mini-batches of 4 prompts, as the tiny preset
            new = _response_logp(policy, ids[rows], valid[rows], plen)
            loss, _ = compute_policy_loss(old[rows], new, adv[rows], mask[rows], 0.2, 0.2, 3.0, "token-mean")
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
    return curve


@pytest.mark.timeout(60)
def test_tiny_grpo_raises_digit_match_reward_on_default_task():
    """Guards the learnability of the default synthetic task + reward + policy loss (a sign error or a task
    made too hard shows up here). lr 3e-3 rather than the preset's 1e-3 so that 20 steps separate clearly:
    over seeds 0-9 the last-5-step mean beat the first-5 mean by 0.044-0.12 (at lr 1e-3 the rise is about
    half as fast: 0.035 -> 0.065 at step ~17 -> 0.086 at step ~28)."""
    torch.set_num_threads(1)
    curve = _grpo_rewards(steps=20, lr=3e-3, seed=0)
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
    assert first > 0.0  # a random policy already earns a little reward: the signal is dense
    assert last > first + 0.03 and last > 1.5 * first, curve
