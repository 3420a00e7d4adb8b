"""Property-based fuzzing of every gRPC method of molt's services (hypothesis, real servers on loopback).

Requests are drawn from the methods' protobuf descriptors (``ProtoInputs``): any value of each field,
with the edges that matter (token ids below 0 and at the vocabulary's size, max_tokens and sample
counts past their caps, huge repeated fields, unknown enum values, out-of-range durations), and are
sent as raw bytes beside garbage, messages cut short, strings that are not UTF-8 and a message over
the servers' size limit. Each call must end within its deadline with a status that says what was
wrong (never INTERNAL or UNKNOWN). Afterwards the service answers a valid request, its log holds no
unexpected error, and nothing the fuzz sent changed what it serves: the router's version and pause,
the broadcaster's published version, the queue's entries, the learner's checkpoint. Each test prints
how many inputs it tried (``pytest -s``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from transformers import AutoConfig

from molt.core.queue import QueueKeys, TrajectoryQueue
from molt.core.queue_writes import PAYLOAD_FIELD
from molt.core.testing import RedisServer, ServiceProcess, free_port
from molt.core.trajectory import group_problems
from molt.v1 import (
    agent_pool_pb2,
    agent_pool_pb2_grpc,
    common_pb2,
    learner_pb2,
    learner_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    weights_pb2,
    weights_pb2_grpc,
)

pytestmark = pytest.mark.integration
Field = pb_descriptor.FieldDescriptor
OK = grpc.StatusCode.OK
# What a refused request may end with: each names what was wrong. Never INTERNAL or UNKNOWN (a server
# bug), never DEADLINE_EXCEEDED (a hang past the call's deadline).
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
REFUSED_REFIT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
CALL_TIMEOUT_S = 60.0
FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same inputs on every run: CI reproduces a failure
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

INT_RANGES = {
    **dict.fromkeys((Field.TYPE_INT32, Field.TYPE_SINT32, Field.TYPE_SFIXED32), (-(2**31), 2**31 - 1)),
    **dict.fromkeys((Field.TYPE_INT64, Field.TYPE_SINT64, Field.TYPE_SFIXED64), (-(2**63), 2**63 - 1)),
    **dict.fromkeys((Field.TYPE_UINT32, Field.TYPE_FIXED32), (0, 2**32 - 1)),
    **dict.fromkeys((Field.TYPE_UINT64, Field.TYPE_FIXED64), (0, 2**64 - 1)),
}
HUGE_REPEATS = (1025, 300_000)  # past a 1024-token context; ~1.5 MB of varints
MAX_MESSAGE_BYTES = 16 << 20  # every molt server's default max_message_bytes, which the fuzz stack keeps
NOT_UTF8 = (b"\xff", b"ab\x80", b"\xc3\x28", b"\xed\xa0\x80")  # a stray byte, a cut sequence, a surrogate


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


OVERSIZE = _length_delimited(4095, bytes(MAX_MESSAGE_BYTES + 1))  # an unknown field past the limit


def _string_paths(descriptor: pb_descriptor.Descriptor, depth: int = 0) -> list[tuple[int, ...]]:
    """Field-number paths to every string field of ``descriptor`` (through nested messages)."""
    paths: list[tuple[int, ...]] = []
    for field in descriptor.fields:
        if field.type == Field.TYPE_STRING:
            paths.append((field.number,))
        elif field.type == Field.TYPE_MESSAGE and depth < 2:
            paths += [(field.number, *rest) for rest in _string_paths(field.message_type, depth + 1)]
    return paths


def _nested(path: tuple[int, ...], raw: bytes) -> bytes:
    for number in reversed(path):
        raw = _length_delimited(number, raw)
    return raw


class ProtoInputs:
    """Hypothesis strategies for the requests of a service, derived from their protobuf descriptors."""

    def __init__(
        self, edges: Iterable[int], words: Iterable[str] = (), fields: Mapping[str, SearchStrategy[Any]] = {}
    ) -> None:
        self.edges = sorted(set(edges))  # integers worth trying in every integer field
        self.words = sorted(set(words)) or [""]  # strings worth trying (ids the services know)
        self.fields = dict(fields)  # by a field's full name: a strategy replacing the derived one

    def message(self, descriptor: pb_descriptor.Descriptor, depth: int = 0) -> SearchStrategy[Message]:
        cls = message_factory.GetMessageClass(descriptor)
        fields = {} if depth > 2 else {f.name: self.field(f, depth) for f in descriptor.fields}
        return st.fixed_dictionaries({}, optional=fields).map(lambda values: cls(**values))

    def field(self, field: pb_descriptor.FieldDescriptor, depth: int) -> SearchStrategy[Any]:
        if field.full_name in self.fields:
            return self.fields[field.full_name]
        if field.type == Field.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name
            return st.dictionaries(self.scalar(entry["key"], depth), self.scalar(entry["value"], depth), max_size=4)
        one = self.scalar(field, depth)
        if not field.is_repeated:
            return one
        if field.type in (Field.TYPE_STRING, Field.TYPE_BYTES, Field.TYPE_MESSAGE):
            return st.lists(one, max_size=6)
        return st.one_of(st.lists(one, max_size=6), st.tuples(one, st.sampled_from(HUGE_REPEATS)).map(_repeat))

    def scalar(self, field: pb_descriptor.FieldDescriptor, depth: int) -> SearchStrategy[Any]:
        kind = field.type
        if kind in INT_RANGES:
            low, high = INT_RANGES[kind]
            return st.one_of(
                st.sampled_from([e for e in self.edges if low <= e <= high] + [low, high]), st.integers(low, high)
            )
        if kind == Field.TYPE_STRING:
            long = st.text(min_size=1, max_size=4).map(lambda s: s * 4096)
            return st.one_of(st.sampled_from(self.words), st.text(max_size=24), long)
        simple: dict[int, SearchStrategy[Any]] = {
            Field.TYPE_BOOL: st.booleans(),
            Field.TYPE_FLOAT: st.floats(width=32),
            Field.TYPE_DOUBLE: st.floats(),
            Field.TYPE_BYTES: st.binary(max_size=64),
        }
        if kind in simple:
            return simple[kind]
        if kind == Field.TYPE_ENUM:  # proto3 enums are open: unknown values arrive as they are
            return st.integers(-2, len(field.enum_type.values) + 2)
        return self.message(field.message_type, depth + 1)

    def payloads(
        self, descriptor: pb_descriptor.Descriptor, messages: SearchStrategy[Message] | None = None, cut: bool = True
    ) -> SearchStrategy[bytes]:
        """Serialized requests: well-typed messages, and what no protobuf library would send. ``cut``:
        messages cut short too (which can cut away the defect of a message made to be refused)."""
        messages = self.message(descriptor) if messages is None else messages
        encoded = messages.map(lambda m: m.SerializeToString())
        variants = [encoded, st.binary(max_size=256), st.just(OVERSIZE)]  # well-typed, garbage, too large
        if cut:
            variants.append(st.tuples(encoded, st.integers(1, 64)).map(lambda p: p[0][: max(0, len(p[0]) - p[1])]))
        if paths := _string_paths(descriptor):  # a string field that is not UTF-8 (through nested messages)
            not_utf8 = st.tuples(encoded, st.sampled_from(paths), st.sampled_from(NOT_UTF8))
            variants.append(not_utf8.map(lambda p: p[0] + _nested(p[1], p[2])))
        return st.one_of(variants)

    def undecodable(self, descriptor: pb_descriptor.Descriptor) -> SearchStrategy[bytes]:
        """Requests that cannot decode: a message, then a field whose length runs past the end."""
        parts = st.tuples(self.message(descriptor).map(lambda m: m.SerializeToString()), st.binary(max_size=8))
        broken = parts.map(lambda p: p[0] + _varint(4095 << 3 | 2) + _varint(len(p[1]) + 1) + p[1])
        return st.one_of(broken, st.just(OVERSIZE)).filter(lambda p: decodes(descriptor, p) is None)


def _repeat(pair: tuple[Any, int]) -> list[Any]:
    return [pair[0]] * pair[1]


def decodes(descriptor: pb_descriptor.Descriptor, payload: bytes) -> Message | None:
    """``payload`` parsed as ``descriptor``'s message, or None when it is not one."""
    try:
        return message_factory.GetMessageClass(descriptor).FromString(payload)
    except DecodeError:
        return None


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    replies: tuple[bytes, ...]  # a unary call's reply, or a stream's messages


