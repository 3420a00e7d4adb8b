"""Checkpoints: exact resume, completeness, the latest pointer and pruning."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from molt.learner.checkpoint import CheckpointError, Checkpoints, RunState, is_complete
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
    # The damaged newest one is refused, not passed over: the steps it held would be lost unseen.
    with pytest.raises(CheckpointError, match=r"step-00000005 is damaged: extra_state.pt missing.*step-00000003"):
        reopened.newest()
    broken.rename(tmp_path / "aside")
    (root / "step-latest-copy").mkdir()  # not a checkpoint name: ignored, by newest() and by pruning
    assert reopened.newest() == root / "step-00000003"
    assert reopened.load(Trainer(learner_settings()), root / "step-00000003").step == 3
    reopened.save(trainer, RunState(step=4, policy_version=4))
    assert [p.name for p in reopened.complete()] == ["step-00000003", "step-00000004"]


def test_damaged_checkpoints_are_refused_by_name_and_load_nothing(
    learner_settings: SettingsFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each damage gets a CheckpointError naming the file, before anything reaches the trainer."""
    settings = learner_settings()
    trainer = Trainer(settings)
    root = tmp_path / "ckpt"
    checkpoints = Checkpoints(root, keep=3)
    for step in (1, 2):
        checkpoints.save(trainer, RunState(step=step, policy_version=step))
    path = root / "step-00000002"
    fresh = Trainer(settings)
    before = [p.detach().clone() for p in fresh.model.parameters()]

    def refused(match: str) -> None:
        with pytest.raises(CheckpointError, match=match):
            Checkpoints(root, keep=3).load(fresh, path)
        assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters(), strict=True))

    good = {name: (path / name).read_bytes() for name in ("model.pt", "extra_state.pt", "state.json")}
    (path / "model.pt").write_bytes(b"")
    refused(r"model.pt is unreadable")
    (path / "model.pt").write_bytes(good["model.pt"][: len(good["model.pt"]) // 2])
    refused(r"model.pt is unreadable .*; to resume from step-00000001 instead .* move step-00000002 aside")
    (path / "model.pt").write_bytes(good["model.pt"])
    (path / "extra_state.pt").write_bytes(good["extra_state.pt"][:100])
    refused(r"extra_state.pt is unreadable")
    (path / "extra_state.pt").write_bytes(good["extra_state.pt"])
    for text, match in (
        ("{", r"state.json is unreadable"),
        ('{"step": "2", "policy_version": 2, "consumed": {}, "dropped": {}}', r"step must be an integer"),
        ('{"step": 2, "policy_version": 2, "consumed": [], "dropped": {}}', r"consumed must map"),
        ('{"step": 7, "policy_version": 7, "consumed": {}, "dropped": {}}', r"holds step 7, its directory says 2"),
    ):
        (path / "state.json").write_text(text)
        refused(match)
    (path / "state.json").write_bytes(good["state.json"])
    assert Checkpoints(root, keep=3).load(fresh, path).step == 2

    for step in (1, 2):  # every checkpoint damaged: refused, never a silent start from step 0
        (root / f"step-0000000{step}" / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint is left"):
        Checkpoints(root, keep=3).newest()
    with pytest.raises(CheckpointError, match="not writable"):
        Checkpoints(root / "latest" / "under-a-file", keep=3)

    other = Trainer(learner_settings(optimizer={"lr": 5e-2}))
    checkpoints.save(trainer, RunState(step=3, policy_version=3))
    caplog.set_level("WARNING", logger="molt.learner.checkpoint")
    checkpoints.load(other, root / "step-00000003")
    assert any("learning rate differs" in r.getMessage() for r in caplog.records)
