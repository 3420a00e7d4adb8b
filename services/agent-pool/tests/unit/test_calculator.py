"""The calculator tool-use Env's logic, without a model: the safe evaluator, tool turns, grading."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from molt.agent_pool.agents import Env, load_agent

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def calc() -> Any:
    """The recipe module (loaded the way the pool loads agents: by file path)."""
    env = load_agent(f"{REPO}/recipes/agents/calculator.py:CalculatorEnv")
    assert issubclass(env, Env)
    return sys.modules[env.__module__]


def call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


@pytest.mark.parametrize(
    ("expression", "value"),
    [("1+2*3", 7), ("(23*17)+89", 480), ("-4 // 3", -2), ("7 % 3", 1), ("2**10", 1024), ("1/4", 0.25), ("+-2", -2)],
)
def test_evaluates_arithmetic(calc: Any, expression: str, value: float) -> None:
    assert calc.evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("(1).__class__", "Attribute is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("'a' * 3", "Constant is not allowed"),
        ("True + 1", "Constant is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("9 ** 999999", "exponent larger"),
        ("2 ** 2 ** 10", "exponent larger"),
        ("10 ** 19", "out of range"),
        ("1e300 * 1e300", "out of range"),
        ("(-8) ** 0.5", "out of range"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" + "+1" * 40, "more than 64 parts"),
        ("1" * 201, "longer than 200"),
    ],
)
def test_refuses_anything_else(calc: Any, expression: str, error: str) -> None:
    with pytest.raises(calc.CalculatorError, match=error):
        calc.evaluate(expression)


def test_results_are_written_plainly(calc: Any) -> None:
    assert [calc.show(v) for v in (3, 4.0, 0.25, 1 / 3)] == ["3", "4", "0.25", "0.3333333333"]


def test_a_tool_turn_then_a_graded_answer(calc: Any) -> None:
    env = calc.CalculatorEnv()
    messages = env.reset({"question": "(23*17)+89", "answer": 480})
    assert messages[-1] == {"role": "user", "content": "(23*17)+89="}
    assert env.tools and env.tools[0]["function"]["name"] == "calculator"

    first = env.step(f"Let me compute. {call('23*17+89')}")
    assert not first.done and first.reward == 0.0
    (result,) = first.observation
    assert result["role"] == "tool" and result["content"] == "480" and result["tool_call_id"].startswith("call_")

    final = env.step(" 480 ")
    assert final.done and final.reward == 1.0 and final.info == {"tool_calls": 1}


def test_wrong_answers_errors_and_unknown_tools(calc: Any) -> None:
    env = calc.CalculatorEnv()
    env.reset({"question": "2+2", "answer": 4})
    bad = env.step(call("2+x"))
    assert bad.observation[0]["content"] == "error: Name is not allowed (numbers and + - * / // % ** only)"
    unknown = env.step('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    assert unknown.observation[0]["content"] == "error: unknown tool 'python'"
    no_expr = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": 4}}</tool_call>')
    assert no_expr.observation[0]["content"] == "error: arguments.expression must be a string"
    malformed = env.step('<tool_call>{"name": "calculator", "arguments": </tool_call>')
    assert not malformed.done and malformed.observation[0]["content"] == calc.MALFORMED_CALL
    wrong = env.step("5")
    assert wrong.done and wrong.reward == 0.0 and wrong.info == {"tool_calls": 3}


def test_two_calls_in_one_reply_get_two_results(calc: Any) -> None:
    env = calc.CalculatorEnv()
    env.reset({"question": "q", "answer": 1})
    step = env.step(call("1+1") + call("2*3"))
    assert [m["content"] for m in step.observation] == ["2", "6"]


def test_the_prompt_sets_are_disjoint_and_graded_right(calc: Any) -> None:
    sets = {}
    for name in ("train", "test"):
        lines = (REPO / f"recipes/data/calculator-{name}.jsonl").read_text().splitlines()
        sets[name] = [json.loads(line) for line in lines]
    assert len(sets["train"]) == 320 and len(sets["test"]) == 80
    assert not {p["question"] for p in sets["train"]} & {p["question"] for p in sets["test"]}
    assert all(calc.evaluate(p["question"]) == p["answer"] for p in sets["train"] + sets["test"])
