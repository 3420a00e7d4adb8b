"""Weight refit over gloo: molt's WeightGroup versus one raw ProcessGroupGloo broadcast, side by side in one run.

Two processes (rank 0 = the learner's side, rank 1 = an engine worker's side)
move the same bytes both ways, in the same process pair:

- ours: rank 0 ``WeightGroup.send`` (bucketing: ``plan_buckets`` + ``pack_bucket``,
  one gloo broadcast per bucket); rank 1 ``WeightGroup.receive`` and, like the
  engine's ``receive_weights``, stages every tensor and checks its
  ``tensor_checksum`` against the manifest's;
- raw: one ``ProcessGroupGloo.broadcast`` of ONE flat uint8 buffer of the same
  total size (rank 0's buffer is filled beforehand; rank 1 allocates it in the timing, as ours does).

Times are rank 1's (the receiver finishes last), from a common start to the
last byte received (raw) or the last tensor staged / verified (ours). Ours runs
twice per round: transfer alone (receive + unpack, which includes the sender's
packing), then with the receiver's checksums (which overlap with the next
bucket's transfer; their own time is reported too); the sender's
manifest checksums (``TensorMeta.of``, which the learner computes for every refit
before it sends) are timed on rank 0 and reported apart. Rounds alternate ours/raw after one warm-up round; medians.

Sizes: ``tiny`` is the tiny model's refit state (``molt.core.tiny_model.build``,
loaded with transformers, tied head dropped as the learner does); ``mixed`` is a
random Qwen2-shaped state of about 300 MB, fp32 and bf16 layers alternating.
Usage: ``uv run python bench/refit.py [--sizes tiny,mixed] [--repeats 5] [--bucket-mb 512]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from molt.core.weightsync import (
    TensorMeta,
    WeightGroup,
    bucket_layout,
    manifest_from_json,
    manifest_to_json,
    pack_bucket,
    plan_buckets,
    tensor_checksum,
)

SIZES = ("tiny", "mixed")
HOST = "127.0.0.1"


def mixed_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """~292 MB shaped like a Qwen2 model (hidden 1024, 6 layers, vocab 32000): even layers fp32, odd layers bf16."""
    hidden, inter, kv, vocab = 1024, 3072, 512, 32000
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    state = {"model.embed_tokens.weight": rand(vocab, hidden, dtype=torch.bfloat16)}
    for layer in range(6):
        dtype = torch.float32 if layer % 2 == 0 else torch.bfloat16
        prefix = f"model.layers.{layer}"
        for name, shape in (
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.q_proj.bias", (hidden,)),
            ("self_attn.k_proj.weight", (kv, hidden)),
            ("self_attn.k_proj.bias", (kv,)),
            ("self_attn.v_proj.weight", (kv, hidden)),
            ("self_attn.v_proj.bias", (kv,)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (inter, hidden)),
            ("mlp.up_proj.weight", (inter, hidden)),
            ("mlp.down_proj.weight", (hidden, inter)),
            ("input_layernorm.weight", (hidden,)),
            ("post_attention_layernorm.weight", (hidden,)),
        ):
            state[f"{prefix}.{name}"] = rand(*shape, dtype=dtype)
    state["model.norm.weight"] = rand(hidden, dtype=torch.float32)
    return state


def tiny_state(model_dir: str) -> dict[str, torch.Tensor]:
    """The tiny model's refit state: what ``gather_for_refit`` sends (the tied ``lm_head.weight`` left out)."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def worker(rank: int, port: int, sizes: list[str], tiny_dir: str, repeats: int, bucket_bytes: int, threads: int):
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    timeout = timedelta(seconds=600)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout, use_libuv=True)
    group = WeightGroup(HOST, port, rank, 2, backend="gloo", generation=1, device=cpu, timeout_s=600)
    raw = dist.ProcessGroupGloo(dist.PrefixStore("raw-bench", store), rank, 2, timeout)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    flag = torch.zeros(1)

    def sync() -> None:  # both ranks leave together
        raw.broadcast([flag], opts).wait()

    for size in sizes:
        if rank == 0:
            state = tiny_state(tiny_dir) if size == "tiny" else mixed_state()
            metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
            store.set(f"{size}/manifest", manifest_to_json(metas))
            total = sum(m.nbytes for m in metas)
            flat = torch.randint(0, 256, (total,), dtype=torch.uint8)
        else:
            metas = manifest_from_json(store.get(f"{size}/manifest").decode())
            total = sum(m.nbytes for m in metas)
        rows: dict[str, list[float]] = {"ours_s": [], "ours_transfer_s": [], "ours_verify_s": [], "raw_s": []}
        manifest_s: list[float] = []
        scratch: torch.Tensor | None = None
        pack_s: list[float] = []
        ok = True
        for round_ in range(repeats + 1):  # round 0 warms up
            if rank == 0 and round_:  # the learner computes the manifest anew for every refit
                started = time.perf_counter()
                metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
                manifest_s.append(time.perf_counter() - started)
                # diagnostic: what send() spends packing, before any byte moves (into a buffer kept between
                # refits, as WeightGroup.send packs on CPU)
                buckets_now = plan_buckets(metas, bucket_bytes)
                if scratch is None:
                    scratch = torch.zeros(max(bucket_layout(b)[1] for b in buckets_now), dtype=torch.uint8)
                started = time.perf_counter()
                for bucket in buckets_now:
                    pack_bucket(bucket, state, cpu, out=scratch)
                pack_s.append(time.perf_counter() - started)
            # ours, twice: transfer alone (receive + stage), then as the engine does it (+ checksums, which
            # overlap with the next bucket's transfer, so the two cannot be split out of one pass)
            timings = []
            verify = 0.0
            for check in (False, True):
                sync()
                started = time.perf_counter()
                if rank == 0:
                    buckets = group.send(metas, state, bucket_bytes)
                else:
                    staged: dict[str, torch.Tensor] = {}
                    for meta, tensor in group.receive(metas, bucket_bytes):
                        staged[meta.name] = tensor
                        if check:
                            mark = time.perf_counter()
                            ok &= tensor_checksum(tensor) == meta.checksum
                            verify += time.perf_counter() - mark
                    ok &= len(staged) == len(metas)
                    del staged
                timings.append(time.perf_counter() - started)
            # raw
            sync()
            started = time.perf_counter()
            buffer = flat if rank == 0 else torch.empty(total, dtype=torch.uint8)
            raw.broadcast([buffer], opts).wait()
            raw_s = time.perf_counter() - started
            del buffer
            if round_:
                rows["ours_transfer_s"].append(timings[0])
                rows["ours_s"].append(timings[1])
                rows["ours_verify_s"].append(verify)
                rows["raw_s"].append(raw_s)
        if rank == 0:
            store.set(
                f"{size}/sender",
                json.dumps(
                    {
                        "manifest_s": statistics.median(manifest_s),
                        "pack_s": statistics.median(pack_s),
                        "buckets": buckets,
                    }
                ),
            )
            del state, flat
        else:
            store.set(f"{size}/receiver", json.dumps({**rows, "bytes": total, "tensors": len(metas), "ok": ok}))
    sync()
    group.close()
    raw.shutdown()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def report(size: str, sender: dict, receiver: dict) -> None:
    nbytes = receiver["bytes"]
    med = {k: statistics.median(v) for k, v in receiver.items() if k.endswith("_s")}
    print(
        f"\n[{size}] {nbytes / 1e6:.1f} MB in {receiver['tensors']} tensors, {sender['buckets']} bucket(s); "
        f"checksums match and every tensor received: {receiver['ok']}"
    )
    print(f"  {'path':44s} {'median s':>9s} {'GB/s':>7s} {'ours/raw':>9s}")
    raw = gbps(nbytes, med["raw_s"])
    for label, key in (
        ("raw: one flat ProcessGroupGloo.broadcast", "raw_s"),
        ("ours: transfer (receive + unpack)", "ours_transfer_s"),
        ("ours: transfer + receiver verify", "ours_s"),
    ):
        rate = gbps(nbytes, med[key])
        print(f"  {label:44s} {med[key]:9.4f} {rate:7.3f} {rate / raw:9.3f}")
    print(f"  {'ours: receiver verify (checksums) alone':44s} {med['ours_verify_s']:9.4f}")
    print(f"  {'sender manifest (checksums)':44s} {sender['manifest_s']:9.4f}")
    print(f"  {'sender pack_bucket alone (inside send)':44s} {sender['pack_s']:9.4f}")
    end_to_end = gbps(nbytes, med["ours_s"] + sender["manifest_s"])
    print(
        f"  throughput ratio ours/raw: transfer {gbps(nbytes, med['ours_transfer_s']) / raw:.3f}, "
        f"with receiver verify {gbps(nbytes, med['ours_s']) / raw:.3f}, "
        f"with both sides' checksums {end_to_end / raw:.3f}  (goal >= 0.8)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {', '.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds per size (after one warm-up)")
    parser.add_argument("--bucket-mb", type=float, default=512, help="bucket bound, MiB (the services' default: 512)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = set(sizes) - set(SIZES)
    if unknown:
        parser.error(f"unknown sizes {sorted(unknown)}")
    bucket_bytes = int(args.bucket_mb * 1024 * 1024)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=True)
    print(
        f"refit over gloo, 2 processes on this host, bucket {args.bucket_mb:g} MiB, {args.repeats} rounds after a "
        f"warm-up, torch {torch.__version__}, {args.threads} thread(s) per process, {os.cpu_count()} cpus"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tiny_dir = ""
        if "tiny" in sizes:
            from molt.core.tiny_model import build

            tiny_dir = str(build(Path(tmp) / "tiny"))
        mp.spawn(worker, args=(store.port, sizes, tiny_dir, args.repeats, bucket_bytes, args.threads), nprocs=2)
    for size in sizes:
        report(size, json.loads(store.get(f"{size}/sender")), json.loads(store.get(f"{size}/receiver")))


if __name__ == "__main__":
    main()
