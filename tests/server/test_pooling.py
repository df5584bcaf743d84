"""Pooling (kembed.engine.pooling) and the front end's post-processing, on hand-made tensors with known answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kembed.engine.pooling import POOLING_MODES, pool
from kembed.frontend.service import postprocess

CLS, SEP, PAD, QUERY = 101, 102, 0, 7


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three right-padded rows: 4 tokens with a control token at 1, 2 tokens, and all padding."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 6)
    ids = torch.tensor([[CLS, QUERY, 2000, SEP, PAD], [CLS, SEP, PAD, PAD, PAD], [PAD] * 5])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0] * 5])
    return hidden, ids, mask


def test_mean_keeps_special_tokens_and_skips_padding(batch) -> None:
    hidden, ids, mask = batch
    got = pool(hidden, ids, mask, "mean", None)
    torch.testing.assert_close(got[0], hidden[0, :4].mean(0))
    torch.testing.assert_close(got[1], hidden[1, :2].mean(0))


def test_mean_drops_excluded_ids_only(batch) -> None:
    hidden, ids, mask = batch
    got = pool(hidden, ids, mask, "mean", torch.tensor([QUERY, 9999]))
    torch.testing.assert_close(got[0], hidden[0, [0, 2, 3]].mean(0))
    torch.testing.assert_close(got[1], hidden[1, :2].mean(0))


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_empty_rows_are_finite(batch, mode: str) -> None:
    hidden, ids, mask = batch
    everything = torch.tensor([CLS, SEP, QUERY, 2000])  # row 0 keeps nothing under mean
    got = pool(hidden, ids, mask, mode, everything)
    assert torch.isfinite(got).all()
    if mode == "mean":
        assert not got[[0, 2]].any()


def test_cls_and_last(batch) -> None:
    hidden, ids, mask = batch
    torch.testing.assert_close(pool(hidden, ids, mask, "cls", None), hidden[:, 0])
    torch.testing.assert_close(pool(hidden, ids, mask, "last", None)[:2], hidden[[0, 1], [3, 1]])


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_low_precision_in_float32_out(batch, mode: str) -> None:
    hidden, ids, mask = batch
    got = pool(hidden.to(torch.bfloat16), ids, mask, mode, torch.tensor([QUERY]))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, pool(hidden, ids, mask, mode, torch.tensor([QUERY])), atol=2e-2, rtol=2e-2)


def test_unknown_mode_fails(batch) -> None:
    hidden, ids, mask = batch
    with pytest.raises(ValueError, match="max"):
        pool(hidden, ids, mask, "max", None)


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_traces_without_graph_breaks(batch, mode: str) -> None:
    hidden, ids, mask = batch
    excluded = torch.tensor([QUERY])
    compiled = torch.compile(pool, fullgraph=True, backend="eager", dynamic=False)
    torch.testing.assert_close(compiled(hidden, ids, mask, mode, excluded), pool(hidden, ids, mask, mode, excluded))


def test_matryoshka_truncates_then_renormalizes() -> None:
    rows = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    got = postprocess(rows, 2, normalize=True)
    np.testing.assert_allclose(got, [[0.6, 0.8], [0.0, 0.0]], rtol=1e-6)
    assert got.dtype == np.float32
    assert got.flags.c_contiguous


def test_full_normalize_and_raw() -> None:
    rows = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(postprocess(rows, 0, normalize=True)[0], rows[0] / 13.0, rtol=1e-6)
    raw = postprocess(rows, 2, normalize=False)
    np.testing.assert_array_equal(raw, rows[:, :2])
    assert raw.flags.c_contiguous
    assert np.isfinite(postprocess(rows, 0, normalize=True)).all()


def test_too_many_dimensions_fails() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        postprocess(np.zeros((1, 3), dtype=np.float32), 4, normalize=True)
