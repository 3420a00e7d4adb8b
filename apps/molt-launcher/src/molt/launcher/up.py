"""``molt up``: one run of a recipe - Redis, a Ray head, SFT warm-up, the four services - until the
learner reaches ``max_steps`` or the user stops it.

Start order: embedded redis-server (when no ``[run] redis_url``) -> local Ray head (when no
``[launcher] ray_address``) -> ``molt-learner --mode sft`` to completion (with ``sft_warmup``) ->
router (healthy) -> broadcaster -> learner -> agent-pool. Stop order is the reverse, each
process with SIGTERM, a grace period, then SIGKILL of its whole session (``molt.core.processes``).

Run directory: ``config.toml`` (the effective recipe every service reads), ``settings.json``
(each service's resolved settings and the plan), ``logs/<service>.log``, ``state.json``, and
what the services write there: ``metrics.jsonl``, ``eval.jsonl``, ``checkpoints/``,
``sft-model/``, ``reward.png`` (redrawn here at the end with the eval curve on it).
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TextIO

from molt.core.auth import Access
from molt.core.config import RunSettings
from molt.core.errors import ConfigError
from molt.core.processes import (
    ChildProcess,
    RedisServer,
    start_ray_head,
    start_ticks,
    wait_serving,
)
from molt.launcher.plan import Plan, embedded_redis, plan_or_raise, preflight
from molt.launcher.progress import Snapshot, gather, plot_rewards, status_line, summary
from molt.launcher.recipe import SERVICES, Recipe, connect_address, is_model_dir, resolve_services, to_toml, wire
from molt.launcher.run_secrets import embedded_redis_server, run_token
from molt.launcher.state import ProcessRecord, RunState
from molt.launcher.supervise import Restarts, cause_of, how_it_ended
from molt.v1 import agent_pool_pb2, learner_pb2, rollout_pb2, weights_pb2

log = logging.getLogger(__name__)

# gRPC service each console script serves; its health check names it, proving the right server answers.
HEALTH_SERVICES = {
    "router": rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name,
    "broadcaster": weights_pb2.DESCRIPTOR.services_by_name["WeightService"].full_name,
    "learner": learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name,
    "agent_pool": agent_pool_pb2.DESCRIPTOR.services_by_name["AgentPoolService"].full_name,
}
# Children must not route Ray workers through `uv run` (see molt.router.__main__); unbuffered logs;
# `ray start` turns token auth on and clients only send the token (~/.ray/auth_token) in token mode.
CHILD_ENV = {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "token"}


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: stop the run."""


