"""The placement plan of a recipe (``molt plan``): which node, GPUs and CPUs each process takes.

The learner's ranks go to node 0 (one GPU, or one CPU, each; local processes or one Ray placement
group); each engine is a placement group of ``tensor_parallel_size`` GPUs on one node, placed
first-fit on what the learner left (one CPU bundle on a CPU run); the router, broadcaster,
agent-pool, Redis and the Ray head share node 0's CPUs. The plan is checked against the recipe's
``[launcher]`` resources (a ``PlanError`` says what was asked for and what is left), the recipe
against the learner's soundness rules, and the machine by ``preflight`` (docs/launcher.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import redis

from molt.agent_pool.dataset import names_local
from molt.core.errors import ConfigError
from molt.core.serve import ports_taken
from molt.launcher.recipe import Recipe, is_model_dir
from molt.learner.config import unsound_settings


class PlanError(ConfigError):
    """The recipe's processes do not fit its declared resources, or its services disagree."""


@dataclass(frozen=True)
class Placement:
    """One process (or engine) of a service on one node; ``cpus`` = CPUs it reserves (0 = shares)."""

    service: str
    process: str
    node: int
    gpus: tuple[int, ...] = ()
    cpus: int = 0


@dataclass(frozen=True)
class Plan:
    """Where everything of a run goes, on ``nodes`` x (``gpus_per_node`` GPUs, ``cpus_per_node`` CPUs)."""

    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    placements: tuple[Placement, ...]

    def gpus(self, service: str, node: int) -> tuple[int, ...]:
        """The GPU indices ``service`` takes on ``node``, sorted."""
        return tuple(sorted(g for p in self.placements if p.service == service and p.node == node for g in p.gpus))

    def engine_nodes(self) -> list[int]:
        """The node of each engine, engine 0 first (the router's ``[router.engine] nodes``)."""
        return [p.node for p in self.placements if p.service == "router" and p.process.startswith("engine ")]

    def render(self, title: str) -> str:
        """The plan as a table, one line per process."""
        lines = [title]
        for node in range(self.nodes):
            on_node = [p for p in self.placements if p.node == node]
            gpus = len({g for p in on_node for g in p.gpus})  # colocated processes share theirs
            cpus = sum(p.cpus for p in on_node)
            lines.append(
                f"node {node}: GPUs {gpus}/{self.gpus_per_node} used, CPUs {cpus}/{self.cpus_per_node} reserved"
            )
            for p in on_node:
                where = f"GPUs {','.join(map(str, p.gpus))}" if p.gpus else "no GPU"
                cpus_text = f"{p.cpus} CPU" if p.cpus else "shared CPUs"
                lines.append(f"  {p.service:<12} {p.process:<16} {where:<18} {cpus_text}")
        return "\n".join(lines)


def check_colocation(recipe: Recipe) -> None:
    """``[launcher] colocate``: one learner rank and one engine of one GPU share a GPU, and the refit goes
    through CUDA IPC from the learner to that engine (a rank on another GPU could not open its handles)."""
    engine = recipe.router.engine
    problems = []
    if recipe.launcher.gpus_per_node == 0:
        problems.append("it needs GPUs (gpus_per_node = 0)")
    if recipe.learner.data_parallel_size != 1 or engine.engine_count != 1 or engine.tensor_parallel_size != 1:
        problems.append(
            f"it shares one GPU between one learner rank and one engine of tensor_parallel_size 1; the recipe has "
            f"{recipe.learner.data_parallel_size} rank(s), {engine.engine_count} engine(s) of "
            f"tensor_parallel_size {engine.tensor_parallel_size}"
        )
    if recipe.broadcaster.backend not in ("auto", "cuda_ipc"):
        problems.append(f"its refit goes through CUDA IPC, but [broadcaster] backend = {recipe.broadcaster.backend!r}")
    if problems:
        raise PlanError("[launcher] colocate = true: " + "; ".join(problems))