def call(
    channel: grpc.Channel, method: pb_descriptor.MethodDescriptor, payload: bytes, first_only: bool = False
) -> Outcome:
    """``payload`` sent as the request of ``method``, as bytes; ``first_only``: a stream is read to its
    first message, then cancelled (a watch never ends)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if not method.server_streaming:
            return Outcome(OK, "", (channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S),))
        stream = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S)
        replies = []
        for reply in stream:
            replies.append(reply)
            if first_only:
                stream.cancel()
                break
        return Outcome(OK, "", tuple(replies))
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "", ())


class Tally:
    """How many inputs a test tried, by method and status; ``report`` prints it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.codes: Counter[str] = Counter()

    def check(
        self,
        method: pb_descriptor.MethodDescriptor,
        payload: bytes,
        outcome: Outcome,
        allowed: Iterable[grpc.StatusCode] = (),
    ) -> None:
        self.codes[f"{method.name} {outcome.code.name}"] += 1
        expected = {OK, *REFUSALS} if not allowed else set(allowed)
        assert outcome.code in expected, (
            f"{method.full_name} ended {outcome.code.name} ({outcome.details!r}) on {len(payload)} bytes "
            f"{payload[:160]!r}"
        )
        for reply in outcome.replies:  # what came back is a well-formed message of its type
            message_factory.GetMessageClass(method.output_type).FromString(reply)

    def report(self) -> int:
        total = sum(self.codes.values())
        print(f"fuzz {self.name}: {total} inputs {dict(sorted(self.codes.items()))}")  # noqa: T201 (shown with -s)
        assert total > 0
        return total


