"""One inference engine: vLLM's AsyncLLM inside a Ray actor, tokens in, tokens + logprobs + version out.

Every token handed out carries the policy version of the weights that sampled
it, read from the engine core's labels (``molt.router.versioned_chunks``).
Requests, aborts and outputs travel over the engine's data channel
(``molt.router.data_channel``); this module holds the engine's end of it: one
router connected at a time, its operations handed to the requests here, the
outputs sent back in one frame per pass of the event loop. Ray carries the
control calls (start, pause, resume, probe, the weight refit).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import pickle
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal
from uuid import uuid4

from molt.core.stallwatch import StallWatch
from molt.router import vllm_wait
from molt.router.data_channel import (
    SECRET_TIMEOUT_S,
    ChannelAddress,
    Chunk,
    Failure,
    Operation,
    Output,
    Submission,
    frame,
    keep_alive,
    read_frame,
)
from molt.router.engine_routing import EngineRouting
from molt.router.engine_spec import EngineInfo, EngineSpec
from molt.router.sampling import Sampling, vllm_params
from molt.router.version_counts import UTILITY, CountedVersions
from molt.router.versioned_chunks import chunks_of, token_versions

log = logging.getLogger(__name__)

WORKER_EXTENSION = "molt.router.worker_extension.EngineWorker"


@dataclass(frozen=True)
class Running:
    """A request the engine is serving, and the router connection that submitted it."""

    task: asyncio.Task[None]
    sample_count: int
    owner: asyncio.StreamWriter


class EngineActor:
    """The body of the engine actor (wrapped with ``ray.remote`` by ``molt.router.engine_launch``)."""

    def __init__(self, spec: EngineSpec, policy_version: int = 0) -> None:
        self.spec = spec
        self.policy_version = policy_version
        self.llm: Any = None
        self.tasks: dict[str, Running] = {}
        self.paused = False
        self.outbox: list[Output] = []
        self.ready = asyncio.Event()  # the outbox has something and a router is connected
        self.address: ChannelAddress | None = None
        self.server: asyncio.Server | None = None
        self.writer: asyncio.StreamWriter | None = None  # the connected router's end of the channel
        self.flusher: asyncio.Task[None] | None = None
        self.opening = asyncio.Lock()  # two ``channel`` calls at once open one server
        self.stall_watch: StallWatch | None = None
        self.counted: CountedVersions | None = None  # versions from token counts (a vLLM without labels)
        self.routing: EngineRouting | None = None  # routed-expert capture (molt.router.engine_routing)
        self.refits_loaded = 0  # refits whose weights every worker loaded and validated (the router asks)

    async def start(self) -> EngineInfo:
        """Builds the vLLM engine (it loads the model, which takes a while); idempotent."""
        if self.llm is None:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            # Read by molt's vLLM plugin in the engine core and worker processes vLLM is about to start.
            os.environ[vllm_wait.ENV] = self.spec.wait
            args = AsyncEngineArgs(
                model=str(self.spec.model_path),
                tensor_parallel_size=self.spec.tensor_parallel_size,
                max_model_len=self.spec.max_model_len,
                gpu_memory_utilization=self.spec.gpu_memory_utilization,
                seed=self.spec.seed,
                dtype=self.spec.dtype,  # type: ignore[arg-type]
                stream_interval=self.spec.stream_interval,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=WORKER_EXTENSION,
                **self.spec.engine_args,
            )
            self.llm = AsyncLLM.from_engine_args(args)
            self._choose_version_source()
            if self.spec.routing_capture:
                self.routing = await EngineRouting.start(self.llm, self.spec.engine_id)
            await self._label(self.policy_version)
            if self.stall_watch is None:  # after the build, which blocks this loop on purpose (imports, load)
                self.stall_watch = StallWatch(f"engine actor {self.spec.engine_id}")
                self.stall_watch.start()
        config = self.llm.model_config
        return EngineInfo(
            self.spec.engine_id,
            config.get_vocab_size(),
            config.max_model_len,
            policy_version=self.policy_version,
            paused=self.paused,
        )

    def _choose_version_source(self) -> None:
        """Labels where the engine core has them (``versioned_chunks``), else counts (``version_counts``)."""
        labels = hasattr(self.llm.engine_core, "set_weight_version_async")
        source = self.spec.version_source
        if source == "labels" and not labels:
            raise RuntimeError("version_source = 'labels', but this vLLM has no weight-version labels; use 'auto'")
        if source == "counts" or not labels:
            self.counted = CountedVersions()
            log.info("token versions from engine-side token counts", extra={"engine": self.spec.engine_id})

    async def channel(self) -> ChannelAddress:
        """Opens the data channel (once) on this node's address and returns where it listens. A router
        that connects replaces an earlier one (a restarted router attaching to a detached engine); the
        requests of a router whose connection closed are aborted, and their outputs dropped: nobody is
        left to read them, and a new router may reuse their ids."""
        async with self.opening:
            if self.address is None:
                import ray

                host = ray.util.get_node_ip_address()
                self.server = await asyncio.start_server(self._serve, host, 0)
                port = self.server.sockets[0].getsockname()[1]
                self.address = ChannelAddress(host, port, secrets.token_bytes(32))
                self.flusher = asyncio.create_task(self._flush())
            return self.address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.address is not None
        authenticated = False
        try:
            # Nothing is unpickled, and nothing larger than the secret read, before the secret matched.
            secret = await asyncio.wait_for(read_frame(reader, max_bytes=len(self.address.token)), SECRET_TIMEOUT_S)
            if not hmac.compare_digest(secret, self.address.token):
                raise ConnectionError("wrong secret")
            authenticated = True
            keep_alive(writer)
            if (old := self.writer) is not None:  # a newer router replaces the old one, which may be gone
                old.transport.abort()  # at once, unsent bytes dropped (close() would wait for them)
                self._drop_orphans(old)
            self.writer = writer
            self.outbox.clear()  # what it holds was for an earlier router
            while True:
                operations: list[Operation] = pickle.loads(await read_frame(reader))
                for operation in operations:
                    if self.writer is not writer:  # replaced while this frame was read
                        return
                    if operation[0] == "submit":
                        self._start(operation[1], writer)
                    else:
                        await self._abort(operation[1], writer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
            if not authenticated:
                peer = str(writer.get_extra_info("peername"))
                log.warning(
                    "data channel: closed a connection that lacked the secret", extra={"peer": peer, "error": repr(exc)}
                )
        except Exception:
            log.exception("data channel: a frame the engine could not take; the connection is closed")
        finally:
            if self.writer is writer:
                self.writer = None
            writer.close()
            if authenticated:
                self._drop_orphans(writer)

    def _drop_orphans(self, owner: asyncio.StreamWriter) -> None:
        """Cancels the requests ``owner`` submitted (vLLM's generator aborts them as it closes)."""
        orphans = [request_id for request_id, running in self.tasks.items() if running.owner is owner]
        for request_id in orphans:
            self.tasks.pop(request_id).task.cancel()
        if orphans:
            log.warning(
                "data channel: a router left; its requests are aborted",
                extra={"engine": self.spec.engine_id, "requests": len(orphans)},
            )

    async def _abort(self, request_id: str, owner: asyncio.StreamWriter) -> None:
        """Aborts ``owner``'s request: through vLLM when vLLM has it (its stream then ends with finish
        "abort"), else by cancelling its task before it gets there (vLLM ignores an abort of an id it
        does not know yet, and the request would run to its end), ending each sample with an "abort" chunk."""
        running = self.tasks.get(request_id)
        if running is None or running.owner is not owner:
            return
        if self.llm.output_processor.external_req_ids.get(request_id):
            await self.llm.abort(request_id)
            return
        del self.tasks[request_id]
        running.task.cancel()
        for index in range(running.sample_count):
            self._emit((request_id, Chunk(index, [], [], self.policy_version, [], "abort", "")))

    def _start(self, s: Submission, owner: asyncio.StreamWriter) -> None:
        if s.request_id in self.tasks:
            message = f"request {s.request_id!r} is already running on {self.spec.engine_id}"
            self._emit((s.request_id, Failure(message, refused=True)))
            return
        task = asyncio.create_task(self._run(s.request_id, s.prompt_token_ids, s.sampling, s.final_only, owner))
        self.tasks[s.request_id] = Running(task, s.sampling.sample_count, owner)

    async def _flush(self) -> None:
        """Sends the outbox to the connected router, everything produced since the last send in one frame."""
        while True:
            await self.ready.wait()
            self.ready.clear()
            writer = self.writer
            if writer is None or not self.outbox:
                continue  # kept until a router connects
            outputs, self.outbox = self.outbox, []
            try:
                writer.write(frame(pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL)))
                await writer.drain()
            except OSError:
                writer.close()  # that router is gone, and with it whoever waited for these outputs
            except Exception:  # never stop sending for the next router
                log.exception("data channel: outputs the engine could not send; the connection is closed")
                writer.close()

    def _emit(self, output: Output) -> None:
        self.outbox.append(output)
        if self.writer is not None:
            self.ready.set()

    async def _run(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: Sampling,
        final_only: bool,
        owner: asyncio.StreamWriter,
    ) -> None:
        try:
            async for chunk in self.generate(request_id, prompt_token_ids, sampling, final_only):
                if owner is self.writer:  # else its router has left (the task is being cancelled)
                    self._emit((request_id, chunk))
        except Exception as exc:  # reported to the router as this request's failure, not swallowed
            log.exception("request failed in the engine", extra={"request_id": request_id})
            if owner is self.writer:
                self._emit((request_id, Failure(f"{type(exc).__name__}: {exc}")))
        finally:
            running = self.tasks.get(request_id)
            if running is not None and running.task is asyncio.current_task():  # not a newer one of the same id
                del self.tasks[request_id]
                if self.counted is not None:
                    self.counted.forget(request_id)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Sampling, final_only: bool = False
    ) -> AsyncIterator[Chunk]:
        """Streams the request's samples as chunks; aborting the request ends the stream.
        ``final_only``: each sample once, finished (``sampling.vllm_params``)."""
        from vllm.inputs import TokensPrompt

        params = vllm_params(sampling, final_only)
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        sent = [0] * sampling.sample_count  # tokens handed out so far, per sample
        if self.counted is not None:
            self.counted.begin(request_id, sampling.sample_count, self.policy_version)
        # Closing vLLM's generator early (a cancel, an error here) makes it abort the request by vLLM's
        # own id; an abort by ours could hit a newer request that reuses it.
        async with contextlib.aclosing(self.llm.generate(prompt, params, request_id)) as outputs:
            async for output in outputs:
                for completion in output.outputs:
                    if completion.token_ids or completion.finish_reason is not None:
                        index = completion.index
                        versions = self._versions(request_id, completion, sent[index])
                        sent[index] += len(completion.token_ids)
                        chunks = chunks_of(completion, versions, sampling.top_logprob_count, self.policy_version)
                        if completion.finish_reason is not None and self.routing is not None:
                            routing = await self.routing.take(
                                self.llm, request_id, index, sampling.sample_count, len(prompt_token_ids) + sent[index]
                            )
                            chunks[-1] = dataclasses.replace(chunks[-1], routing=routing)
                        for chunk in chunks:
                            yield chunk

    def _versions(self, request_id: str, completion: Any, start: int) -> list[int]:
        """The policy version of each of ``completion``'s tokens (``versioned_chunks.token_versions``, or
        ``version_counts`` where vLLM has no labels)."""
        if self.counted is not None:
            return self.counted.versions(request_id, completion.index, start, len(completion.token_ids))
        return token_versions(self.llm.output_processor, request_id, completion, start)

    async def pause(self, mode: Literal["wait", "keep"], clear_cache: bool = True) -> None:
        """Stops scheduling; ``keep`` suspends in-flight requests, ``wait`` lets them finish first.

        With ``clear_cache`` the KV cache is cleared, so suspended requests recompute their prefix under
        the new weights; without it they continue over the old weights' KV (``[router.pause] kv_cache``).
        Calls the engine core directly: vLLM's ``pause_generation`` adds a multimodal cache reset and a
        fixed sleep for outputs on their way, which nothing here needs (tokens get their version from
        the engine's labels, not from when they arrive) and which would lengthen every refit's pause.
        """
        await self.llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
        self.paused = True

    async def resume(self, policy_version: int) -> None:
        """The router's resume: the engine runs again under ``policy_version`` (``_run_core``)."""
        await self._run_core(policy_version)
        self.paused = False

    async def _run_core(self, policy_version: int) -> None:
        """Labels outputs ``policy_version`` and resumes, in one round trip to the engine core: it handles
        one client's calls in the order they were sent (one socket, one input queue) and runs no step
        while paused, so the label is in place before the first step under the new weights."""
        core = self.llm.engine_core
        if self.counted is not None:
            # Read while paused (no step runs until the resume below). A resume at the version already
            # running (the router's, after the probe's) moves no boundary: the engine is not paused then.
            if policy_version != self.policy_version:
                counts = await core.call_utility_async(UTILITY)
                self.counted.switch(self.llm.output_processor, counts, list(self.tasks), policy_version)
            self.policy_version = policy_version
            await core.resume_scheduler_async()
            return
        self.policy_version = policy_version
        # gather starts its tasks in order, and each sends its message before its first await.
        await asyncio.gather(core.set_weight_version_async(str(policy_version)), core.resume_scheduler_async())

    async def _label(self, policy_version: int) -> None:
        """From the next engine step on, outputs are labelled ``policy_version`` (set only while paused)."""
        self.policy_version = policy_version
        if self.counted is None:
            await self.llm.engine_core.set_weight_version_async(str(policy_version))

    async def probe(self, token_ids: list[int], policy_version: int) -> list[float]:
        """Teacher-forced logprobs of ``token_ids[1:]`` under the loaded weights (temperature 1, no cut).

        Runs between a refit's load and the router's resume: the version is set first, then the
        engine resumes (the router still admits nothing new), so any suspended request that moves
        from here on is stamped with the weights that sample it. The engine is left running: the
        router's resume follows at once when the probe agrees, and when it does not the
        broadcaster pauses the router, and with it this engine, again. The engine stays marked
        paused until the router resumes it (a router that takes it over meanwhile starts paused).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        await self._run_core(policy_version)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        final = None
        async for output in self.llm.generate(TokensPrompt(prompt_token_ids=token_ids), params, f"probe-{uuid4()}"):
            final = output
        assert final is not None and final.prompt_logprobs is not None
        return [entry[token].logprob for token, entry in zip(token_ids[1:], final.prompt_logprobs[1:], strict=True)]

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Calls ``method`` of the worker extension in every engine worker (the weight-broadcaster's door)."""
        results = list(await self.llm.collective_rpc(method, args=args))
        if method == "receive_weights" and all(r["loaded"] and not r["problems"] for r in results):
            self.refits_loaded += 1
        return results

    async def loaded_refits(self) -> int:
        """How many refits loaded and validated in this engine (a replacement starts at 0)."""
        return self.refits_loaded

    async def shutdown(self) -> None:
        if self.flusher is not None:
            self.flusher.cancel()
        if self.server is not None:
            self.server.close()
        if self.writer is not None:
            self.writer.close()
        if self.stall_watch is not None:
            self.stall_watch.stop()
            self.stall_watch = None
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
