"""MoE routing replay in the learner, on the tiny Qwen3-MoE in float32: a reference forward's routing
replayed changes nothing; a drifted router picks other experts and replay forces the reference's back
(checked against a hand-written forward of the forced experts); the router learns unless frozen;
a dense model and an unknown router are refused."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from molt.core.errors import ConfigError
from molt.learner.logprobs import token_logprobs
from molt.learner.models import load_policy
from molt.learner.packing import Packed, pack, pad
from molt.learner.routing import (
    freeze_router,
    micro_routing,
    moe_routers,
    routed,
    routing_agreement,
    sequence_routing,
)

CPU = torch.device("cpu")
LENGTHS = (9, 1, 14, 5)


def sequences(seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (n,), generator=generator) for n in LENGTHS]


def logprobs_of(model: nn.Module, micro: Packed, replay: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The micro-batch's logprobs (``[rows, T]``) and the routers' own top-k of that forward."""
    with routed(model, replay) as routing:
        logprobs, _ = token_logprobs(model, micro, len(micro.lengths), 1.0)
    return logprobs, routing.own


def drifted(model: nn.Module, scale: float = 0.05) -> nn.Module:
    """A copy whose router weights carry noise: the precision drift between an engine and the learner."""
    copied = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in moe_routers(copied).values():
            router.weight += scale * torch.randn(router.weight.shape, generator=generator)
    return copied


