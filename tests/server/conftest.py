"""Shared fixtures: the bundled all-MiniLM-L6-v2, loaded once per session (real weights, no mocks)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kembed.config.settings import Settings
from kembed.engine.model import EmbeddingModel, resolve_model_path
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """A failed test's report ends with the logs of the servers still running: on CI they are
    gone with the machine, and a refusal or a restart the test did not expect is only there."""
    report = yield
    if report.failed:
        for server in ServerProcess.running:
            report.sections.append((f"server log: {server.log}", server.tail()))
    return report


@pytest.fixture(scope="session")
def bundled_path() -> Path:
    return resolve_model_path(Settings.from_env({}))[1]


@pytest.fixture(scope="session")
def hf_tokenizer(bundled_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(bundled_path)


@pytest.fixture(scope="session")
def stock_model() -> EmbeddingModel:
    return EmbeddingModel.load(Settings.from_env({}))


@pytest.fixture(scope="session")
def st_model(bundled_path: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(bundled_path), device="cpu")


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pb_grpc.EmbedderStub]:
    """A channel to the module's own ``server`` fixture (a module that defines its own stub keeps it)."""
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.EmbedderStub(channel)
