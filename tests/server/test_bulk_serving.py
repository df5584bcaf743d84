"""``python -m kembed.client embed`` end to end: the command as a subprocess against real servers
with the real model. Its rows must be EmbedClient.embed's vectors, in input order, whatever the
server does meanwhile: refuse (admission, with the engine held, or a low service rate), cut the
stream (its connection's age), or be interrupted (killed) and resumed; whatever the input holds
(a document over the limits, a last line that grew); and whatever the shards (the parts, in the
manifest's order, are one unsharded run). How many requests a run sent is read off the server's
``kembed_requests_total``, so a resumed run is shown to embed only what was missing."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from kembed.client import EmbedClient
from kembed.client.corpus.reader import Shard
from kembed.client.corpus.reader import lines as reader_lines
from kembed.contract import EXIT_EMBED_FAILED, EXIT_EMBED_FINAL
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.folders import small_folder, unwritable_folder
from tests.server.serving import ServerProcess, all_decided, server_fixture, the_plain_server, wait_until

pytestmark = pytest.mark.process

DIMS = 384
HEADER = 128  # bytes before the rows in the .npy files the command writes
NO_DEADLINE_MS = 600_000  # a slow machine must not turn a test's requests into DEADLINE_EXCEEDED retries
OK_REQUESTS = 'kembed_requests_total{api="grpc",code="OK"}'
REFUSED_REQUESTS = 'kembed_requests_total{api="grpc",code="RESOURCE_EXHAUSTED"}'
BATCH_ANSWERED = 'kembed_request_duration_seconds_count{priority="batch"}'
WORDS = ["pods", "nodes", "queue", "token", "vector", "batch", "model", "drain", "budget", "replica", "shard"]


def corpus(lines: int) -> list[str]:
    """Varied texts: short and long (one past the model's limit: cut by default), empty, non-ASCII."""
    texts = [f"line {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 11)) for i in range(lines)]
    texts[3] = ""
    texts[5] = "naïve café, 東京, emoji 🚀\ttab"
    texts[11] = "a long document about embeddings " * 60
    return texts


TEXTS = corpus(300)


def write_lines(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(f"{text}\n" for text in texts), encoding="utf-8")
    return path


def embed_command(server: ServerProcess, *flags: str) -> list[str]:
    return [sys.executable, "-m", "kembed.client", "embed", "--target", server.target, *flags]


def run_embed(server: ServerProcess, *flags: str, stdin: Path | None = None) -> subprocess.CompletedProcess[str]:
    with (stdin or Path("/dev/null")).open("rb") as source:
        return subprocess.run(embed_command(server, *flags), stdin=source, capture_output=True, text=True, timeout=600)


def summary_count(stdout: str, what: str) -> int:
    found = re.search(rf"(\d+) {what}", stdout)
    assert found, stdout
    return int(found.group(1))


def assert_same_vectors(rows: np.ndarray, reference: np.ndarray) -> None:
    """The same rows: a blank line's zeros exactly, any other row within float rounding."""
    assert rows.shape == reference.shape and rows.dtype == np.float32
    blank = ~reference.any(axis=1)
    assert not rows[blank].any()
    rows, reference = rows[~blank], reference[~blank]
    cosines = np.sum(rows * reference, axis=1) / np.linalg.norm(rows, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.9999, (cosines.argmin(), cosines.min())


def read_jsonl(path: Path) -> np.ndarray:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [record["index"] for record in records] == list(range(len(records)))  # in input order
    return np.asarray([record["embedding"] for record in records], dtype=np.float32)


# No admission: request counts must be exact (the refusing server is below); no deadline (PLAIN's).
server = the_plain_server()


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> np.ndarray:
    """``embed``'s vectors of TEXTS, and a row of zeros for the empty one, as the corpus command
    writes a blank line (the server refuses an empty text)."""
    with EmbedClient(server.target, timeout_s=600) as client:
        vectors = client.embed([text for text in TEXTS if text], truncate=True)
    rows = np.zeros((len(TEXTS), vectors.shape[1]), dtype=np.float32)
    rows[[bool(text) for text in TEXTS]] = vectors
    return rows


def test_a_corpus_file_to_npy_gives_embed_clients_vectors_in_order(
    server: ServerProcess, reference: np.ndarray, tmp_path: Path
):
    source = write_lines(tmp_path / "corpus.txt", TEXTS)
    output = tmp_path / "vectors.npy"
    result = run_embed(server, "--input", str(source), "--output", str(output), "--batch-texts", "16")
    assert result.returncode == 0, result.stderr
    assert_same_vectors(np.load(output), reference)
    assert summary_count(result.stdout, "embedded") == len(TEXTS)
    assert summary_count(result.stdout, "blank lines as rows of zeros") == TEXTS.count("") == 1
    assert "texts/s" in result.stderr  # the progress bar


def test_blank_lines_are_rows_of_zeros_counted_and_kept_on_resume(server: ServerProcess, tmp_path: Path):
    """The server refuses an empty text: a blank line keeps its row, as zeros, and a span of blank
    lines alone is written without a request; a resumed run checks a blank last row and keeps it."""
    source = write_lines(tmp_path / "corpus.txt", ["alpha", "", "", "", "beta", ""])
    output = tmp_path / "vectors.npy"
    flags = ["--input", str(source), "--output", str(output), "--batch-texts", "2", "--no-progress"]
    first = run_embed(server, *flags)
    assert first.returncode == 0, first.stderr
    rows = np.load(output)
    assert rows.shape == (6, DIMS)
    assert [bool(row.any()) for row in rows] == [True, False, False, False, True, False]
    assert summary_count(first.stdout, "blank lines as rows of zeros") == 4
    again = run_embed(server, *flags)
    assert again.returncode == 0, again.stderr
    assert (summary_count(again.stdout, "embedded"), summary_count(again.stdout, "blank lines")) == (0, 0)
    assert np.array_equal(np.load(output), rows)


def test_lines_without_content_are_blank_lines(server: ServerProcess, tmp_path: Path):
    """Whitespace or invisible characters alone are no text to the server (``kembed/domain/texts.py``): such
    a line is a blank line, its row zeros, never sent."""
    source = write_lines(tmp_path / "corpus.txt", ["alpha", " ", "\t\u200b", "\ufeff", "beta", "\x00"])
    output = tmp_path / "vectors.npy"
    result = run_embed(server, "--input", str(source), "--output", str(output), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert [bool(row.any()) for row in np.load(output)] == [True, False, False, False, True, False]
    assert summary_count(result.stdout, "blank lines as rows of zeros") == 4


def test_jsonl_from_stdin_to_jsonl_with_fewer_dimensions(server: ServerProcess, reference: np.ndarray, tmp_path: Path):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"id": i, "body": text}) + "\n" for i, text in enumerate(TEXTS)))
    output = tmp_path / "vectors.jsonl"
    flags = ["--input", "-", "--jsonl-field", "body", "--output", str(output), "--dimensions", "128", "--no-progress"]
    result = run_embed(server, *flags, stdin=source)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no bar asked for
    norms = np.linalg.norm(reference[:, :128], axis=1, keepdims=True)
    short = reference[:, :128] / np.maximum(norms, 1e-12)  # Matryoshka, renormalised (a blank line's zeros kept)
    assert_same_vectors(read_jsonl(output), short)


