"""Prompt datasets: rows loaded through Hugging Face ``datasets``, handed to agents as prompts.

``load_prompts`` reads a JSONL or parquet file, a ``save_to_disk`` directory, a directory of data
files or a hub dataset id into a ``datasets.Dataset`` (memory-mapped Arrow, so a large set is not
held as Python objects) and wraps it as ``PromptRows``: row i is the ``Prompt`` dict an agent's
``reset`` receives, every column of the row plus the ``prompt_key`` column under ``"question"``, the
``answer_key`` column under ``"answer"`` and ``"id"`` (the row's own, else ``<name>-<i + 1>``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from molt.agent_pool.agents import Prompt
from molt.core.errors import InvalidInput

if TYPE_CHECKING:
    import datasets

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes (a Dataset, a DatasetDict)


class PromptRows:
    """The rows of one split as prompts, by index (``rows[i]``), read from Arrow on each access."""

    def __init__(self, table: datasets.Dataset, name: str, prompt_key: str, answer_key: str) -> None:
        missing = [key for key in (prompt_key, answer_key) if key not in table.column_names]
        if missing:
            raise InvalidInput(
                f"dataset {name!r} has no column {' or '.join(map(repr, missing))}; its columns are "
                f"{table.column_names} (set [agent_pool.data] prompt_key and answer_key)"
            )
        if len(table) == 0:
            raise InvalidInput(f"dataset {name!r} has no rows")
        self.table = table
        self.name = name
        self.prompt_key = prompt_key
        self.answer_key = answer_key

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> Prompt:
        prompt: Prompt = dict(self.table[index])
        prompt["question"] = prompt[self.prompt_key]
        prompt["answer"] = prompt[self.answer_key]
        if prompt.get("id") is None:  # a JSONL row without one gets a column of None from its neighbours
            prompt["id"] = f"{self.name}-{index + 1}"
        return prompt

    def all(self) -> list[Prompt]:
        return [self[index] for index in range(len(self))]


def load_prompts(path: str, split: str, prompt_key: str = "question", answer_key: str = "answer") -> PromptRows:
    """The ``split`` of the dataset at ``path`` as prompts; ``InvalidInput`` names what is wrong."""
    return PromptRows(load_table(path, split), Path(path).stem or path, prompt_key, answer_key)


def load_table(path: str, split: str) -> datasets.Dataset:
    """One split of a local file, a saved or data-file directory, or a hub id (tried in that order)."""
    import datasets  # here, not above: `molt plan` checks paths with names_local without this second of import

    datasets.disable_progress_bars()  # bars on stderr would interleave the pool's JSON log lines
    local = Path(path)
    try:
        if local.is_dir() and any((local / marker).is_file() for marker in SAVED_MARKERS):
            return _saved_split(local, split)
        if names_local(path) and not local.exists():
            raise InvalidInput(f"dataset {path} does not exist")
        if local.suffix in FILE_BUILDERS:
            builder = FILE_BUILDERS[local.suffix]
            # A single file is one split: named after the split asked for, so that any name reads it.
            return datasets.load_dataset(builder, data_files={split: str(local)}, split=split)
        return datasets.load_dataset(path, split=split)  # a directory of data files, or a hub id
    except InvalidInput:
        raise
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as exc:
        where = _bad_json_line(local) if local.suffix in (".jsonl", ".json") else None
        detail = where or f"{type(exc).__name__}: {exc}"
        raise InvalidInput(f"cannot load dataset {path!r} (split {split!r}): {detail}") from exc


def names_local(path: str) -> bool:
    """Whether ``path`` can only mean a local file or directory: a data file's suffix, or a path no hub
    id has (``name`` and ``org/name`` are hub ids when no such directory exists)."""
    return Path(path).suffix in FILE_BUILDERS or path.startswith(("/", ".")) or path.count("/") > 1


def _saved_split(directory: Path, split: str) -> datasets.Dataset:
    import datasets

    loaded = datasets.load_from_disk(str(directory))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise InvalidInput(f"dataset {directory} has no split {split!r}; its splits are {sorted(loaded)}")
        return loaded[split]
    return loaded


def _bad_json_line(path: Path) -> str | None:
    """``file:N is not ...`` for the first line of a JSONL file that is not a JSON object (the Arrow
    reader's own error names neither the file nor the line)."""
    if not path.is_file():
        return None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            return f"{path}:{number} is not valid JSON: {exc}"
        if not isinstance(row, dict):
            return f"{path}:{number} is not a JSON object"
    return None
