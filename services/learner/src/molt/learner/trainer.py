"""The trainable policy and one optimizer step: model, optional frozen reference and teacher, AdamW, LR schedule.

``Trainer.train_step(batch)`` runs the RL step on the global batch (every rank
gets the same ``StepBatch`` and trains its share from ``packing.plan``):
advantages and aggregation weights over the whole step, then per micro-batch a
forward (under routing replay with the engine's experts, ``replay.py``), the
loss of ``objective.micro_loss`` and a backward (gradients accumulate), then
grad-norm clipping, AdamW and the scheduler; with ``gae`` the critic's update
follows (``critic.py``). The models come from ``models.py``: FSDP2-sharded over
several ranks, the reference and teacher frozen full copies.

The weights after step ``s`` are policy version ``s + version_offset``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function

from molt.algos.aggregation import masked_mean, token_mean
from molt.algos.checks import deferred_checks, immediate_checks
from molt.algos.kl import KLController
from molt.core.errors import ConfigError
from molt.learner.batch import Sample, StepBatch, batch_stats, padded
from molt.learner.config import LearnerSettings
from molt.learner.critic import Critic, critic_update, critic_values
from molt.learner.logprobs import Head, compiled_head, next_token_logprobs, token_logprobs
from molt.learner.lora import apply_lora, base_identity
from molt.learner.minibatches import ppo_epochs, reference_scores, reward_kl, rl_loss
from molt.learner.models import compile_layers, load_policy, model_context, resolve_backend, shard
from molt.learner.objective import advantage_stats, gae_targets, step_advantages, step_row_weights
from molt.learner.optim import adamw
from molt.learner.packing import Layout, Packed, layout_of, plan, resolve_layout
from molt.learner.ranks import SINGLE, RankInfo, device_for, to_device
from molt.learner.replay import StepReplay, replay_shape
from molt.learner.routing import freeze_router

log = logging.getLogger(__name__)
# (micro-batch rows, their logprobs, their entropies) -> (loss to backpropagate, stats as token means)
MicroLoss = Callable[[list[int], Tensor, Tensor | None], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class HostInputs:
    """What one RL step computes on the host before its losses: statistics, advantages, weights."""

    stats: dict[str, float]  # batch_stats, and advantage_stats where the advantages are step-wide
    advantages: Tensor | None  # [S, T] float32; None: per micro-batch (on_policy_distill)
    returns: Tensor | None  # [S, T] the critic's targets (gae only)
    weights: Tensor  # [S] float64 aggregation weights (step_row_weights)


class StepRefused(ValueError):
    """A step whose inputs or gradients hold a non-finite value: nothing of it was applied (the
    gradients are cleared), on every rank alike."""


class Trainer:
    """Owns the policy, the reference model, the optimizer and the schedule of one rank."""

    def __init__(self, settings: LearnerSettings, rank: RankInfo = SINGLE) -> None:
        self.settings = settings
        self.rank = rank
        self.device = device_for(rank)
        torch.manual_seed(settings.seed)
        self.backend = resolve_backend(settings.backend, self.device)
        self.layout: Layout = resolve_layout(settings.micro_batch_layout)
        load = functools.partial(load_policy, device=self.device, backend=self.backend, dtype=settings.param_dtype)
        self.model = load(settings.model_path, trainable=True)
        if settings.freeze_router:  # before sharding and the optimizer: both see which weights train
            log.info("router frozen", extra={"parameters": freeze_router(self.model)})
        # Adapters only train; the base, adapters off, is the reference. The SFT warm-up trains it all.
        self.lora = settings.lora.rank > 0 and settings.mode == "rl"
        self.base = base_identity(settings.model_path) if self.lora else None
        if self.lora:
            self.model = apply_lora(self.model, settings.lora)
        # Under routing replay each sample must carry routing of this shape (build_group); None: replay off.
        self.routing_shape = replay_shape(self.model, self.backend) if settings.rollout.routing_replay else None
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_length: int | None = settings.max_sequence_tokens or model_context(self.model.config)
        dtype = str(next(self.model.parameters()).dtype)
        log.info(
            "policy loaded",
            extra={"backend": self.backend, "dtype": dtype, "device": str(self.device), "layout": self.layout},
        )
        if rank.distributed:
            shard(self.model, rank.world_size, self.device)
        self.head: Head = next_token_logprobs
        if settings.compile:
            self.compile()
        needs_reference = settings.algorithm.kl_coef > 0 and not self.lora
        self.reference = load(settings.model_path, trainable=False) if needs_reference else None
        teacher = settings.algorithm.teacher_path
        self.teacher = load(teacher, trainable=False) if teacher is not None else None
        if self.teacher is not None and int(self.teacher.config.vocab_size) != self.vocab_size:
            raise ConfigError(
                f"teacher {teacher} has vocab_size {self.teacher.config.vocab_size}, the policy "
                f"{self.vocab_size}: on_policy_distill needs one vocabulary"
            )
        opt = settings.optimizer
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = adamw(trainable, opt, opt.lr, fused=self.device.type == "cuda")
        algo = settings.algorithm
        self.kl = KLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)  # the KL term's coefficient
        self.critic: Critic | None = None
        if settings.algorithm.estimator == "gae":
            critic = settings.critic
            # transformers for the critic's body whatever the policy's backend: Critic needs its base_model.
            body = load_policy(
                critic.model_path or settings.model_path, self.device, trainable=True, dtype=settings.param_dtype
            )
            self.critic = Critic.from_causal_lm(body)
            self.critic_optimizer, self.critic_scheduler = adamw(self.critic.parameters(), opt, critic.lr)
        self.step = 0
        # Policy version = step + offset. 0 unless the engines were ahead of a restarted learner: its first
        # refit is then published after their version and the numbering goes on from there.
        self.version_offset = 0

    def compile(self) -> None:
        """What ``compile = true`` does: each decoder layer and the logprob head through ``torch.compile``."""
        compile_layers(self.model)
        self.head = compiled_head()

    @property
    def policy_version(self) -> int:
        return self.step + self.version_offset

    def train_step(self, batch: StepBatch) -> dict[str, float]:
        """One learner step on the global batch: one optimizer step, or with ``mini_batches`` / ``epochs``
        above 1 several (``minibatches.py``); returns the step's metrics (identical on every rank)."""
        started = time.monotonic()
        samples = batch.samples
        old_values = self._values(samples) if self.critic is not None else None
        # Host-side work, done once the first forward is queued (``_accumulate`` calls it on every rank at
        # that point), so on a GPU this CPU work overlaps the forward instead of leaving the GPU idle.
        lora_kl = self.lora and self.settings.algorithm.kl_coef > 0
        refs = reference_scores(self, samples) if lora_kl else None  # before any update: the base's
        host = functools.cache(functools.partial(self._host_inputs, batch, self.policy_version, old_values, refs))
        if self.settings.mini_batches == 1 and self.settings.epochs == 1:
            loss_of = rl_loss(self, samples, lambda: host().advantages, lambda: host().weights, references=refs)
            metrics = {**self.minibatch_step(samples, loss_of, first=True, after_first_forward=host)}
        else:
            metrics = ppo_epochs(self, batch, host, refs)
        metrics = {**host().stats, **metrics, **self._advance()}
        if self.settings.algorithm.kl_coef > 0:  # the coefficient this step used, then the next one's from its KL
            metrics["kl_coef"] = self.kl.coef
            self.kl.update(metrics["kl"], len(samples))
        if old_values is not None:
            returns = host().returns
            assert returns is not None
            metrics.update(self._critic_step(samples, old_values, returns))
        elapsed = time.monotonic() - started
        tokens = sum(s.length for s in samples)
        metrics.update({"step_seconds": elapsed, "tokens": float(tokens), "tokens_per_s": tokens / elapsed})
        return metrics

    def minibatch_step(
        self,
        samples: list[Sample],
        loss_of: MicroLoss,
        *,
        first: bool,
        after_first_forward: Callable[[], object] = lambda: None,
    ) -> dict[str, float]:
        """One optimizer step on ``samples`` (under routing replay with their routing); the LR schedule and
        the step count move on in ``_advance``, once per learner step. A refused update that is not the
        step's ``first`` is skipped (the earlier ones of the step stand): counted, logged, not raised."""
        replay = None
        if self.routing_shape is not None:
            replay = StepReplay(self.model, samples, self.settings.rollout.temperature, self.head,
                                compare=self.settings.compare_unreplayed)  # fmt: skip
        try:
            objective, stats, norm = self._accumulate(
                samples, loss_of, self.settings.rollout.temperature, entropy=True,
                after_first_forward=after_first_forward, replay=replay,
            )  # fmt: skip
            metrics = {**stats, "loss/objective": objective, **self._apply(norm)}
        except StepRefused as exc:
            if first:
                raise
            log.error("a mini-batch's update was refused; the step's others stand", extra={"reason": str(exc)})
            return {"minibatch/refused": 1.0}
        if replay is not None:
            metrics.update(replay.stats(self._sum_over_ranks))
        return metrics

    @record_function("molt/host_inputs")
    def _host_inputs(
        self, batch: StepBatch, version: int, old_values: Tensor | None, refs: list[Tensor] | None = None
    ) -> HostInputs:
        """The step-wide quantities computed on the host: batch and advantage statistics, advantages
        (``gae`` from the critic's ``old_values``; none for ``on_policy_distill``, whose signal is per
        micro-batch) and aggregation weights. Bad values (a NaN reward) raise here at once, on every rank
        alike (the same global batch), before any backward's collectives."""
        algo = self.settings.algorithm
        with immediate_checks():
            stats = batch_stats(batch, version)
            advantages = returns = None
            kl = reward_kl(self, batch.samples, refs) if algo.kl_in_reward and self.teacher is None else None
            if old_values is not None:
                advantages, returns = gae_targets(batch, algo, old_values, kl, self.kl.coef)
            elif self.teacher is None:
                advantages = step_advantages(batch, algo, kl, self.kl.coef)
            if advantages is not None:
                stats.update(advantage_stats(advantages, padded([s.loss_mask for s in batch.samples])))
            return HostInputs(stats, advantages, returns, step_row_weights(batch, algo))

    def _values(self, samples: Sequence[Sample]) -> Tensor:
        """The critic's values of every sample of the step, ``[S, T]`` float32 on the CPU (no gradient)."""
        assert self.critic is not None
        return critic_values(
            self.critic, samples, ((rows, self._micro(samples, rows)) for rows in self._plan(samples, 1)[0])
        )

    def _critic_step(self, samples: Sequence[Sample], old_values: Tensor, returns: Tensor) -> dict[str, float]:
        """One critic update (``critic_update``) on this rank's micro-batches of the data-parallel plan."""
        assert self.critic is not None
        mine = self._plan(samples, self.rank.world_size)[self.rank.rank]
        return critic_update(
            self.critic,
            self.critic_optimizer,
            self.critic_scheduler,
            self.settings.critic,
            samples,
            old_values,
            returns,
            ((rows, self._micro(samples, rows)) for rows in mine if rows),
            device=self.device,
            distributed=self.rank.distributed,
        )

    def _frozen_logprobs(self, model: nn.Module | None, samples: Sequence[Sample], rows: list[int]) -> Tensor | None:
        """A frozen model's (reference, teacher) logprobs of the rows' tokens at the sampling temperature."""
        if model is None:
            return None
        with torch.no_grad():
            logprobs, _ = token_logprobs(
                model, self._micro(samples, rows), len(rows), self.settings.rollout.temperature, head=self.head
            )
        return logprobs

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One supervised step: the token mean of ``-log p`` over every loss token of the step (all
        micro-batches and ranks), at temperature 1 (the data was not sampled)."""
        total = float(sum(s.loss_tokens for s in samples))  # samples: the global batch, so the global count

        def loss_of(rows: list[int], logprobs: Tensor, entropy: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
            mask = self._to_device(padded([samples[r].loss_mask for r in rows], logprobs.shape[1]))
            nll = -logprobs
            loss = token_mean(nll, mask, total) * self.rank.world_size
            return loss, {"loss/nll": masked_mean(nll.detach(), mask).double()}

        objective, stats, norm = self._accumulate(samples, loss_of, 1.0, entropy=False)
        return {**stats, "loss/objective": objective, **self._apply(norm), **self._advance()}

    def _accumulate(
        self,
        samples: Sequence[Sample],
        loss_of: MicroLoss,
        temperature: float,
        *,
        entropy: bool,
        after_first_forward: Callable[[], object] = lambda: None,
        replay: StepReplay | None = None,
    ) -> tuple[float, dict[str, float], Tensor]:
        """Forward + backward of this rank's micro-batches, then the gradients clipped to ``max_grad_norm``;
        returns the summed loss and token-mean stats of the whole step (reduced over ranks) and the
        gradients' norm before clipping. The sums stay on the device: the loop adds no host sync per
        micro-batch, and the objective's value checks are settled once, before any optimizer step but after
        the clipping is queued, so while the host waits there the GPU still has the clipping to run.
        ``after_first_forward`` runs on every rank once the first forward is queued (an idle rank's too),
        before any backward: what it raises stops every rank at the same point. With ``replay`` the
        policy's forwards use the samples' routing (``StepReplay.forward``)."""
        my_plan = self._plan(samples, self.rank.world_size)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, Tensor] = {}
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        failure: str | None = None
        try:
            with deferred_checks():  # molt.algos' value checks: one sync after the last backward, not one per call
                for index, rows in enumerate(my_plan[self.rank.rank]):
                    between = after_first_forward if index == 0 else None
                    if not rows:
                        if replay is not None:
                            replay.idle()
                        self._idle_backward(between)
                        continue
                    micro = self._micro(samples, rows)
                    replayed = replay.forward(rows, micro) if replay is not None else nullcontext()
                    with record_function("molt/forward"), replayed:
                        logprobs, entropies = token_logprobs(
                            self.model,
                            micro,
                            len(rows),
                            temperature,
                            entropy=entropy,
                            entropy_grad=self.settings.algorithm.entropy_coef > 0,
                            head=self.head,
                        )
                    if between is not None:
                        between()
                    with record_function("molt/loss"):
                        loss, stats = loss_of(rows, logprobs, entropies)
                    with record_function("molt/backward"):
                        loss.backward()
                    count = float(sum(samples[r].loss_tokens for r in rows))
                    total += loss.detach().double() / self.rank.world_size
                    tokens += count
                    for name, value in stats.items():
                        zero = torch.zeros((), dtype=torch.float64, device=self.device)
                        sums[name] = sums.get(name, zero) + value * count
                norm = self._clip_gradients()
        except ValueError as exc:  # a bad value in this rank's share of the step (or in the step-wide inputs)
            failure = str(exc)
            norm = torch.full((), float("nan"))
        refused = failure is not None
        if self.rank.distributed:  # every rank learns whether any refused, so all of them skip the update alike
            refused = float(self._sum_over_ranks(torch.tensor([float(refused)], device=self.device))[0]) > 0
        if refused:
            self._refuse(failure or "another rank refused a value of this step")
        names = sorted(sums)
        if self.rank.distributed:  # a rank with no rows this time has no stats: every rank sums the same names
            everyone: list[list[str] | None] = [None] * self.rank.world_size
            dist.all_gather_object(everyone, names)
            names = sorted({n for part in everyone if part for n in part})
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        with record_function("molt/reduce"):  # after the checks' sync: the GPU has nothing left to run
            reduced = self._sum_over_ranks(torch.stack([total, tokens, *(sums.get(n, zero) for n in names)]))
        count = float(reduced[1].clamp(min=1))
        stats = {n: float(v) / count for n, v in zip(names, reduced[2:], strict=True)}
        return float(reduced[0]), stats, norm

    def _idle_backward(self, between: Callable[[], object] | None = None) -> None:
        """A zero-gradient forward/backward: this rank has no samples for this micro-batch, but FSDP's
        all-gathers and reduce-scatters are collectives every rank must join. ``between`` runs after the
        forward, where a busy rank runs its first loss."""
        one = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
        logits = self.model(input_ids=one, position_ids=one, use_cache=False).logits
        if between is not None:
            between()
        (logits.sum() * 0.0).backward()

    def _plan(self, samples: Sequence[Sample], world_size: int) -> list[list[list[int]]]:
        return plan([s.length for s in samples], world_size, self.settings.micro_batch_tokens, self.layout)

    def _micro(self, samples: Sequence[Sample], rows: list[int]) -> Packed:
        return layout_of(self.layout)([samples[r].input_ids for r in rows])

    def _to_device(self, tensor: Tensor) -> Tensor:
        return to_device(tensor, self.device)

    def _sum_over_ranks(self, values: Tensor) -> Tensor:
        if self.rank.distributed:
            values = values.to(self.device)
            dist.all_reduce(values)
        return values.cpu()

    @record_function("molt/clip")
    def _clip_gradients(self) -> Tensor:
        """Clips the policy's gradients to ``max_grad_norm`` in place; their total norm before (all ranks)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.settings.optimizer.max_grad_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _refuse(self, reason: str) -> NoReturn:
        self.optimizer.zero_grad(set_to_none=True)  # nothing of the refused step may reach the next one
        raise StepRefused(reason)

    @record_function("molt/optimizer")
    def _apply(self, grad_norm: Tensor) -> dict[str, float]:
        """AdamW on the accumulated gradients, then cleared (the LR stays until ``_advance``)."""
        if not torch.isfinite(grad_norm):  # the norm of every rank's gradients: the same on every rank
            self._refuse(f"the gradient norm is {float(grad_norm)}: the step is not applied")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm)}

    def _advance(self) -> dict[str, float]:
        """The end of a learner step: the LR schedule moves on and the step (the policy version) counts."""
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        return {"lr": lr}
