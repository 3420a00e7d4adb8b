"""Data-parallel ranks: who this process is, the process group, and starting the other ranks.

Ranks are local processes started with ``torch.multiprocessing`` (``placement =
"local"``, rendezvous on ``127.0.0.1``) or Ray actors (``placement = "ray"``,
``molt.learner.placement``, rendezvous on rank 0's node address). CPU ranks talk
over gloo, GPU ranks over NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Followers wait in a broadcast while rank 0 waits for trajectories: the default
# 30-minute collective timeout would kill an idle but healthy run.
COLLECTIVE_TIMEOUT = timedelta(days=1)


@dataclass(frozen=True)
class RankInfo:
    """This process's place among the data-parallel ranks."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


SINGLE = RankInfo()


def device_for(rank: RankInfo) -> torch.device:
    """The rank's device: its GPU when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank.rank % torch.cuda.device_count())
    return torch.device("cpu")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host: on CUDA through pinned memory and a
    non-blocking copy. A plain ``.to("cuda")`` of pageable memory waits for every kernel queued before it,
    so one in the middle of a step leaves the GPU idle while the host then queues the next work. The
    copy may still be in flight on return: do not change ``tensor`` in place afterwards (an already
    pinned tensor is used as it is)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def init_group(rank: RankInfo, master_addr: str, master_port: int) -> None:
    """Joins the process group of ``rank.world_size`` ranks at ``master_addr:master_port`` (no-op for one rank)."""
    if not rank.distributed:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank.rank,
        world_size=rank.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def finish_together(rank: RankInfo, timeout: timedelta = timedelta(seconds=120)) -> None:
    """After a normal end: every rank waits for the others before any tears its process group down (a
    rank that destroyed its gloo group while a peer still used the connections was seen to abort the
    peer at exit, about once in ten runs). Not on error paths: a dead peer would never arrive."""
    if rank.distributed:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timeout)
        else:
            dist.barrier()


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
