"""Where the learner's numbers go: ``<run_dir>/metrics.jsonl`` (one line per step), Prometheus
gauges ``molt_learner_*``, TensorBoard events under ``<run_dir>/tensorboard``, W&B when configured
(``wandb_sink.py``) and the reward curve
``<run_dir>/reward.png``, redrawn every ``plot_every`` steps in a background thread (a drawing
costs enough CPU that on the training loop's path it delayed the refit of its step).

After a restart the JSONL keeps the lines of steps that were lost with the crash;
a reader takes the *last* line of each step (``read_history`` does). TensorBoard
drops the lost steps itself (``purge_step``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

Series = tuple[list[int], list[float], list[float]]  # steps, reward mean, reward std

STEP = Gauge("molt_learner_step", "Optimizer steps completed.")
POLICY_VERSION = Gauge("molt_learner_policy_version", "Policy version of the learner's weights.")
LAST_CHECKPOINT_STEP = Gauge("molt_learner_last_checkpoint_step", "Step of the newest complete checkpoint.")
IDLE_SECONDS = Gauge("molt_learner_idle_seconds", "Seconds since the last trajectory group arrived.")
READY_GROUPS = Gauge("molt_learner_ready_groups", "Groups read and waiting for the next step.")
CONSUMED = Counter("molt_learner_consumed_trajectories_total", "Trajectories trained on.")
DROPPED = Counter("molt_learner_dropped_trajectories_total", "Trajectories dropped before training.", ["reason"])
STEP_SECONDS = Histogram("molt_learner_step_seconds", "Wall time of one optimizer step.")
# Per-step values, keyed by their name in metrics.jsonl.
STEP_GAUGES = {
    key: Gauge(f"molt_learner_{key.replace('/', '_')}", doc)
    for key, doc in {
        "reward/mean": "Mean episode reward of the last step.",
        "reward/std": "Std of the episode rewards of the last step.",
        "advantage/mean": "Mean advantage over loss tokens.",
        "advantage/std": "Std of the advantages over loss tokens.",
        "loss/policy": "Per-token mean policy loss.",
        "clip_fraction": "Fraction of loss tokens where the clipped surrogate was chosen.",
        "is_ratio_mean": "Mean trainer/engine probability ratio.",
        "is_filter_ratio": "Fraction of IS units rejected (masked).",
        "vllm_kl": "k1 estimate of KL(rollout || trainer); under routing replay, with the engine's experts.",
        "vllm_kl_unreplayed": "vllm_kl of the same micro-batches without routing replay (compare_unreplayed).",
        "routing_agreement": "Fraction of (token, MoE layer) cells where the trainer's router picks the engine's "
        "experts (routing replay).",
        "kl": "KL estimate to the reference model.",
        "entropy": "Mean next-token entropy over loss tokens.",
        "grad_norm": "Gradient norm before clipping.",
        "lr": "Learning rate of the last step.",
        "tokens_per_s": "Trained tokens per second of step time.",
        "staleness/mean": "Mean policy-version lag of the trained tokens.",
        "staleness/max": "Largest policy-version lag of the trained tokens.",
    }.items()
}


def read_history(path: Path) -> dict[int, dict[str, float]]:
    """The metrics of each step in ``path`` (the last line of a step wins: earlier ones were lost)."""
    history: dict[int, dict[str, float]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                history[int(record["step"])] = record
    return history


class StepSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """Writes each step's metrics to every sink; one per run, on rank 0."""

    def __init__(self, run_dir: Path, *, plot_every: int, resumed_step: int = 0, sink: StepSink | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = run_dir / "metrics.jsonl"
        self.plot_path = run_dir / "reward.png"
        self.plot_every = plot_every
        self.history = {s: r for s, r in read_history(self.jsonl).items() if s <= resumed_step}
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resumed_step + 1)
        self.drawer = ThreadPoolExecutor(1, thread_name_prefix="reward-plot")
        self.drawing: Future[None] | None = None
        self.sink = sink  # one more place each step goes (W&B)

    def record(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        with self.jsonl.open("a") as out:
            out.write(json.dumps(record) + "\n")
        self.history[step] = record
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
            if key in STEP_GAUGES:
                STEP_GAUGES[key].set(value)
        if self.sink is not None:
            self.sink.log(step, metrics)
        STEP.set(step)
        if "step_seconds" in metrics:
            STEP_SECONDS.observe(metrics["step_seconds"])
        if step % self.plot_every == 0 and (self.drawing is None or self.drawing.done()):
            self.drawing = self.drawer.submit(self._draw_logged, self._series())  # busy: skip this refresh

    def plot(self) -> None:
        """Redraws the reward curve now (after any drawing in progress)."""
        if self.drawing is not None:
            self.drawing.result()
        self._draw(self._series())

    def _series(self) -> Series:
        steps = sorted(s for s, r in self.history.items() if "reward/mean" in r)
        return (
            steps,
            [self.history[s]["reward/mean"] for s in steps],
            [self.history[s].get("reward/std", 0.0) for s in steps],
        )

    def _draw_logged(self, series: Series) -> None:
        try:
            self._draw(series)
        except Exception:  # a refresh that fails must not stop training; the final plot() raises
            log.exception("could not redraw the reward curve", extra={"path": str(self.plot_path)})

    def _draw(self, series: Series) -> None:
        """Draws mean +- std per step and replaces the PNG atomically (matplotlib's object API, no
        pyplot: its global state is not for threads)."""
        from matplotlib.figure import Figure

        steps, mean, std = series
        if not steps:
            return
        figure = Figure(figsize=(6, 3.5), dpi=100)
        axes = figure.subplots()
        axes.plot(steps, mean, label="reward mean")
        axes.fill_between(
            steps,
            [m - d for m, d in zip(mean, std, strict=True)],
            [m + d for m, d in zip(mean, std, strict=True)],
            alpha=0.2,
            label="± std",
        )
        axes.set_xlabel("step")
        axes.set_ylabel("episode reward")
        axes.legend(loc="best")
        figure.tight_layout()
        tmp = self.plot_path.with_suffix(".tmp.png")
        figure.savefig(tmp)
        os.replace(tmp, self.plot_path)

    def close(self) -> None:
        """Draws the final curve (a failure is logged: the run's outputs matter more), flushes the rest."""
        try:
            self.plot()
        except Exception:
            log.exception("could not draw the final reward curve", extra={"path": str(self.plot_path)})
        finally:
            self.drawer.shutdown()
            self.writer.close()
            if self.sink is not None:
                self.sink.close()
