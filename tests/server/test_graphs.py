"""CPU-testable parts of the graph guard: limits that cover the plan, a loud limit hit, sealing, whole
graphs only, and counting what warmup compiled (an eager warmup cannot pass for a compiled one)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator

import pytest
import torch

from kembed.config.values import Graphs
from kembed.engine import graphs
from kembed.engine.graphs import (
    CompileCount,
    NothingCompiledError,
    ShapeGuard,
    UnplannedShapeError,
    compile_forward,
    configure_dynamo,
    recompile_limit,
)
from kembed.engine.model import EmbeddingModel
from kembed.engine.warmup import warmup_batch


@pytest.fixture
def dynamo() -> Iterator[None]:
    """Dynamo's limits and stance as they were, and no compiled code, after the test."""
    config = torch._dynamo.config
    saved = {
        "recompile_limit": config.recompile_limit,
        "accumulated_recompile_limit": config.accumulated_recompile_limit,
        "fail_on_recompile_limit_hit": config.fail_on_recompile_limit_hit,
    }
    with config.patch(saved):
        yield
    torch.compiler.set_stance("default")
    # torch 2.13: resetting a reduce-overhead backend imports this module, whose import registers a
    # backend in the dict that reset() is iterating ("dictionary changed size during iteration").
    importlib.import_module("torch._inductor.cudagraph_trees")
    torch.compiler.reset()


def _compiled_sum() -> object:
    # backend="eager": dynamo's guards and cache entries without inductor's C++ compiler.
    return torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)


def test_the_limit_covers_every_planned_shape_and_is_never_lowered(dynamo: None) -> None:
    applied = configure_dynamo(40)
    assert applied["recompile_limit"] == recompile_limit(40) >= 40
    assert applied["accumulated_recompile_limit"] >= applied["recompile_limit"]
    assert applied["fail_on_recompile_limit_hit"] is True
    torch._dynamo.config.recompile_limit = 500
    assert configure_dynamo(40)["recompile_limit"] == 500


def test_every_planned_shape_compiles_and_one_more_than_the_limit_is_an_error(dynamo: None) -> None:
    planned = 3
    configure_dynamo(planned)
    double = _compiled_sum()
    for length in range(1, recompile_limit(planned) + 1):  # dynamic=False: one cache entry per length
        double(torch.ones(length))  # type: ignore[operator]
    with pytest.raises(Exception, match=r"recompile_limit|cache_size_limit"):  # not a silent eager run
        double(torch.ones(recompile_limit(planned) + 1))  # type: ignore[operator]


def test_after_warmup_an_unplanned_shape_is_refused_and_a_recompile_raises(dynamo: None) -> None:
    prepared: list[tuple[int, ...]] = []
    double = _compiled_sum()

    def prepare(ids: torch.Tensor, mask: torch.Tensor) -> object:
        prepared.append(tuple(ids.shape))
        return lambda ids, mask: double(ids)  # type: ignore[operator]

    guard = ShapeGuard(prepare)  # type: ignore[arg-type]
    for shape in [(1, 16), (2, 16), (1, 16)]:
        guard(torch.ones(shape), torch.ones(shape))
    assert prepared == [(1, 16), (2, 16)]  # once per shape
    assert guard.shapes == {(1, 16), (2, 16)}
    assert guard.seal() == "fail_on_recompile"
    with pytest.raises(UnplannedShapeError, match="4x16 is not one of the 2 warmed-up shapes"):
        guard(torch.ones(4, 16), torch.ones(4, 16))
    assert prepared == [(1, 16), (2, 16)]
    guard(torch.ones(2, 16), torch.ones(2, 16))  # planned shapes still run
    with pytest.raises(Exception, match=r"fail_on_recompile|recompil"):
        double(torch.ones(3))  # type: ignore[operator]


def test_capture_without_cuda_compiles_per_shape_and_says_so(
    dynamo: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools: list[str] = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pools.append("cuda"))  # must not be reached
    with caplog.at_level(logging.WARNING, logger=graphs.__name__):
        guard = graphs.compile_graphs(lambda ids, mask: ids.float(), Graphs.CAPTURE, 4, torch.device("cpu"))
    assert not guard.shapes and not guard.sealed
    assert pools == []
    assert any("graphs=capture needs CUDA" in r.getMessage() for r in caplog.records)


def _masked_sum(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (ids.float() * mask).sum(dim=1)


def _checks_for_padding(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if bool(mask.all()):  # a host sync and a data-dependent branch, as some attention-mask code has
        return ids.float().sum(dim=1)
    return _masked_sum(ids, mask)


@pytest.mark.parametrize("mode", list(Graphs))
def test_a_graph_break_fails_the_compile_instead_of_running_eager_between_graphs(dynamo: None, mode: Graphs) -> None:
    ids, mask = warmup_batch(2, 8, 100, 0, torch.Generator().manual_seed(0))
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match=r"(?i)data-dependent"):
        compile_forward(_checks_for_padding, mode)(ids, mask)


def test_the_models_forward_is_one_graph_with_padding(stock_model: EmbeddingModel) -> None:
    """Dynamo's graph breaks do not depend on the device: this is what capture mode compiles on CUDA."""
    ids, mask = warmup_batch(4, 32, stock_model.info.vocab_size, 0, torch.Generator().manual_seed(0))
    assert 0 < int(mask.sum()) < mask.numel()  # padded
    with torch.inference_mode():
        explained = torch._dynamo.explain(stock_model._pooled)(ids, mask)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.process
def test_a_compiled_warmup_counts_what_each_shape_compiled(dynamo: None) -> None:
    """Inductor on CPU (static mode, a C++ compile per shape): one whole graph and its kernels per shape."""
    guard = graphs.compile_graphs(_masked_sum, Graphs.STATIC, 2, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for rows in (2, 1):
        ids, mask = warmup_batch(rows, 8, 100, 0, generator)
        torch.testing.assert_close(guard(ids, mask), _masked_sum(ids, mask))
    assert set(guard.compiles) == {(2, 8), (1, 8)}
    for shape, count in guard.compiles.items():
        assert count.graphs == 1 and count.kernels >= 1 and count.graph_breaks == 0, (shape, count)
    before = CompileCount.now()
    guard(*warmup_batch(2, 8, 100, 0, generator))  # a planned shape again: nothing compiles
    assert CompileCount.now() == before
    assert guard.seal() == "fail_on_recompile"


def test_a_compiled_warmup_that_ran_eager_refuses_to_seal(dynamo: None) -> None:
    torch.compiler.set_stance("force_eager")  # one way torch.compile silently runs the plain function
    guard = graphs.compile_graphs(_masked_sum, Graphs.STATIC, 1, torch.device("cpu"))
    guard(*warmup_batch(2, 8, 100, 0, torch.Generator().manual_seed(0)))
    assert guard.compiles[(2, 8)] == CompileCount()
    with pytest.raises(NothingCompiledError, match="compiled no graph"):
        guard.seal()
    assert not guard.sealed