def methods(descriptor: pb_descriptor.FileDescriptor, service: str, names: Sequence[str] = ()) -> list[Any]:
    found = descriptor.services_by_name[service].methods
    return [m for m in found if not names or m.name in names]


def cases(
    inputs: ProtoInputs, chosen: Sequence[Any], sound: Mapping[str, SearchStrategy[Message]] = {}
) -> SearchStrategy[tuple[Any, bytes]]:
    """(method, payload) pairs over ``chosen`` methods; ``sound``, by method name: requests made to be
    accepted, drawn as often as the derived ones (which seldom get every field right)."""

    def case(method: Any) -> SearchStrategy[tuple[Any, bytes]]:
        derived = inputs.message(method.input_type)
        messages = st.one_of(derived, sound[method.name]) if method.name in sound else derived
        return st.tuples(st.just(method), inputs.payloads(method.input_type, messages))

    return st.sampled_from(chosen).flatmap(case)


def serving(address: str, service: str) -> None:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def no_unexpected_errors(logs: Iterable[Path]) -> None:
    """No service logged an error it did not map to a status (``molt.core.serve``)."""
    for log in logs:
        bad = [line for line in log.read_text(errors="replace").splitlines() if "unexpected error in" in line]
        assert not bad, f"{log.name}: {bad[0][:2000]}"


def fuzz(strategy: SearchStrategy[Any], examples: int, body: Callable[[Any], None]) -> None:
    """Runs ``body`` on ``examples`` inputs drawn from ``strategy``."""
    settings(FUZZ, max_examples=examples)(given(strategy)(body))()


def finite_logprobs(values: Iterable[float]) -> bool:
    return all(math.isfinite(v) and v <= 0 for v in values)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# -- rollout-router ------------------------------------------------------------------------------------


def router_status(address: str) -> rollout_pb2.GetRouterStatusResponse:
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        return stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)


def router_inputs(status: rollout_pb2.GetRouterStatusResponse) -> ProtoInputs:
    """Token ids mostly inside the vocabulary (so that some requests pass and reach the engine), the
    protected sampling values mostly the router's own, the rest anything."""
    vocab, context, cap = status.vocab_size, status.max_model_len, status.max_tokens_cap
    tokens = st.one_of(st.integers(0, vocab - 1), st.sampled_from([-1, vocab, 2**31 - 1, -(2**31)]))
    prompts = st.one_of(
        st.lists(tokens, max_size=12),
        st.tuples(tokens, st.sampled_from([context - 1, context, *HUGE_REPEATS])).map(_repeat),
    )
    rollout = status.rollout
    sampling = "molt.v1.SamplingParams"
    return ProtoInputs(
        edges=[-1, 0, 1, 2, 20, 21, 64, 65, cap, cap + 1, vocab - 1, vocab, context],
        words=["engine-0", "fuzz", "x" * 128, "x" * 129],
        fields={
            "molt.v1.GenerateRequest.prompt_token_ids": prompts,
            "molt.v1.GenerateStreamRequest.prompt_token_ids": prompts,
            f"{sampling}.stop_token_ids": st.lists(tokens, max_size=3),
            f"{sampling}.temperature": st.one_of(st.just(rollout.temperature), st.floats(width=32)),
            f"{sampling}.top_p": st.one_of(st.just(rollout.top_p), st.floats(width=32)),
            f"{sampling}.top_k": st.one_of(st.just(rollout.top_k), st.integers(-(2**31), 2**31 - 1)),
            # A newer version is what a refit legitimately resumes with (the broadcaster's call); versions
            # far ahead are left out so that the stack's later refit-less tests keep a small one.
            "molt.v1.ResumeGenerationRequest.policy_version": st.one_of(st.integers(-(2**63), -1), st.integers(0, 3)),
        },
    )


