"""``python -m kembed.client embed``: the corpus command's flags, its summary and its exit codes
(0 done, 1 failed, 2 bad flags, 3 failed for good, 130 interrupted: :mod:`kembed.contract`).

``--summary-file PATH`` gets one JSON object at exit, however the run ended (the operator points it
at ``/dev/termination-log``, so a pod's last state says how far its shard got): ``rows`` in the
output or part, ``embedded`` by this run (``blank`` of them blank lines, written as rows of zeros),
``shard`` (``"I/N"`` or null), ``output`` (the output, or the part's name once complete) and
``complete``; then how the run went: its ``seconds`` and the server's answers (``retries``,
``refusals``, ``reconnects``), as the summary line on stdout says them; and ``error``, the message
of a run that failed (null otherwise), cut to ``MAX_ERROR_CHARS``:
a pod's termination message holds 4 KiB at most.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kembed.client import connection
from kembed.client.corpus import CorpusError, FinalError
from kembed.client.corpus.reader import STDIN, Shard
from kembed.client.corpus.run import CorpusRun, Interrupted, Summary, embed_corpus
from kembed.client.corpus.stream import Request
from kembed.client.corpus.writers import FORMATS
from kembed.client.flags import (
    add_chunk,
    add_dimensions,
    add_priority,
    add_prompt,
    add_truncation_direction,
    at_least,
    prompt_of,
)
from kembed.contract import EXIT_EMBED_FAILED, EXIT_EMBED_FINAL, EXIT_EMBED_INTERRUPTED

MAX_ERROR_CHARS = 500


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
    parser.add_argument(
        "--shard",
        type=_shard,
        metavar="I/N",
        help="embed shard I of N of the input file (a byte range aligned to lines) into OUT's part I "
        "(OUT.part-IIIII-of-NNNNN.EXT); the last shard to finish writes OUT.manifest.json",
    )
    parser.add_argument("--batch-texts", type=at_least(int, 1), default=32, help="texts per request (default 32)")
    parser.add_argument("--in-flight", type=at_least(int, 1), default=8, help="requests in flight (default 8)")
    parser.add_argument(
        "--truncate",
        action=argparse.BooleanOptionalAction,
        help="cut texts longer than the model's limit (default without --chunk); --no-truncate: such a text "
        "fails the run",
    )
    add_truncation_direction(parser)
    add_chunk(parser)
    add_priority(parser, "batch")
    add_prompt(parser)
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
    parser.add_argument("--summary-file", type=Path, help="write a JSON summary of the run here at exit")
    return parser


def _shard(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str]) -> int:
    flags = parser()
    args = flags.parse_args(argv)
    if args.shard is not None and args.input == STDIN:
        flags.error("--shard: a shard is a byte range of a file; stdin cannot be split (give --input FILE)")
    if args.chunk and args.truncate:
        flags.error("--chunk, --truncate: a long text is either chunked or cut; choose one")
    truncate = args.truncate if args.truncate is not None else not args.chunk
    run = CorpusRun(
        connection=connection.from_arguments(flags, args),
        input=args.input,
        output=args.output,
        request=Request(
            args.dimensions, truncate, args.priority, args.chunk, prompt_of(args), args.truncation_direction
        ),
        output_format=args.format,
        jsonl_field=args.jsonl_field,
        shard=args.shard,
        batch_texts=args.batch_texts,
        in_flight=args.in_flight,
        give_up_after_s=args.give_up_after,
        progress=args.progress,
    )
    summary = Summary(run.part, run.shard)
    try:
        embed_corpus(run, summary)
    except CorpusError as error:
        summary.error = str(error)
        print(f"kembed embed: {error}", file=sys.stderr)
        return exit_code(error)
    except Exception as error:  # a fault of the command's own: its traceback follows; the summary names it
        summary.error = f"{type(error).__name__}: {error}"
        raise
    finally:
        if args.summary_file is not None:
            write_summary(args.summary_file, summary)
    print(describe(summary))
    return 0


def exit_code(error: CorpusError) -> int:
    if isinstance(error, Interrupted):
        return EXIT_EMBED_INTERRUPTED
    return EXIT_EMBED_FINAL if isinstance(error, FinalError) else EXIT_EMBED_FAILED


def describe(summary: Summary) -> str:
    counts = summary.counts
    rate = summary.embedded / summary.seconds if summary.seconds else 0.0
    said = (
        f"{summary.output}: {summary.rows} x {summary.dimensions} ({summary.embedded} embedded, {summary.skipped} "
        f"already there; {summary.blank} blank lines as rows of zeros) in {summary.seconds:.1f} s, "
        f"{rate:.1f} texts/s; {counts.retries} retries "
        f"({counts.refusals} refusals), {counts.reconnects} reconnects"
    )
    return said if summary.manifest is None else f"{said}\nevery part is complete: {summary.manifest}"


def write_summary(path: Path, summary: Summary) -> None:
    record = {
        "rows": summary.rows,
        "embedded": summary.embedded,
        "blank": summary.blank,
        "shard": None if summary.shard is None else str(summary.shard),
        "output": str(summary.output),
        "complete": summary.complete,
        "seconds": round(summary.seconds, 3),
        "retries": summary.counts.retries,
        "refusals": summary.counts.refusals,
        "reconnects": summary.counts.reconnects,
        "error": summary.error[:MAX_ERROR_CHARS] or None,
    }
    try:
        path.write_text(json.dumps(record) + "\n")
    except OSError as error:
        print(f"kembed embed: --summary-file: {error}", file=sys.stderr)
