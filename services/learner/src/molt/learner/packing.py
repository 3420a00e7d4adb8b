"""Which rank trains which samples, in which packed micro-batch, and the packed tensors themselves.

``plan`` splits a step's samples over data-parallel ranks by length (longest
first onto the least-loaded rank), then packs each rank's share into
micro-batches of at most ``budget`` tokens, balanced by tokens. Every rank
gets the same number of micro-batches, padding with empty ones: under FSDP
each forward/backward is a collective, so a rank with less work must still
take part. Every rank computes the same plan from the same global batch, so
no coordination is needed.

``pack`` concatenates a micro-batch's sequences into one ``[1, N]`` row with
position ids restarting at 0 for each sequence and no padding; transformers'
attention masks derive the block-diagonal causal mask from the restarts
(pinned by ``test_packed_logits_equal_separate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def _least_loaded(rows: Sequence[int], lengths: Sequence[int], bins: int) -> list[list[int]]:
    """Longest-processing-time greedy: each row, longest first, onto the bin with the fewest tokens."""
    loads = [0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        target = min(range(bins), key=lambda b: (loads[b], b))
        out[target].append(row)
        loads[target] += lengths[row]
    return out


def micro_batches(rows: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Packs ``rows`` into the fewest token-balanced bins of at most ``budget`` tokens each.

    A sequence longer than the budget gets a bin of its own (it cannot be split).
    """
    if not rows:
        return []
    total = sum(lengths[r] for r in rows)
    bins = max(1, -(-total // budget))
    while True:
        packed = _least_loaded(rows, lengths, bins)
        over = [b for b in packed if len(b) > 1 and sum(lengths[r] for r in b) > budget]
        if not over:
            return [b for b in packed if b]
        bins += 1


def plan(lengths: Sequence[int], world_size: int, budget: int) -> list[list[list[int]]]:
    """``plan[rank][micro]`` = sample indices; every rank has the same number of micro-batches (some empty)."""
    shares = _least_loaded(range(len(lengths)), lengths, world_size)
    per_rank = [micro_batches(share, lengths, budget) for share in shares]
    count = max(1, *(len(m) for m in per_rank))
    return [m + [[] for _ in range(count - len(m))] for m in per_rank]


@dataclass(frozen=True)
class Packed:
    """One packed micro-batch: ``[1, N]`` inputs and where each sequence's predictions are."""

    input_ids: Tensor  # [1, N] int64
    position_ids: Tensor  # [1, N] int64, restarting at 0 per sequence
    predict_at: Tensor  # [P] int64: positions whose next token is in the same sequence
    targets: Tensor  # [P] int64: that next token
    row: Tensor  # [P] int64: the sequence (0..B-1 within this micro-batch) of each prediction
    column: Tensor  # [P] int64: the index on that sequence's next-token axis
    width: int  # T: the longest sequence's next-token axis


def pack(sequences: Sequence[Tensor]) -> Packed:
    """Concatenates 1-D token tensors (each >= 1 token) into one packed row."""
    lengths = torch.tensor([int(s.numel()) for s in sequences], dtype=torch.int64)
    input_ids = torch.cat(list(sequences))
    starts = torch.cumsum(lengths, 0) - lengths
    seq_of_token = torch.repeat_interleave(torch.arange(len(sequences)), lengths)
    position = torch.arange(input_ids.numel()) - starts[seq_of_token]
    last = (position == lengths[seq_of_token] - 1).nonzero().squeeze(1)
    keep = torch.ones(input_ids.numel(), dtype=torch.bool)
    keep[last] = False
    predict_at = keep.nonzero().squeeze(1)
    return Packed(
        input_ids=input_ids[None],
        position_ids=position[None],
        predict_at=predict_at,
        targets=input_ids[predict_at + 1],
        row=seq_of_token[predict_at],
        column=position[predict_at],
        width=int(lengths.max()) - 1,
    )