def test_a_corpus_to_parquet(server: ServerProcess, reference: np.ndarray, tmp_path: Path):
    pq = pytest.importorskip("pyarrow.parquet")
    output = tmp_path / "vectors.parquet"
    result = run_embed(server, "--input", str(write_lines(tmp_path / "corpus.txt", TEXTS)), "--output", str(output))
    assert result.returncode == 0, result.stderr
    column = pq.read_table(output).column("embedding").combine_chunks()
    assert_same_vectors(column.flatten().to_numpy().reshape(-1, DIMS), reference)


def test_a_rerun_with_a_longer_input_embeds_only_the_new_texts(
    server: ServerProcess, reference: np.ndarray, tmp_path: Path
):
    output = tmp_path / "vectors.npy"
    flags = ["--output", str(output), "--batch-texts", "32", "--no-progress"]
    first = run_embed(server, "--input", str(write_lines(tmp_path / "half.txt", TEXTS[:150])), *flags)
    assert first.returncode == 0, first.stderr
    first_half = output.read_bytes()
    full = str(write_lines(tmp_path / "full.txt", TEXTS))

    before, batch_before = server.metric(OK_REQUESTS), server.metric(BATCH_ANSWERED)
    second = run_embed(server, "--input", full, *flags)
    assert second.returncode == 0, second.stderr
    sent = 1 + math.ceil(150 / 32)  # the check of the last row written, then only the second half
    assert server.metric(OK_REQUESTS) - before == sent
    assert server.metric(BATCH_ANSWERED) - batch_before == sent  # sent as batch work
    assert (summary_count(second.stdout, "embedded"), summary_count(second.stdout, "already there")) == (150, 150)
    assert output.read_bytes()[HEADER:].startswith(first_half[HEADER:])  # the first half untouched
    assert_same_vectors(np.load(output), reference)

    before = server.metric(OK_REQUESTS)
    again = run_embed(server, "--input", full, *flags)
    assert again.returncode == 0, again.stderr
    assert server.metric(OK_REQUESTS) == before + 1  # the last row's check, nothing left to embed
    assert_same_vectors(np.load(output), reference)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_keeps_its_rows_and_the_same_command_goes_on(
    server: ServerProcess, reference: np.ndarray, tmp_path: Path, stop: signal.Signals
):
    output = tmp_path / "vectors.npy"
    flags = ["--output", str(output), "--batch-texts", "32", "--no-progress"]
    # 100 lines down a pipe that stays open: three full batches go, the fourth waits for line 101.
    command = embed_command(server, "--input", "-", *flags)
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdin is not None
    process.stdin.write("".join(f"{text}\n" for text in TEXTS[:100]).encode())
    process.stdin.flush()
    wait_until(lambda: output.exists() and output.stat().st_size >= HEADER + 96 * DIMS * 4, 300, "96 rows written")
    process.send_signal(stop)
    assert process.wait(timeout=60) == 130  # with its input still open: nothing waits for the read
    _, stderr = process.communicate()
    assert b"interrupted" in stderr
    assert np.load(output).shape == (96, DIMS)  # committed on the way out

    before = server.metric(OK_REQUESTS)
    rest = run_embed(server, "--input", str(write_lines(tmp_path / "corpus.txt", TEXTS)), *flags)
    assert rest.returncode == 0, rest.stderr
    assert server.metric(OK_REQUESTS) - before == 1 + math.ceil((300 - 96) / 32)  # the check, and the rest
    assert_same_vectors(np.load(output), reference)


