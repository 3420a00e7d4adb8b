"""Prompt datasets: every supported form loads the same prompts, keys map into what Envs read, and
what cannot be loaded is named (file and line, column, split), as are the keys that moved."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import datasets
import pytest

from molt.agent_pool.agents import load_agent
from molt.agent_pool.config import AgentPoolSettings
from molt.agent_pool.dataset import load_prompts, names_local
from molt.agent_pool.envs.math import MathEnv
from molt.core.config import load_settings
from molt.core.errors import ConfigError, InvalidInput

REPO = Path(__file__).resolve().parents[4]
ROWS = [{"problem": f"{n}+1", "solution": n + 1} for n in range(5)]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def as_pairs(path: Path | str, split: str) -> list[tuple[object, object]]:
    prompts = load_prompts(str(path), split, "problem", "solution")
    return [(p["question"], p["answer"]) for p in prompts.all()]


def test_jsonl_parquet_and_saved_directories_load_the_same_prompts(tmp_path: Path) -> None:
    expected = [(row["problem"], row["solution"]) for row in ROWS]
    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table.select(range(2)), "test": table}).save_to_disk(str(tmp_path / "splits"))
    (tmp_path / "files").mkdir()
    table.to_parquet(str(tmp_path / "files" / "test-00000.parquet"))
    table.select(range(1)).to_parquet(str(tmp_path / "files" / "train-00000.parquet"))

    assert as_pairs(write_jsonl(tmp_path / "rows.jsonl", ROWS), "train") == expected
    assert as_pairs(tmp_path / "rows.jsonl", "test") == expected  # a single file is one split, by any name
    assert as_pairs(tmp_path / "rows.parquet", "train") == expected
    assert as_pairs(tmp_path / "saved", "train") == expected
    assert as_pairs(tmp_path / "splits", "test") == expected
    assert as_pairs(tmp_path / "files", "test") == expected
    assert as_pairs(tmp_path / "files", "train") == expected[:1]


def test_keys_map_into_the_prompt_math_env_and_arithmetic_env_read(tmp_path: Path) -> None:
    """prompt_key and answer_key land under "question" and "answer", beside every column of the row."""
    path = write_jsonl(tmp_path / "math.jsonl", [{"problem": "What is 2+3?", "solution": "5", "level": 1}])
    (prompt,) = load_prompts(str(path), "train", "problem", "solution").all()
    assert prompt == {
        "problem": "What is 2+3?",
        "solution": "5",
        "level": 1,
        "question": "What is 2+3?",
        "answer": "5",
        "id": "math-1",
    }
    math_env = MathEnv()
    messages = asyncio.run(math_env.reset(prompt))
    assert messages[-1] == {"role": "user", "content": "What is 2+3?"} and math_env.reference == "5"
    arithmetic = load_agent(f"{REPO}/recipes/agents/arithmetic.py:ArithmeticEnv")()
    messages = asyncio.run(arithmetic.reset(prompt))  # type: ignore[attr-defined]
    assert messages[-1] == {"role": "user", "content": "What is 2+3?="}


def test_a_rows_own_id_is_kept_and_the_others_are_numbered_by_row(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question": "1+1", "answer": 2}\n\n{"id": "mine", "question": "2+2", "answer": 4}\n')
    path.write_text(path.read_text() + '{"question": "3+3", "answer": 6}\n')
    assert [p["id"] for p in load_prompts(str(path), "train").all()] == ["prompts-1", "mine", "prompts-3"]


def test_what_cannot_be_loaded_is_named(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question": "1+1", "answer": 2}\n\n{"question": 3+\n')
    with pytest.raises(InvalidInput, match=r"prompts.jsonl:3 is not valid JSON"):
        load_prompts(str(path), "train")
    path.write_text('{"question": "1+1", "answer": 2}\n[1]\n')
    with pytest.raises(InvalidInput, match=r"prompts.jsonl:2 is not a JSON object"):
        load_prompts(str(path), "train")
    path.write_text('{"question": "1+1", "answer": 2}\n')
    with pytest.raises(InvalidInput, match=r"no column 'problem'; its columns are \['question', 'answer'\]"):
        load_prompts(str(path), "train", prompt_key="problem")
    with pytest.raises(InvalidInput, match="does not exist"):
        load_prompts(str(tmp_path / "missing.parquet"), "train")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(InvalidInput, match=r"has no split 'test'; its splits are \['train'\]"):
        load_prompts(str(tmp_path / "splits"), "test", "problem", "solution")
    datasets.Dataset.from_list([{"question": "x", "answer": 1}]).select([]).to_parquet(str(tmp_path / "none.parquet"))
    with pytest.raises(InvalidInput, match=r"none.parquet.*no data"):
        load_prompts(str(tmp_path / "none.parquet"), "train")


def test_local_paths_are_told_from_hub_ids() -> None:
    """A hub id is tried only when the path cannot be a local one: a missing local path fails at once."""
    assert names_local("data/math-train.jsonl") and names_local("./math") and names_local("/data/math")
    assert names_local("recipes/data/saved")  # a hub id has at most one slash
    assert not names_local("openai/gsm8k") and not names_local("gsm8k")


def test_the_old_keys_fail_naming_their_new_place(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        '[agent_pool]\nagent = "arithmetic.py:ArithmeticEnv"\ntokenizer_path = "models/tiny"\n'
        'prompts_path = "train.jsonl"\nseed = 3\n[agent_pool.eval]\nenabled = true\ndata_path = "test.jsonl"\n'
    )
    with pytest.raises(ConfigError) as refused:
        load_settings(AgentPoolSettings, "agent_pool", ["--config", str(recipe)], environ={})
    assert refused.value.message.splitlines()[1:] == [
        "  agent_pool.prompts_path (from recipe [agent_pool]) moved to [agent_pool.data] path",
        "  agent_pool.seed (from recipe [agent_pool]) moved to [agent_pool.data] seed",
        "  agent_pool.eval.data_path (from recipe [agent_pool]) moved to [agent_pool.eval] path",
    ]
    recipe.write_text('[agent_pool]\nagent = "a.py:A"\ntokenizer_path = "t"\ndata = { path = "train.jsonl" }\n')
    with pytest.raises(ConfigError, match=r"agent_pool.prompts_path \(from environment\) moved to \[agent_pool.data\]"):
        load_settings(
            AgentPoolSettings, "agent_pool", ["--config", str(recipe)], environ={"MOLT_AGENT_POOL_PROMPTS_PATH": "x"}
        )
    settings, _ = load_settings(AgentPoolSettings, "agent_pool", ["--config", str(recipe)], environ={})
    assert (settings.data.path, settings.data.split, settings.data.shuffle) == ("train.jsonl", "train", True)
