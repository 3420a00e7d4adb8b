"""The critic of ``gae``: the policy's transformer body with a scalar value head.

The body starts from ``[learner.critic] model_path`` (default: the policy's own
weights, as PPO for LLMs usually does) and the head from zeros, so every value
starts at 0 and the first step's advantages are the discounted rewards. Each
rank holds a full replica and the trainer sums its gradients over ranks by hand
(no FSDP): every rank computes the values of the whole step anyway, because GAE
whitens its advantages over the whole step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel


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