def test_a_text_the_server_refuses_fails_the_job_naming_its_line(server: ServerProcess, tmp_path: Path):
    texts = [f"short text {i}" for i in range(64)]
    texts[39] = "word " * 400  # line 40: too long, and --no-truncate
    output = tmp_path / "vectors.npy"
    flags = ["--output", str(output), "--batch-texts", "8", "--in-flight", "1", "--no-truncate", "--no-progress"]
    result = run_embed(server, "--input", str(write_lines(tmp_path / "corpus.txt", texts)), *flags)
    assert result.returncode == EXIT_EMBED_FINAL  # the server refuses that line whenever it is sent
    assert result.stderr.startswith("kembed embed: input line 40: INVALID_ARGUMENT: texts[7]"), result.stderr
    assert np.load(output).shape == (32, DIMS)  # the batches before it, kept


def test_bad_arguments_fail_before_writing(server: ServerProcess, tmp_path: Path):
    source = write_lines(tmp_path / "corpus.txt", TEXTS[:3])
    output = tmp_path / "vectors.npy"
    result = run_embed(server, "--input", str(source), "--output", str(output), "--dimensions", "999")
    expected = (EXIT_EMBED_FINAL, "kembed embed: --dimensions: 999 exceeds the model's 384\n")
    assert (result.returncode, result.stderr) == expected
    assert not output.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    result = run_embed(server, "--input", str(bad), "--output", str(output), "--no-progress")
    assert result.returncode == EXIT_EMBED_FINAL
    assert result.stderr == "kembed embed: input line 2: field 'text' is not a string: 3\n"
    assert np.load(output).shape == (1, DIMS)  # the line before it


