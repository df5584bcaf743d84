"""The gRPC API's messages as the domain's: an EmbedRequest read (pre-scanned past a size:
:mod:`kembed.frontend.proto_scan`) and checked against the limits as it becomes an
:class:`~kembed.frontend.call.EmbedCall`, an :class:`~kembed.frontend.call.EmbedResult` as an
EmbedResponse, bad input named by the request's own fields, and the one place failures become gRPC
status codes. Pure: no server here (``grpc_api.py`` serves it), so every mapping is tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kembed.contract import GRPC_PREVIOUS_ATTEMPTS_KEY, REQUEST_ID_KEY, RETRY_ATTEMPT_KEY
from kembed.domain.errors import EmbedError, Failure, Field, InvalidInput
from kembed.domain.inputs import Sequences
from kembed.domain.prompts import PromptChoice
from kembed.frontend.call import EmbedCall, EmbedResult, Limits, ServerInfo
from kembed.frontend.proto_scan import WHOLE_MESSAGE_BYTES, scan
from kembed.frontend.quantize import Encoding
from kembed.ipc.protocol import ServingInfo
from kembed.policy.demand import retry_attempt
from kembed.policy.priority import BY_VALUE
from kembed.v1 import embedder_pb2 as pb

ENCODING_NAMES = {encoding: f"ENCODING_{encoding.name}" for encoding in Encoding}  # the proto's, by the domain's
ENCODINGS = {pb.Encoding.Value(name): encoding for encoding, name in ENCODING_NAMES.items()}

STATUS = {
    Failure.REJECTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
    Failure.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
# What Info tells of the serving engine, by the names the protocol and the proto share.
_INFO_FIELDS = sorted({f.name for f in fields(ServingInfo)} & set(pb.InfoResponse.DESCRIPTOR.fields_by_name))


@dataclass(frozen=True, slots=True)
class Refused:
    """A request refused on the wire, before it was parsed (what the handler then answers)."""

    error: EmbedError


def read_request(data: bytes, limits: Limits) -> pb.EmbedRequest | Refused:
    """A serialized EmbedRequest, parsed if it is safe to parse (the deserializer gRPC calls)."""
    reason = scan(data, limits) if len(data) > WHOLE_MESSAGE_BYTES else None
    if reason is None:
        try:
            return pb.EmbedRequest.FromString(data)
        except DecodeError:
            reason = "the message is not an EmbedRequest"
    return Refused(EmbedError(Failure.INVALID_ARGUMENT, reason))


def attempt_of(context: grpc.aio.ServicerContext) -> int:
    """The call's earlier attempts, as its retry marker says: gRPC's retry policy's, or kembed's client's."""
    for key, value in context.invocation_metadata() or ():
        if key in (GRPC_PREVIOUS_ATTEMPTS_KEY, RETRY_ATTEMPT_KEY):
            return retry_attempt(value)
    return 0


def offered_request_id(context: grpc.aio.ServicerContext) -> str | None:
    """The call's ``x-request-id`` metadata, if its caller sent one."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return str(value)
    return None


def to_call(
    request: pb.EmbedRequest, limits: Limits, time_remaining: float | None, peer: str, attempt: int = 0
) -> EmbedCall:
    """The request as the domain's call, checked against ``limits`` as it is read."""
    has_texts, has_tokens = len(request.texts) > 0, request.HasField("tokens")
    if not has_texts and not has_tokens:  # proto3 cannot tell an empty list from none
        raise _invalid("texts: empty, and no tokens: nothing to embed")
    if has_texts and has_tokens:
        raise _invalid("texts, tokens: exactly one of the two must be set")
    if not 0 <= request.priority < len(BY_VALUE):  # a proto3 enum field takes any int32
        raise _invalid(f"priority: {request.priority} is not a priority class")
    if request.encoding not in ENCODINGS:
        raise _invalid(f"encoding: {request.encoding} is not an encoding")
    if request.truncation_direction not in (pb.TRUNCATION_DIRECTION_RIGHT, pb.TRUNCATION_DIRECTION_LEFT):
        raise _invalid(f"truncation_direction: {request.truncation_direction} is not a direction")
    left = request.truncation_direction == pb.TRUNCATION_DIRECTION_LEFT
    inputs = _sequences(request.tokens, limits) if has_tokens else limits.texts(request.texts, request.truncate, left)
    return EmbedCall(
        inputs=inputs,
        truncate=request.truncate,
        truncate_left=left,
        chunk=request.chunk if request.HasField("chunk") else None,
        normalize=request.normalize if request.HasField("normalize") else True,
        dimensions=request.dimensions,
        encoding=ENCODINGS[request.encoding],
        priority=BY_VALUE[request.priority],
        prompt=PromptChoice(
            request.prompt_name, request.prompt if request.HasField("prompt") else None, request.input_type
        ),
        request_id=request.request_id,
        timeout_s=time_remaining,
        peer=peer,
        attempt=attempt,
    )


