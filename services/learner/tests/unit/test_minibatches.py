"""PPO mini-batches and epochs: the batch's split, the decoupled loss against its formulas in float64,
and the trainer's several optimizer steps per batch on the tiny model (the clipping binds)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.learner.batch import Sample, StepBatch, assemble
from molt.learner.checkpoint import Checkpoints, RunState
from molt.learner.config import AlgorithmSettings, LearnerSettings
from molt.learner.minibatches import split
from molt.learner.objective import MicroInputs, micro_loss
from molt.learner.optim import lr_factor
from molt.learner.synthetic import step_batch
from molt.learner.trainer import Trainer

SettingsFactory = Callable[..., LearnerSettings]


def sample(group: int, length: int) -> Sample:
    ids = torch.ones(length, dtype=torch.int64)
    return Sample(f"t{group}-{length}", f"g{group}", f"g{group}/0", ids, torch.ones(length - 1, dtype=torch.bool),
                  torch.zeros(length - 1), torch.zeros(length - 1, dtype=torch.int64), 0.0)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(st.lists(st.integers(2, 60), min_size=1, max_size=4), min_size=1, max_size=12),
    count=st.integers(1, 8),
)
def test_a_split_keeps_groups_whole_and_uses_every_row_once(groups: list[list[int]], count: int) -> None:
    batch = assemble([sample(g, n) for g, lengths in enumerate(groups) for n in lengths])
    parts = split(batch, count)
    assert len(parts) == min(count, len(groups)) and all(parts)
    assert sorted(r for part in parts for r in part) == list(range(len(batch.samples)))
    owner = {r: i for i, part in enumerate(parts) for r in part}
    for g in range(len(groups)):
        assert len({owner[r] for r in range(len(batch.samples)) if batch.group_ids[r] == g}) == 1


def test_the_split_is_about_equal_in_tokens() -> None:
    batch = assemble([sample(g, 10 + g % 3) for g in range(16) for _ in range(2)])
    sizes = [sum(batch.samples[r].length for r in part) for part in split(batch, 4)]
    assert max(sizes) - min(sizes) <= 2 * 12  # at most one group's worth apart


def reference_loss(algo: AlgorithmSettings, lp: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor,
                   adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Straight from docs/algorithms.md, float64: token IS weights (trunc at 2) on pi_prox / pi_behav,
    the surrogate on pi_theta / pi_prox, a token mean over the mask."""
    w = torch.clamp((prox - behav).exp(), max=algo.importance_sampling.high)
    r = (lp - prox).exp()
    low, high = 1 - algo.clip_low, 1 + algo.clip_high
    if algo.loss == "ppo":
        per = torch.maximum(-adv * r, -adv * r.clamp(low, high))
        if algo.dual_clip is not None:
            per = torch.where(adv < 0, torch.minimum(per, -algo.dual_clip * adv), per)
    elif algo.loss == "gspo":
        seq = (((lp - prox) * mask).sum(1) / mask.sum(1)).exp()[:, None]
        s = seq.detach() * (lp - lp.detach()).exp()
        per = torch.maximum(-adv * s, -adv * s.clamp(low, high))
    else:  # cispo: the weight clipped above only (its lower edge is 1 - 1 = 0)
        per = -(r.clamp(0.0, high)).detach() * adv * lp
    return (w * per * mask).sum() / mask.sum()


LOSSES = {
    "ppo": {"loss": "ppo"},
    "dual_clip": {"loss": "ppo", "dual_clip": 1.5},
    "gspo": {"loss": "gspo"},
    "cispo": {"loss": "cispo"},
}


def test_the_decoupled_loss_matches_its_formulas_and_the_surrogates_differ() -> None:
    """pi_theta drifted from pi_prox by up to +-1 in log space: every surrogate clips some tokens (the
    dual clip too), and the four give four different gradients, each the float64 formula's."""
    generator = torch.Generator().manual_seed(3)
    shape = (4, 12)
    prox = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    lp0 = prox + (torch.rand(shape, generator=generator, dtype=torch.float64) - 0.5) * 2.0
    behav = prox + (torch.rand(shape, generator=generator, dtype=torch.float64) - 0.5) * 0.4
    adv = torch.randn(shape[0], 1, generator=generator, dtype=torch.float64).expand(shape).clone()
    mask = torch.rand(shape, generator=generator) > 0.2
    grads = {}
    for name, overrides in LOSSES.items():
        algo = AlgorithmSettings(**overrides)
        lp = lp0.clone().requires_grad_(True)
        weights = torch.full((shape[0],), 1.0 / float(mask.sum()), dtype=torch.float64)
        inputs = MicroInputs(lp, behav, adv, mask, weights, old_logprobs=prox)
        loss, stats = micro_loss(inputs, algo, 1.0)
        (grad,) = torch.autograd.grad(loss, lp)
        ref_lp = lp0.clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(reference_loss(algo, ref_lp, prox, behav, adv, mask.double()), ref_lp)
        torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12, msg=name)
        if name != "gspo":  # gspo clips whole sequences: its clip fraction is of sequences, may be 0 here
            assert float(stats["clip_fraction"]) > 0, name
        if name == "dual_clip":
            assert float(stats["dual_clip_fraction"]) > 0
        grads[name] = grad
    for a, b in ((a, b) for a in grads for b in grads if a < b):
        assert not torch.allclose(grads[a], grads[b]), (a, b)


