"""Versions from engine-side token counts: the boundaries a refit leaves in each sample.

The output processor here is vLLM's shape reduced to the two maps ``switch`` reads (external id ->
engine ids, engine id -> state with ``request_index``); the end-to-end check against a real engine
is ``tests/integration/test_refit.py`` with ``version_source = "counts"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from molt.router.version_counts import CountedVersions


@dataclass
class State:
    request_index: int


@dataclass
class Processor:
    external_req_ids: dict[str, list[str]] = field(default_factory=dict)
    request_states: dict[str, State] = field(default_factory=dict)

    def admit(self, request_id: str, samples: int) -> None:
        ids = [f"{index}_{request_id}-x" for index in range(samples)]
        self.external_req_ids[request_id] = ids
        self.request_states.update({engine_id: State(index) for index, engine_id in enumerate(ids)})


def test_tokens_after_the_count_read_at_the_pause_carry_the_new_version() -> None:
    processor, counted = Processor(), CountedVersions()
    counted.begin("a", 2, version=3)
    processor.admit("a", 2)
    counted.switch(processor, {"0_a-x": 5, "1_a-x": 2}, ["a"], version=4)
    assert counted.versions("a", 0, 0, 8) == [3] * 5 + [4] * 3
    assert counted.versions("a", 1, 0, 4) == [3, 3, 4, 4]
    assert counted.versions("a", 0, 6, 2) == [4, 4]  # a later output starts past the boundary


def test_a_request_not_yet_in_the_engine_is_all_new_version() -> None:
    """Accepted by the actor, not admitted by vLLM when the pause came (no count): nothing was sampled."""
    processor, counted = Processor(), CountedVersions()
    counted.begin("late", 1, version=3)
    counted.switch(processor, {}, ["late"], version=4)
    assert counted.versions("late", 0, 0, 3) == [4, 4, 4]


def test_two_switches_without_tokens_between_leave_one_boundary() -> None:
    """A probe's resume and the router's resume at the same count: the later label replaces the earlier."""
    processor, counted = Processor(), CountedVersions()
    counted.begin("a", 1, version=1)
    processor.admit("a", 1)
    counted.switch(processor, {"0_a-x": 4}, ["a"], version=2)
    counted.switch(processor, {"0_a-x": 4}, ["a"], version=3)
    counted.switch(processor, {"0_a-x": 6}, ["a"], version=4)
    assert counted.starts["a"][0] == [(0, 1), (4, 3), (6, 4)]
    assert counted.versions("a", 0, 0, 7) == [1, 1, 1, 1, 3, 3, 4]


def test_unknown_requests_are_ignored_and_finished_ones_forgotten() -> None:
    processor, counted = Processor(), CountedVersions()
    counted.switch(processor, {"0_gone-x": 9}, ["gone"], version=2)
    assert "gone" not in counted.starts
    counted.begin("a", 1, version=0)
    counted.forget("a")
    assert counted.starts == {}


def test_a_sample_the_engine_core_no_longer_holds_keeps_the_tokens_already_handed_out() -> None:
    """Finished in the engine core before the pause (so absent from the counts) while the actor still
    streams it: the tokens already handed out stay old, and a boundary never moves back."""
    processor, counted = Processor(), CountedVersions()
    counted.begin("a", 1, version=1)
    processor.admit("a", 1)
    assert counted.versions("a", 0, 0, 3) == [1, 1, 1]
    counted.switch(processor, {}, ["a"], version=2)
    assert counted.versions("a", 0, 0, 4) == [1, 1, 1, 2]
    counted.switch(processor, {"0_a-x": 1}, ["a"], version=3)  # a stale count below the boundary
    assert counted.starts["a"][0] == [(0, 1), (3, 2), (4, 3)]  # after the 4 tokens handed out