def sound_generations(status: rollout_pb2.GetRouterStatusResponse) -> dict[str, SearchStrategy[Message]]:
    """Generation requests the router must accept: every field in range, any value there."""
    rollout, vocab = status.rollout, status.vocab_size
    params = st.fixed_dictionaries(
        {
            "max_tokens": st.integers(0, status.max_tokens_cap),
            "stop_token_ids": st.lists(st.integers(0, vocab - 1), max_size=3),
            "stop_strings": st.lists(st.text(min_size=1, max_size=8), max_size=2),
            "sample_count": st.integers(0, 4),
            "top_logprob_count": st.integers(0, 20),
        },
        optional={
            "seed": st.integers(-(2**63), 2**63 - 1),
            "temperature": st.just(rollout.temperature),
            "top_p": st.just(rollout.top_p),
            "top_k": st.just(rollout.top_k),
        },
    ).map(lambda values: common_pb2.SamplingParams(**values))
    return {
        cls.__name__.removesuffix("Request"): st.builds(
            cls,
            request_id=st.text(min_size=1, max_size=128),
            session_id=st.text(max_size=24),
            prompt_token_ids=st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24),
            sampling_params=params,
        )
        for cls in (rollout_pb2.GenerateRequest, rollout_pb2.GenerateStreamRequest)
    }


def check_generation(
    status: rollout_pb2.GetRouterStatusResponse, method: Any, payload: bytes, replies: Sequence[bytes]
) -> None:
    """An accepted generation is well-formed: the samples asked for, each within the cap, token ids in
    the vocabulary, one finite logprob each, all sampled at the router's version."""
    request = decodes(method.input_type, payload)
    assert request is not None
    if method.name == "Generate":
        completions = list(rollout_pb2.GenerateResponse.FromString(replies[0]).completions)
    else:
        completions = [rollout_pb2.GenerateStreamResponse.FromString(reply) for reply in replies]
    samples: dict[int, list[int]] = {}
    for part in completions:
        assert all(0 <= t < status.vocab_size for t in part.token_ids), part
        assert len(part.logprobs) == len(part.token_ids) and finite_logprobs(part.logprobs), part
        assert set(part.policy_versions) <= {status.policy_version}, part
        samples.setdefault(part.sample_index, []).extend(part.token_ids)
    assert sorted(samples) == list(range(request.sampling_params.sample_count or 1))
    assert all(len(ids) <= status.max_tokens_cap for ids in samples.values())


def router_serves(fuzz_stack: Any, before: rollout_pb2.GetRouterStatusResponse) -> None:
    """The router is as the fuzz found it: running, nothing in flight, its engine live, its version
    unchanged; and it generates: the engine serves that version."""
    after = router_status(fuzz_stack.router)
    assert not after.paused and after.in_flight_request_count == 0 and after.waiting_request_count == 0
    assert after.policy_version == before.policy_version and all(e.healthy for e in after.engines)
    request = rollout_pb2.GenerateRequest(
        request_id="after-fuzz", prompt_token_ids=[1, 2, 3], sampling_params=common_pb2.SamplingParams(sample_count=2)
    )
    method = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name["Generate"]
    with grpc.insecure_channel(fuzz_stack.router) as channel:
        outcome = call(channel, method, request.SerializeToString())
    assert outcome.code == OK, outcome.details
    check_generation(after, method, request.SerializeToString(), outcome.replies)
    serving(fuzz_stack.router, "molt.v1.RolloutService")
    no_unexpected_errors(fuzz_stack.logs)


@pytest.mark.slow
def test_router_requests(fuzz_stack: Any) -> None:
    """Generate, GenerateStream, AbortGeneration, GetRouterStatus. UNAVAILABLE is not allowed: from a
    running router it means the engine failed a request, i.e. something malformed reached it."""
    before = router_status(fuzz_stack.router)
    chosen = methods(rollout_pb2.DESCRIPTOR, "RolloutService", ("Generate", "GenerateStream", "AbortGeneration"))
    chosen += methods(rollout_pb2.DESCRIPTOR, "RolloutService", ("GetRouterStatus",))
    tally = Tally("router requests")
    with grpc.insecure_channel(fuzz_stack.router) as channel:

        def body(case: tuple[Any, bytes]) -> None:
            method, payload = case
            outcome = call(channel, method, payload)
            tally.check(method, payload, outcome)
            if outcome.code == OK and method.name.startswith("Generate"):
                check_generation(before, method, payload, outcome.replies)

        fuzz(cases(router_inputs(before), chosen, sound_generations(before)), 600, body)
    tally.report()
    router_serves(fuzz_stack, before)


