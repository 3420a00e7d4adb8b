"""Settings of the learner (the recipe's ``[learner]`` table)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from molt.core.config import ServiceSettings


class OptimizerSettings(BaseModel):
    """AdamW with linear warm-up then cosine decay, and grad-norm clipping."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    total_steps: int = Field(1000, ge=1, description="Steps of the schedule (decay ends here).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip.")


class ImportanceSamplingSettings(BaseModel):
    """Correction for the rollout/train logprob mismatch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    level: Literal["off", "token", "seq", "geo"] = Field("token", description="Where the ratio is taken.")
    mode: Literal["mask", "clip", "trunc"] = Field("trunc", description="What happens outside the band.")
    low: float = Field(0.0, ge=0, description="Lower edge of the ratio band.")
    high: float = Field(2.0, gt=0, description="Upper edge of the ratio band.")


class AlgorithmSettings(BaseModel):
    """Advantage estimator, policy loss and regularisers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    estimator: Literal["reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "gae", "on_policy_distill"] = (
        Field("grpo", description="Advantage estimator.")
    )
    loss: Literal["ppo", "gspo", "cispo"] = Field("ppo", description="Policy-loss surrogate.")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "prompt_mean_token_mean"] = Field(
        "token_mean", description="How per-token losses are reduced over one optimizer step."
    )
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1.")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1.")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference coefficient; 0 disables the reference model.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    importance_sampling: ImportanceSamplingSettings = Field(
        default_factory=ImportanceSamplingSettings, description="IS correction."
    )


class LearnerSettings(ServiceSettings):
    """molt-learner: trains the policy on trajectory groups from the queue."""

    listen: str = Field("127.0.0.1:50053", description="gRPC listen address host:port.")
    metrics_port: int = Field(9103, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one.")
    broadcaster_address: str = Field("127.0.0.1:50054", description="WeightService address host:port.")
    model_path: Path = Field(description="Local directory of the initial policy (save_pretrained layout).")
    backend: Literal["auto", "torch", "automodel"] = Field(
        "auto", description="auto: AutoModel where CUDA is present, else transformers + torch FSDP2."
    )
    data_parallel_size: int = Field(1, ge=1, description="Training ranks (FSDP2).")
    groups_per_step: int = Field(8, ge=1, description="Trajectory groups per optimizer step.")
    micro_batch_tokens: int = Field(8192, ge=16, description="Token budget of one packed micro-batch.")
    max_staleness: int = Field(1, ge=0, description="Drop samples whose oldest token is more versions behind.")
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings, description="RL algorithm.")
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings, description="Optimizer and schedule.")
    checkpoint_every: int = Field(10, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(3, ge=1, description="Complete checkpoints kept (older ones pruned).")
