"""Two FSDP ranks (gloo, CPU) meet a step whose NaN lies in rank 1's share of the batch only.

Run as ``python refused_step_ranks.py <model> <out.json>`` (tests/integration/test_learner_fsdp.py).
Every rank must refuse that step (StepRefused, its gradients cleared), then take the next, good step
to the same weights: a rank that refused alone would skip the update its peer applied, or hang in a
collective its peer never joins.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.multiprocessing as mp

from molt.core.testing import free_port
from molt.learner.config import LearnerSettings
from molt.learner.ranks import RankInfo, finish_together, init_group
from molt.learner.synthetic import step_batch
from molt.learner.trainer import StepRefused, Trainer

WORLD = 2


def rank_main(rank: int, model: str, port: int, queue: mp.Queue) -> None:
    info = RankInfo(rank, WORLD)
    torch.set_num_threads(1)
    init_group(info, "127.0.0.1", port)
    settings = LearnerSettings(
        model_path=model,
        metrics_port=0,
        rollout={"group_size": 3, "groups_per_step": 1},
        micro_batch_tokens=16,
        cpu_threads=1,
    )
    trainer = Trainer(settings, info)
    bad = step_batch({"bad": [1.0, 0.0, 0.5]})
    shares = trainer._plan(bad.samples, WORLD)  # one sample per micro-batch (micro_batch_tokens 16)
    row = next(r for micro in shares[1] for r in micro)
    bad.samples[row].rollout_logprobs[-1] = float("nan")  # fault injected: only rank 1 trains this row
    try:
        trainer.train_step(bad)
        refused = ""
    except StepRefused as exc:
        refused = str(exc)
    cleared = all(p.grad is None for p in trainer.model.parameters())
    metrics = trainer.train_step(step_batch({"good": [1.0, 0.0, 0.5]}))
    total = sum(float(p.full_tensor().double().sum()) for p in trainer.model.parameters())
    finish_together(info)
    queue.put(
        {
            "rank": rank,
            "refused": refused,
            "cleared": cleared,
            "step": trainer.step,
            "weights": total,
            "grad_norm": metrics["grad_norm"],
            "rows_of_rank_1": [r for m in shares[1] for r in m],
        }
    )


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=rank_main, args=(r, model, port, queue)) for r in range(WORLD)]
    for p in processes:
        p.start()
    results = sorted((queue.get(timeout=240) for _ in processes), key=lambda r: r["rank"])
    for p in processes:
        p.join(timeout=60)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
