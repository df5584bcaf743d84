"""The worker's model runner: a failing item fails only its own request; batches match lone runs; a
worker thread that dies is fatal; the dtype auto serves, from injected capabilities and timings."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from kembed.config.settings import Settings
from kembed.config.values import Dtype, Warmup
from kembed.engine import compile_cache, cpu, precision
from kembed.engine.graphs import ShapeGuard, UnplannedShapeError
from kembed.engine.model import EmbeddingModel
from kembed.engine.runner import ModelRunner, make_plan, warmup_order
from kembed.engine.units import Batch, Chunk, Computed, Job, Outcome
from kembed.engine.warmup import (
    WARMUP_REPEATS_EAGER,
    batch_overhead,
    comparison_shapes,
    min_cosine,
    probe_vectors,
    start_runner,
    warm_up,
    warmup_batch,
)
from kembed.engine.worker import Worker
from tests.server.queueing import chunks

POISON = 4242  # a real vocabulary id that the injected fault treats as fatal to its batch


@pytest.fixture(scope="module")
def engine() -> ModelRunner:
    settings = Settings.from_env({}, buckets="16,32", max_batch_size=8, max_tokens_per_batch=256)
    model = EmbeddingModel.load(settings)
    return ModelRunner(model, dataclasses.replace(make_plan(settings, model), warmup=Warmup.LARGEST))


def chunks_for(engine: ModelRunner, texts: list[str], poison: bool = False) -> list[Chunk]:
    seqs = engine.model.tokenizer.from_texts(texts, truncate=False)
    if poison:
        seqs.ids[1] = POISON
    job = Job(link_id=1, tag=1, count=seqs.count, deadline=float("inf"))
    return [chunk for _, chunk in chunks(job, seqs, [16, 32], 0.0)]


def test_a_failing_item_fails_alone(engine: ModelRunner, monkeypatch: pytest.MonkeyPatch):
    real_forward = engine.model.forward

    def faulty(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if bool((ids == POISON).any()):
            raise RuntimeError("injected fault")
        return real_forward(ids, mask)

    monkeypatch.setattr(engine.model, "forward", faulty)
    before = chunks_for(engine, ["first request", "its second item"])
    bad = chunks_for(engine, ["the bad one"], poison=True)
    after = chunks_for(engine, ["third request", "x", "y"])
    outcomes = engine.compute(before + bad + after, seq_len=16)

    failed = [o for o in outcomes if o.error is not None]
    assert [c.job for o in failed for c in o.chunks] == [bad[0].job]
    monkeypatch.setattr(engine.model, "forward", real_forward)
    for lone in (before, after):
        alone = engine.compute(lone, seq_len=16)[0].embeddings
        assert alone is not None
        np.testing.assert_allclose(rows_of(lone[0].job, outcomes), alone, atol=1e-5)


def rows_of(job: Job, outcomes: list[Outcome]) -> np.ndarray:
    """A job's embeddings, gathered from the outcomes its chunks landed in."""
    rows = []
    for outcome in outcomes:
        offset = 0
        for chunk in outcome.chunks:
            if chunk.job is job and outcome.embeddings is not None:
                rows.append(outcome.embeddings[offset : offset + chunk.items])
            offset += chunk.items
    return np.concatenate(rows)


def test_warmup_times_the_largest_batch_of_each_bucket(engine: ModelRunner):
    assert engine.plan.warmup_shapes() == [(32, 8), (16, 8), (256, 1)]  # the model's limit is the last bucket
    warm_up(engine, lambda: None)
    assert engine.warmup_tokens == 16 * 8 + 32 * 8 + 256
    assert engine.warmup_seconds > 0


