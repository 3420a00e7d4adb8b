"""The math Env: one question from a prompt row, one reply, one reward from symbolic equivalence.

``extract_answer`` finds the final answer in the reply (the last ``\\boxed{...}``, or the text after
the last ``####``), ``grade`` compares it with the row's reference answer through math-verify
(``1/2``, ``0.5`` and ``\\frac{1}{2}`` are one answer), and ``MathEnv`` wraps both as a single-turn
Env. A recipe names it as ``agent = "molt.agent_pool.envs.math:MathEnv"`` or subclasses it to change
its fields. Nothing here raises on a reply: what cannot be found or parsed earns 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from math_verify import parse, verify

from molt.agent_pool.agents import Env, Message, Prompt, StepResult

AnswerFormat = Literal["boxed", "hash"]

BOXED = "\\boxed{"
HASH = "####"


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced; None when its braces never close."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth = 1
    content_start = start + len(BOXED)
    for index in range(content_start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:index]
    return None


def _after_last_hash(text: str) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K's answer mark), or None."""
    start = text.rfind(HASH)
    if start < 0:
        return None
    return text[start + len(HASH) :].split("\n", 1)[0]


def extract_answer(text: str, formats: Sequence[AnswerFormat] = ("boxed",)) -> str | None:
    """The final answer in ``text``: the first of ``formats`` that finds a non-blank one, else None.

    ``"boxed"``: the content of the last ``\\boxed{...}`` (nested braces kept; an unclosed last box
    counts as no answer rather than falling back to an earlier one, which the model overrode).
    ``"hash"``: the rest of the line after the last ``####``.
    """
    finders = {"boxed": _last_boxed, "hash": _after_last_hash}
    for answer_format in formats:
        if answer_format not in finders:
            raise ValueError(f"unknown answer format {answer_format!r}: expected one of {sorted(finders)}")
        found = finders[answer_format](text)
        if found is not None and found.strip():
            return found.strip()
    return None


def _parsed(answer: str) -> list[object]:
    """``answer`` as math-verify's candidates (SymPy expressions, then the string itself).

    Boxing it makes math-verify read the whole string as LaTeX, without the anchors (``$``, "the
    answer is") it needs in free text. The timeout is off: math-verify implements it with SIGALRM,
    which raises off the main thread, where an Env's plain methods run.
    """
    return parse(BOXED + answer + "}", parsing_timeout=None, raise_on_error=False)


def grade(
    reply: str, reference: str, formats: Sequence[AnswerFormat] = ("boxed",), format_reward: float = 0.0
) -> float:
    """1.0 when the answer extracted from ``reply`` equals ``reference`` symbolically, else 0.0, plus
    ``format_reward`` whenever an answer was extracted at all (right or wrong).

    ``verify`` is not symmetric (the reference goes first); it compares numbers to 6 decimals and
    expressions by simplification. Its timeout is off for the same reason as ``_parsed``'s.
    """
    answer = extract_answer(reply, formats)
    if answer is None:
        return 0.0
    correct = verify(_parsed(reference), _parsed(answer), timeout_seconds=None, raise_on_error=False)
    return float(correct) + format_reward


class MathEnv(Env):
    """A single-turn math problem graded by symbolic equivalence. Configure it by subclassing.

    Fields (class attributes):
    - ``question_key``, ``answer_key``: the prompt row's fields holding the question and the
      reference answer (``"question"``, ``"answer"``); the answer may be a number or LaTeX.
    - ``system_prompt``: the system message before the question, or None for the question alone.
    - ``answer_formats``: where the reply's answer is looked for, in order: ``"boxed"`` (the last
      ``\\boxed{...}``) and/or ``"hash"`` (after the last ``####``).
    - ``format_reward``: added when an answer was found, right or wrong (0.0: off). The episode's
      reward is then 1.0 + ``format_reward`` when right, ``format_reward`` when wrong, 0 when absent.
    - ``max_turns`` is 1; ``max_tokens`` as in ``Env``.

    Example: ``class Gsm8k(MathEnv): answer_formats = ("hash", "boxed"); format_reward = 0.1``.
    """

    question_key: str = "question"
    answer_key: str = "answer"
    system_prompt: str | None = "Reason step by step, and put your final answer within \\boxed{}."
    answer_formats: tuple[AnswerFormat, ...] = ("boxed",)
    format_reward: float = 0.0
    max_turns = 1

    async def reset(self, prompt: Prompt) -> list[Message]:
        # Building two messages never blocks, so this runs on the pool's loop (no thread hand-over).
        self.reference = str(prompt[self.answer_key])
        question: Message = {"role": "user", "content": str(prompt[self.question_key])}
        if self.system_prompt is None:
            return [question]
        return [{"role": "system", "content": self.system_prompt}, question]

    def step(self, action: str) -> StepResult:
        # Plain, so it runs on the episode's thread: grading has no timeout (see ``_parsed``) and
        # SymPy can run long on an adversarial answer; there it stalls this episode, which the
        # pool's episode_timeout_s fails, not the loop all episodes share. One huge integer
        # operation (a power tower) holds the GIL and stalls the whole process: a known limit.
        reward = grade(action, self.reference, self.answer_formats, self.format_reward)
        return StepResult(reward=reward, done=True)
