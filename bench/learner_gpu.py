"""RL training steps of the learner on one GPU against a plain transformers training step, one run.

Model: a Qwen2-shaped causal LM with random weights (transformers ``Qwen2Config``,
nothing downloaded; default hidden 2048, 27 layers, 16 heads of 128 with 4 KV heads,
intermediate 5632, vocab 32000, tied embeddings: about 1.28B parameters), bf16,
SDPA attention. It is saved once with ``save_pretrained`` into a temporary folder,
and both sides load it from there.

- ours: ``molt.learner.trainer.Trainer`` built from ``LearnerSettings`` (world size 1,
  so no FSDP; ``device_for`` picks the GPU, ``load_policy`` loads bf16) and its
  ``train_step(batch)``. The batch goes through the learner's own input path:
  ``TrajectoryGroup`` protos (``molt.learner.synthetic``) -> ``build_group`` ->
  ``assemble``. One step is GRPO advantages and row weights over the step, then per
  micro-batch (``--micro-batch-tokens``, default one micro-batch of the whole step;
  ``--layout``, default the learner's: padded rows) the logprob recompute
  (``logprobs.token_logprobs``, with the logged entropy), the PPO/IS objective of
  ``molt.algos`` (``objective.micro_loss``) and a backward, then grad-norm clipping,
  AdamW and the LR schedule.
- plain: ``model(input_ids, labels=input_ids).loss.backward()`` on the same tokens as
  one ``[sequences, length]`` batch, then a fused AdamW step (no clipping).

Steps of the two alternate; times are host clocks around a step with the device
synchronised before and after. MFU is model FLOPs over time against the bf16 matmul
rate measured in the same run (``--matmul`` cubed, random data): 6 * parameters *
tokens, and that plus causal attention (6 * layers * hidden * sequence length per
token, forward + backward). Diagnostics after the timed steps: peak memory, GPU
busy time from the profiler, the optimizer step fused versus for-each, a run of
``--mixed`` mixed-length sequences (ours only), the same step at the learner's default
``micro_batch_tokens`` (``--default-budget``: two 4k sequences per micro-batch), and with
``--compile`` ours, then plain, again with each decoder layer ``torch.compile``d (for ours
what ``[learner] compile = true`` does).

``--backend`` picks the learner's backend (``auto``: NVIDIA AutoModel where it imports, else
transformers); "plain" is always transformers.
Usage: ``python bench/learner_gpu.py [--backend auto|torch|automodel] [--layers 27] [--steps 10] [--compile]``
(outside the workspace's venv put ``libs/*/src`` and ``services/*/src`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import benchlib
import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from molt.core.config import RunSettings
from molt.core.rollout import RolloutSettings
from molt.learner.batch import StepBatch, assemble, build_group
from molt.learner.config import LearnerSettings, OptimizerSettings, check_sound
from molt.learner.packing import plan
from molt.learner.synthetic import group_of, trajectory
from molt.learner.trainer import Trainer


def qwen2_config(args: argparse.Namespace) -> Qwen2Config:
    return benchlib.qwen2_config(args.hidden, args.intermediate, args.layers, args.vocab, max(4096, args.seq_len))


CUDA = torch.cuda.is_available()  # without CUDA: a quick check of the code on a tiny config (--layers 2 ...)
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32  # what the learner's load_policy picks


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def empty_cache() -> None:
    if CUDA:
        torch.cuda.empty_cache()


def timed(fn: Callable[[], object]) -> float:
    sync()
    started = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - started


def matmul_rate(n: int, reps: int) -> float:
    """``n x n @ n x n`` on random data: TFLOP/s, the median of 3 rounds of ``reps`` back-to-back products
    (each round timed as a whole) after 3 warm-ups."""
    a = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    b = torch.randn(n, n, device=DEVICE, dtype=DTYPE)

    def products() -> None:
        for _ in range(reps):
            torch.matmul(a, b)

    for _ in range(3):
        torch.matmul(a, b)
    seconds = statistics.median(timed(products) for _ in range(3)) / reps
    return 2 * n**3 / seconds / 1e12


def save_random_model(config: Qwen2Config, folder: Path, seed: int) -> int:
    """Random bf16 weights initialised on the GPU, saved with ``save_pretrained``; returns the parameter count."""
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(config)
    model = model.to(DTYPE)
    params = sum(p.numel() for p in model.parameters())  # the tied head counted once
    model.save_pretrained(folder)
    del model
    empty_cache()
    return params


def step_batch(lengths: list[int], vocab: int, prompt: int, seed: int, settings: LearnerSettings) -> StepBatch:
    """One GRPO group of ``len(lengths)`` samples through the learner's input path (protos -> build_group ->
    assemble); random token ids, rollout logprobs ``-log(vocab)`` (what a random model assigns)."""
    rng = random.Random(seed)
    trajectories = []
    for i, length in enumerate(lengths):
        t = trajectory(
            f"t{seed}-{i}",
            [rng.randrange(vocab) for _ in range(prompt)],
            [rng.randrange(vocab) for _ in range(length - prompt)],
            reward=float(i % 4) / 3,
        )
        t.rollout_logprobs[:] = [-math.log(vocab)] * (length - prompt)
        trajectories.append(t)
    outcome = build_group(
        group_of(f"g{seed}", trajectories),
        vocab_size=vocab,
        current_version=0,
        max_staleness=settings.rollout.max_staleness,
        consumed=set(),
        needs_groups=True,
    )
    assert len(outcome.samples) == len(lengths), outcome.dropped
    return assemble(outcome.samples)


def flops_per_step(params: int, layers: int, hidden: int, lengths: list[int]) -> tuple[float, float]:
    """(6 * params * tokens, causal attention forward + backward) of one step over sequences of ``lengths``."""
    dense = 6.0 * params * sum(lengths)
    attention = sum(6.0 * layers * hidden * s * s for s in lengths)
    return dense, attention


Scopes = dict[str, list[float]]  # trainer scope -> [host s, GPU idle s within it]


def gpu_busy(fn: Callable[[], object]) -> tuple[float, float, int, list[tuple[str, float, int]], Scopes, list[str]]:
    """(wall s, summed GPU kernel + copy time s, device events, top kernels by time, per trainer scope) of one
    call under the profiler. One stream, so the kernels do not overlap and wall - busy is the time the GPU sat
    idle. Scopes are the trainer's ``record_function("molt/...")`` blocks: ``[host s, GPU idle s within it]``;
    gaps the four longest stretches of GPU idle time, each with the host operators running during it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - started
    kernels: dict[str, list[float]] = {}
    spans: list[tuple[float, float]] = []
    for event in prof.events():
        # Not kernels: the profiler's buffer marker, and the trainer's scopes mirrored on the device's timeline.
        if event.device_type != DeviceType.CUDA or event.name.startswith(("Command Buffer Full", "molt/")):
            continue
        entry = kernels.setdefault(event.name, [0.0, 0])
        entry[0] += event.time_range.elapsed_us() / 1e6
        entry[1] += 1
        spans.append((event.time_range.start, event.time_range.end))
    busy = sum(v[0] for v in kernels.values())
    count = int(sum(v[1] for v in kernels.values()))
    top = sorted(((k, v[0], int(v[1])) for k, v in kernels.items()), key=lambda r: -r[1])
    union: list[list[float]] = []
    for start, end in sorted(spans):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    scopes: Scopes = {}
    for event in prof.events():
        if event.device_type != DeviceType.CPU or not event.name.startswith("molt/"):
            continue
        start, end = event.time_range.start, event.time_range.end
        covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)
        entry = scopes.setdefault(event.name, [0.0, 0.0])
        entry[0] += (end - start) / 1e6
        entry[1] += (end - start - covered) / 1e6
    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU and not e.name.startswith("molt/")]
    edges = [(min(e.time_range.start for e in cpu), union[0][0])] if cpu and union else []
    edges += [(union[i][1], union[i + 1][0]) for i in range(len(union) - 1)]
    gaps = []
    for a, b in sorted(edges, key=lambda g: g[0] - g[1])[:4]:
        # The host operators running while the GPU waited: the largest overlap first, inner ones before outer.
        ops = sorted(
            ((min(b, e.time_range.end) - max(a, e.time_range.start), e.time_range.elapsed_us(), e.name) for e in cpu),
            key=lambda r: (-r[0], r[1]),
        )
        names = ", ".join(f"{name[:40]} {overlap / 1e3:.1f}" for overlap, _, name in ops[:5] if overlap > 0)
        gaps.append(f"{(b - a) / 1e3:.1f} ms idle at +{(a - edges[0][0]) / 1e3:.1f} ms: {names}")
    return wall, busy, count, top[:8], scopes, gaps


