"""The weight group's membership: the store its members meet at, the registered engines, their ranks.

Rank 0 is the learner (it sends); ranks 1.. are the engine workers (they
receive, through the router's worker extension, which this process reaches as
Ray actors named ``molt-<engine_id>`` in the router's namespace), in engine-id
order. The broadcaster holds no tensors: it hosts the group's TCPStore. A change
of membership (an engine registered, a new learner) makes the next refit build
a new *generation* of the group.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Any

import grpc
import torch.distributed as dist

from molt.broadcaster.config import BroadcasterSettings
from molt.core.auth import Access, store_namespace
from molt.core.errors import InvalidInput, Unavailable
from molt.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class Engine:
    """A registered engine: its Ray actor and its workers' first rank in the current generation."""

    engine_id: str
    actor: Any
    worker_count: int
    first_rank: int = 0


@dataclass
class GroupState:
    """The weight group's current membership."""

    generation: int = 0
    members: tuple[tuple[str, int], ...] = ()  # (engine id, worker count), in rank order
    learner_joined: bool = False


class Membership:
    """Owns the weight group's store, the registered engines and the group's generation."""

    def __init__(self, settings: BroadcasterSettings, router: rollout_pb2_grpc.RolloutServiceStub) -> None:
        self.settings = settings
        self.router = router
        self.store: dist.Store | None = None
        self.store_port = settings.store_port
        self.namespace = store_namespace(Access.of(settings.run).token)  # every key of the group's store
        self.engines: dict[str, Engine] = {}
        self.group = GroupState()

    def open_store(self) -> None:
        """Opens the TCPStore the group rendezvous on, listening on ``store_host`` only (a TCPStore left to
        itself listens on every interface), its keys under the run's namespace."""
        host = self.settings.store_host
        family = socket.getaddrinfo(host, self.store_port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, self.store_port), family=family)
        port = listener.getsockname()[1]
        # The store's server takes the bound socket over (and closes it): Python lets go of it.
        fd = listener.detach()
        master = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True, master_listen_fd=fd)
        self.store = dist.PrefixStore(self.namespace, master) if self.namespace else master
        self.store_port = port
        log.info("weight-group store open", extra={"host": host, "port": port, "namespaced": bool(self.namespace)})

    @property
    def rendezvous_address(self) -> str:
        return f"{self.settings.store_host}:{self.store_port}"

    async def register_engine(self, engine_id: str, actor_name: str) -> Engine:
        """Finds the engine's Ray actor and counts its workers."""
        import ray

        namespace = f"molt-{self.settings.run.run_id}"
        try:
            actor = await asyncio.to_thread(ray.get_actor, actor_name or f"molt-{engine_id}", namespace)
        except ValueError as exc:
            raise InvalidInput(
                f"no engine actor {actor_name or 'molt-' + engine_id!r} in namespace {namespace}"
            ) from exc
        ranks = await actor.collective_rpc.remote("weight_worker_rank")
        for other in self.engines.values():  # checked after the await: another registration may have run
            if other.engine_id != engine_id and other.actor._actor_id == actor._actor_id:
                raise InvalidInput(
                    f"engine actor {actor_name or 'molt-' + engine_id!r} is already registered as {other.engine_id!r}",
                    reason="ENGINE_REGISTERED_TWICE",
                )
        engine = Engine(engine_id, actor, len(ranks))
        self.engines[engine_id] = engine
        log.info("engine registered", extra={"engine": engine_id, "workers": engine.worker_count})
        return engine

    async def register_endpoint(self, engine_id: str, actor_name: str) -> Engine:
        """RegisterWeightEndpoint for an engine: one the router reports, and an actor not registered yet
        under another id (twice in the group, it would double the world size: every join times out)."""
        status = await self.router_status()
        reported = sorted(engine.engine_id for engine in status.engines)
        if engine_id not in reported:
            raise InvalidInput(
                f"the router reports no engine {engine_id!r} (it has {reported})", reason="UNKNOWN_ENGINE"
            )
        if actor_name not in ("", f"molt-{engine_id}"):
            raise InvalidInput(
                f"engine {engine_id!r} is the actor 'molt-{engine_id}', not {actor_name!r}", reason="WRONG_ENGINE_ACTOR"
            )
        return await self.register_engine(engine_id, actor_name)

    async def discover_engines(self) -> int:
        """Brings the registered engines in line with the router's before a refit; returns the router's
        vocabulary size. Registers an engine the router reports for the first time; registers again one
        whose actor is not the registered one (a router restarted without detached engines starts new
        actors under the same names, and the old handles are dead); forgets one the router no longer
        reports, or reports dead (its data channel closed: every refit to it would fail). Any of these
        changes the membership, so the refit builds a new generation of the group."""
        import ray

        status = await self.router_status()
        reported = {engine.engine_id for engine in status.engines if engine.healthy}  # a dead one cannot receive
        namespace = f"molt-{self.settings.run.run_id}"
        for engine_id in sorted(reported):
            known = self.engines.get(engine_id)
            if known is not None:
                try:
                    current = await asyncio.to_thread(ray.get_actor, f"molt-{engine_id}", namespace)
                except ValueError:
                    current = None  # its actor is gone: register_engine says so
                if current is not None and current._actor_id == known.actor._actor_id:
                    continue
                log.warning("engine actor replaced; registering it again", extra={"engine": engine_id})
                del self.engines[engine_id]
            await self.register_engine(engine_id, "")
        for engine_id in sorted(set(self.engines) - reported):
            log.warning("engine dead or gone from the router; leaving the group", extra={"engine": engine_id})
            del self.engines[engine_id]
        return int(status.vocab_size)

    async def router_status(self) -> rollout_pb2.GetRouterStatusResponse:
        try:
            return await self.router.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"router at {self.settings.router_address}: {exc.details()}") from exc

    def assign_ranks(self) -> tuple[int, bool]:
        """Ranks in engine-id order; returns the world size and whether the membership changed."""
        members = tuple((e.engine_id, e.worker_count) for e in sorted(self.engines.values(), key=lambda e: e.engine_id))
        rank = 1
        for engine_id, count in members:
            self.engines[engine_id].first_rank = rank
            rank += count
        changed = members != self.group.members or not self.group.learner_joined
        if changed:
            self.group = GroupState(self.group.generation + 1, members)
        return rank, changed

    def backend(self) -> str:
        """The group's backend: the configured one, else NCCL when the cluster has GPUs and gloo when not."""
        if self.settings.backend != "auto":
            return self.settings.backend
        import ray

        return "nccl" if ray.cluster_resources().get("GPU", 0) > 0 else "gloo"


def retryable(exc: Exception, request_id: str, router_address: str) -> Unavailable | None:
    """A refit's failure the learner should wait out and send again, as UNAVAILABLE; None for others."""
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"router at {router_address}: {exc.details()}")  # away (restarting)
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError):
        # An engine died during the refit: the next one leaves it out of the group (or takes its replacement in).
        return Unavailable(f"an engine died during refit {request_id}: {exc}")
    return None
