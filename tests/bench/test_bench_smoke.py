"""Fast checks of the benchmark machinery: workload, arrivals, load generator, report math."""

from __future__ import annotations

import os
import statistics
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import torch

from bench import headline, plot
from bench.compute import batches, ceiling
from bench.serving import serve_load
from bench.tools import loadgen, workload
from bench.tools.report import (
    Spread,
    deltas_by_label,
    metric_delta,
    padding_ratio,
    parse_prometheus,
    percentile,
    ratio_table,
    splice,
    window_rates,
    worker_figures,
)
from bench.tools.server import Server
from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.engine.batcher import BatchShapes
from kembed.v1 import embedder_pb2


@pytest.fixture(scope="module")
def count_tokens() -> workload.TokenCounter:
    return workload.tokenizer_counter()


@pytest.mark.process
@pytest.mark.usefixtures("workload_corpus")
def test_workload_is_deterministic_and_covers_every_bucket(count_tokens: workload.TokenCounter) -> None:
    first = workload.build(count_tokens, size=64)
    again = workload.build(count_tokens, size=64)
    assert first.texts == again.texts
    assert first.fingerprint() == again.fingerprint()
    assert all(n > 0 for n in workload.histogram(first.tokens).values())
    assert workload.build(count_tokens, size=64, seed=1).texts != first.texts
    assert first.tokens == count_tokens(first.texts)


def test_workload_shares_follow_the_mix() -> None:
    quotas = workload._quotas(1000, workload.MIX)
    assert sum(quotas.values()) == 1000
    assert quotas == {c: round(1000 * w) for c, w in workload.MIX.items()}
    assert all(q >= 1 for q in workload._quotas(3, workload.MIX).values())


def test_calls_of_many_texts_take_consecutive_texts_and_leave_a_partial_group_out() -> None:
    calls = [embedder_pb2.EmbedRequest.FromString(c) for c in serve_load.encode_requests(list("abcdefg"), 3)]
    assert [list(c.texts) for c in calls] == [["a", "b", "c"], ["d", "e", "f"]] and all(c.truncate for c in calls)


def test_bucket_class_boundaries() -> None:
    assert [workload.bucket_class(t) for t in (1, 16, 17, 256, 257)] == ["16", "16", "32", "256", "over"]