def test_after_warmup_an_unplanned_shape_fails_its_batch_whole(engine: ModelRunner, monkeypatch: pytest.MonkeyPatch):
    real_forward = engine.model.forward
    prepared: list[tuple[int, ...]] = []

    def prepare(ids: torch.Tensor, mask: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        prepared.append(tuple(ids.shape))
        return real_forward

    guard = ShapeGuard(prepare)
    monkeypatch.setattr(engine.model, "forward", guard)
    sealed = ModelRunner(engine.model, dataclasses.replace(engine.plan, packed=False), graphs=guard)  # fixed shapes
    try:
        warm_up(sealed, lambda: None)
    finally:
        torch.compiler.set_stance("default")  # sealing forbids recompiles process-wide
    assert guard.sealed
    assert prepared == [(rows, seq_len) for seq_len, rows in sealed.plan.warmup_shapes()]
    outcomes = sealed.compute(chunks_for(sealed, ["one", "two", "three"]), seq_len=16)  # 3x16: not warmed
    assert len(outcomes) == 1  # not halved into per-item failures: no shape of it would be planned either
    assert isinstance(outcomes[0].error, UnplannedShapeError)
    assert len(prepared) == len(sealed.plan.warmup_shapes())


def test_warmup_goes_largest_first_and_one_row_shapes_last():
    """The dynamic compile takes its size hints from its first call, and one-row batches get a graph
    of their own: the general graph must first see the largest batch, the one-row graph the longest."""
    shapes = [(16, 1), (16, 2), (16, 8), (32, 1), (32, 8), (256, 1)]
    assert warmup_order(shapes) == [(32, 8), (16, 8), (16, 2), (256, 1), (32, 1), (16, 1)]


@pytest.mark.parametrize(("rows", "seq_len"), [(1, 16), (2, 16), (8, 256), (1, 1)])
def test_warmup_batches_are_right_padded_like_served_ones(rows: int, seq_len: int):
    ids, mask = warmup_batch(rows, seq_len, 30522, 0, torch.Generator().manual_seed(rows))
    lengths = mask.sum(dim=1)
    assert ids.shape == mask.shape == (rows, seq_len) and ids.dtype == mask.dtype == torch.int32
    assert torch.equal(mask, (torch.arange(seq_len)[None, :] < lengths[:, None]).to(torch.int32))
    assert int(lengths.min()) >= 1
    if rows > 1:
        assert int(lengths[0]) == seq_len  # the batch's length is its longest item's bucket
    if seq_len > 1:
        assert int(lengths.min()) < seq_len  # padding, even in a one-row batch
    assert not bool(ids[mask == 0].any())  # pad id where masked


def test_warmup_runs_every_shape_largest_first_with_padding(engine: ModelRunner, monkeypatch: pytest.MonkeyPatch):
    real_forward = engine.model.forward
    seen: list[tuple[tuple[int, ...], int, int]] = []

    def recording(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(ids.shape), int(mask.sum()), mask.numel()))
        return real_forward(ids, mask)

    monkeypatch.setattr(engine.model, "forward", recording)
    warm_up(ModelRunner(engine.model, dataclasses.replace(engine.plan, warmup=Warmup.GRID)), lambda: None)
    shapes = list(dict.fromkeys(shape for shape, _, _ in seen))
    assert shapes == [(rows, seq_len) for seq_len, rows in warmup_order(engine.plan.shapes.grid([16, 32, 256]))]
    assert all(real < total for _, real, total in seen)  # no warmup batch is all real tokens