@pytest.mark.slow
def test_router_pause_and_resume(fuzz_stack: Any) -> None:
    """PauseGeneration and ResumeGeneration change the router's state: after each call the state must
    be the one its answer claims (paused after a pause; running at the answered version after a
    resume); the test then resumes a paused router. Nothing is in flight, so a drain ends at once."""
    before = router_status(fuzz_stack.router)
    chosen = methods(rollout_pb2.DESCRIPTOR, "RolloutService", ("PauseGeneration", "ResumeGeneration"))
    tally = Tally("router pause and resume")
    with grpc.insecure_channel(fuzz_stack.router) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)

        def body(case: tuple[Any, bytes]) -> None:
            method, payload = case
            outcome = call(channel, method, payload)
            tally.check(method, payload, outcome)
            status = stub.GetRouterStatus(rollout_pb2.GetRouterStatusRequest(), timeout=30)
            if outcome.code == OK and method.name == "PauseGeneration":
                assert status.paused
            if outcome.code == OK and method.name == "ResumeGeneration":
                answered = rollout_pb2.ResumeGenerationResponse.FromString(outcome.replies[0])
                assert not status.paused and status.policy_version == answered.policy_version
            if status.paused:
                stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=60)

        fuzz(cases(router_inputs(before), chosen), 300, body)
    tally.report()
    router_serves(fuzz_stack, router_status(fuzz_stack.router))


# -- weight-broadcaster --------------------------------------------------------------------------------


def not_a_dtype(name: str) -> bool:
    return not isinstance(getattr(torch, name, None), torch.dtype)


def refit_requests(vocab: int) -> SearchStrategy[weights_pb2.RefitWeightsRequest]:
    """Refit requests that are sound but for one defect the broadcaster must refuse before it pauses
    anything. A sound one would pause the engines and wait for its sender's bytes, which takes a
    learner (tests/integration/test_refit.py sends those)."""
    tensor = st.builds(
        weights_pb2.TensorSpec,
        name=st.text(min_size=1, max_size=12),
        dtype=st.sampled_from(["float32", "bfloat16", "int64"]),
        shape=st.lists(st.integers(0, 64), max_size=3),
        checksum=st.integers(0, 2**64 - 1),
    )
    sound = st.builds(
        weights_pb2.RefitWeightsRequest,
        request_id=st.text(min_size=1, max_size=40),
        learner_step=st.integers(0, 2**63 - 1),
        tensors=st.lists(tensor, min_size=1, max_size=4, unique_by=lambda t: t.name),
        bucket_bytes=st.integers(0, 2**63 - 1),
        pause_mode=st.integers(-1, 3),
        policy_version=st.integers(0, 2**63 - 1),
        continue_versions=st.booleans(),
    )
    in_vocab = st.lists(st.integers(0, vocab - 1), min_size=2, max_size=6)
    outside = st.one_of(st.integers(-(2**31), -1), st.integers(vocab, 2**31 - 1))

    def probe(tokens: list[int], logprobs: int) -> Callable[[Any], None]:
        def apply(r: Any) -> None:
            r.run_probe = True
            r.probe_token_ids[:] = tokens
            r.probe_logprobs[:] = [-1.0] * logprobs

        return apply

    def setter(name: str) -> Callable[[Any], Callable[[Any], None]]:
        return lambda value: lambda r: setattr(r, name, value)

    defects = st.one_of(
        st.just(lambda r: r.ClearField("request_id")),
        st.just(lambda r: r.ClearField("tensors")),
        st.integers(-(2**63), -1).map(setter("learner_step")),
        st.integers(-(2**63), -1).map(setter("policy_version")),
        st.integers(-(2**63), -1).map(setter("bucket_bytes")),
        st.text(max_size=12).filter(not_a_dtype).map(lambda d: lambda r: setattr(r.tensors[0], "dtype", d)),
        st.integers(-(2**63), -1).map(lambda size: lambda r: r.tensors[0].shape.append(size)),
        st.just(lambda r: r.tensors.append(r.tensors[0])),  # a name twice
        st.just(lambda r: r.tensors.add(name="\0huge", dtype="float32", shape=[1 << 40, 1 << 40])),
        st.lists(st.integers(0, vocab - 1), max_size=1).map(lambda t: probe(t, max(0, len(t) - 1))),
        st.tuples(in_vocab, st.integers(0, 8)).filter(lambda p: p[1] != len(p[0]) - 1).map(lambda p: probe(*p)),
        st.tuples(in_vocab, outside, st.integers(0, 5)).map(
            lambda p: probe([*p[0][: p[2]], p[1], *p[0][p[2] :]], len(p[0]))
        ),
    )

    def broken(pair: tuple[Any, Callable[[Any], None]]) -> Any:
        request, defect = pair
        defect(request)
        return request

    return st.tuples(sound, defects).map(broken)


