"""kembed's client: the library, the one-shot CLI and the corpus command (docs/client.md).

    from kembed.client import EmbedClient
    with EmbedClient("127.0.0.1:50051") as client:
        vectors = client.embed(["hello world"])   # float32 [1, 384], L2-normalised

- :mod:`.connection`: the target, TLS files and channel options, shared by everything below.
- :mod:`.aio`: :class:`AsyncEmbedClient`, the core: any number of texts, cut into parts within the
  server's limits (:mod:`.requests`), a window of them out at once paced by the server's refusals
  (:mod:`.window`), retried politely within one deadline (:mod:`.retries`).
- :mod:`.embed_client`: :class:`EmbedClient`, the same blocking: the core on a private event loop.
- :mod:`.errors`: :class:`EmbedError` and its kinds, what every failure is raised as.
- :mod:`.__main__`: ``python -m kembed.client [--target ...] TEXT...`` prints shapes and timings;
  ``python -m kembed.client embed ...`` is the corpus command (:mod:`.corpus`).

It imports nothing of the server (no torch, no tokenizer): ``pip install 'kembed[client]'`` is all
it needs, and a test holds it to that.
"""

from kembed.client.aio import AsyncEmbedClient
from kembed.client.connection import Connection
from kembed.client.embed_client import EmbedClient
from kembed.client.errors import EmbedError, InvalidInput, Refused, Unavailable
from kembed.client.requests import decode

__all__ = [
    "AsyncEmbedClient",
    "Connection",
    "EmbedClient",
    "EmbedError",
    "InvalidInput",
    "Refused",
    "Unavailable",
    "decode",
]
