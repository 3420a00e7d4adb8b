"""Moving weights between processes: the manifest, checksums, buckets and the weight group.

Shared by the learner (the sender, rank 0), the engine workers (receivers,
through the router's worker extension) and the benchmarks. The control plane
(who joins, when to send) is the weight-broadcaster's gRPC service; this module
is only the data plane.

- A **manifest** lists every tensor of a refit in broadcast order: name (the
  HF checkpoint name, which vLLM's ``load_weights`` maps onto its fused
  parameters), dtype, shape and checksum. Each tensor keeps its own dtype.
- A **checksum** is position-sensitive and computed with integer arithmetic on
  the tensor's own device (``tensor_checksum``), so sender and receiver agree
  bit for bit whatever the device, and a GPU tensor is never copied to the host
  just to be hashed.
- **Buckets** pack consecutive tensors into one flat byte buffer of at most
  ``bucket_bytes`` (a larger tensor travels alone); one broadcast per bucket.
- The **weight group** is a standalone torch.distributed process group (gloo
  on CPU, NCCL on GPU) built on a TCPStore that the broadcaster hosts. It is not
  the default group, so it coexists with the learner's FSDP group and vLLM's
  own groups in the same processes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_MASK64 = (1 << 64) - 1
# Integer views by element size: the checksum reads raw bits, never values.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PERIOD = 65521  # position weights repeat with this period
# Elements hashed at once: bounds the int64 temporaries and the cached position weights (int64, chunk + _PERIOD).
_CHUNK_CPU = 1 << 22
_CHUNK_DEVICE = 1 << 23
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a refit: enough to receive and rebuild it."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    checksum: int  # tensor_checksum of the sender's bytes

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        return dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.torch_dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor_checksum(tensor))


def manifest_to_json(metas: Iterable[TensorMeta]) -> str:
    return json.dumps([asdict(m) for m in metas])


def manifest_from_json(text: str) -> list[TensorMeta]:
    return [TensorMeta(d["name"], d["dtype"], tuple(d["shape"]), int(d["checksum"])) for d in json.loads(text)]


def tensor_checksum(tensor: torch.Tensor) -> int:
    """64-bit checksum of a tensor's bits: sum over elements of bits(i) * (i mod 65521 + 1), mod 2**64.

    Integer sums wrap identically on every device and in any reduction order,
    so the sender's and the receiver's values are equal exactly when the bits
    (in order) are. Dtype and shape are compared separately, in the manifest.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    ints = flat.view(_INT_VIEW[flat.element_size()])
    chunk = _CHUNK_CPU if ints.device.type == "cpu" else _CHUNK_DEVICE
    weights = _position_weights(ints.device, chunk)
    if ints.device.type == "cpu":  # int64 dot product: no int64 temporary but the reused scratch
        scratch = torch.empty(min(chunk, ints.numel()), dtype=torch.int64)
        total = 0
        for start in range(0, ints.numel(), chunk):
            part = scratch[: min(chunk, ints.numel() - start)]
            part.copy_(ints[start : start + chunk])
            offset = start % _PERIOD
            total = (total + int(torch.dot(part, weights[offset : offset + part.numel()]))) & _MASK64
        return total
    # Elsewhere: accumulate on the device (sums wrap mod 2**64 like the host's), one synchronisation at the end.
    acc = torch.zeros((), dtype=torch.int64, device=ints.device)
    for start in range(0, ints.numel(), chunk):
        part = ints[start : start + chunk]
        offset = start % _PERIOD
        acc += (part * weights[offset : offset + part.numel()]).sum()  # int64 by promotion
    return int(acc.item()) & _MASK64


def _position_weights(device: torch.device, chunk: int) -> torch.Tensor:
    """``i mod 65521 + 1`` for i in [0, chunk + 65521), cached per device: the chunk at element ``start`` uses the
    slice from ``start mod 65521``."""
    weights = _WEIGHTS.get(device)
    if weights is None or weights.numel() < chunk + _PERIOD:
        weights = torch.arange(chunk + _PERIOD, dtype=torch.int64, device=device) % _PERIOD + 1
        _WEIGHTS[device] = weights
    return weights


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive tensors grouped so that each bucket's buffer (``bucket_layout``, alignment included) holds at
    most ``bucket_bytes``, or is one larger tensor alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in metas:
        start = (size + 15) // 16 * 16  # where bucket_layout would put it
        if current and start + meta.nbytes > bucket_bytes:
            buckets.append(current)
            current, start = [], 0
        current.append(meta)
        size = start + meta.nbytes
    if current:
        buckets.append(current)
    return buckets


