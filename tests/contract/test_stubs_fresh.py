"""The checked-in stubs equal a fresh generation from protos/ (run `uv run molt-gen-protos` to refresh)."""

from __future__ import annotations

from pathlib import Path

from molt.protogen import PACKAGE_DIR, find_repo_root, generate

ROOT = find_repo_root(Path(__file__).resolve().parent)


def test_checked_in_stubs_are_fresh(tmp_path: Path) -> None:
    fresh = {p.name: p.read_bytes() for p in generate(ROOT / "protos", tmp_path)}
    checked_in_dir = ROOT / "libs" / "molt-proto" / "src" / PACKAGE_DIR
    checked_in = {p.name: p.read_bytes() for p in checked_in_dir.iterdir() if p.is_file()}
    assert sorted(checked_in) == sorted(fresh), "stub files added or missing: run `uv run molt-gen-protos`"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale stubs {stale}: run `uv run molt-gen-protos` and commit the result"
