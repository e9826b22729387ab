"""The agent loop of multi-turn, tool-using rollouts (`rollout.multi_turn`).

Every row alternates model turns and observations:

    prompt | model turn 1 ... <call> | observation (tool answer) | model turn 2 ... EOS

A model turn ends at EOS (the answer is done), at a tool-call end token (the tokenizer's
`tool_call_stop_ids`) or at the row's token budget. The rows that called get their calls parsed
(`tokenizer.parse_tool_call`), run concurrently (`rltrain.tools.ToolRunner`, limits per call) and the
answers appended as observation tokens (`tokenizer.observation_text`); those rows then take another turn.
Rows that finished drop out, so each turn decodes only the rows still talking.

The returned batch has the layout of a single-turn rollout (rltrain/rollout/batch.py), with one difference:
observation tokens are in `responses` and attended to (`attention_mask` 1) but are not the model's, so
`response_mask` is 0 on them and `rollout_log_probs` 0: no loss, no advantage, no KL ever lands on them
(rltrain.algorithms treats interior zeros as absent). A response never ends with an observation: an answer
there would not be read by the model, so a call made without turns or tokens left ends the row instead.

The loop talks to the engine through a `RolloutClient` (`WorkerRolloutClient` for the Ray workers, or a
plain `GenerateFn` callable wrapped in `CallbackClient`). Each call passes every row's whole context; a
client whose `keeps_kv_cache` is true has its workers keep each row's KV cache between the calls of one
rollout (a session, `rltrain.megatron.inference.KVSession`), so a turn prefills only what is new (the
last sampled token and the observation) on top of the cached context, rows that ended are dropped from it
and `close` frees it. A client that cannot keep a cache (vLLM, a rollout resharded to another TP; see
`RolloutServer.kv_session_unsupported`) says so and every call prefills the whole context: same tokens,
more work. Each row samples turn k from its own stream (seed, row, k), so what a row generates does not
depend on which other rows share its call.

Tools run asynchronously (`ToolRunner.submit`): every call of a turn starts at once in the runner's
threads, each under its own limits, and rows whose tools are back take their next turn while slower tools
still run; a late row joins a later call. A tool that comes back within STRAGGLER_WAIT_S of the others of
its wave rides the same call (calls stay large); one that misses that window is not waited for again.

An optional `Interaction` (rollout.multi_turn.interaction, package.module:Class) is an environment: after
each turn that ends without a tool call it may answer with feedback (appended like a tool answer, the model
goes on) and a per-turn reward, and at the end it gives a final reward; the rewards are added to the row's
score by the controller.
"""

from __future__ import annotations

import importlib
import inspect
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rlconf.errors import ConfigError, error
from rlconf.plan.run import ToolPlan
from rlconf.seeding import derive_seed
from rltrain.tokenizer import ToolCallParseError
from rltrain.tools import PendingCall, Tool, ToolResult, ToolRunner

# (contexts, max_new_tokens, stop_token_ids, seed) -> per context (new token ids, their log-probs), each
# ending at EOS, a stop token or max_new_tokens.
GenerateFn = Callable[[list[list[int]], int, tuple[int, ...], int], list[tuple[list[int], list[float]]]]
Generated = list[tuple[list[int], list[float]]]
TURN = "multi-turn"  # seed purposes: call c of a rollout (seed, c, TURN); row i's turn k (seed, i, TURN/k)
# How long a generation call waits for the rest of a wave of tool calls once one of them is back (s).
STRAGGLER_WAIT_S = 0.1
# Per-row statistics the batch carries next to the tensors of a single-turn rollout (the controller keeps
# them to itself: metrics and interaction rewards).
STAT_KEYS = ("multi_turn_turns", "multi_turn_tool_calls", "multi_turn_tool_errors", "multi_turn_reward")


@runtime_checkable
class Interaction(Protocol):
    """An environment that talks back (rollout.multi_turn.interaction, instantiated once, no arguments)."""

    def start(self, prompt: str, ground_truth: str) -> Any:
        """A fresh state for one row."""
        ...

    def respond(self, state: Any, assistant_text: str) -> tuple[str | None, float]:
        """After a model turn that ended without a tool call: (feedback text or None when the row is
        finished, this turn's reward)."""
        ...

    def final_reward(self, state: Any) -> float:
        """Added to the row's reward when the rollout ends."""
        ...


