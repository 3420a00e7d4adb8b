"""Held-out evaluation: the agent on test prompts, scored, never queued for training.

A pass runs every test prompt ``samples_per_prompt`` times through the training's episode
runner (same router, same sampling): at start, whenever the policy version crosses a multiple
of ``every_versions``, and at a graceful stop when the latest pass saw an older version. Each
pass appends one line to ``<run_dir>/eval.jsonl``::

    {"policy_version": 3, "mean_reward": 0.42, "episodes": 64, "failed": 0,
     "time": 1760000000.0, "token_versions": [3, 3], "duration_s": 12.5}

``policy_version``: the version when the pass started; ``token_versions``: the oldest and newest
version of the tokens sampled (a refit mid-pass widens it); ``mean_reward``: over the episodes that did not fail.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from molt.agent_pool import metrics
from molt.agent_pool.agents import Prompt
from molt.agent_pool.config import EvalSettings
from molt.agent_pool.episodes import Episode, EpisodeRunner, attempt

log = logging.getLogger(__name__)
POLL_S = 0.5


@dataclass(frozen=True)
class EvalResult:
    """One evaluation pass, as written to eval.jsonl."""

    policy_version: int
    mean_reward: float
    episodes: int
    failed: int
    time: float
    token_versions: list[int]
    duration_s: float


def due(last: int | None, current: int, every: int) -> bool:
    """Whether a pass is due: none yet, or the version crossed a multiple of ``every`` (0: never by cadence)."""
    if last is None:
        return True
    return every > 0 and current // every > last // every


class Evaluator:
    """Runs evaluation passes on a cadence of policy versions; ``close`` runs the final one."""

    def __init__(
        self,
        settings: EvalSettings,
        prompts: list[Prompt],
        runner: EpisodeRunner,
        policy_version: Callable[[], int],
        out_path: Path,
        episode_timeout_s: float,
        max_concurrent: int,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.policy_version = policy_version
        self.out_path = out_path
        self.timeout_s = episode_timeout_s
        self.prompts = prompts
        self.slots = asyncio.Semaphore(max_concurrent)
        self.results: list[EvalResult] = []
        self.task: asyncio.Task[None] | None = None
        self.current: asyncio.Task[EvalResult] | None = None
        self.running_version: int | None = None  # version of the pass in progress

    @property
    def last_version(self) -> int | None:
        return self.results[-1].policy_version if self.results else None

    def start(self) -> None:
        """Starts the cadence loop (its first pass runs at once)."""
        self.task = asyncio.create_task(self._loop())

    async def close(self, final: bool = True) -> None:
        """Stops the loop; with ``final``, makes sure the latest version has been evaluated.

        A pass already running on the current version is awaited, an older one is cancelled.
        """
        current = self.current
        if current is not None and not current.done() and self.running_version == self.policy_version():
            await asyncio.gather(asyncio.shield(current), return_exceptions=True)
        if self.task is not None:
            self.task.cancel()  # also cancels a pass of an older version still running
            await asyncio.gather(self.task, return_exceptions=True)
        if final and self.last_version != self.policy_version():
            try:
                await self.run_pass()
            except Exception:  # logged; the pool's shutdown goes on
                log.exception("final evaluation pass failed")

    async def _loop(self) -> None:
        while True:
            if due(self.last_version, self.policy_version(), self.settings.every_versions):
                self.current = asyncio.create_task(self.run_pass())
                try:
                    await self.current
                except Exception:  # a broken pass is logged; the next due version tries again
                    log.exception("evaluation pass failed")
            await asyncio.sleep(POLL_S)

    async def run_pass(self) -> EvalResult:
        """Evaluates every test prompt now; appends and returns the result."""
        version = self.policy_version()
        self.running_version = version
        started, wall = time.time(), time.monotonic()
        log.info("evaluation started", extra={"policy_version": version, "prompts": len(self.prompts)})
        try:
            work = [p for p in self.prompts for _ in range(self.settings.samples_per_prompt)]
            outcomes = await asyncio.gather(*(self._one(p) for p in work))
        finally:
            self.running_version = None
        episodes = [e for e in outcomes if e is not None]
        if not episodes:  # not a reward of 0: nothing was measured (a router down, an agent bug)
            raise RuntimeError(f"every one of the {len(outcomes)} evaluation episodes at version {version} failed")
        rewards = [e.reward for e in episodes]
        token_versions = [v for e in episodes for s in e.segments for v in s.versions]
        result = EvalResult(
            policy_version=version,
            mean_reward=sum(rewards) / len(rewards),
            episodes=len(episodes),
            failed=len(outcomes) - len(episodes),
            time=started,
            token_versions=[min(token_versions), max(token_versions)] if token_versions else [],
            duration_s=round(time.monotonic() - wall, 3),
        )
        self._record(result)
        return result

    async def _one(self, prompt: Prompt) -> Episode | None:
        async with self.slots:
            episode, _ = await attempt(self.runner, prompt, self.timeout_s, "eval")
            return episode

    def _record(self, result: EvalResult) -> None:
        metrics.EVAL_REWARD.set(result.mean_reward)
        metrics.EVAL_POLICY_VERSION.set(result.policy_version)
        metrics.EVAL_PASSES.inc()
        self.results.append(result)
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        with self.out_path.open("a") as out:
            out.write(json.dumps(asdict(result)) + "\n")
        log.info(
            "evaluation finished",
            extra={
                "policy_version": result.policy_version,
                "mean_reward": result.mean_reward,
                "episodes": result.episodes,
                "failed": result.failed,
                "duration_s": result.duration_s,
            },
        )
