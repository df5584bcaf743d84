"""The worker's engine: a failing item fails only its own request; batches match lone runs; a
worker thread that dies is fatal."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from kembed.config import Settings, Warmup
from kembed.engine import compile_cache
from kembed.engine.graphs import ShapeGuard, UnplannedShapeError
from kembed.engine.model import EmbeddingModel
from kembed.engine.work import Chunk, Job
from kembed.engine.worker import Engine, Outcome, Worker, make_plan, start_engine, warmup_batch, warmup_order
from tests.server.queueing import chunks

POISON = 4242  # a real vocabulary id that the injected fault treats as fatal to its batch


@pytest.fixture(scope="module")
def engine() -> Engine:
    settings = Settings.from_env({}, buckets="16,32", max_batch_size=8, max_tokens_per_batch=256)
    model = EmbeddingModel.load(settings)
    return Engine(model, dataclasses.replace(make_plan(settings, model), warmup=Warmup.LARGEST))


def chunks_for(engine: Engine, texts: list[str], poison: bool = False) -> list[Chunk]:
    seqs = engine.model.tokenizer.from_texts(texts, truncate=False)
    if poison:
        seqs.ids[1] = POISON
    job = Job(link=1, tag=1, count=seqs.count, deadline=float("inf"))
    return [chunk for _, chunk in chunks(job, seqs, [16, 32], 0.0)]


def test_a_failing_item_fails_alone(engine: Engine, monkeypatch: pytest.MonkeyPatch):
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


def test_warmup_times_the_largest_batch_of_each_bucket(engine: Engine):
    assert engine.plan.warmup_shapes() == [(32, 8), (16, 8), (256, 1)]  # the model's limit is the last bucket
    engine.warm_up(lambda: None)
    assert engine.warmup_tokens == 16 * 8 + 32 * 8 + 256
    assert engine.warmup_seconds > 0


def test_after_warmup_an_unplanned_shape_fails_its_batch_whole(engine: Engine, monkeypatch: pytest.MonkeyPatch):
    real_forward = engine.model.forward
    prepared: list[tuple[int, ...]] = []

    def prepare(ids: torch.Tensor, mask: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        prepared.append(tuple(ids.shape))
        return real_forward

    guard = ShapeGuard(prepare)
    monkeypatch.setattr(engine.model, "forward", guard)
    sealed = Engine(engine.model, engine.plan, graphs=guard)
    try:
        sealed.warm_up(lambda: None)
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


def test_warmup_runs_every_shape_largest_first_with_padding(engine: Engine, monkeypatch: pytest.MonkeyPatch):
    real_forward = engine.model.forward
    seen: list[tuple[tuple[int, ...], int, int]] = []

    def recording(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(ids.shape), int(mask.sum()), mask.numel()))
        return real_forward(ids, mask)

    monkeypatch.setattr(engine.model, "forward", recording)
    Engine(engine.model, dataclasses.replace(engine.plan, warmup=Warmup.GRID)).warm_up(lambda: None)
    shapes = list(dict.fromkeys(shape for shape, _, _ in seen))
    assert shapes == [(rows, seq_len) for seq_len, rows in warmup_order(engine.plan.shapes.grid([16, 32, 256]))]
    assert all(real < total for _, real, total in seen)  # no warmup batch is all real tokens


@pytest.mark.slow
def test_a_compiled_start_compiles_each_shape_whole_and_a_restart_loads_it_from_the_cache(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """On CPU, graphs=capture compiles per shape (static), through inductor and the compile cache."""
    for name in (compile_cache.INDUCTOR_ENV, compile_cache.TRITON_ENV):
        monkeypatch.setenv(name, "")  # restored after the test: the start points them at tmp_path
    settings = Settings.from_env(
        {}, compile="on", max_input_tokens=16, max_batch_size=2, compile_cache_dir=str(tmp_path)
    )
    try:
        for start in ("cold", "warm"):
            hits = counters["inductor"]["fxgraph_cache_hit"]  # torch.compiler.reset() replaces the Counter
            started = start_engine(settings, EmbeddingModel.load, lambda: None)
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
    settings = Settings.from_env({}, buckets="16", max_batch_size=2, max_tokens_per_batch=32)
    worker = Worker(settings, loop, fatal.set_result, lambda _: stock_model)
    worker.start()
    assert isinstance(await worker.warm, Engine)

    def broken() -> None:
        raise RuntimeError("a bug in the worker's own loop")

    monkeypatch.setattr(worker, "_beat", broken)  # the idle loop beats every second, outside compute
    worker.serve(lambda *_: None)
    error = await asyncio.wait_for(fatal, 120)
    assert str(error) == "a bug in the worker's own loop"
