"""Parse a ``GenerateRequest`` off the wire, and say which field is bad when it cannot be parsed.

protobuf refuses a message whose string field holds invalid UTF-8 with a ``DecodeError`` that
names no field, and grpc answers such a request with UNKNOWN. The Generation service parses with
``parse_generate_request`` instead: a message that does not parse becomes a ``MalformedRequest``
whose message names the field, which the service answers with INVALID_ARGUMENT. To find the
field, the bytes are parsed again with a twin of the request type whose string fields are bytes
fields (the same wire format, no UTF-8 check), and each of those is decoded in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from pdserve.v1 import generation_pb2 as pb

_LENIENT_PACKAGE = "pdserve.v1.lenient"


@dataclass
class MalformedRequest:
    """A request that could not be parsed; ``message`` says why (naming the field when it can)."""

    message: str


def _lenient_request_class():
    """``GenerateRequest`` with every ``string`` field turned into ``bytes``, in a pool of its own."""
    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "pdserve/v1/generation_lenient.proto"
    fdp.package = _LENIENT_PACKAGE
    del fdp.service[:]
    prefix = f".{pb.DESCRIPTOR.package}."
    for message in fdp.message_type:
        for f in message.field:
            if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            if f.type_name.startswith(prefix):
                f.type_name = f".{_LENIENT_PACKAGE}." + f.type_name[len(prefix):]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_LENIENT_PACKAGE}.GenerateRequest"))


_LenientRequest = _lenient_request_class()


def _bad_utf8_field(request) -> str | None:
    """The first field (as the API names it) whose bytes are not UTF-8, in a lenient request."""
    candidates = [("request_id", request.request_id)]
    kind = request.WhichOneof("input")
    if kind == "prompt":
        candidates.append(("prompt", request.prompt))
    elif kind == "messages":
        for i, m in enumerate(request.messages.messages):
            candidates += [(f"messages[{i}].role", m.role), (f"messages[{i}].content", m.content)]
    candidates += [(f"sampling.stop[{i}]", s) for i, s in enumerate(request.sampling.stop)]
    for name, value in candidates:
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"{name} (byte {exc.start})"
    return None


def parse_generate_request(data: bytes) -> pb.GenerateRequest | MalformedRequest:
    """The request in ``data``, or a ``MalformedRequest`` naming what is wrong with it."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        error = exc
    try:
        lenient = _LenientRequest.FromString(data)
    except DecodeError:
        return MalformedRequest(f"the request is not a valid pdserve.v1.GenerateRequest: {error}")
    field = _bad_utf8_field(lenient)
    if field is not None:
        return MalformedRequest(f"{field} is not valid UTF-8: string fields must hold UTF-8 text")
    return MalformedRequest(f"the request is not a valid pdserve.v1.GenerateRequest: {error}")
