"""The forwards: per-token logprobs (and entropy) of a micro-batch (packed or padded), and the critic's
values, on the ``[B, T]`` grid.

The engine reports logprobs *after temperature* (vLLM's processed logprobs), so
the learner divides the logits by the rollout temperature before the softmax;
with any other temperature every IS ratio would be off by a systematic factor.
Results are scattered from the micro-batch's predicted positions back to ``[B, T]`` (next-token
axis, 0 on padding) because the sequence-level losses and IS units in
``molt.algos`` work per row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from molt.algos.checks import check_finite
from molt.algos.losses import entropy_from_logprobs
from molt.learner.packing import Packed
from molt.learner.ranks import to_device

# (logits [N, V], targets [N], temperature, entropy, entropy_grad) -> (logprobs [N], entropy [N] or None)
Head = Callable[[Tensor, Tensor, float, bool, bool], tuple[Tensor, Tensor | None]]


def next_token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float, entropy: bool, entropy_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """``log p(target)`` with ``log p = log_softmax(logits / temperature)`` in float32, ``[N, V] -> [N]``,
    and with ``entropy`` ``H = -sum_v p_v log p_v`` of the same distribution (one ``log_softmax`` for
    both; gradients through ``H`` only with ``entropy_grad``). Pure tensor math with no host sync, so
    ``compile = true`` can hand it to ``torch.compile``, which fuses the float32 passes over ``[N, V]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, targets[:, None]).squeeze(-1)
    if not entropy:
        return picked, None
    source = logp if entropy_grad else logp.detach()
    return picked, entropy_from_logprobs(source)


def compiled_head() -> Head:
    """``next_token_logprobs`` through ``torch.compile`` (dynamic shapes: micro-batches vary in size)."""
    return torch.compile(next_token_logprobs, dynamic=True)  # type: ignore[return-value]


def _cells(packed: Packed, device: torch.device) -> tuple[Tensor, Tensor]:
    """Where each prediction goes on the ``[rows, T]`` grid: (row, column) on ``device``."""
    return to_device(packed.row, device), to_device(packed.column, device)


def _grid(values: Tensor, cells: tuple[Tensor, Tensor], rows: int, width: int) -> Tensor:
    grid = torch.zeros((rows, width), dtype=values.dtype, device=values.device)
    return grid.index_put(cells, values)


def token_logprobs(
    model: nn.Module,
    packed: Packed,
    rows: int,
    temperature: float,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    head: Head = next_token_logprobs,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(logits / temperature)`` of each next token, ``[rows, T]`` float32, and optionally
    the entropy of each next-token distribution (same grid). Gradients flow through the logprobs, and
    through the entropy only with ``entropy_grad`` (a bonus term; for logging it is detached).

    Every position of the micro-batch, padding included, is scored against the token after it; those
    that predict nothing (a sequence's last token, padding) are dropped afterwards, a gather of
    ``[R * L]`` scalars, so no ``[P, V]`` copy of the logits is made, nor its scatter back in the
    backward. Float32 ``[R * L, V]`` tensors (the log-softmax, with the entropy its exponential and
    product) are the peak memory, bounded by the micro-batch budget. A non-finite entropy raises
    ``ValueError`` (deferred inside ``molt.algos.checks.deferred_checks``).
    """
    device = next(model.parameters()).device
    input_ids = to_device(packed.input_ids, device)
    out = model(
        input_ids=input_ids,
        position_ids=_positions(packed, device),
        use_cache=False,  # with a cache transformers ignores the packed position ids
    )
    targets = torch.roll(input_ids.flatten(), -1)  # the next token of each position (wrapping where unused)
    picked, entropies = head(out.logits.flatten(0, 1), targets, temperature, entropy, entropy_grad)
    at, cells = to_device(packed.predict_at, device), _cells(packed, device)
    if entropies is not None:
        entropies = _grid(entropies[at], cells, rows, packed.width)
        check_finite(entropy=entropies)
    return _grid(picked[at], cells, rows, packed.width), entropies


def token_values(critic: nn.Module, packed: Packed, rows: int) -> Tensor:
    """The critic's value of each next-token position, ``[rows, T]`` float32 (``V[b, k]``: the state in
    which token k + 1 is sampled, in line with the logprobs and the loss mask). Gradients flow."""
    device = next(critic.parameters()).device
    values = critic(to_device(packed.input_ids, device), _positions(packed, device))
    at = to_device(packed.predict_at, device)
    return _grid(values.flatten()[at].float(), _cells(packed, device), rows, packed.width)


def _positions(packed: Packed, device: torch.device) -> Tensor | None:
    return None if packed.position_ids is None else to_device(packed.position_ids, device)
