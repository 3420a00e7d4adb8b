"""Starting, attaching to and stopping engine actors: their spec, placement group and name.

Each engine is the Ray actor ``molt-<engine_id>`` in the run's namespace, in a
placement group of its own (one CPU bundle on CPU; one GPU per tensor-parallel
worker on GPU). A router finds a running one by that name and attaches to it
(a detached engine outlives its router); otherwise it builds the engine's spec
from ``[router.engine]`` and starts it. With ``[router.engine] nodes`` the group's
bundles ask for the Ray node labelled ``molt/node=<index>`` (Ray's label selectors),
so an engine runs on the node the launcher's plan gave it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from molt.core.errors import ConfigError
from molt.router.config import RouterSettings
from molt.router.engine_actor import EngineActor
from molt.router.engine_spec import EngineSpec

log = logging.getLogger(__name__)

# The Ray node label naming a node's index in a molt cluster: node 0 runs the launcher and the learner.
NODE_LABEL = "molt/node"

# Engine arguments molt sets itself (overriding them would break logprob exactness or the refit hook)
# or that have their own [router.engine] setting.
RESERVED_ENGINE_ARGS = (
    "logprobs_mode",
    "worker_extension_cls",
    "model",
    "tokenizer",
    "tensor_parallel_size",
    "max_model_len",
    "gpu_memory_utilization",
    "seed",
    "dtype",
    "stream_interval",
)


def check_engine_args(settings: RouterSettings, use_gpu: bool) -> None:
    """Refuses ``router.engine.engine_args`` that molt reserves or that cannot work with the other settings."""
    engine = settings.engine
    reserved = sorted(set(engine.engine_args) & set(RESERVED_ENGINE_ARGS))
    if reserved:
        raise ConfigError(
            f"router.engine.engine_args may not set {reserved}: molt sets them itself or they have "
            "their own [router.engine] setting"
        )
    if settings.pause.kv_cache == "keep" and engine.engine_args.get("enable_prefix_caching"):
        raise ConfigError(
            'router.pause.kv_cache = "keep" needs prefix caching off (new requests would reuse blocks the old '
            "weights wrote); remove router.engine.engine_args.enable_prefix_caching"
        )
    if settings.rollout.routing_replay:
        for name, needed in ROUTING_CAPTURE_ARGS.items():
            if engine.engine_args.get(name, needed) != needed:
                raise ConfigError(
                    f"[rollout] routing_replay needs router.engine.engine_args.{name} = {needed!r} (the engine "
                    "captures routed experts in eager mode, from forwards over every token: docs/moe.md); remove "
                    f"{name} from engine_args"
                )
    if not use_gpu and engine.engine_args.get("enable_chunked_prefill"):
        raise ConfigError(
            "router.engine.engine_args.enable_chunked_prefill is not safe on CPU engines: vLLM rewinds a seeded "
            "request's random generator after a partial prefill, which CPU generators cannot do, and the "
            "engine dies; remove it"
        )


# What routed-expert capture (molt.router.expert_capture) needs of the engine: prompt tokens served from
# the prefix cache run no forward, and a compiled CPU engine traced its MoE blocks without the hook.
ROUTING_CAPTURE_ARGS = {"enable_prefix_caching": False, "enforce_eager": True}


def check_engine_nodes(settings: RouterSettings, use_gpu: bool) -> None:
    """Refuses ``[router.engine] nodes`` that no live Ray node can hold: the engine's placement group
    would wait forever for a node labelled ``molt/node=<index>`` with room for it."""
    engine = settings.engine
    gpus = engine.tensor_parallel_size if use_gpu else 0
    labelled: dict[str, dict[str, float]] = {}
    for node in ray.nodes():
        index = node.get("Labels", {}).get(NODE_LABEL)
        if node.get("Alive") and index is not None:
            labelled[index] = node.get("Resources", {})
    problems = []
    for index in sorted(set(engine.nodes)):
        resources = labelled.get(str(index))
        if resources is None:
            problems.append(f"no live Ray node is labelled {NODE_LABEL}={index}")
        elif resources.get("CPU", 0) < 1 or resources.get("GPU", 0) < gpus:
            problems.append(
                f"the Ray node labelled {NODE_LABEL}={index} registers {resources.get('CPU', 0):g} CPUs and "
                f"{resources.get('GPU', 0):g} GPUs; an engine needs 1 CPU and {gpus} GPUs"
            )
    if problems:
        raise ConfigError(
            f"router.engine.nodes = {engine.nodes}: " + "; ".join(problems) + f" (Ray nodes carry their index as "
            f"`ray start --labels {NODE_LABEL}=<index>`; recipes/slurm/molt.sbatch labels each node it starts; "
            f"labelled nodes: {sorted(labelled)})"
        )


def group_name(namespace: str, engine_id: str) -> str:
    return f"{namespace}-{engine_id}"


def engine_spec(settings: RouterSettings, engine_id: str, use_gpu: bool) -> EngineSpec:
    """What engine ``engine_id`` is built from: ``[router.engine]`` plus the engine arguments molt adds."""
    engine = settings.engine
    tp = engine.tensor_parallel_size
    extra: dict[str, Any] = {"distributed_executor_backend": "ray"} if use_gpu and tp > 1 else {}
    if settings.pause.kv_cache == "keep":
        extra["enable_prefix_caching"] = False
    if settings.rollout.routing_replay:
        extra.update(ROUTING_CAPTURE_ARGS)
    if not use_gpu:
        # vLLM rewinds a seeded request's generator (set_offset) when a step only prefilled part of it,
        # which a CPU generator refuses: the engine died once seeded prompts overran a step's token
        # budget (concurrent long prompts; requests re-prefilling after a pause). Whole prefills only.
        extra["enable_chunked_prefill"] = False
    return EngineSpec(
        engine_id=engine_id,
        model_path=engine.model_path,
        tensor_parallel_size=tp,
        max_model_len=engine.max_model_len,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        seed=engine.seed,
        dtype=engine.dtype,
        stream_interval=engine.stream_interval,
        engine_args={**extra, **engine.engine_args},
        wait=engine.wait if engine.wait != "auto" else ("spin" if use_gpu else "sleep"),
        version_source=engine.version_source,
        routing_capture=settings.rollout.routing_replay,
    )


def start_or_attach(settings: RouterSettings, namespace: str, index: int, use_gpu: bool, policy_version: int) -> Any:
    """The actor of engine ``index`` (``engine-<index>``): the running one of its name, else a new one at
    ``policy_version``, on node ``[router.engine] nodes[index]`` when nodes are given."""
    engine_id = f"engine-{index}"
    name = f"molt-{engine_id}"
    try:
        actor = ray.get_actor(name, namespace=namespace)
        log.info("attached to running engine", extra={"engine": engine_id})
        return actor
    except ValueError:
        pass
    try:  # a detached group whose engine died (crash, ray.kill) would block creating it again
        remove_placement_group(get_placement_group(group_name(namespace, engine_id)))
        log.warning("removed the placement group of a dead engine", extra={"engine": engine_id})
    except ValueError:
        pass
    engine = settings.engine
    tp = engine.tensor_parallel_size
    # CPU: one bundle for the actor (vLLM's worker runs in a child process). GPU: one GPU per
    # tensor-parallel worker; with tp > 1 vLLM's Ray executor places its workers in this group.
    bundles = [{"CPU": 1.0, "GPU": 1.0}] + [{"GPU": 1.0}] * (tp - 1) if use_gpu else [{"CPU": 1.0}]
    # A detached engine's group is detached too: Ray removes a job's groups, and the actors in them,
    # when the job (this router) ends.
    lifetime = "detached" if engine.detached else None
    # Every bundle on the planned node: an engine's tensor-parallel workers share one node.
    selector = [{NODE_LABEL: str(engine.nodes[index])}] * len(bundles) if engine.nodes else None
    group = placement_group(
        bundles,
        strategy="PACK",
        name=group_name(namespace, engine_id),
        lifetime=lifetime,
        bundle_label_selector=selector,
    )
    remote_cls = ray.remote(EngineActor)
    return remote_cls.options(  # type: ignore[attr-defined]
        name=name,
        namespace=namespace,
        lifetime="detached" if engine.detached else None,
        num_cpus=1,
        num_gpus=1 if use_gpu and tp == 1 else 0,
        max_concurrency=10_000,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
    ).remote(engine_spec(settings, engine_id, use_gpu), policy_version)


async def stop_engines(actors: dict[str, Any], namespace: str) -> None:
    """Stops the engines, ends their actors and frees their placement groups."""
    await asyncio.gather(*(actor.shutdown.remote() for actor in actors.values()), return_exceptions=True)
    for engine_id, actor in actors.items():
        ray.kill(actor)
        try:
            remove_placement_group(get_placement_group(group_name(namespace, engine_id)))
        except Exception as exc:  # already gone (with an earlier router's job): nothing to free
            log.debug("no placement group to remove", extra={"engine": engine_id, "error": repr(exc)})
