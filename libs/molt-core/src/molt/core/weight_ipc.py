"""The weight group's CUDA IPC transport, for a learner and engines that share one GPU (colocated).

NCCL refuses two ranks on one device, so a colocated refit cannot broadcast. Here rank 0 packs each
bucket (the same plan as ``WeightGroup``: ``plan_buckets``, ``bucket_layout``) into its own GPU memory
and publishes a CUDA IPC handle to it in the group's store; every receiver opens the handle, copies
the bucket into memory of its own and acknowledges. The sender keeps at most two buckets shared and
frees one only once every receiver acknowledged it, so a refit needs about two buckets of extra
memory on the sender, as the NCCL path does. Receivers check that the handle comes from their own GPU
(by UUID): a handle opened on another device would read the wrong memory or fail obscurely.

``open_weight_group`` picks the transport by the backend the broadcaster's go names.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from molt.core.weightsync import (
    TensorMeta,
    WeightGroup,
    bucket_layout,
    open_store,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
    wait_for_sender,
)

IPC_BACKEND = "cuda_ipc"
IN_FLIGHT = 2  # buckets shared at once: the sender packs the next while receivers copy the last


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind ``device`` (indices differ between processes with other CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(device).uuid)


class IpcWeightGroup:
    """Rank 0 sends, every other rank receives, through CUDA IPC handles passed in the group's store.

    Both sides count the transfers of a generation, so each refit's keys are distinct; a failed refit
    makes the broadcaster start a new generation, which starts the count again on every member.
    """

    def __init__(
        self,
        store_host: str,
        store_port: int,
        rank: int,
        world_size: int,
        *,
        generation: int,
        device: torch.device,
        timeout_s: float = 600.0,
        ready_key: str = "",
        namespace: str = "",
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"the {IPC_BACKEND} weight group needs a CUDA device, not {device}")
        self.timeout = timedelta(seconds=timeout_s)
        self.store = open_store(store_host, store_port, self.timeout, namespace)
        if ready_key:
            wait_for_sender(self.store, ready_key)
        self.keys = dist.PrefixStore(f"molt-weights/{generation}/ipc", self.store)
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = IPC_BACKEND
        self.transfers = 0

    def _key(self, transfer: int, index: int, what: str, rank: int | None = None) -> str:
        return f"{transfer}/{index}/{what}" + ("" if rank is None else f"/{rank}")

    def _wait_acks(self, transfer: int, index: int) -> None:
        acks = [self._key(transfer, index, "ack", r) for r in range(1, self.world_size)]
        if acks:
            self.keys.wait(acks, self.timeout)

    def send(self, metas: list[TensorMeta], tensors: dict[str, torch.Tensor], bucket_bytes: int) -> int:
        """Rank 0: shares every bucket in turn; returns once every receiver copied every bucket."""
        from torch.multiprocessing.reductions import reduce_tensor

        transfer, self.transfers = self.transfers, self.transfers + 1
        buckets = plan_buckets(metas, bucket_bytes)
        shared: dict[int, torch.Tensor] = {}
        uuid = gpu_uuid(self.device)
        for index, bucket in enumerate(buckets):
            if index >= IN_FLIGHT:
                self._wait_acks(transfer, index - IN_FLIGHT)
                del shared[index - IN_FLIGHT]
            buffer = pack_bucket(bucket, tensors, self.device)
            torch.cuda.current_stream(self.device).synchronize()  # written before anyone reads it
            shared[index] = buffer
            _, args = reduce_tensor(buffer)
            self.keys.set(self._key(transfer, index, "handle"), pickle.dumps((uuid, args)))
        for index in range(max(0, len(buckets) - IN_FLIGHT), len(buckets)):
            self._wait_acks(transfer, index)
        shared.clear()
        torch.cuda.ipc_collect()  # release what receivers have let go of
        return len(buckets)

    def receive(self, metas: list[TensorMeta], bucket_bytes: int) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
        """Other ranks: yields every tensor of the manifest (views into a copy of each bucket, on this
        rank's device) as its bucket arrives."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        transfer, self.transfers = self.transfers, self.transfers + 1
        uuid = gpu_uuid(self.device)
        for index, bucket in enumerate(plan_buckets(metas, bucket_bytes)):
            sender_uuid, args = pickle.loads(self.keys.get(self._key(transfer, index, "handle")))
            if sender_uuid != uuid:
                raise RuntimeError(
                    f"{IPC_BACKEND}: the learner's bucket lives on GPU {sender_uuid}, this engine worker runs on "
                    f"{uuid}; colocation needs both on one GPU (use nccl across GPUs)"
                )
            args = _on_device(args, self.device)
            peer = rebuild_cuda_tensor(*args)
            own = peer[: bucket_layout(bucket)[1]].clone()
            torch.cuda.current_stream(self.device).synchronize()
            del peer
            self.keys.set(self._key(transfer, index, "ack", self.rank), b"1")
            yield from unpack_bucket(bucket, own)

    def close(self) -> None:
        """Nothing to tear down: the store connection closes with the object."""


def _on_device(args: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    """``reduce_tensor``'s arguments with the storage's device index replaced by this process's index of
    the same GPU (index 6 of the CUDA rebuild arguments)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (*args[:6], index, *args[7:])


def open_weight_group(backend: str, *args: Any, join_timeout_s: float | None = None, **kwargs: Any) -> Any:
    """The weight group for ``backend``: ``cuda_ipc`` (one GPU, colocated) or a process group (nccl,
    gloo), built from the same arguments (``WeightGroup``'s; ``join_timeout_s`` bounds gloo's rendezvous)."""
    if backend == IPC_BACKEND:
        return IpcWeightGroup(*args, **kwargs)
    return WeightGroup(*args, backend=backend, join_timeout_s=join_timeout_s, **kwargs)
