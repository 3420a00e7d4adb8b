"""Every recipe loads in every service's settings class, and ``molt plan`` places it correctly.

The recipes are what a new user runs first: a recipe that a service refuses, or whose plan
does not fit its declared machine, must fail here rather than minutes into a run.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from molt.launcher.cli import main as molt_main
from molt.launcher.plan import PlanError, check_recipe, plan_or_raise
from molt.launcher.recipe import SERVICES, load_recipe, wire

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
MAIN_MODULES = {
    "router": "molt.router",
    "broadcaster": "molt.broadcaster",
    "learner": "molt.learner",
    "agent_pool": "molt.agent_pool",
}


def test_the_shipped_recipes_exist() -> None:
    assert {r.name for r in RECIPES} >= {"tiny-cpu.toml", "tiny-math-cpu.toml", "qwen3-4b-math.toml", "cluster.toml"}


@pytest.mark.parametrize("section", list(SERVICES))
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_in_each_service(
    recipe: Path, section: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`molt-<svc> --config R --dry-run` exits normally (the console script's own entry point)."""
    monkeypatch.chdir(ROOT)
    for key in [k for k in os.environ if k.startswith("MOLT_")]:  # the recipe alone decides
        monkeypatch.delenv(key)
    main = importlib.import_module(f"{MAIN_MODULES[section]}.__main__").main
    main(["--config", str(recipe), "--dry-run"])  # a config error raises SystemExit(2)
    assert '"run_id"' in capsys.readouterr().out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_services_agree(recipe: Path) -> None:
    """Mirrored values match (learner vs router / agent-pool / broadcaster) and the learner is sound."""
    assert check_recipe(load_recipe(recipe)) == []


def placements(recipe: Path, *sets: str) -> list[tuple[str, int, tuple[int, ...], int]]:
    plan = plan_or_raise(load_recipe(recipe, sets))
    return [(p.service, p.node, p.gpus, p.cpus) for p in plan.placements if p.cpus or p.gpus]


def test_tiny_cpu_plan() -> None:
    """One CPU for the learner's rank, one for the engine's Ray bundle: the 2 declared CPUs."""
    got = placements(ROOT / "recipes/tiny-cpu.toml")
    assert got == [("learner", 0, (), 1), ("router", 0, (), 1)]


def test_qwen3_4b_plan_splits_one_node() -> None:
    got = placements(ROOT / "recipes/qwen3-4b-math.toml")
    assert [g for s, n, g, _ in got if s == "learner"] == [(0,), (1,), (2,), (3,)]
    assert [g for s, n, g, _ in got if s == "router"] == [(4,), (5,), (6,), (7,)]
    assert {n for _, n, _, _ in got} == {0}


def test_cluster_plan_train_node_0_rollout_node_1() -> None:
    got = placements(ROOT / "recipes/cluster.toml")
    assert [(n, g) for s, n, g, _ in got if s == "learner"] == [(0, (i,)) for i in range(8)]
    assert [(n, g) for s, n, g, _ in got if s == "router"] == [(1, (i,)) for i in range(8)]


def test_cluster_engines_are_pinned_to_their_planned_nodes(tmp_path: Path) -> None:
    """On several nodes the launcher hands the router its plan: each engine's node, which the router turns
    into a Ray label selector (molt/node=<index>). A recipe pinning engines itself is refused there."""
    sets = ["learner.data_parallel_size=6", "router.engine.engine_count=7"]
    recipe = load_recipe(ROOT / "recipes/cluster.toml", sets)
    plan = plan_or_raise(recipe)
    assert plan.engine_nodes() == [0, 0, 1, 1, 1, 1, 1]  # first-fit: node 0's 2 GPUs the learner leaves
    tables = wire(recipe, tmp_path, None, "10.0.0.1:6379", plan.engine_nodes())
    assert tables["router"]["engine"]["nodes"] == [0, 0, 1, 1, 1, 1, 1]
    pinned = load_recipe(ROOT / "recipes/cluster.toml", ["router.engine.nodes=[1, 1, 1, 1, 1, 1, 1, 1]"])
    assert any("leave router.engine.nodes unset" in p for p in check_recipe(pinned))