def script(name: str) -> str:
    """A console script of this environment (beside the running interpreter), else from PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        raise ConfigError(f"{name} is not installed in this environment (uv sync installs it)")
    return found


class Launch:
    """One ``molt up``: starts the pieces in order, shows progress, stops them in reverse order."""

    def __init__(self, recipe: Recipe, plan: Plan, run_dir: Path, out: TextIO) -> None:
        self.recipe, self.plan, self.run_dir, self.out = recipe, plan, run_dir, out
        self.state = RunState.new(run_dir, recipe.path)
        self.state.run_id, self.state.max_steps = recipe.learner.run.run_id, recipe.learner.max_steps
        self.children: dict[str, ChildProcess] = {}  # in start order
        self.redis: RedisServer | None = None
        self.stopping = False
        self.restarts = Restarts(recipe.launcher.restarts, recipe.launcher.restart_backoff_s)
        self.engineless_polls = 0  # status lines in a row on which the router had no live engine
        self.config_path = run_dir / "config.toml"
        self.access = Access()  # the run's token and TLS, once the config is written

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            self.say(f"molt: {signal.Signals(signum).name} again; still stopping (molt down forces it)")
            return
        raise Interrupted(signal.Signals(signum).name)

    def _record(self, name: str, child: ChildProcess, address: str | None = None, service: str = "") -> None:
        assert child.pid is not None
        self.state.processes[name] = ProcessRecord(
            child.pid, start_ticks(child.pid), str(child.log_path), address, service
        )
        self.state.save()

    def _env(self, gpus: tuple[int, ...] | None) -> dict[str, str]:
        if gpus is None or self.plan.gpus_per_node == 0:
            return dict(CHILD_ENV)
        return {**CHILD_ENV, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}

    def run(self) -> int:
        """The whole run; returns the exit code (0: the learner finished its steps)."""
        started = time.monotonic()
        previous = {sig: signal.signal(sig, self._signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        code = 1
        try:
            self._start_infrastructure()
            self._sft()
            self._start_services()
            code = self._monitor(started)
            if code != 0:
                self.state.phase = "failed"
        except Interrupted as exc:
            self.say(f"molt: {exc}; stopping the run")
            code = 130
        except (RuntimeError, ConfigError, OSError) as exc:
            self.say(f"molt: {exc}")
            self.state.phase = "failed"
        finally:
            self.stopping = True
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        plot = plot_rewards(self.run_dir)
        self.say(summary(self.run_dir, time.monotonic() - started))
        if self.restarts.counts:
            self.say(f"restarts: {self.restarts.describe()} (each announced above, with its cause)")
        if plot is not None:
            self.say(f"reward curve: {plot}")
        return code

    def _start_infrastructure(self) -> None:
        for sub in ("logs", "checkpoints"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self.state.save()
        model = self.recipe.learner.model_path
        kind = self.recipe.launcher.build_tiny_model
        if kind and not is_model_dir(model):
            from molt.core.tiny_model import build

            moe = kind == "moe"
            self.say(f"molt: building the tiny {'MoE ' if moe else ''}model at {model}")
            build(model, moe=moe, arch="qwen3" if moe else "qwen2")
        redis_url = None
        token_file = run_token(self.recipe, self.run_dir)
        if embedded_redis(self.recipe):
            self.redis = embedded_redis_server(self.run_dir, token_file, self.state.run_id)
            self.redis.start()
            redis_url = self.redis.url
            assert self.redis.process is not None
            pid = self.redis.process.pid
            self.state.processes["redis"] = ProcessRecord(pid, start_ticks(pid), str(self.run_dir / "redis"))
            self.say(f"molt: redis-server at {redis_url}")
        ray_address = self.recipe.launcher.ray_address or self._start_ray_head()
        self.state.redis_url = redis_url or self.recipe.learner.run.redis_url
        self.state.ray_address = ray_address
        tables = wire(self.recipe, self.run_dir, redis_url, ray_address, self.plan.engine_nodes(), token_file)
        self.config_path.write_text(to_toml(tables))
        self.access = Access.of(RunSettings(**tables["run"]))
        resolved = resolve_services(tables, without=self.recipe.launcher.without)  # what each service loads
        snapshot = {
            "recipe": str(self.recipe.path),
            "launcher": self.recipe.launcher.model_dump(mode="json"),
            "services": {name: s.model_dump(mode="json") for name, s in resolved.items()},
            "plan": [vars(p) for p in self.plan.placements],
        }
        (self.run_dir / "settings.json").write_text(json.dumps(snapshot, indent=2, default=str) + "\n")
        self.state.save()

    def ray_gpus(self) -> tuple[int, ...]:
        """Node 0's GPUs that its Ray head registers: the engines', plus the learner's when Ray places its ranks."""
        gpus = self.plan.gpus("router", 0)
        if self.recipe.learner.placement == "ray":
            gpus = tuple(sorted(gpus + self.plan.gpus("learner", 0)))
        return gpus

    def rollout_nice(self) -> int:
        """``[launcher] rollout_nice``; unset: 10 on a CPU run, 0 with GPUs."""
        configured = self.recipe.launcher.rollout_nice
        if configured is not None:
            return configured
        return 10 if self.plan.gpus_per_node == 0 else 0

    def _start_ray_head(self) -> str:
        """A local Ray head (``molt.core.processes.start_ray_head``); returns its address."""
        ray_gpus = self.ray_gpus()
        head, address, temp_dir = start_ray_head(
            script("ray"),
            self.run_dir / "logs" / "ray.log",
            num_cpus=self.plan.cpus_per_node,
            num_gpus=len(ray_gpus),
            port=self.recipe.launcher.ray_port,
            env=self._env(ray_gpus),
            # Ray-placed learner ranks are Ray workers too: then the head keeps the default priority.
            nice=self.rollout_nice() if self.recipe.learner.placement == "local" else 0,
        )
        self.children["ray"] = head
        self._record("ray", head)
        self.state.ray_temp_dir = str(temp_dir)
        self.say(f"molt: Ray head at {address} (logs under {temp_dir})")
        return address

    def _sft(self) -> None:
        output = self.recipe.sft_output(self.run_dir)
        if output is None:
            return
        if is_model_dir(output):
            self.say(f"molt: SFT model already at {output}; skipping the warm-up (delete it to redo)")
            return
        self.state.phase = "sft"
        self.say(f"molt: SFT warm-up -> {output}")
        args = [script("molt-learner"), "--config", str(self.config_path), "--mode", "sft"]
        args += ["--model_path", str(self.recipe.learner.model_path)]
        sft = ChildProcess(args, self.run_dir / "logs" / "learner-sft.log", self._env(self.plan.gpus("learner", 0)))
        self.children["learner-sft"] = sft
        process = sft.spawn()
        self._record("learner-sft", sft)
        code = process.wait()
        del self.children["learner-sft"]
        if code != 0:
            raise RuntimeError(f"SFT warm-up exited with {code}; see {sft.log_path}")

    def _start_services(self) -> None:
        timeout = self.recipe.launcher.start_timeout_s
        for name, settings in self.recipe.services.items():
            address = connect_address(settings.listen)  # type: ignore[attr-defined]
            args = [script(SERVICES[name][1]), "--config", str(self.config_path)]
            # A learner placed by Ray is only its driver here; Ray gives each rank its GPU.
            placed_here = name == "learner" and self.recipe.learner.placement == "local"
            gpus = self.plan.gpus("learner", 0) if placed_here else None
            if name == "learner" and self.plan.gpus_per_node == 0 and not self.recipe.learner.cpu_threads:
                # A CPU rank reserves one CPU in the plan. torch's default (a thread per core) would also
                # run on the engine's core and oversubscribe it: 1.85x slower steps on 2 cores (bench/async.py).
                args += ["--cpu_threads", "1"]
            nice = 0 if name == "learner" else self.rollout_nice()
            self.children[name] = ChildProcess(args, self.run_dir / "logs" / f"{name}.log", self._env(gpus), nice)
            self._spawn_service(name, address, timeout)
        self.state.phase = "running"
        self.state.save()

    def _spawn_service(self, name: str, address: str, timeout_s: float) -> None:
        """Starts ``self.children[name]`` (again) and waits until it serves."""
        child = self.children[name]
        process = child.spawn()
        self._record(name, child, address, HEALTH_SERVICES[name])
        self.say(f"molt: starting {name} at {address} (log {child.log_path})")
        began = time.monotonic()
        try:
            wait_serving(address, HEALTH_SERVICES[name], timeout_s, process, self.access)
        except RuntimeError as exc:
            raise RuntimeError(f"{name} {exc}{cause_of(child.log_path)}; see {child.log_path}") from exc
        self.say(f"molt: {name} healthy after {time.monotonic() - began:.0f} s")

    def _monitor(self, started: float) -> int:
        """Prints the status line until the learner exits on its own (the run's end); restarts whatever
        else dies (``molt.launcher.supervise``) while the budget lasts."""
        every = self.recipe.launcher.progress_every_s
        previous: Snapshot | None = None
        while True:
            # Redis first: a service that died of a dead Redis must not be restarted into it.
            if self.redis is not None and self.redis.process is not None and self.redis.process.poll() is not None:
                self._restart_redis(self.redis.process.returncode)
            for name, child in list(self.children.items()):
                code = child.process.poll() if child.process is not None else None
                if code is None:
                    continue
                if name == "learner" and code == 0:
                    self.say("molt: the learner exited with 0")
                    return 0
                self._restart(name, code)
            state = self.state
            snap = gather(state.addresses(), state.redis_url, state.run_id, self.run_dir, state.max_steps, self.access)
            self._restart_router_without_engines(snap)
            line = status_line(snap, time.monotonic() - started, previous)
            if self.restarts.counts:
                line += f" | restarts: {self.restarts.describe()}"
            self.say(line)
            previous = snap
            time.sleep(every)

    def _restart_router_without_engines(self, snap: Snapshot) -> None:
        """A router all of whose engines died, and which is not replacing them (``[router]
        replace_dead_engines`` off, or between failed tries), serves nothing, yet runs: restarted, it
        starts new ones (at version 0; the broadcaster and the learner bring them up to date). Two status
        lines in a row, so that a router still starting its engines is left alone."""
        dead = (snap.engines_healthy or "").startswith("0/") and not snap.engines_replacing
        self.engineless_polls = self.engineless_polls + 1 if dead else 0
        if self.engineless_polls >= 2:
            self.engineless_polls = 0
            self._restart("router", None, "has no live engine left")

    def _spend_restart(self, name: str, code: int | None, log_path: Path, why: str = "did not serve") -> None:
        """Announces the death of ``name`` and waits out its backoff; raises when no restart is left."""
        delay = self.restarts.take(name)
        # Dead: how it ended and its log's word why; alive but useless (or never serving): ``why``.
        died = f"{name} {how_it_ended(code)}{cause_of(log_path, code)}" if code is not None else f"{name} {why}"
        if delay is None:
            why = "the Ray head is never restarted" if name == "ray" else "no restart left"
            raise RuntimeError(f"{died} ({why}); see {log_path}")
        self.state.restarts = dict(self.restarts.counts)
        self.state.save()
        self.say(f"molt: {died}; restarting it in {delay:.0f} s ({self.restarts.left} restart(s) left; see {log_path})")
        time.sleep(delay)

    def _restart(self, name: str, code: int | None, why: str = "did not serve") -> None:
        """Starts ``name`` again; one that fails to serve again (its port still taken, ...) costs another."""
        child = self.children[name]
        address = connect_address(self.recipe.services[name].listen)  # type: ignore[attr-defined]
        while True:
            self._spend_restart(name, code, child.log_path, why)
            why = "did not serve"
            child.stop(timeout_s=10)  # what is left of its session (a Ray-placed learner's ranks)
            try:
                self._spawn_service(name, address, self.recipe.launcher.start_timeout_s)
                return
            except RuntimeError as exc:
                self.say(f"molt: {exc}")
                code = child.process.poll() if child.process is not None else None

    def _restart_redis(self, code: int) -> None:
        """The embedded redis-server again, on its port and data directory (AOF: nothing acknowledged is lost)."""
        assert self.redis is not None
        self._spend_restart("redis", code, self.redis.data_dir / "redis.log")
        self.redis.start(port=self.redis.port)
        assert self.redis.process is not None
        pid = self.redis.process.pid
        self.state.processes["redis"] = ProcessRecord(pid, start_ticks(pid), str(self.redis.data_dir))
        self.state.save()
        self.say(f"molt: redis-server back at {self.redis.url}")

    def _stop_all(self) -> None:
        """Stops every child, newest first; the agent-pool gets its longer grace (final evaluation)."""
        self.state.phase = "stopping" if self.state.phase != "failed" else "failed"
        self._save_state()
        launcher = self.recipe.launcher
        for name in reversed(list(self.children)):
            child = self.children[name]
            if child.process is None:
                continue
            timeout = launcher.agent_pool_stop_timeout_s if name == "agent_pool" else launcher.stop_timeout_s
            self.say(f"molt: stopping {name}")
            code = child.stop(timeout_s=timeout)
            log.info("stopped", extra={"child": name, "exitCode": code})
        if self.redis is not None:
            self.say("molt: stopping redis-server")
            self.redis.stop()
        self.state.phase = "stopped" if self.state.phase != "failed" else "failed"
        if self.state.ray_temp_dir and "ray" in self.children:
            if self.state.phase == "failed":  # its session logs (engine workers' included) may say why
                self.say(f"molt: Ray's session logs are kept under {self.state.ray_temp_dir}")
            else:
                shutil.rmtree(self.state.ray_temp_dir, ignore_errors=True)
                self.state.ray_temp_dir = None
        self._save_state()

    def _save_state(self) -> None:
        """While stopping: a run record that cannot be written must not keep the children running."""
        try:
            self.state.save()
        except OSError as exc:
            self.say(f"molt: could not record the run's state: {exc}")


def up(recipe: Recipe, run_dir: Path | None = None, out: TextIO = sys.stdout) -> int:
    """Validates ``recipe``, prints its plan and runs it in ``run_dir`` (default: its ``[run] run_dir``)."""
    plan = plan_or_raise(recipe)
    run_dir = (run_dir or recipe.learner.run.run_dir).absolute()
    if (run_dir / "state.json").exists():
        try:
            active = RunState.load(run_dir).launcher_alive()
        except ConfigError as exc:  # a torn record of an earlier run: this one writes a new one
            out.write(f"molt: ignoring the earlier run's record: {exc.message}\n")
            active = False
        if active:
            raise ConfigError(f"a run is already active in {run_dir} (molt status / molt down)")
    missing = preflight(recipe, run_dir)
    if missing:
        raise ConfigError(
            f"recipe {recipe.path} cannot run on this machine:\n" + "\n".join(f"  - {p}" for p in missing)
        )
    out.write(plan.render(f"plan for {recipe.path}:") + "\n")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".molt-write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"run directory {run_dir} is not writable: {exc}") from exc
    return Launch(recipe, plan, run_dir, out).run()
