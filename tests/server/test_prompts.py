"""Prompts end to end: a real server serving a copy of the bundled model whose
config_sentence_transformers.json declares prompts and a default, its vectors against
sentence-transformers' own ``encode(prompt_name=...)`` / ``encode(prompt=...)``, over gRPC and REST;
and the rules on their own (which prompt a request gets, what is refused)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from kembed.client import AsyncEmbedClient, EmbedClient, decode
from kembed.client.__main__ import main
from kembed.config.settings import Settings
from kembed.contract import EXIT_EMBED_FINAL
from kembed.domain.errors import Field, InvalidInput
from kembed.domain.prompts import MAX_PROMPT_CHARS, ModelPrompts, PromptChoice, name_problem
from kembed.engine.model import EmbeddingModel, ModelLoadError
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, serving
from tests.server.test_bulk_serving import embed_command
from tests.server.test_model import model_copy, write_json
from tests.server.test_rest import post

PROMPTS = {"query": "query: ", "passage": "passage: "}
TEXTS = ["How do pods find each other?", "A Service gives pods one stable address.", "naïve café 東京"]
MAX_INPUT_TOKENS = 64
REST_MODEL = "prompted"


def prompted_folder(bundled: Path, into: Path, **config: Any) -> Path:
    folder = model_copy(bundled, into, rewritten=["config_sentence_transformers.json"])
    write_json(folder / "config_sentence_transformers.json", config)
    return folder


@pytest.fixture(scope="module")
def folder(bundled_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    into = tmp_path_factory.mktemp("prompted")
    return prompted_folder(bundled_path, into, prompts=PROMPTS, default_prompt_name="query")


@pytest.fixture(scope="module")
def st(folder: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    model.max_seq_length = MAX_INPUT_TOKENS
    return model


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serving(
        tmp_path_factory.mktemp("prompts"),
        model=str(folder),
        admission="",
        max_input_tokens=MAX_INPUT_TOKENS,
        served_model_name=REST_MODEL,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def rest(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.rest_url, api_key="unused", max_retries=0)


def reference(st: Any, texts: list[str], **prompt: Any) -> np.ndarray:
    return np.asarray(st.encode(texts, normalize_embeddings=True, **prompt))


def rest_vectors(rest: openai.OpenAI, texts: list[str], **extra: Any) -> tuple[np.ndarray, int]:
    answer = rest.embeddings.create(model=REST_MODEL, input=texts, encoding_format="float", extra_body=extra)
    return np.asarray([item.embedding for item in answer.data], dtype=np.float32), answer.usage.prompt_tokens


# Each request's prompt fields, and sentence-transformers' arguments for the same vectors.
CHOICES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "the default": ({}, {}),  # sentence-transformers applies default_prompt_name too
    "a prompt by name": ({"prompt_name": "passage"}, {"prompt_name": "passage"}),
    "a literal prompt": ({"prompt": "Represent this: "}, {"prompt": "Represent this: "}),
    "an empty prompt: none": ({"prompt": ""}, {"prompt": ""}),
    "input_type query": ({"input_type": "query"}, {"prompt_name": "query"}),
    "input_type document: the passage prompt": ({"input_type": "document"}, {"prompt_name": "passage"}),
}


@pytest.mark.process
@pytest.mark.parametrize("case", CHOICES)
def test_vectors_and_counts_are_sentence_transformers_with_the_prompt(
    stub: pb_grpc.EmbedderStub, rest: openai.OpenAI, st: Any, case: str
) -> None:
    fields, st_prompt = CHOICES[case]
    expected = reference(st, TEXTS, **st_prompt)
    answer = stub.Embed(pb.EmbedRequest(texts=TEXTS, **fields))
    np.testing.assert_allclose(decode(answer), expected, atol=2e-6)
    prompt = st_prompt.get("prompt", PROMPTS.get(st_prompt.get("prompt_name", "query"), ""))
    counts = [len(st.tokenizer(prompt + text)["input_ids"]) for text in TEXTS]
    assert list(answer.token_counts) == counts  # the prompt's tokens are counted
    vectors, usage = rest_vectors(rest, TEXTS, **fields)
    np.testing.assert_allclose(vectors, expected, atol=2e-6)
    assert usage == sum(counts)


@pytest.mark.process
def test_the_prompt_changes_the_vector(stub: pb_grpc.EmbedderStub) -> None:
    """The query prompt (the default), the passage prompt, a literal one and none: four vectors, so
    none of the choices is ignored."""
    choices: list[dict[str, Any]] = [{}, {"prompt_name": "passage"}, {"prompt": "Represent this: "}, {"prompt": ""}]
    vectors = [decode(stub.Embed(pb.EmbedRequest(texts=TEXTS[:1], **fields)))[0] for fields in choices]
    closest = max(float(a @ b) for i, a in enumerate(vectors) for b in vectors[i + 1 :])
    assert closest < 0.999, closest


@pytest.mark.process
def test_truncation_cuts_the_text_never_the_prompt(stub: pb_grpc.EmbedderStub, st: Any) -> None:
    long = "word " * 200
    answer = stub.Embed(pb.EmbedRequest(texts=[long], truncate=True, prompt_name="passage"))
    assert list(answer.token_counts) == [MAX_INPUT_TOKENS]
    np.testing.assert_allclose(decode(answer), reference(st, [long], prompt_name="passage"), atol=2e-6)
    with pytest.raises(grpc.RpcError) as refused:  # without truncate: too long, counting the prompt
        stub.Embed(pb.EmbedRequest(texts=["word " * (MAX_INPUT_TOKENS - 3)], prompt_name="passage"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts[0]" in str(refused.value.details())


@pytest.mark.process
def test_info_and_models_list_the_prompts(stub: pb_grpc.EmbedderStub, server: ServerProcess) -> None:
    info = stub.Info(pb.InfoRequest())
    assert (dict(info.prompts), info.default_prompt_name) == (PROMPTS, "query")
    with urllib.request.urlopen(server.rest_url + "/models", timeout=60) as response:
        models = json.loads(response.read())["data"]
    assert all((m["prompts"], m["default_prompt_name"]) == (PROMPTS, "query") for m in models), models


BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "two at once": ({"prompt_name": "query", "prompt": "x"}, "prompt", "set together with prompt_name"),
    "name and type": ({"prompt_name": "query", "input_type": "query"}, "input_type", "set together with prompt_name"),
    "an unknown name": ({"prompt_name": "title"}, "prompt_name", "'title' is not one of this model's prompts"),
    "a name that cannot be one": ({"prompt_name": "a b"}, "prompt_name", "prompt name 'a b' must match"),
    "an unknown type": ({"input_type": "code"}, "input_type", "'code' is not one of query, passage, document"),
    "a prompt too long": ({"prompt": "p" * (MAX_PROMPT_CHARS + 1)}, "prompt", "1025 characters, more than 1024"),
    "a prompt that leaves no room": ({"prompt": "word " * 70}, "prompt", "70 tokens, leaving no room for a text"),
}


@pytest.mark.process
@pytest.mark.parametrize("case", BAD)
def test_bad_prompt_fields_are_refused_naming_them(
    stub: pb_grpc.EmbedderStub, server: ServerProcess, case: str
) -> None:
    fields, field, reason = BAD[case]
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(texts=TEXTS, **fields))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value.details()).startswith(f"{field}: {reason}"), refused.value.details()
    if case == "an unknown name":
        assert "query, passage" in str(refused.value.details())  # the known ones listed
    if case == "a prompt too long":
        return  # REST bounds every field at 1024 characters itself (test_openai_api)
    status, body, _ = post(server, {"input": TEXTS, **fields})
    assert (status, body["error"]["param"]) == (400, field) and body["error"]["message"].startswith(f"{field}: ")


@pytest.mark.process
@pytest.mark.parametrize("fields", [{"prompt_name": "query"}, {"prompt": ""}, {"input_type": "query"}])
def test_pretokenized_input_takes_no_prompt(stub: pb_grpc.EmbedderStub, fields: dict[str, Any]) -> None:
    tokens = pb.TokenIds(ids=np.asarray([101, 7592, 102], "<i4").tobytes(), lengths=[3])
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(tokens=tokens, **fields))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value.details()).startswith(f"{next(iter(fields))}: not taken with pre-tokenized input")
    plain = stub.Embed(pb.EmbedRequest(tokens=tokens))  # and the default prompt is not put before ids
    assert list(plain.token_counts) == [3]


# --- the rules, without a server -----------------------------------------------------------------


def test_input_types_map_to_the_models_prompts() -> None:
    named = ModelPrompts({"query": "q: ", "document": "d: "})
    assert [named.text(PromptChoice(input_type=t)) for t in ("query", "passage", "document")] == ["q: ", "d: ", "d: "]
    with pytest.raises(InvalidInput) as caught:
        ModelPrompts({}).text(PromptChoice(input_type="query"))
    assert caught.value.field is Field.INPUT_TYPE and "declares no prompt named query" in caught.value.reason
    assert "it declares none" in caught.value.reason


def test_a_name_is_the_whole_string() -> None:
    assert name_problem("query") is None
    assert name_problem("query\n") is not None  # re's "$" would match before the newline


def test_settings_override_the_folders_prompts(folder: Path) -> None:
    declared = ModelPrompts.of(folder, None, "")
    assert (declared.prompts, declared.default_name) == (PROMPTS, "query")
    settings = Settings.from_env({"KEMBED_PROMPTS": '{"q": "Q: "}', "KEMBED_DEFAULT_PROMPT_NAME": "q"})
    overridden = ModelPrompts.of(folder, settings.prompts, settings.default_prompt_name)
    assert (overridden.prompts, overridden.default_name, overridden.text(PromptChoice())) == ({"q": "Q: "}, "q", "Q: ")


def test_a_default_that_is_not_a_prompt_stops_the_load(bundled_path: Path, tmp_path: Path) -> None:
    folder = prompted_folder(bundled_path, tmp_path, prompts=PROMPTS, default_prompt_name="title")
    with pytest.raises(ModelLoadError, match="default prompt name 'title' is not one of the prompts"):
        EmbeddingModel.load(Settings.from_env({}, model=str(folder)))


# --- the client -----------------------------------------------------------------------------------


@pytest.mark.process
def test_the_clients_take_the_prompt(server: ServerProcess, st: Any) -> None:
    with EmbedClient(server.target) as client:
        np.testing.assert_allclose(
            client.embed(TEXTS, prompt_name="passage"), reference(st, TEXTS, prompt_name="passage"), atol=2e-6
        )
        np.testing.assert_allclose(client.embed(TEXTS, prompt=""), reference(st, TEXTS, prompt=""), atol=2e-6)
        np.testing.assert_allclose(client.embed(TEXTS, input_type="query"), reference(st, TEXTS), atol=2e-6)

    async def literal() -> np.ndarray:
        async with AsyncEmbedClient(server.target) as client:
            return await client.embed(TEXTS, prompt="Represent this: ")

    np.testing.assert_allclose(asyncio.run(literal()), reference(st, TEXTS, prompt="Represent this: "), atol=2e-6)


@pytest.mark.process
def test_the_command_takes_the_prompt_flags(server: ServerProcess, st: Any, capsys: pytest.CaptureFixture[str]) -> None:
    expected = reference(st, TEXTS[:1], prompt_name="passage")[0]
    assert main(["--target", server.target, "--prompt-name", "passage", TEXTS[0]]) == 0
    printed = capsys.readouterr().out.splitlines()[1]
    assert printed.endswith(f"[{', '.join(f'{v:+.4f}' for v in expected[:6])}, ...]"), printed
    with pytest.raises(SystemExit) as exited:
        main(["--target", server.target, "--prompt", "x", "--input-type", "query", TEXTS[0]])
    assert exited.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.process
def test_the_corpus_command_takes_the_prompt(server: ServerProcess, st: Any, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"{text}\n" for text in TEXTS), encoding="utf-8")
    output = tmp_path / "out.npy"
    flags = ["--input", str(corpus), "--output", str(output), "--input-type", "passage"]
    done = subprocess.run(embed_command(server, *flags), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(np.load(output), reference(st, TEXTS, prompt_name="passage"), atol=2e-6)
    flags = ["--input", str(corpus), "--output", str(tmp_path / "none.npy"), "--prompt-name", "title"]
    unknown = subprocess.run(embed_command(server, *flags), capture_output=True, text=True, timeout=600)
    assert unknown.returncode == EXIT_EMBED_FINAL and "prompt_name: 'title' is not one of" in unknown.stderr, unknown


def test_prompts_for_a_model_that_pools_without_them_stop_the_load(bundled_path: Path, tmp_path: Path) -> None:
    """sentence-transformers' include_prompt false leaves the prompt's tokens out of pooling; kembed
    pools them, so it refuses to serve such a model's prompts rather than differ from it."""
    folder = model_copy(
        bundled_path, tmp_path, rewritten=["config_sentence_transformers.json", "1_Pooling/config.json"]
    )
    write_json(folder / "config_sentence_transformers.json", {"prompts": PROMPTS})
    pooling = {"embedding_dimension": 384, "pooling_mode": "mean", "include_prompt": False}
    write_json(folder / "1_Pooling/config.json", pooling)
    with pytest.raises(ModelLoadError, match="include_prompt is false"):
        EmbeddingModel.load(Settings.from_env({}, model=str(folder)))


def test_a_prompt_that_leaves_no_room_for_a_text_stops_the_load(bundled_path: Path, tmp_path: Path) -> None:
    """Truncation cuts the text, never the prompt: a prompt of the model's whole limit has no text to cut."""
    folder = prompted_folder(bundled_path, tmp_path, prompts={"long": "word " * 70})
    with pytest.raises(ModelLoadError, match="prompt 'long' is 70 tokens, leaving no room for a text"):
        EmbeddingModel.load(Settings.from_env({}, model=str(folder), max_input_tokens=MAX_INPUT_TOKENS))
