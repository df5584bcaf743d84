"""The CPU's compiled forward (kembed.engine.cpu_compile): which forward serves and why, decided on
measured figures; a real server that compiles, computing in lanes and matching sentence-transformers;
one whose compiler is missing, serving eager and saying why. The only test servers that compile:
every other one pins ``KEMBED_COMPILE=off`` (tests/server/serving.py)."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from kembed.config.settings import Settings
from kembed.config.values import Graphs, Toggle
from kembed.contract import COMPILING
from kembed.domain.inputs import Sequences
from kembed.engine import compile_cache, cpu, cpu_compile, verdicts
from kembed.engine.cpu_compile import COMPILED, EAGER, GRAPHS
from kembed.engine.graphs import CompileCount
from kembed.engine.model import EmbeddingModel
from kembed.engine.precision import MIN_COSINE, PROBE_TEXTS
from kembed.engine.runner import ModelRunner
from kembed.engine.warmup import compile_while_serving, min_cosine, start_runner
from kembed.policy.shapes import Queueing
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, serving, wait_until

SHAPES = [(64, 8), (16, 32)]  # (seq_len, rows)
# Few, small shapes: the compile is paid once per server, and its shapes are dynamic anyway.
SMALL: dict[str, Any] = {"buckets": "16,64", "max_batch_size": 16, "max_tokens_per_batch": 512, "frontends": 1}


@pytest.mark.parametrize(
    ("asked", "eager_s", "compiled_s", "cosine", "forward", "why"),
    [
        (
            "auto",
            [1.0, 1.0],
            [0.7, 0.9],
            0.9999,
            COMPILED,
            "auto: compiled 1.25x eager's speed (8x64 1.43x, 32x16 1.11x)",
        ),
        ("auto", [1.0, 1.0], [0.5, 1.1], 0.9999, EAGER, "not 1.05x overall and 0.95x on every shape"),  # one slower
        ("auto", [1.0, 1.0], [0.8, 1.0], 0.9999, COMPILED, "compiled 1.11x"),  # one shape at 1.00x: noise
        ("auto", [1.0, 1.0], [0.99, 0.99], 0.9999, EAGER, "not 1.05x overall"),  # within the noise
        ("auto", [1.0, 1.0], [0.5, 0.5], 0.99, EAGER, "min cosine 0.99000, under 0.999"),
        ("on", [1.0, 1.0], [1.5, 1.5], 0.99, COMPILED, "KEMBED_COMPILE=on: compiled 0.67x"),  # explicit wins
    ],
)
def test_auto_serves_compiled_only_where_it_is_faster_and_no_shape_slower_and_accurate(
    asked: str, eager_s: list[float], compiled_s: list[float], cosine: float, forward: str, why: str
) -> None:
    served = cpu_compile.measured(Toggle(asked), SHAPES, eager_s, compiled_s, cosine)
    assert served.forward == forward and why in served.why, served


@pytest.mark.parametrize(
    ("asked", "device", "batching", "graphs", "fixed", "tried", "forward"),
    [
        ("auto", "cpu", "token_bucket", "capture", False, True, None),
        ("on", "cpu", "token_bucket", "capture", False, True, None),
        ("on", "cpu", "token_bucket", "static", True, False, GRAPHS),
        ("off", "cpu", "token_bucket", "capture", False, False, EAGER),
        ("auto", "cpu", "naive", "capture", False, False, EAGER),
        ("auto", "cuda", "token_bucket", "capture", True, False, GRAPHS),
        ("off", "cuda", "token_bucket", "capture", False, False, EAGER),
    ],
)
def test_a_cpu_compiles_one_forward_for_packed_batches_and_fixed_shapes_only_when_static(
    asked: str, device: str, batching: str, graphs: str, fixed: bool, tried: bool, forward: str | None
) -> None:
    queueing = Queueing(one_queue=batching == "naive", compile=Toggle(asked), graphs=Graphs(graphs))
    assert queueing.compiles(device) is fixed
    assert queueing.compiles_forward(device) is tried
    if forward is not None:
        assert cpu_compile.unmeasured(Toggle(asked), fixed).forward == forward


def test_the_compile_waits_for_a_window_with_cpu_to_spare() -> None:
    """A pod that joins under load serves eager at its full speed: its compile starts only once a
    quarter of its CPUs went unused over a whole window (two CPUs, a 10 s window here)."""
    spare = cpu_compile.SpareCpu(cpus=2.0, share=0.25, window_s=10.0)
    assert not spare.spare(used_s=0.0, now=0.0)
    assert not spare.spare(used_s=5.0, now=5.0)  # half idle, but not a whole window seen yet
    assert not spare.spare(used_s=19.0, now=10.0)  # 19 of 20 CPU-seconds used: under load
    assert not spare.spare(used_s=28.0, now=15.0)  # 23 of 20 over the last 10 s (a burst past the quota)
    assert spare.spare(used_s=30.0, now=20.0)  # 11 of 20: the load left room


def test_cpu_use_is_the_containers_where_its_cgroup_says_else_the_machines(tmp_path) -> None:
    stat, proc = tmp_path / "cpu.stat", tmp_path / "stat"
    stat.write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    proc.write_text("cpu  100 0 50 800 50 0 10 0 0 0\ncpu0 50 0 25 400 25 0 5 0 0 0\n")
    assert cpu.cpu_seconds_used(stat, proc) == (2.5, True)
    used, own = cpu.cpu_seconds_used(tmp_path / "absent", proc)  # cgroup v1, or no cgroup: the machine
    assert not own and used == pytest.approx(160 / os.sysconf("SC_CLK_TCK"))  # idle and iowait left out


def test_a_failed_compile_says_what_failed_on_one_line() -> None:
    served = cpu_compile.failed(RuntimeError("InvalidCxxCompiler: No working C++ compiler found\ntraceback..."))
    assert served == cpu_compile.Served(
        EAGER, "compile failed, serving eager: RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    )


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_padding_a_one_token_batch_leaves_its_vectors_as_they_were(stock_model: EmbeddingModel, pooling: str) -> None:
    """What the compiled forward does to dodge dynamo's 0/1 specialisation, on the eager forward:
    the padded column is masked out of attention and of every pooling."""
    info = dataclasses.replace(stock_model.info, pooling=pooling)
    model = EmbeddingModel(stock_model._model, stock_model.tokenizer, info)
    padded = cpu_compile.padded_to_min_length(model.forward, info.pad_token_id)
    ids, mask = torch.tensor([[101], [2023]], dtype=torch.int32), torch.ones((2, 1), dtype=torch.int32)
    with torch.inference_mode():
        as_is, two = model.forward(ids, mask).numpy(), padded(ids, mask).numpy()
    assert min_cosine(as_is, two) >= 0.99999


@pytest.mark.process
def test_warmup_compiles_at_a_lanes_threads_so_a_lane_runs_what_it_compiled(tmp_path, monkeypatch) -> None:
    """Dynamo guards on the thread count: a forward warmed at another count than a lane's would
    compile again at every lane's first batch, mid-traffic (on one core, the counts cannot differ)."""
    for name in (compile_cache.INDUCTOR_ENV, compile_cache.TRITON_ENV):
        monkeypatch.setenv(name, "")  # restored after the test: the start points them at tmp_path
    monkeypatch.setattr(cpu, "share_cores", lambda *_: None)  # niceness is never lowered again: not here
    plan = {key: value for key, value in SMALL.items() if key != "frontends"}
    settings = Settings.from_env(
        {}, compile="on", dtype="bfloat16", compute_lanes=2, compile_cache_dir=str(tmp_path), **plan
    )
    threads = cpu.lane_threads(settings.cpus(), 2)
    before = CompileCount.now()
    try:
        runner = start_runner(settings, EmbeddingModel.load, lambda: None)
        assert runner.served == cpu_compile.pending(Toggle.ON)  # ready on eager
        assert compile_while_serving(settings, runner).forward == COMPILED
        assert runner.served.forward == COMPILED
        assert (CompileCount.now() - before).graphs == 2  # the general graph and the one-row one

        def lane() -> None:
            cpu.enter_lane(threads)
            runner.embed(runner.model.tokenizer.from_texts(list(PROBE_TEXTS[:5]), truncate=True))

        computing = threading.Thread(target=lane)
        computing.start()
        computing.join()
        assert (CompileCount.now() - before).graphs == 2  # the lane ran what warmup compiled

        # Dynamo specialises sizes 0 and 1: one token, alone or beside others, runs a warmed graph
        # (padded to two), and its vector is eager's.
        one_token = Sequences(np.array([101, 101, 2023], dtype=np.int32), np.array([1, 1, 1], dtype=np.int32))
        with cpu.threads_of_a_lane(threads):
            alone = runner.embed(Sequences(one_token.ids[:1], one_token.lengths[:1]))
            together = runner.embed(one_token)
        assert (CompileCount.now() - before).graphs == 2
        eager = ModelRunner(EmbeddingModel.load(settings), runner.plan)
        assert min_cosine(alone, eager.embed(Sequences(one_token.ids[:1], one_token.lengths[:1]))) >= MIN_COSINE
        assert min_cosine(together, eager.embed(one_token)) >= MIN_COSINE
    finally:
        torch.compiler.reset()


