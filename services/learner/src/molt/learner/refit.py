"""The learner's side of a refit: gather full weights, send the manifest, broadcast the buckets.

``WeightPublisher`` is the loop's ``on_step`` hook (rank 0). On a refit step it
gathers the full tensors (``gather_for_refit``, a collective the followers join),
scores the probe, asks the weight-broadcaster to refit (``RefitWeights``, in a
thread: it returns after validation), waits in the group's store for the go, joins
the weight group when its generation changed and broadcasts the buckets as rank 0.
With ``refit_overlap`` everything after the gather runs in the background on a
snapshot, one refit in flight at a time; a failed refit raises at the latest one
step later, so the loop stops rather than train on while the engines serve other
weights. Names are the HF checkpoint's; a tied ``lm_head.weight`` is not sent.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any
from uuid import uuid4

import grpc
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from molt.core.auth import Access, store_namespace
from molt.core.errors import Unavailable
from molt.core.serve import KEEPALIVE
from molt.core.weight_ipc import IpcWeightGroup, open_weight_group
from molt.core.weightsync import TensorMeta, WeightGroup, open_store, refit_keys
from molt.learner.config import LearnerSettings
from molt.learner.lora import is_lora, merged_state
from molt.learner.refit_faults import RefitFault, with_faults
from molt.v1 import weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)

PROBE_SEED = 1234


def probe_token_ids(vocab_size: int, length: int) -> list[int]:
    """The fixed probe sequence (seeded, so every rank and every refit uses the same one)."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def gather_for_refit(model: nn.Module, probe: list[int]) -> tuple[dict[str, Tensor], list[float]]:
    """Full tensors (rank 0; empty elsewhere) and the probe logprobs; every rank must call it."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_lora(model):  # the engines get the base model's names, each adapted weight merged
        state = merged_state(model, state) if state else state
        model_for_names = model.get_base_model()
    else:
        model_for_names = model
    config = getattr(model_for_names, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    if state and isinstance(model_for_names, PreTrainedModel):
        # The checkpoint's names and layout, which the engine loads: transformers fuses some tensors
        # in memory (an MoE block's experts into 3-D gate_up_proj / down_proj) and splits them on save.
        state = revert_weight_conversion(model_for_names, state)
    if len(probe) < 2:
        return state, []
    device = next(model.parameters()).device
    ids = torch.tensor([probe], device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    model.train(was_training)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return state, logprobs.cpu().tolist()


def snapshot(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """``state`` with every tensor that shares memory with ``model`` copied (on one CPU rank the full
    state dict holds the live parameters, which the next optimizer step would change mid-send)."""
    live = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    return {name: t.clone() if t.untyped_storage().data_ptr() in live else t for name, t in state.items()}


class WeightPublisher:
    """Rank 0's refit client (see the module docstring)."""

    def __init__(self, settings: LearnerSettings, vocab_size: int, faults: Sequence[RefitFault] = ()) -> None:
        self.settings = settings
        self.faults = tuple(faults)  # on purpose, for tests and gates only (refit_faults)
        access = Access.of(settings.run)
        self.namespace = store_namespace(access.token)  # the weight group's keys (molt.core.auth)
        self.channel = access.channel(
            settings.broadcaster_address, [("grpc.max_send_message_length", 64 * 1024 * 1024), *KEEPALIVE]
        )
        self.stub = weights_pb2_grpc.WeightServiceStub(self.channel)
        self.probe = probe_token_ids(vocab_size, settings.refit_probe_tokens)
        self.group: WeightGroup | IpcWeightGroup | None = None
        self.generation = -1
        self.calls = ThreadPoolExecutor(1, thread_name_prefix="refit")
        self.store: dist.TCPStore | None = None
        self.host = ""
        self.port = 0
        self.last_report: weights_pb2.RefitReport | None = None
        self.refits = 0  # started by this process through __call__
        self.in_flight: Future[weights_pb2.RefitWeightsResponse] | None = None
        self.sender = ThreadPoolExecutor(1, thread_name_prefix="refit-send")
        # In every request id: a restarted learner may send a version again that an earlier one of the run
        # sent (its refit cut short), and the broadcaster keeps ids (answers, the group store's go key).
        self.nonce = uuid4().hex[:8]

    def next_probe(self) -> list[int]:
        """The probe tokens of the next refit: every ``refit_probe_every``-th one, the first included."""
        return self.probe if self.refits % self.settings.refit_probe_every == 0 else []

    def wait(self) -> None:
        """Returns once the refit in flight (if any) is published; raises what it raised."""
        pending, self.in_flight = self.in_flight, None
        if pending is not None:
            pending.result()

    def register(self) -> None:
        try:
            reply = self.stub.RegisterWeightEndpoint(
                weights_pb2.RegisterWeightEndpointRequest(
                    endpoint_id="learner", role=weights_pb2.ENDPOINT_ROLE_LEARNER, worker_count=1
                ),
                timeout=60,
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            raise Unavailable(f"weight-broadcaster at {self.settings.broadcaster_address}: {exc}") from exc
        self.host, port = reply.rendezvous_address.rsplit(":", 1)
        self.port = int(port)
        self.store = open_store(self.host, self.port, timedelta(seconds=60), self.namespace)
        log.info("registered with the weight-broadcaster", extra={"rendezvous": reply.rendezvous_address})

    def wants(self, step: int) -> bool:
        """Every ``refit_every`` steps, and at the run's last step (``max_steps``), so that the engines end
        up serving the weights the run trained, not those of the last multiple of ``refit_every``."""
        every, last = self.settings.refit_every, self.settings.max_steps
        return every > 0 and (step % every == 0 or step == last)

    def __call__(self, step: int, model: nn.Module, version: int | None = None) -> None:
        """Publishes ``model``'s weights as those of ``step`` at ``version`` (default ``step``) when
        ``wants(step)``; in the background with ``refit_overlap``."""
        if not self.wants(step):
            return
        state, probe_logprobs, probe = self._gather(model)
        if not self.settings.refit_overlap:
            self.publish(step, state, probe_logprobs, probe=probe, version=version)
            return
        self.in_flight = self.sender.submit(
            self._publish_aside, step, snapshot(state, model), probe_logprobs, probe, version
        )

    def publish_first(self, step: int, version: int, model: nn.Module) -> int:
        """The learner's first refit after it starts (synchronous): ``model``'s weights as ``version``,
        or, when the engines are at that version or past it, as the one after theirs; returns the
        version published."""
        state, probe_logprobs, probe = self._gather(model)
        deadline = time.monotonic() + self.settings.refit_timeout_s
        while True:
            try:
                response = self.publish(
                    step, state, probe_logprobs, probe=probe, version=version, continue_versions=True
                )
                return response.policy_version.version
            except grpc.RpcError as exc:
                # UNAVAILABLE comes before anything moved (no router or engine yet, started by hand out of
                # order): wait for them. Anything else is the refit's failure.
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                log.warning("the first refit cannot run yet, retrying in 2 s: %s", exc.details())
                time.sleep(2.0)

    def _gather(self, model: nn.Module) -> tuple[dict[str, Tensor], list[float] | None, list[int]]:
        """After the refit in flight: the full weights, the probe's logprobs (None when this refit runs
        no probe) and the probe tokens; counts the refit."""
        self.wait()
        probe = self.next_probe()
        self.refits += 1
        state, probe_logprobs = gather_for_refit(model, probe)
        return state, probe_logprobs if probe else None, probe

    def _publish_aside(
        self,
        step: int,
        state: dict[str, Tensor],
        probe_logprobs: list[float] | None,
        probe: list[int],
        version: int | None,
    ) -> weights_pb2.RefitWeightsResponse:
        """``publish`` in the sender thread. On a GPU its copies and NCCL waits go on a stream of their
        own: on the default stream they would hold back the training kernels queued behind them."""
        if not torch.cuda.is_available():
            return self.publish(step, state, probe_logprobs, probe=probe, version=version)
        with torch.cuda.stream(torch.cuda.Stream()):
            return self.publish(step, state, probe_logprobs, probe=probe, version=version)

    @staticmethod
    def manifest(state: dict[str, Tensor]) -> list[TensorMeta]:
        """What a refit announces for ``state``: names, dtypes, shapes and checksums, in send order."""
        return [TensorMeta.of(name, tensor) for name, tensor in state.items()]

    def publish(
        self,
        step: int,
        state: dict[str, Tensor],
        probe_logprobs: list[float] | None,
        probe: list[int] | None = None,
        version: int | None = None,
        continue_versions: bool = False,
    ) -> weights_pb2.RefitWeightsResponse:
        """One refit of ``state`` as the weights of ``step`` at policy ``version`` (default ``step``);
        returns the broadcaster's response.

        ``probe_logprobs`` score ``probe`` (default ``self.probe``); None runs no probe.
        ``continue_versions``: a first refit after the learner started (see the broadcaster's
        ``RefitWeightsRequest``). The faults given for ``version`` apply here (``refit_faults``).

        A broadcaster that goes away (its call UNAVAILABLE, its store's connection lost) is waited for up
        to ``refit_timeout_s``: a restarted one has a new store and group, so this learner registers
        again and sends the whole refit again."""
        deadline = time.monotonic() + self.settings.refit_timeout_s
        while True:
            try:
                return self._publish_once(step, state, probe_logprobs, probe, version, continue_versions)
            except (grpc.RpcError, dist.DistError, Unavailable) as exc:
                code = exc.code() if isinstance(exc, grpc.RpcError) else None
                if code not in (None, grpc.StatusCode.UNAVAILABLE) or time.monotonic() > deadline:
                    raise
                log.warning(
                    "the refit could not reach the broadcaster or the engines; retrying in 2 s: %s", _first_line(exc)
                )
                self._forget_broadcaster()
                time.sleep(2.0)

    def _forget_broadcaster(self) -> None:
        """Drops the store and group of a broadcaster that went away (the next publish registers again),
        and takes new request ids: one the broadcaster saw fail must not be answered from its memory."""
        if self.group is not None:
            self.group.close()
        self.group, self.store, self.generation = None, None, -1
        self.nonce = uuid4().hex[:8]

    def _publish_once(
        self,
        step: int,
        state: dict[str, Tensor],
        probe_logprobs: list[float] | None,
        probe: list[int] | None,
        version: int | None,
        continue_versions: bool,
    ) -> weights_pb2.RefitWeightsResponse:
        if self.store is None:
            self.register()
        started = time.perf_counter()
        version = step if version is None else version
        metas, state = with_faults(self.faults, version, self.manifest(state), state)
        request = self._request(step, version, metas, probe_logprobs, probe, continue_versions)
        call = self.calls.submit(self.stub.RefitWeights, request, timeout=self.settings.refit_timeout_s)
        go = self._wait_for_go(request.request_id, call)
        group = self._join(go)
        try:
            group.send(metas, state, go["bucket_bytes"])
        except RuntimeError as exc:  # gloo or NCCL: a receiver went away (its engine died with its router)
            self.generation = -1  # the group is broken; the broadcaster rebuilds it next time
            raise Unavailable(f"the weight group broke during the send: {exc}") from exc
        except Exception:
            self.generation = -1
            raise
        response: weights_pb2.RefitWeightsResponse = call.result()
        self.last_report = response.report
        log.info(
            "refit done",
            extra={
                "step": step,
                "version": response.policy_version.version,
                "bytes": response.report.byte_count,
                "seconds": round(time.perf_counter() - started, 3),
            },
        )
        return response

    def _request(
        self,
        step: int,
        version: int,
        metas: list[TensorMeta],
        probe_logprobs: list[float] | None,
        probe: list[int] | None,
        continue_versions: bool,
    ) -> weights_pb2.RefitWeightsRequest:
        """The ``RefitWeights`` request: the manifest, the bucket size and the probe."""
        # A first-kind refit may come again in one process (StaleWatch): each has its own id, or the
        # broadcaster would answer it from memory while the learner joins a group nobody receives on.
        kind = f"first{self.refits}" if continue_versions else f"v{version}"
        request_id = f"{self.settings.run.run_id}-{self.nonce}-{kind}"
        return weights_pb2.RefitWeightsRequest(
            request_id=request_id,
            learner_step=step,
            policy_version=version,
            continue_versions=continue_versions,
            tensors=[
                weights_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=list(m.shape), checksum=m.checksum)
                for m in metas
            ],
            bucket_bytes=self.settings.refit_bucket_bytes,
            run_probe=probe_logprobs is not None,
            probe_token_ids=(self.probe if probe is None else probe) if probe_logprobs is not None else [],
            probe_logprobs=probe_logprobs or [],
        )

    def _wait_for_go(self, request_id: str, call: Future[weights_pb2.RefitWeightsResponse]) -> dict[str, Any]:
        """Waits in the group's store for the broadcaster's go (or for the call to fail first), then
        writes the ready key; returns the go (generation, world size, backend, bucket bytes)."""
        assert self.store is not None
        key, ready_key = refit_keys(request_id)
        while True:
            if call.done():  # failed before the go (e.g. the router could not pause)
                call.result()
                raise Unavailable(f"refit {request_id} ended before the broadcaster gave the go")
            try:
                self.store.wait([key], timedelta(seconds=1))
                break
            except (RuntimeError, dist.DistStoreError):
                continue
        go: dict[str, Any] = json.loads(self.store.get(key))
        self.store.set(ready_key, b"1")  # the engine workers block on the group only once this is written
        return go

    def _join(self, go: dict[str, Any]) -> WeightGroup | IpcWeightGroup:
        """The weight group of the go's generation: the current one, or a new one joined as rank 0."""
        if go["generation"] != self.generation:
            if self.group is not None:
                self.group.close()
            device = (
                torch.device("cuda", torch.cuda.current_device()) if go["backend"] != "gloo" else torch.device("cpu")
            )
            self.group = open_weight_group(
                go["backend"],
                self.host,
                self.port,
                0,
                go["world_size"],
                generation=go["generation"],
                device=device,
                timeout_s=self.settings.refit_timeout_s,
                # Twice the engine workers' bound: they may still be in the rendezvous of a learner that
                # died joining (for up to theirs) when this one starts waiting for them.
                join_timeout_s=2 * go["join_timeout_s"],
                namespace=self.namespace,
            )
            self.generation = go["generation"]
        assert self.group is not None
        return self.group

    def close(self) -> None:
        if self.in_flight is not None:
            self.in_flight.cancel()
        self.sender.shutdown(wait=True)
        if self.group is not None:
            self.group.close()
        self.calls.shutdown(wait=False)
        self.channel.close()


def _first_line(exc: BaseException) -> str:
    text = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)  # type: ignore[attr-defined]
    return (text or type(exc).__name__).splitlines()[0]