def batch_of_four_groups() -> StepBatch:
    return step_batch({"a": [1.0, 0.0, 1.0, 0.0], "b": [0.0, 0.0, 1.0, 0.5], "c": [1.0, 1.0, 0.0, 0.0],
                       "d": [0.2, 0.9, 0.4, 0.0]})  # fmt: skip


def forwards(trainer: Trainer) -> list[int]:
    calls: list[int] = []
    trainer.model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_mini_batches_make_several_updates_and_the_clipping_binds(learner_settings: SettingsFactory) -> None:
    """Four mini-batches, two epochs, a learning rate large enough to move the policy: eight AdamW steps
    in one learner step (one LR, one policy version), one extra forward (pi_prox) per micro-batch, and
    the later mini-batches' ratios leave 1 far enough to clip."""
    batch = batch_of_four_groups()
    trainer = Trainer(learner_settings(mini_batches=4, epochs=2, optimizer={"lr": 3e-2}, groups_per_step=4))
    calls = forwards(trainer)
    metrics = trainer.train_step(batch)
    assert trainer.step == 1 and metrics["optimizer_steps"] == 8
    assert len(calls) == 1 + 8  # the proximal pass (one micro-batch of everything), then one per update
    assert metrics["minibatch/clip_fraction/max"] > 0
    assert metrics["minibatch/grad_norm/max"] >= metrics["grad_norm"] > 0
    assert metrics["lr"] == pytest.approx(3e-2 * lr_factor(0, trainer.settings.optimizer))  # the batch's one LR


def test_one_mini_batch_and_one_epoch_run_no_extra_forward(learner_settings: SettingsFactory) -> None:
    """The default: one optimizer step, pi_old = pi_theta detached (ratio 1: nothing clips), and no
    proximal pass."""
    trainer = Trainer(learner_settings(groups_per_step=4))
    calls = forwards(trainer)
    metrics = trainer.train_step(batch_of_four_groups())
    assert len(calls) == 1 and "optimizer_steps" not in metrics
    assert metrics["clip_fraction"] == 0.0 and metrics["ratio_mean"] == 1.0


def test_the_losses_give_different_updates_with_mini_batches(learner_settings: SettingsFactory) -> None:
    batch = batch_of_four_groups()
    after = {}
    for name, overrides in LOSSES.items():
        trainer = Trainer(learner_settings(mini_batches=4, optimizer={"lr": 3e-2}, algorithm=overrides,
                                           groups_per_step=4))  # fmt: skip
        trainer.train_step(batch)
        after[name] = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    for a, b in ((a, b) for a in after for b in after if a < b):
        assert not torch.equal(after[a], after[b]), (a, b)


def test_a_resume_between_batches_with_mini_batches_is_exact(learner_settings: SettingsFactory, tmp_path: Path) -> None:
    """Two mini-batches, two epochs: two learner steps straight equal one, a checkpoint, a fresh trainer
    loaded from it and the second step, bit for bit (the mini-batches' order is drawn from the seed and
    the step, so the resumed step visits them as the straight run did)."""
    settings = learner_settings(mini_batches=2, epochs=2, optimizer={"lr": 1e-2}, groups_per_step=4)
    straight = Trainer(settings)
    straight.train_step(batch_of_four_groups())
    straight.train_step(batch_of_four_groups())
    interrupted = Trainer(settings)
    interrupted.train_step(batch_of_four_groups())
    path = Checkpoints(tmp_path / "ckpt", keep=2).save(interrupted, RunState(step=1, policy_version=1))
    resumed = Trainer(settings)
    Checkpoints(tmp_path / "ckpt", keep=2).load(resumed, path)
    resumed.train_step(batch_of_four_groups())
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
