"""The corpus command's pure parts (kembed.client.corpus): the reader (lines, shards, texts that do
not fit a request), the resumable writers, parts and the manifest, pacing and ordering with a fake
clock, and the CLI's argument checks. The stream driver runs end to end against a real server in
test_bulk_serving."""

from __future__ import annotations

import asyncio
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kembed.client.__main__ import main
from kembed.client.corpus import CorpusError, FinalError, file_error
from kembed.client.corpus.pacing import BACKOFF_S, MAX_BACKOFF_S, Pacing
from kembed.client.corpus.parts import complete, growing_path, manifest_path, part_path, write_manifest
from kembed.client.corpus.reader import (
    SKIP_CHUNK,
    CorpusReader,
    Limits,
    Shard,
    Span,
    ThreadedSpans,
    cut_spans,
    lines,
)
from kembed.client.corpus.run import Bar, Summary, keep_or_replace
from kembed.client.corpus.stream import (
    InOrder,
    Request,
    RequestSize,
    Window,
    embed_request,
)
from kembed.client.corpus.writers import ParquetWriter, Writer, committed_shape, format_of, held_rows, open_writer
from kembed.client.requests import REQUEST_ENVELOPE_BYTES, TEXT_ENVELOPE_BYTES
from kembed.contract import EXIT_EMBED_FINAL
from kembed.v1 import embedder_pb2 as pb

DIMS = 4


def rows(start: int, count: int) -> np.ndarray:
    """Distinct float32 rows, some values not representable in few decimal digits."""
    values = np.arange(start * DIMS, (start + count) * DIMS, dtype=np.float32).reshape(count, DIMS)
    return values / np.float32(3.0) + np.float32(1e-7)


# --- inputs ---------------------------------------------------------------------------------

LIMITS = Limits(message_bytes=16 * 1024 * 1024)


def corpus_file(tmp_path: Path, data: bytes, name: str = "corpus.txt") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def read_all(
    source: str, field: str | None = None, limits: Limits = LIMITS, shard: Shard | None = None, held: int = 0
) -> list[str]:
    return [text for span in CorpusReader(source, field, limits, shard).spans(1000, held) for text in span.texts]


def test_lines_are_texts_and_crlf_empty_and_unterminated_lines_read_as_expected(tmp_path: Path):
    data = b"first\nwindows\r\n\ncaf\xc3\xa9 \xe6\x9d\xb1\xe4\xba\xac\nno newline"
    assert read_all(corpus_file(tmp_path, data)) == ["first", "windows", "", "café 東京", "no newline"]


def test_jsonl_reads_the_named_field(tmp_path: Path):
    data = b'{"id": 1, "body": "one"}\n{"body": "two \\u00e9", "x": null}\n'
    assert read_all(corpus_file(tmp_path, data), "body") == ["one", "two é"]


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
def test_bad_input_names_its_line(tmp_path: Path, case: str):
    data, field, message = BAD_LINES[case]
    with pytest.raises(CorpusError) as caught:
        read_all(corpus_file(tmp_path, data), field)
    assert str(caught.value).startswith(message), caught.value


@pytest.mark.parametrize("case", BAD_LINES)
def test_a_bad_line_is_final(tmp_path: Path, case: str):
    """The same input fails the same way however often it is run: an EmbeddingJob must not retry it."""
    data, field, _ = BAD_LINES[case]
    with pytest.raises(FinalError):
        read_all(corpus_file(tmp_path, data), field)


CARRIAGE_RETURNS = {
    # input, field, the texts read before the refusal, its line and the \r's byte in it
    "CR line ends (old Mac)": (b"".join(b"text %d\r" % i for i in range(50)), None, [], 1, 7),
    "a stray CR in a LF file": (b"one\ntwo\r2\nthree\n", None, ["one"], 2, 4),
    "CR before CRLF": (b"one\r\ntwo\r\r\n", None, ["one"], 2, 4),
    "JSONL with CR line ends": (b'{"text": "a"}\r{"text": "b"}\r', "text", [], 1, 14),
}


