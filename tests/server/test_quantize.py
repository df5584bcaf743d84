"""Quantized vectors (kembed/frontend/quantize.py): sentence-transformers' binary kinds bit for bit, int8 and
uint8 at their one fixed scale, on both edges of a real server."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings

from kembed.client import EmbedClient, InvalidInput
from kembed.frontend import openai_api, rest
from kembed.frontend.quantize import INT8_SCALE, Encoding, encode
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, the_plain_server
from tests.server.test_rest import post

TEXTS = ["hello world", "kubernetes scales embedding servers", "a queue of tokens", "naïve café 東京"]
WIRE_DTYPES = {Encoding.INT8: np.int8, Encoding.UINT8: np.uint8, Encoding.BINARY: np.int8, Encoding.UBINARY: np.uint8}


def theirs(vectors: np.ndarray, kind: Encoding) -> np.ndarray:
    """sentence-transformers' quantize_embeddings of ``vectors`` to ``kind``."""
    return np.asarray(quantize_embeddings(vectors, precision=kind.value))


def test_the_binary_kinds_are_sentence_transformers_bit_for_bit(st_model: Any) -> None:
    vectors = np.asarray(st_model.encode(TEXTS * 8, normalize_embeddings=True))
    for kind in (Encoding.BINARY, Encoding.UBINARY):
        ours = encode(vectors, kind)
        assert ours.dtype == theirs(vectors, kind).dtype
        assert np.array_equal(ours, theirs(vectors, kind))


def test_int8_is_one_fixed_scale_whatever_the_batch_holds() -> None:
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(6, 384)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    alone = encode(rows[:1], Encoding.INT8)
    spiky = np.vstack([rows[:1], np.eye(1, 384, dtype=np.float32)])  # a row at the range's very end
    assert np.array_equal(encode(spiky, Encoding.INT8)[:1], alone)  # no per-batch range moved it
    assert np.abs(alone.astype(np.float32) - rows[:1] * INT8_SCALE).max() <= 0.5  # within half a step
    assert np.array_equal(encode(rows, Encoding.UINT8).astype(np.int16) - 128, encode(rows, Encoding.INT8))
    assert encode(np.eye(2, dtype=np.float32), Encoding.INT8).max() == 127  # a unit vector is never clipped


server = the_plain_server()


def grpc_rows(stub: pb_grpc.EmbedderStub, encoding: Encoding, **fields: Any) -> np.ndarray:
    answer = stub.Embed(pb.EmbedRequest(texts=TEXTS, encoding=f"ENCODING_{encoding.name}", **fields), timeout=120)
    assert (answer.count, answer.encoding) == (len(TEXTS), pb.Encoding.Value(f"ENCODING_{encoding.name}"))
    dtype = WIRE_DTYPES.get(encoding, np.dtype("<f4"))
    return np.frombuffer(answer.embeddings, dtype=dtype).reshape(answer.count, -1)


@pytest.mark.process
@pytest.mark.parametrize("kind", [e for e in Encoding if e is not Encoding.FLOAT32])
def test_both_edges_answer_the_quantized_vectors_of_their_own_floats(
    stub: pb_grpc.EmbedderStub, server: ServerProcess, kind: Encoding
) -> None:
    floats = grpc_rows(stub, Encoding.FLOAT32, dimensions=128)
    quantized = grpc_rows(stub, kind, dimensions=128)
    width = 128 // 8 if kind in (Encoding.BINARY, Encoding.UBINARY) else 128
    assert quantized.shape == (len(TEXTS), width)
    if kind in (Encoding.BINARY, Encoding.UBINARY):
        assert np.array_equal(quantized, theirs(floats, kind))
    else:  # the same text, computed again: at most a step apart where a value sits on a rounding edge
        assert np.abs(quantized.astype(np.int16) - encode(floats, kind).astype(np.int16)).max() <= 1
    status, body, _ = post(server, {"input": TEXTS, "encoding_format": kind.value, "dimensions": 128})
    assert status == 200, body
    rest = np.asarray([item["embedding"] for item in body["data"]])
    assert rest.shape == quantized.shape and np.abs(rest - quantized.astype(np.int64)).max() <= 1


@pytest.mark.process
def test_a_quantization_that_cannot_hold_is_refused_naming_the_field(
    stub: pb_grpc.EmbedderStub, server: ServerProcess
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(texts=TEXTS, encoding="ENCODING_INT8", normalize=False), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value.details()).startswith("encoding: int8 takes normalised vectors")
    with pytest.raises(grpc.RpcError) as unknown:
        stub.Embed(pb.EmbedRequest(texts=TEXTS, encoding=99), timeout=60)  # type: ignore[arg-type]
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "encoding: 99" in str(unknown.value.details())
    assert set(rest.ANSWER_BYTES_PER_VALUE) == set(openai_api.ENCODINGS)  # every answer is weighed
    status, body, _ = post(server, {"input": TEXTS, "encoding_format": "int4"})
    assert status == 400 and body["error"]["param"] == "encoding_format"


@pytest.mark.process
def test_the_client_asks_for_an_encoding_and_decodes_it(server: ServerProcess, stub: pb_grpc.EmbedderStub) -> None:
    with EmbedClient(server.target) as client:
        for kind in (Encoding.INT8, Encoding.UBINARY):
            rows = client.embed(TEXTS, encoding=kind.value, dimensions=128)
            again = grpc_rows(stub, kind, dimensions=128)  # computed again: a value on a rounding edge may move a step
            assert rows.dtype == WIRE_DTYPES[kind] and rows.shape == again.shape
            if kind is Encoding.INT8:
                assert np.abs(rows.astype(np.int16) - again.astype(np.int16)).max() <= 1
            else:  # a sign bit may flip only for a value at 0
                assert (np.unpackbits(rows) != np.unpackbits(again)).mean() < 0.01
        with pytest.raises(InvalidInput, match="encoding: 'int4' is not one of"):
            client.embed(TEXTS, encoding="int4")
