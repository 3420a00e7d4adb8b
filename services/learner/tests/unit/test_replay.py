"""Routing replay in the RL step, on the tiny Qwen3-MoE in float32. An "engine" is the unperturbed model,
in float32 or cast to bfloat16 as GPU engines serve it: each trajectory carries its logprobs and routing
from a forward of that sequence alone, as an engine records them. Replaying them changes nothing while
the learner routes alike; once the learner's routers drift, the learner's own routing moves vllm_kl
while replay keeps it at its unperturbed level; the learner's logprobs are those of a forward with the
given routing. A dense model is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from molt.core import expert_routing
from molt.core.errors import ConfigError
from molt.learner.batch import StepBatch, assemble, build_group, padded
from molt.learner.config import LearnerSettings, unsound_settings
from molt.learner.logprobs import token_logprobs
from molt.learner.models import load_policy
from molt.learner.packing import pad
from molt.learner.replay import replay_shape
from molt.learner.routing import micro_routing, moe_routers, routed, routing_agreement
from molt.learner.synthetic import named_group
from molt.learner.trainer import Trainer
from molt.v1 import common_pb2

SettingsFactory = Callable[..., LearnerSettings]
CPU = torch.device("cpu")
# The trainer takes the GPU where there is one: the "engine" records there too, so that replaying its
# routing is compared with a forward of the same kernels (bench/gpu_moe/run.sh runs these on a GPU).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GROUPS = {"alpha": [1.0, 0.0, 1.0, 0.0], "beta": [0.0, 0.0, 1.0, 0.5]}


def as_engine_recorded(engine: nn.Module, group: common_pb2.TrajectoryGroup) -> common_pb2.TrajectoryGroup:
    """``group`` with each trajectory's rollout logprobs and routing from a forward of it alone through
    ``engine``; the last token's row is "none" (an engine never feeds the last sampled token)."""
    for t in group.trajectories:
        ids = torch.tensor([*t.prompt_token_ids, *t.response_token_ids])
        with torch.no_grad(), routed(engine) as routing:
            logprobs, _ = token_logprobs(engine, pad([ids]), 1, 1.0)
        own = routing.own.cpu()
        own[-1] = -1
        t.routed_experts.CopyFrom(expert_routing.pack(own.numpy().astype(np.int16), num_experts=8))
        del t.rollout_logprobs[:]
        t.rollout_logprobs.extend(logprobs[0, len(t.prompt_token_ids) - 1 : ids.numel() - 1].tolist())
    return group


def engine_batch(engine: nn.Module) -> StepBatch:
    samples = []
    for name, rewards in GROUPS.items():
        group = as_engine_recorded(engine, named_group(name, rewards))
        kwargs = {"vocab_size": 320, "current_version": 0, "max_staleness": 1, "consumed": set()}
        outcome = build_group(group, **kwargs, needs_groups=True, routing_shape=(2, 2))
        assert not outcome.dropped
        samples += outcome.samples
    return assemble(samples)