@pytest.mark.parametrize("case", CARRIAGE_RETURNS)
def test_a_carriage_return_inside_a_line_is_refused_naming_it(tmp_path: Path, case: str):
    """50 lines ended by CR alone were one text (1 x 384, exit 0): a line holding a \\r that does not
    end it in CRLF is refused, after the texts before it, and the message says why and what to do."""
    data, field, before, number, byte = CARRIAGE_RETURNS[case]
    spans = CorpusReader(corpus_file(tmp_path, data), field, LIMITS).spans(1, 0)
    assert [text for _, span in zip(before, spans, strict=False) for text in span.texts] == before
    with pytest.raises(FinalError) as caught:
        next(spans)
    assert str(caught.value).startswith(f"input line {number}: a carriage return (\\r, byte {byte}) inside the line")
    assert "tr '\\r' '\\n'" in str(caught.value)


def test_crlf_files_keep_one_text_per_line_whole_and_in_shards(tmp_path: Path):
    source = corpus_file(tmp_path, b"".join(b"text %d\r\n" % i for i in range(50)))
    assert read_all(source) == [f"text {i}" for i in range(50)]
    for count in (3, 7, 64):  # a range may start between a \r and its \n
        assert [t for i in range(count) for t in read_all(source, shard=Shard(i, count))] == read_all(source)


@pytest.mark.parametrize("data", [b"", b"a", b"a\n", b"a\nb", b"a\nb\n", b"\n\n", b"x\r\ny\r\n"])
def test_the_count_is_what_is_read(tmp_path: Path, data: bytes):
    source = corpus_file(tmp_path, data)
    assert CorpusReader(source, None, LIMITS).count() == len(read_all(source))


def test_a_missing_input_is_named_and_final(tmp_path: Path):
    absent = tmp_path / "absent.txt"
    with pytest.raises(FinalError) as caught:
        CorpusReader(str(absent), None, LIMITS).count()
    assert str(caught.value) == (
        f"--input: {absent}: No such file or directory; check the path (an output's folder must exist) "
        "(running it again cannot help)"
    )


@pytest.mark.parametrize(
    ("number", "final", "says"),
    [
        (errno.EROFS, True, "Read-only file system; a read-only file system: write the output where"),
        (errno.EACCES, True, "Permission denied; this run may not use it"),
        (errno.ENOTDIR, True, "Not a directory; a part of the path is a file, not a folder"),
        (errno.EFBIG, True, "File too large; the file cannot grow any larger here"),
        (errno.ENOSPC, False, "No space left on device; the 7 rows committed are kept: free space, then run the same"),
        (errno.EDQUOT, False, "Disk quota exceeded; the 7 rows committed are kept: free space"),
        (errno.EIO, False, "Input/output error; the 7 rows committed are kept: run the same command again"),
    ],
)
def test_a_file_error_is_one_line_that_says_what_to_do(number: int, final: bool, says: str):
    error = file_error("--output", "/d/emb.npy", OSError(number, os.strerror(number)), rows=7)
    assert isinstance(error, FinalError) == final
    assert str(error).startswith(f"--output: /d/emb.npy: {says}"), error
    assert "\n" not in str(error)
    named = file_error("--output", "/d/emb.npy", OSError(number, os.strerror(number), "/d/emb.npy.partial"))
    assert str(named).startswith("--output: /d/emb.npy.partial: ")  # the file the error was about


def test_spans_start_after_the_rows_already_written():
    cut = list(cut_spans(iter("abcdefg"), size=3, request_bytes=1000, first=2, shard=None))
    assert cut == [Span(2, ["a", "b", "c"]), Span(5, ["d", "e", "f"]), Span(8, ["g"])]
    assert (cut[0].lines, cut[2].lines) == ("input lines 3-5", "input line 9")
    assert Span(4, ["a", "b"], Shard(1, 4)).lines == "lines 5-6 of shard 1/4"


