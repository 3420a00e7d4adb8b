"""The prompt file: a malformed line is named by file and line, blank lines are skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from molt.agent_pool.prompts import PromptSource
from molt.core.errors import InvalidInput


def test_a_malformed_line_is_named_by_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question": "1+1"}\n\n{"question": "2+2"}\n{"question": 3+\n')
    with pytest.raises(InvalidInput, match=r"prompts.jsonl:4 is not valid JSON"):
        PromptSource(path)
    path.write_text('{"question": "1+1"}\n\n[1]\n')
    with pytest.raises(InvalidInput, match=r"prompts.jsonl:3 is not a JSON object"):
        PromptSource(path)
    path.write_text("\n\n")
    with pytest.raises(InvalidInput, match="is empty"):
        PromptSource(path)
    path.write_text('{"question": "1+1"}\n\n{"id": "mine", "question": "2+2"}\n{"question": "3+3"}\n')
    assert [p["id"] for p in PromptSource(path).prompts] == ["prompts-1", "mine", "prompts-3"]