def test_a_kept_eager_verdict_compiles_nothing_and_says_it_was_read(tmp_path, monkeypatch) -> None:
    """A later start of a service follows the forward verdict an earlier one measured: where that
    was eager, nothing is compiled beside serving."""
    monkeypatch.setattr(cpu, "share_cores", lambda *_: None)
    plan = {key: value for key, value in SMALL.items() if key != "frontends"}
    settings = Settings.from_env({}, compile="auto", compile_cache_dir=str(tmp_path), **plan)
    runner = start_runner(settings, EmbeddingModel.load, lambda: None)
    info, threads = runner.model.info, cpu.lane_threads(settings.cpus(), runner.plan.lanes)
    ident = verdicts.identity("forward", info.path, dtype=str(info.dtype), lane_threads=str(threads))
    with verdicts.held(str(tmp_path), ident) as kept:
        kept.keep({"forward": EAGER, "why": "auto: compiled 0.87x eager's speed"})
    before = CompileCount.now()
    served = compile_while_serving(settings, runner)
    assert served.forward == EAGER and served.why.startswith("as measured before (")
    assert served.why.endswith("auto: compiled 0.87x eager's speed") and runner.served == served
    assert CompileCount.now() - before == CompileCount()


def rows(reply: pb.EmbedResponse) -> np.ndarray:
    return np.frombuffer(reply.embeddings, dtype="<f4").reshape(reply.count, reply.dimensions)


