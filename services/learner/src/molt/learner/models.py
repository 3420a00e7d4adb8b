"""Loading the learner's models: the policy, the frozen reference and teacher, the critic's body.

``load_policy`` reads a causal LM through transformers or NVIDIA AutoModel
(``resolve_backend`` picks one); ``shard`` wraps it in FSDP2 when there are
several ranks and ``compile_layers`` compiles its decoder layers, both found by
``decoder_layers`` wherever the architecture keeps them.
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


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's repeated decoder blocks, wherever the architecture keeps them (``model.layers``,
    ``transformer.h``, ...): of the ``nn.ModuleList``s whose children are all of one class with
    parameters, those of a class transformers names in ``_no_split_modules`` (when any is), the one
    holding the most parameters (so the layers win over a list of experts inside each layer).
    A ``ConfigError`` naming the model's class when there is none."""
    lists = [
        module
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        and len(module) > 0
        and len({type(child) for child in module}) == 1
        and any(True for _ in module.parameters())
    ]
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    # By the class's ancestry: FSDP2 swaps each wrapped module's class for a subclass of it.
    named = [layers for layers in lists if any(cls.__name__ in no_split for cls in type(layers[0]).__mro__)]
    candidates = named or lists
    if not candidates:
        raise ConfigError(
            f"cannot find the decoder layers of {type(model).__name__}: no nn.ModuleList of identical "
            "blocks with parameters; molt shards and compiles a causal LM one decoder layer at a time"
        )
    return max(candidates, key=lambda layers: sum(p.numel() for p in layers.parameters()))


def shard(model: PreTrainedModel, world_size: int, device: torch.device) -> None:
    """FSDP2: each decoder layer is a unit (its weights gathered only while it runs), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each decoder layer (after FSDP2 wrapped it): fewer, fused kernels and far less
    host time per step; the first steps of each new shape pay the compile (dynamic shapes after that)."""
    for layer in decoder_layers(model):
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