def test_spans_fit_in_a_request():
    texts = ["a" * 10, "b" * 10, "c" * 10, "d"]  # each weighs its bytes and an envelope
    cut = list(cut_spans(iter(texts), size=32, request_bytes=2 * (10 + TEXT_ENVELOPE_BYTES), first=0, shard=None))
    assert [span.texts for span in cut] == [texts[:2], texts[2:]]


def test_a_resumed_reader_gives_the_last_written_line_alone_then_the_rest(tmp_path: Path):
    source = corpus_file(tmp_path, b"a\nb\nc\nd\ne\n")
    spans = list(CorpusReader(source, None, LIMITS).spans(size=2, held=2))
    assert spans == [Span(1, ["b"]), Span(2, ["c", "d"]), Span(4, ["e"])]
    assert list(CorpusReader(source, None, LIMITS).spans(size=2, held=5)) == [Span(4, ["e"])]


def test_the_texts_before_a_bad_line_are_cut_into_spans_before_its_error():
    def failing() -> Iterator[str]:
        yield from "abc"
        raise CorpusError("input line 4: no field 'text'")

    cut = cut_spans(failing(), size=2, request_bytes=1000, first=0, shard=None)
    assert [next(cut), next(cut)] == [Span(0, ["a", "b"]), Span(2, ["c"])]
    with pytest.raises(CorpusError, match="input line 4"):
        next(cut)


def test_a_span_splits_into_consecutive_rows():
    head, rest = Span(10, ["a", "b", "c"]).split(1)
    assert (head, rest) == (Span(10, ["a"]), Span(11, ["b", "c"]))


def test_an_input_shorter_than_the_output_is_refused(tmp_path: Path):
    with pytest.raises(CorpusError, match=r"^--output already holds 5 rows but the input has only 3 texts"):
        read_all(corpus_file(tmp_path, b"a\nb\nc\n"), held=5)


def test_threaded_spans_hand_over_every_span_then_the_error_after_them():
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


# --- texts that do not fit a request ------------------------------------------------------------

TINY = Limits(message_bytes=REQUEST_ENVELOPE_BYTES + TEXT_ENVELOPE_BYTES + 10)  # a text may weigh 10 bytes


def test_a_line_longer_than_a_request_carries_is_cut_to_whole_characters(tmp_path: Path):
    # "é" is 2 bytes: the 10-byte cut falls inside the fifth one, which goes whole.
    source = corpus_file(tmp_path, "xéééééé\n".encode() + b"x" * 100 + b"\nshort\n")
    assert read_all(source, limits=TINY) == ["xéééé", "x" * 10, "short"]


def test_without_truncate_a_line_longer_than_a_request_carries_is_refused_naming_it(tmp_path: Path):
    source = corpus_file(tmp_path, b"short\n" + b"x" * 100 + b"\n")
    limits = Limits(TINY.message_bytes, truncate=False)
    with pytest.raises(
        CorpusError, match=r"^input line 2: longer than the 10 bytes a request carries \(--no-truncate\)"
    ):
        read_all(source, limits=limits)


def test_jsonl_a_field_too_long_is_cut_and_a_line_too_long_to_parse_is_refused(tmp_path: Path):
    fits = json.dumps({"text": "y" * 20}).encode()  # 32 bytes: within 4 x 10, its text cut to 10
    assert read_all(corpus_file(tmp_path, fits + b"\n", "a.jsonl"), "text", TINY) == ["y" * 10]
    too_long = json.dumps({"text": "y" * 50}).encode()
    with pytest.raises(CorpusError, match=r"^input line 2: a JSONL line longer than 40 bytes"):
        read_all(corpus_file(tmp_path, fits + b"\n" + too_long + b"\n", "b.jsonl"), "text", TINY)


