"""Token-exact capture: extension by delta, masks, segments on rewritten history."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from molt.agent_pool.transcript import Transcript


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> object:
    return AutoTokenizer.from_pretrained(tiny_model)


def sample(tokenizer: object, text: str) -> list[int]:
    """Ids as an engine would sample them: the reply's tokens, then the end-of-turn token."""
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_multi_turn_with_tool_output_extends_one_segment(tokenizer: object) -> None:
    transcript = Transcript(tokenizer)
    messages = [{"role": "user", "content": "2*3?"}]
    plan = transcript.plan(messages)
    first = plan.prompt_ids
    assert first == tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    reply_ids = sample(tokenizer, "<tool_call>calc</tool_call>")
    reply = {"role": "assistant", "content": transcript.reply_text(reply_ids)}
    transcript.commit(plan, reply_ids, [-0.5] * len(reply_ids), [3] * len(reply_ids), reply)
    messages = [*messages, reply, {"role": "tool", "content": "6"}]
    plan = transcript.plan(messages)
    second = plan.prompt_ids
    transcript.commit(plan, [], [], [], {"role": "assistant", "content": ""})

    (segment,) = transcript.segments
    assert second[: len(first) + len(reply_ids)] == first + reply_ids  # the sampled ids, untouched
    delta = second[len(first) + len(reply_ids) :]
    assert (
        tokenizer.decode(delta)
        == "\n<|im_start|>user\n<tool_response>6</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert segment.loss_mask == [True] * len(reply_ids) + [False] * len(delta)
    assert segment.logprobs == [-0.5] * len(reply_ids) + [0.0] * len(delta)
    assert segment.versions == [3] * (len(reply_ids) + len(delta))
    # The whole segment is what the template renders for the full conversation.
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(second) == rendered


def test_rewritten_history_starts_a_new_segment(tokenizer: object) -> None:
    transcript = Transcript(tokenizer)
    messages = [{"role": "user", "content": "long story"}]
    plan = transcript.plan(messages)
    ids = sample(tokenizer, "ok")
    reply = {"role": "assistant", "content": "ok"}
    transcript.commit(plan, ids, [-1.0] * len(ids), [0] * len(ids), reply)
    compacted = [{"role": "user", "content": "summary of the story"}, {"role": "user", "content": "go on"}]
    plan = transcript.plan(compacted)
    prompt = plan.prompt_ids
    assert plan.new_segment and len(transcript.segments) == 1  # nothing changes until the turn is committed
    transcript.commit(plan, [5], [-1.0], [0], reply)
    assert len(transcript.segments) == 2
    assert prompt == tokenizer.apply_chat_template(
        compacted, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert transcript.segments[0].response_ids == ids and transcript.segments[1].response_ids == [5]


def test_changed_tool_list_starts_a_new_segment(tokenizer: object) -> None:
    transcript = Transcript(tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    plan = transcript.plan(messages)
    transcript.commit(plan, [5], [-1.0], [0], {"role": "assistant", "content": "x"})
    tools = [{"type": "function", "function": {"name": "calc"}}]
    follow_up = [*messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "again"}]
    assert transcript.plan(follow_up, tools).new_segment
    assert not transcript.plan(follow_up).new_segment


def test_reserialised_reply_still_extends(tokenizer: object) -> None:
    """A client that re-sends our tool-call reply in structured form (different JSON spacing) still extends."""
    transcript = Transcript(tokenizer)
    messages = [{"role": "user", "content": "add"}]
    plan = transcript.plan(messages)
    first = plan.prompt_ids
    ids = sample(tokenizer, '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>')
    structured = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}],
    }
    transcript.commit(plan, ids, [-1.0] * len(ids), [0] * len(ids), structured)
    plan = transcript.plan([*messages, structured, {"role": "tool", "content": "1"}])
    second = plan.prompt_ids
    assert not plan.new_segment
    assert second[: len(first) + len(ids)] == first + ids
    assert tokenizer.decode(second[len(first) + len(ids) :]).startswith("<|im_start|>user\n<tool_response>1")


def _routing(rows: int, fill: int) -> np.ndarray:
    routing = np.full((rows, 2, 2), fill, dtype=np.int16)
    routing[-1] = -1  # the last sampled token was never fed to the model
    return routing


def test_a_segment_keeps_each_tokens_first_routing(tokenizer: object) -> None:
    """Turn 2 recomputes turn 1's tokens (as a later policy might); turn 1's rows stay, and its last
    row, which turn 1 never computed, is filled from turn 2."""
    transcript = Transcript(tokenizer)
    messages = [{"role": "user", "content": "2*3?"}]
    plan = transcript.plan(messages)
    ids = sample(tokenizer, "six")
    reply = {"role": "assistant", "content": transcript.reply_text(ids)}
    first_rows = len(plan.prompt_ids) + len(ids)
    transcript.commit(plan, ids, [-0.5] * len(ids), [0] * len(ids), reply, _routing(first_rows, 1))
    plan = transcript.plan([*messages, reply, {"role": "user", "content": "sure?"}])
    again = sample(tokenizer, "yes")
    rows = len(plan.prompt_ids) + len(again)
    transcript.commit(plan, again, [-0.5] * len(again), [1] * len(again), reply, _routing(rows, 2))
    (segment,) = transcript.segments
    routing = segment.full_routing
    assert routing is not None and len(routing) == len(segment.token_ids()) == rows
    assert (routing[: first_rows - 1] == 1).all()
    assert (routing[first_rows - 1 : -1] == 2).all() and (routing[-1] == -1).all()


def test_a_turn_without_routing_leaves_the_segment_without_any(tokenizer: object) -> None:
    transcript = Transcript(tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    plan = transcript.plan(messages)
    ids = sample(tokenizer, "hello")
    reply = {"role": "assistant", "content": transcript.reply_text(ids)}
    transcript.commit(plan, ids, [-0.5] * len(ids), [0] * len(ids), reply, _routing(len(plan.prompt_ids) + len(ids), 1))
    assert transcript.segments[0].full_routing is not None
    plan = transcript.plan([*messages, reply, {"role": "user", "content": "more"}])
    transcript.commit(plan, ids, [-0.5] * len(ids), [0] * len(ids), reply)
    assert transcript.segments[0].full_routing is None