def test_the_one_shot_form_is_unchanged(server: ServerProcess):
    result = subprocess.run(
        [sys.executable, "-m", "kembed.client", "--target", server.target, "embed", "hello world"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("model sentence-transformers/all-MiniLM-L6-v2: 2 x 384 in ")
    assert lines[1].startswith("'embed'") and lines[2].startswith("'hello world'")


# --- what no retry can fix, and output errors: one line each, its exit code says which ----------


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, start: str) -> str:
    """The run failed with ``code`` and said why on one line starting with ``start``: no traceback."""
    assert result.returncode == code, result.stderr
    assert result.stderr.startswith(start) and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_cr_line_ends_are_refused_saying_why_and_crlf_stays_one_text_a_line(server: ServerProcess, tmp_path: Path):
    """The reproduction: 50 lines ended by \\r alone gave 1 x 384 and exit 0."""
    texts = [f"line {i}: {WORDS[i % len(WORDS)]}" for i in range(50)]
    crlf, cr = tmp_path / "crlf.txt", tmp_path / "cr.txt"
    crlf.write_bytes("".join(f"{text}\r\n" for text in texts).encode())
    cr.write_bytes("".join(f"{text}\r" for text in texts).encode())
    result = run_embed(server, "--input", str(crlf), "--output", str(tmp_path / "crlf.npy"), "--no-progress")
    assert result.returncode == 0, result.stderr
    with EmbedClient(server.target, timeout_s=600) as client:
        assert_same_vectors(np.load(tmp_path / "crlf.npy"), client.embed(texts))  # 50 x 384
    output = tmp_path / "cr.npy"
    refused = run_embed(server, "--input", str(cr), "--output", str(output), "--no-progress")
    said = assert_one_line(refused, EXIT_EMBED_FINAL, "kembed embed: input line 1: a carriage return (\\r, byte 13)")
    assert "lines end only at \\n or \\r\\n" in said and "tr '\\r' '\\n'" in said
    assert np.load(output).shape == (0, DIMS)


def test_a_missing_input_fails_for_good_in_one_line(server: ServerProcess, tmp_path: Path):
    absent = tmp_path / "absent.txt"
    result = run_embed(server, "--input", str(absent), "--output", str(tmp_path / "x.npy"), "--no-progress")
    assert_one_line(result, EXIT_EMBED_FINAL, f"kembed embed: --input: {absent}: No such file or directory; ")


def test_an_output_folder_it_cannot_write_fails_for_good_in_one_line(server: ServerProcess, tmp_path: Path):
    """A read-only file system (EROFS) ended in a traceback and exit 1, retried by a Job."""
    source = write_lines(tmp_path / "corpus.txt", TEXTS[:20])
    folder = tmp_path / "read-only"
    output = folder / "vectors.npy"
    with unwritable_folder(folder) as why:
        result = run_embed(server, "--input", str(source), "--output", str(output), "--no-progress")
    said = assert_one_line(result, EXIT_EMBED_FINAL, f"kembed embed: --output: {output}: {why}; ")
    assert said.endswith("(running it again cannot help)\n")


def test_a_full_disk_keeps_the_committed_rows_and_the_same_command_goes_on_once_space_is_freed(
    server: ServerProcess, tmp_path: Path
):
    """ENOSPC ended in a traceback. 2,000 rows of 8 dimensions (32 bytes each) into a 48 KiB
    tmpfs: the rows are committed every 1,024, so the disk fills after a commit; grown to 256 KiB,
    the same command goes on from the rows committed."""
    texts = [f"short text number {i}" for i in range(2000)]
    source = write_lines(tmp_path / "corpus.txt", texts)
    folder = tmp_path / "small"
    output = folder / "vectors.npy"
    flags = ["--input", str(source), "--output", str(output), "--dimensions", "8", "--no-progress"]
    with small_folder(folder, "48k") as grow:
        full = run_embed(server, *flags)
        said = assert_one_line(full, EXIT_EMBED_FAILED, f"kembed embed: --output: {output}: No space left on device; ")
        kept = np.load(output)
        assert f"the {len(kept)} rows committed are kept: free space, then run the same command again" in said
        assert 1024 <= len(kept) < len(texts)
        grow("256k")
        rest = run_embed(server, *flags)
        assert rest.returncode == 0, rest.stderr
        assert summary_count(rest.stdout, "already there") == len(kept)
        rows = np.load(output)
    assert rows.shape == (len(texts), 8)
    sample = [*range(32), *range(len(kept) - 16, len(kept) + 16), *range(len(texts) - 32, len(texts))]
    with EmbedClient(server.target, timeout_s=600) as client:
        expected = client.embed([texts[i] for i in sample], dimensions=8)
    assert_same_vectors(rows[sample], expected)
    assert_same_vectors(kept[:32], expected[:32])


def test_a_file_size_limit_fails_for_good_in_one_line(server: ServerProcess, reference: np.ndarray, tmp_path: Path):
    """A write that fails mid-run (EFBIG: the process may write files of 64 KiB, 42 rows)."""
    source = write_lines(tmp_path / "corpus.txt", TEXTS)
    output = tmp_path / "vectors.npy"

    command = embed_command(server, "--input", str(source), "--output", str(output), "--no-progress")
    limited = ["prlimit", f"--fsize={64 * 1024}", "--", *command]  # no preexec_fn: see tests/server/serving.py
    result = subprocess.run(limited, capture_output=True, text=True, timeout=600)
    assert_one_line(result, EXIT_EMBED_FINAL, f"kembed embed: --output: {output}: File too large; ")
    kept = np.load(output)  # still an array: the rows appended before the failed write, committed on the way out
    assert len(kept) < 64 * 1024 // (DIMS * 4)
    assert_same_vectors(kept, reference[: len(kept)])


# --- documents that do not fit, inputs that change ----------------------------------------------


def test_a_document_over_the_character_limit_is_cut_with_truncate_and_named_without(
    server: ServerProcess, tmp_path: Path
):
    """100,005 characters, over the server's 100,000: truncate cuts it (its first 256 tokens are
    those of its first 2,000 characters), in the corpus command and in the API itself."""
    long = ("word " * 20_001)[:100_005]
    source = write_lines(tmp_path / "corpus.txt", ["before", long, "after"])
    output = tmp_path / "vectors.npy"
    result = run_embed(server, "--input", str(source), "--output", str(output), "--no-progress")
    assert result.returncode == 0, result.stderr
    with EmbedClient(server.target, timeout_s=600) as client:
        expected = client.embed(["before", long[:2000], "after"], truncate=True)
        assert_same_vectors(client.embed([long], truncate=True), expected[1:2])  # the server cuts it too
    assert_same_vectors(np.load(output), expected)
    refused = run_embed(
        server, "--input", str(source), "--output", str(tmp_path / "x.npy"), "--no-truncate", "--no-progress"
    )
    assert refused.returncode == EXIT_EMBED_FINAL
    assert refused.stderr.startswith("kembed embed: input line 2: INVALID_ARGUMENT: texts[1]: 100005 characters")


def test_a_line_over_a_requests_16_mib_is_cut_with_truncate_and_named_without(server: ServerProcess, tmp_path: Path):
    huge = "x" * (17 * 1024 * 1024)
    source = write_lines(tmp_path / "corpus.txt", ["before", huge, "after"])
    output = tmp_path / "vectors.npy"
    result = run_embed(server, "--input", str(source), "--output", str(output), "--no-progress")
    assert result.returncode == 0, result.stderr
    with EmbedClient(server.target, timeout_s=600) as client:
        assert_same_vectors(np.load(output), client.embed(["before", huge[:100_000], "after"], truncate=True))
    output = tmp_path / "refused.npy"
    refused = run_embed(server, "--input", str(source), "--output", str(output), "--no-truncate", "--no-progress")
    assert refused.returncode == EXIT_EMBED_FINAL
    assert refused.stderr.startswith("kembed embed: input line 2: longer than the "), refused.stderr
    assert np.load(output).shape == (1, DIMS)  # the line before it


def test_truncation_direction_left_keeps_each_documents_end(server: ServerProcess, tmp_path: Path):
    """--truncation-direction left reaches every request: a document past the model's tokens keeps
    its last ones, and one past the server's 100,000 characters its last characters (the client
    cuts it as the server would), as the library's truncation_direction="left" gives; not what the
    default keeps, the start. With --chunk, which cuts nothing, it changes nothing."""
    head, tail = "pods and nodes ", "the queue drains the shards at last "
    past_tokens = head * 60 + tail * 30  # about 400 tokens
    past_chars = head * 6667 + tail * 89  # 103,209 characters: its first 100,000 hold none of its end
    texts = ["before", past_tokens, past_chars, "after"]
    flags = ["--no-progress", "--batch-texts", "2", "--truncation-direction", "left"]
    output = tmp_path / "left.npy"
    result = run_embed(server, "--input", str(write_lines(tmp_path / "a.txt", texts)), "--output", str(output), *flags)
    assert result.returncode == 0, result.stderr
    fits = [texts[0], past_tokens, texts[3]]  # chunked, a text past the characters would fail the run
    chunked = tmp_path / "chunked.npy"
    source = write_lines(tmp_path / "b.txt", fits)
    result = run_embed(server, "--input", str(source), "--output", str(chunked), "--chunk", *flags)
    assert result.returncode == 0, result.stderr
    with EmbedClient(server.target, timeout_s=600) as client:
        left = client.embed(texts, truncate=True, truncation_direction="left")
        right = client.embed(texts, truncate=True)
        assert_same_vectors(np.load(chunked), client.embed(fits, chunk=True))
    rows = np.load(output)
    assert_same_vectors(rows, left)
    cosines = np.sum(rows[1:3] * right[1:3], axis=1)  # normalised rows
    assert cosines.max() < 0.95, cosines


@pytest.mark.parametrize("output_format", ["npy", "jsonl", "parquet"])
def test_a_last_line_that_grew_since_it_was_embedded_is_embedded_again(
    server: ServerProcess, tmp_path: Path, output_format: str
):
    """The reproduction: ``alpha\\nbeta`` without a final newline, embedded; then `` gamma delta``
    and ``epsilon`` appended. Row 1 must be the embedding of line 2 as it reads now."""
    if output_format == "parquet":
        pytest.importorskip("pyarrow")
    source = tmp_path / "corpus.txt"
    source.write_text("alpha\nbeta")
    output = tmp_path / f"vectors.{output_format}"
    flags = ["--input", str(source), "--output", str(output), "--no-progress"]
    first = run_embed(server, *flags)
    assert first.returncode == 0, first.stderr
    with source.open("a") as grown:
        grown.write(" gamma delta\nepsilon\n")
    second = run_embed(server, *flags)
    assert second.returncode == 0, second.stderr
    assert "input line 2 changed since its row was written" in second.stderr
    assert (summary_count(second.stdout, "embedded"), summary_count(second.stdout, "already there")) == (2, 1)
    with EmbedClient(server.target) as client:
        expected = client.embed(["alpha", "beta gamma delta", "epsilon"], truncate=True)
    assert_same_vectors(read_output(output, output_format), expected)
    again = run_embed(server, *flags)  # unchanged now: the check keeps the row
    assert "changed" not in again.stderr
    assert (summary_count(again.stdout, "embedded"), summary_count(again.stdout, "already there")) == (0, 3)


def read_output(path: Path, output_format: str) -> np.ndarray:
    if output_format == "jsonl":
        return read_jsonl(path).reshape(-1, DIMS)  # an empty part too
    if output_format == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).column("embedding").combine_chunks().flatten().to_numpy().reshape(-1, DIMS)
    return np.load(path)


