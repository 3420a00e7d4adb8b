"""Refit of a ~1B-parameter bf16 Qwen2-shaped model on GPUs: molt's WeightGroup versus a raw flat broadcast, one run.

Two processes, one GPU each (the default; for a host with 2 GPUs):

- rank 0 (the learner's side) builds a Qwen2ForCausalLM with random weights
  (transformers ``Qwen2Config``, nothing downloaded; default hidden 2048, 22
  layers, vocab 32000, tied embeddings: about 1.0B parameters, 2 GB in bf16),
  computes the manifest (``TensorMeta.of``) and ``WeightGroup.send``s its state
  (tied ``lm_head.weight`` left out, as the learner does) over NCCL;
- rank 1 (the engine worker's side) holds an equally shaped model with other
  random weights, ``WeightGroup.receive``s, checks every tensor's checksum
  against the manifest (as ``receive_weights`` does), then ``load_state_dict``s;
  afterwards it re-hashes its loaded parameters and runs a teacher-forced probe
  (logprobs of a fixed token sequence) to compare with rank 0's;
- raw: one ``ProcessGroupNCCL.broadcast`` of ONE flat uint8 buffer of the same
  size, in the same process pair, rounds alternating with ours.

``--single-gpu`` (a machine with one GPU: NCCL cannot put two ranks on one
GPU) runs both sides' code paths in one process, one after the other: rank 0's
side = manifest checksums + ``pack_bucket`` of every bucket; the wire = a
device-to-device copy of each bucket buffer; rank 1's side = ``unpack_bucket`` +
checksum verification + ``load_state_dict`` into the second model + the probe.
It compares with a raw device-to-device ``copy_`` of one flat buffer of the
same size and prints every phase. The wire there is HBM, far faster than any
link between GPUs, so its ratios bound our overhead from above; it also drives
``WeightGroup.send`` through a 1-rank NCCL group (a smoke test of that path,
not a transfer). ``--device cpu`` (with gloo for two processes) runs either
mode on a small model without a GPU, as a check of the code.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, set before any NCCL init).
Usage: ``python bench/refit_nccl.py [--single-gpu] [--layers 22] [--repeats 5] [--bucket-mb 512]``
(outside the workspace's venv: ``PYTHONPATH=libs/molt-core/src``; needs torch and transformers only).
"""

from __future__ import annotations

import os

# Before torch initialises NCCL, also in spawned children (they inherit the environment).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse
import json
import statistics
import time
from datetime import timedelta

import benchlib
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from molt.core.weightsync import (
    TensorMeta,
    WeightGroup,
    bucket_layout,
    manifest_from_json,
    manifest_to_json,
    pack_bucket,
    plan_buckets,
    tensor_checksum,
    unpack_bucket,
)

HOST = "127.0.0.1"
PROBE_SEED = 1234  # the learner's probe seed (molt.learner.refit.PROBE_SEED)


def qwen2_config(args: argparse.Namespace) -> Qwen2Config:
    return benchlib.qwen2_config(args.hidden, args.intermediate, args.layers, args.vocab, 4096)


def build_model(config: Qwen2Config, seed: int, device: torch.device) -> Qwen2ForCausalLM:
    """Random weights from ``seed`` (initialised in fp32 on ``device``, then cast to bf16)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def refit_state(model: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    """What the learner sends: every tensor of the state dict, the tied ``lm_head.weight`` left out."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def probe_ids(vocab: int, length: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab, (length,), generator=generator).to(device)


