"""Multi-turn, tool-using rollouts: the built-in tokenizer's call format, the agent loop on the real tiny
model (megatron-core over gloo, one process) and what the trainer sees of its batch: observation tokens are
attended to but never in the loss (response_mask 0, no log-prob, no gradient), and the engine's log-probs of
the model's own tokens after an observation match what the sampler drew."""

from __future__ import annotations

import pytest
import torch

from rlconf.config import MultiTurnConfig
from rlconf.plan.run import tool_plan
from rltrain.data import left_pad
from rltrain.rollout.agent import AgentLoop, rows_from_rollout
from rltrain.tokenizer import CharTokenizer, ToolCallParseError
from rltrain.tools import ToolCall, load_tools

from .megatron._common import TINY_DEPTH, TINY_REDUCTION, actor_cfg, actor_of, tiny_model_cfg
from .tolerance import assert_close


def test_char_tool_call_format():
    tok = CharTokenizer()
    tools = load_tools(tool_plan(MultiTurnConfig(tools=("calculator",))))
    assert tok.parse_tool_call("<12*34>", tools) == ToolCall("calculator", {"expression": "12*34"})
    # A bare `>` asks about the question on the line before it.
    assert tok.parse_tool_call(">", tools, "47*8=>") == ToolCall("calculator", {"expression": "47*8"})
    assert tok.parse_tool_call("408", tools) is None  # the turn ended at EOS or the budget
    assert tok.observation_text("408", False) == "=408\n"
    assert tok.observation_text("anything", True) == "=err\n"
    assert tok.tool_call_stop_ids() == (tok.encode(">")[0],)


