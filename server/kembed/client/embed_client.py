"""The blocking library: :class:`EmbedClient`, the asyncio core (:class:`~kembed.client.AsyncEmbedClient`)
driven on a private event loop in a thread of its own, so both clients split, pace and retry alike."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from kembed.client.aio import AsyncEmbedClient
from kembed.client.connection import Connection
from kembed.client.requests import Limits
from kembed.client.retries import RetryBudget
from kembed.v1 import embedder_pb2 as pb

__all__ = ["EmbedClient", "RetryBudget"]

T = TypeVar("T")


class EmbedClient:
    """``with EmbedClient("host:50051") as client: client.embed([...])``: the arguments and the
    methods are :class:`~kembed.client.AsyncEmbedClient`'s, without ``await``. Safe to call from
    several threads: their calls share one window of parts and one retry budget."""

    def __init__(self, target: str | Connection, **settings: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kembed-client", daemon=True)
        self._thread.start()
        self._client = self._run(_opened(target, settings))  # its channel belongs to the loop
        self.connection = self._client.connection
        self.retry_budget = self._client.retry_budget

    @property
    def retries(self) -> int:
        """How many attempts were retried, for callers that want to know."""
        return self._client.retries

    @property
    def refusals(self) -> int:
        """How many attempts the server refused (RESOURCE_EXHAUSTED), retried or not."""
        return self._client.refusals

    def embed(self, texts: Sequence[str], **options: Any) -> np.ndarray:
        """:meth:`AsyncEmbedClient.embed <kembed.client.AsyncEmbedClient.embed>`: any number of texts,
        with its keyword options (normalize, dimensions, truncate, priority, chunk, prompt_name,
        prompt, input_type, encoding, truncation_direction)."""
        return self._run(self._client.embed(texts, **options))

    def embed_tokens(
        self, sequences: Sequence[Sequence[int]], *, normalize: bool = True, dimensions: int = 0
    ) -> np.ndarray:
        """Pre-tokenized input (ids including the model's special tokens), as one request."""
        return self._run(self._client.embed_tokens(sequences, normalize=normalize, dimensions=dimensions))

    def embed_request(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        return self._run(self._client.embed_request(request))

    def info(self) -> pb.InfoResponse:
        return self._run(self._client.info())

    def limits(self) -> Limits:
        """What one request may carry: the server's limits, read once."""
        return self._run(self._client.limits())

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        """``call`` on the client's loop, waited for here; interrupted (^C), it is cancelled there."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(call, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> EmbedClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


async def _opened(target: str | Connection, settings: dict[str, Any]) -> AsyncEmbedClient:
    return AsyncEmbedClient(target, **settings)
