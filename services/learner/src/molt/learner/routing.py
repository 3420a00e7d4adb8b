"""Mixture-of-experts routing in the learner: replay of given expert choices, router freeze, agreement.

Routing tensors have the layout ``[tokens, layers, top_k]`` (int64 expert ids): ``tokens`` in the order
of the micro-batch's flattened ``input_ids`` (``micro_routing`` lays per-sequence arrays out so),
``layers`` the model's global decoder-layer index (``num_hidden_layers``, as vLLM indexes its capture),
``top_k`` the experts of one token. A ``-1`` anywhere in a token's row means "no given choice": that
token keeps the router's own (padding, a layer with no experts, routing the data did not carry).
``routed(model, replay)`` hooks every router for one forward: with ``replay`` the experts are the given
ones, their weights recomputed from the live router logits so the router still gets gradient; either
way it records the router's own top-k, from which ``routing_agreement`` is computed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from molt.core.errors import ConfigError
from molt.learner.packing import Packed
from molt.learner.ranks import to_device

# Routers whose forward is softmax over all experts, top-k, then (norm_topk_prob) renormalised, returning
# (logits, weights, ids): the semantics ``_replayed`` reproduces. Matched by class ancestry (FSDP2 subclasses).
SUPPORTED_ROUTERS = ("Qwen3MoeTopKRouter",)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_routers(model: nn.Module) -> dict[int, nn.Module]:
    """Each MoE block's router by global decoder-layer index. An MoE block is a module with an ``experts``
    child; its router is its ``gate``. A ``ConfigError`` for a model with none (a dense model has no
    routing to replay or freeze) and for a block whose router this module does not know."""
    routers: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "experts", None), nn.Module):
            continue
        router = getattr(module, "gate", None)
        kind = type(router).__name__
        if router is None or not any(cls.__name__ in SUPPORTED_ROUTERS for cls in type(router).__mro__):
            raise ConfigError(
                f"MoE block {name} ({type(module).__name__}, router {kind}) is not supported for routing "
                f"replay or router freeze; supported routers: {', '.join(SUPPORTED_ROUTERS)}"
            )
        layer = _LAYER.search(name + ".")
        if layer is None:
            raise ConfigError(f"MoE block {name} is not inside a decoder layer (no 'layers.<n>' in its path)")
        routers[int(layer.group(1))] = router
    if not routers:
        raise ConfigError(
            f"{type(model).__name__} has no mixture-of-experts blocks: routing replay and freeze_router "
            "need an MoE policy (molt-tiny-model --moe builds one)"
        )
    return routers


def freeze_router(model: nn.Module) -> int:
    """``[learner] freeze_router``: no gradient reaches any router (``requires_grad`` off on its
    parameters, matched by class so an expert's ``gate_proj`` keeps learning); call it before the
    optimizer is built. Returns the number of parameters frozen."""
    frozen = 0
    for router in moe_routers(model).values():
        for parameter in router.parameters():
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen


@dataclass
class Routing:
    """What ``routed`` saw in its block: the routers' own top-k, ``[tokens, layers, top_k]`` int64 on
    the forward's device (a copy to the host per layer would stall a GPU), ``-1`` at layers without a
    router, empty until a forward ran; and the routing replayed, as the forward used it (on its device),
    None without replay."""

    own: Tensor
    given: Tensor | None = None


def _replayed(router: nn.Module, logits: Tensor, own: Tensor, given: Tensor) -> tuple[Tensor, Tensor]:
    """The experts to use (``given``, or ``own`` on a row with a ``-1``) and their weights from the live
    logits: ``p = softmax(logits)`` in float32 over all experts, ``w = p[ids]``, divided by its sum when
    ``norm_topk_prob``, in the logits' dtype: the op order of the router itself, so replaying its own
    choice gives its weights bit for bit. ``[N, E]``, ``[N, k]``, ``[N, k]`` -> ``[N, k]``, ``[N, k]``."""
    ids = torch.where((given >= 0).all(-1, keepdim=True), given, own)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    weights = probs.gather(-1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


def _check(replay: Tensor, layers: int, routers: dict[int, nn.Module]) -> None:
    top_k = {int(r.top_k) for r in routers.values()}
    experts = min(int(r.num_experts) for r in routers.values())
    if replay.dim() != 3 or replay.shape[1] != layers or replay.shape[2] not in top_k:
        raise ValueError(
            f"routing to replay has shape {tuple(replay.shape)}; expected [tokens, {layers} layers, "
            f"top_k {sorted(top_k)}]"
        )
    if replay.numel() and int(replay.max()) >= experts:
        raise ValueError(f"routing to replay names expert {int(replay.max())}; the model has {experts}")


@contextmanager
def routed(model: nn.Module, replay: Tensor | None = None) -> Iterator[Routing]:
    """For the forwards inside the block, every router records its own top-k into the yielded
    ``Routing``, and with ``replay`` (``[tokens, layers, top_k]``, aligned with the forward's flattened
    input ids) its block uses the given experts, weighted from the live router logits (``_replayed``).
    A forward of another token count than ``replay`` raises ``ValueError``. The hooks go on leaving."""
    routers = moe_routers(model)
    layers = int(model.config.num_hidden_layers)
    if replay is not None:
        _check(replay, layers, routers)
        replay = to_device(replay, next(model.parameters()).device)  # once, not once per layer
    routing = Routing(own=torch.empty((0, layers, 0), dtype=torch.int64), given=replay)

    def hook_for(layer: int) -> Callable[[nn.Module, object, tuple[Tensor, Tensor, Tensor]], tuple[Tensor, ...]]:
        def hook(router: nn.Module, args: object, output: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, ...]:
            logits, weights, own = output
            tokens, top_k = own.shape
            if routing.own.shape[0] != tokens or routing.own.shape[2] != top_k:
                routing.own = torch.full((tokens, layers, top_k), -1, dtype=torch.int64, device=own.device)
            routing.own[:, layer] = own.detach()
            if replay is None:
                return output
            if replay.shape[0] != tokens:
                raise ValueError(f"routing to replay covers {replay.shape[0]} tokens; the forward has {tokens}")
            ids, weights = _replayed(router, logits, own, replay[:, layer])
            return logits, weights, ids

        return hook

    handles = [router.register_forward_hook(hook_for(layer)) for layer, router in routers.items()]
    try:
        yield routing
    finally:
        for handle in handles:
            handle.remove()


def agreeing_cells(own: Tensor, given: Tensor) -> tuple[Tensor, Tensor]:
    """How many (token, layer) cells hold a choice (no ``-1``) in both routings, and in how many of
    those the learner's own top-k *set* equals the given one: ``(agreeing, compared)``, int64 scalars on
    ``own``'s device (no host sync). ``[N, layers, k]`` twice; ``ValueError`` when the shapes differ."""
    if own.shape != given.shape:
        raise ValueError(f"routing shapes differ: {tuple(own.shape)} and {tuple(given.shape)}")
    given = given.to(own.device)
    comparable = (own >= 0).all(-1) & (given >= 0).all(-1)
    same = (own.sort(-1).values == given.sort(-1).values).all(-1)
    return (same & comparable).sum(), comparable.sum()


def routing_agreement(own: Tensor, given: Tensor) -> float:
    """The fraction of (token, layer) cells where the learner's own top-k *set* equals the given one,
    over the cells where both hold a choice (``agreeing_cells``); ``ValueError`` when the shapes differ
    or no cell can be compared."""
    agreeing, compared = agreeing_cells(own, given)
    if not int(compared):
        raise ValueError("no (token, layer) cell holds a choice in both routings")
    return int(agreeing) / int(compared)


def sequence_routing(prompt_tokens: int, response: Tensor, prompt: Tensor | None = None) -> Tensor:
    """One sequence's routing, prompt then response, ``[prompt_tokens + R, layers, k]`` int64, from the
    response's ``[R, layers, k]`` and the prompt's (``-1`` rows when the data carries none: the learner
    routes those tokens itself)."""
    if response.dim() != 3:
        raise ValueError(f"response routing has shape {tuple(response.shape)}; expected [tokens, layers, top_k]")
    if prompt is None:
        prompt = torch.full((prompt_tokens, *response.shape[1:]), -1, dtype=torch.int64)
    if tuple(prompt.shape) != (prompt_tokens, *response.shape[1:]):
        raise ValueError(
            f"prompt routing has shape {tuple(prompt.shape)}; expected {(prompt_tokens, *response.shape[1:])}"
        )
    return torch.cat([prompt.to(torch.int64), response.to(torch.int64)])


def micro_routing(packed: Packed, sequences: Sequence[Tensor]) -> Tensor:
    """The routing of a micro-batch, ``[R * L, layers, k]``, aligned with ``packed.input_ids.flatten()``
    (packed: the sequences end to end; padded: one per row), ``-1`` on padding. ``sequences[i]`` is
    ``sequence_routing``'s tensor for the micro-batch's i-th sequence."""
    if len(sequences) != len(packed.lengths):
        raise ValueError(f"{len(sequences)} routings for a micro-batch of {len(packed.lengths)} sequences")
    rows, width = packed.input_ids.shape
    out = torch.full((rows * width, *sequences[0].shape[1:]), -1, dtype=torch.int64)
    start = 0
    for index, (routing, length) in enumerate(zip(sequences, packed.lengths, strict=True)):
        if routing.shape[0] != length:
            raise ValueError(f"sequence {index} has {length} tokens but routing for {routing.shape[0]}")
        at = start if packed.packed else index * width
        out[at : at + length] = routing
        start += length
    return out
