"""Batch building: alignment on the next-token axis, drops by reason, dense ids, per-episode stats."""

from __future__ import annotations

import numpy as np
import torch

from molt.core import expert_routing
from molt.learner.batch import assemble, batch_stats, build_group, padded
from molt.learner.synthetic import UNIFORM_LOGPROB, named_group, trajectory
from molt.learner.synthetic import group_of as make_group_of

VOCAB = 320


def build(group, *, version: int = 0, staleness: int = 1, consumed=(), needs_groups: bool = True):
    return build_group(
        group,
        vocab_size=VOCAB,
        current_version=version,
        max_staleness=staleness,
        consumed=set(consumed),
        needs_groups=needs_groups,
    )


def test_sample_is_aligned_on_the_next_token_axis() -> None:
    """Prompt [1, 2, 3], response [4, 5, 6] with mask [1, 0, 1]: position k predicts token k + 1, so the
    next-token mask is [F, F, T, F, T] (tokens 2, 3 are prompt; 4 sampled; 5 tool; 6 sampled)."""
    t = trajectory("a", [1, 2, 3], [4, 5, 6], mask=[True, False, True], versions=[2, 2, 3], reward=1.5)
    outcome = build(make_group_of("g", [t, trajectory("b", [1], [7], versions=[3])]), version=3)
    sample = outcome.samples[0]
    assert sample.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert sample.loss_mask.tolist() == [False, False, True, False, True]
    expected = torch.tensor([0.0, 0.0, UNIFORM_LOGPROB, 0.0, UNIFORM_LOGPROB], dtype=torch.float32)
    assert torch.equal(sample.rollout_logprobs, expected)
    assert sample.policy_versions.tolist() == [2, 2, 2, 2, 3]
    assert sample.reward == 1.5 and sample.loss_tokens == 2
    assert not outcome.dropped


def test_a_token_outside_the_vocabulary_drops_the_whole_group() -> None:
    for bad in (VOCAB, -1):
        group = make_group_of("g", [trajectory("a", [1, 2], [3]), trajectory("b", [1, 2], [bad])])
        outcome = build(group)
        assert outcome.samples == []
        assert outcome.dropped == {"invalid_token": 2}
    outcome = build(make_group_of("g", [trajectory("a", [VOCAB - 1], [0]), trajectory("b", [1], [2])]))
    assert len(outcome.samples) == 2


def test_a_version_below_zero_drops_the_whole_group() -> None:
    """Versions count from 0. A negative one (a producer's bug) passed the staleness check as merely old
    and was trained on; now the group is dropped whole, as a producer's bug, before staleness."""
    group = make_group_of("g", [trajectory("a", [1], [2, 3]), trajectory("b", [1], [2, 3], versions=[0, -2])])
    assert build(group, staleness=5).dropped == {"invalid_version": 2}
    assert build(group, version=9, staleness=1).dropped == {"invalid_version": 2}
    group.trajectories[1].policy_versions[1] = 0
    assert len(build(group, staleness=5).samples) == 2


def test_staleness_counts_the_oldest_loss_token_only() -> None:
    """Learner at version 6, max_staleness 2: a loss token of version 3 is 3 behind (stale); a tool token
    of version 1 does not count, so a sample whose loss tokens are 4 and 5 is kept."""
    stale = trajectory("stale", [1], [2, 3], versions=[3, 5])
    kept = trajectory("kept", [1], [2, 3, 4], mask=[False, True, True], versions=[1, 4, 5])
    outcome = build(make_group_of("g", [stale, kept]), version=6, staleness=2)
    assert [s.trajectory_id for s in outcome.samples] == ["kept"]
    assert outcome.dropped == {"stale": 1}


def test_empty_samples_are_dropped_and_a_group_delivered_again_is_a_duplicate_whole() -> None:
    group = make_group_of(
        "g", [trajectory("seen", [1], [2]), trajectory("new", [1], [2]), trajectory("tool-only", [1], [2], mask=[0])]
    )
    outcome = build(group)
    assert [s.trajectory_id for s in outcome.samples] == ["seen", "new"]
    assert outcome.dropped == {"no_loss_tokens": 1}
    # One of its ids trained already: the entry came again after its step's checkpoint, which counted the
    # rest of it (trained, or dropped with a reason); counted again, a run's account would hold it twice.
    again = build(group, consumed={"seen"})
    assert again.samples == [] and again.dropped == {"duplicate": 3}


def test_group_of_one_is_dropped_only_for_group_estimators() -> None:
    group = make_group_of("g", [trajectory("a", [1], [2])])
    assert build(group).dropped == {"group_of_one": 1}
    assert len(build(group, needs_groups=False).samples) == 1


