"""Micro-batches: budgets, balance across ranks, both layouts' tensors, and that their logits are exact."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from molt.learner.logprobs import token_logprobs
from molt.learner.models import load_policy
from molt.learner.packing import micro_batches, pack, pad, padded_micro_batches, plan

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


def padded_cost(bins: list[list[int]], lengths: list[int], budget: int) -> float:
    """Padded tokens plus the fixed cost (budget / 16 tokens) of each micro-batch."""
    return sum(len(b) * max(lengths[r] for r in b) + budget / 16 for b in bins)


def partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        yield [[first], *smaller]
        for i in range(len(smaller)):
            yield [*smaller[:i], [first, *smaller[i]], *smaller[i + 1 :]]


def test_padded_micro_batches_count_the_padding_and_group_similar_lengths() -> None:
    """Budget 100 (a micro-batch costs 6.25 tokens more): [120] alone (over budget); 50 and 40 apart
    (2 x 50 would pad 10), 30 with 30, and 10 with 5; 310 padded tokens for 305 real ones."""
    bins = padded_micro_batches(range(len(LENGTHS)), LENGTHS, 100)
    assert sorted(r for b in bins for r in b) == list(range(len(LENGTHS)))
    assert bins == [[7], [0], [2], [3, 4], [5], [1, 6]]
    for b in bins:
        assert len(b) == 1 or len(b) * max(LENGTHS[r] for r in b) <= 100
    assert plan(LENGTHS, 1, 100, "padded") == [bins]


def test_padded_micro_batches_are_the_cheapest_split() -> None:
    """Against every partition of up to 7 sequences that fits the budget (a longer one alone)."""
    rng = random.Random(0)
    for _ in range(150):
        lengths = [rng.choice([rng.randrange(1, 40), rng.randrange(40, 130)]) for _ in range(rng.randrange(1, 8))]
        budget = rng.choice([64, 100, 256])
        ours = padded_micro_batches(range(len(lengths)), lengths, budget)
        assert sorted(r for b in ours for r in b) == list(range(len(lengths)))
        assert all(len(b) == 1 or len(b) * max(lengths[r] for r in b) <= budget for b in ours)
        feasible = [
            p
            for p in partitions(list(range(len(lengths))))
            if all(len(b) == 1 or len(b) * max(lengths[r] for r in b) <= budget for b in p)
        ]
        assert min(padded_cost(p, lengths, budget) for p in feasible) == pytest.approx(
            padded_cost(ours, lengths, budget)
        ), (lengths, budget, ours)


def test_at_most_k_micro_batches_take_the_fewest_padded_tokens() -> None:
    """``at_most``: no cost per micro-batch, at most k of them; against every partition of up to 7."""
    rng = random.Random(1)
    for _ in range(150):
        lengths = [rng.choice([rng.randrange(1, 40), rng.randrange(40, 130)]) for _ in range(rng.randrange(1, 8))]
        budget = rng.choice([64, 100, 256])
        fewest = len(padded_micro_batches(range(len(lengths)), lengths, budget))
        k = rng.randrange(fewest, fewest + 3)
        ours = padded_micro_batches(range(len(lengths)), lengths, budget, at_most=k)
        assert sorted(r for b in ours for r in b) == list(range(len(lengths))) and len(ours) <= k
        assert all(len(b) == 1 or len(b) * max(lengths[r] for r in b) <= budget for b in ours)
        feasible = [
            p
            for p in partitions(list(range(len(lengths))))
            if len(p) <= k and all(len(b) == 1 or len(b) * max(lengths[r] for r in b) <= budget for b in p)
        ]
        assert min(padded_cost(p, lengths, budget) - len(p) * budget / 16 for p in feasible) == pytest.approx(
            padded_cost(ours, lengths, budget) - len(ours) * budget / 16
        ), (lengths, budget, k, ours)


def test_ranks_in_lockstep_split_finer_instead_of_idling() -> None:
    """Every rank runs as many passes as the busiest one; a rank with rows to spare uses them all for a
    finer split (an empty pass only once it has one row per pass), never padding more than its own
    cheapest split would."""
    rng = random.Random(2)
    for _ in range(100):
        lengths = [rng.choice([rng.randrange(1, 40), rng.randrange(40, 130)]) for _ in range(rng.randrange(2, 24))]
        world, budget = rng.choice([2, 3]), rng.choice([100, 256])
        ranks = plan(lengths, world, budget, "padded")
        passes = len(ranks[0])
        assert all(len(rank) == passes for rank in ranks)
        assert sorted(r for rank in ranks for b in rank for r in b) == list(range(len(lengths)))
        for rank in ranks:
            rows = [r for b in rank for r in b]
            assert sum(1 for b in rank if b) == min(passes, len(rows))
            assert all(len(b) <= 1 or len(b) * max(lengths[r] for r in b) <= budget for b in rank)
            alone = padded_micro_batches(rows, lengths, budget)
            padded = sum(len(b) * max(lengths[r] for r in b) for b in rank if b)
            assert padded <= sum(len(b) * max(lengths[r] for r in b) for b in alone)


def test_a_long_sequence_does_not_pad_the_short_ones() -> None:
    """A long tail: one 512-token sample among 31 short ones (1851 tokens). Filling micro-batches
    greedily, longest first, put 7 shorter samples beside it, padded to 512: 4096 + 24 x 30 = 4816
    positions. The cheapest split: [512, 300], [100..50], the rest: 2344."""
    lengths = [512, 300, 100, 80, 70, 60, 55, 50] + [30 - i % 10 for i in range(24)]
    bins = padded_micro_batches(range(len(lengths)), lengths, 4096)
    assert bins[:2] == [[0, 1], [2, 3, 4, 5, 6, 7]] and len(bins) == 3
    assert sum(len(b) * max(lengths[r] for r in b) for b in bins) == 2 * 512 + 6 * 100 + 24 * 30


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
