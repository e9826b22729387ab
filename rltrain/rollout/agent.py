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

Each turn re-runs the prefill of the whole context (prompt and the turns so far) through the engine's
`generate`: the KV cache is not kept across turns, which costs one prefill per turn and keeps the engines
unchanged. Tools run between turns (concurrently across rows, not overlapped with decoding).

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

from rlconf.config import MultiTurnConfig
from rlconf.errors import ConfigError, error
from rlconf.seeding import derive_seed
from rltrain.tokenizer import ToolCallParseError
from rltrain.tools import Tool, ToolCall, ToolResult, ToolRunner

# (contexts, max_new_tokens, stop_token_ids, seed) -> per context (new token ids, their log-probs), each
# ending at EOS, a stop token or max_new_tokens.
GenerateFn = Callable[[list[list[int]], int, tuple[int, ...], int], list[tuple[list[int], list[float]]]]
TURN = "multi-turn"  # the seed purpose of turn t: (rollout seed, t, TURN)
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
        self, tokenizer: Any, cfg: MultiTurnConfig, tools: Sequence[Tool], max_total_tokens: int,
        interaction: Interaction | None = None,
    ) -> None:  # fmt: skip
        self.tok, self.cfg, self.tools = tokenizer, cfg, list(tools)
        self.max_total_tokens = max_total_tokens
        self.interaction = interaction
        self.runner = ToolRunner(
            self.tools, cfg.tool_timeout_s, cfg.max_tool_response_length, cfg.max_parallel_tools
        )
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
        generate: GenerateFn,
        prompt_ids: Sequence[Sequence[int]],
        seed: int,
        prompts: Sequence[str] | None = None,
        ground_truths: Sequence[str] | None = None,
    ) -> AgentRollout:
        """Roll out every prompt (already repeated n times) to the end; the sampling of turn t draws from
        (seed, t, TURN)."""
        eos = self.tok.eos_token_id
        rows = [_Row(list(p), len(p), self.max_total_tokens) for p in prompt_ids]
        if self.interaction is not None:
            assert prompts is not None and ground_truths is not None
            for row, prompt, truth in zip(rows, prompts, ground_truths, strict=True):
                row.state = self.interaction.start(prompt, truth)
        tool_seconds, call_seconds, t_gen = 0.0, [], 0.0
        max_turns = self.cfg.max_assistant_turns
        for turn in range(max_turns):
            active = [r for r in rows if not r.done and r.budget > 0]
            if not active:
                break
            t0 = time.perf_counter()
            outs = generate([r.context for r in active], max(r.budget for r in active), self.stop_ids,
                            derive_seed(seed, turn, TURN))  # fmt: skip
            t_gen += time.perf_counter() - t0
            calls: list[tuple[_Row, ToolCall | None, str]] = []
            for row, (ids, lps) in zip(active, outs, strict=True):
                ids, lps = list(ids)[: row.budget], list(lps)[: row.budget]
                row.append(ids, lps)
                row.turns += 1
                turns_left = turn + 1 < max_turns
                # A turn ends at a call at the stop token; a tokenizer without one (stop_ids empty) may end
                # a turn that calls at EOS: its text is read for a call then.
                may_call = bool(ids) and (ids[-1] in self.stop_ids or not self.stop_ids)
                if may_call and not turns_left:  # its answer could never be read: the row ends, nothing runs
                    row.done = True
                    continue
                try:
                    call = (
                        self.tok.parse_tool_call(
                            self.tok.decode(ids), self.tools, self.tok.decode(row.context)
                        )
                        if may_call
                        else None
                    )
                except ToolCallParseError as exc:
                    calls.append((row, None, f"error: {exc}"))
                    continue
                if call is None:
                    # EOS or the budget: the answer is done, unless an environment has more to say.
                    if self.interaction is not None and ids and ids[-1] == eos:
                        feedback, reward = self.interaction.respond(row.state, self.tok.decode(ids))
                        row.reward += float(reward)
                        if feedback is not None:
                            self._observe(row, self.tok.observation_text(feedback, False), turns_left)
                            continue
                    row.done = True
                    continue
                calls.append((row, call, ""))
            runnable = [(row, c) for row, c, _ in calls if c is not None]
            t0 = time.perf_counter()
            results = iter(self.runner.run_many([c for _, c in runnable]))
            tool_seconds += time.perf_counter() - t0 if runnable else 0.0
            for row, call, message in calls:
                result = next(results) if call is not None else ToolResult(message, error=True)
                row.tool_calls += 1
                row.tool_errors += int(result.error)
                call_seconds.append(result.seconds)
                self._observe(row, self.tok.observation_text(result.text, result.error), turn + 1 < max_turns)
        if self.interaction is not None:
            for row in rows:
                row.reward += float(self.interaction.final_reward(row.state))
        batch = self._batch(rows)
        n = max(len(rows), 1)
        metrics = {
            "multi_turn/turns_mean": sum(r.turns for r in rows) / n,
            "multi_turn/tool_calls_mean": sum(r.tool_calls for r in rows) / n,
            "multi_turn/tool_errors": float(sum(r.tool_errors for r in rows)),
            "multi_turn/tool_time_s": tool_seconds,
            "multi_turn/tool_call_time_mean_s": sum(call_seconds) / max(len(call_seconds), 1),
            "multi_turn/generate_s": t_gen,
            "multi_turn/observation_tokens_mean": sum(len(r.tokens) - sum(r.loss_mask) for r in rows) / n,
        }
        return AgentRollout(batch, metrics)

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


def build_agent_loop(tokenizer: Any, cfg: MultiTurnConfig, max_response_length: int) -> AgentLoop:
    """The agent loop of `rollout.multi_turn` (tools and interaction loaded; ConfigError when unusable)."""
    from rltrain.tools import load_tools

    interaction = load_interaction(cfg.interaction) if cfg.interaction is not None else None
    total = cfg.max_total_tokens if cfg.max_total_tokens is not None else max_response_length
    return AgentLoop(tokenizer, cfg, load_tools(cfg), total, interaction)


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
