"""``python -m kembed.client``: embed a few texts and print their shapes and timings, or, with
``embed`` as the first argument, embed a corpus (:mod:`kembed.client.corpus.command`).
``python -m kembed.client -- embed`` embeds the word "embed"."""

from __future__ import annotations

import argparse
import sys

from kembed.client import connection
from kembed.client.embed_client import EmbedClient, decode
from kembed.client.flags import add_dimensions
from kembed.v1 import embedder_pb2 as pb


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["embed"]:
        from kembed.client.corpus.command import main as embed_corpus  # only this form needs it

        return embed_corpus(args[1:])
    return embed_texts(args)


def embed_texts(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kembed.client", description="embed texts with a kembed server")
    connection.add_arguments(parser)
    add_dimensions(parser)
    parser.add_argument("texts", nargs="+")
    args = parser.parse_args(argv)
    with EmbedClient(connection.from_arguments(parser, args)) as client:
        info = client.info()
        response = client.embed_request(pb.EmbedRequest(texts=args.texts, dimensions=args.dimensions))
    vectors = decode(response)
    print(f"model {info.model_id}: {vectors.shape[0]} x {vectors.shape[1]} in {response.timings.total_ms:.1f} ms")
    for text, vector in zip(args.texts, vectors, strict=True):
        print(f"{text[:40]!r:44} [{', '.join(f'{v:+.4f}' for v in vector[:6])}, ...]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