def test_poisson_arrivals_rate_bounds_and_seed() -> None:
    arrivals = loadgen.poisson_arrivals(rate=200, duration=50, count=100_000, seed=7)
    gaps = np.diff(arrivals)
    assert arrivals == loadgen.poisson_arrivals(rate=200, duration=50, count=100_000, seed=7)
    assert len(arrivals) == pytest.approx(10_000, rel=0.05)
    assert gaps.mean() == pytest.approx(1 / 200, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: CV 1
    assert max(arrivals) < 50
    assert len(loadgen.poisson_arrivals(rate=200, duration=50, count=10, seed=7)) == 10


def test_percentile_matches_numpy() -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_spread_ratio_takes_the_worst_and_best_pairings() -> None:
    ratio = Spread(90, 80, 100).over(Spread(100, 95, 110))
    assert ratio == Spread(0.9, 80 / 110, 100 / 95)
    assert Spread.of([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0)


def test_window_rates_and_padding() -> None:
    rates = window_rates([0.5, 1.5, 1.6, 2.5, 9.0], [1, 1, 1, 2, 1], start=0, end=3, windows=3)
    assert rates == [1.0, 2.0, 2.0]
    assert padding_ratio(real=85, padding=15) == pytest.approx(0.15)


def test_prometheus_counters_delta() -> None:
    before = parse_prometheus('# HELP x\nkembed_tokens_total{kind="real"} 10\nkembed_tokens_total{kind="padding"} 2\n')
    after = parse_prometheus('kembed_tokens_total{kind="real"} 110\nkembed_tokens_total{kind="padding"} 12.0\n')
    assert metric_delta(before, after, "kembed_tokens_total", kind="real") == 100
    assert metric_delta(before, after, "kembed_tokens_total") == 110
    assert deltas_by_label(before, after, "kembed_tokens_total", "kind") == {"padding": 10, "real": 100}


def test_worker_figures_from_the_server_counters() -> None:
    def counters(compute_s: float, rows: float, batches: float, real: float, padding: float) -> str:
        return (
            f"kembed_inference_seconds_sum {compute_s}\nkembed_batch_size_sum {rows}\n"
            f'kembed_batch_size_count {batches}\nkembed_tokens_total{{kind="real"}} {real}\n'
            f'kembed_tokens_total{{kind="padding"}} {padding}\n'
        )

    before = parse_prometheus(counters(1, 10, 2, 100, 0))
    after = parse_prometheus(counters(4, 70, 8, 9100, 1000))
    figures = worker_figures(before, after, wall_s=4.0)
    assert figures == {"busy_share": 0.75, "padded_tokens_per_compute_s": 10000 / 3, "rows_per_batch": 10.0}


def test_sorted_packing_pads_less_and_respects_limits() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 256, size=500).tolist()
    order = list(range(len(lengths)))

    def padded(groups: list[list[int]]) -> int:
        return sum(len(g) * max(lengths[i] for i in g) for g in groups)

    arrival = batches.pack(order, lengths, max_rows=64, max_tokens=8192)
    by_length = batches.pack(sorted(order, key=lengths.__getitem__), lengths, max_rows=64, max_tokens=8192)
    for groups in (arrival, by_length):
        assert sorted(i for g in groups for i in g) == order
        assert all(len(g) <= 64 and len(g) * max(lengths[i] for i in g) <= 8192 for g in groups)
    assert padded(by_length) < padded(arrival)


def test_ceiling_rates_overall_and_pass_range() -> None:
    # Two passes over four batches of 10 texts: 6 s, then 4 s.
    spread = batches.rates([[1.0, 2.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]], [10, 10, 10, 10])
    assert spread == Spread(80 / 10, 40 / 6, 10.0)


def test_interleave_spreads_each_batching_over_the_pass() -> None:
    batch = batches.PaddedBatch(torch.zeros(1, 1), torch.ones(1, 1), 1, 1)
    order = ceiling.interleave({"a": [batch] * 2, "b": [batch] * 4})
    assert order == [("b", 0), ("a", 0), ("b", 1), ("b", 2), ("a", 1), ("b", 3)]


def test_bucket_packing_keeps_each_batch_in_one_bucket() -> None:
    shapes = BatchShapes.build(max_batch_size=64, max_tokens=8192, fixed=False)
    buckets = [16, 32, 64, 128, 256]
    lengths = np.random.default_rng(1).integers(1, 257, size=700).tolist()
    groups = batches.pack_buckets(lengths, buckets, shapes)
    assert sorted(i for g in groups for i in g) == list(range(700))
    for group in groups:
        bucket = batches.bucket_of(max(lengths[i] for i in group), buckets)
        assert {batches.bucket_of(lengths[i], buckets) for i in group} == {bucket}
        assert len(group) <= shapes.max_rows(bucket)


def _serve_stub(calls: list[int]) -> grpc.GenericRpcHandler:
    """Embed answers OK, except every third call, rejected with a pushback trailer."""

    async def embed(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls.append(len(request))
        if len(calls) % 3 == 0:
            context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, "5"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        return b""

    handler = grpc.unary_unary_rpc_method_handler(embed)  # no serializers: bytes both ways
    return grpc.method_handlers_generic_handler("kembed.v1.Embedder", {"Embed": handler})


@pytest.fixture
async def stub_target() -> AsyncIterator[tuple[str, list[int]]]:
    calls: list[int] = []
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_serve_stub(calls),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", calls
    finally:
        await server.stop(None)


async def test_open_loop_sends_every_arrival_and_sorts_codes(stub_target: tuple[str, list[int]]) -> None:
    target, calls = stub_target
    outcomes = await loadgen.open_loop(target, [b"a", b"bb"], rate=200, duration=0.5, count=50, seed=1, deadline=5)
    assert len(outcomes) == len(calls) == 50  # count bound hit before the time bound
    assert [o.scheduled for o in outcomes] == loadgen.poisson_arrivals(200, 0.5, 50, 1)
    assert {o.code for o in outcomes} == {loadgen.OK, "RESOURCE_EXHAUSTED"}
    assert all(o.done >= o.sent >= 0 for o in outcomes)


async def test_closed_loop_is_bounded_in_count(stub_target: tuple[str, list[int]]) -> None:
    target, calls = stub_target
    outcomes = await loadgen.closed_loop(target, [b"a"], concurrency=4, duration=5, count=30, deadline=5)
    assert len(outcomes) == len(calls) == 30
    assert sorted(o.item for o in outcomes) == list(range(30))


def test_process_readings_from_proc() -> None:
    me = Server(pid=os.getpid(), grpc_target="", http_url="")
    assert me.cpu_seconds() > 0
    assert me.peak_rss_mib() > 10


def _serve_result(batching: str, rate: float, p95: float) -> dict:
    phase = {"emb_per_s": Spread(rate, rate * 0.9, rate * 1.1).to_dict(), "padding_ratio": 0.1}
    overload = {**phase, "offered_x": 4.0, "latency_ms": {"p95": p95}}
    return {"batching": batching, "max_drain_ms": 2000.0, "saturation": phase, "open_loop": [overload]}


def test_headline_ratios_and_readme_splice() -> None:
    ceiling_result = {
        "sorted": {"emb_per_s": Spread(50, 48, 52).to_dict()},
        "naive": {"emb_per_s": Spread(25, 24, 26).to_dict()},
    }
    rows = headline.ratios(ceiling_result, _serve_result("token_bucket", 46, 1500), _serve_result("naive", 23, 9000))
    by_name = {r.name.split(" (")[0]: r for r in rows}
    assert by_name["Server at saturation / sorted ceiling"].value.median == pytest.approx(0.92)
    assert by_name["Server at saturation / sorted ceiling"].met() is True
    assert by_name["Accepted p95 at 4x / drain budget"].value.median == pytest.approx(0.75)
    assert by_name["Token bucket / naive server, at saturation"].value.median == pytest.approx(2.0)
    assert "| yes |" in ratio_table(rows)
    compiled_only = {"bucketed": ceiling_result["sorted"]}  # CUDA graphs: only the server's shapes
    first = headline.ratios(compiled_only, _serve_result("token_bucket", 46, 1500), None)[0]
    assert first.name.startswith("Server at saturation / bucketed ceiling")
    begin, end = plot.RESULTS_MARKERS
    readme = f"intro\n{begin}\nold\n{end}\nend\n"
    assert splice(readme, "new", plot.RESULTS_MARKERS) == f"intro\n{begin}\nnew\n{end}\nend\n"
    assert splice(readme, "new", plot.HEADLINE_MARKERS) == readme


def test_spread_median_is_the_middle() -> None:
    assert statistics.median([1.0, 2.0, 10.0]) == Spread.of([10.0, 1.0, 2.0]).median