def sound_registrations() -> SearchStrategy[Message]:
    """Registrations the broadcaster must accept: a learner by any id, or the router's engine."""
    learner = st.builds(
        weights_pb2.RegisterWeightEndpointRequest,
        endpoint_id=st.text(min_size=1, max_size=24),
        role=st.just(weights_pb2.ENDPOINT_ROLE_LEARNER),
        worker_count=st.integers(-(2**31), 2**31 - 1),
        address=st.text(max_size=24),
    )
    engine = st.builds(
        weights_pb2.RegisterWeightEndpointRequest,
        endpoint_id=st.just("engine-0"),
        role=st.just(weights_pb2.ENDPOINT_ROLE_ENGINE),
        worker_count=st.integers(-(2**31), 2**31 - 1),
        address=st.sampled_from(["", "molt-engine-0"]),
    )
    return st.one_of(learner, engine)


def broadcaster_status(address: str) -> weights_pb2.GetPolicyVersionResponse:
    with grpc.insecure_channel(address) as channel:
        stub = weights_pb2_grpc.WeightServiceStub(channel)
        return stub.GetPolicyVersion(weights_pb2.GetPolicyVersionRequest(), timeout=30)


@pytest.mark.slow
def test_broadcaster_requests(fuzz_stack: Any) -> None:
    """Every WeightService method. A refit must be refused (INVALID_ARGUMENT) before the router is
    paused; registrations may re-register the real engine or a learner (both harmless: the next
    refit builds a new group); the watch answers with the published version."""
    router_before, before = router_status(fuzz_stack.router), broadcaster_status(fuzz_stack.broadcaster)
    inputs = ProtoInputs(
        edges=[-1, 0, 1, 2, router_before.vocab_size],
        words=["engine-0", "engine-1", "molt-engine-0", "molt-engine-1", "learner", "fuzz"],
    )
    service = weights_pb2.DESCRIPTOR.services_by_name["WeightService"]
    refit = service.methods_by_name["RefitWeights"]
    refits = inputs.payloads(refit.input_type, refit_requests(router_before.vocab_size), cut=False)
    others = [m for m in service.methods if m is not refit]
    tally = Tally("broadcaster requests")
    with grpc.insecure_channel(fuzz_stack.broadcaster) as channel:

        def body(case: tuple[Any, bytes]) -> None:
            method, payload = case
            outcome = call(channel, method, payload, first_only=True)
            if method is refit:
                tally.check(method, payload, outcome, REFUSED_REFIT)
                assert not router_status(fuzz_stack.router).paused
            else:
                tally.check(method, payload, outcome)

        registrations = {"RegisterWeightEndpoint": sound_registrations()}
        fuzz(st.one_of(cases(inputs, others, registrations), st.tuples(st.just(refit), refits)), 400, body)
    tally.report()
    after = broadcaster_status(fuzz_stack.broadcaster)
    assert after.policy_version.version == before.policy_version.version and after.refit_failure == ""
    serving(fuzz_stack.broadcaster, "molt.v1.WeightService")
    router_serves(fuzz_stack, router_before)


# -- agent-pool ----------------------------------------------------------------------------------------


def defects(group: common_pb2.TrajectoryGroup, run_id: str, vocab: int) -> list[str]:
    """How ``group`` breaks the queue's contract (common.proto): its structure, token ids outside the
    vocabulary, logprobs not finite, versions below 0 (none: it is well-formed)."""
    found = group_problems(group, run_id)
    for t in group.trajectories:
        if not all(0 <= i < vocab for i in (*t.prompt_token_ids, *t.response_token_ids)):
            found.append(f"{t.trajectory_id}: a token id outside [0, {vocab})")
        if not all(math.isfinite(v) for v in t.rollout_logprobs):
            found.append(f"{t.trajectory_id}: a logprob not finite")
        if not all(v >= 0 for v in t.policy_versions):
            found.append(f"{t.trajectory_id}: a policy version below 0")
    return found


def well_formed(group: common_pb2.TrajectoryGroup, run_id: str, vocab: int) -> bool:
    return not defects(group, run_id, vocab)


def queued(redis_url: str, run_id: str) -> list[tuple[str, bytes]]:
    """The run's queue entries, id and payload, oldest first."""
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(QueueKeys(run_id).stream)
    finally:
        client.close()
    return [(entry_id.decode(), fields.get(PAYLOAD_FIELD, b"")) for entry_id, fields in entries]