def test_truncate_cuts_a_text_to_the_servers_character_limit(tmp_path: Path):
    source = corpus_file(tmp_path, "東京東京東京\nab\n".encode())
    assert read_all(source, limits=Limits(LIMITS.message_bytes, text_chars=4)) == ["東京東京", "ab"]
    assert read_all(source, limits=Limits(LIMITS.message_bytes, text_chars=4, truncate=False))[0] == "東京東京東京"


LEFT = Limits(TINY.message_bytes, truncate_left=True)  # a text may weigh 10 bytes, cut to its end


def test_truncating_left_keeps_a_texts_last_characters(tmp_path: Path):
    source = corpus_file(tmp_path, "京都東京大阪\nab\n".encode())
    assert read_all(source, limits=Limits(LIMITS.message_bytes, text_chars=4, truncate_left=True)) == ["東京大阪", "ab"]


def test_truncating_left_a_line_longer_than_a_request_carries_keeps_its_end_in_whole_characters(tmp_path: Path):
    """Read to its end, only its last bytes held: "é" is 2 bytes, so the 10-byte cut falls inside
    the fifth from the end, which goes whole; a CRLF end and a line past the read's chunks alike."""
    past_a_chunk = b"y" * (SKIP_CHUNK * 2 + 5) + b"0123456789"
    data = "ééééééx\r\n".encode() + past_a_chunk + b"\nshort\n" + b"z" * 11 + b"\r\nlast"
    source = corpus_file(tmp_path, data)
    assert read_all(source, limits=LEFT) == ["ééééx", "0123456789", "short", "z" * 10, "last"]
    assert read_all(source, limits=TINY)[:2] == ["ééééé", "y" * 10]  # right: its start, as before


def test_a_shard_truncating_left_starts_at_the_line_after_a_long_one(tmp_path: Path):
    """A line read to its end for its tail still counts all its bytes: the next line is where it is."""
    source = corpus_file(tmp_path, b"x" * 100 + b"the end\n" + b"second\nthird\n")
    whole = read_all(source, limits=LEFT)
    assert whole == ["xxxthe end", "second", "third"]
    assert read_all(source, limits=LEFT, shard=Shard(0, 2)) + read_all(source, limits=LEFT, shard=Shard(1, 2)) == whole


# --- shards -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shard"), [("0/1", Shard(0, 1)), ("3/16", Shard(3, 16)), ("99998/99999", Shard(99998, 99999))]
)
def test_a_shard_is_i_of_n(text: str, shard: Shard):
    assert Shard.parse(text) == shard
    assert str(shard) == text


@pytest.mark.parametrize("text", ["4/4", "-1/4", "1/0", "1", "a/4", "1/4/2", "0/100000", " 1/4"])
def test_a_shard_out_of_range_is_refused(text: str):
    with pytest.raises(ValueError, match=r"I/N|N at most"):
        Shard.parse(text)


SHARDED_INPUTS = {
    "short lines": b"".join(b"line %d\n" % i for i in range(37)),
    "no final newline": b"alpha\nbeta\ngamma",
    "empty and crlf lines": b"\n\na\r\n\r\nb\n\n",
    "a long line that spans shards": b"a\n" + b"x" * 1000 + b"\nb\nc\n",
    "one line": b"only\n",
    "empty": b"",
}


@pytest.mark.parametrize("case", SHARDED_INPUTS)
def test_the_shards_lines_in_order_are_the_inputs(tmp_path: Path, case: str):
    source = corpus_file(tmp_path, SHARDED_INPUTS[case])
    whole = read_all(source)
    for count in (1, 2, 3, 4, 7, 64):
        shards = [read_all(source, shard=Shard(index, count)) for index in range(count)]
        assert [text for shard in shards for text in shard] == whole, count


def test_a_shard_holds_the_lines_that_start_in_its_range(tmp_path: Path):
    data = SHARDED_INPUTS["a long line that spans shards"]  # 1,008 bytes: ranges of 252
    source = corpus_file(tmp_path, data)
    found = {index: list(lines(source, Shard(index, 4), 4096)) for index in range(4)}
    starts = {index: [line.offset for line in found[index]] for index in found}
    assert starts == {0: [0, 2], 1: [], 2: [], 3: [1003, 1005]}  # the long line is shard 0's, alone past its end
    assert [line.number for line in found[3]] == [1, 2]
    assert read_all(source, shard=Shard(1, 4)) == []


