"""``[router.engine] nodes``: one node index per engine, or none."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from molt.router.config import EngineSettings


def test_one_node_per_engine_or_none() -> None:
    assert EngineSettings(model_path="m", engine_count=2).nodes == []
    assert EngineSettings(model_path="m", engine_count=2, nodes=[1, 0]).nodes == [1, 0]
    with pytest.raises(ValidationError, match=r"names 1 node\(s\) for engine_count = 2 engines"):
        EngineSettings(model_path="m", engine_count=2, nodes=[1])
    with pytest.raises(ValidationError, match="node indices start at 0"):
        EngineSettings(model_path="m", engine_count=1, nodes=[-1])