@pytest.mark.process
def test_a_compiled_start_compiles_each_shape_whole_and_a_restart_loads_it_from_the_cache(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """On CPU, graphs=static compiles per shape, through inductor and the compile cache."""
    for name in (compile_cache.INDUCTOR_ENV, compile_cache.TRITON_ENV):
        monkeypatch.setenv(name, "")  # restored after the test: the start points them at tmp_path
    settings = Settings.from_env(
        {}, compile="on", graphs="static", max_input_tokens=16, max_batch_size=2, compile_cache_dir=str(tmp_path)
    )
    try:
        for start in ("cold", "warm"):
            hits = counters["inductor"]["fxgraph_cache_hit"]  # torch.compiler.reset() replaces the Counter
            started = start_runner(settings, EmbeddingModel.load, lambda: None)
            assert started.graphs is not None and started.graphs.sealed, start
            assert set(started.graphs.compiles) == {(2, 16), (1, 16)}, start
            for shape, count in started.graphs.compiles.items():
                assert count.graphs == 1 and count.kernels >= 1 and count.graph_breaks == 0, (start, shape, count)
            assert counters["inductor"]["fxgraph_cache_hit"] - hits == (0 if start == "cold" else 2), start
            torch.compiler.set_stance("default")
            torch.compiler.reset()
    finally:
        torch.compiler.set_stance("default")
    (folder,) = [entry for entry in tmp_path.iterdir() if (entry / compile_cache.MANIFEST).exists()]
    manifest = compile_cache.Manifest.read(folder)
    assert manifest is not None and manifest.shapes == ["1x16", "2x16"]


async def test_a_worker_thread_that_dies_outside_compute_is_fatal(
    stock_model: EmbeddingModel, monkeypatch: pytest.MonkeyPatch
):
    loop = asyncio.get_running_loop()
    fatal: asyncio.Future[BaseException] = loop.create_future()
    settings = Settings.from_env({}, buckets="16", max_batch_size=2, max_tokens_per_batch=32, compile="off")
    worker = Worker(settings, loop, fatal.set_result, lambda _: stock_model)
    worker.start()
    assert isinstance(await worker.warm, ModelRunner)

    def broken() -> None:
        raise RuntimeError("a bug in the worker's own loop")

    monkeypatch.setattr(worker, "_beat", broken)  # the idle loop beats every second, outside compute
    worker.serve(lambda *_: None)
    error = await asyncio.wait_for(fatal, 120)
    assert str(error) == "a bug in the worker's own loop"


async def test_lanes_compute_batches_side_by_side_each_on_its_share_of_the_threads(
    stock_model: EmbeddingModel, monkeypatch: pytest.MonkeyPatch
):
    loop = asyncio.get_running_loop()
    settings = Settings.from_env(
        {}, buckets="16", max_batch_size=2, max_tokens_per_batch=32, compute_lanes=2, compile="off"
    )
    worker = Worker(settings, loop, lambda error: None, lambda _: stock_model)
    worker.start()
    runner = await worker.warm
    assert runner.plan.lanes == 2
    seen: list[tuple[str, int]] = []
    forward = stock_model.forward

    def slow_forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        time.sleep(0.05)  # long enough that the other lane takes the next batch meanwhile
        return forward(ids, mask)

    monkeypatch.setattr(stock_model, "forward", slow_forward)
    texts = [f"lane test {i}" for i in range(8)]
    batches = [Batch(chunks_for(runner, texts[i : i + 2]), 16, 2) for i in range(0, 8, 2)]
    delivered: list[tuple[Batch, list[Outcome], Computed]] = []
    all_done = loop.create_future()

    def deliver(batch: Batch, outcomes: list[Outcome], computed: Computed) -> None:
        delivered.append((batch, outcomes, computed))
        if len(delivered) == len(batches):
            all_done.set_result(None)

    worker.serve(deliver)
    for batch in batches:
        worker.submit(batch)
    await asyncio.wait_for(all_done, 60)
    worker.stop()
    assert {computed.lane for _, _, computed in delivered} == {0, 1}
    assert {threads for _, threads in seen} == {cpu.lane_threads(settings.cpus(), 2)}
    spans = sorted((c.started, c.started + c.seconds) for _, _, c in delivered)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))  # side by side
    expected = runner.embed(stock_model.tokenizer.from_texts(texts, truncate=False))
    for batch, (outcome,), _ in delivered:
        first = 2 * next(i for i, sent in enumerate(batches) if sent is batch)
        assert outcome.embeddings is not None
        np.testing.assert_allclose(outcome.embeddings, expected[first : first + 2], atol=1e-5)


# --- the dtype (kembed.engine.precision) --------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "device", "units", "measures", "dtype", "why"),
    [
        (Dtype.AUTO, "cpu", ("avx512_bf16",), True, "float32", "auto: bf16 units (avx512_bf16), not measured"),
        (Dtype.AUTO, "cpu", (), False, "float32", "auto: no bf16 units"),
        (Dtype.AUTO, "cuda", (), False, "bfloat16", "auto: bf16 on CUDA"),
        (Dtype.FLOAT32, "cpu", ("amx_bf16",), False, "float32", "KEMBED_DTYPE=float32"),  # explicit wins
        (Dtype.BFLOAT16, "cpu", (), False, "bfloat16", "KEMBED_DTYPE=bfloat16"),
    ],
)
def test_what_is_measured_and_what_is_not(
    asked: Dtype, device: str, units: tuple[str, ...], measures: bool, dtype: str, why: str
) -> None:
    assert precision.measures(asked, device, units) is measures
    unmeasured = precision.unmeasured(asked, device, units)
    assert unmeasured.dtype == dtype and unmeasured.why.startswith(why)


