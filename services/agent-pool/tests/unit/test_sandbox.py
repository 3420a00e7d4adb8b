"""Untrusted tool code in the sandbox (real subprocesses, real namespaces): it runs and prints; every
escape tried fails (network, another process, a root-owned file, CPU, memory, file size, wall time,
a child left behind); the calling process is untouched and the next call works."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from molt.agent_pool.agents import load_agent
from molt.agent_pool.sandbox import CPU_EXIT, SandboxLimits, SandboxResult, run_python

REPO = Path(__file__).resolve().parents[4]
FAST = SandboxLimits(cpu_s=1, memory_bytes=256 * 1024 * 1024, file_bytes=64 * 1024, wall_s=3.0)


def run(code: str, limits: SandboxLimits = FAST) -> SandboxResult:
    return asyncio.run(run_python(code, limits))


def test_code_runs_and_its_output_comes_back() -> None:
    result = run("print(sum(range(10)))\nimport os\nprint(os.getcwd().split('/')[-1].startswith('molt-tool-'))")
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "45\nTrue\n", False)
    assert result.for_the_model() == "45\nTrue\n"


def test_no_network() -> None:
    result = run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert result.exit_code == 1 and "Network is unreachable" in result.stderr


def test_no_process_outside_is_visible_or_killable() -> None:
    result = run(f"import os\nprint(os.getpid())\nos.kill({os.getpid()}, 9)")
    assert result.exit_code == 1 and "ProcessLookupError" in result.stderr
    assert result.stdout == "1\n"  # the first process of its own PID namespace


def test_a_file_the_caller_owns_outside_is_not_writable(tmp_path: Path) -> None:
    target = tmp_path / "owned"
    target.write_text("kept")
    target.chmod(0o644)
    result = run(f"open({str(target)!r}, 'w').write('overwritten')")
    assert result.exit_code == 1 and "PermissionError" in result.stderr
    assert target.read_text() == "kept"


@pytest.mark.parametrize(
    ("code", "what"),
    [
        ("while True:\n    pass", "cpu"),
        ("x = bytearray(1 << 30)", "memory"),
        ("open('big', 'wb').write(b'x' * (1 << 20))", "file size"),
    ],
)
def test_each_limit_stops_the_code(code: str, what: str) -> None:
    started = time.monotonic()
    result = run(code)
    assert not result.timed_out and time.monotonic() - started < FAST.wall_s
    if what == "cpu":
        assert result.exit_code == CPU_EXIT and "CPU time limit" in result.for_the_model()
    elif what == "memory":
        assert result.exit_code == 1 and "MemoryError" in result.stderr
    else:  # Python ignores SIGXFSZ: the write fails instead
        assert result.exit_code == 1 and "File too large" in result.stderr


def test_the_wall_limit_ends_the_code_and_every_process_it_started() -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.execv('/bin/sleep', ['sleep', '997'])\ntime.sleep(60)"
    started = time.monotonic()
    result = run(code)
    assert result.timed_out and time.monotonic() - started < FAST.wall_s + 2
    assert "time limit" in result.for_the_model()
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "sleep 997"], capture_output=True, text=True)
    assert left.stdout == "", "a process the code started outlived the sandbox"
    assert run("print('next')").stdout == "next\n"  # the caller goes on


def test_the_shipped_python_tool_env_runs_the_models_code_in_the_sandbox() -> None:
    env = load_agent(str(REPO / "recipes" / "agents" / "python_tool.py") + ":PythonToolEnv")()

    async def episode() -> tuple[list[object], list[object], float]:
        await env.reset({"question": "What is 6*7?", "answer": "42"})
        call = '<tool_call>{"name": "python", "arguments": {"code": "import os; print(6*7, os.getpid())"}}</tool_call>'
        ran = await env.step(call)
        escape = await env.step(
            '<tool_call>{"name": "python", "arguments": {"code": "import socket; socket.create_connection('
            "('1.1.1.1', 53), timeout=2)\"}}</tool_call>"
        )
        final = await env.step("42")
        assert not ran.done and not escape.done and final.done
        return ran.observation or [], escape.observation or [], final.reward

    ran, escape, reward = asyncio.run(episode())
    assert [m["content"] for m in ran] == ["42 1\n"]  # type: ignore[index]
    assert "Network is unreachable" in escape[0]["content"]  # type: ignore[index]
    assert reward == 1.0