# --- shards -------------------------------------------------------------------------------------


def run_shards(server: ServerProcess, source: Path, output: Path, count: int, order: list[int], *flags: str) -> None:
    """Each shard's command, one after the other in ``order``: only the last writes the manifest."""
    manifest = output.with_name(output.stem + ".manifest.json")
    for done, index in enumerate(order, start=1):
        summary = output.with_name(f"summary-{index}.json")
        shard = ["--shard", f"{index}/{count}", "--summary-file", str(summary)]
        result = run_embed(server, "--input", str(source), "--output", str(output), "--no-progress", *shard, *flags)
        assert result.returncode == 0, result.stderr
        assert manifest.exists() == (done == count), index
        record = json.loads(summary.read_text())
        assert (record["shard"], record["complete"], record["rows"]) == (f"{index}/{count}", True, record["embedded"])


def from_manifest(output: Path, output_format: str) -> tuple[np.ndarray, list[int]]:
    """The parts concatenated in the manifest's order, and their row counts."""
    manifest = json.loads(output.with_name(output.stem + ".manifest.json").read_text())
    parts = [read_output(output.parent / part["path"], output_format) for part in manifest["parts"]]
    assert [len(part) for part in parts] == [part["rows"] for part in manifest["parts"]]
    assert manifest["rows"] == sum(len(part) for part in parts)
    return np.concatenate(parts), [part["rows"] for part in manifest["parts"]]


