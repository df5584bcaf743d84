"""The API key at both edges (``KEMBED_API_KEY_FILE``, read by :mod:`kembed.plumbing.api_keys`): decided from
a call's head alone, before its body is read or anything is done for it.

- REST (``rest.py``): every route but the two that describe the API (``/openapi.json`` and
  ``/docs``, which a browser opens without a header) needs ``Authorization: Bearer KEY``; else 401 in
  OpenAI's error shape, ``code`` ``invalid_api_key``, as OpenAI answers one, with ``WWW-Authenticate``.
- gRPC (:class:`KeyCheck`): every method of the Embedder service (Embed, EmbedStream, Info) needs
  ``authorization: Bearer KEY`` metadata; else UNAUTHENTICATED before its message is read. gRPC health
  stays open (kubelet's gRPC probe sends no metadata), and so does reflection, which describes the
  API as ``/openapi.json`` does.

Both are counted in ``kembed_requests_total`` (``401``, ``UNAUTHENTICATED``). Without keys nothing is
checked, and the gRPC server has no interceptor at all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from kembed.contract import GRPC_SERVICE
from kembed.frontend.openai_api import ApiError
from kembed.metrics import FrontendMetrics
from kembed.plumbing.api_keys import ApiKeys

NO_KEY = "no API key: send one as Authorization: Bearer KEY"
WRONG_KEY = "the API key is not one this server takes"
AUTHORIZATION = "authorization"  # gRPC's metadata keys are lower case
_GUARDED = f"/{GRPC_SERVICE}/"


def refusal(keys: ApiKeys, authorization: str | None) -> ApiError | None:
    """A REST call's 401, or None when its ``Authorization`` header presents a key."""
    if keys.allows(authorization):
        return None
    error = ApiError(401, WRONG_KEY if authorization else NO_KEY, "invalid_request_error", None, "invalid_api_key")
    error.headers["WWW-Authenticate"] = 'Bearer realm="kembed"'
    return error


class KeyCheck(grpc.aio.ServerInterceptor):
    """The gRPC server's interceptor: a call to the Embedder service without a key is answered
    UNAUTHENTICATED by a handler of its own kind that reads nothing."""

    def __init__(self, keys: ApiKeys, metrics: FrontendMetrics) -> None:
        self._keys = keys
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_GUARDED):
            return handler
        presented = _authorization(details.invocation_metadata)
        if self._keys.allows(presented):
            return handler
        self._metrics.answered("grpc", grpc.StatusCode.UNAUTHENTICATED.name)
        return _refusing(handler, WRONG_KEY if presented else NO_KEY)


def _authorization(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            return value if isinstance(value, str) else None
    return None


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED; its requests are never parsed."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[handler.request_streaming, handler.response_streaming]
    return kind(refuse)