def probe(model: Qwen2ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logprob of each next token of ``ids`` (float32, on the host)."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None])[:, 0].cpu()


def load(model: Qwen2ForCausalLM, staged: dict[str, torch.Tensor]) -> None:
    result = model.load_state_dict(staged, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if missing or result.unexpected_keys:
        raise RuntimeError(f"load_state_dict: missing {sorted(missing)[:3]}, unexpected {result.unexpected_keys[:3]}")


def loaded_checksums_ok(model: Qwen2ForCausalLM, metas: list[TensorMeta]) -> bool:
    state = model.state_dict()
    return all(tensor_checksum(state[m.name]) == m.checksum for m in metas)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def median(values: list[float]) -> float:
    return statistics.median(values)


# ---------------------------------------------------------------- two processes, one GPU each


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    nccl = args.device == "cuda"
    if nccl:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    backend = "nccl" if nccl else "gloo"
    timeout = timedelta(seconds=600)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout, use_libuv=True)
    group = WeightGroup(HOST, port, rank, 2, backend=backend, generation=1, device=device, timeout_s=600)
    raw_store = dist.PrefixStore("raw-bench", store)
    raw = dist.ProcessGroupNCCL(raw_store, rank, 2) if nccl else dist.ProcessGroupGloo(raw_store, rank, 2, timeout)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    flag = torch.zeros(1, device=device)

    def barrier() -> None:
        raw.broadcast([flag], opts).wait()
        sync(device)

    config = qwen2_config(args)
    model = build_model(config, seed=rank, device=device)
    ids = probe_ids(config.vocab_size, args.probe_tokens, device)
    bucket_bytes = int(args.bucket_mb * 1024 * 1024)
    if rank == 0:
        state = refit_state(model)
        metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
        store.set("manifest", manifest_to_json(metas))
        store.set("probe", json.dumps(probe(model, ids).tolist()))
        total = sum(m.nbytes for m in metas)
        flat = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
    else:
        metas = manifest_from_json(store.get("manifest").decode())
        total = sum(m.nbytes for m in metas)
        before = probe(model, ids)
    rows: dict[str, list[float]] = {k: [] for k in ("manifest", "ours", "receive", "verify", "load", "raw", "send")}
    ok = True
    for round_ in range(args.repeats + 1):  # round 0 warms up (communicators, allocator)
        times: dict[str, float] = {}
        if rank == 0:
            started = time.perf_counter()
            metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
            times["manifest"] = time.perf_counter() - started
        barrier()
        started = time.perf_counter()
        if rank == 0:
            group.send(metas, state, bucket_bytes)
            times["send"] = time.perf_counter() - started
        else:
            staged: dict[str, torch.Tensor] = {}
            verify = 0.0
            for meta, tensor in group.receive(metas, bucket_bytes):
                staged[meta.name] = tensor
                mark = time.perf_counter()
                ok &= tensor_checksum(tensor) == meta.checksum  # synchronises: the time is the checksum's
                verify += time.perf_counter() - mark
            received = time.perf_counter()
            load(model, staged)
            sync(device)
            times["ours"] = time.perf_counter() - started
            times["verify"] = verify
            times["receive"] = received - started - verify
            times["load"] = times["ours"] - (received - started)
            ok &= len(staged) == len(metas)
            del staged
        barrier()
        started = time.perf_counter()
        buffer = flat if rank == 0 else torch.empty(total, dtype=torch.uint8, device=device)
        raw.broadcast([buffer], opts).wait()
        sync(device)
        times["raw"] = time.perf_counter() - started
        del buffer
        if round_:
            for key, value in times.items():
                rows[key].append(value)
    if rank == 0:
        store.set("sender", json.dumps({"manifest": median(rows["manifest"]), "send": median(rows["send"])}))
    else:
        after = probe(model, ids)
        reference = torch.tensor(json.loads(store.get("probe")))
        result = {
            "bytes": total,
            "tensors": len(metas),
            "buckets": len(plan_buckets(metas, bucket_bytes)),
            "checksums_ok": bool(ok),
            "loaded_checksums_ok": loaded_checksums_ok(model, metas),
            "probe_diff_before": float((before - reference).abs().max()),
            "probe_diff_after": float((after - reference).abs().max()),
            **{k: median(v) for k, v in rows.items() if v},
        }
        store.set("receiver", json.dumps(result))
    barrier()
    group.close()
    raw.shutdown()


def two_processes(args: argparse.Namespace) -> None:
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"two-process mode needs 2 GPUs, this host has {torch.cuda.device_count()} (--single-gpu?)")
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=True)
    print(
        f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, tied, bf16; "
        f"{'NCCL, one GPU per rank' if args.device == 'cuda' else 'gloo on cpu'}; bucket <= {args.bucket_mb:g} MiB; "
        f"{args.repeats} rounds after a warm-up"
    )
    mp.spawn(worker, args=(store.port, args), nprocs=2)
    sender, r = json.loads(store.get("sender")), json.loads(store.get("receiver"))
    nbytes = r["bytes"]
    raw = gbps(nbytes, r["raw"])
    print(f"\n{nbytes / 1e9:.3f} GB in {r['tensors']} tensors, {r['buckets']} bucket(s); medians over rounds")
    print(f"  {'path':52s} {'median s':>9s} {'GB/s':>8s} {'ours/raw':>9s}")
    print(f"  {'raw: one flat broadcast':52s} {r['raw']:9.4f} {raw:8.2f} {1:9.3f}")
    transfer = r["receive"]
    for label, seconds in (
        ("ours: receive + unpack", transfer),
        ("ours: receive + verify", transfer + r["verify"]),
        ("ours: receive + verify + load_state_dict (refit)", r["ours"]),
        ("ours: refit + sender manifest", r["ours"] + sender["manifest"]),
    ):
        print(f"  {label:52s} {seconds:9.4f} {gbps(nbytes, seconds):8.2f} {gbps(nbytes, seconds) / raw:9.3f}")
    for label, key in (("receiver verify (checksums)", "verify"), ("receiver load_state_dict", "load")):
        print(f"  {label:52s} {r[key]:9.4f}")
    print(f"  {'sender manifest (checksums)':52s} {sender['manifest']:9.4f}")
    print(f"  {'sender send() (pack + broadcast)':52s} {sender['send']:9.4f}")
    print(
        f"refit throughput ratio ours/raw: {gbps(nbytes, r['ours']) / raw:.3f}  (goal >= 0.8); "
        f"with the sender's manifest: {gbps(nbytes, r['ours'] + sender['manifest']) / raw:.3f}"
    )
    print(
        f"validation: checksums of received tensors match the manifest: {r['checksums_ok']}; loaded parameters "
        f"re-hashed match: {r['loaded_checksums_ok']}; probe max |logprob diff| rank 0 vs rank 1: before refit "
        f"{r['probe_diff_before']:.4g}, after {r['probe_diff_after']:.4g}"
    )


