"""A router attaching to engines that outlived an earlier router takes their version and pause over."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from molt.core.errors import WrongState
from molt.router.config import RouterSettings
from molt.router.engine_spec import EngineInfo


def pool_over(*engines: tuple[int, bool]) -> Any:
    """A pool that took over engines at (policy version, paused); it holds no actors (nothing to resume)."""
    # Imported here, not at collection: molt.router.engine_pool imports Ray, and Ray reads its environment
    # (RAY_AUTH_MODE) once, at import; a later test that connects to a token-auth head sets it first.
    from molt.router.engine_pool import EnginePool

    pool = EnginePool(RouterSettings(engine={"model_path": Path("unused")}))  # type: ignore[arg-type]
    infos = [EngineInfo(f"engine-{i}", 320, 1024, version, paused) for i, (version, paused) in enumerate(engines)]
    pool._take_over(infos)
    return pool


def test_fresh_engines_start_at_version_0_running() -> None:
    pool = pool_over((0, False), (0, False))
    assert (pool.policy_version, pool.paused, pool._open.is_set()) == (0, False, True)


def test_a_paused_engine_keeps_the_router_paused_at_its_version_until_a_resume() -> None:
    pool = pool_over((3, True))
    assert (pool.policy_version, pool.paused, pool._open.is_set()) == (3, True, False)
    assert asyncio.run(pool.resume(None)) == 3  # the version it took over, not 0
    assert not pool.paused and pool._open.is_set()


def test_engines_at_different_versions_resume_only_with_a_new_version() -> None:
    pool = pool_over((5, False), (0, False))  # e.g. one engine attached, one started fresh beside it
    assert (pool.policy_version, pool.paused) == (5, True)
    with pytest.raises(WrongState, match="only a refit"):
        asyncio.run(pool.resume(None))
    assert pool.paused
    assert asyncio.run(pool.resume(6)) == 6  # what a refit's resume does: every engine got version 6
    assert not pool.paused