def test_four_shards_concatenated_in_the_manifests_order_are_one_unsharded_run(
    server: ServerProcess, reference: np.ndarray, tmp_path: Path
):
    source = write_lines(tmp_path / "corpus.txt", TEXTS)
    whole = tmp_path / "whole.npy"
    unsharded = run_embed(server, "--input", str(source), "--output", str(whole), "--no-progress")
    assert unsharded.returncode == 0, unsharded.stderr
    output = tmp_path / "emb.npy"
    run_shards(server, source, output, 4, [2, 0, 3, 1])
    rows, counts = from_manifest(output, "npy")
    assert all(counts) and sum(counts) == len(TEXTS)
    assert_same_vectors(rows, np.load(whole))
    assert_same_vectors(rows, reference)
    assert sorted(p.name for p in tmp_path.glob("emb.*")) == [
        "emb.manifest.json",
        *(f"emb.part-0000{i}-of-00004.npy" for i in range(4)),
    ]  # nothing left aside


def test_uneven_shards_and_shards_without_a_line(server: ServerProcess, tmp_path: Path):
    """A line of 1,000 characters across three of four byte ranges: two shards start no line and
    write empty parts, the first reads past its end to finish it."""
    texts = ["first", "a long line " * 84, "second to last", "last"]
    source = write_lines(tmp_path / "corpus.txt", texts)
    output = tmp_path / "emb.jsonl"
    run_shards(server, source, output, 4, [3, 1, 2, 0])
    rows, counts = from_manifest(output, "jsonl")
    assert counts == [2, 0, 0, 2]
    with EmbedClient(server.target) as client:
        assert_same_vectors(rows, client.embed(texts, truncate=True))


