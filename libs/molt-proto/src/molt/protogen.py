"""Generates the checked-in Python stubs of ``protos/molt/v1`` (``uv run molt-gen-protos``).

The stubs under ``libs/molt-proto/src/molt/v1`` are never edited by hand. The
proto path equals the import path (``-I protos``), so the generated imports
(``from molt.v1 import common_pb2``) need no post-processing. The generator
(grpcio-tools, mypy-protobuf) is pinned in the workspace's dev group together
with the protobuf/grpcio runtime, because the gencode checks their versions at
import. ``tests/contract/test_stubs_fresh.py`` regenerates into a temporary
directory and byte-compares with the checked-in files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from importlib import resources
from pathlib import Path

PACKAGE_DIR = Path("molt") / "v1"


def find_repo_root(start: Path) -> Path:
    """Returns the nearest directory at or above ``start`` that holds ``protos/molt/v1``."""
    for candidate in (start, *start.parents):
        if (candidate / "protos" / PACKAGE_DIR).is_dir():
            return candidate
    raise SystemExit(f"no protos/{PACKAGE_DIR} found at or above {start}; run from the molt checkout")


def _plugin(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} not found: install the workspace's dev group (uv sync)")
    return path


def generate(proto_root: Path, out_dir: Path) -> list[Path]:
    """Writes ``_pb2.py``, ``_pb2.pyi``, ``_pb2_grpc.py``, ``_pb2_grpc.pyi`` and ``py.typed`` into ``out_dir/molt/v1``."""
    from grpc_tools import protoc  # dev-group only: imported here so the runtime never needs it

    protos = sorted(str(p.relative_to(proto_root)) for p in (proto_root / PACKAGE_DIR).glob("*.proto"))
    well_known = resources.files("grpc_tools") / "_proto"
    target = out_dir / PACKAGE_DIR
    if target.exists():
        for old in target.glob("*_pb2*"):
            old.unlink()
    target.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (its message is above)")
    (target / "py.typed").write_text("")
    return sorted(target.iterdir())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output root (default: libs/molt-proto/src of the checkout)")
    args = parser.parse_args(argv)
    root = find_repo_root(Path.cwd())
    out = args.out or root / "libs" / "molt-proto" / "src"
    for path in generate(root / "protos", out):
        sys.stdout.write(f"wrote {path}\n")


if __name__ == "__main__":
    main()
