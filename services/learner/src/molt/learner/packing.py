"""Which rank trains which samples, in which micro-batch, and the micro-batch tensors themselves.

``plan`` splits a step's samples over data-parallel ranks by length (longest
first onto the least-loaded rank), then groups each rank's share into
micro-batches of at most ``budget`` tokens. Every rank gets the same number of
micro-batches, padding with empty ones: under FSDP each forward/backward is a
collective, so a rank with less work must still take part. Every rank computes
the same plan from the same global batch, so no coordination is needed.
Two layouts of a micro-batch (``[learner] micro_batch_layout``): ``packed``
(``pack``, one row, no padding) and ``padded`` (``pad``, one sequence per row);
``auto`` picks ``padded`` (``resolve_layout`` says why).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

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


def padded_micro_batches(
    rows: Sequence[int], lengths: Sequence[int], budget: int, at_most: int | None = None
) -> list[list[int]]:
    """Splits ``rows``, longest first, into runs whose padded size (count x longest) fits ``budget``,
    choosing the cuts that minimise the step's padded tokens plus a fixed cost per micro-batch
    (``budget / 16`` tokens: a forward and a backward more). A sequence longer than the budget gets a
    micro-batch of its own. With ``at_most``: the fewest padded tokens in at most that many
    micro-batches, with no cost per micro-batch (ranks in lockstep pay for ``at_most`` passes anyway).

    Dynamic programming over the sorted order (a run of consecutive lengths is never worse than any
    other grouping of the same sizes). Filling each micro-batch greedily instead lets one long
    sequence pad every short one beside it to its length: with a long tail of response lengths
    most of a step's compute went to padding.
    """
    order = sorted(rows, key=lambda r: (-lengths[r], r))
    n = len(order)

    def runs(i: int) -> range:  # the run lengths that may start at order[i]
        return range(1, max(1, min(budget // max(lengths[order[i]], 1), n - i)) + 1)

    def padded(i: int, k: int) -> int:
        return k * lengths[order[i]]

    ends = [n] * n  # ends[i]: where the micro-batch starting at order[i] ends
    if at_most is None:
        overhead = budget / 16
        best = [0.0] * (n + 1)  # best[i]: the cost of order[i:]
        for i in range(n - 1, -1, -1):
            best[i], ends[i] = min((padded(i, k) + overhead + best[i + k], i + k) for k in runs(i))
    else:
        inf = float("inf")
        # least[p][i]: the fewest padded tokens of order[i:] in at most p micro-batches
        least = [[inf] * n + [0.0] for _ in range(at_most + 1)]
        cuts = [[n] * (n + 1) for _ in range(at_most + 1)]
        for p in range(1, at_most + 1):
            for i in range(n - 1, -1, -1):
                least[p][i], cuts[p][i] = min((padded(i, k) + least[p - 1][i + k], i + k) for k in runs(i))
        if n and least[at_most][0] == inf:
            raise ValueError(f"{n} sequences do not fit {at_most} micro-batches of {budget} padded tokens")
        p, i = at_most, 0
        while i < n:
            ends[i] = cuts[p][i]
            i, p = cuts[p][i], p - 1
    out: list[list[int]] = []
    start = 0
    while start < n:
        out.append(order[start : ends[start]])
        start = ends[start]
    return out


Layout = Literal["packed", "padded"]


def resolve_layout(requested: str) -> Layout:
    """``auto`` is ``padded``: with SDPA a packed row gets a dense block-diagonal mask, so its attention
    costs (total tokens)^2 instead of the sum of each sequence's length^2 (and loses the flash kernel on a
    GPU); bench/RESULTS.md compares the two per step."""
    return "packed" if requested == "packed" else "padded"


def plan(lengths: Sequence[int], world_size: int, budget: int, layout: Layout = "packed") -> list[list[list[int]]]:
    """``plan[rank][micro]`` = sample indices; every rank has the same number of micro-batches (some empty).

    Ranks step through their micro-batches in lockstep (each is a collective under FSDP), so with the
    padded layout a rank that needs fewer micro-batches than the busiest one spends the passes it
    would otherwise run empty on a finer split: less padding, no idle pass while it has rows to split.
    """
    shares = _least_loaded(range(len(lengths)), lengths, world_size)
    group = micro_batches if layout == "packed" else padded_micro_batches
    per_rank = [group(share, lengths, budget) for share in shares]
    count = max(1, *(len(m) for m in per_rank))
    if layout == "padded" and world_size > 1:
        per_rank = [padded_micro_batches(share, lengths, budget, at_most=count) for share in shares]
    return [m + [[] for _ in range(count - len(m))] for m in per_rank]


@dataclass(frozen=True)
class Packed:
    """One micro-batch of either layout: ``[R, L]`` inputs and where each sequence's predictions are.

    Only the inputs are built eagerly; the prediction indices are computed on first use, which the
    forward reaches after it has queued the model on the device, so on a GPU building them overlaps it.
    """

    input_ids: Tensor  # [R, L] int64 ([1, N] packed)
    position_ids: Tensor | None  # [1, N] int64 restarting at 0 per sequence (packed); None = 0..L-1 per row
    lengths: tuple[int, ...]  # tokens of each sequence, in order
    packed: bool  # one row of concatenated sequences (else one sequence per row)

    @property
    def width(self) -> int:
        """T: the longest sequence's next-token axis."""
        return max(self.lengths) - 1

    @cached_property
    def _predictions(self) -> tuple[Tensor, Tensor, Tensor]:
        lengths = torch.tensor(self.lengths)
        predicted = lengths - 1  # next-token predictions of each sequence
        row = torch.repeat_interleave(torch.arange(len(self.lengths)), predicted)
        column = torch.cat([torch.arange(n) for n in predicted.tolist()])
        if self.packed:
            starts = torch.cumsum(lengths, 0) - lengths
            return starts[row] + column, row, column
        return row * self.input_ids.shape[1] + column, row, column

    @property
    def predict_at(self) -> Tensor:
        """[P] int64: flat indices into ``[R * L]`` whose next token is in the same sequence."""
        return self._predictions[0]

    @property
    def row(self) -> Tensor:
        """[P] int64: the sequence (0..B-1 within this micro-batch) of each prediction."""
        return self._predictions[1]

    @property
    def column(self) -> Tensor:
        """[P] int64: the index on that sequence's next-token axis."""
        return self._predictions[2]