@contextmanager
def forced_by_hand(model: nn.Module, routing: Tensor) -> Iterator[None]:
    """Every MoE block's output replaced by the textbook mixture over the given experts, written out
    here independently of ``routed`` and of transformers' expert loop: ``sum_j w_j * E_{i_j}(x)`` with
    ``w = softmax(x G^T)[i] / sum``, ``E(x) = down(silu(gate(x)) * up(x))``."""

    def hook_for(layer: int) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], Tensor]:
        def hook(block: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
            x = args[0].reshape(-1, args[0].shape[-1])
            ids = routing[:, layer]
            weights = torch.softmax(x @ block.gate.weight.T, dim=-1).gather(-1, ids)
            weights = weights / weights.sum(-1, keepdim=True)
            gate, up = torch.einsum("nh,nkoh->nko", x, block.experts.gate_up_proj[ids]).chunk(2, dim=-1)
            mixed = torch.einsum("nki,nkhi->nkh", nn.functional.silu(gate) * up, block.experts.down_proj[ids])
            return (weights[..., None] * mixed).sum(1).reshape(output.shape)

        return hook

    blocks = {layer: router_block(model, layer) for layer in moe_routers(model)}
    handles = [block.register_forward_hook(hook_for(layer)) for layer, block in blocks.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def router_block(model: nn.Module, layer: int) -> nn.Module:
    return model.model.layers[layer].mlp


@pytest.fixture
def moe(tiny_moe_model: Path) -> nn.Module:
    return load_policy(tiny_moe_model, CPU, trainable=True)


@pytest.mark.parametrize("layout", [pack, pad])
def test_replaying_a_reference_forwards_routing_changes_no_logprob(moe: nn.Module, layout: Callable) -> None:
    micro = layout(sequences())
    with torch.no_grad():
        reference, routing = logprobs_of(moe, micro)
        replayed, own = logprobs_of(moe, micro, replay=routing)
    assert routing.shape == (micro.input_ids.numel(), 2, 2)
    torch.testing.assert_close(replayed, reference, rtol=0, atol=1e-6)
    assert routing_agreement(own, routing) == 1.0


@pytest.mark.parametrize("layout", [pack, pad])
def test_per_sequence_routing_lines_up_with_the_micro_batch(moe: nn.Module, layout: Callable) -> None:
    """Each sequence routed alone (as an engine would), laid out by ``micro_routing`` with a prompt
    left to the learner (-1): the micro-batch forward picks the same experts at every real token, and
    replaying the laid-out routing leaves every logprob as it was."""
    alone = []
    with torch.no_grad():
        for sequence in sequences():
            _, own = logprobs_of(moe, pack([sequence]))
            prompt = min(2, sequence.numel() - 1)
            alone.append(sequence_routing(prompt, own[prompt:]))
        micro = layout(sequences())
        reference, micro_own = logprobs_of(moe, micro)
        given = micro_routing(micro, alone)
        replayed, _ = logprobs_of(moe, micro, replay=given)
    assert int((given[:, 0, 0] >= 0).sum()) == sum(LENGTHS) - sum(min(2, n - 1) for n in LENGTHS)
    assert routing_agreement(micro_own, given) == 1.0
    torch.testing.assert_close(replayed, reference, rtol=0, atol=1e-6)


def test_replay_forces_the_reference_experts_on_a_drifted_router(moe: nn.Module) -> None:
    micro = pack(sequences())
    engine = drifted(moe)  # the weights the engine sampled with: their routing is the one to replay
    with torch.no_grad():
        engine_logprobs, engine_routing = logprobs_of(engine, micro)
        learner_logprobs, learner_own = logprobs_of(moe, micro)
        replayed, replay_own = logprobs_of(moe, micro, replay=engine_routing)
        with forced_by_hand(moe, engine_routing):
            by_hand, _ = token_logprobs(moe, micro, len(LENGTHS), 1.0)
    agreement = routing_agreement(learner_own, engine_routing)
    assert 0.0 < agreement < 1.0
    # Replay leaves the router's own choice on record (the first layer's input is the same either way).
    assert torch.equal(replay_own[:, 0], learner_own[:, 0])
    assert (learner_logprobs - engine_logprobs).abs().max() > 1e-3
    torch.testing.assert_close(replayed, by_hand, rtol=0, atol=1e-5)
    # Forced to the engine's experts, the learner is closer to the engine than when it routes itself.
    assert (replayed - engine_logprobs).abs().mean() < (learner_logprobs - engine_logprobs).abs().mean()


def router_grads(model: nn.Module, replay: Tensor | None) -> list[Tensor | None]:
    micro = pack(sequences())
    logprobs, _ = logprobs_of(model, micro, replay=replay)
    logprobs.sum().backward()
    return [router.weight.grad for router in moe_routers(model).values()]


def test_the_router_learns_through_replay_unless_frozen(moe: nn.Module) -> None:
    with torch.no_grad():
        _, routing = logprobs_of(drifted(moe), pack(sequences()))
    grads = router_grads(moe, routing)
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)

    moe.zero_grad(set_to_none=True)
    assert freeze_router(moe) == 2 * 8 * 128
    assert router_grads(moe, routing) == [None, None]
    experts = moe.model.layers[0].mlp.experts.gate_up_proj.grad
    assert experts is not None and experts.abs().sum() > 0  # the experts still learn


def test_a_dense_model_is_refused(tiny_model: Path) -> None:
    dense = load_policy(tiny_model, CPU, trainable=True)
    with pytest.raises(ConfigError, match="no mixture-of-experts blocks"), routed(dense, torch.zeros(3, 2, 2)):
        pass
    with pytest.raises(ConfigError, match="no mixture-of-experts blocks"):
        freeze_router(dense)


def test_an_unknown_router_is_refused() -> None:
    config = Qwen2MoeConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1
    )
    config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size = 4, 32, 32
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp \(Qwen2MoeSparseMoeBlock, router Qwen2MoeTopKRouter\)"):
        moe_routers(Qwen2MoeForCausalLM(config))


def test_routing_of_the_wrong_shape_or_experts_is_refused(moe: nn.Module) -> None:
    micro = pack(sequences())
    tokens = micro.input_ids.numel()
    with pytest.raises(ValueError, match=r"expected \[tokens, 2 layers, top_k \[2\]\]"):
        logprobs_of(moe, micro, replay=torch.zeros(tokens, 3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="names expert 8; the model has 8"):
        logprobs_of(moe, micro, replay=torch.full((tokens, 2, 2), 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=f"covers {tokens - 1} tokens; the forward has {tokens}"):
        logprobs_of(moe, micro, replay=torch.zeros(tokens - 1, 2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="sequence 2 has 14 tokens but routing for 13"):
        micro_routing(micro, [torch.zeros(n - (n == 14), 2, 2, dtype=torch.int64) for n in LENGTHS])


def test_agreement_compares_sets_where_both_routings_choose() -> None:
    """Three comparable cells, two equal as sets (order within a token's top-k does not matter);
    a cell with a -1 on either side is not counted."""
    own = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]])
    given = torch.tensor([[[1, 0]], [[2, 3]], [[4, 6]], [[-1, -1]]])
    assert routing_agreement(own, given) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no \\(token, layer\\) cell"):
        routing_agreement(own[3:], given[3:])