@pytest.mark.parametrize(
    ("fp32_s", "bf16_s", "cosine", "dtype", "why"),
    [
        (1.9, 1.0, 0.99995, "bfloat16", "auto: bf16 1.90x fp32's speed, min cosine 0.99995"),
        (1.0, 1.0, 0.99995, "float32", "auto: bf16 1.00x fp32's speed, min cosine 0.99995, not 1.3x"),
        (1.2, 1.0, 0.99995, "float32", "auto: bf16 1.20x fp32's speed, min cosine 0.99995, not 1.3x"),  # noise
        (1.0, 2.5, 0.99995, "float32", "auto: bf16 0.40x fp32's speed"),  # bf16 emulated: 2.5x slower
        (2.0, 1.0, 0.9985, "float32", "auto: bf16 2.00x fp32's speed, min cosine 0.99850, under 0.999"),
    ],
)
def test_auto_serves_bf16_only_where_it_is_faster_and_accurate(
    fp32_s: float, bf16_s: float, cosine: float, dtype: str, why: str
) -> None:
    choice = precision.measured(fp32_s, bf16_s, cosine)
    assert choice.dtype == dtype and choice.why.startswith(why)


def test_a_batch_costs_its_tokens_plus_what_a_small_batch_shows_beyond_them() -> None:
    assert batch_overhead(0.010, 16, per_token=1e-4, max_tokens=2048) == pytest.approx(100 - 16)
    assert batch_overhead(0.001, 16, per_token=1e-4, max_tokens=2048) == 32  # faster than the rate: skewed
    assert batch_overhead(1.0, 16, per_token=1e-4, max_tokens=2048) == 128  # a burst of load: capped


class Loads:
    """EmbeddingModel.load, recording the dtype each load asked for."""

    def __init__(self) -> None:
        self.asked: list[Dtype] = []

    def __call__(self, settings: Settings) -> EmbeddingModel:
        self.asked.append(settings.dtype)
        return EmbeddingModel.load(settings)


SMALL = {"buckets": "16", "max_input_tokens": 32, "max_batch_size": 2, "max_tokens_per_batch": 32, "compile": "off"}


@pytest.mark.parametrize(
    ("asked", "units", "loads", "why"),
    [
        ("auto", ("avx512_bf16",), [Dtype.AUTO, Dtype.BFLOAT16], "auto: bf16 "),
        ("auto", (), [Dtype.AUTO], "auto: no bf16 units"),
        ("float32", ("amx_bf16",), [Dtype.FLOAT32], "KEMBED_DTYPE=float32"),
    ],
)
def test_the_start_measures_bf16_only_on_a_cpu_with_bf16_units_when_auto(
    asked: str, units: tuple[str, ...], loads: list[Dtype], why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision, "bf16_units", lambda: units)
    monkeypatch.setattr(cpu, "share_cores", lambda *_: None)  # niceness is never lowered again: not here
    loader = Loads()
    runner = start_runner(Settings.from_env({}, dtype=asked, **SMALL), loader, lambda: None)
    assert loader.asked == loads and runner.why.startswith(why)
    assert runner.precision.dtype in ("float32", "bfloat16") and runner.warmup_tokens == 2 * 16 + 32
    assert 32 / 64 <= runner.overhead_tokens <= 32 / 16


