"""PPO's mini-batches and epochs (several optimizer steps on one consumed batch, so that the ratio
leaves 1 and clipping binds), and the scoring passes they and the KL reference need.

With ``[learner] mini_batches = M`` and ``epochs = E`` one consumed batch makes M x E optimizer steps.
Before the first, one forward without gradient scores every sample with the weights the batch found:
the proximal policy pi_prox. Advantages A come once, from the whole batch. Then, epoch after epoch,
the M mini-batches (whole groups, about equal in tokens, in an order drawn from the seed, the step and
the epoch) each make one optimizer step on, per loss token t,

    r_t    = pi_theta(a_t) / pi_prox(a_t)               the surrogate's ratio (clipped: PPO, GSPO, CISPO)
    w_t    = IS(pi_prox(a_t) / pi_behav(a_t))           importance weight against the engine's sampling
    loss_t = w_t * surrogate(r_t, A_t) (+ kl_coef * KL(pi_theta || pi_ref)_t) (- entropy_coef * H_t)

(decoupled PPO: pi_behav is the rollout's logprobs, the policy that sampled; pi_prox the learner's
weights at the batch's start), reduced with the mini-batch's own global token mean over its
micro-batches and ranks. With M = E = 1 none of this runs (``Trainer.train_step``): there pi_prox is
pi_theta detached, the same values, so the ratio is 1 and only the IS weights act.

One consumed batch stays one learner step: ``max_steps``, ``checkpoint_every``, ``refit_every``, the
LR schedule and the policy version count consumed batches; every optimizer step of a batch uses its LR.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from molt.algos.aggregation import masked_mean
from molt.algos.kl import kl_penalty
from molt.learner.batch import Sample, StepBatch, assemble, padded
from molt.learner.logprobs import token_logprobs
from molt.learner.lora import disabled
from molt.learner.objective import MicroInputs, distill_advantages, micro_loss, step_row_weights
from molt.learner.replay import StepReplay

if TYPE_CHECKING:
    from molt.learner.trainer import HostInputs, MicroLoss, Trainer

log = logging.getLogger(__name__)


def split(batch: StepBatch, count: int) -> list[list[int]]:
    """The batch's rows in at most ``count`` mini-batches of whole groups, in order, about equal in tokens
    (a group's samples share their advantages' baseline and the aggregation's group weights)."""
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(batch.group_ids.tolist()):
        groups.setdefault(group, []).append(row)
    members = list(groups.values())
    count = min(count, len(members))
    total = sum(s.length for s in batch.samples)
    parts: list[list[int]] = []
    current: list[int] = []
    placed = 0
    for index, rows in enumerate(members):
        tokens = sum(batch.samples[r].length for r in rows)
        to_open = count - len(parts) - 1  # parts still to come after the current one
        # Full once this group would end nearer the next boundary outside the current part than inside it.
        full = placed + tokens / 2 > total * (len(parts) + 1) / count
        if current and to_open > 0 and (full or len(members) - index <= to_open):
            parts.append(current)
            current = []
        current.extend(rows)
        placed += tokens
    parts.append(current)
    return parts


def scored_logprobs(trainer: Trainer, samples: list[Sample]) -> list[Tensor]:
    """pi_prox (or, adapters off, the LoRA reference): each sample's logprobs on its next-token axis
    (float32, CPU) under the weights now, from one forward without gradient over this rank's share
    (every rank's forwards in step, as FSDP needs), then gathered from every rank."""
    temperature = trainer.settings.rollout.temperature
    replay = None
    if trainer.routing_shape is not None:
        replay = StepReplay(trainer.model, samples, temperature, trainer.head, compare=False)
    mine: dict[int, Tensor] = {}
    training = trainer.model.training
    trainer.model.eval()  # no dropout (LoRA's): a score, not a sample of the training forward
    try:
        with torch.no_grad():
            for rows in trainer._plan(samples, trainer.rank.world_size)[trainer.rank.rank]:
                if not rows:
                    if replay is not None:
                        replay.idle()
                    one = torch.zeros((1, 1), dtype=torch.int64, device=trainer.device)
                    trainer.model(input_ids=one, position_ids=one, use_cache=False)
                    continue
                micro = trainer._micro(samples, rows)
                with replay.forward(rows, micro) if replay is not None else nullcontext():
                    logprobs, _ = token_logprobs(trainer.model, micro, len(rows), temperature, head=trainer.head)
                for i, row in enumerate(rows):
                    mine[row] = logprobs[i, : samples[row].rollout_logprobs.numel()].float().cpu()
    finally:
        trainer.model.train(training)
    if trainer.rank.distributed:
        everyone: list[dict[int, Tensor] | None] = [None] * trainer.rank.world_size
        dist.all_gather_object(everyone, mine)
        mine = {row: t for part in everyone if part for row, t in part.items()}
    return [mine[row] for row in range(len(samples))]


def rl_loss(
    trainer: Trainer,
    samples: list[Sample],
    advantages: Callable[[], Tensor | None],
    weights: Callable[[], Tensor],
    proximal: list[Tensor] | None = None,
    references: list[Tensor] | None = None,
) -> MicroLoss:
    """The loss of one micro-batch of ``samples`` (rows index them): ``advantages()`` and ``weights()``
    are row-aligned with ``samples`` (called once the first forward is queued); ``proximal``: pi_prox of
    each sample, or None for pi_theta detached (one optimizer step per batch); ``references``: the KL
    reference's logprobs of each sample when scored ahead (LoRA), else the frozen copy scores each micro-batch."""
    algo = trainer.settings.algorithm

    def ref_of(rows: list[int], width: int) -> Tensor | None:
        if references is None:
            return trainer._frozen_logprobs(trainer.reference, samples, rows)
        return trainer._to_device(padded([references[r] for r in rows], width))

    def loss_of(rows: list[int], logprobs: Tensor, entropy: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        width = logprobs.shape[1]
        rollout = trainer._to_device(padded([samples[r].rollout_logprobs for r in rows], width))
        mask = trainer._to_device(padded([samples[r].loss_mask for r in rows], width))
        extra: dict[str, Tensor] = {}
        step_advantages = advantages()
        if step_advantages is None:
            teacher = trainer._frozen_logprobs(trainer.teacher, samples, rows)
            assert teacher is not None
            reference = ref_of(rows, width) if algo.kl_in_reward else None
            micro_advantages, extra = distill_advantages(rollout, teacher, mask, algo, reference, trainer.kl.coef)
            extra["advantage/mean"] = masked_mean(micro_advantages, mask).to(torch.float64)
        else:
            micro_advantages = trainer._to_device(step_advantages[rows, :width])
        old = None if proximal is None else trainer._to_device(padded([proximal[r] for r in rows], width))
        inputs = MicroInputs(
            logprobs=logprobs,
            rollout_logprobs=rollout,
            advantages=micro_advantages,
            loss_mask=mask,
            weights=trainer._to_device(weights()[rows]),
            entropy=entropy,
            ref_logprobs=ref_of(rows, width),
            old_logprobs=old,
        )
        loss, stats = micro_loss(inputs, algo, float(trainer.rank.world_size), trainer.kl.coef)
        return loss, {**stats, **extra}

    return loss_of


def ppo_epochs(
    trainer: Trainer, batch: StepBatch, host: Callable[[], HostInputs], references: list[Tensor] | None = None
) -> dict[str, float]:
    """The M x E optimizer steps of one consumed batch (module docstring); returns the batch's metrics:
    the mean of each mini-batch statistic, ``minibatch/<name>/max`` for the clip fractions and grad
    norm, and ``optimizer_steps``. Each mini-batch's own figures go to the log."""
    settings, algo = trainer.settings, trainer.settings.algorithm
    inputs = host()  # advantages over the whole batch, before any update
    proximal = scored_logprobs(trainer, batch.samples)
    parts = split(batch, settings.mini_batches)
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + trainer.step)
    runs: list[dict[str, float]] = []
    for epoch in range(settings.epochs):
        for part in torch.randperm(len(parts), generator=generator).tolist():
            rows = parts[part]
            mini = assemble([batch.samples[r] for r in rows])  # its own dense group ids, for its weights
            index = torch.tensor(rows)
            advantages = None if inputs.advantages is None else inputs.advantages[index]
            weights = step_row_weights(mini, algo)
            refs = None if references is None else [references[r] for r in rows]
            loss_of = rl_loss(trainer, mini.samples, lambda a=advantages: a, lambda w=weights: w,
                              [proximal[r] for r in rows], refs)  # fmt: skip
            metrics = trainer.minibatch_step(mini.samples, loss_of, first=not runs)
            log.info("mini-batch", extra={"epoch": epoch, "miniBatch": part, "rows": len(rows), **metrics})
            runs.append(metrics)
    return summarise(runs)


def summarise(runs: list[dict[str, float]]) -> dict[str, float]:
    """The batch's figures from its mini-batches' (module docstring of ``ppo_epochs``); a refused
    mini-batch counts in ``minibatch/refused`` only."""
    refused = sum(1 for r in runs if "minibatch/refused" in r)
    applied = [r for r in runs if "minibatch/refused" not in r]
    names = {name for run in applied for name in run}
    out = {name: sum(r[name] for r in applied if name in r) / sum(name in r for r in applied) for name in names}
    for name in ("grad_norm", "clip_fraction", "dual_clip_fraction"):
        values = [r[name] for r in applied if name in r]
        if values:
            out[f"minibatch/{name}/max"] = max(values)
    out["optimizer_steps"] = float(len(applied))
    if refused:
        out["minibatch/refused"] = float(refused)
    return out


def reference_scores(trainer: Trainer, samples: Sequence[Sample]) -> list[Tensor]:
    """The KL reference's logprobs of each sample (CPU, next-token axis): under LoRA the policy with its
    adapters off (a pass every rank joins), else the frozen full copy's (on each rank: no collective)."""
    if trainer.lora:
        with disabled(trainer.model):
            return scored_logprobs(trainer, list(samples))
    scores: dict[int, Tensor] = {}
    for micro in trainer._plan(samples, 1)[0]:
        scored = trainer._frozen_logprobs(trainer.reference, samples, micro)
        assert scored is not None
        for i, row in enumerate(micro):
            scores[row] = scored[i, : samples[row].rollout_logprobs.numel()].float().cpu()
    return [scores[row] for row in range(len(samples))]


def reward_kl(trainer: Trainer, samples: Sequence[Sample], refs: list[Tensor] | None) -> Tensor:
    """``kl_in_reward``: KL_t(pi_behav || pi_ref) of every sampled token of the step, ``[S, T]`` on the
    host, as ``kl_estimator`` estimates it from the rollout's logprobs and the reference's."""
    ref = padded(refs if refs is not None else reference_scores(trainer, samples))
    rollout = padded([s.rollout_logprobs for s in samples], ref.shape[1])
    mask = padded([s.loss_mask for s in samples], ref.shape[1])
    return kl_penalty(rollout, ref, mask, trainer.settings.algorithm.kl_estimator)
