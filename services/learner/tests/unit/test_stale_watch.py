"""StaleWatch: a step's worth of stale samples with no step between them asks for a republish; stale
drops between steps (an ordinary asynchronous run) never do, and republishes are spaced out."""

from __future__ import annotations

from molt.learner.stale_watch import StaleWatch


def test_a_steps_worth_of_stale_samples_without_a_step_asks_for_a_republish() -> None:
    watch = StaleWatch(samples_per_step=32, every_s=30.0)
    assert not watch.due(stale=100, step=7, now=0.0)  # the first look only marks
    assert not watch.due(stale=131, step=7, now=1.0)
    assert watch.due(stale=132, step=7, now=2.0)
    # Counted again from the republish, and not again within every_s.
    assert not watch.due(stale=170, step=7, now=10.0)
    assert watch.due(stale=170, step=7, now=33.0)


def test_stale_drops_between_steps_never_ask() -> None:
    watch = StaleWatch(samples_per_step=32, every_s=0.0)
    stale = 0
    for step in range(1, 50):
        stale += 31  # nearly a step's worth dropped between each pair of steps
        assert not watch.due(stale=stale, step=step, now=float(step))


def test_a_publish_at_the_start_counts_as_one() -> None:
    """The stale groups a restarted learner reads first were sampled before its own first publish."""
    watch = StaleWatch(samples_per_step=32, every_s=30.0)
    watch.mark(stale=10, step=20, now=100.0)
    assert not watch.due(stale=60, step=20, now=110.0)  # within every_s of that publish
    assert watch.due(stale=60, step=20, now=131.0)
