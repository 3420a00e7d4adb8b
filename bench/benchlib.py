"""What the benches share: a real rollout-router on the tiny model, and the Qwen2-shaped config
of the GPU benches.

Imported by scripts run as ``python bench/<name>.py`` (their directory is on ``sys.path``).
Imports happen inside the functions: the GPU benches run where only torch and transformers are.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from molt.core.processes import ServiceProcess


def qwen2_config(hidden: int, intermediate: int, layers: int, vocab: int, max_positions: int) -> Any:
    """A dense Qwen2 shape with head_dim 128, 4 query heads per KV head and a tied lm_head."""
    from transformers import Qwen2Config

    heads = hidden // 128
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=128,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )


def start_router(
    workdir: Path, model: Path, *, run_id: str, context: int, temperature: float, max_tokens_cap: int
) -> tuple[ServiceProcess, str]:
    """Starts ``molt-router`` on ``model`` (fp32, eager) and waits until it serves; returns it and its address."""
    from molt.core.processes import ServiceProcess, free_port

    port = free_port()
    recipe = workdir / "router.toml"
    recipe.write_text(
        f'[run]\nrun_id = "{run_id}"\nrun_dir = "{workdir / "run"}"\n'
        f'[router]\nlisten = "127.0.0.1:{port}"\nmetrics_port = 0\n'
        f'[router.engine]\nmodel_path = "{model}"\ndtype = "float32"\nmax_model_len = {context}\n'
        f"engine_args = {{ enforce_eager = true }}\n"
        f"[router.sampling]\ntemperature = {temperature}\nmax_tokens_cap = {max_tokens_cap}\n"
    )
    router = ServiceProcess(
        [sys.executable, "-m", "molt.router", "--config", str(recipe)],
        f"127.0.0.1:{port}",
        workdir / "router.log",
        env={"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"},
        service="molt.v1.RolloutService",
    )
    router.start(timeout_s=600)
    return router, f"127.0.0.1:{port}"
