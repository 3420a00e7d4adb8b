"""Settings of the learner (the recipe's ``[learner]`` table) and the start-up soundness check.

``LearnerSettings`` is built once in ``__main__``. ``unsound_settings`` lists the
combinations that would train silently wrong (off-policy data without IS
correction, IS on renormalised sampling, group estimators without groups);
``check_sound`` turns them into one ``ConfigError`` before any model is loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from molt.core.config import ServiceSettings
from molt.core.errors import ConfigError

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_baseline")


class OptimizerSettings(BaseModel):
    """AdamW with linear warm-up then cosine decay, and grad-norm clipping."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    total_steps: int = Field(1000, ge=1, description="Steps of the schedule (decay ends here).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="LR at the end of the cosine, as a fraction of lr.")
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
        Field("grpo", description="Advantage estimator; gae trains a critic ([learner.critic]).")
    )
    gae_gamma: float = Field(1.0, ge=0, le=1, description="gae: discount per loss token.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="gae: lambda of the advantage estimate.")
    teacher_path: Path | None = Field(
        None, description="on_policy_distill: the frozen teacher (same vocabulary as the policy), a local model dir."
    )
    distill_coef: float = Field(1.0, gt=0, description="on_policy_distill: scale of the per-token reverse-KL signal.")
    loss: Literal["ppo", "gspo", "cispo"] = Field("ppo", description="Policy-loss surrogate.")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "prompt_mean_token_mean"] = Field(
        "token_mean", description="How per-token losses are reduced over one optimizer step."
    )
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1.")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 (CISPO: the weight's ceiling - 1).")
    dual_clip: float | None = Field(None, gt=1, description="PPO dual clip c > 1 on negative advantages; unset = off.")
    reward_clip: float = Field(10.0, gt=0, description="Rewards are clamped to [-reward_clip, reward_clip].")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference coefficient; 0 disables the reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator of the KL loss term.")
    kl_in_reward: bool = Field(
        False,
        description="The KL to the reference as a per-token reward (-kl_coef * KL_t of the sampled tokens, in the "
        "returns) instead of a loss term: reinforce, gae and on_policy_distill (docs/algorithms.md); the group "
        "estimators would ignore it, so they refuse it. Needs kl_coef > 0.",
    )
    kl_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive KL: after each step kl_coef *= 1 + clip(KL / kl_target - 1, +-0.2) * samples / "
        "kl_horizon, so it rises while the policy's KL to the reference is above the target (docs/algorithms.md). "
        "Unset: kl_coef stays fixed. Needs kl_coef > 0 (its start).",
    )
    kl_horizon: int = Field(10_000, ge=1, description="Adaptive KL: samples over which the coefficient adapts.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    importance_sampling: ImportanceSamplingSettings = Field(
        default_factory=ImportanceSamplingSettings, description="IS correction."
    )


class LoraSettings(BaseModel):
    """LoRA adapters on the policy (PEFT): only they train; refits send merged weights (docs/algorithms.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(0, ge=0, description="Adapter rank r; 0 = no LoRA (the whole policy trains).")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the adapter's update is (alpha / rank) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        description="Names of the linear layers that get adapters (PEFT's target_modules).",
    )


class MetricsSettings(BaseModel):
    """Where the learner's metrics go besides metrics.jsonl, TensorBoard, Prometheus and reward.png."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wandb_project: str | None = Field(
        None,
        description="Also log every step to this Weights & Biases project (needs the learner's wandb extra; the "
        "API key from WANDB_API_KEY or `wandb login`, never from a recipe). Unset: no W&B.",
    )
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); unset: the key's default.")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="offline: written under <run_dir>/wandb for a later `wandb sync`, nothing sent."
    )


