"""Calculator: a multi-turn tool-use Env. The model may call a calculator, then answers; exact grader.

The tool is offered through ``Env.tools``, so the chat template lists it in the
system prompt. A call is the model writing
``<tool_call>{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}</tool_call>``
(the markup our chat templates render and ``molt.agent_pool.chat_formats`` parses);
the result comes back as a ``tool`` message, whose tokens molt masks out of the
loss. A reply without a tool call is the final answer: reward 1.0 when it is
exactly the expected number, else 0.0. Running out of turns earns 0.0.

The calculator never runs ``eval``: ``evaluate`` walks a parsed ``ast`` that
may hold only numbers, + - * / // % ** and parentheses, within size limits.
Prompts: ``recipes/data/calculator-{train,test}.jsonl`` (disjoint); regenerate with
``uv run python recipes/agents/calculator.py --out recipes/data``.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import operator
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from molt.agent_pool.agents import Env, Message, Prompt, StepResult
from molt.agent_pool.chat_formats import parse_reply

SYSTEM = "Solve the problem. You may use the calculator tool. Reply with the final number only."
MALFORMED_CALL = 'error: write a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (valid JSON)'
MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18

BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
            "required": ["expression"],
        },
    },
}


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message goes back to the model."""


def evaluate(expression: str) -> int | float:
    """The value of a small arithmetic expression; raises CalculatorError for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError("not an arithmetic expression") from exc
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return _checked(UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or (abs(left) > 1 and right > MAX_EXPONENT)):
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        try:
            return _checked(BINARY[type(node.op)](left, right))
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        except (OverflowError, ValueError) as exc:  # e.g. a float overflow, a negative number to a fractional power
            raise CalculatorError("result out of range") from exc
    raise CalculatorError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result out of range")
    return int(value) if isinstance(value, int) else float(value)


def show(value: int | float) -> str:
    """How a result is written back: integers plainly, other numbers with up to 10 significant digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class CalculatorEnv(Env):
    """Tool calls get calculator results back; the first reply without one is graded."""

    tools = [CALCULATOR_TOOL]  # noqa: RUF012 (read-only; the shape Env declares)
    max_turns = 4

    def reset(self, prompt: Prompt) -> list[Message]:
        self.answer = str(prompt["answer"])
        self.calls = 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{prompt['question']}="}]

    def step(self, action: str) -> StepResult:
        reply = parse_reply(action)
        if reply.tool_calls:
            self.calls += len(reply.tool_calls)
            results = [
                {"role": "tool", "tool_call_id": call.id, "content": self.call(call.name, call.arguments)}
                for call in reply.tool_calls
            ]
            return StepResult(observation=results, info={"tool_calls": self.calls})
        if "<tool_call>" in action:  # markup that did not parse: say so instead of grading it
            return StepResult(observation=[{"role": "tool", "content": MALFORMED_CALL}])
        correct = action.strip() == self.answer
        return StepResult(reward=float(correct), done=True, info={"tool_calls": self.calls})

    @staticmethod
    def call(name: str, arguments: dict[str, Any]) -> str:
        """Runs one tool call; errors are answers too (the model should learn from them)."""
        if name != "calculator":
            return f"error: unknown tool {name!r}"
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return "error: arguments.expression must be a string"
        try:
            return show(evaluate(expression))
        except CalculatorError as exc:
            return f"error: {exc}"


def problems(seed: int = 0, count: int = 400) -> list[tuple[str, int]]:
    """Two-step integer problems such as ``(23*17)+89``: too big to guess, easy with the tool."""
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    while len(seen) < count:
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 999)
        question = rng.choice([f"({a}*{b})+{c}", f"({a}*{b})-{c}", f"{c}+{a}*{b}", f"({a}+{b})*{c % 50 + 2}"])
        seen[question] = int(evaluate(question))
    return list(seen.items())


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the calculator prompt sets.")
    parser.add_argument("--out", type=Path, default=Path("recipes/data"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = problems()
    cut = len(chosen) // 5
    for name, part in (("train", chosen[cut:]), ("test", chosen[:cut])):
        lines = [json.dumps({"id": f"calc-{name}-{i}", "question": q, "answer": a}) for i, (q, a) in enumerate(part)]
        (args.out / f"calculator-{name}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