# ---------------------------------------------------------------- one GPU, both sides in one process


def one_round(model_b, state, metas, buckets, flat, device) -> dict[str, float]:
    """One refit through both sides' code paths, phase by phase, then the raw copy; seconds per phase."""
    times: dict[str, float] = {}

    def phase(name: str, started: float) -> float:
        sync(device)
        now = time.perf_counter()
        times[name] = now - started
        return now

    mark = time.perf_counter()
    sent_metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
    mark = phase("manifest", mark)
    packed = [pack_bucket(bucket, state, device) for bucket in buckets]
    mark = phase("pack", mark)
    wire = [
        torch.empty(bucket_layout(b)[1], dtype=torch.uint8, device=device).copy_(p)
        for b, p in zip(buckets, packed, strict=True)
    ]
    mark = phase("wire", mark)
    del packed
    staged = {m.name: t for bucket, buf in zip(buckets, wire, strict=True) for m, t in unpack_bucket(bucket, buf)}
    mark = phase("unpack", mark)
    bad = [m.name for m in metas if tensor_checksum(staged[m.name]) != m.checksum]
    mark = phase("verify", mark)
    load(model_b, staged)
    mark = phase("load", mark)
    del staged, wire
    times["ok"] = float(not bad and sent_metas == metas)
    sync(device)
    mark = time.perf_counter()
    torch.empty_like(flat).copy_(flat)
    phase("raw", mark)
    return times


