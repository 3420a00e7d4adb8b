"""The prompt dataset: a JSONL file, one object per line, cycled through in a seeded order."""

from __future__ import annotations

import json
import random
from pathlib import Path

from molt.agent_pool.agents import Prompt
from molt.core.errors import InvalidInput


class PromptSource:
    """Cycles through a JSONL prompt file, reshuffled (seeded) every epoch."""

    def __init__(self, path: Path, seed: int = 0) -> None:
        self.prompts: list[Prompt] = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)
            except ValueError as exc:
                raise InvalidInput(f"{path}:{number} is not valid JSON: {exc}") from exc
            if not isinstance(prompt, dict):
                raise InvalidInput(f"{path}:{number} is not a JSON object")
            prompt.setdefault("id", f"{path.stem}-{len(self.prompts) + 1}")  # counts prompts, not blank lines
            self.prompts.append(prompt)
        if not self.prompts:
            raise InvalidInput(f"prompt file {path} is empty")
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def next(self) -> Prompt:
        if not self.order:
            self.order = list(range(len(self.prompts)))
            self.rng.shuffle(self.order)
        return self.prompts[self.order.pop()]
