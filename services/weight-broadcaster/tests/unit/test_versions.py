"""Which version a refit publishes as (``Publisher.version_for``): versions only grow, and the cases
where a version is sent again are taken."""

from __future__ import annotations

import pytest

from molt.broadcaster.config import BroadcasterSettings
from molt.broadcaster.publication import Publisher
from molt.core.errors import InvalidInput


def publisher(published_here: int = 0) -> Publisher:
    made = Publisher(BroadcasterSettings(publish_redis=False))
    made.published_here = published_here
    return made


def test_versions_only_grow_but_the_routers_unpublished_one_is_taken_again() -> None:
    assert publisher().version_for(4, 4, False, router_version=3) == 4
    # The broadcaster before this one resumed the engines at 12 and died before publishing it: the
    # learner, which never saw the reply, sends 12 again to this one.
    assert publisher().version_for(12, 12, False, router_version=12) == 12
    with pytest.raises(InvalidInput, match="not newer"):
        publisher(published_here=12).version_for(12, 12, False, router_version=12)  # published here: a replay
    with pytest.raises(InvalidInput, match="not newer"):
        publisher().version_for(11, 11, False, router_version=12)
    assert publisher().version_for(10, 10, True, router_version=12) == 13  # a learner restarted behind