def _sequences(tokens: pb.TokenIds, limits: Limits) -> Sequences:
    """The ids as sequences: a view of the request's bytes, read once their size is checked."""
    limits.check_count(len(tokens.lengths))
    # int64 holds any uint32 (a client's -1 is 4294967295) and any sum of max_items of them.
    counts = np.asarray(tokens.lengths, dtype=np.int64)
    if len(tokens.ids) % 4:
        raise EmbedError(
            Failure.INVALID_ARGUMENT, f"tokens.ids: {len(tokens.ids)} bytes is not a whole number of int32 ids"
        )
    limits.check_sizes(counts, ids=True)
    total = int(counts.sum())
    if total * 4 != len(tokens.ids):
        held = len(tokens.ids) // 4
        raise EmbedError(
            Failure.INVALID_ARGUMENT, f"tokens.lengths: sum to {total} tokens, but tokens.ids holds {held}"
        )
    return Sequences(ids=np.frombuffer(tokens.ids, dtype="<i4"), lengths=counts.astype(np.int32))


def _invalid(message: str) -> EmbedError:
    """Bad input only the wire format can have: its message names the proto's field."""
    return EmbedError(Failure.INVALID_ARGUMENT, message)


def message(error: EmbedError, request: pb.EmbedRequest | Refused) -> str:
    """The error's message, bad input named by the request's own fields."""
    if not isinstance(error, InvalidInput) or isinstance(request, Refused):
        return error.message
    return f"{_place(error, request)}: {error.reason}"


def _place(error: InvalidInput, request: pb.EmbedRequest) -> str:
    """``texts[3]``, ``tokens.lengths[2]``, ``tokens.ids[12]`` (the ids are flat on the wire)..."""
    index = "" if error.index is None else f"[{error.index}]"
    if error.field is not Field.INPUT:
        return str(error.field)
    if not request.HasField("tokens"):
        return "texts" + index
    if error.index is None or error.position is None:
        return "tokens.lengths" + index
    return f"tokens.ids[{sum(request.tokens.lengths[: error.index]) + error.position}]"


def response(result: EmbedResult) -> pb.EmbedResponse:
    vectors, timings = result.embeddings, result.timings
    return pb.EmbedResponse(
        embeddings=vectors.astype("<f4", copy=False).tobytes() if vectors.dtype == np.float32 else vectors.tobytes(),
        count=vectors.shape[0],
        dimensions=result.dimensions,
        encoding=ENCODING_NAMES[result.encoding],
        token_counts=result.token_counts.tolist(),
        request_id=result.request_id,
        timings=pb.Timings(
            queue_ms=timings.queue_s * 1000,
            tokenize_ms=timings.tokenize_s * 1000,
            inference_ms=timings.inference_s * 1000,
            total_ms=timings.total_s * 1000,
        ),
    )


def info_response(info: ServerInfo) -> pb.InfoResponse:
    return pb.InfoResponse(
        **{name: getattr(info.serving, name) for name in _INFO_FIELDS},
        buckets=info.serving.bucket_lengths,
        server_version=info.server_version,
        max_batch_items=info.max_batch_items,
        batching=info.batching,
        max_text_chars=info.max_text_chars,
        max_message_bytes=info.max_message_bytes,
        served_model_name=info.served_model_name,
        max_chunks_per_input=info.max_chunks_per_input,
        chunk_long_inputs=info.chunk_long_inputs,
        forward=info.forward,
        admission_budget_tokens=info.admission_budget_tokens,
        max_connection_age_ms=info.max_connection_age_ms,
        max_connection_age_grace_ms=info.max_connection_age_grace_ms,
    )
