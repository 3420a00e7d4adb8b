"""The critic of ``gae``: the policy's transformer body with a scalar value head.

The body starts from ``[learner.critic] model_path`` (default: the policy's own
weights, as PPO for LLMs usually does) and the head from zeros, so every value
starts at 0 and the first step's advantages are the discounted rewards. Each
rank holds a full replica and the trainer sums its gradients over ranks by hand
(no FSDP): every rank computes the values of the whole step anyway, because GAE
whitens its advantages over the whole step. ``critic_values`` scores a step
before the policy's update, ``critic_update`` then trains the critic on it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PreTrainedModel

from molt.algos.losses import value_loss
from molt.learner.batch import Sample, padded
from molt.learner.config import CriticSettings
from molt.learner.logprobs import token_values
from molt.learner.packing import Packed
from molt.learner.ranks import to_device

log = logging.getLogger(__name__)
MicroBatches = Iterable[tuple[list[int], Packed]]  # (rows of the step, their micro-batch tensors)


class Critic(nn.Module):
    """``V(prefix)`` for every position of a micro-batch: ``head(body(ids)[t])``, float32."""

    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_causal_lm(cls, model: PreTrainedModel) -> Critic:
        """The causal LM's decoder (its ``base_model``) under a new value head; the LM head is dropped."""
        body = model.base_model
        critic = cls(body, int(model.config.hidden_size))
        return critic.to(next(body.parameters()).device)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """``[R, L]`` token ids and position ids (packed; None = 0..L-1 per row) in, ``[R, L]`` float32 values out."""
        hidden = self.body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.head(hidden.float()).squeeze(-1)


def critic_values(critic: Critic, samples: Sequence[Sample], micro_batches: MicroBatches) -> Tensor:
    """The critic's values of every sample of the step, ``[S, T]`` float32 on the CPU (no gradient)."""
    values = torch.zeros((len(samples), max(s.length for s in samples) - 1))
    with torch.no_grad():
        for rows, micro in micro_batches:
            grid = token_values(critic, micro, len(rows)).cpu()
            values[rows, : grid.shape[1]] = grid
    return values


def critic_update(
    critic: Critic,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    settings: CriticSettings,
    samples: Sequence[Sample],
    old_values: Tensor,
    returns: Tensor,
    micro_batches: MicroBatches,
    *,
    device: torch.device,
    distributed: bool,
) -> dict[str, float]:
    """One critic update on the clipped value loss, a token mean over every loss token of the step;
    ``micro_batches``: this rank's share of the data-parallel plan; the gradients are summed over ranks."""
    total = float(sum(s.loss_tokens for s in samples))
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # value error, clip fraction, tokens
    for rows, micro in micro_batches:
        values = token_values(critic, micro, len(rows))
        width = values.shape[1]
        mask = to_device(padded([samples[r].loss_mask for r in rows], width), device)
        per_token, stats = value_loss(
            values,
            to_device(old_values[rows, :width], device),
            to_device(returns[rows, :width].float(), device),
            mask,
            clip=settings.value_clip,
        )
        (per_token.sum() / total).backward()
        count = mask.sum().double()
        sums += torch.stack(
            [stats["value_error"].double() * count, stats["value_clip_fraction"].double() * count, count]
        )
    params = list(critic.parameters())
    if distributed:
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)
        dist.all_reduce(sums)
    norm = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    if torch.isfinite(norm):  # the same on every rank (the gradients are summed over ranks)
        optimizer.step()
        scheduler.step()
    else:  # the policy's step is applied already: skip the critic's alone, loudly
        log.warning("critic update skipped: its gradient norm is not finite", extra={"norm": float(norm)})
    optimizer.zero_grad(set_to_none=True)
    error, clipped, tokens = (float(v) for v in sums.cpu())
    mask = padded([s.loss_mask for s in samples]).bool()
    return {
        "critic/value_error": error / max(tokens, 1.0),
        "critic/clip_fraction": clipped / max(tokens, 1.0),
        "critic/value_mean": float(old_values[:, : mask.shape[1]][mask].mean()) if mask.any() else 0.0,
        "critic/grad_norm": float(norm),
        "critic/lr": lr,
    }