def pack(sequences: Sequence[Tensor]) -> Packed:
    """Concatenates 1-D token tensors (each >= 1 token) into one packed ``[1, N]`` row, position ids
    restarting at 0 for each sequence: transformers derives the block-diagonal causal mask from the
    restarts (pinned by ``test_packed_logits_equal_separate``). No token is wasted, but the explicit
    mask keeps SDPA off its flash kernel. Micro-batches are balanced by tokens (``micro_batches``)."""
    lengths = tuple(int(s.numel()) for s in sequences)
    position = torch.cat([torch.arange(n) for n in lengths])
    return Packed(torch.cat(list(sequences))[None], position[None], lengths, packed=True)


def pad(sequences: Sequence[Tensor]) -> Packed:
    """One 1-D token tensor (>= 1 token) per row of ``[R, L]``, right-padded with token 0 (never scored).
    Plain causal attention needs no mask (a padding token comes after every real token of its row), so
    SDPA runs its flash kernel. The budget counts the padding (``R x L <= budget``) and the split
    minimises it (``padded_micro_batches``): sequences of similar length share a micro-batch."""
    lengths = tuple(int(s.numel()) for s in sequences)
    input_ids = torch.zeros((len(sequences), max(lengths)), dtype=torch.int64)
    for row, sequence in enumerate(sequences):
        input_ids[row, : lengths[row]] = sequence
    return Packed(input_ids, None, lengths, packed=False)


def layout_of(layout: Layout) -> Callable[[Sequence[Tensor]], Packed]:
    """The function that builds a micro-batch of ``layout``."""
    return pack if layout == "packed" else pad