def profile_report(name: str, fn: Callable[[], object]) -> None:
    """One profiled call of ``fn``: peak memory, GPU busy and idle, top kernels, and where the GPU idled."""
    torch.cuda.reset_peak_memory_stats()
    timed(fn)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30
    try:
        wall, busy, count, top, scopes, gaps = gpu_busy(fn)
    except Exception as exc:  # a diagnostic: never lose the rest of the run to it
        print(f"  {name}: profiler failed: {exc!r}")
        return
    print(
        f"  {name}: peak memory {peak_mem:.1f} GiB; profiled wall {wall:.4f} s, {count} kernels/copies "
        f"taking {busy:.4f} s ({busy / wall * 100:.1f}% busy, GPU idle {wall - busy:.4f} s)"
    )
    for key, seconds, calls in top:
        print(f"      {seconds * 1e3:8.2f} ms  x{calls:<5} {key[:90]}")
    if scopes:
        print(
            "      trainer scopes (host ms / GPU idle ms within): "
            + ", ".join(f"{scope[5:]} {host * 1e3:.1f}/{idle * 1e3:.1f}" for scope, (host, idle) in scopes.items())
        )
    for gap in gaps:
        print(f"      {gap} (host ops, ms of overlap)")


def optimizer_times(model: torch.nn.Module, reps: int) -> dict[str, float]:
    """Median seconds of one AdamW step over ``model``'s parameters with random grads: fused and for-each."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    out = {}
    for name, kwargs in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        opt = torch.optim.AdamW(params, lr=1e-9, **kwargs)
        for _ in range(2):
            opt.step()
        out[name] = statistics.median(timed(opt.step) for _ in range(reps))
        del opt
    for p in params:
        p.grad = None
    empty_cache()
    return out


def report(name: str, times: list[float], tokens: int, flops: tuple[float, float], peak: float) -> dict[str, float]:
    med = statistics.median(times)
    tps = tokens / med
    row = {
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "tokens_per_s": tps,
        "mfu_6n": flops[0] / med / 1e12 / peak,
        "mfu_6n_attn": (flops[0] + flops[1]) / med / 1e12 / peak,
    }
    print(
        f"  {name:<34} {med:8.4f} {min(times):8.4f} {max(times):8.4f} {tps:10.0f}"
        f" {row['mfu_6n'] * 100:8.1f}% {row['mfu_6n_attn'] * 100:9.1f}%",
        flush=True,
    )
    return row


HEADER = f"  {'path':<34} {'median s':>8} {'min s':>8} {'max s':>8} {'tokens/s':>10} {'MFU 6N':>9} {'MFU 6N+at':>10}"


def compile_experiment(
    trainer: Trainer,
    plain: torch.nn.Module,
    ours: Callable[[], object],
    plain_step: Callable[[], object],
    args: argparse.Namespace,
    tokens: int,
    flops: tuple[float, float],
    peak: float,
) -> None:
    """Ours, then plain, with each decoder layer ``torch.compile``d (ours also its logprob head:
    ``Trainer.compile``, what ``compile = true`` does)."""
    print("\neach decoder layer torch.compile'd, and ours' logprob head (Trainer.compile, what compile = true does)")
    compile_started = time.perf_counter()
    trainer.compile()
    for _ in range(args.warmup):
        ours()
    sync()
    print(f"  ours: compile + {args.warmup} warm-up steps: {time.perf_counter() - compile_started:.1f} s", flush=True)
    compiled, plain_again = [], []
    for _ in range(args.steps):
        compiled.append(timed(ours))
        plain_again.append(timed(plain_step))
    for layer in plain.model.layers:
        layer.compile()
    for _ in range(args.warmup):
        plain_step()
    plain_compiled = [timed(plain_step) for _ in range(args.steps)]
    print(HEADER)
    c = report("ours, compiled layers", compiled, tokens, flops, peak)
    p = report("plain (again, alternating)", plain_again, tokens, flops, peak)
    pc = report("plain, compiled layers (after)", plain_compiled, tokens, flops, peak)
    print(
        f"ratio ours compiled / plain: {c['tokens_per_s'] / p['tokens_per_s']:.3f}; "
        f"ours compiled / plain compiled: {c['tokens_per_s'] / pc['tokens_per_s']:.3f}"
    )
    if CUDA:
        print("diagnostics, compiled (one step each)")
        profile_report("ours, compiled", ours)
        profile_report("plain, compiled", plain_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "automodel"], help="the learner's")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--sequences", type=int, default=4, help="sequences per step (one GRPO group)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=0, help="the learner's micro_batch_tokens; 0 = sequences x seq-len"
    )
    parser.add_argument(
        "--layout", default="auto", choices=["auto", "packed", "padded"], help="the learner's micro_batch_layout"
    )
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of each sequence (no loss)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each path, alternating")
    parser.add_argument("--matmul", type=int, default=8192)
    parser.add_argument("--mixed", type=int, default=5, help="timed steps of mixed-length packed batches; 0 = none")
    parser.add_argument(
        "--default-budget", type=int, default=5, help="timed steps at the default micro_batch_tokens; 0 = none"
    )
    parser.add_argument("--compile", action="store_true", help="also time ours with compiled decoder layers")
    args = parser.parse_args()
    started = time.perf_counter()
    device = DEVICE
    if CUDA:
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
    else:
        where = "CPU (no CUDA: a check of the code, not a measurement)"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {where}", flush=True)
    peak = matmul_rate(args.matmul, 10)
    print(f"{DTYPE} matmul {args.matmul}^3, random data, 3 rounds of 10, median: {peak:.1f} TFLOP/s", flush=True)

    config = qwen2_config(args)
    lengths = [args.seq_len] * args.sequences
    tokens = sum(lengths)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "policy"
        params = save_random_model(config, folder, seed=0)
        settings = LearnerSettings(
            model_path=folder,
            run=RunSettings(run_dir=Path(tmp) / "run"),
            rollout=RolloutSettings(group_size=args.sequences, groups_per_step=1),
            micro_batch_tokens=args.micro_batch_tokens or args.seq_len * args.sequences,
            micro_batch_layout=args.layout,
            optimizer=OptimizerSettings(lr=1e-6, total_steps=10_000),
            backend=args.backend,
        )
        check_sound(settings)
        trainer = Trainer(settings)
        assert trainer.device.type == device.type, trainer.device
        print(f"learner backend: {trainer.backend} (asked: {args.backend}); plain: transformers", flush=True)
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE, attn_implementation="sdpa").to(device)
        plain.train()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-6, fused=True)
    param_dtype = next(trainer.model.parameters()).dtype
    print(
        f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, {config.num_attention_heads} heads "
        f"({config.num_key_value_heads} KV) of 128, intermediate {args.intermediate}, vocab {args.vocab}, tied; "
        f"{params / 1e9:.3f}B parameters, {param_dtype}, sdpa; trainer on {trainer.device}, "
        f"optimizer fused={trainer.optimizer.defaults.get('fused')}",
        flush=True,
    )
    batch = step_batch(lengths, args.vocab, args.prompt, 1, settings)
    ids = torch.stack([s.input_ids for s in batch.samples]).to(device)

    def ours() -> dict[str, float]:
        return trainer.train_step(batch)

    def plain_step() -> None:
        loss = plain(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    budget, layout = settings.micro_batch_tokens, trainer.layout
    micro = plan(lengths, 1, budget, layout)[0]
    print(
        f"step: {args.sequences} sequences x {args.seq_len} tokens = {tokens} tokens "
        f"(prompt {args.prompt}, loss on the rest); ours: {len(micro)} {layout} micro-batch(es) of <= {budget} "
        f"tokens (rows {micro}); plain: one [{args.sequences}, {args.seq_len}] batch. {args.warmup} warm-up + "
        f"{args.steps} timed steps each, alternating",
        flush=True,
    )
    for _ in range(args.warmup):
        metrics = ours()
        plain_step()
    sync()
    print(f"  ours' metrics after warm-up: loss {metrics['loss/objective']:.4f}, grad_norm {metrics['grad_norm']:.3f}")
    ours_times, plain_times = [], []
    for _ in range(args.steps):
        ours_times.append(timed(ours))
        plain_times.append(timed(plain_step))
    flops = flops_per_step(params, args.layers, args.hidden, lengths)
    print(
        f"\nMFU against {peak:.1f} TFLOP/s measured above; FLOPs per step: 6N {flops[0] / 1e12:.1f} T, "
        f"causal attention {flops[1] / 1e12:.1f} T"
    )
    print(HEADER)
    rows = {
        "ours": report("ours: Trainer.train_step", ours_times, tokens, flops, peak),
        "plain": report("plain: transformers + fused AdamW", plain_times, tokens, flops, peak),
    }
    ratio = rows["ours"]["tokens_per_s"] / rows["plain"]["tokens_per_s"]
    print(
        f"ratio ours/plain (tokens/s): {ratio:.3f}  (goal >= 1.0); ours MFU 6N {rows['ours']['mfu_6n'] * 100:.1f}%, "
        f"with attention {rows['ours']['mfu_6n_attn'] * 100:.1f}%  (goal >= 55%)",
        flush=True,
    )

    print("\ndiagnostics (one step each; the profiler adds host overhead to the wall time)")
    for name, fn in (("ours", ours), ("plain", plain_step)) if CUDA else ():
        profile_report(name, fn)
    trainer.optimizer.zero_grad(set_to_none=True)
    opt_times = optimizer_times(plain, 5)
    print(
        f"  AdamW step alone over {params / 1e9:.2f}B {param_dtype} params: fused {opt_times['fused'] * 1e3:.2f} ms, "
        f"for-each {opt_times['foreach'] * 1e3:.2f} ms",
        flush=True,
    )

    if args.mixed:
        rng = random.Random(7)
        low, high = args.prompt + args.seq_len // 16, args.seq_len * 7 // 8
        mixed = [rng.randrange(low, high) for _ in range(4 * args.sequences)]
        mixed_batch = step_batch(mixed, args.vocab, args.prompt, 2, settings)
        micro = plan(mixed, 1, budget, layout)[0]
        for _ in range(2):
            trainer.train_step(mixed_batch)
        times = [timed(lambda: trainer.train_step(mixed_batch)) for _ in range(args.mixed)]
        print(
            f"\nmixed lengths (ours only): {len(mixed)} sequences of {min(mixed)}..{max(mixed)} tokens = "
            f"{sum(mixed)} tokens in {len(micro)} {layout} micro-batches of <= {budget} (sizes "
            f"{sorted(len(m) for m in micro)} sequences)"
            + ("; block-diagonal masks, so SDPA gets an explicit mask" if layout == "packed" else "")
        )
        print(HEADER)
        mixed_flops = flops_per_step(params, args.layers, args.hidden, mixed)
        report(f"ours: mixed-length {layout}", times, sum(mixed), mixed_flops, peak)

    if args.default_budget:
        # The learner's default micro_batch_tokens (8192): two 4k sequences share a micro-batch.
        default = LearnerSettings.model_fields["micro_batch_tokens"].default
        trainer.settings = settings.model_copy(update={"micro_batch_tokens": default})
        for _ in range(2):
            ours()
        times = [timed(ours) for _ in range(args.default_budget)]
        trainer.settings = settings
        print(
            f"\nthe same step at the learner's default micro_batch_tokens = {default} "
            f"(micro-batches of rows {plan(lengths, 1, default, layout)[0]}, {layout})"
        )
        print(HEADER)
        report(f"ours: micro_batch_tokens {default}", times, tokens, flops, peak)

    if args.compile:
        compile_experiment(trainer, plain, ours, plain_step, args, tokens, flops, peak)
    print(f"\ntotal wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
