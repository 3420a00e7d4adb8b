"""Untrusted tool code (Python a model wrote) run outside the pool's process, with limits.

``run_python(code)`` runs ``code`` in a fresh interpreter that cannot reach the network, cannot see or
signal any process outside its own (new user, network and PID namespaces: ``unshare``), runs as
``nobody`` when the pool runs as root (``setpriv``, so it cannot write what root owns), in an empty
scratch directory that is removed afterwards, and under limits set before the code runs: CPU seconds,
address space, size of any file it writes, no core dumps. The pool waits at most ``wall_s`` (a
``sleep`` uses no CPU time) and then kills the whole namespace; stdout and stderr are cut to
``output_bytes``. A tool call can fail in any way the code likes; the pool does not.

Not isolated: files the sandbox user may read (world-readable ones) and world-writable directories.
Needs util-linux's ``unshare`` and ``setpriv`` and user namespaces (refused with a clear message
where they are missing, rather than run unisolated).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

NOBODY = 65534
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")  # the code needs the standard library only
# Runs first in the sandbox: the limits cannot be raised again by the code (no capability outside its
# namespace), then the code, read from stdin, as __main__.
# SIGXCPU at the CPU limit ends it with CPU_EXIT (the kernel's SIGKILL a second later, should the code
# have taken the signal over).
RUNNER = """import os, resource, signal, sys
cpu, memory, files = map(int, sys.argv[1:4])
for limit, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                          (resource.RLIMIT_FSIZE, files, files), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(limit, (soft, hard))
signal.signal(signal.SIGXCPU, lambda *_: os._exit(152))
code = sys.stdin.read()
del cpu, memory, files, limit, soft, hard, resource
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""
CPU_EXIT = 152  # 128 + SIGXCPU


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    memory_bytes: int = 512 * 1024 * 1024
    file_bytes: int = 1024 * 1024
    wall_s: float = 10.0
    output_bytes: int = 16 * 1024


@dataclass(frozen=True)
class SandboxResult:
    """What the code printed and how it ended: ``exit_code`` is the code's (``CPU_EXIT`` past the CPU
    limit); ``timed_out``: stopped at the wall limit."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool

    def for_the_model(self) -> str:
        """The tool message: its output, or why it failed (the last lines of a traceback)."""
        if self.timed_out:
            return "error: the code ran past its time limit and was stopped"
        if self.exit_code == 0:
            return self.stdout or "(no output)"
        if self.exit_code == CPU_EXIT:
            return "error: the code ran past its CPU time limit and was stopped"
        tail = "\n".join(self.stderr.strip().splitlines()[-3:])
        return f"error (exit {self.exit_code}):\n{tail}"


def sandbox_command(limits: SandboxLimits) -> list[str]:
    """The argv that runs ``RUNNER`` isolated; raises ``RuntimeError`` where isolation is not available."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare is None or (os.geteuid() == 0 and setpriv is None):
        raise RuntimeError("untrusted tool code needs util-linux's unshare (and setpriv as root); not run")
    prefix = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []
    limits_argv = [str(limits.cpu_s), str(limits.memory_bytes), str(limits.file_bytes)]
    # -r: a user namespace (root inside maps to the caller outside: no capability over the host);
    # -n: no network; -p -f --mount-proc: its own PID namespace, where no outside process is visible;
    # --kill-child: the namespace's first process (and so all of it) dies with unshare.
    isolate = [unshare, "-rnpf", "--mount-proc", "--kill-child"]
    return [*prefix, *isolate, _interpreter(), "-I", "-c", RUNNER, *limits_argv]  # type: ignore[list-item]


def _interpreter() -> str:
    """A Python the sandbox user may run: the pool's own, unless the pool is root and ``nobody`` runs
    the code (a virtual environment under root's home is closed to it); then the system's."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in SYSTEM_PYTHONS:
        if os.path.isfile(candidate):
            return candidate
    raise RuntimeError(f"untrusted tool code run as nobody needs a system Python ({', '.join(SYSTEM_PYTHONS)})")


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Runs ``code`` in the sandbox (module docstring) and returns what it printed and how it ended."""
    limits = limits or SandboxLimits()
    scratch = tempfile.mkdtemp(prefix="molt-tool-")
    os.chmod(scratch, 0o777)  # the sandbox user (nobody) writes there
    try:
        process = await asyncio.create_subprocess_exec(
            *sandbox_command(limits),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=scratch,
            env={"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        timed_out = False
        try:
            out, err = await asyncio.wait_for(process.communicate(code.encode()), limits.wall_s)
        except TimeoutError:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)  # its session: setpriv, unshare and what they started
            out, err = await process.communicate()
        assert process.returncode is not None
        cut = limits.output_bytes
        return SandboxResult(
            out[:cut].decode(errors="replace"), err[-cut:].decode(errors="replace"), process.returncode, timed_out
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
