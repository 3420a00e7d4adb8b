"""SFT: assistant spans derived from the chat template, and a short warm-up that lowers the NLL."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.learner.config import LearnerSettings
from molt.learner.metrics import read_history
from molt.learner.sft import assistant_mask, run_sft

SettingsFactory = Callable[..., LearnerSettings]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "Done."},
]


def spans(ids: list[int], mask: list[bool]) -> list[list[int]]:
    out: list[list[int]] = []
    for i, (token, on) in enumerate(zip(ids, mask, strict=True)):
        if on and (i == 0 or not mask[i - 1]):
            out.append([])
        if on:
            out[-1].append(token)
    return out


def test_assistant_spans_come_from_the_template(tiny_model: Path) -> None:
    """The template renders an assistant turn as '<|im_start|>assistant\\n' + content + '<|im_end|>\\n';
    the header belongs to the generation prompt, so the spans are exactly content + '<|im_end|>\\n'."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids, mask = assistant_mask(tokenizer, CONVERSATION)
    decoded = [tokenizer.decode(span) for span in spans(ids, mask)]
    assert decoded == ["4<|im_end|>\n", "Done.<|im_end|>\n"]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)


def test_sft_warm_up_lowers_the_nll_and_saves_a_loadable_model(
    learner_settings: SettingsFactory, tmp_path: Path, tiny_model: Path
) -> None:
    data = tmp_path / "chat.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": f"count to {n}"}, {"role": "assistant", "content": "123456789"[:n]}]}
        for n in range(3, 9)
    ]
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    settings = learner_settings(mode="sft", sft={"data_path": data, "epochs": 4, "samples_per_step": 3})
    output = run_sft(settings)
    history = read_history(settings.run.run_dir / "sft" / "metrics.jsonl")
    assert sorted(history) == list(range(1, 9))
    assert history[8]["loss/nll"] < history[1]["loss/nll"] - 0.5
    # The cosine spans the warm-up's own 8 steps (not RL's total_steps): nearly decayed at the last one.
    assert history[8]["lr"] < 0.1 * history[1]["lr"]
    tuned = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert not torch.equal(tuned.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    assert (output / "tokenizer_config.json").is_file()
