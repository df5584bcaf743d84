"""A lone well-behaved client is never refused by an idle server (issue 59: a 20,000-text
``EmbedClient.embed`` drew 188 RESOURCE_EXHAUSTED on this machine before the client kept to the
server's admission budget, and the corpus command broke its stream at the connection's age). Counted
by the server's own metrics: every refusal, whatever refused it, and every stream the corpus command
had to open again."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kembed.client import EmbedClient
from tests.server.serving import ServerProcess

TOPICS = ["pods", "nodes", "vectors", "queues", "tokens", "shards", "replicas", "graphs"]
TEXTS = [
    f"note {i} on {TOPICS[i % 8]} and {TOPICS[i * 7 % 8]}, kept for {i % 97} days by shard {i * 13 % 1000}"
    for i in range(20_000)
]
SAMPLED = [0, 1, 2_047, 2_048, 13_001, 19_999]  # rows compared with the text embedded alone
# Every sample of /metrics that counts a refusal: admission's by reason, and every answer that was one.
REFUSAL = re.compile(
    r'^(kembed_rejected_total\{.*|kembed_requests_total\{.*code="(?:RESOURCE_EXHAUSTED|429)".*) (\S+)$'
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The defaults but a connection's age of 1 s and a grace of 10 s (the drain timeout): a stream
    open past about 11 s would be cut, as a 5-minute age and 25 s grace cut it in a long run."""
    log = tmp_path_factory.mktemp("lone") / "server.log"
    running = ServerProcess(log, max_connection_age_ms=1000, drain_timeout_s=10)
    yield running.wait_ready()
    running.stop()


def refusals(server: ServerProcess) -> dict[str, float]:
    """The server's refusals so far, by sample (none: an empty dict)."""
    status, body = server.http("/metrics")
    assert status == 200
    found = {m[1]: float(m[2]) for line in body.splitlines() if (m := REFUSAL.match(line))}
    return {sample: value for sample, value in found.items() if value}


@pytest.mark.process
@pytest.mark.timeout(1800)  # 20,000 texts on two busy cores: minutes
def test_twenty_thousand_texts_from_one_client_draw_no_refusal(server: ServerProcess):
    with EmbedClient(server.target) as client:
        vectors = client.embed(TEXTS)
        refused, retries = client.refusals, client.retries
        alone = np.concatenate([client.embed([TEXTS[i]]) for i in SAMPLED])
    assert refusals(server) == {}
    assert (refused, retries) == (0, 0)
    assert vectors.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(vectors[SAMPLED], alone, atol=1e-5)  # row for row, in input order


@pytest.mark.process
@pytest.mark.timeout(1800)
def test_the_corpus_command_takes_turns_of_streams_silently_and_draws_no_refusal(server: ServerProcess, tmp_path: Path):
    corpus, output, summary = tmp_path / "corpus.txt", tmp_path / "corpus.npy", tmp_path / "summary.json"
    corpus.write_text("\n".join(TEXTS) + "\n")
    before = refusals(server)
    command = [sys.executable, "-m", "kembed.client", "embed", "--target", server.target, "--input", str(corpus)]
    command += ["--output", str(output), "--no-progress", "--summary-file", str(summary)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no stream broke, nothing to say
    said = json.loads(summary.read_text())
    assert (said["rows"], said["retries"], said["refusals"], said["reconnects"]) == (len(TEXTS), 0, 0, 0), said
    assert refusals(server) == before
    with EmbedClient(server.target) as client:
        alone = client.embed([TEXTS[i] for i in SAMPLED], priority="batch")
    np.testing.assert_allclose(np.load(output)[SAMPLED], alone, atol=1e-5)