def make_plan(recipe: Recipe) -> Plan:
    """Places the learner's ranks, the router's engines and the CPU services; raises ``PlanError``."""
    launcher = recipe.launcher
    nodes, gpus_per_node, cpus_per_node = launcher.nodes, launcher.gpus_per_node, launcher.cpus_per_node
    on_gpu = gpus_per_node > 0
    free_gpus = {n: list(range(gpus_per_node)) for n in range(nodes)}
    free_cpus = dict.fromkeys(range(nodes), cpus_per_node)
    placements: list[Placement] = []

    ranks = recipe.learner.data_parallel_size
    need, have, unit = (ranks, gpus_per_node, "GPUs") if on_gpu else (ranks, cpus_per_node, "CPUs")
    if need > have:
        raise PlanError(
            f"learner: data_parallel_size = {ranks} ranks need {need} {unit} on one node (its ranks share node "
            f"0), but [launcher] declares {have} {unit} per node"
        )
    if launcher.colocate:
        check_colocation(recipe)
    for rank in range(ranks):
        # Colocated, the engine takes the same GPU: the learner's rank leaves it in the free list.
        gpus = ((free_gpus[0][rank] if launcher.colocate else free_gpus[0].pop(0)),) if on_gpu else ()
        placements.append(Placement("learner", f"rank {rank}", 0, gpus, 1))
        free_cpus[0] -= 1

    engine = recipe.router.engine
    tp = engine.tensor_parallel_size
    if on_gpu and tp > gpus_per_node:
        raise PlanError(
            f"router: tensor_parallel_size = {tp} GPUs per engine, but a node has {gpus_per_node}; "
            f"an engine's tensor-parallel workers must share a node"
        )
    for index in range(engine.engine_count):
        fits = [n for n in range(nodes) if free_cpus[n] >= 1 and (not on_gpu or len(free_gpus[n]) >= tp)]
        node = fits[0] if fits else None
        if node is None:
            left = {n: len(free_gpus[n]) for n in range(nodes)} if on_gpu else free_cpus
            asked = f"{engine.engine_count} engines x {tp} GPUs" if on_gpu else f"{engine.engine_count} engines x 1 CPU"
            raise PlanError(
                f"router: engine {index} does not fit: the recipe asks for {asked} beside {ranks} learner "
                f"rank(s) on {nodes} node(s) x {gpus_per_node} GPUs / {cpus_per_node} CPUs; "
                f"free {'GPUs' if on_gpu else 'CPUs'} per node after placing earlier processes: {left}"
            )
        gpus = tuple(free_gpus[node].pop(0) for _ in range(tp)) if on_gpu else ()
        placements.append(Placement("router", f"engine {index} (tp {tp})", node, gpus, 1))
        free_cpus[node] -= 1

    if launcher.sft_warmup:
        # Runs to completion before RL starts, on rank 0's device: it reserves nothing extra.
        placements.insert(0, Placement("learner", "sft (before RL)", 0, placements[0].gpus, 0))
    services = [name for name in ("router", "broadcaster", "agent_pool") if name in recipe.services]
    if launcher.ray_address is None:
        services.insert(0, "ray head")
    placements.extend(Placement(name, "process", 0) for name in services)
    placements.append(Placement("redis", "embedded" if embedded_redis(recipe) else "external", 0))
    return Plan(nodes, gpus_per_node, cpus_per_node, tuple(placements))


def embedded_redis(recipe: Recipe) -> bool:
    """Whether ``molt up`` starts its own redis-server: asked for, or no ``[run] redis_url`` given."""
    return recipe.launcher.embedded_redis or "redis_url" not in recipe.tables.get("run", {})


def refit_problems(refit_every: int, max_staleness: int, max_steps: int) -> list[str]:
    """A refit cadence the staleness bound cannot follow: the run would stall, not fail.

    The learner's policy version is its step; the engines sample under the last version refit to them.
    With a refit every k steps a sample can be k - 1 versions old when it is trained on, and with no
    refits (0) as old as the step itself; samples older than ``max_staleness`` are dropped and the
    agent-pool waits for a newer version, which never comes.
    """
    if refit_every == 0 and (max_steps == 0 or max_staleness < max_steps):
        return [
            f"learner.refit_every = 0 never sends the engines new weights: every sample stays at version 0 and is "
            f"older than rollout.max_staleness = {max_staleness} from step {max_staleness + 1} on, so the run "
            f"stalls there; set refit_every >= 1"
        ]
    if refit_every > 1 and max_staleness < refit_every - 1:
        return [
            f"learner.refit_every = {refit_every}: samples are up to {refit_every - 1} versions old between refits, "
            f"more than rollout.max_staleness = {max_staleness} allows, so the run stalls; set max_staleness >= "
            f"{refit_every - 1} or refit more often"
        ]
    return []


