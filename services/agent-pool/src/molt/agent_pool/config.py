"""Settings of the agent-pool (the recipe's ``[agent_pool]`` table)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt.core.config import ServiceSettings


class FilterSettings(BaseModel):
    """Dynamic filtering: drop groups whose mean reward is not strictly inside (low, high)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="Drop groups whose mean reward lies outside the open band.")
    low: float = Field(0.0, description="Lower edge of the band (exclusive).")
    high: float = Field(1.0, description="Upper edge of the band (exclusive).")

    @model_validator(mode="after")
    def _band(self) -> FilterSettings:
        if self.low >= self.high:
            raise ValueError(f"filter band is empty: low {self.low} >= high {self.high}")
        return self


class DataSettings(BaseModel):
    """The training prompts: a dataset loaded through Hugging Face ``datasets`` (docs/agents.md, "Prompt data")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(
        description="A JSONL (.jsonl, .json) or parquet file, a directory written by save_to_disk or holding "
        "data files, or a Hugging Face hub dataset id (where the machine can reach the hub)."
    )
    split: str = Field("train", description="The split to read; a single file is one split, whatever its name.")
    prompt_key: str = Field(
        "question", description="The column holding the prompt; the agent reads it as prompt['question']."
    )
    answer_key: str = Field(
        "answer", description="The column holding the reference answer; the agent reads it as prompt['answer']."
    )
    shuffle: bool = Field(True, description="Visit the rows in a new seeded order every epoch (else in file order).")
    seed: int = Field(0, description="Seed of the row order; epoch e is shuffled with (seed, e).")


class EvalSettings(BaseModel):
    """Held-out evaluation: the agent on test prompts, never queued for training."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="Run evaluation passes over the held-out set at path.")
    path: str | None = Field(
        None,
        description="The held-out prompts, in any form [agent_pool.data] path takes, read with its prompt_key "
        "and answer_key; every row is evaluated, in file order.",
    )
    split: str = Field("test", description="The split of path to read; a single file is one split, whatever its name.")
    every_versions: int = Field(
        0, ge=0, description="Evaluate whenever the policy version crosses a multiple of this; 0: start and stop only."
    )
    samples_per_prompt: int = Field(1, ge=1, description="Episodes per test prompt.")

    @model_validator(mode="after")
    def _data(self) -> EvalSettings:
        if self.enabled and self.path is None:
            raise ValueError("eval is enabled but [agent_pool.eval] path is not set")
        return self


class AgentPoolSettings(ServiceSettings):
    """molt-agent-pool: runs agents, serves the OpenAI/Anthropic front, queues trajectory groups."""

    MOVED_KEYS: ClassVar[Mapping[tuple[str, ...], str]] = {
        ("prompts_path",): "[agent_pool.data] path",
        ("seed",): "[agent_pool.data] seed",
        ("eval", "data_path"): "[agent_pool.eval] path",
    }

    listen: str = Field("127.0.0.1:50052", description="gRPC listen address host:port.")
    http_listen: str = Field("127.0.0.1:8000", description="OpenAI/Anthropic HTTP front host:port.")
    http_max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest request body the HTTP front reads (HTTP 413 above it): rendering and tokenizing a "
        "body costs CPU time in proportion to its size, on the loop that serves every other request.",
    )
    metrics_port: int = Field(9102, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one.")
    router_address: str = Field("127.0.0.1:50051", description="RolloutService address host:port.")
    broadcaster_address: str = Field(
        "",
        description="WeightService address host:port: a pool held back by staleness hears of each new policy "
        "version at once (WatchPolicyVersion) instead of asking the router every 50 ms. Empty: the router alone.",
    )
    agent: str = Field(description="The agent: 'package.module:Class' or 'path/to/file.py:Class'.")
    data: DataSettings = Field(description="The training prompts (the [agent_pool.data] table).")
    groups_in_flight: int = Field(8, ge=1, description="Prompt groups kept in flight.")
    max_concurrent_episodes: int = Field(64, ge=1, description="Episodes running at once.")
    episode_timeout_s: float = Field(
        300.0, gt=0, description="An episode running longer fails (counted, not trained on)."
    )
    max_tokens: int = Field(256, ge=1, description="Generation budget of one turn, in tokens.")
    tokenizer_path: Path = Field(description="Tokenizer (with chat template) of the served model.")
    autostart: bool = Field(True, description="Start producing at launch (else wait for StartRollouts).")
    groups_per_step_share: int | None = Field(
        None,
        ge=1,
        description="This pool's share of [rollout] groups_per_step when several producers feed one run (the "
        "shares summing to it): it paces as if the learner took this many of its groups per version. Unset: all.",
    )
    filter: FilterSettings = Field(default_factory=FilterSettings, description="Dynamic filtering of groups.")
    eval: EvalSettings = Field(default_factory=EvalSettings, description="Held-out evaluation passes.")
