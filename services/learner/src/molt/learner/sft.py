"""Supervised fine-tuning on chat data, on the same model path and trainer as RL (a warm-up before it).

Data: JSONL, one ``{"messages": [...]}`` conversation per line. The loss covers the assistant
turns only, and their spans come from the model's own chat template, never from hard-coded
markers: for assistant message i the span starts where ``render(messages[:i],
add_generation_prompt=True)`` ends and stops where ``render(messages[:i + 1])`` ends. Each
rendered prefix must be a token prefix of the whole conversation, else the template is not
prefix-stable and the conversation is refused.

``run_sft(settings)`` trains ``epochs`` passes and saves the tuned model (``save_pretrained``
layout, with the tokenizer) for the RL run's ``model_path``; ``molt-learner --mode sft`` calls it.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from molt.core.errors import InvalidInput
from molt.learner.batch import Sample
from molt.learner.config import LearnerSettings
from molt.learner.metrics import MetricsLog
from molt.learner.trainer import Trainer

log = logging.getLogger(__name__)

Message = dict[str, Any]


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=generation_prompt, return_dict=True
    )
    return list(encoded["input_ids"])


def assistant_mask(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and a per-token mask that is true on assistant turns (as the template
    renders them, end-of-turn token included). Raises ``InvalidInput`` for a non-prefix-stable template."""
    ids = _render(tokenizer, messages, False)
    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else []
        through = _render(tokenizer, messages[: i + 1], False)
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise InvalidInput(
                f"the chat template does not render message {i}'s prefix as a prefix of the conversation; "
                f"assistant spans cannot be derived from it"
            )
        mask[len(before) : len(through)] = [True] * (len(through) - len(before))
    return ids, mask


def load_conversations(path: Path) -> list[list[Message]]:
    """The ``messages`` lists of a JSONL file; a line without one is an error naming the line."""
    conversations = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
            raise InvalidInput(f"{path}:{number}: expected an object with a 'messages' list")
        conversations.append(record["messages"])
    return conversations


def sft_sample(index: int, ids: list[int], mask: list[bool], max_length: int) -> Sample:
    """A ``Sample`` on the next-token axis (no rollout logprobs or versions: the data was not sampled)."""
    ids, mask = ids[:max_length], mask[:max_length]
    width = len(ids) - 1
    return Sample(
        trajectory_id=f"sft-{index}",
        group_key=f"sft-{index}",
        rollout_key=f"sft-{index}",
        input_ids=torch.tensor(ids, dtype=torch.int64),
        loss_mask=torch.tensor(mask[1:], dtype=torch.bool),
        rollout_logprobs=torch.zeros(width),
        policy_versions=torch.zeros(width, dtype=torch.int64),
        reward=0.0,
    )


def run_sft(settings: LearnerSettings) -> Path:
    """Trains on ``settings.sft`` data and saves the model; returns the output directory."""
    if settings.sft is None:
        raise InvalidInput("SFT needs [learner.sft] settings")
    sft = settings.sft
    tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    samples = []
    for index, messages in enumerate(load_conversations(sft.data_path)):
        sample = sft_sample(index, *assistant_mask(tokenizer, messages), sft.max_length)
        if sample.loss_tokens:
            samples.append(sample)
    if not samples:
        raise InvalidInput(f"{sft.data_path} has no assistant tokens to train on")
    # The schedule spans the warm-up's own steps (RL's total_steps would cut or stretch its decay), and
    # supervised warm-up and RL usually want different peak rates.
    steps = sft.epochs * -(-len(samples) // sft.samples_per_step)
    optimizer = {"total_steps": steps} | ({} if sft.lr is None else {"lr": sft.lr})
    settings = settings.model_copy(update={"optimizer": settings.optimizer.model_copy(update=optimizer)})
    trainer = Trainer(settings)
    metrics = MetricsLog(settings.run.run_dir / "sft", plot_every=settings.plot_every)
    order = random.Random(settings.seed)
    for epoch in range(sft.epochs):
        shuffled = order.sample(samples, len(samples))
        for start in range(0, len(shuffled), sft.samples_per_step):
            step_metrics = trainer.sft_step(shuffled[start : start + sft.samples_per_step])
            metrics.record(trainer.step, {**step_metrics, "epoch": float(epoch)})
            log.info("sft step %d, nll %.4f", trainer.step, step_metrics["loss/nll"])
    metrics.close()
    output = sft.output_dir or settings.run.run_dir / "sft-model"
    trainer.model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    log.info("sft model saved", extra={"path": str(output), "steps": trainer.step})
    return output