def test_tensor_parallel_engines_pack_on_one_node() -> None:
    """4 engines x TP 2 beside 8 learner ranks: each engine's 2 GPUs on one node."""
    got = placements(
        ROOT / "recipes/cluster.toml", "router.engine.engine_count=4", "router.engine.tensor_parallel_size=2"
    )
    assert [(n, g) for s, n, g, _ in got if s == "router"] == [(1, (0, 1)), (1, (2, 3)), (1, (4, 5)), (1, (6, 7))]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("router.engine.engine_count=5",), r"router: engine 4 does not fit: the recipe asks for 5 engines x 1 GPUs"),
        (("learner.data_parallel_size=16",), r"data_parallel_size = 16 ranks need 16 GPUs on one node"),
        (("router.engine.tensor_parallel_size=16",), r"tensor_parallel_size = 16 GPUs per engine, but a node has 8"),
        (("learner.refit_every=0",), r"refit_every = 0 never sends the engines new weights"),
        (("learner.refit_every=3",), r"up to 2 versions old between refits, more than rollout.max_staleness = 1"),
    ],
)
def test_recipe_that_does_not_fit_fails_clearly(sets: tuple[str, ...], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_or_raise(load_recipe(ROOT / "recipes/qwen3-4b-math.toml", sets))


def test_tiny_cpu_on_one_cpu_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command: exit code 2 and the reason on stderr."""
    with pytest.raises(SystemExit) as exited:
        molt_main(["plan", str(ROOT / "recipes/tiny-cpu.toml"), "--set", "launcher.cpus_per_node=1"])
    assert exited.value.code == 2
    assert "router: engine 0 does not fit" in capsys.readouterr().err


def test_plan_command_prints_every_process(capsys: pytest.CaptureFixture[str]) -> None:
    molt_main(["plan", str(ROOT / "recipes/cluster.toml")])
    out = capsys.readouterr().out
    assert "node 0: GPUs 8/8 used" in out
    assert "node 1: GPUs 8/8 used" in out
    assert out.count("engine ") == 8 and out.count("rank ") == 8


def test_gpu_1_plan_colocates_learner_and_engine_on_one_gpu(tmp_path: Path) -> None:
    """[launcher] colocate: both on GPU 0, the GPU counted once, and the refit wired to CUDA IPC."""
    recipe = load_recipe(ROOT / "recipes/gpu-1.toml")
    got = placements(ROOT / "recipes/gpu-1.toml")
    assert [(s, g) for s, _, g, _ in got] == [("learner", (0,)), ("router", (0,))]
    assert "node 0: GPUs 1/1 used" in plan_or_raise(recipe).render("plan")
    assert wire(recipe, tmp_path, None, None, [0])["broadcaster"]["backend"] == "cuda_ipc"
    assert recipe.broadcaster.backend == "auto"  # the recipe itself names no transport


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("learner.data_parallel_size=2", "launcher.gpus_per_node=2"), r"the recipe has 2 rank\(s\), 1 engine\(s\)"),
        (("router.engine.engine_count=2",), r"1 rank\(s\), 2 engine\(s\)"),
        (("broadcaster.backend=nccl",), r"its refit goes through CUDA IPC, but \[broadcaster\] backend = 'nccl'"),
        (("launcher.gpus_per_node=0",), r"it needs GPUs"),
    ],
)
def test_colocation_beyond_one_gpu_is_refused(sets: tuple[str, ...], message: str) -> None:
    with pytest.raises(PlanError, match=r"\[launcher\] colocate = true: .*" + message):
        plan_or_raise(load_recipe(ROOT / "recipes/gpu-1.toml", sets))
