"""Micro-batches: budgets, balance across ranks, both layouts' tensors, and that their logits are exact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from molt.learner.logprobs import token_logprobs
from molt.learner.packing import micro_batches, pack, pad, padded_micro_batches, plan
from molt.learner.trainer import load_policy

LENGTHS = [50, 10, 40, 30, 30, 20, 5, 120]


def test_micro_batches_respect_the_budget_and_cover_every_row_once() -> None:
    """Total 305 tokens, budget 100: at least 4 bins; the 120-token row cannot fit and gets its own."""
    bins = micro_batches(range(len(LENGTHS)), LENGTHS, 100)
    assert sorted(r for b in bins for r in b) == list(range(len(LENGTHS)))
    for b in bins:
        assert len(b) == 1 or sum(LENGTHS[r] for r in b) <= 100
    assert [7] in bins
    loads = sorted(sum(LENGTHS[r] for r in b) for b in bins if b != [7])
    assert loads[-1] - loads[0] <= max(LENGTHS[r] for r in range(7))  # balanced within one sequence


def test_plan_balances_ranks_and_equalises_micro_batch_counts() -> None:
    """Two ranks: LPT gives loads 155 / 150; both get the same number of micro-batches."""
    ranks = plan(LENGTHS, 2, 100)
    assert len(ranks[0]) == len(ranks[1])
    rows = [r for rank in ranks for b in rank for r in b]
    assert sorted(rows) == list(range(len(LENGTHS)))
    loads = [sum(LENGTHS[r] for b in rank for r in b) for rank in ranks]
    assert sorted(loads) == [150, 155]


def test_plan_pads_a_rank_without_samples_with_empty_micro_batches() -> None:
    assert plan([7], 2, 100) == [[[0]], [[]]]


def test_pack_restarts_positions_and_scores_only_in_sequence_tokens() -> None:
    packed = pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.predict_at.tolist() == [0, 1, 3]
    assert packed.input_ids.view(-1)[packed.predict_at + 1].tolist() == [6, 7, 9]  # the next tokens
    assert packed.row.tolist() == [0, 0, 1] and packed.column.tolist() == [0, 1, 0]
    assert packed.width == 2


def test_padded_micro_batches_count_the_padding_and_group_similar_lengths() -> None:
    """Budget 100, longest first: [120] alone (over budget), then runs whose count x longest fits."""
    bins = padded_micro_batches(range(len(LENGTHS)), LENGTHS, 100)
    assert sorted(r for b in bins for r in b) == list(range(len(LENGTHS)))
    assert bins == [[7], [0, 2], [3, 4, 5], [1, 6]]  # 120 | 50,40 (2x50) | 30,30,20 (3x30) | 10,5
    for b in bins:
        assert len(b) == 1 or len(b) * max(LENGTHS[r] for r in b) <= 100
    assert plan(LENGTHS, 1, 100, "padded") == [bins]


def test_pad_puts_one_sequence_per_row_and_scores_only_real_tokens() -> None:
    padded = pad([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    assert padded.input_ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert padded.position_ids is None
    assert padded.predict_at.tolist() == [0, 1, 3]  # flat indices into [2 x 3]
    assert padded.input_ids.view(-1)[padded.predict_at + 1].tolist() == [6, 7, 9]
    assert padded.row.tolist() == [0, 0, 1] and padded.column.tolist() == [0, 1, 0]
    assert padded.width == 2


@pytest.mark.parametrize("layout", [pack, pad])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logits_equal_separate(tiny_model: Path, temperature: float, layout: Callable) -> None:
    """Pins transformers' packed-sequence attention (block-diagonal mask from restarting position ids)
    and the padded layout's unmasked causal attention: the logprobs of three sequences in one
    micro-batch equal each sequence run alone, and equal log_softmax(logits / temperature) by hand."""
    model = load_policy(tiny_model, torch.device("cpu"), trainable=False)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 320, (n,), generator=generator) for n in (9, 4, 13)]
    together, _ = token_logprobs(model, layout(sequences), 3, temperature)
    for i, seq in enumerate(sequences):
        alone, _ = token_logprobs(model, pack([seq]), 1, temperature)
        torch.testing.assert_close(together[i, : seq.numel() - 1], alone[0], rtol=0, atol=2e-5)
        with torch.no_grad():
            logits = model(input_ids=seq[None]).logits[0, :-1]
        by_hand = torch.log_softmax(logits / temperature, -1).gather(-1, seq[1:, None]).squeeze(-1)
        torch.testing.assert_close(alone[0], by_hand, rtol=0, atol=2e-5)