def test_assemble_gives_dense_ids_and_segments_share_a_rollout() -> None:
    """Two groups; in the second, two segments of one episode share rollout "ep": 3 episodes in g2 -> 2."""
    g1 = build(named_group("g1", [1.0, 0.0])).samples
    segments = [
        trajectory("s0", [1], [2], rollout_id="ep", reward=2.0),
        trajectory("s1", [1], [2, 3], rollout_id="ep", reward=2.0),
        trajectory("s2", [1], [2], reward=4.0),
    ]
    g2 = build(make_group_of("g2", segments)).samples
    batch = assemble(g1 + g2)
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 1]
    assert batch.rollout_ids.tolist() == [0, 1, 2, 2, 3]
    stats = batch_stats(batch, current_version=0)
    # Episode rewards 1, 0, 2, 4 (the two-segment episode once): mean 7/4.
    assert stats["reward/mean"] == 1.75
    assert stats["episodes"] == 4 and stats["samples"] == 5 and stats["groups"] == 2


def test_padded_right_pads_with_zeros() -> None:
    grid = padded([torch.tensor([1, 2]), torch.tensor([3])])
    assert grid.tolist() == [[1, 2], [3, 0]]
    assert padded([torch.tensor([True])], 3).tolist() == [[True, False, False]]


def test_entries_that_reuse_group_and_rollout_ids_stay_apart() -> None:
    """Two queue entries with the same group_id and the same rollout ids (a producer numbering episodes
    per prompt): two groups and four episodes, so each group is normalised on its own."""
    first = make_group_of("g", [trajectory("a", [1], [2], rollout_id="ep-0"), trajectory("b", [1], [2])])
    second = make_group_of("g", [trajectory("c", [1], [2], rollout_id="ep-0"), trajectory("d", [1], [2])])
    first.trajectories[1].rollout_id = second.trajectories[1].rollout_id = "ep-1"
    samples = [*build_group_keyed(first, "1-0"), *build_group_keyed(second, "2-0")]
    batch = assemble(samples)
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.rollout_ids.tolist() == [0, 1, 2, 3]


def build_group_keyed(group, key: str):
    return build_group(
        group, vocab_size=VOCAB, current_version=0, max_staleness=1, consumed=set(), needs_groups=True, key=key
    ).samples


def test_samples_of_a_future_version_or_too_long_are_dropped() -> None:
    """Learner at version 2: a loss token of version 3 was sampled by no policy it made; a sample of 6
    tokens is over a max_length of 5."""
    future = trajectory("future", [1], [2, 3], versions=[2, 3])
    long = trajectory("long", [1, 2, 3], [4, 5, 6])
    kept = trajectory("kept", [1], [2], versions=[2])
    outcome = build_group(
        make_group_of("g", [future, long, kept]),
        vocab_size=VOCAB,
        current_version=2,
        max_staleness=4,
        consumed=set(),
        needs_groups=True,
        max_length=5,
    )
    assert [s.trajectory_id for s in outcome.samples] == ["kept"]
    assert outcome.dropped == {"future_version": 1, "too_long": 1}
    nan = make_group_of("g", [trajectory("a", [1], [2, 3]), trajectory("b", [1], [2, 3])])
    nan.trajectories[1].rollout_logprobs[1] = float("-inf")
    assert build(nan).dropped == {"invalid_logprob": 2}


def test_a_producers_bug_is_reported_before_staleness() -> None:
    """A group whose samples are all stale (version 0 at learner version 5, bound 1) and one of which has
    a non-finite logprob is dropped whole as invalid_logprob: the stale count would hide the bug."""
    group = make_group_of("g", [trajectory("a", [1], [2, 3]), trajectory("b", [1], [2, 3])])
    group.trajectories[0].rollout_logprobs[0] = float("nan")
    assert build(group, version=5).dropped == {"invalid_logprob": 2}
    group.trajectories[0].rollout_logprobs[0] = -0.5
    assert build(group, version=5).dropped == {"stale": 2}


def test_under_routing_replay_a_sample_without_usable_routing_is_dropped() -> None:
    """Replay on for a policy of 2 layers, top-2: a sample carrying routing of its 3 tokens is kept with
    it unpacked; one with none, one whose routing covers 2 tokens and one of 3 layers are dropped as
    no_routing. With replay off (no routing_shape) all four are kept and routing is not read."""
    ids = np.arange(12, dtype=np.int16).reshape(3, 2, 2) % 8
    ids[-1] = -1  # the last token was never fed to the engine
    good, missing, short, deep = (trajectory(name, [1, 2], [3]) for name in ("good", "missing", "short", "deep"))
    good.routed_experts.CopyFrom(expert_routing.pack(ids, num_experts=8))
    short.routed_experts.CopyFrom(expert_routing.pack(ids[:2], num_experts=8))
    deep.routed_experts.CopyFrom(expert_routing.pack(np.zeros((3, 3, 2), dtype=np.int16), num_experts=8))
    group = make_group_of("g", [good, missing, short, deep])
    kw = {"vocab_size": VOCAB, "current_version": 0, "max_staleness": 1, "consumed": set(), "needs_groups": True}
    outcome = build_group(group, **kw, routing_shape=(2, 2))
    assert [s.trajectory_id for s in outcome.samples] == ["good"]
    assert outcome.dropped == {"no_routing": 3}
    routing = outcome.samples[0].routing
    assert routing is not None and torch.equal(routing, torch.from_numpy(ids))
    off = build_group(group, **kw)
    assert len(off.samples) == 4 and all(s.routing is None for s in off.samples)
