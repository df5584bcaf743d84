"""The corpus command's pure parts (kembed.client.corpus): input readers, the resumable writers, pacing and
ordering with a fake clock, and the CLI's argument checks. The stream driver runs end to end
against a real server in test_bulk_serving."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kembed.client.__main__ import main
from kembed.client.corpus import CorpusError
from kembed.client.corpus.reader import Span, ThreadedSpans, count_lines, read_texts, spans, texts
from kembed.client.corpus.run import Bar
from kembed.client.corpus.stream import BACKOFF_S, MAX_BACKOFF_S, InOrder, Pacing, Request, RequestSize, embed_request
from kembed.client.corpus.writers import ParquetWriter, Writer, format_of, open_writer
from kembed.v1 import embedder_pb2 as pb

DIMS = 4


def rows(start: int, count: int) -> np.ndarray:
    """Distinct float32 rows, some values not representable in few decimal digits."""
    values = np.arange(start * DIMS, (start + count) * DIMS, dtype=np.float32).reshape(count, DIMS)
    return values / np.float32(3.0) + np.float32(1e-7)


# --- inputs -----------------------------------------------------------------------------------


def test_lines_are_texts_and_crlf_empty_and_unterminated_lines_read_as_expected():
    lines = [b"first\n", b"windows\r\n", b"\n", b"caf\xc3\xa9 \xe6\x9d\xb1\xe4\xba\xac\n", b"no newline"]
    assert list(read_texts(lines, None)) == ["first", "windows", "", "café 東京", "no newline"]


def test_jsonl_reads_the_named_field():
    lines = [b'{"id": 1, "body": "one"}\n', b'{"body": "two \\u00e9", "x": null}\n']
    assert list(read_texts(lines, "body")) == ["one", "two é"]


BAD_LINES = {
    "not JSON": (b'{"text": "a"}\n{broken\n', "text", "input line 2: not a JSON object"),
    "not an object": (b'["text"]\n', "text", "input line 1: no field 'text'"),
    "no field": (b'{"text": "a"}\n{"body": "b"}\n', "text", "input line 2: no field 'text'"),
    "not a string": (b'{"text": 5}\n', "text", "input line 1: field 'text' is not a string: 5"),
    "lone surrogate": (b'{"text": "\\ud800"}\n', "text", "input line 1: field 'text' holds a lone surrogate"),
    "blank JSONL line": (b'{"text": "a"}\n\n', "text", "input line 2: not a JSON object"),
    "bad UTF-8": (b"fine\nbad \xff byte\n", None, "input line 2: not UTF-8 (byte 5"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_input_names_its_line(case: str):
    data, field, message = BAD_LINES[case]
    with pytest.raises(CorpusError) as caught:
        list(read_texts(data.splitlines(keepends=True), field))
    assert str(caught.value).startswith(message), caught.value


@pytest.mark.parametrize("data", [b"", b"a", b"a\n", b"a\nb", b"a\nb\n", b"\n\n", b"x\r\ny\r\n"])
def test_count_lines_counts_what_is_read(tmp_path: Path, data: bytes):
    source = tmp_path / "corpus.txt"
    source.write_bytes(data)
    assert count_lines(str(source)) == len(list(texts(str(source), None)))


def test_a_missing_input_is_named(tmp_path: Path):
    with pytest.raises(CorpusError, match=r"^--input: .*No such file"):
        count_lines(str(tmp_path / "absent.txt"))


def test_batches_start_after_the_rows_already_written():
    cut = list(spans(iter("abcdefg"), size=3, skip=2))
    assert cut == [Span(2, ["c", "d", "e"]), Span(5, ["f", "g"])]
    assert cut[1].lines == "input lines 6-7"
    assert list(spans(iter("abc"), size=3, skip=3)) == []


def test_the_texts_before_a_bad_line_are_batched_before_its_error():
    def failing() -> Iterator[str]:
        yield from "abc"
        raise CorpusError("input line 4: no field 'text'")

    cut = spans(failing(), size=2, skip=0)
    assert [next(cut), next(cut)] == [Span(0, ["a", "b"]), Span(2, ["c"])]
    with pytest.raises(CorpusError, match="input line 4"):
        next(cut)


def test_a_batch_splits_into_consecutive_rows():
    head, rest = Span(10, ["a", "b", "c"]).split(1)
    assert (head, rest) == (Span(10, ["a"]), Span(11, ["b", "c"]))


def test_an_input_shorter_than_the_output_is_refused():
    with pytest.raises(CorpusError, match=r"^--output already holds 5 rows but the input has only 3 texts"):
        list(spans(iter("abc"), size=2, skip=5))


def test_threaded_batches_hand_over_every_batch_then_the_error_after_them():
    def source() -> Iterator[Span]:
        yield Span(0, ["a"])
        yield Span(1, ["b"])
        raise CorpusError("input line 3: broken")

    async def drain() -> list[Span | None]:
        feed = ThreadedSpans(source())
        taken = [await feed.next(), await feed.next()]
        with pytest.raises(CorpusError, match="input line 3"):
            await feed.next()
        return taken

    assert asyncio.run(drain()) == [Span(0, ["a"]), Span(1, ["b"])]


# --- outputs ----------------------------------------------------------------------------------


def read_back(path: Path, output_format: str) -> np.ndarray:
    if output_format == "npy":
        return np.load(path)
    if output_format == "jsonl":
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["index"] for r in records] == list(range(len(records)))
        return np.asarray([r["embedding"] for r in records], dtype=np.float32).reshape(-1, DIMS)
    import pyarrow.parquet as pq

    column = pq.read_table(path).column("embedding").combine_chunks()
    return column.flatten().to_numpy().reshape(-1, DIMS)


FORMATS = ["npy", "jsonl", pytest.param("parquet", marks=pytest.mark.skipif("not has_pyarrow()"))]


def has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def write_finished(path: Path, output_format: str, *blocks: np.ndarray) -> int:
    """Open (or resume) the output, append the blocks and finish it; the rows it held before."""
    writer = open_writer(path, output_format, DIMS)
    held = writer.rows
    for block in blocks:
        writer.append(block)
    writer.finish()
    writer.close()
    return held


@pytest.mark.parametrize("output_format", FORMATS)
def test_rows_written_in_order_read_back_exactly(tmp_path: Path, output_format: str):
    path = tmp_path / f"out.{output_format}"
    write_finished(path, output_format, rows(0, 3), rows(3, 2))
    np.testing.assert_array_equal(read_back(path, output_format), rows(0, 5))  # exact: float32 round trip


@pytest.mark.parametrize("output_format", FORMATS)
def test_a_reopened_output_goes_on_after_its_committed_rows(tmp_path: Path, output_format: str):
    path = tmp_path / f"out.{output_format}"
    writer = open_writer(path, output_format, DIMS)
    writer.append(rows(0, 3))
    writer.commit()
    writer.append(rows(3, 2))  # appended, never committed: a killed run
    writer.close()
    # The .npy header and Parquet's staging header count committed rows; a complete JSONL line is a row.
    held = 5 if output_format == "jsonl" else 3
    assert write_finished(path, output_format, rows(held, 7 - held)) == held
    np.testing.assert_array_equal(read_back(path, output_format), rows(0, 7))


@pytest.mark.parametrize("output_format", FORMATS)
def test_a_finished_output_grows_when_the_input_does(tmp_path: Path, output_format: str):
    path = tmp_path / f"out.{output_format}"
    for start, count in ((0, 2), (2, 3)):
        assert write_finished(path, output_format, rows(start, count)) == start
    np.testing.assert_array_equal(read_back(path, output_format), rows(0, 5))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no staging left behind


@pytest.mark.parametrize("output_format", FORMATS)
def test_an_empty_input_gives_an_empty_output(tmp_path: Path, output_format: str):
    path = tmp_path / f"out.{output_format}"
    write_finished(path, output_format)
    assert read_back(path, output_format).shape == (0, DIMS)


def test_npy_saved_by_numpy_can_be_continued(tmp_path: Path):
    path = tmp_path / "out.npy"
    np.save(path, rows(0, 3))
    assert write_finished(path, "npy", rows(3, 1)) == 3
    np.testing.assert_array_equal(np.load(path), rows(0, 4))


TORN_TAILS = {
    "npy": rows(2, 1).tobytes()[:7],  # half a row after the committed ones: a write cut short
    "jsonl": b'{"index": 2, "embedding": [0.1, ',  # a line without its end
}


@pytest.mark.parametrize("output_format", TORN_TAILS)
def test_a_torn_tail_is_dropped_and_the_output_stays_readable(tmp_path: Path, output_format: str):
    path = tmp_path / f"out.{output_format}"
    write_finished(path, output_format, rows(0, 2))
    with path.open("ab") as file:
        file.write(TORN_TAILS[output_format])
    if output_format == "npy":
        assert np.load(path).shape == (2, DIMS)  # the header is the commit record: still a valid array
    assert write_finished(path, output_format) == 2
    np.testing.assert_array_equal(read_back(path, output_format), rows(0, 2))


MISMATCHED = {
    "npy of other dimensions": ("out.npy", lambda p: np.save(p, np.zeros((2, 8), np.float32)), "8-dimensional rows"),
    "npy of float64": ("out.npy", lambda p: np.save(p, np.zeros((2, DIMS))), "float64"),
    "not npy": ("out.npy", lambda p: p.write_text("hello"), "not a .npy file"),
    "jsonl of other dimensions": (
        "out.jsonl",
        lambda p: p.write_text('{"index": 0, "embedding": [1.0, 2.0]}\n'),
        "2-dimensional rows",
    ),
    "jsonl not ours": ("out.jsonl", lambda p: p.write_text('{"a": 1}\n'), "not a row kembed writes"),
    "jsonl index off": ("out.jsonl", lambda p: p.write_text('{"index": 4, "embedding": [1, 2, 3, 4]}\n'), "index 4"),
}


@pytest.mark.parametrize("case", MISMATCHED)
def test_an_output_this_run_cannot_continue_is_refused(tmp_path: Path, case: str):
    name, make, message = MISMATCHED[case]
    path = tmp_path / name
    make(path)
    before = path.read_bytes()
    with pytest.raises(CorpusError, match=f"^--output: .*{message}"):
        open_writer(path, format_of(path, None), DIMS)
    assert path.read_bytes() == before  # untouched


def test_parquet_interrupted_stays_in_staging_until_finished(tmp_path: Path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "out.parquet"
    writer: Writer = ParquetWriter(path, DIMS)
    writer.append(rows(0, 3))
    writer.commit()
    writer.close()
    assert not path.exists() and (tmp_path / "out.parquet.partial.npy").exists()
    resumed = ParquetWriter(path, DIMS)
    assert resumed.rows == 3
    resumed.append(rows(3, 1))
    resumed.finish()
    resumed.close()
    np.testing.assert_array_equal(read_back(path, "parquet"), rows(0, 4))


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)  # as if not installed
    with pytest.raises(CorpusError, match=r"^--output: Parquet needs pyarrow"):
        ParquetWriter(tmp_path / "out.parquet", DIMS)


@pytest.mark.parametrize(
    ("name", "named", "expected"),
    [("a.npy", None, "npy"), ("a.JSONL", None, "jsonl"), ("a.parquet", None, "parquet"), ("a.bin", "npy", "npy")],
)
def test_format_from_the_extension_or_the_flag(name: str, named: str | None, expected: str):
    assert format_of(Path(name), named) == expected


def test_an_unknown_extension_without_format_is_refused():
    with pytest.raises(CorpusError, match=r"^--output: no format named by 'a\.txt'"):
        format_of(Path("a.txt"), None)


# --- pacing and ordering ----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pacing(clock: FakeClock, give_up_s: float = 60.0) -> Pacing:
    return Pacing(give_up_s, clock=clock, jitter=lambda: 1.0)


def test_a_refusal_pauses_for_its_pushback():
    clock = FakeClock()
    pace = pacing(clock)
    pace.refused(1500, "RESOURCE_EXHAUSTED")
    assert pace.wait_s() == pytest.approx(1.5)
    pace.refused(200, "RESOURCE_EXHAUSTED")  # a shorter one does not cut the pause
    assert pace.wait_s() == pytest.approx(1.5)
    clock.now += 1.5
    assert pace.wait_s() == 0


def test_failures_back_off_exponentially_up_to_a_cap_and_reset_on_progress():
    clock = FakeClock()
    pace = pacing(clock, give_up_s=1e9)
    waits = []
    for _ in range(10):
        pace.failed("UNAVAILABLE")
        waits.append(pace.wait_s())
        clock.now += waits[-1]
    assert waits[:4] == pytest.approx([BACKOFF_S, 2 * BACKOFF_S, 4 * BACKOFF_S, 8 * BACKOFF_S])
    assert waits[-1] == MAX_BACKOFF_S
    pace.progressed()
    pace.refused(0, "RESOURCE_EXHAUSTED without a time")  # backs off from the start again
    assert pace.wait_s() == pytest.approx(BACKOFF_S)


def test_it_gives_up_only_after_give_up_s_without_a_row_written():
    clock = FakeClock()
    pace = pacing(clock, give_up_s=60)
    clock.now += 50
    pace.failed("UNAVAILABLE: warming up")
    pace.progressed()
    clock.now += 60
    pace.failed("UNAVAILABLE: warming up")  # exactly the limit: still going
    clock.now += 1
    with pytest.raises(CorpusError, match=r"^gave up: no row written for 61 s \(--give-up-after\); last: UNAVAILABLE"):
        pace.failed("UNAVAILABLE: warming up")


def test_a_refusal_halves_the_request_size_once_per_generation_and_successes_grow_it_back():
    size = RequestSize(32)
    for _ in range(8):  # eight 32-text requests refused together: halved once
        size.refused(32)
    assert size.texts == 16
    size.refused(16)
    size.refused(5)
    assert size.texts == 2
    size.refused(1)
    assert size.texts == 1  # never below one text
    grown = []
    for _ in range(12):
        size.succeeded(size.texts)
        grown.append(size.texts)
    assert grown == [2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 18, 22]
    size.succeeded(1)  # a small leftover piece succeeding says nothing about the size
    assert size.texts == 22
    for _ in range(5):
        size.succeeded(size.texts)
    assert size.texts == 32  # up to --batch-texts, not beyond


@pytest.mark.parametrize(
    ("arrivals", "written"),
    [
        ([0, 2, 5], [[0], [2], [5]]),  # in order: each goes at once
        ([5, 2, 0], [[], [], [0, 2, 5]]),  # reversed: all wait for the first
        ([2, 0, 5], [[], [0, 2], [5]]),
    ],
)
def test_rows_leave_in_input_order(arrivals: list[int], written: list[list[int]]):
    sizes = {0: 2, 2: 3, 5: 1}  # batches of rows 0-1, 2-4, 5
    order = InOrder(next_row=0)
    for first, expected in zip(arrivals, written, strict=True):
        due = order.add(first, np.full((sizes[first], DIMS), first, np.float32))
        assert [int(block[0, 0]) for block in due] == expected
    assert order.next_row == 6


def test_the_request_carries_the_job_settings_and_the_rows_it_is_for():
    request = embed_request(Span(64, ["a", "b"]), Request(dimensions=128, truncate=True))
    assert list(request.texts) == ["a", "b"]
    assert (request.dimensions, request.truncate, request.request_id) == (128, True, "64")
    assert request.priority == pb.PRIORITY_BATCH  # an ingest, unless told otherwise
    asked = embed_request(Span(0, ["a"]), Request(dimensions=0, truncate=False, priority="interactive"))
    assert asked.priority == pb.PRIORITY_INTERACTIVE
    assert not request.HasField("normalize")  # the server's default: normalised


# --- the CLI ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-texts", "0"], "argument --batch-texts: must be at least 1, not 0"),
        (["--in-flight", "x"], "argument --in-flight: invalid int value: 'x'"),
        (["--dimensions", "-1"], "argument --dimensions: must be at least 0, not -1"),
        (["--format", "csv"], "argument --format: invalid choice: 'csv'"),
        (["--priority", "urgent"], "argument --priority: invalid choice: 'urgent'"),
    ],
)
def test_bad_flags_are_usage_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        main(["embed", "--output", "out.npy", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_an_output_of_unknown_format_fails_before_connecting(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a\n")
    target = "127.0.0.1:1"  # nothing listens: the error must come first
    assert main(["embed", "--target", target, "--input", str(corpus), "--output", str(tmp_path / "x.txt")]) == 1
    assert "kembed embed: --output: no format named by 'x.txt'" in capsys.readouterr().err


def test_the_bar_is_optional(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # as if tqdm were not installed
    bar = Bar(total=10, done=0, enabled=True)
    bar.update(5)
    bar.note("stream broke")
    bar.close()
    assert capsys.readouterr().err == "stream broke\n"
