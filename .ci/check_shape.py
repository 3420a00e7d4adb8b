"""The house shape of the source tree (CONTRIBUTING.md): every ``.py`` file under a ``src/`` folder
is at most 400 lines and every function in it at most 80, generated protobuf stubs excepted.

Run from the repository root: ``uv run --frozen python .ci/check_shape.py``; it prints each breach
and exits 1 when there is one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
PACKAGE_ROOTS = ("libs", "services", "apps")


def source_files(root: Path) -> list[Path]:
    """Every hand-written module under a package's ``src/`` (the generated ``_pb2`` stubs left out)."""
    files = [path for top in PACKAGE_ROOTS for path in (root / top).glob("*/src/**/*.py")]
    return sorted(path for path in files if "_pb2" not in path.name)


def breaches(path: Path, root: Path) -> list[str]:
    """One line per limit ``path`` breaks."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(root)
    found = []
    lines = text.count("\n")
    if lines > MAX_FILE_LINES:
        found.append(f"{name}: {lines} lines (limit {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines (limit {MAX_FUNCTION_LINES})")
    return found


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    files = source_files(root)
    if not files:
        sys.stderr.write("check_shape: no source file found\n")
        return 1
    found = [line for path in files for line in breaches(path, root)]
    for line in found:
        sys.stderr.write(line + "\n")
    sys.stderr.write(f"check_shape: {len(files)} files, {len(found)} breaches\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
