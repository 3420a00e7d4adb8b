"""Checkpoints: exact resume, completeness, the latest pointer and pruning."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from molt.learner.checkpoint import Checkpoints, RunState, is_complete
from molt.learner.config import LearnerSettings
from molt.learner.synthetic import step_batch
from molt.learner.trainer import Trainer

SettingsFactory = Callable[..., LearnerSettings]


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_resume_continues_exactly(learner_settings: SettingsFactory, tmp_path: Path, estimator: str) -> None:
    """Two steps straight == one step, save, fresh objects, load, one step: bit-identical parameters,
    optimizer moments and learning rate (warm-up makes the LR differ per step, so the schedule is checked);
    with gae the critic too."""
    settings = learner_settings(
        optimizer={"lr": 1e-3, "warmup_steps": 3, "total_steps": 10},
        algorithm={"estimator": estimator},
        critic={"lr": 1e-3},
    )
    first, second = step_batch({"one": [1.0, 0.0, 0.5, 0.0]}), step_batch({"two": [0.0, 1.0, 1.0, 0.0]})

    straight = Trainer(settings)
    straight.train_step(first)
    straight.train_step(second)

    interrupted = Trainer(settings)
    interrupted.train_step(first)
    checkpoints = Checkpoints(tmp_path / "ckpt", keep=2)
    consumed = dict.fromkeys(first.trajectory_ids, 1)
    path = checkpoints.save(interrupted, RunState(step=1, policy_version=1, consumed=consumed, dropped={"stale": 2}))
    del interrupted

    resumed = Trainer(settings)
    state = Checkpoints(tmp_path / "ckpt", keep=2).load(resumed, path)
    assert state == RunState(step=1, policy_version=1, consumed=consumed, dropped={"stale": 2})
    assert resumed.step == 1
    resumed.train_step(second)

    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert straight.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        sa, sb = straight.optimizer.state[a], resumed.optimizer.state[b]
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]) and torch.equal(sa["step"], sb["step"])
    if estimator == "gae":
        assert straight.critic is not None and resumed.critic is not None
        for (name, a), (_, b) in zip(
            straight.critic.named_parameters(), resumed.critic.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), name
        assert straight.critic_scheduler.get_last_lr() == resumed.critic_scheduler.get_last_lr()


def test_only_complete_checkpoints_count_and_old_ones_are_pruned(
    learner_settings: SettingsFactory, tmp_path: Path
) -> None:
    trainer = Trainer(learner_settings())
    root = tmp_path / "ckpt"
    checkpoints = Checkpoints(root, keep=2)
    for step in (1, 2, 3):
        checkpoints.save(trainer, RunState(step=step, policy_version=step))
    assert [p.name for p in checkpoints.complete()] == ["step-00000002", "step-00000003"]
    assert (root / "latest").read_text().strip() == "step-00000003"

    # A crash mid-write leaves a temp dir; one without extra_state.pt under a final name is not complete.
    shutil.copytree(root / "step-00000003", root / ".tmp-step-00000004-dead")
    broken = root / "step-00000005"
    shutil.copytree(root / "step-00000003", broken)
    (broken / "extra_state.pt").unlink()
    assert not is_complete(broken)
    reopened = Checkpoints(root, keep=2)
    assert not list(root.glob(".tmp-*"))
    assert reopened.newest() == root / "step-00000003"
    assert reopened.load(Trainer(learner_settings()), root / "step-00000003").step == 3
