"""The CUDA IPC weight group: a sender and a receiver process on one GPU, through a real TCPStore."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from molt.core.testing import free_port
from molt.core.weight_ipc import IPC_BACKEND, open_weight_group
from molt.core.weightsync import TensorMeta, tensor_checksum


def test_the_ipc_group_refuses_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        open_weight_group(IPC_BACKEND, "127.0.0.1", 1, 0, 2, generation=0, device=torch.device("cpu"))


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 64, generator=generator).to(torch.bfloat16),
        "odd": torch.randn(7, 3, generator=generator),  # 84 bytes: the next tensor starts after a gap
        "ints": torch.randint(0, 100, (1001,), generator=generator, dtype=torch.int64),
        "head": torch.randn(64, 300, generator=generator),
    }


def receive(port: int, metas: list[TensorMeta], bucket_bytes: int, transfers: int, out: multiprocessing.Queue) -> None:
    group = open_weight_group(
        IPC_BACKEND, "127.0.0.1", port, 1, 2, generation=3, device=torch.device("cuda", 0), timeout_s=60
    )
    for _ in range(transfers):
        out.put({meta.name: tensor_checksum(tensor) for meta, tensor in group.receive(metas, bucket_bytes)})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_buckets_cross_to_another_process_on_the_same_gpu_bit_for_bit() -> None:
    """Buckets smaller than the weights (several in flight, so the sender waits for acknowledgements),
    two transfers in one generation (their keys must not collide), the second with other values."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), use_libuv=True)
    first, second = weights(0), weights(1)
    metas = [TensorMeta.of(name, tensor) for name, tensor in first.items()]
    bucket_bytes = 40_000  # the 38 400-byte embedding alone, then the rest: at least three buckets
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    receiver = context.Process(target=receive, args=(port, metas, bucket_bytes, 2, out))
    receiver.start()
    try:
        sender = open_weight_group(
            IPC_BACKEND, "127.0.0.1", port, 0, 2, generation=3, device=torch.device("cuda", 0), timeout_s=60
        )
        for state in (first, second):
            assert sender.send(metas, {name: t.cuda() for name, t in state.items()}, bucket_bytes) >= 3
            got = out.get(timeout=60)
            assert got == {name: tensor_checksum(tensor) for name, tensor in state.items()}
        assert got != {name: tensor_checksum(tensor) for name, tensor in first.items()}
    finally:
        receiver.join(timeout=60)
        del store
    assert receiver.exitcode == 0
