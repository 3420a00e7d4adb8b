"""What the benches share: a real rollout-router on the tiny model, and the Qwen2-shaped config
of the GPU benches.

Imported by scripts run as ``python bench/<name>.py`` (their directory is on ``sys.path``).
Imports happen inside the functions: the GPU benches run where only torch and transformers are.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from molt.core.processes import ServiceProcess


def qwen2_config(hidden: int, intermediate: int, layers: int, vocab: int, max_positions: int) -> Any:
    """A dense Qwen2 shape with head_dim 128, 4 query heads per KV head and a tied lm_head."""
    from transformers import Qwen2Config

    heads = hidden // 128
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=128,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )


def start_router(
    workdir: Path,
    model: Path,
    *,
    run_id: str,
    context: int,
    temperature: float,
    max_tokens_cap: int,
    stream_interval: int | None = None,
    wait: str | None = None,
    dtype: str = "float32",
    gpu_memory_utilization: float | None = None,
    engine_args: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
) -> tuple[ServiceProcess, str]:
    """Starts ``molt-router`` on ``model`` (``dtype``, eager unless ``engine_args`` says otherwise) and waits
    until it serves; returns it and its address. ``engine_args`` pass through to vLLM as the recipe's
    ``[router.engine] engine_args`` do; ``rollout`` adds values to the ``[rollout]`` table."""
    from molt.core.ports import free_port
    from molt.core.processes import ServiceProcess

    port = free_port()
    recipe = workdir / "router.toml"
    passed: dict[str, Any] = {"enforce_eager": True, **(engine_args or {})}
    recipe.write_text(
        f'[run]\nrun_id = "{run_id}"\nrun_dir = "{workdir / "run"}"\n'
        f'[router]\nlisten = "127.0.0.1:{port}"\nmetrics_port = 0\n'
        f'[router.engine]\nmodel_path = "{model}"\ndtype = "{dtype}"\nmax_model_len = {context}\n'
        f"engine_args = {toml_inline(passed)}\n"
        + (f"gpu_memory_utilization = {gpu_memory_utilization}\n" if gpu_memory_utilization else "")
        + (f"stream_interval = {stream_interval}\n" if stream_interval else "")
        + (f'wait = "{wait}"\n' if wait else "")
        + f"[router.sampling]\nmax_tokens_cap = {max_tokens_cap}\n"
        + "[rollout]\n"
        + "".join(
            f"{key} = {json.dumps(value)}\n" for key, value in {"temperature": temperature, **(rollout or {})}.items()
        )
    )
    router = ServiceProcess(
        [sys.executable, "-m", "molt.router", "--config", str(recipe)],
        f"127.0.0.1:{port}",
        workdir / "router.log",
        env={"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"},
        service="molt.v1.RolloutService",
    )
    router.start(timeout_s=600)
    return router, f"127.0.0.1:{port}"


def toml_inline(table: dict[str, Any]) -> str:
    """``table`` (strings, booleans, numbers, tables) as a TOML inline table."""

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return toml_inline(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(item) for item in v) + "]"
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v) if isinstance(v, str) else repr(v)  # a JSON string is a TOML basic string

    return "{ " + ", ".join(f"{json.dumps(key)} = {value(v)}" for key, v in table.items()) + " }"


def parse_assignments(assignments: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings, each VALUE a TOML value (``true``, ``8``, ``"TRITON_ATTN"``), as a dict; a key
    given twice takes the later value."""
    parsed: dict[str, Any] = {}
    for assignment in assignments:
        parsed.update(tomllib.loads(assignment))
    return parsed


class CpuSampler(threading.Thread):
    """Every ``every_s``: the wall clock, the machine's busy CPU seconds (``/proc/stat``, all CPUs) and
    each process's CPU seconds (``/proc/<pid>/stat``) by command name, for the busy share of a window."""

    def __init__(self, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every_s = every_s
        self.samples: list[tuple[float, float, dict[int, tuple[str, float]]]] = []
        self.halt = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.parents: dict[int, int] = {}  # pid -> parent pid, of every process seen

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append((time.time(), self.busy_s(), self.processes()))
            self.halt.wait(self.every_s)
        self.samples.append((time.time(), self.busy_s(), self.processes()))  # closes a window ending at the halt

    def busy_s(self) -> float:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        return (sum(ticks) - ticks[3] - ticks[4]) / self.tick

    def processes(self) -> dict[int, tuple[str, float]]:
        found: dict[int, tuple[str, float]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
            found[int(entry.name)] = (name, (int(rest[11]) + int(rest[12])) / self.tick)  # utime + stime
            self.parents[int(entry.name)] = int(rest[1])
        return found

    def owner(self, pid: int, roots: dict[int, str]) -> str:
        """The label of the first of ``roots`` that ``pid`` descends from (or is), else "other"."""
        seen = set()
        while pid not in roots and pid in self.parents and pid not in seen:
            seen.add(pid)
            pid = self.parents[pid]
        return roots.get(pid, "other")

    def window(
        self, start: float, end: float, roots: dict[int, str] | None = None
    ) -> tuple[float, list[tuple[str, float]]]:
        """Busy cores on average over [start, end] (nearest samples inside it, or around it when fewer than
        two fall inside) and CPU cores used per command, busiest first; with ``roots`` (pid -> label) per
        ``label:command`` of the process tree it belongs to."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:  # a window shorter than the sampling interval: the samples around it
            inside = [s for s in self.samples if s[0] <= start][-1:] + [s for s in self.samples if s[0] >= end][:1]
        (t0, busy0, procs0), (t1, busy1, procs1) = inside[0], inside[-1]
        per_name: dict[str, float] = {}
        for pid, (name, cpu) in procs1.items():
            before = procs0.get(pid, (name, 0.0))[1]
            key = f"{self.owner(pid, roots)}:{name}" if roots else name
            per_name[key] = per_name.get(key, 0.0) + cpu - before
        top = sorted(per_name.items(), key=lambda item: -item[1])
        return (busy1 - busy0) / (t1 - t0), [(name, cpu / (t1 - t0)) for name, cpu in top]
