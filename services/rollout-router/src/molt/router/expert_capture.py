"""Routed-expert capture inside a vLLM engine worker on the V1 model runner (the CPU build's path).

vLLM's native capture needs Model Runner V2, which the CPU build lacks; this records the same ids
through the hook vLLM's MoE routers already carry (``BaseRouter.set_capture_fn``, bound by vLLM's own
``bind_routed_experts_capturer``). Each engine step, every MoE layer hands over its top-k ids for the
step's token rows; when the step's forward is done the rows are mapped to (request, position) through
the model runner's batch layout and kept per request. ``take_routing`` assembles a request's routing
``[tokens, layers, top_k]`` int16 and forgets it. Rules (docs/moe.md, "Engine capture"): a position's
first computation wins (a recompute after preemption or a refit never overwrites it), a position no
forward computed is ``-1`` (so the learner routes it itself), and the last token's row is always ``-1``.
Refused: prefix caching (a prompt token served from the cache has no forward to capture) and a
compiled engine (vLLM traced the CPU MoE block into its graph before the hook existed).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

# Finished requests whose routing nobody took are forgotten oldest first beyond this many, so an
# engine whose caller never asks (aborted requests, a crashed router) does not grow without bound.
KEPT_FINISHED = 4096


@dataclass
class RequestRouting:
    """The rows captured for one request, in step order: ``(positions [n], ids [n, layers, top_k])``."""

    chunks: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    def assemble(self, token_count: int, layers: int, top_k: int) -> tuple[np.ndarray, int]:
        """``[token_count, layers, top_k]`` int16, the first computation of each position, ``-1`` where
        none was captured and on the last row; with the number of rows before the last left ``-1``."""
        routing = np.full((token_count, layers, top_k), -1, dtype=np.int16)
        filled = np.zeros(token_count, dtype=bool)
        for positions, ids in self.chunks:
            inside = positions < token_count
            fresh = inside.copy()
            fresh[inside] = ~filled[positions[inside]]
            routing[positions[fresh]] = ids[fresh]
            filled[positions[fresh]] = True
        if token_count:
            # Sampled but never fed to the model (or fed only by a step scheduled ahead of the finish
            # under async scheduling): undefined either way, and no loss reads the logits after it.
            routing[-1] = -1
            filled[-1] = True
        return routing, int((~filled).sum())


class RoutingRecorder:
    """The capture state of one worker: ``capture`` is each MoE layer's callback, ``begin`` and
    ``commit`` bracket one ``execute_model`` of the model runner."""

    def __init__(self, layers: int, top_k: int, kept_finished: int = KEPT_FINISHED) -> None:
        self.layers = layers
        self.top_k = top_k
        self.kept_finished = kept_finished
        self.step: dict[int, torch.Tensor] | None = None  # layer -> ids of the open step's rows
        self.requests: dict[str, RequestRouting] = {}
        self.finished: deque[str] = deque()
        self.forgotten = 0
        self.experts = 0  # experts per MoE layer (0: not known)

    def shape(self) -> dict[str, int]:
        return {"layers": self.layers, "top_k": self.top_k, "experts": self.experts}

    def begin(self) -> None:
        self.step = {}

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        """One layer's ``[rows, top_k]`` ids; ignored outside a step (warm-up and profiling forwards)."""
        if self.step is not None:
            self.step[layer] = topk_ids.to(torch.int16, copy=True)

    def commit(self, req_ids: list[str], counts: list[int], positions: np.ndarray, finished: set[str]) -> None:
        """Closes the step: its first ``sum(counts)`` rows belong to ``req_ids`` in order, ``counts[i]``
        rows each, at ``positions``; then marks ``finished`` requests for eviction order."""
        step, self.step = self.step, None
        rows = int(sum(counts))
        if step and rows:
            ids = np.full((rows, self.layers, self.top_k), -1, dtype=np.int16)
            for layer, layer_ids in step.items():
                ids[:, layer] = layer_ids[:rows].cpu().numpy()  # a device tensor on a GPU
            start = 0
            for req_id, count in zip(req_ids, counts, strict=True):
                if count:
                    chunk = (positions[start : start + count].copy(), ids[start : start + count])
                    self.requests.setdefault(req_id, RequestRouting()).chunks.append(chunk)
                start += count
        for req_id in finished:
            if req_id in self.requests:
                self.finished.append(req_id)
        while len(self.finished) > self.kept_finished:
            if self.requests.pop(self.finished.popleft(), None) is not None:
                self.forgotten += 1

    def take(self, token_counts: dict[str, int]) -> dict[str, dict[str, Any]]:
        """The routing of each request (by the id given to vLLM) with its token count, as
        ``{"shape", "data" (int16 little-endian bytes), "missing"}``; forgets what it returns. A request
        with nothing captured is absent from the answer."""
        by_external = {external_id(req_id): req_id for req_id in self.requests}
        answer: dict[str, dict[str, Any]] = {}
        for request_id, token_count in token_counts.items():
            req_id = by_external.get(request_id, request_id)
            record = self.requests.pop(req_id, None)
            if record is None:
                continue
            routing, missing = record.assemble(token_count, self.layers, self.top_k)
            answer[request_id] = {
                "shape": list(routing.shape),
                "data": routing.astype("<i2").tobytes(),
                "missing": missing,
            }
        return answer


