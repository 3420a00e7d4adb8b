"""Moving weights between processes: the manifest, checksums, buckets and the weight group.

The data plane of a refit, shared by the learner (the sender, rank 0), the engine
workers (receivers, through the router's worker extension) and the benchmarks; the
control plane is the weight-broadcaster's gRPC service. A **manifest** lists every
tensor of a refit in broadcast order (``TensorMeta``: HF checkpoint name, dtype,
shape, checksum). A **checksum** (``tensor_checksum``) is position-sensitive integer
arithmetic on the tensor's own device. **Buckets** pack consecutive tensors into one
flat buffer of at most ``bucket_bytes``, one broadcast each. The **weight group** is
a standalone process group (gloo on CPU, NCCL on GPU) on the broadcaster's TCPStore,
so it coexists with the learner's FSDP group and vLLM's own groups.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_MASK64 = (1 << 64) - 1
_PERIOD = 65521  # position weights repeat with this period
# Words hashed at once: bounds the int64 temporaries and the cached position weights (int64, chunk + _PERIOD).
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
    """64-bit checksum of a tensor's bytes: its bytes, zero-padded to a multiple of 8, read as
    little-endian int64 words w(j); the sum over j of w(j) * (j mod 65521 + 1), mod 2**64.

    Integer sums wrap identically on every device and in any reduction order,
    so the sender's and the receiver's values are equal exactly when the bytes
    (in order) are. Dtype and shape are compared separately, in the manifest.
    Reading 8-byte words whatever the dtype needs no widening copy: on CPU the
    whole hash is one int64 dot product per chunk.
    """
    words = _int64_words(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    if words.numel() == 0:
        return 0
    chunk = _CHUNK_CPU if words.device.type == "cpu" else _CHUNK_DEVICE
    weights = _position_weights(words.device, chunk)
    if words.device.type == "cpu":
        total = 0
        for start in range(0, words.numel(), chunk):
            part = words[start : start + chunk]
            offset = start % _PERIOD
            total = (total + int(torch.dot(part, weights[offset : offset + part.numel()]))) & _MASK64
        return total
    # Elsewhere: accumulate on the device (sums wrap mod 2**64 like the host's), one synchronisation at the end.
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), chunk):
        part = words[start : start + chunk]
        offset = start % _PERIOD
        acc += (part * weights[offset : offset + part.numel()]).sum()
    return int(acc.item()) & _MASK64


def _int64_words(data: torch.Tensor) -> torch.Tensor:
    """``data`` (flat uint8) as int64 words, zero-padded at the end; a view when its start is 8-aligned."""
    whole = data.numel() // 8 * 8
    if whole == data.numel() and data.storage_offset() % 8 == 0:
        return data.view(torch.int64)
    padded = torch.zeros((data.numel() + 7) // 8 * 8, dtype=torch.uint8, device=data.device)
    padded[: data.numel()] = data
    return padded.view(torch.int64)


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


def pack_bucket(
    bucket: list[TensorMeta], tensors: dict[str, torch.Tensor], device: torch.device, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The bucket's flat uint8 buffer on ``device``: each tensor's bytes at its ``bucket_layout`` offset.

    Written into ``out`` (a uint8 buffer of at least the bucket's size; the result is its prefix) when
    given, else into a new buffer. The alignment gaps are zeroed (the buffer's bytes are deterministic),
    the rest is written once."""
    offsets, total = bucket_layout(bucket)
    if out is None:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.numel() < total:
        raise ValueError(f"pack buffer is {out.dtype} x {out.numel()}, the bucket needs uint8 x {total}")
    else:
        buffer = out[:total]
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


MAX_MANIFEST_BYTES = 1 << 50  # 1 PiB: a manifest beyond it is a mistake, not a model


def check_manifest(metas: list[TensorMeta]) -> None:
    """Names unique, dtypes known, shapes non-negative, a plausible size: a manifest both sides can follow."""
    seen: set[str] = set()
    total = 0
    for meta in metas:
        if meta.name in seen:
            raise ValueError(f"tensor {meta.name!r} appears twice in the manifest")
        seen.add(meta.name)
        meta.torch_dtype  # noqa: B018 - raises on an unknown dtype
        if any(size < 0 for size in meta.shape):
            raise ValueError(f"tensor {meta.name!r}: negative size in shape {meta.shape}")
        total += meta.nbytes
        if total > MAX_MANIFEST_BYTES:
            raise ValueError(f"the manifest holds more than {MAX_MANIFEST_BYTES} bytes (at {meta.name!r})")


ABANDONED = b"abandoned"  # the value the broadcaster writes to a refit's ready key when the sender is gone


def refit_keys(request_id: str) -> tuple[str, str]:
    """A refit's two keys in the group's store: the broadcaster's go (JSON: generation, world size,
    backend, bucket bytes) and the sender's ready key (written once it read the go)."""
    go = f"refit/{request_id}"
    return go, f"{go}/read"


