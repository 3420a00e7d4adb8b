"""Every molt.v1 message survives a serialize/parse round trip with every field set."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from molt.v1 import common_pb2

PROTOS = ("common", "rollout", "agent_pool", "learner", "weights")
MODULES: list[ModuleType] = [importlib.import_module(f"molt.v1.{name}_pb2") for name in PROTOS]
GRPC_MODULES = [importlib.import_module(f"molt.v1.{name}_pb2_grpc") for name in PROTOS]
MESSAGES = sorted((d for m in MODULES for d in m.DESCRIPTOR.message_types_by_name.values()), key=lambda d: d.full_name)

SCALARS = {
    FieldDescriptor.TYPE_STRING: "text",
    FieldDescriptor.TYPE_BYTES: b"\x00\x01",
    FieldDescriptor.TYPE_BOOL: True,
    FieldDescriptor.TYPE_FLOAT: 1.5,
    FieldDescriptor.TYPE_DOUBLE: 2.25,
    FieldDescriptor.TYPE_INT32: -7,
    FieldDescriptor.TYPE_INT64: 1 << 40,
    FieldDescriptor.TYPE_FIXED64: (1 << 64) - 1,
}


def _value(field: FieldDescriptor) -> object:
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    return SCALARS[field.type]


def filled(descriptor: Descriptor, depth: int = 0) -> Message:
    """A message of ``descriptor`` with every field set to a non-default value."""
    message = _class(descriptor)()
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            getattr(message, field.name)[_value(key_field)] = _value(value_field)
        elif field.message_type is not None:
            child = filled(field.message_type, depth + 1) if depth < 3 else _class(field.message_type)()
            if field.is_repeated:
                getattr(message, field.name).append(child)
                getattr(message, field.name).append(child)
            else:
                getattr(message, field.name).CopyFrom(child)
        elif field.is_repeated:
            getattr(message, field.name).extend([_value(field), _value(field)])
        else:
            setattr(message, field.name, _value(field))
    return message


def _class(descriptor: Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def test_every_stub_module_imports_with_its_service() -> None:
    services = [s.name for m in MODULES for s in m.DESCRIPTOR.services_by_name.values()]
    assert services == ["RolloutService", "AgentPoolService", "LearnerService", "WeightService"]
    for module, name in zip(GRPC_MODULES[1:], services, strict=True):
        assert hasattr(module, f"{name}Stub") and hasattr(module, f"{name}Servicer")


@pytest.mark.parametrize("descriptor", MESSAGES, ids=lambda d: d.full_name)
def test_round_trip(descriptor: Descriptor) -> None:
    message = filled(descriptor)
    assert len(message.ListFields()) == len(descriptor.fields)
    parsed = _class(descriptor).FromString(message.SerializeToString())
    assert parsed == message


def test_per_token_arrays_are_packed() -> None:
    """Packed encoding keeps the queue payload small: one tag per array, not per token."""
    trajectory = common_pb2.Trajectory(
        response_token_ids=list(range(128, 1152)),
        loss_mask=[True] * 1024,
        policy_versions=[3] * 1024,
        rollout_logprobs=[-0.25] * 1024,
    )
    size = trajectory.ByteSize()
    # ids in [128, 16384) take 2 varint bytes, bools and small versions 1, floats 4: 8 bytes a token plus headers.
    assert 8 * 1024 <= size <= 8 * 1024 + 32
    for field in (
        "prompt_token_ids",
        "response_token_ids",
        "rollout_logprobs",
        "loss_mask",
        "policy_versions",
    ):
        assert common_pb2.Trajectory.DESCRIPTOR.fields_by_name[field].is_packed, field
