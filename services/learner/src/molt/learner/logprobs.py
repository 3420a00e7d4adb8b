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

import torch
from torch import Tensor, nn

from molt.algos.losses import entropy_from_logits
from molt.learner.packing import Packed


def _grid(values: Tensor, packed: Packed, rows: int) -> Tensor:
    grid = torch.zeros((rows, packed.width), dtype=values.dtype, device=values.device)
    return grid.index_put((packed.row.to(values.device), packed.column.to(values.device)), values)


def token_logprobs(
    model: nn.Module,
    packed: Packed,
    rows: int,
    temperature: float,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(logits / temperature)`` of each next token, ``[rows, T]`` float32, and optionally
    the entropy of each next-token distribution (same grid). Gradients flow through the logprobs, and
    through the entropy only with ``entropy_grad`` (a bonus term; for logging it is detached).

    Only predicted positions are scored, so the ``[P, V]`` float32 logits are the peak memory.
    """
    device = next(model.parameters()).device
    out = model(
        input_ids=packed.input_ids.to(device),
        position_ids=_positions(packed, device),
        use_cache=False,  # with a cache transformers ignores the packed position ids
    )
    scaled = out.logits.flatten(0, 1)[packed.predict_at.to(device)].float() / temperature
    targets = packed.targets.to(device)[:, None]
    logprobs = scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    entropies = None
    if entropy:
        entropies = _grid(entropy_from_logits(scaled if entropy_grad else scaled.detach()), packed, rows)
    return _grid(logprobs, packed, rows), entropies


def token_values(critic: nn.Module, packed: Packed, rows: int) -> Tensor:
    """The critic's value of each next-token position, ``[rows, T]`` float32 (``V[b, k]``: the state in
    which token k + 1 is sampled, in line with the logprobs and the loss mask). Gradients flow."""
    device = next(critic.parameters()).device
    values = critic(packed.input_ids.to(device), _positions(packed, device))
    return _grid(values.flatten()[packed.predict_at.to(device)].float(), packed, rows)


def _positions(packed: Packed, device: torch.device) -> Tensor | None:
    return None if packed.position_ids is None else packed.position_ids.to(device)