def test_a_shards_errors_name_its_line_and_where_it_is_in_the_input(tmp_path: Path):
    source = corpus_file(tmp_path, b"fine\n" * 10 + b"bad \xff\n")  # 56 bytes: shard 1 starts at 30
    with pytest.raises(CorpusError, match=r"^line 5 of shard 1/2 \(byte 50 of the input\): not UTF-8"):
        read_all(source, shard=Shard(1, 2))


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


@pytest.mark.parametrize("output_format", FORMATS)
def test_the_last_row_reads_back_and_dropping_it_lets_another_take_its_place(tmp_path: Path, output_format: str):
    path = tmp_path / f"out.{output_format}"
    write_finished(path, output_format, rows(0, 3))
    writer = open_writer(path, output_format, DIMS)
    np.testing.assert_array_equal(writer.last_row(), rows(2, 1)[0])
    writer.drop_last()
    assert writer.rows == 2
    writer.close()
    assert held_rows(path, output_format) == 2  # durably, before anything takes its place
    writer = open_writer(path, output_format, DIMS)
    writer.append(rows(7, 2))
    writer.finish()
    writer.close()
    np.testing.assert_array_equal(read_back(path, output_format), np.concatenate([rows(0, 2), rows(7, 2)]))
    assert committed_shape(path, output_format) == (4, DIMS)


@pytest.mark.parametrize("output_format", ["npy", "jsonl"])
def test_an_output_has_one_writer_at_a_time(tmp_path: Path, output_format: str):
    path = tmp_path / f"out.{output_format}"
    writer = open_writer(path, output_format, DIMS)
    with pytest.raises(CorpusError, match=r"^--output: another run is writing .*out\."):
        open_writer(path, output_format, DIMS)
    writer.close()
    open_writer(path, output_format, DIMS).close()


def test_a_jsonl_output_is_counted_from_its_last_line(tmp_path: Path):
    path = tmp_path / "out.jsonl"
    write_finished(path, "jsonl", rows(0, 3))
    with path.open("ab") as file:
        file.write(b'{"index": 3, "emb')  # torn
    assert committed_shape(path, "jsonl") == (3, DIMS)
    assert held_rows(tmp_path / "absent.jsonl", "jsonl") == 0


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


# --- parts and the manifest ---------------------------------------------------------------------


def test_a_part_is_named_after_its_output_and_shard():
    assert part_path(Path("/d/emb.npy"), Shard(3, 16)) == Path("/d/emb.part-00003-of-00016.npy")
    assert part_path(Path("/d/emb"), Shard(0, 2)) == Path("/d/emb.part-00000-of-00002")
    assert manifest_path(Path("/d/emb.npy")) == Path("/d/emb.manifest.json")


def test_a_part_grows_aside_and_is_at_its_name_once_complete(tmp_path: Path):
    path = tmp_path / "emb.part-00000-of-00002.npy"
    growing = growing_path(path, "npy")
    assert growing == tmp_path / "emb.part-00000-of-00002.npy.partial"
    assert growing_path(tmp_path / "emb.part-00000-of-00002.parquet", "parquet").name.endswith(".parquet")
    write_finished(growing, "npy", rows(0, 2))
    complete(growing, path)
    assert not growing.exists() and np.load(path).shape == (2, DIMS)
    assert growing_path(path, "npy") == path  # a complete part run again stays where it is


