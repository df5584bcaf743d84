"""The library on asyncio (grpc.aio): :class:`AsyncEmbedClient`, :class:`~kembed.client.EmbedClient`'s
API with ``await``, its splitting, its retries and its :class:`RetryBudget` the same."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TypeVar

import grpc
import numpy as np

from kembed.client.connection import Connection
from kembed.client.embed_client import ClientBase, decode, retry_marker, tokens_request
from kembed.client.requests import Limits, Options, Part, Prompt, located, plan
from kembed.v1 import embedder_pb2 as pb

T = TypeVar("T")


class AsyncEmbedClient(ClientBase[grpc.aio.Channel]):
    """``async with AsyncEmbedClient("host:50051") as client: await client.embed([...])``; the
    arguments are :class:`~kembed.client.EmbedClient`'s. Use it from one event loop."""

    def _open(self, connection: Connection) -> grpc.aio.Channel:
        return connection.aio_channel()

    async def embed(
        self,
        texts: Sequence[str],
        *,
        normalize: bool = True,
        dimensions: int = 0,
        truncate: bool = False,
        priority: str = "interactive",
        chunk: bool | None = None,
        prompt_name: str = "",
        prompt: str | None = None,
        input_type: str = "",
    ) -> np.ndarray:
        options = Options(normalize, dimensions, truncate, priority, chunk, Prompt(prompt_name, prompt, input_type))
        parts = plan(texts, options, await self.limits())
        slots = asyncio.Semaphore(self._in_flight)

        async def send(part: Part) -> pb.EmbedResponse:
            async with slots:
                return await self._embed_part(part)

        tasks = [asyncio.ensure_future(send(part)) for part in parts]  # each takes its slot in order
        try:
            answers = await asyncio.gather(*tasks)
        except BaseException:  # the first failure is the call's: the other parts are cancelled
            for task in tasks:
                task.cancel()
            raise
        return np.concatenate([decode(answer) for answer in answers])

    async def embed_tokens(
        self, sequences: Sequence[Sequence[int]], *, normalize: bool = True, dimensions: int = 0
    ) -> np.ndarray:
        return decode(await self.embed_request(tokens_request(sequences, normalize, dimensions)))

    async def embed_request(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        return await self._with_retries(
            lambda earlier: self._stub.Embed(request, timeout=self._timeout, metadata=retry_marker(earlier))
        )

    async def info(self) -> pb.InfoResponse:
        return await self._with_retries(lambda _: self._stub.Info(pb.InfoRequest(), timeout=self._timeout))

    async def limits(self) -> Limits:
        if self._limits is None:
            self._limits = Limits.of(self.connection, await self.info())
        return self._limits

    async def _embed_part(self, part: Part) -> pb.EmbedResponse:
        try:
            return await self.embed_request(part.request)
        except grpc.RpcError as error:
            raise located(error, part) from None

    async def _with_retries(self, call: Callable[[int], Awaitable[T]]) -> T:
        retrying = self._retrying
        deadline = retrying.deadline()
        attempt = 0
        while True:
            attempt += 1
            if held := retrying.held_s():  # another request's pushback holds this one too
                await asyncio.sleep(held)
            try:
                answer = await call(attempt - 1)  # the earlier attempts: a retry says so (retry_marker)
            except grpc.RpcError as error:
                wait = retrying.wait_s(error, attempt, deadline)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
            else:
                retrying.answered()
                return answer

    async def close(self) -> None:
        await self._channel.close(None)

    async def __aenter__(self) -> AsyncEmbedClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()
