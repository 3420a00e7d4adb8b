"""Rollout routing replay in the RL step: the policy's forward of each micro-batch uses the engine's experts.

With ``[rollout] routing_replay`` the trainer checks at start that replay can run (``replay_shape``) and
builds one ``StepReplay`` per RL step. Its ``forward`` wraps the policy's forward of a micro-batch in
``routing.routed`` with the samples' routing (``Sample.routing``, laid out by ``micro_routing``), so the
logprobs that enter the loss, and ``vllm_kl``, are those of the network that sampled the tokens. Per step
it reports ``routing_agreement`` and, with ``[learner] compare_unreplayed``, ``vllm_kl_unreplayed``: the
``vllm_kl`` of the same micro-batches scored by the learner's own routing (one extra forward without
gradient each). The reference and teacher forwards do not replay (docs/moe.md says why).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from molt.algos.importance import is_weights
from molt.core.errors import ConfigError
from molt.learner.batch import Sample, padded
from molt.learner.logprobs import Head, token_logprobs
from molt.learner.packing import Packed
from molt.learner.ranks import to_device
from molt.learner.routing import agreeing_cells, micro_routing, moe_routers, routed


def replay_shape(model: nn.Module, backend: str) -> tuple[int, int]:
    """(decoder layers, experts per token): the shape of the routing each sample must carry. A
    ``ConfigError`` where replay cannot run: a dense model or an unknown router (``moe_routers``), and
    the AutoModel backend, whose own MoE implementation has none of the routers ``routed`` hooks."""
    if backend == "automodel":
        raise ConfigError(
            "rollout.routing_replay: AutoModel's MoE layers are not hooked for replay yet; use backend = torch"
        )
    router = next(iter(moe_routers(model).values()))
    return int(model.config.num_hidden_layers), int(router.top_k)


class StepReplay:
    """One RL step's replay on this rank: the routing of each micro-batch, and sums for the step's stats
    kept on the device (no host sync per micro-batch) until ``stats`` reduces them over the ranks."""

    def __init__(
        self, model: nn.Module, samples: Sequence[Sample], temperature: float, head: Head, *, compare: bool
    ) -> None:
        self.model = model
        self.samples = samples
        self.temperature = temperature
        self.head = head
        self.compare = compare
        self.device = next(model.parameters()).device
        # agreeing cells, compared cells, vllm_kl_unreplayed * loss tokens, loss tokens
        self.sums = torch.zeros(4, dtype=torch.float64, device=self.device)

    def _routing(self, row: int) -> Tensor:
        routing = self.samples[row].routing
        if routing is None:  # build_group drops such samples under replay
            raise ValueError(f"sample {self.samples[row].trajectory_id} carries no routing to replay")
        return routing

    @contextmanager
    def forward(self, rows: list[int], micro: Packed) -> Iterator[None]:
        """The policy's forward of ``rows`` (laid out as ``micro``) inside the block uses their routing.
        Before it, with ``compare``, the same micro-batch without replay and without gradient; after it,
        the routers' own top-k (given the replayed inputs of each layer) is compared with the engine's."""
        if self.compare:
            self._unreplayed(rows, micro)
        given = micro_routing(micro, [self._routing(r) for r in rows])
        with routed(self.model, given) as routing:
            yield
        assert routing.given is not None  # the replayed routing, already on the forward's device
        agreeing, compared = agreeing_cells(routing.own, routing.given)
        self.sums[0] += agreeing
        self.sums[1] += compared

    def _unreplayed(self, rows: list[int], micro: Packed) -> None:
        """``vllm_kl`` of the rows scored by the learner's own routing, as ``is_weights`` defines it."""
        with torch.no_grad():
            logprobs, _ = token_logprobs(self.model, micro, len(rows), self.temperature, head=self.head)
        width = logprobs.shape[1]
        rollout = to_device(padded([self.samples[r].rollout_logprobs for r in rows], width), self.device)
        mask = to_device(padded([self.samples[r].loss_mask for r in rows], width), self.device)
        _, stats = is_weights(logprobs, rollout, mask, level="off", mode="mask")
        tokens = float(sum(self.samples[r].loss_tokens for r in rows))
        self.sums[2] += stats["vllm_kl"].double() * tokens
        self.sums[3] += tokens

    def idle(self) -> None:
        """On a rank without rows in this micro-batch: the extra forward busy ranks run with ``compare``,
        because under FSDP each forward's all-gathers are collectives every rank must join."""
        if self.compare:
            one = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
            with torch.no_grad():
                self.model(input_ids=one, position_ids=one, use_cache=False)

    def stats(self, sum_over_ranks: Callable[[Tensor], Tensor]) -> dict[str, float]:
        """``routing_agreement`` (agreeing over compared cells of the whole step) and, with ``compare``,
        ``vllm_kl_unreplayed`` (a loss-token mean, as ``vllm_kl``); a value with nothing to average is left out."""
        agreeing, compared, kl, tokens = (float(v) for v in sum_over_ranks(self.sums))
        stats = {"routing_agreement": agreeing / compared} if compared else {}
        if self.compare and tokens:
            stats["vllm_kl_unreplayed"] = kl / tokens
        return stats