@pytest.mark.slow
def test_agent_pool_requests(fuzz_stack: Any) -> None:
    """Sequences of StartRollouts, StopRollouts and GetAgentPoolStatus, each followed by a stop; every
    group the rollouts queued meanwhile is well-formed, and the pool still produces one on request."""
    vocab = router_status(fuzz_stack.router).vocab_size
    chosen = methods(agent_pool_pb2.DESCRIPTOR, "AgentPoolService")
    sequences = st.lists(cases(ProtoInputs(edges=[-1, 0, 1, 2, 3]), chosen), min_size=1, max_size=3)
    tally = Tally("agent-pool requests")
    with grpc.insecure_channel(fuzz_stack.pool) as channel:
        stub = agent_pool_pb2_grpc.AgentPoolServiceStub(channel)

        def status() -> agent_pool_pb2.GetAgentPoolStatusResponse:
            return stub.GetAgentPoolStatus(agent_pool_pb2.GetAgentPoolStatusRequest(), timeout=30)

        def body(calls: list[tuple[Any, bytes]]) -> None:
            for method, payload in calls:
                outcome = call(channel, method, payload)
                tally.check(method, payload, outcome)
            stub.StopRollouts(agent_pool_pb2.StopRolloutsRequest(drain=False), timeout=60)
            assert not status().running

        fuzz(sequences, 150, body)
        tally.report()
        before = status().queued_group_count
        assert stub.StartRollouts(agent_pool_pb2.StartRolloutsRequest(max_group_count=1), timeout=30).started
        wait_for(lambda: status().queued_group_count > before and not status().running, "a group on request")
    groups = [
        common_pb2.TrajectoryGroup.FromString(payload) for _, payload in queued(fuzz_stack.redis_url, fuzz_stack.run_id)
    ]
    assert groups and all(well_formed(group, fuzz_stack.run_id, vocab) for group in groups)
    serving(fuzz_stack.pool, "molt.v1.AgentPoolService")
    no_unexpected_errors(fuzz_stack.logs)


# -- learner -------------------------------------------------------------------------------------------

LEARNER_RUN = "fuzz-learner"


@dataclass(frozen=True)
class Learner:
    address: str
    process: ServiceProcess
    run_dir: Path
    log: Path


@pytest.fixture
def learner(tiny_model: Path, redis_server: RedisServer, tmp_path: Path) -> Iterator[Learner]:
    """A learner on the tiny model reading its own run's queue (two groups of two a step)."""
    workdir = tmp_path
    address = f"127.0.0.1:{free_port()}"
    recipe = workdir / "recipe.toml"
    recipe.write_text(f"""
[run]
run_id = "{LEARNER_RUN}"
redis_url = "{redis_server.url}"
run_dir = "{workdir / "run"}"

[rollout]
group_size = 2
groups_per_step = 2
max_staleness = 100

[learner]
model_path = "{tiny_model}"
listen = "{address}"
metrics_port = 0
checkpoint_every = 1000
micro_batch_tokens = 256
poll_s = 0.1
""")
    log = workdir / "learner.log"
    process = ServiceProcess([sys.executable, "-m", "molt.learner", "--config", str(recipe)], address, log)
    process.start(timeout_s=180)
    yield Learner(address, process, workdir / "run", log)
    process.stop()


def trajectory_groups(vocab: int) -> SearchStrategy[common_pb2.TrajectoryGroup]:
    """Groups as the contract asks (common.proto) with any values it allows: rewards and logprobs of any
    finite size, any mix of sampled and inserted tokens; half of them with one defect (a token id
    outside the vocabulary, a value not finite, arrays of different lengths, an empty prompt or id,
    another run, an id twice, a version from the future or below 0)."""
    finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
    token = st.integers(0, vocab - 1)
    step = st.tuples(token, finite, st.one_of(st.just(True), st.booleans()), st.just(0))  # the learner's version

    def trajectory(parts: tuple[Any, ...]) -> common_pb2.Trajectory:
        trajectory_id, prompt, response, reward = parts
        return common_pb2.Trajectory(
            trajectory_id=trajectory_id,
            rollout_id=trajectory_id,
            prompt_token_ids=prompt,
            response_token_ids=[token for token, *_ in response],
            rollout_logprobs=[logprob for _, logprob, _, _ in response],
            loss_mask=[mask for *_, mask, _ in response],
            policy_versions=[version for *_, version in response],
            reward=reward,
        )

    ids = st.uuids().map(str)
    one = st.tuples(ids, st.lists(token, min_size=1, max_size=6), st.lists(step, min_size=1, max_size=6), finite)
    sound = st.builds(
        common_pb2.TrajectoryGroup,
        group_id=ids,
        run_id=st.just(LEARNER_RUN),
        sample_count=st.integers(2, 3),
        trajectories=st.lists(one.map(trajectory), min_size=2, max_size=3),
    )
    not_finite = st.sampled_from([math.nan, math.inf, -math.inf])
    first = lambda g: g.trajectories[0]  # noqa: E731
    defects = st.one_of(
        st.sampled_from([-1, vocab, 2**31 - 1]).map(lambda t: lambda g: first(g).prompt_token_ids.append(t)),
        not_finite.map(lambda v: lambda g: first(g).rollout_logprobs.__setitem__(0, v)),
        not_finite.map(lambda v: lambda g: setattr(first(g), "reward", v)),
        st.just(lambda g: first(g).loss_mask.pop()),
        st.just(lambda g: first(g).ClearField("prompt_token_ids")),
        st.just(lambda g: first(g).ClearField("trajectory_id")),
        st.just(lambda g: g.ClearField("group_id")),
        st.just(lambda g: setattr(g, "run_id", "other-run")),
        st.just(lambda g: g.trajectories.append(first(g))),
        st.integers(1, 2**63 - 1).map(lambda v: lambda g: first(g).policy_versions.__setitem__(0, v)),
        st.integers(-(2**63), -1).map(lambda v: lambda g: first(g).policy_versions.__setitem__(0, v)),
    )

    def with_defect(pair: tuple[common_pb2.TrajectoryGroup, Callable[[Any], None] | None]) -> Any:
        group, defect = pair
        if defect is not None:
            defect(group)
        return group

    return st.tuples(sound, st.one_of(st.none(), defects)).map(with_defect)


