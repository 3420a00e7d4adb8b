"""LoRA on the policy (PEFT): only the adapters train; the engines get merged full weights.

With ``[learner.lora] rank`` above 0 the policy is wrapped in PEFT's ``LoraModel`` before it is
sharded: each targeted linear layer ``W`` gains ``B @ A`` (rank r, ``B`` zero at the start) scaled by
``alpha / r``, and only ``A`` and ``B`` get gradients and optimizer state. The KL reference is the base
model itself, scored with the adapters disabled (no second copy). A refit sends the merged weights
``W + (alpha / r) B @ A`` under the base model's names, so any engine loads them as a full refit; a
checkpoint holds the adapters only, with the base model's identity (path and content hash), and a
resume refuses another base.
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import AbstractContextManager
from pathlib import Path

from torch import Tensor, nn

from molt.core.errors import ConfigError
from molt.learner.config import LoraSettings

log = logging.getLogger(__name__)

PREFIX = "base_model.model."  # PEFT's wrapping of every name
BASE = ".base_layer."  # a targeted layer's own weights
ADAPTER = "default"  # PEFT's adapter name


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """``model`` wrapped in PEFT LoRA (in place for the base weights, which are frozen)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as exc:  # no module matched target_modules, or one PEFT cannot adapt
        raise ConfigError(f"[learner.lora] target_modules {settings.target_modules}: {exc}") from exc
    from peft.tuners.lora import Linear, LoraLayer

    odd = [name for name, m in wrapped.named_modules() if isinstance(m, LoraLayer) and not isinstance(m, Linear)]
    if odd:  # an embedding or convolution adapter: merged_state merges linear layers only
        raise ConfigError(f"[learner.lora] target_modules may name linear layers only; {odd[:3]} are not")
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    log.info("LoRA adapters on the policy", extra={"trainable": trainable, "parameters": total})
    return wrapped


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def adapter_names(state: dict[str, Tensor]) -> list[str]:
    return [name for name in state if ".lora_" in name]


def merged_state(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The base model's state under its own names, each adapted weight merged: ``W + scale * B @ A``.
    ``state``: the PEFT model's full state dict (as gathered for a refit)."""
    from peft.tuners.lora import LoraLayer

    scales = {name: module.scaling[ADAPTER] for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    merged: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        if BASE in name:
            module = name[: name.index(BASE)]
            if name.endswith(".weight"):
                a = state[f"{module}.lora_A.{ADAPTER}.weight"]
                b = state[f"{module}.lora_B.{ADAPTER}.weight"]
                scale = scales[module]  # FSDP2 keeps the module names the state dict uses
                tensor = (tensor.float() + scale * (b.float() @ a.float())).to(tensor.dtype)
            name = name.replace(BASE, ".")
        merged[name.removeprefix(PREFIX)] = tensor
    return merged


def base_identity(path: Path) -> dict[str, str]:
    """The base model's path and a SHA-256 over its config and weight files (names and bytes)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".bin")):
        if file.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            continue  # the tokenizer and sampling defaults do not change the weights
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return {"path": str(path), "sha256": digest.hexdigest()}


def check_base(saved: dict[str, str] | None, current: dict[str, str], checkpoint: Path) -> None:
    """Refuses to put adapters on another base model than the one they were trained on."""
    if saved is None:
        raise ConfigError(f"{checkpoint} holds no LoRA adapters: it was written without [learner.lora]")
    if saved["sha256"] != current["sha256"]:
        raise ConfigError(
            f"{checkpoint}'s adapters were trained on {saved['path']} (sha256 {saved['sha256'][:12]}), and the "
            f"model_path {current['path']} is another model (sha256 {current['sha256'][:12]})"
        )


def disabled(model: nn.Module) -> AbstractContextManager[None]:
    """The adapters off for the block: the base model, the KL reference."""
    return model.disable_adapter()  # type: ignore[operator,no-any-return]