def single_gpu(args: argparse.Namespace) -> None:
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    config = qwen2_config(args)
    model_a = build_model(config, seed=0, device=device)
    model_b = build_model(config, seed=1, device=device)
    ids = probe_ids(config.vocab_size, args.probe_tokens, device)
    reference, before = probe(model_a, ids), probe(model_b, ids)
    state = refit_state(model_a)
    metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
    bucket_bytes = int(args.bucket_mb * 1024 * 1024)
    buckets = plan_buckets(metas, bucket_bytes)
    nbytes = sum(m.nbytes for m in metas)
    params = sum(p.numel() for p in model_a.parameters())
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    print(
        f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, tied, bf16, {params / 1e9:.3f}B "
        f"parameters; refit {nbytes / 1e9:.3f} GB in {len(metas)} tensors, {len(buckets)} bucket(s) of <= "
        f"{args.bucket_mb:g} MiB; {args.repeats} rounds after a warm-up; device {device_name(device)}"
    )
    rounds = [one_round(model_b, state, metas, buckets, flat, device) for _ in range(args.repeats + 1)][1:]
    med = {k: median([r[k] for r in rounds]) for k in rounds[0]}
    after = probe(model_b, ids)
    print(f"  {'phase':46s} {'median s':>9s} {'GB/s':>8s}")
    for label, key in (
        ("rank 0: manifest (TensorMeta.of checksums)", "manifest"),
        ("rank 0: pack_bucket, every bucket", "pack"),
        ("wire stand-in: D2D copy of each bucket", "wire"),
        ("rank 1: unpack_bucket (views)", "unpack"),
        ("rank 1: verify checksums", "verify"),
        ("rank 1: load_state_dict", "load"),
        ("raw: one flat D2D copy_", "raw"),
    ):
        print(f"  {label:46s} {med[key]:9.5f} {gbps(nbytes, med[key]):8.1f}")
    data_path = med["pack"] + med["wire"] + med["unpack"]
    refit = data_path + med["verify"] + med["load"]
    print(
        f"ratio ours/raw (throughput): data path (pack + wire + unpack) {med['raw'] / data_path:.3f}; "
        f"+ verify + load {med['raw'] / refit:.3f}; + sender manifest {med['raw'] / (refit + med['manifest']):.3f}"
    )
    overhead = med["manifest"] + med["pack"] + med["unpack"] + med["verify"] + med["load"]
    print(
        f"our work beyond moving the bytes, per refit: {overhead * 1e3:.1f} ms "
        f"({overhead / med['raw']:.1f}x the raw copy)"
    )
    if device.type == "cuda":
        host_ok = all(tensor_checksum(t.cpu()) == m.checksum for m, t in zip(metas, state.values(), strict=True))
        print(f"device checksums equal host checksums of the same tensors: {host_ok}")
        print(f"1-rank NCCL WeightGroup.send (smoke test of the NCCL path): {nccl_smoke(metas, state, bucket_bytes)}")
    print(
        f"validation: every round's checksums matched: {all(r['ok'] for r in rounds)}; loaded parameters re-hashed "
        f"match: {loaded_checksums_ok(model_b, metas)}; probe max |logprob diff| model A vs model B: before refit "
        f"{float((before - reference).abs().max()):.4g}, after {float((after - reference).abs().max()):.4g}"
    )


def nccl_smoke(metas: list[TensorMeta], state: dict[str, torch.Tensor], bucket_bytes: int) -> str:
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=True)
    group = WeightGroup(HOST, store.port, 0, 1, backend="nccl", generation=1, device=torch.device("cuda", 0))
    try:
        group.send(metas, state, bucket_bytes)  # warm-up: the communicator starts here
        started = time.perf_counter()
        count = group.send(metas, state, bucket_bytes)
        return f"ok, {count} bucket(s) in {time.perf_counter() - started:.4f} s"
    except Exception as exc:  # reported, not fatal: the other results stand
        return f"FAILED: {type(exc).__name__}: {exc}"
    finally:
        group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single-gpu", action="store_true", help="both sides in one process on one GPU")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a code check (gloo)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (after one warm-up)")
    parser.add_argument("--bucket-mb", type=float, default=512, help="bucket bound, MiB (the services' default: 512)")
    parser.add_argument("--probe-tokens", type=int, default=32)
    args = parser.parse_args()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    print(
        f"torch {torch.__version__}, NCCL {nccl}, GPUs {torch.cuda.device_count()}, "
        f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}"
    )
    if args.single_gpu:
        single_gpu(args)
    else:
        two_processes(args)


if __name__ == "__main__":
    main()
