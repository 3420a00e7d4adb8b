"""The trainable policy and one optimizer step: model, optional frozen reference, AdamW, LR schedule.

``Trainer.train_step(batch)`` runs the RL step on the global batch (every rank
gets the same ``StepBatch`` and trains its share from ``packing.plan``):
advantages and aggregation weights over the whole step, then per packed
micro-batch a forward, the loss of ``objective.micro_loss`` and a backward
(gradients accumulate), then grad-norm clipping, AdamW and the scheduler.
With more than one rank the model is sharded with FSDP2 (``fully_shard`` per
decoder layer, then the root); the reference model is a full frozen copy per rank.

The weights after step ``s`` are policy version ``s``: the weight-broadcaster
publishes them through the loop's ``on_step`` hook after every step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from molt.algos.aggregation import masked_mean, token_mean
from molt.learner.batch import Sample, StepBatch, batch_stats, padded
from molt.learner.config import LearnerSettings, OptimizerSettings
from molt.learner.logprobs import token_logprobs
from molt.learner.objective import MicroInputs, micro_loss, step_advantages, step_row_weights
from molt.learner.packing import pack, plan
from molt.learner.ranks import SINGLE, RankInfo, device_for

# (micro-batch rows, their logprobs, their entropies) -> (loss to backpropagate, stats as token means)
MicroLoss = Callable[[list[int], Tensor, Tensor | None], tuple[Tensor, dict[str, Tensor]]]


def load_policy(path: Path, device: torch.device, *, trainable: bool) -> PreTrainedModel:
    """The causal LM at ``path``: float32 on CPU, bfloat16 on GPU; ``trainable=False`` freezes it (reference)."""
    hf_logging.disable_progress_bar()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def shard(model: PreTrainedModel, world_size: int, device: torch.device) -> None:
    """FSDP2: each decoder layer is a unit (its weights gathered only while it runs), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def lr_factor(step: int, opt: OptimizerSettings) -> float:
    """Linear warm-up over ``warmup_steps`` then cosine from 1 to ``min_lr_ratio`` at ``total_steps``."""
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    progress = min(1.0, (step - opt.warmup_steps) / max(1, opt.total_steps - opt.warmup_steps))
    return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Owns the policy, the reference model, the optimizer and the schedule of one rank."""

    def __init__(self, settings: LearnerSettings, rank: RankInfo = SINGLE) -> None:
        self.settings = settings
        self.rank = rank
        self.device = device_for(rank)
        torch.manual_seed(settings.seed)
        self.model = load_policy(settings.model_path, self.device, trainable=True)
        self.vocab_size = int(self.model.config.vocab_size)
        if rank.distributed:
            shard(self.model, rank.world_size, self.device)
        needs_reference = settings.algorithm.kl_coef > 0
        self.reference = load_policy(settings.model_path, self.device, trainable=False) if needs_reference else None
        opt = settings.optimizer
        # On CUDA the fused kernel updates every parameter in one pass; on CPU torch's default (for-loop).
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            fused=True if self.device.type == "cuda" else None,
        )
        self.scheduler = LambdaLR(self.optimizer, lambda step: lr_factor(step, opt))
        self.step = 0

    @property
    def policy_version(self) -> int:
        return self.step

    def train_step(self, batch: StepBatch) -> dict[str, float]:
        """One RL optimizer step on the global batch; returns the step's metrics (identical on every rank)."""
        started = time.monotonic()
        before = batch_stats(batch, self.policy_version)
        algo = self.settings.algorithm
        advantages = step_advantages(batch, algo)
        weights = step_row_weights(batch, algo)
        samples = batch.samples

        def loss_of(rows: list[int], logprobs: Tensor, entropy: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
            width = logprobs.shape[1]
            inputs = MicroInputs(
                logprobs=logprobs,
                rollout_logprobs=padded([samples[r].rollout_logprobs for r in rows], width).to(self.device),
                advantages=advantages[rows, :width].to(self.device),
                loss_mask=padded([samples[r].loss_mask for r in rows], width).to(self.device),
                weights=weights[rows].to(self.device),
                entropy=entropy,
                ref_logprobs=self._reference_logprobs(samples, rows),
            )
            return micro_loss(inputs, algo, float(self.rank.world_size))

        objective, stats = self._accumulate(samples, loss_of, self.settings.rollout.temperature, entropy=True)
        metrics = {**before, **stats, "loss/objective": objective, **self._optimizer_step()}
        metrics.update(advantage_stats(advantages, padded([s.loss_mask for s in samples])))
        elapsed = time.monotonic() - started
        tokens = sum(s.length for s in samples)
        metrics.update({"step_seconds": elapsed, "tokens": float(tokens), "tokens_per_s": tokens / elapsed})
        return metrics

    def _reference_logprobs(self, samples: Sequence[Sample], rows: list[int]) -> Tensor | None:
        if self.reference is None:
            return None
        with torch.no_grad():
            logprobs, _ = token_logprobs(
                self.reference, pack([samples[r].input_ids for r in rows]), len(rows), self.settings.rollout.temperature
            )
        return logprobs

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One supervised step: the token mean of ``-log p`` over every loss token of the step (all
        micro-batches and ranks), at temperature 1 (the data was not sampled)."""
        total = float(sum(s.loss_tokens for s in samples))  # samples: the global batch, so the global count

        def loss_of(rows: list[int], logprobs: Tensor, entropy: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
            mask = padded([samples[r].loss_mask for r in rows], logprobs.shape[1]).to(self.device)
            nll = -logprobs
            loss = token_mean(nll, mask, total) * self.rank.world_size
            return loss, {"loss/nll": masked_mean(nll.detach(), mask).double()}

        objective, stats = self._accumulate(samples, loss_of, 1.0, entropy=False)
        return {**stats, "loss/objective": objective, **self._optimizer_step()}

    def _accumulate(
        self, samples: Sequence[Sample], loss_of: MicroLoss, temperature: float, *, entropy: bool
    ) -> tuple[float, dict[str, float]]:
        """Forward + backward of this rank's micro-batches; returns the summed loss and token-mean stats of
        the whole step (reduced over ranks). The sums stay on the device until the end of the step: the loop
        adds no host sync per micro-batch of its own (the objective's finiteness checks still sync)."""
        my_plan = plan([s.length for s in samples], self.rank.world_size, self.settings.micro_batch_tokens)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, Tensor] = {}
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        for rows in my_plan[self.rank.rank]:
            if not rows:
                self._idle_backward()
                continue
            packed = pack([samples[r].input_ids for r in rows])
            logprobs, entropies = token_logprobs(
                self.model,
                packed,
                len(rows),
                temperature,
                entropy=entropy,
                entropy_grad=self.settings.algorithm.entropy_coef > 0,
            )
            loss, stats = loss_of(rows, logprobs, entropies)
            loss.backward()
            count = float(sum(samples[r].loss_tokens for r in rows))
            total += loss.detach().double() / self.rank.world_size
            tokens += count
            for name, value in stats.items():
                sums[name] = sums.get(name, torch.zeros((), dtype=torch.float64, device=self.device)) + value * count
        names = sorted(sums)
        reduced = self._sum_over_ranks(torch.stack([total, tokens, *(sums[n] for n in names)]))
        count = float(reduced[1].clamp(min=1))
        return float(reduced[0]), {n: float(v) / count for n, v in zip(names, reduced[2:], strict=True)}

    def _idle_backward(self) -> None:
        """A zero-gradient forward/backward: this rank has no samples for this micro-batch, but FSDP's
        all-gathers and reduce-scatters are collectives every rank must join."""
        one = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
        logits = self.model(input_ids=one, position_ids=one, use_cache=False).logits
        (logits.sum() * 0.0).backward()

    def _sum_over_ranks(self, values: Tensor) -> Tensor:
        if self.rank.distributed:
            values = values.to(self.device)
            dist.all_reduce(values)
        return values.cpu()

    def _optimizer_step(self) -> dict[str, float]:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.settings.optimizer.max_grad_norm)
        full_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"grad_norm": float(full_norm), "lr": lr}


def advantage_stats(advantages: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """Mean, std, min and max of the advantages over the step's loss tokens."""
    values = advantages[loss_mask.bool()].double()
    if not values.numel():
        return {}
    return {
        "advantage/mean": float(values.mean()),
        "advantage/std": float(values.std(unbiased=False)),
        "advantage/min": float(values.min()),
        "advantage/max": float(values.max()),
    }
