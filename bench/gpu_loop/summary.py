"""The one-GPU loop's figures from a finished run directory (bench/gpu_loop/run.sh calls it).

Prints JSON: steps, samples/s and trained tokens/s over the run after its first step (start-up and
the first compile excluded), refit seconds and bytes (the broadcaster's "refit published" lines),
the probe's largest engine-vs-learner logprob difference and the learner's vllm_kl per step, the
learner's MFU by 6 x parameters x tokens/s against the H100/H200 dense bf16 peak, and the peak
GPU memory of each process (nvidia-smi, sampled once a second).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

from molt.core.service_logs import log_records

PEAK_BF16_FLOPS = 989e12  # H100 SXM and H200, dense


def parameters(model: Path) -> int:
    """Parameter count from the safetensors headers (no weights read)."""
    total = 0
    for path in model.glob("*.safetensors"):
        with path.open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
    return total


def main(run: Path, memory: Path, model: Path) -> dict:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    refits = log_records(run / "logs" / "broadcaster.log", "refit published")
    after_first = steps[1:]
    span = after_first[-1]["time"] - steps[0]["time"] if len(steps) > 1 else float("nan")
    settings = json.loads((run / "settings.json").read_text())
    rollout = settings["services"]["learner"]["rollout"]
    samples_per_step = rollout["group_size"] * rollout["groups_per_step"]
    tokens = [s["tokens_per_s"] for s in after_first if "tokens_per_s" in s]
    n = parameters(model)
    peaks: dict[str, int] = {}
    for line in memory.read_text().splitlines() if memory.is_file() else []:
        parts = [p.strip() for p in line.replace(",", " ").split()]
        if len(parts) == 3 and parts[2].isdigit():
            peaks[parts[1]] = max(peaks.get(parts[1], 0), int(parts[2]))
    return {
        "steps": len(steps),
        "parameters": n,
        "samples_per_s": len(after_first) * samples_per_step / span if after_first else None,
        "trained_tokens_per_s_median": statistics.median(tokens) if tokens else None,
        "learner_mfu_median": 6 * n * statistics.median(tokens) / PEAK_BF16_FLOPS if tokens else None,
        "step_seconds_median": statistics.median(b["time"] - a["time"] for a, b in itertools.pairwise(steps))
        if len(steps) > 2
        else None,
        "refits": len(refits),
        "refit_seconds": [e.get("seconds") for e in refits],
        "refit_bytes": refits[-1].get("bytes") if refits else None,
        "refit_phase_seconds_last": refits[-1].get("phase_seconds") if refits else None,
        "probe_max_abs_diff": [e.get("probe_max_abs_diff") for e in refits],
        "vllm_kl": [s.get("vllm_kl") for s in steps],
        "is_ratio_mean": [s.get("is_ratio_mean") for s in steps],
        "reward_mean": [s.get("reward/mean") for s in steps],
        "gpu_memory_peak_mib_by_pid": peaks,
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])), indent=1))