def test_learner_requests_and_queue(learner: Learner, redis_server: RedisServer, tiny_model: Path) -> None:
    """GetLearnerStatus, GetRunSettings and SaveCheckpoint with any request; StopLearner only with
    requests that do not decode (one that does stops the learner: it is called once, validly, at the
    end). Meanwhile the run's queue receives fuzzed groups and garbage, as a producer other than molt's
    could write them. The learner keeps serving, and its last checkpoint holds only trajectories of
    well-formed groups, and finite weights."""
    vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
    inputs = ProtoInputs(edges=[-1, 0, 1], words=["r1", "r2"])
    service = learner_pb2.DESCRIPTOR.services_by_name["LearnerService"]
    stop = service.methods_by_name["StopLearner"]
    others = [m for m in service.methods if m is not stop]
    entries = st.one_of(trajectory_groups(vocab).map(lambda g: g.SerializeToString()), st.binary(max_size=64))
    written: list[bytes] = []
    tally = Tally("learner requests and queue")
    client = redis_server.client()
    with grpc.insecure_channel(learner.address) as channel:

        def body(case: tuple[Any, bytes]) -> None:
            method, payload = case
            if method is None:
                client.xadd(QueueKeys(LEARNER_RUN).stream, {PAYLOAD_FIELD: payload})
                written.append(payload)
                tally.codes["queue entry"] += 1
                return
            tally.check(method, payload, call(channel, method, payload))

        strategy = st.one_of(
            cases(inputs, others),
            st.tuples(st.just(stop), inputs.undecodable(stop.input_type)),
            st.tuples(st.just(None), entries),
        )
        fuzz(strategy, 300, body)
        tally.report()
        queue = TrajectoryQueue(client, LEARNER_RUN)
        wait_for(lambda: queue.stats().lag == 0, "the learner to read every entry")
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        status = stub.GetLearnerStatus(learner_pb2.GetLearnerStatusRequest(), timeout=30)
        stub.StopLearner(learner_pb2.StopLearnerRequest(save_checkpoint=True), timeout=120)
    client.close()
    assert learner.process.process is not None and learner.process.process.wait(timeout=60) == 0
    good, bad = set(), {}
    for payload in written:
        group: Any = decodes(common_pb2.TrajectoryGroup.DESCRIPTOR, payload)
        if group is not None:
            found = defects(group, LEARNER_RUN, vocab)
            for t in group.trajectories:
                (bad.__setitem__(t.trajectory_id, found) if found else good.add(t.trajectory_id))
    checkpoint = learner.run_dir / "checkpoints" / (learner.run_dir / "checkpoints" / "latest").read_text().strip()
    consumed = json.loads((checkpoint / "state.json").read_text())["consumed"]
    assert set(consumed) <= good, [bad.get(i, i) for i in sorted(set(consumed) - good)][:5]
    print(  # noqa: T201 (shown with -s: how deep the queue's fuzz got)
        f"fuzz learner: {len(good)} well-formed trajectories queued, {len(consumed)} trained in {status.step} "
        f"steps; dropped {dict(status.dropped_trajectory_counts)}, {status.dead_letter_count} dead letters"
    )
    weights = torch.load(checkpoint / "model.pt", weights_only=True)
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())
    no_unexpected_errors([learner.log])