def test_a_shard_killed_midway_goes_on_from_its_part_with_nothing_lost_or_repeated(
    server: ServerProcess, reference: np.ndarray, tmp_path: Path
):
    lines = 2000
    source = write_lines(tmp_path / "corpus.txt", [TEXTS[i % len(TEXTS)] for i in range(lines)])
    numbers = {line.offset: number for number, line in enumerate(reader_lines(str(source), None, 1 << 20))}
    owned = [numbers[line.offset] for line in reader_lines(str(source), Shard(1, 4), 1 << 20)]
    expected = reference[[i % len(TEXTS) for i in owned]]
    output = tmp_path / "emb.jsonl"
    growing = tmp_path / "emb.part-00001-of-00004.jsonl.partial"
    flags = ["--input", str(source), "--output", str(output), "--shard", "1/4", "--batch-texts", "8", "--no-progress"]
    process = subprocess.Popen(embed_command(server, *flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_until(lambda: growing.exists() and growing.read_bytes().count(b"\n") >= 24, 300, "24 rows in the part")
    process.kill()
    assert process.wait(timeout=60) == -signal.SIGKILL
    held = growing.read_bytes().count(b"\n")
    assert 24 <= held < len(owned)
    rest = run_embed(server, *flags)
    assert rest.returncode == 0, rest.stderr
    assert summary_count(rest.stdout, "embedded") + summary_count(rest.stdout, "already there") == len(owned)
    assert summary_count(rest.stdout, "already there") == held  # its last row checked and kept
    part = tmp_path / "emb.part-00001-of-00004.jsonl"
    assert not growing.exists()
    assert_same_vectors(read_jsonl(part), expected)  # indices 0, 1, 2... and each row its line's


# --- a server that refuses, a stream that breaks ------------------------------------------------

REQUEST = pb.EmbedRequest(texts=["Admission control rejects early instead of queueing into timeouts."] * 8)
ONE_TEXT = pb.EmbedRequest(texts=["x"])  # padded to the smallest bucket: the least any request costs


# Admission on, with a small drain budget (test_overload's), and an engine the test can hold.
refusing_server = server_fixture(
    held=True, max_drain_ms=1000, max_queued_tokens=16_384, default_timeout_ms=NO_DEADLINE_MS
)


def test_refused_requests_are_retried_after_their_pushback_and_every_row_lands_in_order(
    refusing_server: ServerProcess, reference: np.ndarray, tmp_path: Path
):
    server = refusing_server
    output = tmp_path / "vectors.jsonl"
    command = embed_command(server, "--input", "-", "--output", str(output), "--batch-texts", "8", "--in-flight", "4")
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdin is not None
    # Held only from here: the command is connected and waits for its input. (A batch held long
    # enters the server's service rate as one very slow batch; see the report on admission.)
    wait_until(lambda: output.exists(), 120, "the command connected")
    before = server.metric(REFUSED_REQUESTS)
    with grpc.insecure_channel(server.target) as channel, server.engine:
        stub = pb_grpc.EmbedderStub(channel)
        backlog = held_until_refused(server, stub)
        # A unary refusal is counted once answered: the count from here is the command's alone.
        refused = before + sum(call.done() for call in backlog)
        wait_until(lambda: server.metric(REFUSED_REQUESTS) == refused, 120, "the backlog's refusals counted")
        process.stdin.write("".join(f"{text}\n" for text in TEXTS[:100]).encode())
        process.stdin.flush()  # closed by communicate below
        # The engine computes nothing until the command has been refused (or has ended: said below).
        wait_until(lambda: server.metric(REFUSED_REQUESTS) > refused or process.poll() is not None, 120, "a refusal")
        assert process.poll() is None, process.communicate()[1].decode()
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr.decode()
    assert summary_count(stdout.decode(), "retries") >= 1
    assert_same_vectors(read_jsonl(output), reference[:100])


def held_until_refused(server: ServerProcess, stub: pb_grpc.EmbedderStub) -> list[grpc.Future]:
    """A backlog in the held engine that leaves the drain budget no room for any request: more
    requests than the budget holds at the rate measured (which stays while nothing computes), then
    one-text requests, the least a request costs, until one is refused. Whatever this machine's rate,
    every request of the command (batch work, weighed against all of it) is refused. A backlog of
    40 requests alone left what its last one did not fit: at 4,075 padded tokens/s, 117 of a budget
    of 2,037 tokens, and the command's first request (112) was admitted into the held engine,
    neither refused nor answered."""
    info = stub.Info(pb.InfoRequest(), timeout=60)
    least = min(info.buckets)
    count = info.admission_budget_tokens // (least * len(REQUEST.texts)) + 1  # more than the budget holds
    backlog = [stub.Embed.future(REQUEST, timeout=600) for _ in range(count)]
    wait_until(lambda: all_decided(server, backlog), 120, "a backlog")
    while True:  # the room the last of them did not fit may still hold a smaller request
        backlog.append(stub.Embed.future(ONE_TEXT, timeout=600))
        wait_until(lambda: all_decided(server, backlog), 120, "a one-text request decided")
        if backlog[-1].done():  # refused (held, nothing is answered): less room than any request needs
            break
    assert {call.code() for call in backlog if call.done()} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    return backlog


# Connections closed 5 s after their age of 10 s: a stream held that long breaks. Once the engine
# is released, a stream's 15 s are far more than its two batches take on a machine busy with other
# work, where compute runs below everything else (2 s were not: every stream broke again).
aging_server = server_fixture(
    held=True,
    admission="",
    max_connection_age_ms=10_000,
    drain_timeout_s=5,  # the connection's grace after its age
    default_timeout_ms=NO_DEADLINE_MS,
)


def test_a_broken_stream_is_opened_again_and_its_requests_resent(
    aging_server: ServerProcess, reference: np.ndarray, tmp_path: Path
):
    server = aging_server
    source = write_lines(tmp_path / "corpus.txt", TEXTS[:40])
    output = tmp_path / "vectors.npy"
    errors = tmp_path / "stderr.txt"
    flags = ["--input", str(source), "--output", str(output), "--batch-texts", "8", "--in-flight", "2", "--no-progress"]
    with errors.open("w") as stderr, server.engine:
        process = subprocess.Popen(embed_command(server, *flags), stdout=subprocess.PIPE, stderr=stderr, text=True)
        # Held, the requests stay on the stream until its connection is closed under them.
        wait_until(lambda: "stream broke" in errors.read_text(), 120, "the stream broken")
    stdout, _ = process.communicate(timeout=600)
    assert process.returncode == 0, errors.read_text()
    assert summary_count(stdout, "reconnects") >= 1
    assert_same_vectors(np.load(output), reference[:40])


# --- a slow server: pace by its pushback ----------------------------------------------------------


# A drain budget of 300 ms: about one request of 32 short texts at a time on this CPU.
slow_server = server_fixture(max_drain_ms=300, default_timeout_ms=NO_DEADLINE_MS)


def test_under_a_low_service_rate_the_command_paces_by_the_pushback(slow_server: ServerProcess, tmp_path: Path):
    """Resending the whole window after each pushback got four refusals a text (13 in the runs of
    this test); the window of requests in flight drops to one at a refusal and grows back, so a
    refusal comes at most once per two requests admitted, a few more while it first grows."""
    server = slow_server
    texts = [f"short text number {i}" for i in range(200)]
    source = write_lines(tmp_path / "corpus.txt", texts)
    output = tmp_path / "vectors.npy"
    summary = tmp_path / "summary.json"
    before = server.metric(REFUSED_REQUESTS)
    flags = ["--no-progress", "--summary-file", str(summary)]
    result = run_embed(server, "--input", str(source), "--output", str(output), *flags)
    assert result.returncode == 0, result.stderr
    refused = server.metric(REFUSED_REQUESTS) - before
    assert summary_count(result.stdout, "refusals") == refused
    record = json.loads(summary.read_text())  # bench.serving.corpus reads the refusals from here
    assert (record["refusals"], record["retries"]) == (refused, summary_count(result.stdout, "retries"))
    assert refused <= len(texts) / 8, result.stdout
    with EmbedClient(server.target, timeout_s=600) as client:
        assert_same_vectors(
            np.load(output), np.concatenate([client.embed(texts[i : i + 50]) for i in range(0, 200, 50)])
        )
