"""The weight data plane: checksums, bucket plans and a real gloo broadcast across ranks."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from molt.core import weightsync
from molt.core.weightsync import (
    TensorMeta,
    WeightGroup,
    bucket_layout,
    check_manifest,
    manifest_from_json,
    manifest_to_json,
    pack_bucket,
    plan_buckets,
    tensor_checksum,
    unpack_bucket,
)


def test_checksum_sees_every_bit_and_position() -> None:
    base = torch.randn(1000, dtype=torch.float32)
    flipped = base.clone()
    flipped.view(torch.int32)[500] ^= 1  # lowest mantissa bit of one element
    swapped = base.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert tensor_checksum(base) == tensor_checksum(base.clone())
    assert tensor_checksum(base) != tensor_checksum(flipped)
    assert tensor_checksum(base) != tensor_checksum(swapped)
    assert tensor_checksum(base.to(torch.bfloat16)) != tensor_checksum(base.to(torch.bfloat16).roll(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
def test_checksum_equals_its_definition_across_chunks(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """sum of w(j) * (j mod 65521 + 1), mod 2**64, w = the bytes zero-padded to 8-byte little-endian signed
    words, over many chunks; 140,001 elements leave a partial last word for every element size but 8."""
    monkeypatch.setattr(weightsync, "_CHUNK_CPU", 1000)
    monkeypatch.setattr(weightsync, "_WEIGHTS", {})
    tensor = (torch.randn(140_001, generator=torch.Generator().manual_seed(1)) * 1e4).to(dtype)
    raw = tensor.numpy().tobytes() if dtype != torch.bfloat16 else tensor.view(torch.int16).numpy().tobytes()
    raw += b"\0" * (-len(raw) % 8)
    words = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]
    expected = sum(w * (j % 65521 + 1) for j, w in enumerate(words)) % 2**64
    assert tensor_checksum(tensor) == expected
    assert tensor_checksum(tensor[1:]) != tensor_checksum(tensor[:-1])  # unaligned starts go through the padding


def test_checksum_of_non_contiguous_tensor_equals_its_contiguous_copy() -> None:
    matrix = torch.randn(16, 8)
    assert tensor_checksum(matrix.t()) == tensor_checksum(matrix.t().contiguous())


def test_buckets_respect_the_bound_and_keep_order() -> None:
    metas = [TensorMeta(f"t{i}", "float32", (n,), 0) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = plan_buckets(metas, bucket_bytes=100)
    assert [m.name for b in buckets for m in b] == [m.name for m in metas]
    for bucket in buckets:
        assert len(bucket) == 1 or bucket_layout(bucket)[1] <= 100
    assert [len(b) for b in buckets] == [2, 1, 1, 1, 1]  # 40+40 | 120 alone | 20 | 400 alone | 4
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(metas, 0)


def test_layout_aligns_every_tensor() -> None:
    metas = [
        TensorMeta("a", "bfloat16", (3,), 0),
        TensorMeta("b", "float64", (2,), 0),
        TensorMeta("c", "int8", (1,), 0),
    ]
    offsets, total = bucket_layout(metas)
    assert offsets == [0, 16, 32] and total == 33


def test_pack_and_unpack_roundtrip_with_zeroed_gaps() -> None:
    tensors = {
        "a": torch.randn(3).to(torch.bfloat16),
        "b": torch.randn(4, 2, dtype=torch.float64).t(),  # non-contiguous: packed as its contiguous copy
        "c": torch.arange(5, dtype=torch.int8),
        "empty": torch.zeros(0, 3),
    }
    metas = [TensorMeta.of(name, t) for name, t in tensors.items()]
    buffer = pack_bucket(metas, tensors, torch.device("cpu"))
    offsets, total = bucket_layout(metas)
    assert buffer.dtype == torch.uint8 and buffer.numel() == total
    assert int(buffer[6:16].count_nonzero()) == 0  # the alignment gap after "a"
    unpacked = {m.name: t for m, t in unpack_bucket(metas, buffer)}
    for meta in metas:
        assert unpacked[meta.name].dtype == tensors[meta.name].dtype
        assert torch.equal(unpacked[meta.name], tensors[meta.name])
        assert tensor_checksum(unpacked[meta.name]) == meta.checksum
    assert unpacked["c"].data_ptr() == buffer.data_ptr() + offsets[2]  # views, not copies
    with pytest.raises(ValueError, match="bucket buffer"):
        list(unpack_bucket(metas, buffer[:-1]))


def test_manifest_roundtrip_and_checks() -> None:
    metas = [TensorMeta.of("w", torch.ones(2, 3, dtype=torch.bfloat16)), TensorMeta.of("b", torch.zeros(3))]
    assert manifest_from_json(manifest_to_json(metas)) == metas
    with pytest.raises(ValueError, match="twice"):
        check_manifest([metas[0], metas[0]])
    with pytest.raises(ValueError, match="unknown dtype"):
        check_manifest([TensorMeta("x", "float7", (1,), 0)])
    with pytest.raises(ValueError, match="negative size"):
        check_manifest([TensorMeta("x", "float32", (3, -1), 0)])
    check_manifest([TensorMeta("empty", "float32", (0, 64), 0), TensorMeta("scalar", "float32", (), 0)])
    with pytest.raises(ValueError, match="more than"):
        check_manifest([TensorMeta("x", "float32", (1 << 40, 1 << 40), 0)])


def test_gloo_group_moves_mixed_dtypes_bit_exactly() -> None:
    """Rank 0 sends fp32, bf16 and int64 tensors (odd sizes, several buckets) to two receivers."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(33, 7, generator=generator),
        "router.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
        "norm.weight": torch.randn(3, generator=generator).to(torch.bfloat16),
        "counts": torch.arange(9, dtype=torch.int64),
    }
    metas = [TensorMeta.of(name, t) for name, t in tensors.items()]
    received: dict[int, dict[str, torch.Tensor]] = {1: {}, 2: {}}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = WeightGroup(
                "127.0.0.1", store.port, r, 3, backend="gloo", generation=7, device=torch.device("cpu"), timeout_s=60
            )
            if r == 0:
                assert group.send(metas, tensors, bucket_bytes=256) == len(plan_buckets(metas, 256))
            else:
                for meta, tensor in group.receive(metas, bucket_bytes=256):
                    received[r][meta.name] = tensor.clone()
            group.close()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for r in (1, 2):
        for meta in metas:
            got = received[r][meta.name]
            assert got.dtype == tensors[meta.name].dtype and got.shape == tensors[meta.name].shape
            assert torch.equal(got, tensors[meta.name])
            assert tensor_checksum(got) == meta.checksum


