"""Loading the learner's models: the policy, the frozen reference and teacher, the critic's body.

``load_policy`` reads a causal LM through transformers or NVIDIA AutoModel
(``resolve_backend`` picks one); ``shard`` wraps it in FSDP2 when there are
several ranks and ``compile_layers`` compiles its decoder layers.
``model_context`` is the longest sequence the model's config allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from molt.core.errors import ConfigError

Backend = Literal["torch", "automodel"]


def resolve_backend(requested: str, device: torch.device) -> Backend:
    """The training backend actually used. ``auto``: NVIDIA AutoModel when the device is CUDA and
    ``nemo_automodel`` imports, else transformers. ``automodel`` without either is a ``ConfigError``."""
    if requested == "torch":
        return "torch"
    problem = None
    if device.type != "cuda":
        problem = "it needs CUDA (NeMoAutoModelForCausalLM places the model on a GPU)"
    else:
        try:
            import nemo_automodel  # noqa: F401
        except ImportError as exc:
            problem = f"nemo_automodel does not import ({exc}); install the gpu extra"
    if problem is None:
        return "automodel"
    if requested == "automodel":
        raise ConfigError(f"backend 'automodel' is not available: {problem}; use 'torch' or 'auto'")
    return "torch"


def load_policy(
    path: Path, device: torch.device, *, trainable: bool, backend: Backend = "torch", dtype: str = "auto"
) -> PreTrainedModel:
    """The causal LM at ``path``, through transformers or NVIDIA AutoModel (``NeMoAutoModelForCausalLM``,
    its own implementation of the architecture, same parameter names); ``dtype`` auto: float32 on CPU,
    bfloat16 on GPU. ``trainable=False`` freezes it (reference, teacher)."""
    hf_logging.disable_progress_bar()
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    if backend == "automodel":
        from nemo_automodel import NeMoAutoModelForCausalLM

        # str: it tells a path from a config by type; torch_dtype: its own argument (it reads no dtype=).
        model = NeMoAutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch_dtype).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa").to(device)
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def shard(model: PreTrainedModel, world_size: int, device: torch.device) -> None:
    """FSDP2: each decoder layer is a unit (its weights gathered only while it runs), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each decoder layer (after FSDP2 wrapped it): fewer, fused kernels and far less
    host time per step; the first steps of each new shape pay the compile (dynamic shapes after that)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(
            f"compile = true needs the decoder layers at model.model.layers; {type(model).__name__} has none"
        )
    for layer in layers:
        layer.compile()


def model_context(config: Any) -> int | None:
    """The longest sequence the model's config allows: max_position_embeddings, times the RoPE scaling
    factor where one is set (as vLLM derives its default max_model_len); None when the config says nothing."""
    positions = getattr(config, "max_position_embeddings", None)
    if not positions:
        return None
    scaling = getattr(config, "rope_scaling", None) or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    return int(positions * factor) if isinstance(factor, int | float) and factor > 1 else int(positions)
