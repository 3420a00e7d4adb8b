"""The math Env: one question from a prompt row, one reply, one reward from symbolic equivalence.

``extract_answer`` finds the final answer in the reply (the last ``\\boxed{...}``, or the text after
the last ``####``), ``grade`` compares it with the row's reference answer through math-verify
(``1/2``, ``0.5`` and ``\\frac{1}{2}`` are one answer), and ``MathEnv`` wraps both as a single-turn
Env. A recipe names it as ``agent = "molt.agent_pool.envs.math:MathEnv"`` or subclasses it to change
its fields. Nothing here raises on a reply: what cannot be found or parsed earns 0.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from typing import Literal

from math_verify import parse, verify

from molt.agent_pool.agents import Env, Message, Prompt, StepResult

log = logging.getLogger(__name__)
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


@functools.cache
def _grading_context() -> ForkServerContext:
    """Processes forked from a server that imported this module (and math-verify) once: a child then
    starts in milliseconds, and nothing of the pool's threads, loop or gRPC state is forked with it."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _grade_into(sink: Connection, reply: str, reference: str, formats: tuple[str, ...], bonus: float) -> None:
    sink.send(grade(reply, reference, formats, bonus))  # type: ignore[arg-type]
    sink.close()


def grade_bounded(
    reply: str,
    reference: str,
    formats: Sequence[AnswerFormat] = ("boxed",),
    format_reward: float = 0.0,
    timeout_s: float = 10.0,
) -> float:
    """``grade`` in a child process, killed after ``timeout_s`` (the reply then earns 0).

    math-verify's own timeout cannot be used off the main thread, and a reply can make grading run
    for ever: SymPy simplifying at length, or one integer power tower computed while holding the GIL,
    which would stall every episode of the pool, not only its own. A process can be killed.
    """
    context = _grading_context()
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_grade_into, args=(send, reply, reference, tuple(formats), format_reward))
    child.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            return float(receive.recv())
        log.warning("grading a reply took longer than %.1f s: it earns 0", timeout_s, extra={"replyTail": reply[-200:]})
        return 0.0
    except EOFError:  # the child died before answering (killed from outside, out of memory)
        log.warning("the grading process died before answering: the reply earns 0")
        return 0.0
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()


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
    - ``grade_timeout_s``: the longest a reply's grading may take (in a child process, then killed:
      the reply earns 0).
    - ``max_turns`` is 1; ``max_tokens`` as in ``Env``.

    Example: ``class Gsm8k(MathEnv): answer_formats = ("hash", "boxed"); format_reward = 0.1``.
    """

    question_key: str = "question"
    answer_key: str = "answer"
    system_prompt: str | None = "Reason step by step, and put your final answer within \\boxed{}."
    answer_formats: tuple[AnswerFormat, ...] = ("boxed",)
    format_reward: float = 0.0
    grade_timeout_s: float = 10.0
    max_turns = 1

    async def reset(self, prompt: Prompt) -> list[Message]:
        # Building two messages never blocks, so this runs on the pool's loop (no thread hand-over).
        self.reference = str(prompt[self.answer_key])
        question: Message = {"role": "user", "content": str(prompt[self.question_key])}
        if self.system_prompt is None:
            return [question]
        return [{"role": "system", "content": self.system_prompt}, question]

    def step(self, action: str) -> StepResult:
        # Plain, so it runs on the episode's thread: it waits for the grading process, which is
        # bounded by grade_timeout_s (grade_bounded says why grading runs in a process at all).
        reward = grade_bounded(action, self.reference, self.answer_formats, self.format_reward, self.grade_timeout_s)
        return StepResult(reward=reward, done=True)
