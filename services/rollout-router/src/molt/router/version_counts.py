"""Each token's policy version on a vLLM without weight-version labels, from token counts at the pause.

vLLM releases before the engine core's weight-version labels (``set_weight_version_async``, read by
``molt.router.versioned_chunks``) say nothing about which weights sampled a token. The engine
actor then asks the engine core, while it is paused for a refit (no step runs), how many tokens
every request has produced so far: those were sampled by the old weights, every later one by the
new. The count comes from the engine core itself, not from outputs that reached the actor, so
outputs still on their way when the pause returns are labelled right.

``register`` is a vLLM general plugin (loaded in the engine core process) that adds that question
to the engine core's utility calls; ``CountedVersions`` keeps the boundaries per request and sample.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

UTILITY = "molt_output_counts"


def register() -> None:
    """vLLM plugin entry point: ``EngineCore.molt_output_counts`` -> {engine request id: output tokens}."""
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, UTILITY):
        setattr(EngineCore, UTILITY, _output_counts)


def _output_counts(self: Any) -> dict[str, int]:
    return {request_id: request.num_output_tokens for request_id, request in self.scheduler.requests.items()}


class CountedVersions:
    """Per request and sample, the output positions where a new policy version starts."""

    def __init__(self) -> None:
        self.starts: dict[str, list[list[tuple[int, int]]]] = {}
        self.handed_out: dict[str, list[int]] = {}  # per sample, the tokens given a version so far

    def begin(self, request_id: str, sample_count: int, version: int) -> None:
        """A request the actor accepted: everything it samples is ``version``'s until the next switch."""
        self.starts[request_id] = [[(0, version)] for _ in range(sample_count)]
        self.handed_out[request_id] = [0] * sample_count

    def forget(self, request_id: str) -> None:
        self.starts.pop(request_id, None)
        self.handed_out.pop(request_id, None)

    def switch(self, processor: Any, counts: dict[str, int], request_ids: Iterable[str], version: int) -> None:
        """The engine resumes under ``version``: every sample of ``request_ids`` (the actor's requests)
        continues at its engine-side count, read while paused (``counts``). A sample the engine core no
        longer holds has either finished there (every token it sampled is older) or not been admitted
        yet (it has sampled nothing): it continues after the tokens already handed out for it, which
        are 0 in the second case. A boundary never moves back over tokens already labelled."""
        for request_id in request_ids:
            samples = self.starts.get(request_id)
            if samples is None:
                continue
            at = list(self.handed_out[request_id])
            for internal_id in processor.external_req_ids.get(request_id, ()):
                state = processor.request_states.get(internal_id)
                if state is not None and state.request_index < len(at) and internal_id in counts:
                    at[state.request_index] = max(at[state.request_index], counts[internal_id])
            for index, marks in enumerate(samples):
                if marks[-1][0] >= at[index]:  # nothing sampled since the last switch: that label is void
                    at[index] = marks.pop()[0]
                marks.append((at[index], version))

    def versions(self, request_id: str, index: int, start: int, count: int) -> list[int]:
        """The versions of sample ``index``'s output tokens ``start .. start + count - 1``."""
        marks = self.starts[request_id][index]
        self.handed_out[request_id][index] = max(self.handed_out[request_id][index], start + count)
        versions, mark = [], 0
        for position in range(start, start + count):
            while mark + 1 < len(marks) and marks[mark + 1][0] <= position:
                mark += 1
            versions.append(marks[mark][1])
        return versions