class SFTSettings(BaseModel):
    """Supervised warm-up on chat data: loss on assistant turns only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_path: Path = Field(description='JSONL chat data, one {"messages": [...]} object per line.')
    epochs: int = Field(1, ge=1, description="Passes over the data.")
    samples_per_step: int = Field(8, ge=1, description="Conversations per optimizer step.")
    max_length: int = Field(2048, ge=2, description="Conversations are truncated to this many tokens.")
    output_dir: Path | None = Field(None, description="Where the tuned model is saved; unset = <run_dir>/sft-model.")
    lr: float | None = Field(
        None, gt=0, description="Peak learning rate of the warm-up; unset = [learner.optimizer] lr (RL's)."
    )


class CriticSettings(BaseModel):
    """The value model of ``gae``: a transformer body with a scalar head, trained beside the policy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: Path | None = Field(None, description="Body weights; unset = the policy's model_path.")
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (same warm-up and cosine as the policy's).")
    value_clip: float = Field(0.2, ge=0, description="Clip of the value update around the old values.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip of the critic.")


class LearnerSettings(ServiceSettings):
    """molt-learner: trains the policy on trajectory groups from the queue."""

    mode: Literal["rl", "sft"] = Field("rl", description="rl: train from the queue; sft: supervised warm-up on sft.")
    listen: str = Field("127.0.0.1:50053", description="gRPC listen address host:port.")
    metrics_port: int = Field(9103, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one.")
    broadcaster_address: str = Field("127.0.0.1:50054", description="WeightService address host:port.")
    refit_every: int = Field(
        0,
        ge=0,
        description=(
            "Refit the engines through the weight-broadcaster every N steps and at max_steps; 0 = never "
            "(no broadcaster)."
        ),
    )
    refit_bucket_bytes: int = Field(
        512 * 1024 * 1024, ge=1024, description="Upper bound of one broadcast bucket, bytes."
    )
    refit_probe_tokens: int = Field(32, ge=0, description="Length of the teacher-forced refit probe; 0 = no probe.")
    refit_probe_every: int = Field(
        1, ge=1, description="Probe every N-th refit (and always the first after a start); checksums every one."
    )
    refit_timeout_s: float = Field(600.0, gt=0, description="Longest wait for one refit, seconds.")
    refit_overlap: bool = Field(
        True,
        description="Train the next step while a refit is on the wire (weights snapshotted first); false: wait.",
    )
    model_path: Path = Field(description="Local directory of the initial policy (save_pretrained layout).")
    backend: Literal["auto", "torch", "automodel"] = Field(
        "auto",
        description="auto: NVIDIA AutoModel where CUDA is present and it imports, else transformers; FSDP2 either way.",
    )
    param_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Parameter dtype of the policy (and reference, teacher, critic); auto: bf16 on GPU, fp32 on CPU.",
    )
    data_parallel_size: int = Field(1, ge=1, description="Training ranks (FSDP2; CPU ranks use gloo).")
    placement: Literal["local", "ray"] = Field(
        "local",
        description="local: the ranks are processes beside molt-learner; ray: Ray actors in one placement group "
        "(one node, preferring molt-learner's), a GPU each where the cluster has GPUs.",
    )
    ray_address: str | None = Field(
        None,
        description="placement = ray: the Ray cluster to join (host:port, or 'auto'); unset = a Ray of its own.",
    )
    placement_timeout_s: float = Field(
        600.0, gt=0, description="placement = ray: longest wait for the cluster to grant the ranks' bundles, seconds."
    )
    master_port: int = Field(
        0, ge=0, le=65535, description="placement = local: rendezvous port of the ranks; 0 picks a free one."
    )
    seed: int = Field(0, description="Seed of torch / python RNGs (saved and restored with checkpoints).")
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per consumed batch (PPO mini-batches of whole groups, balanced in tokens; at "
        "most the batch's groups). Above 1, or with epochs above 1, a forward without gradient first scores the "
        "batch (the proximal policy), so the surrogate's ratio leaves 1 and its clipping binds (docs/algorithms.md).",
    )
    epochs: int = Field(
        1, ge=1, description="Passes over each consumed batch's mini-batches (PPO epochs; docs/algorithms.md)."
    )
    micro_batch_tokens: int = Field(
        8192, ge=16, description="Token budget of one micro-batch (padded layout: rows x longest row)."
    )
    max_sequence_tokens: int | None = Field(
        None,
        ge=2,
        description="Longest sample (prompt + response tokens) trained on; a longer one is dropped with a log "
        "line (dropped/too_long), so one oversize trajectory cannot exhaust memory. Unset: the model's "
        "max_position_embeddings.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer of the policy and the logprob head (log-softmax, the "
        "picked token, entropy fused): fewer kernels and float32 passes over the vocabulary; the first steps (and "
        "new shapes) pay the compile.",
    )
    freeze_router: bool = Field(
        False,
        description="Mixture-of-experts policy: no gradient reaches the routers (the gate weights that pick "
        "each token's experts); the experts and everything else still train. Refused for a dense model.",
    )
    compare_unreplayed: bool = Field(
        True,
        description="[rollout] routing_replay: also score each micro-batch without replay to report "
        "vllm_kl_unreplayed, the engine/learner mismatch replay removes; costs one extra forward without "
        "gradient per micro-batch. No effect without routing replay.",
    )
    micro_batch_layout: Literal["auto", "packed", "padded"] = Field(
        "auto",
        description="padded (auto): one sequence per row, plain causal attention (flash kernels on GPU); packed: "
        "sequences concatenated in one row, no padding but a dense block-diagonal mask (attention ~ total^2).",
    )
    drop_after_versions: int | None = Field(
        None,
        ge=0,
        description="Drop a sample whose oldest loss token is more than this many versions behind the learner; "
        "unset: [rollout] max_staleness. Under partial rollout a long response spans many refits, and a bound "
        "this tight cuts the long tail of response lengths out of training (docs/queue.md); a larger one keeps it, the "
        "producer's pacing on max_staleness still bounds when groups start, and importance sampling weighs the "
        "old tokens.",
    )
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings, description="RL algorithm.")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA adapters (rank 0: off).")
    metrics: MetricsSettings = Field(default_factory=MetricsSettings, description="Extra metric sinks (W&B).")
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings, description="Optimizer and schedule.")
    checkpoint_every: int = Field(10, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(3, ge=1, description="Complete checkpoints kept (older ones pruned).")
    max_steps: int = Field(
        0, ge=0, description="Stop (with a checkpoint) after this many steps; 0 = run until stopped."
    )
    cpu_threads: int = Field(
        0, ge=0, description="torch threads per rank on a CPU-only machine; 0 = torch's default (every core)."
    )
    poll_s: float = Field(1.0, gt=0, description="Longest wait of one queue read, seconds.")
    redis_outage_s: float = Field(
        600.0,
        gt=0,
        description="Longest Redis outage the learner waits out (queue reads, acknowledgements retried with "
        "backoff) before it stops with an error, seconds.",
    )
    idle_warning_s: float = Field(120.0, gt=0, description="Warn when no trajectory arrived for this long, seconds.")
    status_every_s: float = Field(30.0, gt=0, description="Interval of the one-line status log, seconds.")
    plot_every: int = Field(10, ge=1, description="Steps between refreshes of <run_dir>/reward.png.")
    sft: SFTSettings | None = Field(None, description="Supervised fine-tuning data (mode = sft).")
    critic: CriticSettings = Field(default_factory=CriticSettings, description="The value model (estimator gae).")


def unsound_algorithm(algo: AlgorithmSettings) -> list[str]:
    """The part of ``unsound_settings`` that the algorithm table alone decides."""
    problems: list[str] = []
    if algo.estimator == "on_policy_distill" and algo.teacher_path is None:
        problems.append("estimator 'on_policy_distill' needs algorithm.teacher_path (the frozen teacher model)")
    if algo.teacher_path is not None and algo.estimator != "on_policy_distill":
        problems.append(f"algorithm.teacher_path is only used by on_policy_distill, not {algo.estimator!r}")
    if algo.kl_in_reward and algo.kl_coef == 0:
        problems.append("algorithm.kl_in_reward needs kl_coef > 0 (the reward's coefficient, and the reference)")
    if algo.kl_in_reward and algo.estimator in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        problems.append(
            f"algorithm.kl_in_reward has no effect with {algo.estimator!r}: a group baseline takes one scalar "
            "reward per sample; use the KL loss term (kl_in_reward = false), or reinforce / gae"
        )
    if algo.kl_target is not None and algo.kl_coef == 0:
        problems.append("algorithm.kl_target adapts kl_coef from its start, and kl_coef = 0 runs no reference: set it")
    return problems


def unsound_settings(settings: LearnerSettings) -> list[str]:
    """Every combination that would make the learner train on wrongly weighted data, with the reason."""
    algo = settings.algorithm
    is_on = algo.importance_sampling.level != "off"
    problems: list[str] = []
    if not is_on and (settings.rollout.max_staleness > 0 or settings.rollout.partial_rollout):
        problems.append(
            f"off-policy training (max_staleness = {settings.rollout.max_staleness}, partial_rollout = "
            f"{settings.rollout.partial_rollout}) needs importance-sampling correction: tokens sampled by an "
            f"older policy would be trained on as if the current one produced them; set "
            f"algorithm.importance_sampling.level, or max_staleness = 0 and partial_rollout = false"
        )
    if algo.importance_sampling.level in ("seq", "geo") and algo.importance_sampling.mode != "mask":
        problems.append(
            f"importance_sampling.level = {algo.importance_sampling.level!r} accepts only mode 'mask': a "
            f"sequence ratio can only accept or reject a sequence, not rescale every token"
        )
    if algo.estimator in GROUP_ESTIMATORS and settings.rollout.group_size < 2:
        problems.append(
            f"estimator {algo.estimator!r} normalises within a prompt's group, and group_size = "
            f"{settings.rollout.group_size} gives every sample a zero advantage; use group_size >= 2 or 'reinforce'"
        )
    if is_on and settings.rollout.top_p < 1:
        problems.append(
            f"rollout.top_p = {settings.rollout.top_p} with IS correction: the engine renormalises over the "
            f"nucleus, so its logprobs are not the policy's and every ratio is biased; use top_p = 1"
        )
    if is_on and settings.rollout.top_k > 0:
        problems.append(
            f"rollout.top_k = {settings.rollout.top_k} with IS correction: the engine renormalises over the "
            f"top k, so its logprobs are not the policy's; use top_k = -1"
        )
    if settings.drop_after_versions is not None and settings.drop_after_versions < settings.rollout.max_staleness:
        problems.append(
            f"drop_after_versions = {settings.drop_after_versions} is below max_staleness = "
            f"{settings.rollout.max_staleness}: the producer's pacing lets samples reach max_staleness in their "
            f"slot, so the learner would drop them, and the replacements, over and over; use >= max_staleness or unset"
        )
    problems += unsound_algorithm(algo)
    samples = settings.rollout.group_size * settings.rollout.groups_per_step
    if settings.algorithm.kl_target is not None and settings.algorithm.kl_horizon * 5 < samples:
        problems.append(
            f"algorithm.kl_horizon = {settings.algorithm.kl_horizon} is below a fifth of a step's {samples} samples: "
            "one update (kl_coef *= 1 + e * samples / kl_horizon, e down to -0.2) could make kl_coef negative"
        )
    if settings.metrics.wandb_project and importlib.util.find_spec("wandb") is None:
        problems.append("metrics.wandb_project is set but wandb is not installed (the learner's wandb extra)")
    if settings.mini_batches > settings.rollout.groups_per_step:
        problems.append(
            f"mini_batches = {settings.mini_batches} is more than the {settings.rollout.groups_per_step} groups of a "
            "step (rollout.groups_per_step): a mini-batch holds whole groups"
        )
    if algo.loss == "gspo" and algo.dual_clip is not None:
        problems.append("dual_clip is defined for token ratios only; gspo takes none")
    if settings.rollout.routing_replay and settings.compile:
        problems.append(
            "rollout.routing_replay with compile = true: replay hooks every MoE router, and hooks added to "
            "compiled decoder layers are not seen by the compiled graph; set compile = false"
        )
    if settings.mode == "sft" and settings.sft is None:
        problems.append("mode = 'sft' needs an [learner.sft] table with data_path")
    if settings.mode == "sft" and settings.data_parallel_size > 1:
        problems.append("mode = 'sft' runs on one rank; set data_parallel_size = 1")
    return problems


def check_sound(settings: LearnerSettings) -> None:
    """Raises ``ConfigError`` listing every unsound combination (called at start-up)."""
    problems = unsound_settings(settings)
    if problems:
        raise ConfigError("unsound learner settings:\n" + "\n".join(f"  - {p}" for p in problems))
