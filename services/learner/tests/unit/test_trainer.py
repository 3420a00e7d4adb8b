"""The RL training step on the tiny model: it learns, it is exact across micro-batch splits, KL and
entropy terms run, and the LR schedule has its shape."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from molt.algos import advantages as estimators
from molt.core.errors import ConfigError
from molt.core.tiny_model import build
from molt.learner.batch import StepBatch, assemble, padded
from molt.learner.config import LearnerSettings, OptimizerSettings
from molt.learner.logprobs import token_logprobs
from molt.learner.objective import gae_targets, step_advantages
from molt.learner.optim import lr_factor
from molt.learner.packing import pack
from molt.learner.routing import moe_routers
from molt.learner.synthetic import step_batch
from molt.learner.trainer import Trainer

SettingsFactory = Callable[..., LearnerSettings]


def fixed_batch() -> StepBatch:
    return step_batch({"alpha": [1.0, 0.0, 1.0, 0.0], "beta": [0.0, 0.0, 1.0, 0.5]})


def logprobs_of(trainer: Trainer, batch: StepBatch) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = token_logprobs(trainer.model, pack([s.input_ids for s in batch.samples]), len(batch.samples), 1.0)
    return lp


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_loss_on_a_fixed_batch_falls_and_parameters_move(learner_settings: SettingsFactory) -> None:
    """The surrogate -mean(A * exp(logp - logp_0)) against the initial policy falls step after step."""
    trainer = Trainer(learner_settings())
    batch = fixed_batch()
    mask = padded([s.loss_mask for s in batch.samples]).float()
    advantages = step_advantages(batch, trainer.settings.algorithm)
    initial_params = params(trainer)
    initial = logprobs_of(trainer, batch)

    def surrogate() -> float:
        ratio = (logprobs_of(trainer, batch) - initial).exp()
        return float(-(advantages * ratio * mask).sum() / mask.sum())

    losses = [surrogate()]
    for _ in range(4):
        metrics = trainer.train_step(batch)
        losses.append(surrogate())
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses
    assert losses[-1] < losses[0] - 0.05
    moved = [n for n, p in params(trainer).items() if not torch.equal(p, initial_params[n])]
    assert len(moved) == len(initial_params)
    assert trainer.step == 4 and metrics["grad_norm"] > 0
    assert metrics["samples"] == 8 and metrics["reward/mean"] == 0.4375


def test_a_frozen_router_stays_put_while_the_experts_train(
    learner_settings: SettingsFactory, tiny_moe_model: Path
) -> None:
    trainer = Trainer(learner_settings(model_path=tiny_moe_model, freeze_router=True))
    before = params(trainer)
    trainer.train_step(fixed_batch())
    after = params(trainer)
    routers = {f"model.layers.{layer}.mlp.gate.weight" for layer in moe_routers(trainer.model)}
    assert routers == {n for n in before if n.endswith("mlp.gate.weight")} and len(routers) == 2
    assert all(torch.equal(before[n], after[n]) for n in routers)
    assert all(not torch.equal(before[n], after[n]) for n in before if n not in routers)


def test_freezing_the_router_of_a_dense_model_is_refused(learner_settings: SettingsFactory) -> None:
    with pytest.raises(ConfigError, match="no mixture-of-experts blocks"):
        Trainer(learner_settings(freeze_router=True))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "prompt_mean_token_mean"])
def test_a_step_does_not_depend_on_the_micro_batch_split_or_layout(
    learner_settings: SettingsFactory, aggregation: str
) -> None:
    """One packed micro-batch of everything vs one per sample (budget 16 < 2 samples) vs padded rows
    (lengths 14..17, so rows carry padding; budget 48: micro-batches of 2 rows): the same update,
    because the step's weights are fixed before the split, nothing divides by the count, and padding
    is never attended to or scored. Adam's first update is ~lr * sign(g) where |g| >> eps, blind to a
    constant factor and noisy where g ~ 0, so eps is raised to 1 (the update is then ~lr * g) and the
    gradient norm and loss are compared too (a division by the 8 micro-batches would shrink all three
    8-fold)."""
    batch = fixed_batch()
    after = []
    for budget, layout in ((4096, "packed"), (16, "packed"), (48, "padded"), (4096, "padded")):
        trainer = Trainer(
            learner_settings(
                micro_batch_tokens=budget,
                micro_batch_layout=layout,
                algorithm={"aggregation": aggregation},
                optimizer={"lr": 1e-3, "eps": 1.0},
            )
        )
        assert trainer.layout == layout
        metrics = trainer.train_step(batch)
        after.append((params(trainer), metrics))
    one, m_one = after[0]
    for many, m_many in after[1:]:
        for name in one:
            torch.testing.assert_close(one[name], many[name], rtol=1e-4, atol=1e-9)
        assert m_one["loss/objective"] == pytest.approx(m_many["loss/objective"], abs=1e-6)
        assert m_one["grad_norm"] == pytest.approx(m_many["grad_norm"], rel=1e-5)


def test_kl_and_entropy_terms(learner_settings: SettingsFactory) -> None:
    """With kl_coef > 0 a frozen reference runs: KL is 0 before the first update and > 0 after it."""
    trainer = Trainer(learner_settings(algorithm={"kl_coef": 0.1, "entropy_coef": 0.01, "loss": "gspo"}))
    assert trainer.reference is not None
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    batch = fixed_batch()
    first = trainer.train_step(batch)
    second = trainer.train_step(batch)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    assert second["kl"] > 1e-6
    assert 0 < second["entropy"] <= torch.log(torch.tensor(320.0)).item()


@pytest.mark.parametrize(("target", "direction"), [(1e-7, "rises"), (100.0, "falls")])
def test_adaptive_kl_moves_its_coefficient_by_the_reference_rule(
    learner_settings: SettingsFactory, target: float, direction: str
) -> None:
    """kl_coef *= 1 + clip(KL / target - 1, +-0.2) * samples / horizon after each step (horizon 16, 8
    samples: at most x1.1 a step). The first step's KL is 0 (the policy is the reference): it falls.
    Then a KL far above a tiny target makes it rise, and one far below a huge target makes it fall."""
    algorithm = {"kl_coef": 0.1, "kl_target": target, "kl_horizon": 16}
    trainer = Trainer(learner_settings(algorithm=algorithm, optimizer={"lr": 1e-2}))
    batch = fixed_batch()
    rows = [trainer.train_step(batch) for _ in range(4)]
    coefs = [row["kl_coef"] for row in rows]
    assert coefs[0] == 0.1 and coefs[1] == pytest.approx(0.1 * (1 - 0.2 * 8 / 16))
    for row, before, after in zip(rows[1:], coefs[1:], coefs[2:], strict=False):
        error = min(max(row["kl"] / target - 1, -0.2), 0.2)
        assert after == pytest.approx(before * (1 + error * 8 / 16))
        assert (after > before) == (direction == "rises")
    assert trainer.kl.coef != coefs[-1]  # the fifth step's, from the fourth's KL


def test_kl_in_reward_puts_the_reference_kl_in_reinforce_returns(learner_settings: SettingsFactory) -> None:
    """kl_in_reward: reinforce's per-token returns gain -kl_coef * KL_t(rollout || reference) (k1 here),
    summed to the end of each sample, then whitened; the loss then holds no KL term of its own."""
    algorithm = {"estimator": "reinforce", "kl_coef": 0.5, "kl_in_reward": True, "kl_estimator": "k1"}
    trainer = Trainer(learner_settings(algorithm=algorithm))
    batch = fixed_batch()
    assert trainer.reference is not None
    mask = padded([s.loss_mask for s in batch.samples])
    ref = logprobs_of(trainer, batch)[:, : mask.shape[1]]  # the policy is still the reference
    rollout = padded([s.rollout_logprobs for s in batch.samples])
    kl = (rollout - ref).double() * mask
    returns = torch.flip(torch.cumsum(torch.flip(-0.5 * kl, [1]), 1), [1]) * mask  # -coef * sum_{t' >= t} KL
    returns = returns + batch.rewards.double()[:, None] * mask
    expected = estimators.whiten(returns, mask)
    got = trainer._host_inputs(batch, 0, None).advantages
    assert got is not None
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)
    without = Trainer(learner_settings(algorithm={**algorithm, "kl_in_reward": False}))
    assert not torch.allclose(without._host_inputs(batch, 0, None).advantages, got)


def test_on_policy_distill_moves_the_policy_toward_the_teacher(
    learner_settings: SettingsFactory, tmp_path: Path
) -> None:
    """The teacher is another random tiny model (seed 1). On-policy samples (rollout logprobs = the
    student's): tokens the teacher likes more than the student gain probability, the others lose it,
    and the student's logprobs on the batch get closer to the teacher's."""
    teacher_path = build(tmp_path / "teacher", seed=1)
    distill = {"estimator": "on_policy_distill", "teacher_path": teacher_path}
    # A small rate: the batch is not resampled, so its advantages stay those of the first student.
    trainer = Trainer(learner_settings(group_size=1, algorithm=distill, optimizer={"lr": 1e-5}))
    assert trainer.teacher is not None and not any(p.requires_grad for p in trainer.teacher.parameters())
    batch = fixed_batch()
    mask = padded([s.loss_mask for s in batch.samples])
    student = logprobs_of(trainer, batch)
    on_policy = [
        replace(s, rollout_logprobs=student[i, : s.loss_mask.numel()] * s.loss_mask)
        for i, s in enumerate(batch.samples)
    ]
    batch = assemble(on_policy)
    with torch.no_grad():
        ids = pack([s.input_ids for s in batch.samples])
        teacher, _ = token_logprobs(trainer.teacher, ids, len(batch.samples), 1.0)
    gap = (student - teacher)[mask]
    metrics = trainer.train_step(batch)
    assert metrics["distill/reverse_kl"] == pytest.approx(float(gap.mean()), abs=1e-4)
    assert metrics["advantage/mean"] == pytest.approx(-float(gap.mean()), abs=1e-4)
    trainer.train_step(batch)
    after = logprobs_of(trainer, batch)
    moved = (after - student)[mask]
    assert float((-gap * moved).sum()) > 0  # the update follows the per-token advantage -(student - teacher)
    assert float(((after - teacher)[mask] ** 2).mean()) < float((gap**2).mean())


def test_gae_trains_a_critic_toward_the_returns(learner_settings: SettingsFactory) -> None:
    """With a zero-initialised value head the first step's values are 0, so its advantages are the
    whitened discounted rewards; the critic's value error then falls step after step while the policy
    trains on the GAE advantages."""
    algorithm = {"estimator": "gae", "gae_gamma": 1.0, "gae_lambda": 0.9}
    trainer = Trainer(learner_settings(algorithm=algorithm, critic={"lr": 1e-3}))
    assert trainer.critic is not None
    batch = fixed_batch()
    mask = padded([s.loss_mask for s in batch.samples])
    values = trainer._values(batch.samples)
    assert torch.equal(values, torch.zeros_like(values))
    advantages, returns = gae_targets(batch, trainer.settings.algorithm, values)
    # V = 0: A_t = lambda^(steps to the last loss token) * reward, then whitened; returns = raw A + V.
    last = [int(m.nonzero().max()) for m in mask]
    raw = torch.zeros(mask.shape, dtype=torch.float64)
    for row, end in enumerate(last):
        for t in mask[row].nonzero().flatten().tolist():
            raw[row, t] = 0.9 ** int(mask[row, t:end].sum()) * batch.rewards[row].double()
    torch.testing.assert_close(returns.double(), raw, rtol=1e-5, atol=1e-6)
    mean, std = raw[mask].mean(), raw[mask].std(unbiased=False)
    torch.testing.assert_close(advantages.double()[mask], (raw[mask] - mean) / std, rtol=1e-4, atol=1e-5)

    errors = [trainer.train_step(batch)["critic/value_error"] for _ in range(5)]
    assert all(later < earlier for earlier, later in itertools.pairwise(errors)), errors
    trained = trainer._values(batch.samples)
    assert not torch.equal(trained, values)
    trainer.layout = "padded"  # the critic reads padded rows the same way
    torch.testing.assert_close(trainer._values(batch.samples)[mask], trained[mask], rtol=1e-4, atol=1e-5)


def test_lr_warms_up_then_decays_on_a_cosine() -> None:
    """warmup 4, total 12, min 0.1: steps 0..3 give 1/4..4/4; step 8 is halfway down (0.55); 12+ is 0.1."""
    opt = OptimizerSettings(warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    assert [lr_factor(s, opt) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, opt) == 1.0
    assert lr_factor(8, opt) == pytest.approx(0.55)
    assert lr_factor(12, opt) == pytest.approx(0.1) and lr_factor(50, opt) == pytest.approx(0.1)


@pytest.mark.slow
# torch's own warnings while it traces and imports inductor (the suite turns warnings into errors)
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_compiled_layers_take_the_eager_step(learner_settings: SettingsFactory) -> None:
    """``compile = true`` (inductor on CPU here, ~15 s) changes how the step runs, not what it computes."""
    batch = fixed_batch()
    results = []
    for compiled in (False, True):
        trainer = Trainer(learner_settings(compile=compiled, optimizer={"lr": 1e-3, "eps": 1.0}))
        metrics = trainer.train_step(batch)
        results.append((params(trainer), metrics))
    (eager, m_eager), (compiled_params, m_compiled) = results
    for name in eager:
        torch.testing.assert_close(compiled_params[name], eager[name], rtol=1e-4, atol=1e-8, msg=name)
    assert m_compiled["loss/objective"] == pytest.approx(m_eager["loss/objective"], abs=1e-6)
    assert m_compiled["grad_norm"] == pytest.approx(m_eager["grad_norm"], rel=1e-5)
    assert m_compiled["entropy"] == pytest.approx(m_eager["entropy"], rel=1e-5)  # the compiled logprob head
