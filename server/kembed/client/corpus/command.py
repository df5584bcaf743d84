"""``python -m kembed.client embed``: the corpus command's flags, its summary and its exit codes
(0 done, 1 failed, 2 bad flags, 130 interrupted)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kembed.client import connection
from kembed.client.corpus import CorpusError
from kembed.client.corpus.run import CorpusRun, Interrupted, embed_corpus
from kembed.client.corpus.stream import PRIORITIES
from kembed.client.corpus.writers import FORMATS
from kembed.client.flags import add_dimensions, at_least


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kembed.client embed",
        description="embed a corpus (a file or stdin, one text per line or JSONL) into .npy, JSONL or Parquet, "
        "in input order; run the same command again to go on after an interruption",
    )
    connection.add_arguments(parser)
    add_dimensions(parser)
    parser.add_argument("--input", default="-", help="a text file, one text per line, or JSONL; - (default): stdin")
    parser.add_argument(
        "--jsonl-field", help="read the input as JSONL and embed this field of each line (default: text for *.jsonl)"
    )
    parser.add_argument("--output", required=True, type=Path, help="FILE.npy, FILE.jsonl or FILE.parquet (pyarrow)")
    parser.add_argument("--format", choices=FORMATS, help="the output's format, if not its extension")
    parser.add_argument("--batch-texts", type=at_least(int, 1), default=32, help="texts per request (default 32)")
    parser.add_argument("--in-flight", type=at_least(int, 1), default=8, help="requests in flight (default 8)")
    parser.add_argument(
        "--truncate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cut texts longer than the model's limit (default); --no-truncate: such a text fails the run",
    )
    parser.add_argument(
        "--priority",
        choices=PRIORITIES,
        default="batch",
        help="the requests' class (default batch: an ingest, which queries go ahead of)",
    )
    parser.add_argument(
        "--give-up-after",
        type=at_least(float, 0.0),
        default=300.0,
        metavar="SECONDS",
        help="stop when no row was written for this long (default 300); the rows written are kept",
    )
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="a progress bar on stderr (tqdm)"
    )
    return parser


def main(argv: list[str]) -> int:
    flags = parser()
    args = flags.parse_args(argv)
    run = CorpusRun(
        connection=connection.from_arguments(flags, args),
        input=args.input,
        output=args.output,
        output_format=args.format,
        jsonl_field=args.jsonl_field,
        batch_texts=args.batch_texts,
        in_flight=args.in_flight,
        dimensions=args.dimensions,
        truncate=args.truncate,
        priority=args.priority,
        give_up_after_s=args.give_up_after,
        progress=args.progress,
    )
    try:
        summary = embed_corpus(run)
    except Interrupted as interrupted:
        print(f"kembed embed: {interrupted}", file=sys.stderr)
        return 130
    except CorpusError as error:
        print(f"kembed embed: {error}", file=sys.stderr)
        return 1
    counts = summary.counts
    print(
        f"{args.output}: {summary.rows} x {summary.dimensions} ({counts.embedded} embedded, {summary.skipped} "
        f"already there) in {summary.seconds:.1f} s, {counts.embedded / summary.seconds:.1f} texts/s; "
        f"{counts.retries} retries, {counts.reconnects} reconnects"
    )
    return 0
