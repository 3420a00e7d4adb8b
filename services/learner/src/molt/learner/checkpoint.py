"""Checkpoints: everything needed to continue a run exactly, written so that a crash never leaves a
half checkpoint that could be loaded.

Layout under ``<run_dir>/checkpoints``: ``step-00000010/`` holding ``model.pt`` and
``optimizer.pt`` (full, unsharded state dicts), ``extra_state.pt`` (scheduler and RNG
states; with ``gae`` also the critic, its optimizer and scheduler) and ``state.json``
(step, policy version, consumed trajectory ids with the step that trained each, drop
counts), plus ``latest``, a text file naming the newest directory.

Write order: every file into ``.tmp-step-.../``, each fsynced, then the directory
renamed to its final name (atomic), the parent fsynced, then ``latest`` replaced
the same way, then older checkpoints pruned. A directory with its final name is
therefore complete; loading still checks that every file is present.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from molt.learner.trainer import Trainer

log = logging.getLogger(__name__)

FILES = ("model.pt", "optimizer.pt", "extra_state.pt", "state.json")
LATEST = "latest"
PREFIX = "step-"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class RunState:
    """The learner's bookkeeping that must survive a restart together with the weights."""

    step: int = 0
    policy_version: int = 0
    consumed: dict[str, int] = field(default_factory=dict)  # trajectory id -> the step that trained it
    dropped: dict[str, int] = field(default_factory=dict)  # drop reason -> trajectories

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "policy_version": self.policy_version,
                "consumed": self.consumed,
                "dropped": self.dropped,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RunState:
        data = json.loads(text)
        return cls(data["step"], data["policy_version"], dict(data["consumed"]), dict(data["dropped"]))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def is_complete(path: Path) -> bool:
    return path.is_dir() and path.name.startswith(PREFIX) and all((path / name).is_file() for name in FILES)


class Checkpoints:
    """Saves, finds, loads and prunes the checkpoints of one run. ``save`` and ``load`` are collective:
    every rank calls them (the full state dicts are gathered from FSDP shards); rank 0 writes."""

    def __init__(self, root: Path, keep: int, *, is_writer: bool = True) -> None:
        self.root = root
        self.keep = keep
        self.is_writer = is_writer
        if is_writer:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-*"):  # left by a crash mid-write; never loadable
                shutil.rmtree(stale, ignore_errors=True)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        found = [p for p in self.root.glob(f"{PREFIX}*") if is_complete(p)] if self.root.is_dir() else []
        return sorted(found, key=_step_of)

    def newest(self) -> Path | None:
        """The newest complete checkpoint. ``latest`` is written last, so a checkpoint renamed into place
        just before a crash is newer than ``latest`` and complete: it is preferred."""
        complete = self.complete()
        return complete[-1] if complete else None

    def save(self, trainer: Trainer, state: RunState) -> Path:
        """Writes the checkpoint of ``state.step`` (collective); returns its directory."""
        model_state = get_model_state_dict(trainer.model, options=FULL)
        optimizer_state = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=FULL)
        final = self.root / f"{PREFIX}{state.step:08d}"
        if self.is_writer:
            extra = {
                "scheduler": trainer.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            }
            if trainer.critic is not None:  # replicated on every rank: rank 0's copy is the whole state
                extra["critic"] = {
                    "model": trainer.critic.state_dict(),
                    "optimizer": trainer.critic_optimizer.state_dict(),
                    "scheduler": trainer.critic_scheduler.state_dict(),
                }
            tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            torch.save(model_state, tmp / "model.pt")
            torch.save(optimizer_state, tmp / "optimizer.pt")
            torch.save(extra, tmp / "extra_state.pt")
            (tmp / "state.json").write_text(state.to_json())
            for name in FILES:
                _fsync(tmp / name)
            _fsync(tmp)
            if final.exists():  # left by an abandoned lineage (a manual restart from an older checkpoint)
                log.warning("replacing an existing checkpoint", extra={"path": str(final)})
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync(self.root)
            self._point_latest(final)
            self._prune()
            log.info("checkpoint written", extra={"step": state.step, "path": str(final)})
        if dist.is_initialized():
            dist.barrier()
        return final

    def _point_latest(self, target: Path) -> None:
        tmp = self.root / f".tmp-{LATEST}-{uuid.uuid4().hex[:8]}"
        tmp.write_text(target.name + "\n")
        _fsync(tmp)
        tmp.replace(self.root / LATEST)
        _fsync(self.root)

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, trainer: Trainer, path: Path) -> RunState:
        """Restores model, optimizer, scheduler, RNG and step from ``path`` (collective)."""
        if not is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (needs {', '.join(FILES)})")
        model_state = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        set_model_state_dict(trainer.model, model_state, options=StateDictOptions(full_state_dict=True))
        optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        set_optimizer_state_dict(
            trainer.model, trainer.optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True)
        )
        extra = torch.load(path / "extra_state.pt", map_location="cpu", weights_only=True)
        trainer.scheduler.load_state_dict(extra["scheduler"])
        if trainer.critic is not None:
            if "critic" not in extra:
                raise FileNotFoundError(f"{path} holds no critic; it was not written by a gae run")
            trainer.critic.load_state_dict(extra["critic"]["model"])
            trainer.critic_optimizer.load_state_dict(extra["critic"]["optimizer"])
            trainer.critic_scheduler.load_state_dict(extra["critic"]["scheduler"])
        torch.set_rng_state(extra["torch_rng"])
        random.setstate(extra["python_rng"])
        state = RunState.from_json((path / "state.json").read_text())
        trainer.step = state.step
        trainer.version_offset = state.policy_version - state.step
        log.info("resumed from checkpoint", extra={"step": state.step, "path": str(path)})
        return state
