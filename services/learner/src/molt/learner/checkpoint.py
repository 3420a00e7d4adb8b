"""Checkpoints: everything needed to continue a run exactly, and never half a checkpoint that loads.

Layout under ``<run_dir>/checkpoints``: ``step-00000010/`` holding ``model.pt`` and
``optimizer.pt`` (full, unsharded state dicts), ``extra_state.pt`` (scheduler and RNG
states; with ``gae`` also the critic, its optimizer and scheduler) and ``state.json``
(step, policy version, consumed trajectory ids with the step that trained each, drop
counts), plus ``latest``, a text file naming the newest directory. A directory with
its final name is complete (``save`` says how); one that is not was damaged after the
fact, and the learner then refuses to start rather than resume from an older one and
silently leave out the trajectories the lost steps trained on (their queue entries are
acknowledged).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from molt.core.errors import ConfigError
from molt.learner.lora import adapter_names, check_base
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
    # The part of ``dropped`` in groups skipped whole: those are settled at once and counted in the queue's
    # Redis too (``TrajectoryQueue.skipped_trajectories``), so an account of the run takes them from there.
    skipped: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "policy_version": self.policy_version,
                "consumed": self.consumed,
                "dropped": self.dropped,
                "skipped": self.skipped,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RunState:
        """Parses ``state.json``; ValueError naming the first field that is missing or of the wrong kind."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"expected an object, got {type(data).__name__}")
        for name in ("step", "policy_version"):
            if not _count(data.get(name)):
                raise ValueError(f"{name} must be an integer >= 0, got {data.get(name)!r}")
        data.setdefault("skipped", {})  # a checkpoint written before it was kept
        for name in ("consumed", "dropped", "skipped"):
            value = data.get(name)
            if not isinstance(value, dict) or not all(isinstance(k, str) and _count(v) for k, v in value.items()):
                raise ValueError(f"{name} must map strings to integers >= 0")
        fields = (dict(data[name]) for name in ("consumed", "dropped", "skipped"))
        return cls(data["step"], data["policy_version"], *fields)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or must not be resumed from; the message says which and why."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def _is_checkpoint_name(name: str) -> bool:
    return name.startswith(PREFIX) and name[len(PREFIX) :].isdigit()


def missing_files(path: Path) -> list[str]:
    return [name for name in FILES if not (path / name).is_file()]


def is_complete(path: Path) -> bool:
    return path.is_dir() and _is_checkpoint_name(path.name) and not missing_files(path)