def test_hf_json_tool_call_format():
    from rltrain.tokenizer import _json_call

    call = _json_call(
        'think <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    )
    assert call == ToolCall("calculator", {"expression": "2+2"})
    assert _json_call('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').arguments == {
        "x": 1
    }
    assert _json_call("no call here") is None
    with pytest.raises(ToolCallParseError):
        _json_call("<tool_call>{not json}</tool_call>")


@pytest.fixture(scope="module")
def actor():

    return actor_of(tiny_model_cfg(), actor_cfg(ppo_mini_batch_size=16), "cpu", total_steps=4)


def _agent_rollout(actor, tools=("calculator",), n_rows=64, seed=3, **cfg):
    tok = CharTokenizer()
    mt = MultiTurnConfig(enable=True, tools=tools, max_assistant_turns=3, tool_timeout_s=1.0, **cfg)
    loop = AgentLoop(tok, tool_plan(mt, 24))

    def generate(contexts, max_new_tokens, stop_ids, turn_seed):
        ids, mask = left_pad(contexts, tok.pad_token_id)
        out = actor.generate(ids, max_new_tokens=max_new_tokens, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                             prompt_mask=mask, stop_token_ids=stop_ids, seed=turn_seed)  # fmt: skip
        return rows_from_rollout(out)

    prompts = [f"{10 + i}*{2 + i % 8}=" for i in range(n_rows)]
    try:
        return loop.run(generate, loop.prompt_ids(prompts), seed)
    finally:
        loop.close()


def test_agent_loop_masks_observations_on_the_tiny_model(actor):
    result = _agent_rollout(actor)
    b = result.batch
    n = b["responses"].shape[1]
    present = b["attention_mask"][:, -n:]
    observation = present.bool() & ~b["response_mask"].bool()
    # The random tiny model calls the calculator on some rows (`>` is one of its tokens): those rows hold
    # observation tokens, the others none.
    calls = b["multi_turn_tool_calls"]
    assert calls.sum() > 0 and (calls == 0).any()
    # Only rows that called hold observations (a call whose answer would not fit ends its row instead).
    assert observation.any()
    assert not (observation.any(-1) & (calls == 0)).any()
    assert result.metrics["multi_turn/tool_calls_mean"] == pytest.approx(float(calls.mean()))
    assert result.metrics["multi_turn/turns_mean"] > 1.0
    # Observations start with "=" right after a call and are never the last token of a response.
    tok = CharTokenizer()
    eq = tok.encode("=")[0]
    for i in torch.nonzero(observation.any(-1)).squeeze(-1).tolist():
        cols = torch.nonzero(observation[i]).squeeze(-1)
        assert b["responses"][i, cols[0]] == eq
        last = int(present[i].sum()) - 1
        assert b["response_mask"][i, last] == 1
    assert torch.all(b["rollout_log_probs"][observation] == 0)
    # The engine reads the interior-masked layout: its log-probs of the model's tokens (after observations
    # too) are those the sampler drew them with.
    recomputed = actor.compute_log_prob(b, temperature=1.0)["log_probs"]
    mask = b["response_mask"].bool()
    assert torch.all(recomputed[observation] == 0)
    assert_close(recomputed[mask], b["rollout_log_probs"][mask], reduction=TINY_REDUCTION, depth=TINY_DEPTH)


def test_observation_tokens_receive_no_gradient(actor):
    """Two updates from the same weights whose batches differ only on observation positions (advantages and
    old log-probs set to junk there) leave identical weights: no gradient reaches the actor from them."""

    b = _agent_rollout(actor, n_rows=16).batch
    observation = b["attention_mask"][:, -b["responses"].shape[1] :].bool() & ~b["response_mask"].bool()
    assert observation.any()
    mask = b["response_mask"].float()
    base = {k: v for k, v in b.items() if not k.startswith("multi_turn_")}
    base["old_log_probs"] = b["rollout_log_probs"]
    base["advantages"] = torch.linspace(-1, 1, mask.shape[0]).unsqueeze(-1) * mask
    junk = dict(base)
    junk["advantages"] = base["advantages"] + 100.0 * observation
    junk["old_log_probs"] = base["old_log_probs"] - 50.0 * observation
    weights = []
    for batch in (None, base, junk):
        torch.manual_seed(0)  # the same initial weights for each engine
        engine = actor_of(tiny_model_cfg(), actor_cfg(ppo_mini_batch_size=16), "cpu", total_steps=4)
        if batch is not None:
            engine.update_policy(batch, temperature=1.0, step=1)
        weights.append(
            torch.cat([p.detach().flatten().float() for c in engine._chunks for p in c.parameters()])
        )
    assert not torch.equal(weights[0], weights[1])  # the update does move the weights
    assert torch.equal(weights[1], weights[2])


def test_a_hanging_tool_marks_the_row_and_the_rollout_goes_on(actor, tmp_path, monkeypatch):
    (tmp_path / "hang_tools.py").write_text(
        "import time\n\ndef hang(expression):\n    time.sleep(60)\n\n"
        "hang.schema = {'type': 'function', 'function': {'name': 'hang', 'parameters': {'type': 'object', "
        "'properties': {'expression': {'type': 'string'}}, 'required': ['expression']}}}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = _agent_rollout(actor, tools=("hang_tools:hang",), n_rows=32)
    b = result.batch
    assert b["multi_turn_tool_calls"].sum() > 0
    assert torch.equal(b["multi_turn_tool_errors"], b["multi_turn_tool_calls"])  # every call marked
    assert result.metrics["multi_turn/tool_errors"] == float(b["multi_turn_tool_calls"].sum())
    assert result.metrics["multi_turn/tool_time_s"] < 3 * 1.0 + 3  # cut at the 1 s limit per turn


@pytest.mark.slow
@pytest.mark.multiproc
def test_tiny_tool_learns_to_call_the_calculator(tmp_path):
    """The issue's done-when: `rltrain tiny-tool` as shipped doubles its reward (last 10 steps vs first 10)
    and its tool calls per row rise."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "tiny-tool", "--trainer.output_dir", str(out),
         "--trainer.save_freq", "0"],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def first_last(key: str) -> tuple[float, float]:
        return sum(r[key] for r in rows[:10]) / 10, sum(r[key] for r in rows[-10:]) / 10

    reward0, reward1 = first_last("reward/mean")
    calls0, calls1 = first_last("multi_turn/tool_calls_mean")
    assert reward1 >= 2 * reward0 and reward1 > 0.5, (reward0, reward1)
    assert calls1 > calls0, (calls0, calls1)


class _Tutor:
    """An interaction: a wrong answer gets the feedback "answer" (reward 0) and another turn, a right one ends
    the row with reward 1; the final reward adds 0.25 for every row that needed no feedback."""

    def start(self, prompt, ground_truth):
        return {"truth": ground_truth, "feedback": 0}

    def respond(self, state, assistant_text):
        if assistant_text.strip() == state["truth"]:
            return None, 1.0
        state["feedback"] += 1
        return "answer", 0.0

    def final_reward(self, state):
        return 0.25 if state["feedback"] == 0 else 0.0


def test_interaction_feedback_is_an_observation_and_its_rewards_reach_the_row():
    """A scripted model (each row answers "4" first, then "5": the right answer for row 1 only at turn 2)
    against the `_Tutor` interaction: feedback text is appended as masked observation tokens, the next turn
    continues after it, per-turn and final rewards are summed into multi_turn_reward, and a right first answer
    ends its row at once."""
    tok = CharTokenizer()
    mt = MultiTurnConfig(enable=True, tools=("calculator",), max_assistant_turns=3)
    loop = AgentLoop(tok, tool_plan(mt, 24), interaction=_Tutor())
    answers = ["4", "5", "5"]
    seen_contexts = []

    def generate(contexts, max_new_tokens, stop_ids, turn_seed):
        seen_contexts.append([tok.decode(c) for c in contexts])
        turn = len(seen_contexts) - 1
        return [([*tok.encode(answers[turn]), tok.eos_token_id], [-0.5] * 2) for _ in contexts]

    try:
        prompts, truths = ["2+2=", "2+3="], ["4", "5"]
        out = loop.run(generate, loop.prompt_ids(prompts), seed=0, prompts=prompts, ground_truths=truths)
    finally:
        loop.close()
    b = out.batch
    # Row 0 was right at once: one turn, reward 1 + 0.25. Row 1: wrong, feedback, right: 2 turns, reward 1.
    assert b["multi_turn_turns"].tolist() == [1.0, 2.0]
    assert b["multi_turn_reward"].tolist() == [1.25, 1.0]
    assert len(seen_contexts[1]) == 1 and seen_contexts[1][0].endswith("4=answer\n")  # the feedback was read
    n = b["responses"].shape[1]
    present = b["attention_mask"][1, -n:].bool()
    observation = present & ~b["response_mask"][1].bool()
    assert tok.decode(b["responses"][1][observation].tolist()) == "=answer\n"  # masked out of the loss
    assert torch.all(b["rollout_log_probs"][1][observation] == 0)