def check_recipe(recipe: Recipe) -> list[str]:
    """What makes the recipe unsound or inconsistent with the launcher (empty = runnable).

    Values several services share come from one [rollout] table, so the services cannot disagree;
    what is checked here is whether the learner would train on wrongly weighted data, whether refits
    keep up with the staleness bound, and what the launcher itself needs.
    """
    learner = recipe.learner
    problems = unsound_settings(learner.model_copy(update={"mode": "rl"}))
    problems += refit_problems(learner.refit_every, learner.rollout.max_staleness, learner.max_steps)
    if recipe.launcher.sft_warmup and learner.sft is None:
        problems.append("[launcher] sft_warmup = true needs a [learner.sft] table with data_path")
    pinned = recipe.router.engine.nodes
    if pinned and recipe.launcher.nodes > 1:
        problems.append(
            f"router.engine.nodes = {pinned}: on a cluster of several nodes molt up places the engines by its "
            "plan (molt plan shows it); leave router.engine.nodes unset"
        )
    if recipe.launcher.nodes > 1 and recipe.launcher.ray_address is None:
        problems.append(
            f"[launcher] nodes = {recipe.launcher.nodes}: a local Ray head is one node; set [launcher] "
            f"ray_address to the running cluster (recipes/slurm/molt.sbatch starts one)"
        )
    return problems


def preflight(recipe: Recipe, run_dir: Path | None = None) -> list[str]:
    """What this machine lacks for the recipe, checked before anything starts (empty = ready): model
    directories, data files, free listen and metrics ports, a reachable Redis, and (for a run directory
    that holds checkpoints) a newest checkpoint the learner can resume from. Each would otherwise
    surface a minute later as one service's crash."""
    problems: list[str] = []
    if run_dir is not None and (run_dir / "checkpoints").is_dir():
        from molt.learner.checkpoint import CheckpointError, Checkpoints  # torch: only when there is one

        try:
            Checkpoints(run_dir / "checkpoints", recipe.learner.keep_checkpoints, is_writer=False).check_newest()
        except CheckpointError as exc:
            problems.append(f"the learner cannot resume: {exc}")
    launcher, learner, pool, router = recipe.launcher, recipe.learner, recipe.agent_pool, recipe.router
    built = learner.model_path if launcher.build_tiny_model else None
    sft = launcher.sft_warmup and learner.sft is not None  # then the engines serve the warm-up's output
    models = [("learner.model_path", learner.model_path)]
    if not sft:
        models.append(("router.engine.model_path", router.engine.model_path))
        if built is not None and router.engine.model_path.resolve() != built.resolve():
            problems.append(
                f"[launcher] build_tiny_model builds learner.model_path = {str(built)!r}, but "
                f"router.engine.model_path = {str(router.engine.model_path)!r}: the engines would serve another "
                "model; give both one path"
            )
    for name, path in models:
        if path != built and not is_model_dir(path):
            problems.append(f"{name} = {str(path)!r} is not a model directory (no config.json)")
    files = []
    if sft and learner.sft is not None:
        files.append(("learner.sft.data_path", learner.sft.data_path))
    problems += [f"{name} = {str(path)!r} does not exist" for name, path in files if not path.is_file()]
    if pool is not None:
        datasets = [("agent_pool.data.path", pool.data.path)]
        if pool.eval.enabled and pool.eval.path is not None:
            datasets.append(("agent_pool.eval.path", pool.eval.path))
        # A hub id cannot be checked without the hub; a local path can.
        problems += [
            f"{name} = {path!r} does not exist"
            for name, path in datasets
            if names_local(path) and not Path(path).exists()
        ]
    for name, settings in recipe.services.items():
        problems += [f"{name}.{taken}" for taken in ports_taken(settings)]
    if not embedded_redis(recipe) and learner.run.redis_url:
        try:
            redis.Redis.from_url(learner.run.redis_url, socket_connect_timeout=3, socket_timeout=3).ping()
        except redis.RedisError as exc:
            problems.append(f"[run] redis_url = {learner.run.redis_url!r} does not answer: {exc}")
    return problems


def plan_or_raise(recipe: Recipe) -> Plan:
    """``check_recipe`` and ``make_plan`` together: the plan, or one ``PlanError`` listing every problem."""
    problems = check_recipe(recipe)
    try:
        plan = make_plan(recipe)
    except PlanError as exc:
        problems.insert(0, exc.message)
        plan = None
    if problems or plan is None:
        raise PlanError(f"recipe {recipe.path} cannot run:\n" + "\n".join(f"  - {p}" for p in problems))
    return plan