def external_id(req_id: str) -> str:
    """The id the caller gave vLLM: the engine core's id less the ``-<8 random chars>`` vLLM appends."""
    head, sep, tail = req_id.rpartition("-")
    return head if sep and len(tail) == 8 else req_id


def routing_array(entry: dict[str, Any]) -> np.ndarray:
    """``take_routing``'s answer for one request as ``[tokens, layers, top_k]`` int16."""
    return np.frombuffer(entry["data"], dtype="<i2").reshape(entry["shape"])


class RoutingCapture:
    """Mixed into vLLM's worker class (``EngineWorker``); ``self.model_runner`` is the V1 model runner."""

    model_runner: Any

    def start_routing_capture(self) -> dict[str, int]:
        """Binds the recorder to every MoE router and wraps ``execute_model``; idempotent. Refuses a
        model without MoE routers (vLLM's binder raises) and prefix caching (module docstring)."""
        if getattr(self, "_molt_routing", None) is not None:
            return self._molt_routing.shape()
        from vllm.config import CompilationMode

        runner = self.model_runner
        if runner.cache_config.enable_prefix_caching:
            raise ValueError(
                "routed-expert capture needs prefix caching off: prompt tokens served from the cache run "
                "no forward, so their routing would be missing; set enable_prefix_caching=False"
            )
        if runner.compilation_config.mode != CompilationMode.NONE:
            # On CPU vLLM traces the MoE block into the compiled graph (no opaque op as on GPU), so a
            # hook bound after start-up is never called; in eager mode the router's Python runs.
            raise ValueError(
                f"routed-expert capture needs an eager engine (enforce_eager=True); compilation mode is "
                f"{runner.compilation_config.mode.name}, whose graph was traced without the capture hook"
            )
        if runner.speculative_config is not None:
            raise ValueError("routed-expert capture does not handle speculative decoding; turn it off")
        config = runner.model_config
        recorder = RoutingRecorder(config.get_total_num_hidden_layers(), _top_k(config))
        recorder.experts = config.get_num_experts()
        _bind(runner.model, recorder)
        execute = runner.execute_model

        def execute_and_record(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            recorder.begin()
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                _commit(recorder, runner, scheduler_output)

        runner.execute_model = execute_and_record
        self._molt_routing = recorder
        return recorder.shape()

    def take_routing(self, token_counts: dict[str, int]) -> dict[str, dict[str, Any]]:
        """``RoutingRecorder.take`` of this worker's capture (``start_routing_capture`` first)."""
        recorder: RoutingRecorder | None = getattr(self, "_molt_routing", None)
        if recorder is None:
            raise RuntimeError("take_routing before start_routing_capture")
        return recorder.take(token_counts)


def _top_k(config: Any) -> int:
    """Experts per token: ``ModelConfig.get_num_experts_per_tok`` where vLLM has it (0.32), else the HF
    config's own attribute (vLLM 0.26, the GPU image's)."""
    if hasattr(config, "get_num_experts_per_tok"):
        return int(config.get_num_experts_per_tok())
    hf = config.hf_text_config
    top_k = getattr(hf, "num_experts_per_tok", None) or getattr(hf, "top_k_experts", None)
    if not top_k:
        raise ValueError(f"cannot tell experts per token from {type(hf).__name__}: no num_experts_per_tok")
    return int(top_k)


def _bind(model: Any, recorder: RoutingRecorder) -> None:
    """Hands ``recorder.capture`` to every MoE router: through vLLM's ``bind_routed_experts_capturer``
    (0.32, which also knows monolithic kernels), else (0.26) the way that version's GPU model runner
    binds its own capturer: each ``MoERunner``'s ``BaseRouter.set_capture_fn``."""
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer
    except ImportError:
        bind_routed_experts_capturer = None
    if bind_routed_experts_capturer is not None:
        bind_routed_experts_capturer(model, recorder)
        return
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    bound = 0
    for module in model.modules():
        if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
            module.router.set_capture_fn(partial(recorder.capture, module.layer_id))
            bound += 1
    if not bound:
        raise ValueError("routed-expert capture found no MoE router to bind in this model")


def _commit(recorder: RoutingRecorder, runner: Any, scheduler_output: Any) -> None:
    """The step's batch layout as the model runner laid it out (``GPUModelRunner._prepare_inputs``):
    the requests of ``input_batch`` in order, each with its scheduled tokens as contiguous rows, at the
    positions the forward used (``runner.positions``)."""
    req_ids = list(runner.input_batch.req_ids)
    scheduled = scheduler_output.num_scheduled_tokens
    counts = [int(scheduled.get(req_id, 0)) for req_id in req_ids]
    rows = sum(counts)
    if rows != scheduler_output.total_num_scheduled_tokens:  # no forward ran (or an unknown layout)
        recorder.step = None
        counts, rows = [0] * len(req_ids), 0
    # The runner's positions live on its device (a GPU runner's on the GPU): one small copy a step.
    positions = runner.positions[:rows].cpu().numpy() if rows else np.empty(0, dtype=np.int64)
    recorder.commit(req_ids, counts, positions, set(scheduler_output.finished_req_ids))