def wait_for_sender(store: dist.Store, ready_key: str) -> None:
    """Blocks until the sender wrote ``ready_key`` (it does just before it joins or sends: a receiver
    that blocked on the group earlier would wait out the group's timeout for a sender that died); raises
    when the broadcaster wrote ``ABANDONED`` there instead."""
    store.wait([ready_key])
    if store.get(ready_key) == ABANDONED:
        raise RuntimeError(f"refit abandoned before the sender came ({ready_key}): the learner is gone")


def open_store(host: str, port: int, timeout: timedelta, namespace: str = "") -> dist.Store:
    """A client of the group's store; its keys under ``namespace`` (``molt.core.auth.store_namespace``)."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout, use_libuv=True)
    return dist.PrefixStore(namespace, store) if namespace else store


class WeightGroup:
    """A standalone process group over a TCPStore: rank 0 sends, every other rank receives.

    ``timeout_s`` bounds each broadcast. On gloo, ``join_timeout_s`` (unset: ``timeout_s``) bounds
    the rendezvous in the constructor instead: a rank that dies while the others join holds them
    that long. (NCCL rendezvouses at its first broadcast, under NCCL's own timeout.) A receiver given
    ``ready_key`` first waits for the sender to be on its way (``wait_for_sender``). ``namespace``: the
    run's prefix of the store's keys (``open_store``).
    """

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
        join_timeout_s: float | None = None,
        ready_key: str = "",
        namespace: str = "",
    ) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.timeout = timeout
        store = open_store(store_host, store_port, timeout, namespace)
        self.store = store  # unprefixed: the refits' go and ready keys
        if ready_key:
            wait_for_sender(store, ready_key)
        prefixed = dist.PrefixStore(f"molt-weights/{generation}", store)
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self._pack_buffers: list[torch.Tensor | None] = [None, None]
        if backend == "nccl":
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        elif backend == "gloo":
            # The group's own timeout is the rendezvous's; each broadcast passes ``timeout`` (``_start``).
            join_timeout = timedelta(seconds=timeout_s if join_timeout_s is None else join_timeout_s)
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, join_timeout)
        else:
            raise ValueError(f"unknown weight-group backend {backend!r} (nccl or gloo)")

    def _start(self, buffer: torch.Tensor) -> dist.Work:
        """Starts broadcasting ``buffer`` in place from rank 0."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.backend == "gloo":
            opts.timeout = self.timeout
        return self.group.broadcast([buffer], opts)

    @staticmethod
    def _wait(work: dist.Work, buffer: torch.Tensor) -> None:
        work.wait()
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()

    def _pack_buffer(self, index: int, size: int) -> torch.Tensor | None:
        """On CPU, one of two send buffers kept between refits: packing into fresh host pages costs
        far more than a copy into touched ones (page faults). On GPU the caching allocator already reuses
        memory, and keeping buckets would hold learner GPU memory between refits: None there."""
        if self.device.type != "cpu":
            return None
        if self._pack_buffers[index] is None or self._pack_buffers[index].numel() < size:  # type: ignore[union-attr]
            self._pack_buffers[index] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._pack_buffers[index]

    def send(self, metas: list[TensorMeta], tensors: dict[str, torch.Tensor], bucket_bytes: int) -> int:
        """Rank 0: broadcasts ``tensors`` in manifest order, bucket by bucket; returns the bucket count.
        Bucket k+1 is packed while bucket k is on the wire (two buffers, alternating)."""
        buckets = plan_buckets(metas, bucket_bytes)
        in_flight: tuple[dist.Work, torch.Tensor] | None = None
        for index, bucket in enumerate(buckets):
            out = self._pack_buffer(index % 2, bucket_layout(bucket)[1])
            buffer = pack_bucket(bucket, tensors, self.device, out)
            if in_flight is not None:
                self._wait(*in_flight)
            in_flight = (self._start(buffer), buffer)
        if in_flight is not None:
            self._wait(*in_flight)
        return len(buckets)

    def receive(self, metas: list[TensorMeta], bucket_bytes: int) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
        """Other ranks: yields every tensor of the manifest as it arrives (views into the bucket buffer,
        one new buffer per bucket). Bucket k+1 is already being received while the caller handles
        bucket k's tensors (e.g. checksums them)."""
        buckets = plan_buckets(metas, bucket_bytes)

        def post(bucket: list[TensorMeta]) -> tuple[dist.Work, torch.Tensor]:
            buffer = torch.empty(bucket_layout(bucket)[1], dtype=torch.uint8, device=self.device)
            return self._start(buffer), buffer

        upcoming = post(buckets[0]) if buckets else None
        for index, bucket in enumerate(buckets):
            assert upcoming is not None
            work, buffer = upcoming
            self._wait(work, buffer)
            upcoming = post(buckets[index + 1]) if index + 1 < len(buckets) else None
            yield from unpack_bucket(bucket, buffer)

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()