@pytest.mark.parametrize("output_format", FORMATS)
def test_the_manifest_comes_with_the_last_part_and_lists_every_part_in_order(tmp_path: Path, output_format: str):
    output = tmp_path / f"emb.{output_format}"
    sizes = [3, 0, 2]
    for index in (2, 0):
        write_finished(part_path(output, Shard(index, 3)), output_format, rows(sum(sizes[:index]), sizes[index]))
        assert write_manifest(output, 3, output_format) is None  # not every part is there yet
    write_finished(part_path(output, Shard(1, 3)), output_format)
    written = write_manifest(output, 3, output_format)
    assert written == manifest_path(output)
    manifest = json.loads(written.read_text())
    assert manifest == {
        "format": output_format,
        "dimensions": DIMS,
        "rows": 5,
        "parts": [{"path": part_path(output, Shard(i, 3)).name, "rows": sizes[i]} for i in range(3)],
    }
    before = written.read_bytes()
    assert write_manifest(output, 3, output_format) == written and written.read_bytes() == before  # idempotent
    parts = [read_back(tmp_path / part["path"], output_format) for part in manifest["parts"]]
    np.testing.assert_array_equal(np.concatenate(parts), rows(0, 5))  # in manifest order: the input's
    assert sorted(p.name for p in tmp_path.iterdir() if "manifest" in p.name) == [written.name]  # nothing aside


def test_parts_of_other_dimensions_get_no_manifest(tmp_path: Path):
    output = tmp_path / "emb.npy"
    np.save(part_path(output, Shard(0, 2)), np.zeros((1, DIMS), np.float32))
    np.save(part_path(output, Shard(1, 2)), np.zeros((1, DIMS + 1), np.float32))
    with pytest.raises(CorpusError, match=r"rows of \[4, 5\] dimensions"):
        write_manifest(output, 2, "npy")


# --- the check of a resumed output's last row ---------------------------------------------------


def test_a_last_row_that_is_its_lines_stays_and_one_that_is_not_is_replaced(tmp_path: Path):
    path = tmp_path / "out.npy"
    write_finished(path, "npy", rows(0, 3))
    writer = open_writer(path, "npy", DIMS)
    summary = Summary(path, None, rows=3, skipped=3)
    notes = Bar(None, 0, enabled=False)
    keep_or_replace(writer, rows(2, 1)[0] * 1.00001, Span(2, ["same"]), notes, summary)  # rounding apart
    assert summary.skipped == 3
    keep_or_replace(writer, rows(9, 1)[0], Span(2, ["changed"]), notes, summary)
    assert (writer.rows, summary.skipped) == (3, 2)
    writer.close()
    np.testing.assert_array_equal(np.load(path), np.concatenate([rows(0, 2), rows(9, 1)]))


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


def test_the_window_starts_at_one_request_and_grows_fast_then_slowly_up_to_in_flight():
    window = Window(largest=8)
    assert window.admits(0) and not window.admits(1)
    grown = []
    for _ in range(12):
        window.succeeded()
        grown.append(int(window.limit))
    assert grown == [2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 8, 8]  # no refusal yet: slow start to --in-flight


def test_a_refusal_cuts_the_window_to_one_once_for_the_requests_refused_together():
    window = Window(largest=8)
    for _ in range(5):
        window.succeeded()
    assert window.limit == 6
    sent_in = window.epoch
    for _ in range(6):  # the whole window refused: one cut
        window.refused(sent_in)
    assert (window.limit, window.threshold, window.epoch) == (1, 3, 1)
    limits = []
    for _ in range(6):
        window.succeeded()
        limits.append(round(window.limit, 2))
    assert limits == [2, 3, 3.33, 3.63, 3.91, 4.16]  # quickly back to half, then one more per window
    window.refused(window.epoch)
    assert (window.limit, window.threshold) == (1, pytest.approx(limits[-1] / 2, abs=0.01))


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
    assert not request.HasField("chunk")  # the server's default
    chunked = embed_request(Span(0, ["a"]), Request(dimensions=0, truncate=False, chunk=True))
    assert chunked.HasField("chunk") and chunked.chunk
    assert request.truncation_direction == pb.TRUNCATION_DIRECTION_RIGHT
    left = embed_request(Span(0, ["a"]), Request(dimensions=0, truncate=True, truncation_direction="left"))
    assert left.truncation_direction == pb.TRUNCATION_DIRECTION_LEFT