def bucket_layout(bucket: list[TensorMeta]) -> tuple[list[int], int]:
    """Byte offset of each tensor in its bucket buffer (aligned to 16 bytes, so every dtype view is legal), and
    the buffer's size."""
    offsets: list[int] = []
    size = 0
    for meta in bucket:
        size = (size + 15) // 16 * 16
        offsets.append(size)
        size += meta.nbytes
    return offsets, size


def pack_bucket(bucket: list[TensorMeta], tensors: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's flat uint8 buffer on ``device``: each tensor's bytes at its ``bucket_layout`` offset.

    The alignment gaps are zeroed (the buffer's bytes are deterministic), the rest is written once."""
    offsets, total = bucket_layout(bucket)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    end = 0
    for meta, offset in zip(bucket, offsets, strict=True):
        if offset > end:
            buffer[end:offset].zero_()
        data = tensors[meta.name].detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + meta.nbytes].copy_(data)
        end = offset + meta.nbytes
    return buffer


def unpack_bucket(bucket: list[TensorMeta], buffer: torch.Tensor) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
    """Every tensor of a received bucket buffer, as a view into it (no copy)."""
    offsets, total = bucket_layout(bucket)
    if buffer.dtype != torch.uint8 or buffer.numel() != total:
        raise ValueError(f"bucket buffer is {buffer.dtype} x {buffer.numel()}, expected uint8 x {total}")
    for meta, offset in zip(bucket, offsets, strict=True):
        piece = buffer[offset : offset + meta.nbytes]
        yield meta, piece.view(meta.torch_dtype).reshape(meta.shape)


def check_manifest(metas: list[TensorMeta]) -> None:
    """Names unique, dtypes known, shapes non-negative: a manifest both sides can follow."""
    seen: set[str] = set()
    for meta in metas:
        if meta.name in seen:
            raise ValueError(f"tensor {meta.name!r} appears twice in the manifest")
        seen.add(meta.name)
        meta.torch_dtype  # noqa: B018 - raises on an unknown dtype
        if any(size < 0 for size in meta.shape):
            raise ValueError(f"tensor {meta.name!r}: negative size in shape {meta.shape}")


class WeightGroup:
    """A standalone process group over a TCPStore: rank 0 sends, every other rank receives."""

    def __init__(
        self,
        store_host: str,
        store_port: int,
        rank: int,
        world_size: int,
        *,
        backend: str,
        generation: int,
        device: torch.device,
        timeout_s: float = 600.0,
    ) -> None:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout, use_libuv=True)
        prefixed = dist.PrefixStore(f"molt-weights/{generation}", store)
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        if backend == "nccl":
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        elif backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            raise ValueError(f"unknown weight-group backend {backend!r} (nccl or gloo)")

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Broadcasts ``buffer`` in place from rank 0."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([buffer], opts).wait()
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()

    def send(self, metas: list[TensorMeta], tensors: dict[str, torch.Tensor], bucket_bytes: int) -> int:
        """Rank 0: broadcasts ``tensors`` in manifest order, bucket by bucket; returns the bucket count."""
        buckets = plan_buckets(metas, bucket_bytes)
        for bucket in buckets:
            self.broadcast(pack_bucket(bucket, tensors, self.device))
        return len(buckets)

    def receive(self, metas: list[TensorMeta], bucket_bytes: int) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
        """Other ranks: yields every tensor of the manifest as it arrives (views into the bucket buffer)."""
        for bucket in plan_buckets(metas, bucket_bytes):
            buffer = torch.empty(bucket_layout(bucket)[1], dtype=torch.uint8, device=self.device)
            self.broadcast(buffer)
            yield from unpack_bucket(bucket, buffer)

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()
