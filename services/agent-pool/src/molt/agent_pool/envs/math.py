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
import os
import queue
import threading
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
    """Processes forked from a server that imported this module (and math-verify) once, so that nothing
    of the pool's threads, loop or gRPC state is forked with them."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _serve_grades(requests: Connection) -> None:
    """A grading process's loop: one reply at a time, until its parent closes the pipe."""
    # math-verify warns on every call that its timeout is off; the process is the timeout here, and
    # the warning, unhandled in this process, would go to the pool's log once per reply.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    while True:
        try:
            reply, reference, formats, bonus = requests.recv()
        except EOFError:
            return
        requests.send(grade(reply, reference, formats, bonus))


class _Grader:
    """One grading process, kept from reply to reply. A new process pays for more than the fork: it
    re-imports the parent's main module when the pool was started by its console script, and
    math-verify builds its parser on the first reply; per reply, that kept a loaded machine's grading
    past any timeout."""

    def __init__(self) -> None:
        self.pipe, child_end = _grading_context().Pipe()
        self.process = _grading_context().Process(target=_serve_grades, args=(child_end,), daemon=True)
        self.process.start()
        child_end.close()

    def grade(self, request: tuple[str, str, tuple[str, ...], float], timeout_s: float) -> float | None:
        """The reward, or None when the process overran ``timeout_s`` or died (it is then killed)."""
        try:
            self.pipe.send(request)
            if self.pipe.poll(timeout_s):
                return float(self.pipe.recv())
            log.warning(
                "grading a reply took longer than %.1f s: it earns 0", timeout_s, extra={"replyTail": request[0][-200:]}
            )
        except (EOFError, OSError):  # the process died (killed from outside, out of memory)
            log.warning("the grading process died before answering: the reply earns 0")
        self.process.kill()
        self.process.join()
        self.pipe.close()
        return None


class _Graders:
    """The grading processes of this process: at most ``size`` replies graded at once, each by an idle
    process or a new one; one that overran is killed and not used again."""

    def __init__(self, size: int) -> None:
        self.slots = threading.BoundedSemaphore(size)
        self.idle: queue.SimpleQueue[_Grader] = queue.SimpleQueue()

    def grade(self, request: tuple[str, str, tuple[str, ...], float], timeout_s: float) -> float:
        with self.slots:  # waiting for a free process is not grading time
            try:
                grader = self.idle.get_nowait()
            except queue.Empty:
                grader = _Grader()
            reward = grader.grade(request, timeout_s)
            if reward is None:
                return 0.0
            self.idle.put(grader)
            return reward


@functools.cache
def _graders() -> _Graders:
    return _Graders(max(2, min(os.cpu_count() or 1, 8)))


def grade_bounded(
    reply: str,
    reference: str,
    formats: Sequence[AnswerFormat] = ("boxed",),
    format_reward: float = 0.0,
    timeout_s: float = 10.0,
) -> float:
    """``grade`` in a grading process, killed after ``timeout_s`` (the reply then earns 0).

    math-verify's own timeout cannot be used off the main thread, and a reply can make grading run
    for ever: SymPy simplifying at length, or one integer power tower computed while holding the GIL,
    which would stall every episode of the pool, not only its own. A process can be killed. The
    processes are kept between replies (``_Grader`` says why), a few of them (up to the CPU count,
    at most 8), so that grading never takes more than its share of the machine.
    """
    return _graders().grade((reply, reference, tuple(formats), format_reward), timeout_s)


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