def drift(model: nn.Module, scale: float) -> None:
    """Noise on every router weight: the precision drift between an engine and the learner."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_routers(model).values():
            router.weight += scale * torch.randn(router.weight.shape, generator=generator).to(router.weight.device)


@pytest.fixture
def moe_settings(learner_settings: SettingsFactory, tiny_moe_model: Path) -> SettingsFactory:
    # Replay runs on the torch backend only (where CUDA is present "auto" may pick AutoModel).
    return lambda **overrides: learner_settings(model_path=tiny_moe_model, backend="torch", **overrides)


@pytest.fixture
def batch(tiny_moe_model: Path) -> StepBatch:
    return engine_batch(load_policy(tiny_moe_model, DEVICE, trainable=False))


def gates(trainer: Trainer) -> list[torch.Tensor]:
    return [router.weight.detach().clone() for router in moe_routers(trainer.model).values()]


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_replaying_the_learners_own_routing_changes_nothing(
    moe_settings: SettingsFactory, batch: StepBatch, layout: str
) -> None:
    """The engine routes as the learner does: agreement 1, and the step (loss, IS stats, gradients,
    updated weights) is the one without replay. With the router frozen, replay leaves it frozen."""
    on = Trainer(moe_settings(routing_replay=True, freeze_router=True, micro_batch_layout=layout))
    off = Trainer(moe_settings(freeze_router=True, micro_batch_layout=layout))
    before = gates(on)
    replayed, plain = on.train_step(batch), off.train_step(batch)
    assert replayed["routing_agreement"] == 1.0
    assert replayed["vllm_kl"] == replayed["vllm_kl_unreplayed"] == plain["vllm_kl"] == pytest.approx(0, abs=1e-7)
    for key in ("loss/objective", "loss/policy", "is_ratio_mean", "grad_norm"):
        assert replayed[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-9), key
    for (name, p), q in zip(on.model.named_parameters(), off.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8, msg=name)
    assert all(torch.equal(b, a) for b, a in zip(before, gates(on), strict=True))


def test_a_drifting_router_moves_vllm_kl_unless_replayed(moe_settings: SettingsFactory, batch: StepBatch) -> None:
    """Router noise of 0.002 (a tenth of the weights' std) makes the learner pick other experts in about
    one (token, layer) cell in ten. Routing by itself, the learner moves vllm_kl (k1 on tokens the engine
    did not sample, so of either sign: compared by magnitude) from 0 (a float32 forward of the engine's
    weights gives the engine's logprobs) to over 5e-4. Replayed, the experts are the engine's; their
    mixture weights still come from the drifted router (so the gate learns), which leaves a residual
    well under the unreplayed rise. The replayed step's logprobs are those of a forward with the given
    routing."""
    base = Trainer(moe_settings(routing_replay=True)).train_step(batch)
    on, off = Trainer(moe_settings(routing_replay=True)), Trainer(moe_settings())
    drift(on.model, 0.002)
    drift(off.model, 0.002)
    expected = by_hand(on.model, batch)  # before the step changes the weights
    replayed, plain = on.train_step(batch), off.train_step(batch)

    assert base["vllm_kl"] == pytest.approx(0.0, abs=1e-6) and base["routing_agreement"] == 1.0
    assert 0.8 < replayed["routing_agreement"] < 0.95
    rise = abs(plain["vllm_kl"])
    assert rise > 5e-4
    assert abs(replayed["vllm_kl"]) < 0.2 * rise
    # The unreplayed forward is the step without replay.
    assert replayed["vllm_kl_unreplayed"] == pytest.approx(plain["vllm_kl"], rel=1e-5)
    for key, value in expected.items():
        assert replayed[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_against_a_bfloat16_engine_replay_holds_vllm_kl_within_1_5x_while_the_router_drifts(
    moe_settings: SettingsFactory, tiny_moe_model: Path
) -> None:
    """The engine computes in bfloat16, the learner in float32, as on a GPU: that gap alone already
    sends some tokens to other experts, and gives the unperturbed vllm_kl its real, nonzero size.
    With the learner's routers drifted by 0.002 on top, replay keeps |vllm_kl| within 1.5x of its
    unperturbed value, while the learner's own routing leaves it several times larger, as it does
    without the drift."""
    batch = engine_batch(load_policy(tiny_moe_model, DEVICE, trainable=False).to(torch.bfloat16))
    base = Trainer(moe_settings(routing_replay=True)).train_step(batch)
    on, off = Trainer(moe_settings(routing_replay=True)), Trainer(moe_settings())
    drift(on.model, 0.002)
    drift(off.model, 0.002)
    replayed, plain = on.train_step(batch), off.train_step(batch)

    assert abs(base["vllm_kl"]) > 1e-5 and 0.9 < base["routing_agreement"] < 1.0
    assert abs(base["vllm_kl_unreplayed"]) > 3 * abs(base["vllm_kl"])  # replay already pays without drift
    assert replayed["routing_agreement"] < base["routing_agreement"]
    assert abs(replayed["vllm_kl"]) <= 1.5 * abs(base["vllm_kl"])
    assert abs(plain["vllm_kl"]) > 3 * abs(base["vllm_kl"])


def by_hand(model: nn.Module, batch: StepBatch) -> dict[str, float]:
    """The step's stats from one forward of the whole batch under the given routing, written from
    ``routed`` alone: vllm_kl = mean(rollout - learner), is_ratio_mean = mean(exp(learner - rollout))
    over the loss tokens, and the agreement of the routers' own choices with the given ones."""
    micro = pad([s.input_ids for s in batch.samples])
    given = micro_routing(micro, [s.routing for s in batch.samples if s.routing is not None])
    with torch.no_grad(), routed(model, given) as routing:
        logprobs, _ = token_logprobs(model, micro, len(batch.samples), 1.0)
    logprobs = logprobs.cpu()  # the trainer's model is on CUDA where there is one
    mask = padded([s.loss_mask for s in batch.samples])
    rollout = padded([s.rollout_logprobs for s in batch.samples], logprobs.shape[1])[mask].double()
    learner = logprobs[mask].double()
    return {
        "vllm_kl": float((rollout - learner).mean()),
        "is_ratio_mean": float((learner - rollout).exp().mean()),
        "routing_agreement": routing_agreement(routing.own, given),
    }


def test_replay_is_refused_where_it_cannot_run(learner_settings: SettingsFactory, tiny_moe_model: Path) -> None:
    """A dense policy has no routing; AutoModel's MoE layers are not the routers replay hooks; a compiled
    decoder layer does not see hooks added after compilation."""
    with pytest.raises(ConfigError, match="no mixture-of-experts blocks"):
        Trainer(learner_settings(routing_replay=True))
    with pytest.raises(ConfigError, match="AutoModel's MoE layers are not hooked for replay yet; use backend = torch"):
        replay_shape(load_policy(tiny_moe_model, CPU, trainable=False), "automodel")
    problems = unsound_settings(learner_settings(routing_replay=True, compile=True))
    assert any("routing_replay with compile = true" in p for p in problems)


def test_without_compare_unreplayed_no_extra_forward_is_reported(
    moe_settings: SettingsFactory, batch: StepBatch
) -> None:
    metrics = Trainer(moe_settings(routing_replay=True, compare_unreplayed=False)).train_step(batch)
    assert metrics["routing_agreement"] == 1.0 and "vllm_kl_unreplayed" not in metrics