def load_interaction(spec: str) -> Interaction:
    """`package.module:Class` of rollout.multi_turn.interaction, instantiated (ConfigError when unusable)."""
    path = "rollout.multi_turn.interaction"
    if not re.match(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$", spec):
        raise ConfigError([error(path, f"{spec!r} is not package.module:Class",
                                 "name an importable class, e.g. my_envs.math:Checker", rule="multi-turn")])  # fmt: skip
    module, attr = spec.split(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # import errors of any kind: report them as they are
        raise ConfigError([error(path, f"cannot load {spec!r}: {type(exc).__name__}: {exc}",
                                 "install the package or add its folder to PYTHONPATH", rule="multi-turn")]) from exc  # fmt: skip
    obj = cls() if inspect.isclass(cls) else cls
    if not isinstance(obj, Interaction):
        raise ConfigError([error(path, f"{spec!r} lacks start / respond / final_reward",
                                 "implement rltrain.rollout.agent.Interaction", rule="multi-turn")])  # fmt: skip
    return obj


@dataclass(frozen=True)
class TurnRequest:
    """One generation call of the agent loop: the rows ready for their next model turn."""

    row_ids: tuple[int, ...]
    """The rows' indices in the rollout (stable over its turns)."""
    contexts: list[list[int]]
    """Each row's whole context: prompt and response so far (observations included)."""
    row_seeds: tuple[int, ...]
    """Each row's sampling stream of this turn: (rollout seed, row, TURN/its turn)."""
    call_seed: int
    """One stream for the whole call, for engines that sample per call: (rollout seed, call, TURN)."""
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    finished: tuple[int, ...]
    """Rows that ended since the last call: a kept cache can drop them."""


@runtime_checkable
class RolloutClient(Protocol):
    """How the agent loop reaches an engine over one rollout (open, calls, close)."""

    keeps_kv_cache: bool
    """True: the engine keeps each row's KV cache between calls (a call prefills only what is new)."""

    def open(self, n_rows: int) -> None: ...

    def generate(self, request: TurnRequest) -> Generated:
        """Per row of the request, in order: (new token ids, their log-probs)."""
        ...

    def close(self) -> dict[str, float]:
        """End the rollout (free a kept cache); counts to log as multi_turn/* metrics (may be empty)."""
        ...


class CallbackClient:
    """A `GenerateFn` as a client: no cache kept, one sampling stream per call (tests, scripted models)."""

    keeps_kv_cache = False

    def __init__(self, generate: GenerateFn) -> None:
        self.fn = generate

    def open(self, n_rows: int) -> None:
        pass

    def generate(self, request: TurnRequest) -> Generated:
        return self.fn(request.contexts, request.max_new_tokens, request.stop_ids, request.call_seed)

    def close(self) -> dict[str, float]:
        return {}


class WorkerRolloutClient:
    """The rollout workers (`RolloutServer.generate_turn`) as a client, built per rollout by the controller.

    `dispatch(batch, *extra)` sends a batch's DP shards (equal, contiguous blocks of rows, as the
    controller's `_dispatch_cat`) to the rollout workers and concatenates what they return; `call_all(
    method, *args)` calls a method on every worker. Each row stays on one DP rank for the whole rollout (its
    cache lives there): rank d owns rows [n * d / dp, n * (d + 1) / dp) (the blocks of the first call, so
    the n samples of a prompt share one prefill) and every call sends each rank its own ready rows, padded
    with filler rows (id -1, not generated) to the same count. The cache is kept where every worker can
    keep it (`kv_session_unsupported`), else `keeps_kv_cache` is false and `why_no_cache` says why.
    """

    def __init__(
        self, dispatch: Callable[..., dict[str, torch.Tensor]], call_all: Callable[..., list[Any]], dp: int,
        pad_id: int, validate: bool = False,
    ) -> None:  # fmt: skip
        self.dispatch, self.call_all, self.dp, self.pad_id, self.validate = (
            dispatch,
            call_all,
            dp,
            pad_id,
            validate,
        )
        reasons = [r for r in call_all("kv_session_unsupported") if r is not None]
        self.why_no_cache = reasons[0] if reasons else None
        self.keeps_kv_cache = self.why_no_cache is None
        self.session: str | None = None
        self.n_rows = 0

    def open(self, n_rows: int) -> None:
        import uuid

        self.n_rows = n_rows
        self.session = uuid.uuid4().hex if self.keeps_kv_cache else None

    def owner(self, row: int) -> int:
        """The DP rank that generates `row` for the whole rollout."""
        return next(d for d in range(self.dp) if row < self.n_rows * (d + 1) // self.dp)

    def generate(self, request: TurnRequest) -> Generated:
        from rltrain.data import left_pad

        per_rank: list[list[int]] = [[] for _ in range(self.dp)]
        for k, row in enumerate(request.row_ids):
            per_rank[self.owner(row)].append(k)
        width = max(len(p) for p in per_rank)
        order = [k for p in per_rank for k in p + [-1] * (width - len(p))]  # -1: a filler row
        ids, mask = left_pad([request.contexts[k] if k >= 0 else [self.pad_id] for k in order], self.pad_id)
        batch = {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "row_ids": torch.tensor([request.row_ids[k] if k >= 0 else -1 for k in order], dtype=torch.long),
            "row_seeds": torch.tensor(
                [request.row_seeds[k] if k >= 0 else 0 for k in order], dtype=torch.long
            ),
        }
        out = self.dispatch(batch, self.validate, request.max_new_tokens, request.stop_ids, self.session,
                            request.finished)  # fmt: skip
        rows = rows_from_rollout(out)
        result: list[tuple[list[int], list[float]]] = [([], [])] * len(request.row_ids)
        for j, k in enumerate(order):
            if k >= 0:
                result[k] = rows[j]
        return result

    def close(self) -> dict[str, float]:
        if self.session is None:
            return {}
        counts = self.call_all("end_kv_session", self.session)
        self.session = None
        # Every TP / PP rank of a DP group counts the same rows: count each DP group once (the first rank's
        # numbers are per DP rank; summing all ranks and dividing by ranks per DP group gives the total).
        per_group = max(len(counts) // self.dp, 1)
        return {
            "multi_turn/kv_reused_tokens": sum(c["reused_tokens"] for c in counts) / per_group,
            "multi_turn/prefill_tokens": sum(c["prefilled_tokens"] for c in counts) / per_group,
        }


@dataclass
class _Row:
    """One response being built."""

    context: list[int]  # prompt + response so far: what the next turn continues
    prompt_len: int
    budget: int  # response tokens left (model and observation tokens alike)
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float = 0.0
    state: Any = None
    done: bool = False

    def append(self, ids: Sequence[int], log_probs: Sequence[float] | None) -> None:
        """Add tokens: the model's (with their log-probs) or an observation's (None: masked out)."""
        self.tokens += ids
        self.context += ids
        self.loss_mask += [0 if log_probs is None else 1] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.budget -= len(ids)


@dataclass(frozen=True)
class AgentRollout:
    """The batch (engine layout plus STAT_KEYS rows) and the step's multi_turn/* metrics."""

    batch: dict[str, torch.Tensor]
    metrics: dict[str, float]


class AgentLoop:
    """Runs multi-turn rollouts with one set of tools (built once per run)."""

    def __init__(
        self,
        tokenizer: Any,
        plan: ToolPlan,
        interaction: Interaction | None = None,
    ) -> None:
        """`plan`: the plan's tools and limits (its max_total_tokens bounds each row's response)."""
        self.tok, self.plan = tokenizer, plan
        self.max_total_tokens = plan.max_total_tokens
        self.interaction = interaction
        self.runner = ToolRunner(plan)  # the tools run in its worker processes
        self.tools: list[Tool] = self.runner.tool_list
        self.stop_ids = tuple(tokenizer.tool_call_stop_ids())

    def close(self) -> None:
        self.runner.close()

    def prompt_ids(self, prompts: Sequence[Any]) -> list[list[int]]:
        """The prompts encoded for the agent (the chat template with the tools' schemas where there is one)."""
        schemas = [t.schema for t in self.tools]
        return [list(self.tok.encode_agent_prompt(p, schemas)) for p in prompts]

    def _observe(self, row: _Row, text: str, turns_left: bool) -> None:
        """Append an observation when the model can still read it (a turn and one token beyond it left);
        otherwise the row ends here."""
        ids = self.tok.encode(text)
        if not turns_left or len(ids) + 1 > row.budget:
            row.done = True
            return
        row.append(ids, None)

    def run(
        self,
        client: RolloutClient | GenerateFn,
        prompt_ids: Sequence[Sequence[int]],
        seed: int,
        prompts: Sequence[str] | None = None,
        ground_truths: Sequence[str] | None = None,
    ) -> AgentRollout:
        """Roll out every prompt (already repeated n times) to the end through `client` (or a plain
        `GenerateFn`); row i samples its turn k from (seed, i, TURN/k)."""
        if not isinstance(client, RolloutClient):
            client = CallbackClient(client)
        rows = [_Row(list(p), len(p), self.max_total_tokens) for p in prompt_ids]
        if self.interaction is not None:
            assert prompts is not None and ground_truths is not None
            for row, prompt, truth in zip(rows, prompts, ground_truths, strict=True):
                row.state = self.interaction.start(prompt, truth)
        self._stats = {"tool_wait": 0.0, "gen": 0.0, "calls": 0}
        self._call_seconds: list[float] = []
        ready = list(range(len(rows)))  # rows whose next model turn can start
        waiting: dict[int, PendingCall] = {}  # rows whose tool call runs
        self._waiting = waiting
        stragglers: set[int] = set()  # rows whose call missed its wave's window: no call waits for them
        finished: list[int] = []  # rows that ended since the last call
        client.open(len(rows))
        try:
            while ready or waiting:
                talk = sorted(i for i in ready if not rows[i].done and rows[i].budget > 0)
                finished += [i for i in ready if i not in talk]
                ready = []
                if talk:
                    ready, ended = self._turn(client, rows, talk, seed, tuple(finished))
                    finished = ended
                if waiting:
                    back = self._collect(rows, waiting, stragglers, block=not ready)
                    ready += [i for i in back if not rows[i].done]
                    finished += [i for i in back if rows[i].done]
        finally:
            counts = client.close()
        if self.interaction is not None:
            for row in rows:
                row.reward += float(self.interaction.final_reward(row.state))
        batch = self._batch(rows)
        n = max(len(rows), 1)
        metrics = {
            "multi_turn/turns_mean": sum(r.turns for r in rows) / n,
            "multi_turn/tool_calls_mean": sum(r.tool_calls for r in rows) / n,
            "multi_turn/tool_errors": float(sum(r.tool_errors for r in rows)),
            "multi_turn/tool_time_s": self._stats["tool_wait"],
            "multi_turn/tool_call_time_mean_s": sum(self._call_seconds) / max(len(self._call_seconds), 1),
            "multi_turn/generate_s": self._stats["gen"],
            "multi_turn/generate_calls": float(self._stats["calls"]),
            "multi_turn/observation_tokens_mean": sum(len(r.tokens) - sum(r.loss_mask) for r in rows) / n,
            **counts,
        }
        return AgentRollout(batch, metrics)

    def _turn(
        self, client: RolloutClient, rows: list[_Row], talk: list[int], seed: int, finished: tuple[int, ...]
    ) -> tuple[list[int], list[int]]:
        """One generation call for rows `talk`; their tool calls are submitted. Returns (rows ready for
        another turn at once: an observation that needs no tool, rows that ended)."""
        eos = self.tok.eos_token_id
        max_turns = self.plan.max_assistant_turns
        request = TurnRequest(
            row_ids=tuple(talk),
            contexts=[rows[i].context for i in talk],
            row_seeds=tuple(derive_seed(seed, i, f"{TURN}/{rows[i].turns}") for i in talk),
            call_seed=derive_seed(seed, self._stats["calls"], TURN),
            max_new_tokens=max(rows[i].budget for i in talk),
            stop_ids=self.stop_ids,
            finished=finished,
        )
        t0 = time.perf_counter()
        outs = client.generate(request)
        self._stats["gen"] += time.perf_counter() - t0
        self._stats["calls"] += 1
        again: list[int] = []
        for i, (ids, lps) in zip(talk, outs, strict=True):
            row = rows[i]
            ids, lps = list(ids)[: row.budget], list(lps)[: row.budget]
            row.append(ids, lps)
            row.turns += 1
            turns_left = row.turns < max_turns
            # A turn ends at a call at the stop token; a tokenizer without one (stop_ids empty) may end a
            # turn that calls at EOS: its text is read for a call then.
            may_call = bool(ids) and (ids[-1] in self.stop_ids or not self.stop_ids)
            if may_call and not turns_left:  # its answer could never be read: the row ends, nothing runs
                row.done = True
                continue
            try:
                call = (
                    self.tok.parse_tool_call(self.tok.decode(ids), self.tools, self.tok.decode(row.context))
                    if may_call
                    else None
                )
            except ToolCallParseError as exc:
                self._answer(row, ToolResult(f"error: {exc}", error=True))
                again.append(i)
                continue
            if call is None:
                # EOS or the budget: the answer is done, unless an environment has more to say.
                if self.interaction is not None and ids and ids[-1] == eos:
                    feedback, reward = self.interaction.respond(row.state, self.tok.decode(ids))
                    row.reward += float(reward)
                    if feedback is not None:
                        self._observe(row, self.tok.observation_text(feedback, False), turns_left)
                        again.append(i)
                        continue
                row.done = True
                continue
            self._waiting[i] = self.runner.submit(call)
        return [i for i in again if not rows[i].done], [i for i in talk if rows[i].done]

    def _answer(self, row: _Row, result: ToolResult) -> None:
        """A tool call's result becomes the row's observation (the row had a turn left when it called)."""
        row.tool_calls += 1
        row.tool_errors += int(result.error)
        self._call_seconds.append(result.seconds)
        self._observe(row, self.tok.observation_text(result.text, result.error), True)

    def _collect(
        self, rows: list[_Row], waiting: dict[int, PendingCall], stragglers: set[int], block: bool
    ) -> list[int]:
        """Rows whose tool call is back (answered). With `block` (nothing else to decode) wait for the first;
        then give the rest of the wave (calls not yet stragglers) STRAGGLER_WAIT_S to join it. The time spent
        here is multi_turn/tool_time_s: the rollout waiting on tools, not overlapped with decoding."""
        t0 = time.perf_counter()

        def poll() -> list[int]:
            back = []
            for i, pending in list(waiting.items()):
                result = self.runner.poll(pending)
                if result is not None:
                    del waiting[i]
                    stragglers.discard(i)
                    self._answer(rows[i], result)
                    back.append(i)
            return back

        back = poll()
        if block and not back:
            self.runner.wait(list(waiting.values()))
            back = poll()
        if back or block:
            end = time.perf_counter() + STRAGGLER_WAIT_S
            while (
                fresh := [p for i, p in waiting.items() if i not in stragglers]
            ) and time.perf_counter() < end:
                self.runner.wait(fresh, timeout=end - time.perf_counter())
                back += poll()
            stragglers.update(waiting)
        self._stats["tool_wait"] += time.perf_counter() - t0
        return sorted(back)

    def _batch(self, rows: list[_Row]) -> dict[str, torch.Tensor]:
        """The engine layout (left-padded prompts, right-padded responses) with observation tokens present
        in attention_mask and absent from response_mask, plus the STAT_KEYS rows."""
        pad = self.tok.pad_token_id
        b = len(rows)
        p = max(r.prompt_len for r in rows)
        n = max(max(len(r.tokens) for r in rows), 1)
        prompt_ids = torch.full((b, p), pad, dtype=torch.long)
        prompt_mask = torch.zeros((b, p), dtype=torch.long)
        responses = torch.full((b, n), pad, dtype=torch.long)
        present = torch.zeros((b, n), dtype=torch.long)
        loss_mask = torch.zeros((b, n), dtype=torch.long)
        log_probs = torch.zeros((b, n), dtype=torch.float32)
        for i, r in enumerate(rows):
            if r.prompt_len:
                prompt_ids[i, p - r.prompt_len :] = torch.tensor(r.context[: r.prompt_len])
                prompt_mask[i, p - r.prompt_len :] = 1
            k = len(r.tokens)
            if k:
                responses[i, :k] = torch.tensor(r.tokens)
                present[i, :k] = 1
                loss_mask[i, :k] = torch.tensor(r.loss_mask)
                log_probs[i, :k] = torch.tensor(r.log_probs)
        attention_mask = torch.cat([prompt_mask, present], 1)
        return {
            "input_ids": torch.cat([prompt_ids, responses], 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": loss_mask,
            "rollout_log_probs": log_probs,
            "multi_turn_turns": torch.tensor([r.turns for r in rows], dtype=torch.float32),
            "multi_turn_tool_calls": torch.tensor([r.tool_calls for r in rows], dtype=torch.float32),
            "multi_turn_tool_errors": torch.tensor([r.tool_errors for r in rows], dtype=torch.float32),
            "multi_turn_reward": torch.tensor([r.reward for r in rows], dtype=torch.float32),
        }


def build_agent_loop(tokenizer: Any, plan: ToolPlan) -> AgentLoop:
    """The agent loop of the plan's multi-turn tools (tools and interaction loaded; ConfigError when
    unusable)."""
    interaction = load_interaction(plan.interaction) if plan.interaction is not None else None
    return AgentLoop(tokenizer, plan, interaction)


def rows_from_rollout(batch: dict[str, torch.Tensor]) -> list[tuple[list[int], list[float]]]:
    """Per row of an engine's rollout batch: its response tokens and their log-probs (the GenerateFn
    result)."""
    out = []
    for ids, mask, lps in zip(
        batch["responses"], batch["response_mask"], batch["rollout_log_probs"], strict=True
    ):
        keep = mask.bool()
        out.append((ids[keep].tolist(), lps[keep].tolist()))
    return out
