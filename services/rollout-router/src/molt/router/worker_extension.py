"""Code vLLM injects into every engine worker (``worker_extension_cls`` = ``EngineWorker``): the
receiving end of a refit, and routed-expert capture (molt.router.expert_capture).

Reached with ``collective_rpc`` (the engine actor forwards the broadcaster's calls), beside the model
in the worker process: ``join_weight_group`` makes the worker a rank of the weight group
(molt.core.weightsync); ``receive_weights`` stages every bucket, checks coverage and checksums
against the manifest and only then loads through vLLM's layerwise reload, so a refused refit
leaves the old weights in place. A tied head is rebuilt from the new embedding.
docs/refit.md, "One refit, step by step", has the details.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from molt.core.weight_ipc import IpcWeightGroup, open_weight_group
from molt.core.weightsync import (
    TensorMeta,
    WeightGroup,
    check_manifest,
    manifest_from_json,
    tensor_checksum,
    wait_for_sender,
)
from molt.router.expert_capture import RoutingCapture

log = logging.getLogger(__name__)


def checkpoint_tensors(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a save_pretrained directory's safetensors files (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(entry["shape"])
    return shapes


def coverage_problems(metas: list[TensorMeta], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Why a manifest does not cover the served model exactly (empty when it does)."""
    problems: list[str] = []
    names = {m.name for m in metas}
    missing = sorted(set(expected) - names)
    unknown = sorted(names - set(expected))
    if missing:
        problems.append(f"{len(missing)} tensors missing, e.g. {missing[:3]}")
    if unknown:
        problems.append(f"{len(unknown)} tensors the engine does not serve, e.g. {unknown[:3]}")
    for meta in metas:
        shape = expected.get(meta.name)
        if shape is not None and tuple(meta.shape) != shape:
            problems.append(f"{meta.name}: shape {tuple(meta.shape)} != served {shape}")
    return problems


class WeightReceiver:
    """Mixed into vLLM's worker class; ``self.model_runner.model`` is the served model."""

    model_runner: Any
    rank: int
    device: Any

    def weight_worker_rank(self) -> int:
        """This worker's rank inside its engine (0 .. tensor_parallel_size - 1)."""
        return int(getattr(self, "rank", 0))

    def join_weight_group(
        self,
        host: str,
        port: int,
        first_rank: int,
        world_size: int,
        backend: str,
        generation: int,
        timeout_s: float,
        ready_key: str = "",
        join_timeout_s: float | None = None,
        namespace: str = "",
    ) -> int:
        """Joins the weight group as rank ``first_rank + self.rank``; blocks until every rank has joined
        (at most ``join_timeout_s`` on gloo). With ``ready_key``, first waits for the learner to be on
        its way (``wait_for_sender``)."""
        device = torch.device("cpu") if backend == "gloo" else torch.device(self.device)
        rank = first_rank + int(getattr(self, "rank", 0))
        group = open_weight_group(
            backend,
            host,
            port,
            rank,
            world_size,
            generation=generation,
            device=device,
            timeout_s=timeout_s,
            join_timeout_s=join_timeout_s,
            ready_key=ready_key,
            namespace=namespace,
        )
        old = getattr(self, "_molt_group", None)
        if old is not None:
            old.close()
        self._molt_group = group
        return rank

    def receive_weights(self, manifest_json: str, bucket_bytes: int, ready_key: str = "") -> dict[str, Any]:
        """Receives, validates and (when valid) loads one refit; returns a report (see module docstring).
        With ``ready_key``, first waits for the learner to be on its way (``wait_for_sender``)."""
        group: WeightGroup | IpcWeightGroup | None = getattr(self, "_molt_group", None)
        if group is None:
            raise RuntimeError("receive_weights before join_weight_group")
        if ready_key:
            wait_for_sender(group.store, ready_key)
        metas = manifest_from_json(manifest_json)
        check_manifest(metas)
        started = time.perf_counter()
        staged: dict[str, torch.Tensor] = {}
        bad_checksums: list[str] = []
        for meta, tensor in group.receive(metas, bucket_bytes):
            staged[meta.name] = tensor
            if tensor_checksum(tensor) != meta.checksum:
                bad_checksums.append(meta.name)
        received_s = time.perf_counter() - started
        model_dir = Path(self.model_runner.model_config.model)
        coverage = coverage_problems(metas, checkpoint_tensors(model_dir))
        report: dict[str, Any] = {
            "rank": group.rank,
            "byte_count": sum(m.nbytes for m in metas),
            "tensor_count": len(metas),
            "coverage_ok": not coverage,
            "checksums_ok": not bad_checksums,
            "problems": coverage + [f"checksum mismatch: {name}" for name in bad_checksums[:5]],
            "loaded": False,
            "receive_s": received_s,
        }
        if coverage or bad_checksums:
            log.error("refit refused, old weights kept", extra={"problems": report["problems"]})
            return report
        started = time.perf_counter()
        incomplete = self._load(staged)
        report["load_s"] = time.perf_counter() - started
        report["loaded"] = True
        if incomplete:
            report["coverage_ok"] = False
            report["problems"].append(f"layers not fully loaded: {incomplete[:5]}")
        return report

    def _load(self, staged: dict[str, torch.Tensor]) -> list[str]:
        """Loads staged tensors through vLLM's layerwise reload; returns layers that did not get every element."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            get_layerwise_info,
            initialize_layerwise_reload,
        )

        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        tied = bool(getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False))
        initialize_layerwise_reload(model)
        with torch.no_grad():
            model.load_weights(iter(staged.items()))
        incomplete = []
        for name, layer in model.named_modules():
            info = get_layerwise_info(layer)
            if tied and layer is head:
                continue
            has_params = any(True for _ in layer.parameters(recurse=False))
            if has_params and info.can_load() and info.load_numel < (info.load_numel_total or 0):
                incomplete.append(name)
        finalize_layerwise_reload(model, self.model_runner.model_config)
        _prepack_reloaded_cpu_experts(model, staged)
        if tied and head is not None and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)
        return incomplete


def _prepack_reloaded_cpu_experts(model: torch.nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    """vLLM's CPU MoE experts keep their weights prepacked for their grouped GEMM (done once, when the
    kernel is built); a reload with the kernel built copies the new weights in as loaded, unpacked, and
    the engine would compute with scrambled experts (measured: logprobs off by 0.1 after reloading the
    served weights themselves). Prepack again the expert layers this reload loaded."""
    for name, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not any(cls.__name__ == "CPUUnquantizedExperts" for cls in type(experts).__mro__):
            continue
        owner = name.removesuffix(".routed_experts") + "."  # the checkpoint names the experts under the MoE block
        if any(key.startswith(owner) for key in loaded):
            experts.process_weights_after_loading(layer)


class EngineWorker(WeightReceiver, RoutingCapture):
    """What vLLM mixes into its worker class: one ``worker_extension_cls`` carries both concerns."""
