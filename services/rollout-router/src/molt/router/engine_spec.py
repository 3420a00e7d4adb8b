"""What an engine actor is built from (``EngineSpec``, plain values sent to the Ray actor) and what it
reports once started (``EngineInfo``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class EngineSpec:
    """How to build one engine (plain values: it travels to the Ray actor)."""

    engine_id: str
    model_path: Path
    tensor_parallel_size: int
    max_model_len: int
    gpu_memory_utilization: float
    seed: int
    dtype: str
    stream_interval: int
    engine_args: dict[str, Any]
    wait: Literal["spin", "sleep"] = "spin"  # how vLLM's own processes wait for each other (molt.router.vllm_wait)
    version_source: Literal["auto", "labels", "counts"] = "auto"  # how tokens get their version (_versions)
    routing_capture: bool = False  # [rollout] routing_replay: each finished sample carries its routed experts


@dataclass(frozen=True)
class EngineInfo:
    """What the served model accepts, and the engine's state (a restarted router attaching to a detached
    engine takes its policy version and pause over)."""

    engine_id: str
    vocab_size: int
    max_model_len: int
    policy_version: int = 0
    paused: bool = False  # paused by a router and not resumed by one since