def served_forward(server: ServerProcess) -> tuple[str, str]:
    """Which forward serves and why, as /health, Info and the metric say it alike."""
    health = server.health()
    with grpc.insecure_channel(server.target) as channel:
        assert pb_grpc.EmbedderStub(channel).Info(pb.InfoRequest(), timeout=10).forward == health["forward"]
    forward, why = health["forward"], health["forward_reason"]
    assert server.metric(f'kembed_serving_forward{{forward="{forward}",reason="{why}"}}') == 1
    return forward, why


def compiled_forward(server: ServerProcess, timeout: float = 900) -> tuple[str, str]:
    """Which forward serves once the compile beside serving has ended (a cold compile on two busy cores)."""
    wait_until(lambda: COMPILING not in server.health()["forward_reason"], timeout, "the compile beside serving")
    return served_forward(server)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("compiled")
    with serving(
        folder,
        admission="",  # these tests are about the answers, not the busy machine's service rate
        compile="on",
        dtype="bfloat16",  # what auto serves on a CPU with bf16 units, and where compiling pays most
        compute_lanes=2,
        compile_cache_dir=str(folder / "cache"),
        **SMALL,
    ) as server:
        yield server  # ready on eager: the compile comes once it serves


@pytest.mark.process
def test_a_cpu_server_is_ready_on_eager_and_compiles_while_it_serves(compiled: ServerProcess) -> None:
    """Readiness waits for no compile: a pod is ready in an eager warmup's time, and the compile
    (tens of seconds cold on two cores) runs on a thread beside the lanes."""
    with grpc.insecure_channel(compiled.target) as channel:
        first = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["served at once"]), timeout=120)
    assert rows(first).shape == (1, 384)
    assert f"eager: KEMBED_COMPILE=on: {COMPILING}" in compiled.output()  # the warm line: ready on eager
    assert compiled_forward(compiled)[0] == COMPILED
    assert compiled.metric(f'kembed_serving_forward{{forward="eager",reason="KEMBED_COMPILE=on: {COMPILING}"}}') == 0


@pytest.mark.process
def test_a_compiled_server_says_so_and_its_lanes_match_sentence_transformers(
    compiled: ServerProcess, st_model: Any
) -> None:
    forward, why = compiled_forward(compiled)
    assert forward == COMPILED and why.startswith("KEMBED_COMPILE=on: compiled "), why
    texts = list(PROBE_TEXTS)
    reference = st_model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    with grpc.insecure_channel(compiled.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        # Two calls at once, each of every text: batches for both lanes.
        calls = [stub.Embed.future(pb.EmbedRequest(texts=texts, truncate=True), timeout=120) for _ in range(2)]
        served = np.concatenate([rows(call.result()) for call in calls])
    cosines = np.sum(served * np.tile(reference, (2, 1)), axis=1) / np.linalg.norm(served, axis=1)
    assert cosines.min() >= MIN_COSINE, cosines.min()
    assert "computing 2 batches at once" in compiled.output()


@pytest.mark.process
def test_a_missing_compiler_serves_eager_and_says_why(tmp_path) -> None:
    server = ServerProcess(
        tmp_path / "server.log",
        environ={"CXX": str(tmp_path / "no-such-g++")},
        compile="on",
        compile_cache_dir=str(tmp_path / "cache"),  # empty: nothing compiled before can be loaded
        **SMALL,
    )
    try:
        server.wait_ready(timeout=300)
        forward, why = compiled_forward(server)
        assert forward == EAGER and why.startswith("compile failed, serving eager: "), why
        with grpc.insecure_channel(server.target) as channel:
            reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["still served"]), timeout=120)
        assert rows(reply).shape == (1, 384)
        assert "compile failed, serving eager" in server.output()
    finally:
        server.stop()