# --- the CLI ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-texts", "0"], "argument --batch-texts: must be at least 1, not 0"),
        (["--in-flight", "x"], "argument --in-flight: invalid int value: 'x'"),
        (["--dimensions", "-1"], "argument --dimensions: must be at least 0, not -1"),
        (["--format", "csv"], "argument --format: invalid choice: 'csv'"),
        (["--priority", "urgent"], "argument --priority: invalid choice: 'urgent'"),
        (["--truncation-direction", "up"], "argument --truncation-direction: invalid choice: 'up'"),
    ],
)
def test_bad_flags_are_usage_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        main(["embed", "--output", "out.npy", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shard", "4/4"], "argument --shard: '4/4': I must be in [0, N)"),
        (["--shard", "1-4"], "argument --shard: '1-4' is not I/N"),
        (["--shard", "0/2", "--input", "-"], "--shard: a shard is a byte range of a file; stdin cannot be split"),
        (["--chunk", "--truncate"], "--chunk, --truncate: a long text is either chunked or cut; choose one"),
    ],
)
def test_bad_shards_are_usage_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        main(["embed", "--output", "out.npy", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_summary_file_is_written_however_the_run_ends(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a\n")
    summary = tmp_path / "summary.json"
    flags = ["--target", "127.0.0.1:1", "--input", str(corpus), "--shard", "1/2", "--summary-file", str(summary)]
    assert main(["embed", *flags, "--output", str(tmp_path / "x.txt")]) == EXIT_EMBED_FINAL
    record = json.loads(summary.read_text())
    assert record == {
        "rows": 0,
        "embedded": 0,
        "blank": 0,
        "shard": "1/2",
        "output": str(tmp_path / "x.part-00001-of-00002.txt"),
        "complete": False,
        "seconds": record["seconds"],  # however long the refused connection took
        "retries": 0,
        "refusals": 0,
        "reconnects": 0,
        "error": "--output: no format named by 'x.txt': end it in .npy, .jsonl or .parquet, or use --format",
    }


def test_an_output_of_unknown_format_fails_before_connecting(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a\n")
    target = "127.0.0.1:1"  # nothing listens: the error must come first
    assert main(["embed", "--target", target, "--input", str(corpus), "--output", str(tmp_path / "x.txt")]) == 3
    assert "kembed embed: --output: no format named by 'x.txt'" in capsys.readouterr().err


def test_parquet_without_pyarrow_fails_before_connecting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)  # as if not installed
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a\n")
    # Nothing listens, and the run would give up on it at once: only an error found first says pyarrow.
    flags = ["--target", "127.0.0.1:1", "--give-up-after", "0", "--input", str(corpus)]
    assert main(["embed", *flags, "--output", str(tmp_path / "x.parquet")]) == EXIT_EMBED_FINAL
    assert capsys.readouterr().err == "kembed embed: --output: Parquet needs pyarrow (pip install pyarrow)\n"


def test_the_bar_is_optional(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # as if tqdm were not installed
    bar = Bar(total=10, done=0, enabled=True)
    bar.update(5)
    bar.note("stream broke")
    bar.close()
    assert capsys.readouterr().err == "stream broke\n"


def test_the_command_refuses_an_empty_text_in_one_line(capsys: pytest.CaptureFixture[str]):
    assert main(["--target", "127.0.0.1:1", "hello", ""]) == 1
    assert capsys.readouterr().err == "kembed.client: INVALID_ARGUMENT: texts[1]: an empty string\n"


def test_the_commands_help_lists_its_subcommands(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    said = capsys.readouterr().out
    assert "python -m kembed.client embed --help" in said
    for flag in ("--truncate", "--truncation-direction", "--dimensions", "--priority"):
        assert flag in said