@pytest.mark.parametrize("kept", ["bfloat16", "float32"])
def test_auto_times_fp32_on_two_shapes_and_warms_the_dtype_it_keeps_on_every_one(
    kept: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision, "bf16_units", lambda: ("avx512_bf16",))
    monkeypatch.setattr(cpu, "share_cores", lambda *_: None)
    monkeypatch.setattr(precision, "measured", lambda *_: precision.Precision(kept, "auto: injected"))
    timed: dict[str, list[tuple[int, int]]] = {"float32": [], "bfloat16": []}
    order: list[str] = []  # the dtype of every timed call, in turn
    timed_for_real = ModelRunner.timed

    def recording(runner: ModelRunner, ids: torch.Tensor, mask: torch.Tensor, repeats: int, beat) -> float:
        timed[runner.precision.dtype].append((ids.shape[1], ids.shape[0]))
        order.append(runner.precision.dtype)
        return timed_for_real(runner, ids, mask, repeats, beat)

    monkeypatch.setattr(ModelRunner, "timed", recording)
    sizes = {"max_batch_size": 4, "max_tokens_per_batch": 64}
    settings = Settings.from_env({}, buckets="16,32,64", max_input_tokens=128, compile="off", **sizes)
    runner = start_runner(settings, EmbeddingModel.load, lambda: None)
    shapes = runner.plan.warmup_shapes()
    compared = comparison_shapes(runner.plan)
    assert runner.precision.dtype == kept and compared == [(128, 1), (16, 4)]
    other = "float32" if kept == "bfloat16" else "bfloat16"
    # Both dtypes' calls alternate one by one on the compared shapes, so load elsewhere meets both.
    compared_calls = len(compared) * WARMUP_REPEATS_EAGER * 2
    assert order[:compared_calls] == ["float32", "bfloat16"] * (compared_calls // 2)
    assert list(dict.fromkeys(timed[other])) == compared  # the dtype let go: timed on the two shapes only
    overhead = (16, 1)  # an eighth of the shortest bucket's 4 rows, at least one
    assert list(dict.fromkeys(timed[kept])) == [*compared, *(s for s in shapes if s not in compared), overhead]
    assert runner.warmup_tokens == sum(seq_len * rows for seq_len, rows in shapes)


def test_a_dtype_measured_once_is_kept_and_later_starts_serve_it_without_measuring(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two starts on one machine measured bf16 faster once and slower once: the second start of a
    service (same CPU, torch and model) serves what the first measured, and says so."""
    monkeypatch.setattr(precision, "bf16_units", lambda: ("avx512_bf16",))
    monkeypatch.setattr(cpu, "share_cores", lambda *_: None)
    settings = Settings.from_env({}, compile_cache_dir=str(tmp_path), **SMALL)
    monkeypatch.setattr(precision, "measured", lambda *_: precision.Precision("bfloat16", "auto: bf16 1.40x"))
    first = start_runner(settings, EmbeddingModel.load, lambda: None)
    assert (first.precision.dtype, first.why) == ("bfloat16", "auto: bf16 1.40x")

    def measuring_again(*_: object) -> precision.Precision:
        raise AssertionError("a kept verdict is read, not measured again")

    monkeypatch.setattr(precision, "measured", measuring_again)
    loader = Loads()
    later = start_runner(settings, loader, lambda: None)
    assert later.precision.dtype == "bfloat16" and loader.asked == [Dtype.AUTO, Dtype.BFLOAT16]
    assert later.why.startswith("as measured before (") and later.why.endswith("): auto: bf16 1.40x")
    explicit = start_runner(Settings.from_env({}, **{**SMALL, "dtype": "float32"}), loader, lambda: None)
    assert explicit.precision.dtype == "float32"  # an explicit dtype wins over the kept verdict


def test_a_loader_that_ignores_bf16_leaves_auto_on_fp32(
    stock_model: EmbeddingModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision, "bf16_units", lambda: ("avx512_bf16",))
    monkeypatch.setattr(cpu, "share_cores", lambda *_: None)
    runner = start_runner(Settings.from_env({}, **SMALL), lambda _: stock_model, lambda: None)
    assert (runner.precision.dtype, runner.why) == ("float32", "auto: bf16 asked, the loader gave torch.float32")


def test_bf16_passes_the_warmup_accuracy_check_on_this_machine(stock_model: EmbeddingModel) -> None:
    """Real text through fp32 and bf16 weights: what auto checks before it serves bf16."""
    plan = make_plan(Settings.from_env({}, **SMALL), stock_model)
    bf16 = EmbeddingModel.load(Settings.from_env({}, dtype="bfloat16"))
    cosine = min_cosine(probe_vectors(ModelRunner(stock_model, plan)), probe_vectors(ModelRunner(bf16, plan)))
    assert precision.MIN_COSINE <= cosine < 1.0  # close, and computed in another dtype
