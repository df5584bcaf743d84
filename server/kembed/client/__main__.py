"""``python -m kembed.client``: embed a few texts and print their shapes and timings, or, with
``embed`` as the first argument, embed a corpus (:mod:`kembed.client.corpus.command`).
``python -m kembed.client -- embed`` embeds the word "embed". An error the server or the connection
gives is one line on stderr (``INVALID_ARGUMENT: texts[0]: ...``), exit 1."""

from __future__ import annotations

import argparse
import sys
import time

from kembed.client import connection
from kembed.client.embed_client import EmbedClient
from kembed.client.errors import EmbedError
from kembed.client.flags import add_chunk, add_dimensions, add_priority, add_prompt, add_truncation_direction

PROG = "python -m kembed.client"
COMMANDS = f"""commands:
  TEXT...          embed these texts and print the first values of each vector (this command)
  embed ...        embed a corpus (a file or stdin) into .npy, JSONL or Parquet, resumably:
                   {PROG} embed --help
  -- embed         embed the word "embed" """


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["embed"]:
        from kembed.client.corpus.command import main as embed_corpus  # only this form needs it

        return embed_corpus(args[1:])
    return embed_texts(args)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [options] TEXT... | {PROG} embed [options]",
        description="embed texts with a kembed server",
        epilog=COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    connection.add_arguments(parser)
    add_dimensions(parser)
    parser.add_argument(
        "--truncate", action="store_true", help="cut texts longer than the model's limit instead of an error"
    )
    add_truncation_direction(parser)
    add_chunk(parser)
    add_priority(parser, "interactive")
    add_prompt(parser)
    parser.add_argument("texts", nargs="+", metavar="TEXT")
    return parser


def embed_texts(argv: list[str]) -> int:
    flags = parser()
    args = flags.parse_args(argv)
    started = time.monotonic()
    try:
        with EmbedClient(connection.from_arguments(flags, args)) as client:
            vectors = client.embed(
                args.texts,
                dimensions=args.dimensions,
                truncate=args.truncate,
                truncation_direction=args.truncation_direction,
                priority=args.priority,
                chunk=args.chunk,
                prompt_name=args.prompt_name,
                prompt=args.prompt,
                input_type=args.input_type,
            )
            model = client.info().model_id
    except EmbedError as error:  # the server's code and message, on one line
        print(f"kembed.client: {error}", file=sys.stderr)
        return 1
    took_ms = (time.monotonic() - started) * 1000
    print(f"model {model}: {vectors.shape[0]} x {vectors.shape[1]} in {took_ms:.1f} ms")
    for text, vector in zip(args.texts, vectors, strict=True):
        print(f"{text[:40]!r:44} [{', '.join(f'{v:+.4f}' for v in vector[:6])}, ...]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
