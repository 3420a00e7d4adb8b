"""vLLM's completions cut into chunks, each holding only tokens sampled under one policy version.

The engine core labels each step's output with the weight version set before
generation resumed after a refit, so a request suspended by a ``keep`` pause
shows both versions. The labels, not the actor's current version, decide: vLLM
holds a request's tokens back until ``stream_interval`` of them are ready, so one
output can hold tokens sampled before a pause and after it; such an output
leaves as one chunk per version. Logprobs are vLLM's *processed* logprobs (after
temperature), the quantity the learner recomputes.
"""

from __future__ import annotations

import itertools
from typing import Any

from molt.router.data_channel import Chunk


def token_versions(processor: Any, request_id: str, completion: Any, start: int) -> list[int]:
    """The policy version of each of ``completion``'s tokens, which are the sample's output tokens
    ``start, start + 1, ...``, from the engine core's weight-version labels: on the last output the
    completion carries them; before it they are read from the output processor's state of the
    request (kept up to date by the same step that produced the tokens)."""
    if not completion.token_ids:
        return []
    spans = completion.weight_versions
    if spans is not None:
        starts = [(span.version, span.start) for span in spans]
    else:
        states = (processor.request_states.get(i) for i in processor.external_req_ids.get(request_id, ()))
        state = next((s for s in states if s is not None and s.request_index == completion.index), None)
        starts = list(state.weight_version_starts) if state is not None else []
    if not starts:  # cannot happen while every step is labelled; fail loudly rather than guess
        raise RuntimeError(f"no weight-version label for {request_id} sample {completion.index}")
    versions, span = [], 0
    for position in range(start, start + len(completion.token_ids)):
        while span + 1 < len(starts) and starts[span + 1][1] <= position:
            span += 1
        versions.append(int(starts[span][0]))
    return versions


def chunks_of(completion: Any, versions: list[int], top_k: int, current_version: int) -> list[Chunk]:
    """``completion`` as one chunk per run of tokens sampled under one version (the finish on the last);
    a completion without tokens (a finish alone) is stamped ``current_version``."""
    token_ids = list(completion.token_ids)
    logprobs: list[float] = []
    top: list[tuple[list[int], list[float]]] = []
    for token_id, position in zip(token_ids, completion.logprobs or [], strict=True):
        logprobs.append(float(position[token_id].logprob))
        if top_k:
            ranked = sorted(position.items(), key=lambda item: item[1].rank)[:top_k]
            top.append(([t for t, _ in ranked], [float(lp.logprob) for _, lp in ranked]))
    bounds = [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
    edges = [0, *bounds, len(token_ids)]
    stop = completion.stop_reason
    chunks = []
    for first, end in itertools.pairwise(edges):
        last = end == len(token_ids)
        chunks.append(
            Chunk(
                sample_index=completion.index,
                token_ids=token_ids[first:end],
                logprobs=logprobs[first:end],
                policy_version=versions[first] if versions else current_version,
                top_logprobs=top[first:end],
                finish_reason=completion.finish_reason if last else None,
                stop_reason=("" if stop is None else str(stop)) if last else "",
            )
        )
    return chunks
