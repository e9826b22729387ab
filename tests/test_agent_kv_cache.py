"""Multi-turn rollouts with the KV cache kept across turns (rltrain/megatron/inference.py `KVSession`,
driven through the rollout workers' `generate_turn` by rltrain/rollout/agent.py `WorkerRolloutClient`)
against the same rollouts re-prefilling every turn, on the real tiny model (megatron-core over gloo): the
same tokens, log-probs within the tiny model's tolerance, and the cache really used (later turns prefill
only the new tokens). A spawned pair of processes checks DP=2 (each row stays on its rank), TP=2 and PP=2
against the single process. And tools run asynchronously: a slow tool in one row does not hold up the
other rows' next turns."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch

from rlconf.config import MultiTurnConfig
from rlconf.plan.run import tool_plan
from rltrain.rollout.agent import AgentLoop, WorkerRolloutClient
from rltrain.rollout.generation import RolloutServer
from rltrain.tokenizer import CharTokenizer
from tests.megatron._common import spawn

from .megatron._common import (
    CountForwards,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    free_port,
    init_groups,
    run_spawned,
    tiny_model_cfg,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


class _Worker(RolloutServer):
    """What a rollout worker holds for `RolloutServer` (the embedded engine on the actor's weights)."""

    def __init__(self, actor, temperature: float) -> None:
        from presets.tiny import tiny_tool
        from rlconf.plan import compile_plan

        cfg = tiny_tool()
        plan = compile_plan(replace(cfg, rollout=replace(cfg.rollout, temperature=temperature)))
        self.plan = replace(plan, refit=None)
        self.actor, self.vllm = actor, None
        self.measured = lambda name: contextlib.nullcontext()


class _NoCacheClient(WorkerRolloutClient):
    """The same workers, told not to keep a cache: every turn prefills the whole context."""

    def open(self, n_rows: int) -> None:
        super().open(n_rows)
        self.session = None
        self.keeps_kv_cache = False


def _client(worker: _Worker, cache: bool) -> WorkerRolloutClient:
    cls = WorkerRolloutClient if cache else _NoCacheClient
    return cls(lambda batch, *extra: worker.generate_turn(batch, *extra),
               lambda method, *args: [getattr(worker, method)(*args)], dp=1, pad_id=CharTokenizer().pad_token_id)  # fmt: skip


def _loop(turns: int = 4, total: int = 40) -> AgentLoop:
    mt = MultiTurnConfig(enable=True, tools=("calculator",), max_assistant_turns=turns, tool_timeout_s=5.0)
    return AgentLoop(CharTokenizer(), tool_plan(mt, total))


def _prompts(n: int) -> list[str]:
    return [f"{10 + i // 2}*{2 + i % 7}=" for i in range(n)]  # pairs of equal prompts (rollout.n = 2)


def rollout(client, n_rows: int = 24, seed: int = 5):
    loop = _loop()
    try:
        return loop.run(client, loop.prompt_ids(_prompts(n_rows)), seed)
    finally:
        loop.close()


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny random Qwen2 on disk: the same weights in every process and layout."""
    from .megatron._common import make_tiny_qwen2

    return str(make_tiny_qwen2(tmp_path_factory.mktemp("hf") / "qwen2_tiny"))


@pytest.fixture(scope="module")
def actor(tiny_hf):

    return actor_of(tiny_model_cfg(tiny_hf), actor_cfg(), "cpu", trainable=False)


def test_kept_cache_gives_the_re_prefill_rollout(actor, monkeypatch):
    """Sampling at temperature 1 (each row draws from its own seeded stream, so both runs draw the same
    numbers): the same tokens and masks, log-probs within tolerance, while the kept cache prefills fewer
    tokens and later turns start their prefill past the cached columns."""
    worker = _Worker(actor, temperature=1.0)
    counted = CountForwards(monkeypatch)
    kept = rollout(_client(worker, cache=True))
    kept_calls, counted.calls = counted.calls, []
    fresh = rollout(_client(worker, cache=False))
    assert kept.metrics["multi_turn/turns_mean"] > 1.2  # several rows took more than one turn
    assert kept.metrics["multi_turn/generate_calls"] >= 2
    for key in ("input_ids", "attention_mask", "responses", "response_mask", "multi_turn_turns",
                "multi_turn_tool_calls"):  # fmt: skip
        assert torch.equal(kept.batch[key], fresh.batch[key]), key
    assert_tiny_close(kept.batch["rollout_log_probs"], fresh.batch["rollout_log_probs"])
    # The cache was used: a later call prefilled from a column past 0, and fewer tokens went through
    # prefills than when every turn re-runs its whole context.
    assert any(start > 0 and cols > 1 for _, cols, start in kept_calls)
    assert all(start == 0 for _, cols, start in counted.calls if cols > 1)
    assert sum(r * c for r, c, _ in kept_calls if c > 1) < counted.prefill_tokens()
    assert kept.metrics["multi_turn/kv_reused_tokens"] > 0
    # The session ended with the rollout: nothing stays on the worker.
    assert worker.__dict__["_kv_sessions"] == {}


def test_a_session_reuses_only_the_matching_prefix(actor):
    """A row whose context the caller changed (cut, or another row under the same id) is still generated
    as from scratch: only the prefix the session holds and the context share is reused."""
    from rltrain.data import left_pad
    from rltrain.megatron.inference import KVSession, generate_with_kv_cache

    tok = CharTokenizer()
    contexts = [tok.encode("12*34=<"), tok.encode("5+6=")]
    kw = dict(temperature=1.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, row_seeds=[11, 12])
    session = KVSession()
    ids, mask = left_pad(contexts, tok.pad_token_id)
    first = generate_with_kv_cache(actor, ids, mask, 6, session=session, row_ids=[0, 1], **kw)
    # Row 0 goes on after its sampled tokens plus an observation; row 1 is replaced by another context.
    row0 = (
        contexts[0] + first["responses"][0][first["response_mask"][0].bool()].tolist()[:3] + tok.encode("=7")
    )
    later = [row0, tok.encode("9*9=#")]
    ids, mask = left_pad(later, tok.pad_token_id)
    cached = generate_with_kv_cache(actor, ids, mask, 6, session=session, row_ids=[0, 1], **kw)
    plain = generate_with_kv_cache(actor, ids, mask, 6, **kw)
    assert session.reused_tokens > 0
    assert torch.equal(cached["responses"], plain["responses"])
    assert_tiny_close(cached["rollout_log_probs"], plain["rollout_log_probs"])


@pytest.mark.parametrize("attention", ["sdpa", "kernel"])
def test_static_decode_with_a_session_keeps_the_rows_a_compaction_kept_finished(
    actor, monkeypatch, attention
):
    """The static (CUDA-graph) decode step with a session: compactions keep a size of the ladder of rows
    (here powers of two: with six rows the 1.5x ladder's sizes up to 4 are exact), i.e. some rows that
    already stopped stay in the cache (harvested at the end, not when they stopped). Both calls of a
    two-call conversation give what the same calls give without a session, and the second reuses the
    cached columns, also of a row that stayed in the cache after it stopped. With SDPA over key buckets and
    with the CUDA step's attention over each row's own columns (its torch reference here: the kernel
    needs CUDA)."""
    from rltrain.data import left_pad
    from rltrain.megatron import decode_kernels, inference
    from rltrain.megatron.inference import KVSession, generate_with_kv_cache

    if attention == "kernel":
        monkeypatch.setattr(
            inference.KVCacheGenerator,
            "_pick_decode_attention",
            lambda self, layers: (decode_kernels.decode_attention_reference, None),
        )

    monkeypatch.setattr(
        inference, "compacted_rows", lambda live, rows: min(1 << max(live - 1, 0).bit_length(), rows)
    )
    kept = []
    real = inference._ladder_rows
    monkeypatch.setattr(
        inference,
        "_ladder_rows",
        lambda still: kept.append((int(still.sum()), int(real(still).sum()))) or real(still),
    )
    tok = CharTokenizer()
    contexts = [tok.encode(t) for t in ("12*34=<", "5+6=", "7-1=", "99*9=", "3+3=", "8/2=")]
    seeds = list(range(20, 26))
    ids, mask = left_pad(contexts, tok.pad_token_id)
    free = generate_with_kv_cache(
        actor, ids, mask, 6, temperature=1.0, pad_id=tok.pad_token_id, row_seeds=seeds
    )
    # Stop on the first token rows 0-2 sample: at least three of six rows stop at once (a compaction).
    stops = sorted({int(free["responses"][i, 0]) for i in range(3)})
    kw = dict(
        temperature=1.0, pad_id=tok.pad_token_id, row_seeds=seeds, stop_token_ids=stops, static_decode=True
    )
    session = KVSession()
    first = generate_with_kv_cache(actor, ids, mask, 6, session=session, row_ids=list(range(6)), **kw)
    assert any(n_kept > n for n, n_kept in kept), kept  # a compaction kept a finished row
    plain_first = generate_with_kv_cache(actor, ids, mask, 6, **kw)
    assert torch.equal(first["responses"], plain_first["responses"])
    assert_tiny_close(first["rollout_log_probs"], plain_first["rollout_log_probs"])
    # Every row goes on after its response and an observation.
    later = [
        c + first["responses"][i][first["response_mask"][i].bool()].tolist() + tok.encode("=1")
        for i, c in enumerate(contexts)
    ]
    ids, mask = left_pad(later, tok.pad_token_id)
    cached = generate_with_kv_cache(actor, ids, mask, 6, session=session, row_ids=list(range(6)), **kw)
    plain = generate_with_kv_cache(actor, ids, mask, 6, **kw)
    assert session.reused_tokens >= sum(len(c) for c in contexts)  # every row's first context came back
    assert torch.equal(cached["responses"], plain["responses"])
    assert_tiny_close(cached["rollout_log_probs"], plain["rollout_log_probs"])


# ------------------------------------------------------------------------------------ asynchronous tools
_SCRIPT_TOOL = """
import os, time, uuid
DIR = {folder!r}

def _wait(cond, what):
    t = time.time() + 20
    while not cond():
        if time.time() > t:
            raise RuntimeError(what)
        time.sleep(0.005)

def calculator(expression):
    if expression == "9":
        _wait(lambda: os.path.exists(os.path.join(DIR, "release")),
              "the other rows' turns never came while this tool ran")
        with open(os.path.join(DIR, "calls_made")) as f, open(os.path.join(DIR, "slow_done_at"), "w") as g:
            g.write(f.read())
    elif expression == "8":
        open(os.path.join(DIR, "eight-" + uuid.uuid4().hex), "w").close()
        _wait(lambda: sum(n.startswith("eight-") for n in os.listdir(DIR)) >= 2, "the two 8 calls never met")
    return "1"

calculator.schema = {{"type": "function", "function": {{"name": "calculator", "parameters": {{
    "type": "object", "properties": {{"expression": {{"type": "string"}}}}, "required": ["expression"]}}}}}}
"""
"""A calculator-shaped user tool whose calls wait on files in `folder` (tools run in worker processes, so
the test and the tool meet through the filesystem): `9` blocks until `release` exists, `8` meets another `8`
(it can only pass when two calls run at once); any other answers at once."""


def test_a_slow_tool_does_not_hold_up_the_other_rows(tmp_path, monkeypatch):
    """Row 0's tool blocks until the other rows have taken all their turns (the scripted model releases it
    when it sees their last turn): the loop must have run those turns while the tool was still
    running, or the tool times out and its row is marked. Rows 1 and 2 call `8` together at their first
    turn: their calls meet, so they ran at the same time (in two tool workers)."""
    folder = tmp_path / "sync"
    folder.mkdir()
    (tmp_path / "script_tools.py").write_text(_SCRIPT_TOOL.format(folder=str(folder)))
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = CharTokenizer()
    mt = MultiTurnConfig(enable=True, tools=("script_tools:calculator",), max_assistant_turns=4,
                         tool_timeout_s=30.0)  # fmt: skip
    loop = AgentLoop(tok, tool_plan(mt, 40))
    calls: list[dict[int, int]] = []  # per generation call: row -> its turn
    turns_of: dict[int, int] = {}
    scripts = {
        0: ["<9>", "5"],
        1: ["<8>", "<1>", "<1>", "3"],
        2: ["<8>", "<1>", "<1>", "3"],
        3: ["<1>", "<1>", "4"],
    }

    def generate(request):
        (folder / "calls_made").write_text(str(len(calls) + 1))
        calls.append({})
        out = []
        for row in request.row_ids:
            turn = turns_of.get(row, 0)
            turns_of[row] = turn + 1
            calls[-1][row] = turn
            text = scripts[row][turn]
            ids = tok.encode(text) + ([] if text.endswith(">") else [tok.eos_token_id])
            out.append((ids, [-0.5] * len(ids)))
        if all(turns_of.get(r, 0) == len(scripts[r]) for r in (1, 2, 3)):
            (folder / "release").touch()
        return out

    class Client:
        keeps_kv_cache = False

        def open(self, n_rows):
            pass

        def generate(self, request):
            return generate(request)

        def close(self):
            return {}

    try:
        result = loop.run(Client(), loop.prompt_ids(["1+1="] * 4), seed=0)
    finally:
        loop.close()
    b = result.batch
    assert b["multi_turn_tool_errors"].tolist() == [0.0] * 4  # nothing timed out, the barrier was met
    assert b["multi_turn_turns"].tolist() == [2.0, 4.0, 4.0, 3.0]
    # Rows 1-3 finished every turn in calls that ran while row 0's tool was running; row 0's second turn
    # came in a later call.
    last_other = max(i for i, c in enumerate(calls) if any(r != 0 for r in c))
    (row0_second,) = [i for i, c in enumerate(calls) if c.get(0) == 1]
    slow_done_at = int((folder / "slow_done_at").read_text())
    assert slow_done_at >= last_other + 1
    assert row0_second > last_other


# ------------------------------------------------------------------------------------ DP / TP / PP
LAYOUTS = [("dp2", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)]  # (name, tp, pp) over 2 processes


def _layout_worker(rank: int, port: int, hf_path: str, ref: dict) -> None:
    run_spawned(_check_layouts, rank, port, hf_path, ref)


def _check_layouts(rank: int, port: int, hf_path: str, ref: dict) -> None:
    from megatron.core import parallel_state

    import rltrain.rollout.agent as agent
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    # Both processes run the whole agent loop and must make the same calls: give every wave of tool calls
    # time to come back together (the calculator answers in microseconds).
    agent.STRAGGLER_WAIT_S = 10.0
    init_distributed("cpu", rank=rank, world_size=2, master_port=port)
    for name, tp, pp in LAYOUTS:
        cfg = actor_cfg(tp, pp)
        init_groups(cfg.megatron, "cpu")
        actor = actor_of(tiny_model_cfg(hf_path), cfg, "cpu", trainable=False)
        worker = _Worker(actor, temperature=1.0)
        dp = parallel_state.get_data_parallel_world_size()
        group = parallel_state.get_data_parallel_group()

        def dispatch(batch, *extra, worker=worker, dp=dp, group=group):
            # The controller's _dispatch_cat: equal contiguous DP shards, results concatenated in DP order.
            rows = next(iter(batch.values())).shape[0]
            d = parallel_state.get_data_parallel_rank()
            shard = {k: v[rows * d // dp : rows * (d + 1) // dp] for k, v in batch.items()}
            out = worker.generate_turn(shard, *extra)
            parts = [None] * dp
            torch.distributed.all_gather_object(parts, out, group=group)
            return {k: torch.cat([p[k] for p in parts], 0) for k in out}

        def call_all(method, *args, worker=worker):
            mine = getattr(worker, method)(*args)
            every = [None] * 2
            torch.distributed.all_gather_object(every, mine)
            return every

        client = WorkerRolloutClient(dispatch, call_all, dp=dp, pad_id=CharTokenizer().pad_token_id)
        result = rollout(client)
        for key in ("responses", "response_mask", "multi_turn_turns"):
            assert torch.equal(result.batch[key], ref["batch"][key]), (name, key)
        assert_tiny_close(result.batch["rollout_log_probs"], ref["batch"]["rollout_log_probs"], msg=name)
        assert result.metrics["multi_turn/kv_reused_tokens"] > 0, name
        del actor
    destroy_parallel()


@pytest.mark.multiproc
@pytest.mark.slow
def test_dp_tp_and_pp_layouts_keep_the_cache_and_match_one_process(actor, tiny_hf):
    """DP=2 (rows sharded by the client, each on one rank for the whole rollout), TP=2 and PP=2 keep the
    cache and give the single process's rollout (the same weights, loaded from one folder)."""
    ref = {"batch": rollout(_client(_Worker(actor, temperature=1.0), cache=True)).batch}
    spawn(_layout_worker, args=(free_port(), tiny_hf, ref), nprocs=2, join=True)


@pytest.mark.slow
@pytest.mark.multiproc
def test_tiny_tool_run_keeps_the_cache_across_turns(tmp_path):
    """`rltrain tiny-tool` for 3 steps through Ray: the workers kept the rows' caches (reused tokens
    logged), nothing was left on them, and the run finished."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "tiny-tool", "--trainer.output_dir", str(out),
         "--trainer.save_freq", "0", "--trainer.total_steps", "3"],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert any(r["multi_turn/kv_reused_tokens"] > 0 for r in rows if r["multi_turn/turns_mean"] > 1)