def test_gloo_join_is_bounded_by_the_join_timeout_and_broadcasts_by_the_refit_timeout() -> None:
    """A rank whose sender never comes gives up after ``join_timeout_s``, not ``timeout_s``; once joined,
    a broadcast that starts later than ``join_timeout_s`` still goes through (bounded by ``timeout_s``)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)

    def member(rank: int, generation: int) -> WeightGroup:
        return WeightGroup(
            "127.0.0.1",
            store.port,
            rank,
            2,
            backend="gloo",
            generation=generation,
            device=torch.device("cpu"),
            timeout_s=120,
            join_timeout_s=1,
        )

    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        member(1, generation=1)
    assert time.monotonic() - started < 60

    tensors = {"w": torch.arange(10, dtype=torch.float32)}
    metas = [TensorMeta.of("w", tensors["w"])]
    groups: dict[int, WeightGroup] = {}

    def join(r: int) -> None:
        groups[r] = member(r, generation=2)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    received: list[torch.Tensor] = []
    receiver = threading.Thread(
        target=lambda: received.extend(t.clone() for _, t in groups[1].receive(metas, bucket_bytes=1024))
    )
    receiver.start()
    time.sleep(2)  # the receiver waits in its broadcast twice the join timeout
    groups[0].send(metas, tensors, bucket_bytes=1024)
    receiver.join(timeout=60)
    assert len(received) == 1 and torch.equal(received[0], tensors["w"])
    for group in groups.values():
        group.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_checksum_on_the_gpu_equals_the_host_one(dtype: torch.dtype) -> None:
    """The sender hashes on its GPU and a receiver may hash on the host (or another GPU): same value."""
    tensor = (torch.randn(3_000_001, generator=torch.Generator().manual_seed(2)) * 100).to(dtype)
    for piece in (tensor, tensor[1:], tensor[:-1]):  # aligned, unaligned start, partial last word
        assert tensor_checksum(piece.cuda()) == tensor_checksum(piece), (dtype, piece.numel())
