"""docs/configuration.md equals a fresh `molt settings` (run `uv run molt settings > docs/configuration.md`)."""

from __future__ import annotations

from pathlib import Path

from molt.launcher.settings_doc import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_reference_is_fresh() -> None:
    assert DOC.read_text() == render(), "stale: run `uv run molt settings > docs/configuration.md` and commit it"


def test_every_table_and_nested_key_is_listed() -> None:
    text = render()
    tables = (
        "run",
        "rollout",
        "router",
        "router.engine",
        "router.pause",
        "learner.algorithm.importance_sampling",
        "launcher",
    )
    for table in tables:
        assert f"## `[{table}]`" in text
    assert "| `wait` | " in text and "| `kv_cache` | " in text and "| `rollout_nice` | " in text
