"""Routed-expert ids on the wire (``molt.v1.ExpertRouting``): packing, unpacking, checks, merging.

In memory a routing is a numpy array ``[tokens, layers, top_k]`` int16, ``-1`` where a token has no
recorded choice. On the wire the ids take one byte each when the model has at most 255 experts
(``255`` then stands for ``-1``), else two (little-endian int16). The router packs what the engine
captured, the agent-pool carries it into trajectories, the learner unpacks it for replay
(docs/moe.md, "Routing layout").
"""

from __future__ import annotations

import numpy as np

from molt.v1 import common_pb2

NONE_U8 = 255


def pack(ids: np.ndarray, num_experts: int | None = None) -> common_pb2.ExpertRouting:
    """``[tokens, layers, top_k]`` ids (``-1``: none) as an ``ExpertRouting``; one byte an id when
    ``num_experts`` (default: the largest id + 1) is at most 255."""
    if ids.ndim != 3 or ids.shape[1] < 1 or ids.shape[2] < 1:
        raise ValueError(f"routing has shape {ids.shape}; expected [tokens, layers, top_k]")
    experts = int(ids.max()) + 1 if num_experts is None and ids.size else int(num_experts or 0)
    if experts <= NONE_U8:
        data = np.where(ids < 0, NONE_U8, ids).astype(np.uint8).tobytes()
        id_bytes = 1
    else:
        data = ids.astype("<i2").tobytes()
        id_bytes = 2
    return common_pb2.ExpertRouting(ids=data, layer_count=ids.shape[1], top_k=ids.shape[2], id_bytes=id_bytes)


def problem(routing: common_pb2.ExpertRouting, tokens: int | None = None) -> str | None:
    """What makes ``routing`` unreadable (or not ``tokens`` tokens long), or None."""
    if routing.id_bytes not in (1, 2):
        return f"routed_experts.id_bytes is {routing.id_bytes}; expected 1 or 2"
    if routing.layer_count < 1 or routing.top_k < 1:
        return f"routed_experts has layer_count {routing.layer_count} and top_k {routing.top_k}; both must be >= 1"
    row = routing.layer_count * routing.top_k * routing.id_bytes
    if len(routing.ids) % row:
        return f"routed_experts holds {len(routing.ids)} bytes, not a multiple of layers*top_k*id_bytes = {row}"
    if tokens is not None and len(routing.ids) // row != tokens:
        return f"routed_experts covers {len(routing.ids) // row} tokens; the trajectory has {tokens}"
    return None


def unpack(routing: common_pb2.ExpertRouting) -> np.ndarray:
    """The ids as ``[tokens, layers, top_k]`` int16, ``-1`` for none; ``ValueError`` when unreadable."""
    wrong = problem(routing)
    if wrong is not None:
        raise ValueError(wrong)
    if routing.id_bytes == 1:
        flat = np.frombuffer(routing.ids, dtype=np.uint8).astype(np.int16)
        flat[flat == NONE_U8] = -1
    else:
        flat = np.frombuffer(routing.ids, dtype="<i2").astype(np.int16)
    return flat.reshape(-1, routing.layer_count, routing.top_k)


def first_wins(earlier: np.ndarray | None, later: np.ndarray) -> np.ndarray:
    """``later`` (``[m, L, k]``) with the rows ``earlier`` (``[n <= m, L, k]``) holds a choice for kept
    from ``earlier``: the routing of a token stays that of the first forward that computed it (a later
    turn recomputes the conversation so far; a row ``earlier`` lacks, such as its last token, is filled)."""
    if earlier is None or not len(earlier):
        return later
    if earlier.shape[0] > later.shape[0] or earlier.shape[1:] != later.shape[1:]:
        raise ValueError(f"routing {earlier.shape} does not prefix routing {later.shape}")
    merged = later.copy()
    known = (earlier >= 0).all(axis=(1, 2))
    merged[: len(earlier)][known] = earlier[known]
    return merged
