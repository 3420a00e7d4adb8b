"""Settings of the weight-broadcaster (the recipe's ``[broadcaster]`` table)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from molt.core.config import ServiceSettings


class BroadcasterSettings(ServiceSettings):
    """molt-broadcaster: owns the weight group, refits engines, validates, publishes versions."""

    listen: str = Field("127.0.0.1:50054", description="gRPC listen address host:port.")
    metrics_port: int = Field(9104, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one.")
    router_address: str = Field("127.0.0.1:50051", description="RolloutService address (pause/resume).")
    ray_address: str | None = Field(
        None, description="Ray cluster of the engines (the router's ray_address); unset = 'auto' (a local cluster)."
    )
    store_port: int = Field(0, ge=0, le=65535, description="TCPStore port of the weight group; 0 picks a free one.")
    store_host: str = Field(
        "127.0.0.1",
        description="Address the learner and engine workers use to reach the TCPStore (this host); the store "
        "listens on this address only.",
    )
    backend: Literal["auto", "nccl", "gloo", "cuda_ipc"] = Field(
        "auto",
        description="auto: NCCL on GPUs, gloo on CPU; cuda_ipc: the learner and the engines share one GPU "
        "(NCCL refuses two ranks on one device; molt up sets it for [launcher] colocate).",
    )
    bucket_bytes: int = Field(512 * 1024 * 1024, ge=1024, description="Upper bound of one broadcast bucket, bytes.")
    probe: bool = Field(
        True,
        description="Run the teacher-forced probe when the learner sends one (refit_probe_tokens > 0); false skips it.",
    )
    probe_tolerance: float = Field(1e-3, gt=0, description="Largest allowed |engine - learner| probe logprob.")
    publish_redis: bool = Field(
        True, description="Also publish each version to the Redis key molt:<run>:policy_version."
    )
    refit_timeout_s: float = Field(600.0, gt=0, description="A refit not finished by then fails and is reported.")
    join_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest wait for every rank to join a new gloo weight group (the rendezvous, milliseconds when "
        "all are alive): a learner that dies while joining holds the engine workers this long, not "
        "refit_timeout_s; the learner waits twice as long for them (they may still be in a dead learner's). "
        "NCCL groups rendezvous at their first broadcast, under NCCL's timeout.",
    )
