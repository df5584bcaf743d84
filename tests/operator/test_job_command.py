"""The rendered command really works: an EmbeddingJob's pod command, for every index, run here.

The Job's container command and arguments are taken from the render, ``$(JOB_COMPLETION_INDEX)``
is expanded the way the kubelet does (from the container's own variables, the index resolved from
the pod annotation the Job controller writes), the claims' mount paths are mapped to a temporary
folder and ``/dev/termination-log`` to a file, and each index runs as a subprocess against a real
kembed server on loopback. The parts, read in the manifest's order, must equal one unsharded run of
the same command row for row; one index is killed mid-way and run again: nothing duplicated or lost.

It needs the corpus command's ``--shard`` and ``--summary-file`` (the client's side of issue 28):
without them it is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kembed.client.corpus import command as corpus_command
from kembed.client.corpus.parts import growing_path
from kembed.contract import GRPC_PORT
from kembed_operator import job_render, job_status, kinds, render
from kembed_operator.config import OperatorConfig
from kembed_operator.job_spec import parse_job_spec
from kembed_operator.spec import parse_spec
from tests.server.folders import unwritable_folder
from tests.server.serving import ServerProcess, wait_until

SHARDS = 3
DIMS = 384
OWNER = render.Owner("wiki", "search", "uid", kinds.EMBEDDING_JOB)
SPEC = {
    "service": "bge",
    "input": {"claimName": "corpora", "path": "wiki/texts.txt"},
    "output": {"claimName": "vectors", "path": "wiki/emb.npy"},
    "shards": SHARDS,
}
WORDS = ["pods", "nodes", "queue", "token", "vector", "batch", "model", "drain", "budget", "replica", "shard"]
TEXTS = [f"line {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 11)) for i in range(900)]
TEXTS[5] = "naïve café, 東京, emoji 🚀\ttab"  # multi-byte characters near a shard's byte boundary or not
TEXTS[400] = "a long document about embeddings " * 60


@cache
def client_shards() -> bool:
    """Whether this checkout's corpus command has the interface the operator renders against."""
    help_text = subprocess.run(
        [sys.executable, "-m", "kembed.client", "embed", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    return "--shard" in help_text and "--summary-file" in help_text


@pytest.fixture(scope="module")
def shards_supported() -> None:
    if not client_shards():
        pytest.skip(
            "`python -m kembed.client embed --help` lists no --shard/--summary-file: the client branch adds them "
            "(issue 28); this test must run after that merge"
        )


def rendered_job(**changes: Any) -> dict[str, Any]:
    target = job_render.Target("bge", "search", parse_spec({}))
    return job_render.render_job(OWNER, 1, parse_job_spec({**SPEC, **changes}), target, OperatorConfig()).manifest


def rendered_container(**changes: Any) -> dict[str, Any]:
    (container,) = rendered_job(**changes)["spec"]["template"]["spec"]["containers"]
    return dict(container)


def fails_its_index_at_once(job: dict[str, Any], code: int) -> bool:
    """Whether the Job's podFailurePolicy fails an index on this exit code of the container, no retry."""
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes", {})
        ours = codes.get("containerName") == job_render.CONTAINER and codes.get("operator") == "In"
        if ours and code in codes["values"]:
            return bool(rule["action"] == "FailIndex")
    return False


def expand(text: str, variables: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: a defined variable's value, ``$$`` a literal ``$``, and an
    undefined reference left as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return variables.get(name, match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


def pod_command(container: dict[str, Any], index: int) -> tuple[list[str], dict[str, str]]:
    """(argv, variables) as the kubelet starts the container of the pod for ``index``."""
    annotations = {job_render.INDEX_ANNOTATION: str(index)}
    variables: dict[str, str] = {}
    for entry in container["env"]:
        if "valueFrom" in entry:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            key = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
            assert key is not None, path  # the only downward-API field the render uses
            variables[entry["name"]] = annotations[key.group(1)]
        else:
            variables[entry["name"]] = expand(entry.get("value", ""), variables)
    argv = [expand(part, variables) for part in [*container["command"], *container["args"]]]
    return argv, variables


def localized(argv: list[str], claims: Path, target: str, termination: Path) -> list[str]:
    """The pod's argv run here: this interpreter, the claims under ``claims``, the server on loopback."""
    assert argv[0] == "python"  # the image's interpreter; here, this one (which has the client)
    out = [sys.executable, *argv[1:]]
    address = out.index("--target") + 1
    assert out[address] == f"bge.search.svc.cluster.local:{GRPC_PORT}"
    out[address] = target
    summary = out.index("--summary-file") + 1
    assert out[summary] == job_render.TERMINATION_LOG
    out[summary] = str(termination)
    return [_on_claims(part, claims) for part in out]


def _on_claims(part: str, claims: Path) -> str:
    """``part`` (a path, or ``--flag=path``) with the pod's claims' mount path mapped to ``claims``."""
    flag, equals, value = part.rpartition("=") if part.startswith("--") else ("", "", part)
    if value.startswith(job_render.DATA_DIR + "/"):
        value = str(claims) + value[len(job_render.DATA_DIR) :]
    return flag + equals + value


def option(argv: list[str], flag: str) -> str:
    """The value of ``flag`` in ``argv``, written ``--flag value`` or ``--flag=value``."""
    for at, part in enumerate(argv):
        if part == flag:
            return argv[at + 1]
        if part.startswith(flag + "="):
            return part[len(flag) + 1 :]
    raise AssertionError(f"{flag} not in {argv}")


def test_the_kubelet_sees_one_shard_per_index(tmp_path: Path) -> None:
    """The harness itself (runs without the client's --shard): each index gets its own shard."""
    container = rendered_container()
    for index in range(SHARDS):
        argv, variables = pod_command(container, index)
        assert variables["JOB_COMPLETION_INDEX"] == str(index)
        assert argv[argv.index("--shard") + 1] == f"{index}/{SHARDS}"
        local = localized(argv, tmp_path, "127.0.0.1:1", tmp_path / "log")
        assert option(local, "--input") == str(tmp_path / "corpora/wiki/texts.txt")
        assert option(local, "--output") == str(tmp_path / "vectors/wiki/emb.npy")
    assert expand("$$(JOB_COMPLETION_INDEX) $(UNSET) $(A)", {"A": "1"}) == "$(JOB_COMPLETION_INDEX) $(UNSET) 1"


def test_what_the_author_wrote_reaches_the_command_as_written() -> None:
    """A field that starts with ``-`` stays a value, and a ``$(VAR)`` in it is not expanded by the
    kubelet: the corpus command's own parser reads back exactly what the resource says."""
    authored = "-x$(JOB_COMPLETION_INDEX)$$"
    source = {"claimName": "corpora", "path": "-a/$(HOME).jsonl", "format": "jsonl", "jsonlField": authored}
    container = rendered_container(input=source, prompt=f"-{authored}: ", truncationDirection="left")
    argv, _ = pod_command(container, 1)
    args = corpus_command.parser().parse_args(argv[argv.index("embed") + 1 :])
    assert args.jsonl_field == authored
    assert args.truncation_direction == "left"
    assert args.prompt == f"-{authored}: "
    assert args.input == f"{job_render.DATA_DIR}/corpora/-a/$(HOME).jsonl"
    assert option(argv, "--shard") == "1/3"  # the operator's own reference still expands


@pytest.fixture
def server(shards_supported: None, held_server: ServerProcess) -> ServerProcess:
    """The session's held server: no admission, no deadline (HELD), so every request is answered
    however busy the machine; released after each test."""
    return held_server


def part(claims: Path, index: int) -> Path:
    return claims / f"vectors/wiki/emb.part-{index:05d}-of-{SHARDS:05d}.npy"


def appended_rows(path: Path) -> int:
    """Whole rows in an .npy file being written, committed or not (its header counts only the
    committed ones: the rest a re-run embeds again)."""
    if not path.exists() or path.stat().st_size < 10:
        return 0
    head = path.read_bytes()[:12]
    header = 10 + int.from_bytes(head[8:10], "little") if head[6] == 1 else 12 + int.from_bytes(head[8:12], "little")
    return max(0, (path.stat().st_size - header) // (DIMS * 4))


def committed_rows(path: Path) -> int:
    """The rows an .npy file's header counts: what its writer committed."""
    with path.open("rb") as file:
        assert np.lib.format.read_magic(file) == (1, 0)  # what the corpus command writes
        shape, _, _ = np.lib.format.read_array_header_1_0(file)
    return int(shape[0])


def run_index(argv: list[str], variables: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **variables}
    return subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=600)


def assert_same_vectors(rows: np.ndarray, reference: np.ndarray) -> None:
    assert rows.shape == reference.shape and rows.dtype == np.float32
    cosines = np.sum(rows * reference, axis=1) / np.linalg.norm(rows, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.9999, (cosines.argmin(), cosines.min())


@pytest.mark.process
@pytest.mark.timeout(1200)
def test_every_index_runs_and_the_parts_are_one_unsharded_run(server: ServerProcess, tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    source = claims / "corpora/wiki/texts.txt"
    source.parent.mkdir(parents=True)
    (claims / "vectors/wiki").mkdir(parents=True)
    source.write_text("".join(f"{text}\n" for text in TEXTS), encoding="utf-8")
    container = rendered_container()
    summaries: dict[int, dict[str, Any]] = {}

    def command(index: int) -> tuple[list[str], dict[str, str], Path]:
        argv, variables = pod_command(container, index)
        termination = tmp_path / f"termination-{index}"
        return localized(argv, claims, server.target, termination), variables, termination

    # Index 1 first, killed mid-way: the engine is held once some rows are committed, so more are
    # in flight (and lost with the process) when it dies.
    argv, variables, termination = command(1)
    process = subprocess.Popen(argv, env={**os.environ, **variables}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    growing = growing_path(part(claims, 1), "npy")  # a part is at its own name only once complete
    wait_until(lambda: appended_rows(growing) >= 32 or process.poll() is not None, 600, "32 rows written")
    server.engine.hold()
    wait_until(lambda: server.health()["open_requests"] >= 1 or process.poll() is not None, 120, "work in flight")
    assert process.poll() is None, process.communicate()  # still mid-way
    process.send_signal(signal.SIGKILL)
    process.wait(60)
    written, committed = appended_rows(growing), committed_rows(growing)
    server.engine.release()

    for index in range(SHARDS):  # the killed index again, with the same command, and the others
        argv, variables, termination = command(index)
        result = run_index(argv, variables)
        assert result.returncode == 0, result.stderr
        summaries[index] = json.loads(termination.read_text())
        assert summaries[index]["shard"] == f"{index}/{SHARDS}" and summaries[index]["complete"] is True
    assert 32 <= written < summaries[1]["rows"]  # it was killed mid-way...
    assert summaries[1]["embedded"] == summaries[1]["rows"] - committed  # ...and went on from its last commit
    assert sum(summary["rows"] for summary in summaries.values()) == len(TEXTS)

    manifest_path = claims / "vectors/wiki/emb.manifest.json"
    manifest = manifest_path.read_text()
    names = [part(claims, index).name for index in range(SHARDS)]
    assert [manifest.index(name) for name in names] == sorted(manifest.index(name) for name in names)
    parts = np.concatenate([np.load(part(claims, index)) for index in range(SHARDS)])

    # One unsharded run of the same command: no --shard, its own output.
    argv, variables, _ = command(0)
    whole = claims / "vectors/whole.npy"
    shard = argv.index("--shard")
    unsharded = argv[:shard] + argv[shard + 2 :]
    summary_at = unsharded.index("--summary-file")
    unsharded = unsharded[:summary_at] + unsharded[summary_at + 2 :]
    unsharded = [part for part in unsharded if not part.startswith("--output")] + ["--output", str(whole)]
    result = run_index(unsharded, variables)
    assert result.returncode == 0, result.stderr
    assert_same_vectors(parts, np.load(whole))


FOR_GOOD = {
    # the EmbeddingJob's changes, what breaks on the claims, the start of what the command says
    "dimensions the model lacks": ({"dimensions": 1000}, "", "--dimensions: 1000 exceeds the model's 384"),
    "a missing input": ({}, "input", "--input: {claims}/corpora/wiki/texts.txt: No such file or directory; "),
    "an output it cannot write": ({}, "output", "--output: {claims}/vectors/wiki/emb.part-00001-of-00003.npy.partial"),
}


@pytest.mark.process
@pytest.mark.parametrize("case", FOR_GOOD)
def test_a_shard_no_retry_can_fix_fails_at_once_and_the_status_says_which_and_why(
    server: ServerProcess, tmp_path: Path, case: str
) -> None:
    """These exited 1, which the Job retries: every shard ran perShard + 1 pods. The rendered command
    exits with a code the Job's podFailurePolicy fails the index on, its termination message says
    why, and the status the operator makes of that pod names the shard and the reason."""
    changes, broken, says = FOR_GOOD[case]
    claims = tmp_path / "claims"
    source = claims / "corpora/wiki/texts.txt"
    source.parent.mkdir(parents=True)
    (claims / "vectors/wiki").mkdir(parents=True)
    if broken != "input":
        source.write_text("".join(f"{text}\n" for text in TEXTS[:30]), encoding="utf-8")
    job = rendered_job(**changes)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    argv, variables = pod_command(container, 1)
    termination = tmp_path / "termination-log"
    with contextlib.ExitStack() as stack:
        if broken == "output":
            stack.enter_context(unwritable_folder(claims / "vectors/wiki"))
        result = run_index(localized(argv, claims, server.target, termination), variables)

    assert fails_its_index_at_once(job, result.returncode), (result.returncode, result.stderr)
    message = termination.read_text()  # what the kubelet makes the pod's termination message
    said = json.loads(message)["error"]
    assert said.startswith(says.format(claims=claims)), said
    assert result.stderr == f"kembed embed: {said}\n"  # one line, no traceback

    pod = {
        "metadata": {
            "annotations": {job_render.INDEX_ANNOTATION: "1"},
            "ownerReferences": [{"uid": "job-uid", "controller": True}],
        },
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": job_render.CONTAINER,
                    "state": {"terminated": {"exitCode": result.returncode, "message": message, "finishedAt": "T"}},
                }
            ],
        },
    }
    job["metadata"]["uid"] = "job-uid"
    job["status"] = {"active": 2, "failed": 1, "failedIndexes": "1"}
    seen = job_status.JobObserved(1, SHARDS, "wiki/emb.manifest.json", job, [job_status.trimmed(pod)], None)
    status = job_status.compute(seen, {}, "2026-01-01T00:00:00Z")
    assert status["failedShards"] == [{"shard": 1, "exitCode": result.returncode, "message": said}]
    assert (status["shardsFailed"], status["podFailures"]) == (1, 1)