class Checkpoints:
    """Saves, finds, loads and prunes the checkpoints of one run. ``save`` and ``load`` are collective:
    every rank calls them (the full state dicts are gathered from FSDP shards); rank 0 writes."""

    def __init__(self, root: Path, keep: int, *, is_writer: bool = True) -> None:
        self.root = root
        self.keep = keep
        self.is_writer = is_writer
        if is_writer:
            try:
                root.mkdir(parents=True, exist_ok=True)
                for stale in root.glob(".tmp-*"):  # left by a crash mid-write (or mid-prune); never loadable
                    shutil.rmtree(stale, ignore_errors=True)
                probe = self._scratch("probe")
                probe.write_bytes(b"")  # before the first step is trained, not after it
                probe.unlink()
            except OSError as exc:
                raise CheckpointError(f"checkpoint directory {root} is not writable: {exc}") from exc

    def _directories(self) -> list[Path]:
        """Every ``step-<n>`` directory, oldest first; anything else there is ignored (with a warning)."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.glob(f"{PREFIX}*"):
            if path.is_dir() and _is_checkpoint_name(path.name):
                found.append(path)
            else:
                log.warning("not a checkpoint, ignored", extra={"path": str(path)})
        return sorted(found, key=_step_of)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return [p for p in self._directories() if is_complete(p)]

    def newest(self) -> Path | None:
        """The newest checkpoint, which must be complete: a damaged one (files missing) is refused with
        CheckpointError rather than passed over for an older one (the module docstring says why). Older
        damaged ones are passed over with a warning. ``latest`` is written last, so a checkpoint renamed
        into place just before a crash is newer than ``latest``; it is complete and preferred."""
        directories = self._directories()
        if not directories:
            return None
        newest = directories[-1]
        if missing := missing_files(newest):
            raise CheckpointError(
                f"newest checkpoint {newest} is damaged: {', '.join(missing)} missing{self._way_out(newest)}"
            )
        for path in directories[:-1]:
            if missing := missing_files(path):
                log.warning("an older checkpoint is damaged, ignored", extra={"path": str(path), "missing": missing})
        return newest

    def check_newest(self) -> Path | None:
        """The newest checkpoint after a quick look at its files, loading nothing (``molt up``'s preflight):
        what ``load`` would refuse for missing files, a state.json that does not parse, or a ``.pt`` that
        is not a whole torch archive (a truncated one). Raises CheckpointError with the way out."""
        newest = self.newest()
        if newest is None:
            return None
        try:
            _read_state(newest)
            for name in FILES:
                if name.endswith(".pt") and not zipfile.is_zipfile(newest / name):
                    raise CheckpointError(f"{newest / name} is unreadable (not a whole torch archive: truncated?)")
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}{self._way_out(newest)}") from exc
        return newest

    def save(self, trainer: Trainer, state: RunState) -> Path:
        """Writes the checkpoint of ``state.step`` (collective); returns its directory.

        Every file goes into ``.tmp-step-.../``, each fsynced, then the directory is renamed to its
        final name (atomic) and the parent fsynced, then ``latest`` is replaced the same way, then
        older checkpoints are pruned (each renamed to ``.tmp-...`` before it is deleted)."""
        model_state = get_model_state_dict(trainer.model, options=FULL)
        if trainer.lora:  # the adapters; the frozen base is named by its identity, not copied
            model_state = {name: model_state[name] for name in adapter_names(model_state)}
        optimizer_state = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=FULL)
        final = self.root / f"{PREFIX}{state.step:08d}"
        if self.is_writer:
            extra = {
                "scheduler": trainer.scheduler.state_dict(),
                "kl_coef": trainer.kl.coef,
                "lora_base": trainer.base,
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            }
            if trainer.critic is not None:  # replicated on every rank: rank 0's copy is the whole state
                extra["critic"] = {
                    "model": trainer.critic.state_dict(),
                    "optimizer": trainer.critic_optimizer.state_dict(),
                    "scheduler": trainer.critic_scheduler.state_dict(),
                }
            tmp = self._scratch(final.name)
            try:
                tmp.mkdir()
                torch.save(model_state, tmp / "model.pt")
                torch.save(optimizer_state, tmp / "optimizer.pt")
                torch.save(extra, tmp / "extra_state.pt")
                (tmp / "state.json").write_text(state.to_json())
                for name in FILES:
                    _fsync(tmp / name)
                _fsync(tmp)
            except (OSError, RuntimeError) as exc:  # torch reports a full disk as "unexpected pos ..."
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(
                    f"could not write checkpoint {final.name} into {self.root} (is the disk full?): {exc}"
                ) from exc
            if final.exists():  # left by an abandoned lineage (a manual restart from an older checkpoint)
                log.warning("replacing an existing checkpoint", extra={"path": str(final)})
                self._remove(final)
            tmp.rename(final)
            _fsync(self.root)
            self._point_latest(final)
            self._prune()
            log.info("checkpoint written", extra={"step": state.step, "path": str(final)})
        if dist.is_initialized():
            dist.barrier()
        return final

    def _point_latest(self, target: Path) -> None:
        tmp = self._scratch(LATEST)
        tmp.write_text(target.name + "\n")
        _fsync(tmp)
        tmp.replace(self.root / LATEST)
        _fsync(self.root)

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep]:
            self._remove(old)

    def _scratch(self, name: str) -> Path:
        """A fresh ``.tmp-`` path under the root: whatever is left there after a crash is cleared at start."""
        return self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"

    def _remove(self, checkpoint: Path) -> None:
        """Deletes a checkpoint directory, renamed to a scratch path first: a crash mid-delete leaves a
        ``.tmp-`` directory, never a damaged ``step-<n>``."""
        doomed = self._scratch(f"removed-{checkpoint.name}")
        checkpoint.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def _way_out(self, damaged: Path) -> str:
        """What to do about a damaged checkpoint: resume from the newest complete one before it."""
        complete = [p for p in self._directories() if _step_of(p) < _step_of(damaged) and is_complete(p)]
        if not complete:
            return "; no complete checkpoint is left: move the directory aside to start over"
        return (
            f"; to resume from {complete[-1].name} instead (the steps after it are retrained only if their "
            f"queue entries are still pending, which after a checkpoint they are not), move {damaged.name} aside"
        )

    @staticmethod
    def _read_all(path: Path) -> tuple[RunState, tuple[Any, Any, Any]]:
        if missing := missing_files(path):
            raise CheckpointError(f"{path} is not a complete checkpoint: {', '.join(missing)} missing")
        state = _read_state(path)
        return state, tuple(_read(path / name) for name in ("model.pt", "optimizer.pt", "extra_state.pt"))  # type: ignore[return-value]

    def load(self, trainer: Trainer, path: Path) -> RunState:
        """Restores model, optimizer, scheduler, RNG and step from ``path`` (collective). Every file is
        read and checked before anything is loaded into the trainer: a damaged checkpoint raises
        CheckpointError naming the file and the way out, and leaves the trainer as it was."""
        try:
            state, (model_state, optimizer_state, extra) = self._read_all(path)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}{self._way_out(path)}") from exc
        if trainer.critic is not None and "critic" not in extra:
            raise CheckpointError(f"{path} holds no critic; it was not written by a gae run")
        if trainer.lora or extra.get("lora_base"):
            _check_lora(trainer, extra.get("lora_base"), path, set(model_state))
        try:
            # Under LoRA the checkpoint holds the adapters alone: the base weights stay as loaded.
            options = StateDictOptions(full_state_dict=True, strict=not trainer.lora)
            set_model_state_dict(trainer.model, model_state, options=options)
        except RuntimeError as exc:  # another model's shapes or names
            raise CheckpointError(
                f"{path / 'model.pt'} does not fit the model {trainer.settings.model_path}: {exc}"
            ) from exc
        set_optimizer_state_dict(
            trainer.model, trainer.optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True)
        )
        trainer.scheduler.load_state_dict(extra["scheduler"])
        trainer.kl.coef = float(extra.get("kl_coef", trainer.kl.coef))  # adaptive KL goes on where it was
        if trainer.critic is not None:
            trainer.critic.load_state_dict(extra["critic"]["model"])
            trainer.critic_optimizer.load_state_dict(extra["critic"]["optimizer"])
            trainer.critic_scheduler.load_state_dict(extra["critic"]["scheduler"])
        torch.set_rng_state(extra["torch_rng"])
        random.setstate(extra["python_rng"])
        _warn_if_lr_changed(trainer, path)
        trainer.step = state.step
        trainer.version_offset = state.policy_version - state.step
        log.info("resumed from checkpoint", extra={"step": state.step, "path": str(path)})
        return state


def _check_lora(trainer: Trainer, saved: dict[str, str] | None, path: Path, names: set[str]) -> None:
    """Adapters go back only onto the base model they were trained on, only into a LoRA run, and only
    into the same adapters (another rank or target_modules would leave some untrained, silently)."""
    if not trainer.lora:
        raise CheckpointError(f"{path} holds LoRA adapters ([learner.lora] rank > 0), and this run has none")
    assert trainer.base is not None
    try:
        check_base(saved, trainer.base, path)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    wanted = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    if names != wanted:
        missing, extra = sorted(wanted - names)[:3], sorted(names - wanted)[:3]
        raise CheckpointError(
            f"{path}'s adapters are not this run's [learner.lora] adapters (another target_modules?): "
            f"missing {missing}, unexpected {extra}"
        )


def _read_state(path: Path) -> RunState:
    try:
        state = RunState.from_json((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / 'state.json'} is unreadable: {exc}") from exc
    if state.step != _step_of(path):
        raise CheckpointError(f"{path / 'state.json'} holds step {state.step}, its directory says {_step_of(path)}")
    return state


def _read(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: torch's own messages do not name it
        raise CheckpointError(f"{path} is unreadable ({type(exc).__name__}: {exc or 'empty or truncated'})") from exc


def _warn_if_lr_changed(trainer: Trainer, path: Path) -> None:
    """The schedule continues from the checkpoint's base learning rate: a recipe that changed ``lr``
    since is not applied, which is said, not left to be found in the metrics."""
    saved = trainer.scheduler.base_lrs[0] if trainer.scheduler.base_lrs else None
    wanted = trainer.settings.optimizer.lr
    if saved is not None and not math.isclose(saved, wanted, rel_tol=1e-9):
        log.warning(
            "the recipe's learning rate differs from the checkpoint's; the checkpoint's schedule continues",
            extra={"checkpointLr": saved, "recipeLr": wanted, "path": str(path)},
        )
