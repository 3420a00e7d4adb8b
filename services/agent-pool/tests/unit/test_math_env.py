"""The math Env's grader and Env, on the real math-verify: equivalent forms, wrong, missing and
malformed answers (0, never an exception), the format reward, grading off the main thread, and a
reply whose grading would never end (killed with its process, earning 0, the rest running on)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from molt.agent_pool.agents import Env, load_agent
from molt.agent_pool.envs.math import MathEnv, _Graders, extract_answer, grade, grade_bounded


@pytest.mark.parametrize("form", ["1/2", "0.5", "\\frac{1}{2}", "\\dfrac12", "\\frac12", "0.50"])
@pytest.mark.parametrize("reference", ["1/2", "0.5", "\\frac{1}{2}"])
def test_equivalent_forms_are_right(form: str, reference: str) -> None:
    assert grade(f"So the answer is $\\boxed{{{form}}}$.", reference) == 1.0


@pytest.mark.parametrize(
    ("reply", "formats"),
    [
        ("\\boxed{42}", ("boxed",)),
        ("6 times 7 makes \\boxed{42}.", ("boxed",)),
        ("6 times 7 makes\n#### 42", ("hash",)),
        ("#### 42\nDone.", ("hash",)),
        ("#### 42", ("boxed", "hash")),
        ("\\boxed{42}", ("hash", "boxed")),
    ],
)
def test_integers_boxed_or_after_hashes(reply: str, formats: tuple[str, ...]) -> None:
    assert grade(reply, "42", formats) == 1.0


def test_a_wrong_answer_earns_nothing() -> None:
    assert grade("\\boxed{0.6}", "1/2") == 0.0
    assert grade("#### 41", "42", ("hash",)) == 0.0


def test_an_answer_without_its_mark_earns_nothing() -> None:
    """The right number in plain text (or after ####, when only boxes count) is not an answer."""
    assert extract_answer("The answer is 42.") is None
    assert grade("The answer is 42.", "42") == 0.0
    assert grade("#### 42", "42", ("boxed",)) == 0.0
    assert grade("\\boxed{}", "42") == 0.0


@pytest.mark.parametrize("reply", ["\\boxed{\\frac{1}{", "\\boxed{\\frac{1}{}}", "\\boxed{}{}", "\\boxed{\\sqrt[}{2}}"])
def test_malformed_latex_earns_nothing_and_does_not_raise(reply: str) -> None:
    assert grade(reply, "1/2") == 0.0


def test_the_last_box_wins() -> None:
    assert extract_answer("First \\boxed{3}, no: \\boxed{4}") == "4"
    assert grade("First \\boxed{3}, no: \\boxed{4}", "4") == 1.0
    assert grade("First \\boxed{4}, no: \\boxed{3}", "4") == 0.0
    # An unclosed last box is no answer: the earlier one was overridden.
    assert extract_answer("\\boxed{4} then \\boxed{5") is None


def test_nested_braces_stay_in_the_box() -> None:
    assert extract_answer("\\boxed{\\frac{1}{2}} and more {text}") == "\\frac{1}{2}"
    assert grade("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}") == 1.0


def test_the_format_reward_is_off_by_default_and_paid_for_any_answer() -> None:
    assert grade("\\boxed{3}", "4") == 0.0
    assert grade("\\boxed{3}", "4", format_reward=0.1) == pytest.approx(0.1)
    assert grade("\\boxed{4}", "4", format_reward=0.1) == pytest.approx(1.1)
    assert grade("4", "4", format_reward=0.1) == 0.0


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown answer format 'latex'"):
        extract_answer("\\boxed{1}", ("latex",))


def test_grading_works_off_the_main_thread() -> None:
    """Plain Env methods run on an episode's thread; a SIGALRM timeout would raise ValueError there."""
    results: list[float] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(grade("\\boxed{\\frac{1}{2}}", "0.5"))
            results.append(grade("\\boxed{\\frac{1}{", "0.5"))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == []
    assert results == [1.0, 0.0]


def test_the_env_loads_by_module_path() -> None:
    assert load_agent("molt.agent_pool.envs.math:MathEnv") is MathEnv
    assert issubclass(MathEnv, Env)


def test_reset_asks_with_the_system_prompt_and_step_grades_once() -> None:
    env = MathEnv()
    messages = asyncio.run(env.reset({"id": "p1", "question": "Half of 1?", "answer": "\\frac{1}{2}"}))
    assert messages == [
        {"role": "system", "content": MathEnv.system_prompt},
        {"role": "user", "content": "Half of 1?"},
    ]
    result = env.step("It is \\boxed{0.5}.")
    assert (result.reward, result.done) == (1.0, True)
    assert MathEnv.max_turns == 1


class Gsm8k(MathEnv):
    question_key = "problem"
    answer_key = "solution"
    system_prompt = None
    answer_formats = ("hash",)
    format_reward = 0.25


def test_a_subclass_changes_keys_prompt_formats_and_format_reward() -> None:
    env = Gsm8k()
    messages = asyncio.run(env.reset({"problem": "6*7?", "solution": 42}))
    assert messages == [{"role": "user", "content": "6*7?"}]
    assert env.step("6*7 = 42\n#### 42").reward == pytest.approx(1.25)
    assert env.step("#### 41").reward == pytest.approx(0.25)
    assert env.step("\\boxed{42}").reward == 0.0


def test_bounded_grading_agrees_with_grade() -> None:
    assert grade_bounded("\\boxed{0.5}", "\\frac{1}{2}", format_reward=0.1) == 1.1
    assert grade_bounded("#### 41", "42", ("hash",)) == 0.0


def test_a_reply_that_would_never_finish_grading_is_killed_and_earns_nothing() -> None:
    """A power tower makes math-verify compute one huge integer while holding the GIL: graded in this
    process, a second thread would stop for as long. In a child process, killed after the timeout, the
    reply earns 0 and this process's other threads keep running throughout."""
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.05)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        reward = grade_bounded("\\boxed{9^{9^{9^9}}}", "1", timeout_s=2.0)
    finally:
        stop.set()
        ticker.join()
    assert reward == 0.0
    # The ticker ran on while the reply was graded (about 40 ticks in the 2 s; held off the GIL by an
    # in-process grading, it would have ticked about once).
    assert len(ticks) >= 5


def test_a_grading_process_serves_reply_after_reply_and_one_that_overran_is_replaced() -> None:
    """A process per reply paid for starting it (the parent's main module, math-verify's parser) on
    every reply; a kept one pays once. One that overran is killed, and the next reply gets another."""
    graders = _Graders(1)
    assert graders.grade(("\\boxed{1}", "1", ("boxed",), 0.0), 10.0) == 1.0
    kept = graders.idle.get()
    graders.idle.put(kept)
    assert graders.grade(("\\boxed{3}", "4", ("boxed",), 0.0), 10.0) == 0.0
    assert kept.process.is_alive() and graders.idle.get() is kept  # the same process graded both
    graders.idle.put(kept)
    assert graders.grade(("\\boxed{9^{9^{9^9}}}", "1", ("boxed",), 0.0), 1.0) == 0.0
    assert not kept.process.is_alive() and graders.idle.empty()
    assert graders.grade(("\\boxed{5}", "5", ("boxed",), 0.0), 10.0) == 1.0  # by a new process
    assert graders.idle.get() is not kept
