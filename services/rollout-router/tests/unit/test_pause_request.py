"""PauseGeneration's drain_timeout: a Duration outside the type's range is refused, not an OverflowError."""

from __future__ import annotations

import pytest
from google.protobuf import duration_pb2

from molt.core.errors import InvalidInput


def test_a_drain_timeout_outside_the_duration_range_is_refused() -> None:
    # Imported here, not at collection: molt.router.server imports Ray (see test_take_over.py).
    from molt.router.server import _seconds

    assert _seconds(duration_pb2.Duration(seconds=1, nanos=500_000_000)) == 1.5
    assert _seconds(duration_pb2.Duration(seconds=-2)) == -2  # negative: refused by the caller, by name
    for seconds, nanos in ((2**63 - 1, 0), (-(2**63), 0), (1, -5), (0, 10**9)):
        with pytest.raises(InvalidInput, match="not a valid Duration"):
            _seconds(duration_pb2.Duration(seconds=seconds, nanos=nanos))
