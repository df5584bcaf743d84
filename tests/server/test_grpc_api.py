"""The gRPC edge's mapping, pure: an ``EmbedRequest`` to the domain's call (the limits and the
wire's own shapes checked while it is read), a result back to an ``EmbedResponse``, and bad input
named by the request's own fields. End to end through a server: test_api."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from kembed.domain.errors import EmbedError, Failure, Field, InvalidInput
from kembed.domain.inputs import Sequences
from kembed.frontend.call import EmbedResult, Limits, ServerInfo, Texts, Timings
from kembed.frontend.grpc_messages import info_response, message, response, to_call
from kembed.frontend.quantize import Encoding
from kembed.ipc.protocol import ServingInfo
from kembed.policy.priority import Priority
from kembed.v1 import embedder_pb2 as pb

LIMITS = Limits(max_items=8, max_text_chars=500)


def ids(*values: int) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def test_texts_and_options_map_to_the_call() -> None:
    request = pb.EmbedRequest(
        texts=["a", "bcd"], truncate=True, normalize=False, dimensions=64, request_id="r1", priority=pb.PRIORITY_BATCH
    )
    call = to_call(request, LIMITS, 2.5, "ipv4:127.0.0.1:5000")
    assert isinstance(call.inputs, Texts) and list(call.inputs.items) == ["a", "bcd"] and call.inputs.chars == 4
    assert (call.truncate, call.normalize, call.dimensions, call.request_id) == (True, False, 64, "r1")
    assert (call.priority, call.timeout_s, call.peer) == (Priority.BATCH, 2.5, "ipv4:127.0.0.1:5000")
    assert to_call(pb.EmbedRequest(texts=["a"]), LIMITS, None, "").normalize  # unset: normalized


def test_token_ids_map_to_sequences_without_a_copy() -> None:
    request = tokens(ids(101, 7, 102, 101, 102), [3, 2])
    inputs = to_call(request, LIMITS, None, "").inputs
    assert isinstance(inputs, Sequences)
    assert inputs.ids.tolist() == [101, 7, 102, 101, 102] and inputs.lengths.tolist() == [3, 2]
    assert not inputs.ids.flags.owndata  # a view of the request's bytes


def tokens(data: bytes, lengths: list[int]) -> pb.EmbedRequest:
    return pb.EmbedRequest(tokens=pb.TokenIds(ids=data, lengths=lengths))


WIRE_ERRORS = {
    "neither": (pb.EmbedRequest(), "texts: empty, and no tokens: nothing to embed"),
    "both": (pb.EmbedRequest(texts=["a"], tokens=pb.TokenIds(ids=ids(1), lengths=[1])), "texts, tokens: exactly one"),
    "unknown priority": (pb.EmbedRequest(texts=["a"], priority=7), "priority: 7 is not a priority class"),  # type: ignore[arg-type]
    "bytes not int32": (tokens(b"\x01\x00\x00\x00\x02", [1]), "tokens.ids: 5 bytes"),
    "zero length": (tokens(ids(1, 2), [2, 0]), "tokens.lengths[1]: an empty array of token ids"),
    "lengths do not sum": (tokens(ids(1, 2, 3, 4), [2, 3]), "tokens.lengths: sum to 5 tokens, but tokens.ids holds 4"),
    "an empty text": (pb.EmbedRequest(texts=["a", ""]), "texts[1]: an empty string"),
    "unknown truncation direction": (
        pb.EmbedRequest(texts=["a"], truncation_direction=5),  # type: ignore[arg-type]
        "truncation_direction: 5 is not a direction",
    ),
    "too many texts": (pb.EmbedRequest(texts=["a"] * 9), "texts: 9 inputs, at most 8"),
    "too many sequences": (tokens(ids(*[1] * 9), [1] * 9), "tokens.lengths: 9 inputs"),
    "no sequences": (pb.EmbedRequest(tokens=pb.TokenIds()), "tokens.lengths: no inputs"),
    "over-long text": (pb.EmbedRequest(texts=["ok", "x" * 501]), "texts[1]: 501 characters, more than 500"),
}


@pytest.mark.parametrize("case", WIRE_ERRORS)
def test_bad_requests_are_refused_naming_the_protos_field(case: str) -> None:
    request, expected = WIRE_ERRORS[case]
    with pytest.raises(EmbedError) as caught:
        to_call(request, LIMITS, None, "")
    assert caught.value.failure is Failure.INVALID_ARGUMENT
    assert message(caught.value, request).startswith(expected), message(caught.value, request)


def test_bogus_lengths_fail_fast_without_allocating() -> None:
    # A client's -1 arrives as 4294967295 through the proto's uint32 field.
    request = tokens(ids(101, 102, 101, 102), [2**32 - 1, 2**32 - 1, 2])
    tracemalloc.start()
    with pytest.raises(EmbedError) as caught:
        to_call(request, LIMITS, None, "")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert message(caught.value, request).startswith("tokens.lengths: sum to 8589934592")
    assert peak < 1 << 20  # nothing sized by the bogus lengths was allocated


NAMED = {
    "a text": (pb.EmbedRequest(texts=["a", "b"]), InvalidInput(Field.INPUT, "long", 1), "texts[1]: long"),
    "the texts": (pb.EmbedRequest(texts=["a"]), InvalidInput(Field.INPUT, "big"), "texts: big"),
    "a sequence": (
        tokens(ids(1, 2, 3), [1, 2]),
        InvalidInput(Field.INPUT, "long", 1),
        "tokens.lengths[1]: long",
    ),
    "an id, flat on the wire": (
        tokens(ids(1, 2, 3, 4, 5, 6), [2, 3, 1]),
        InvalidInput(Field.INPUT, "outside", 1, 2),
        "tokens.ids[4]: outside",
    ),
    "dimensions": (pb.EmbedRequest(texts=["a"]), InvalidInput(Field.DIMENSIONS, "too many"), "dimensions: too many"),
    "not bad input": (pb.EmbedRequest(texts=["a"]), EmbedError(Failure.REJECTED, "overloaded", 100), "overloaded"),
}


@pytest.mark.parametrize("case", NAMED)
def test_domain_errors_are_named_by_the_requests_fields(case: str) -> None:
    request, error, expected = NAMED[case]
    assert message(error, request) == expected


def test_a_result_maps_to_the_response() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    timings = Timings(0.001, 0.002, 0.003, 0.01)
    result = EmbedResult(rows, np.array([4, 5], dtype=np.int32), "r9", timings, Encoding.FLOAT32, rows.shape[1])
    answer = response(result)
    assert (answer.count, answer.dimensions, list(answer.token_counts), answer.request_id) == (2, 3, [4, 5], "r9")
    np.testing.assert_array_equal(np.frombuffer(answer.embeddings, dtype="<f4").reshape(2, 3), rows)
    assert answer.timings.total_ms == pytest.approx(10.0) and answer.timings.queue_ms == pytest.approx(1.0)


def test_info_tells_the_serving_info_and_the_servers_own() -> None:
    serving = ServingInfo("m", 4, 16, 100, 0, "mean", [101], "fp", "float32", "cpu", [16, 32], [1, 2], "{}")
    info = info_response(ServerInfo(serving, "1.2.3", 64, "token_bucket", 100, 2048, "alias", 16, True, "compiled"))
    assert (info.model_id, info.dimensions, info.vocab_size, info.tokenizer_fingerprint) == ("m", 4, 100, "fp")
    assert list(info.buckets) == [16, 32] and list(info.excluded_token_ids) == [101]
    assert (info.server_version, info.max_batch_items, info.batching) == ("1.2.3", 64, "token_bucket")
    assert (info.max_text_chars, info.max_message_bytes, info.served_model_name) == (100, 2048, "alias")
    assert info.forward == "compiled"
    assert (info.max_chunks_per_input, info.chunk_long_inputs) == (16, True)
