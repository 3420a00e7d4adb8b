"""The ``molt`` command: ``up``, ``status``, ``down``, ``plan``.

``molt up RECIPE [--run-dir D] [--set table.key=value ...] [--without agent_pool]`` runs a recipe (see
``molt.launcher.up``; ``--without agent_pool`` leaves the pool out for a producer of your own);
``molt plan RECIPE`` prints where each process would go and checks that it fits, starting nothing;
``molt status [--run-dir D]`` and ``molt down [--run-dir D]`` act on the run recorded in
``D/state.json``. Errors in a recipe exit with code 2 and name the key.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from molt.core.errors import ConfigError
from molt.core.log import setup_logging
from molt.launcher.plan import plan_or_raise
from molt.launcher.progress import gather, status_line
from molt.launcher.recipe import load_recipe
from molt.launcher.run_secrets import run_access
from molt.launcher.settings_doc import render as render_settings
from molt.launcher.state import RunState, describe, down
from molt.launcher.up import up

RUNS = Path("runs")


def newest_run_dir() -> Path:
    """The run directory of a live `molt up` under runs/ (the newest if several), else the newest one."""
    states = sorted(RUNS.glob("*/state.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not states:
        raise FileNotFoundError(f"no run under {RUNS}/ (pass --run-dir)")
    live = [p.parent for p in states if RunState.load(p.parent).launcher_alive()]
    return live[0] if live else states[0].parent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="molt", description="Run a molt recipe: all four services as one run.")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up", help="start a run and follow it until it ends (Ctrl-C stops it)")
    start.add_argument("recipe", type=Path, help="TOML recipe, e.g. recipes/tiny-cpu.toml")
    start.add_argument("--run-dir", type=Path, help="run directory (default: the recipe's [run] run_dir)")
    start.add_argument(
        "--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="override a recipe value (repeatable)"
    )
    plan = commands.add_parser("plan", help="print the placement plan and check it fits; starts nothing")
    plan.add_argument("recipe", type=Path)
    plan.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    for sub in (start, plan):
        sub.add_argument(
            "--without",
            action="append",
            default=[],
            choices=["agent_pool"],
            help="leave a service out ([launcher] without): your own producer feeds the learner",
        )
    for name, text in (("status", "show a run's processes and progress"), ("down", "stop a running `molt up`")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--run-dir", type=Path, help="run directory (default: the live, else newest, run in runs/)")
    commands.add_parser("settings", help="print the configuration reference (every recipe key) as markdown")
    commands.choices["down"].add_argument(
        "--timeout", type=float, default=900.0, help="seconds to wait for the launcher's own orderly stop"
    )
    return parser


def _sets(args: argparse.Namespace) -> list[str]:
    """The ``--set`` assignments, plus ``--without`` as the ``[launcher] without`` list it stands for."""
    return [*args.set, f"launcher.without={json.dumps(args.without)}"] if args.without else list(args.set)


def _status(run_dir: Path) -> int:
    state = RunState.load(run_dir)
    out = sys.stdout
    out.write("\n".join(describe(state)) + "\n")
    if not state.launcher_alive():
        return 1
    started = time.mktime(time.strptime(state.started_at, "%Y-%m-%dT%H:%M:%S%z"))
    access = run_access(run_dir / "config.toml")
    snap = gather(state.addresses(), state.redis_url, state.run_id, run_dir, state.max_steps, access)
    out.write(status_line(snap, time.time() - started) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    setup_logging("molt", "launcher", level="WARNING")
    try:
        if args.command == "settings":
            sys.stdout.write(render_settings())
        elif args.command == "plan":
            recipe = load_recipe(args.recipe, _sets(args))
            sys.stdout.write(plan_or_raise(recipe).render(f"plan for {args.recipe}:") + "\n")
        elif args.command == "up":
            raise SystemExit(up(load_recipe(args.recipe, _sets(args)), args.run_dir))
        elif args.command == "status":
            raise SystemExit(_status(args.run_dir or newest_run_dir()))
        else:
            clean, killed = down(args.run_dir or newest_run_dir(), args.timeout)
            sys.stdout.write(
                ("stopped" if clean else "the launcher did not stop in time; killed it")
                + (f"; ended leftover processes: {', '.join(killed)}" if killed else "")
                + "\n"
            )
    except ConfigError as exc:
        sys.stderr.write(f"molt: {exc.message}\n")
        raise SystemExit(2) from exc
    except FileNotFoundError as exc:
        sys.stderr.write(f"molt: {exc}\n")
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
