"""The eager batcher's policy under a simulated clock (bench.compute.packing): the engine's own batcher,
the workload's lengths, the CPU batch curve's cost model; deterministic, so its figures are facts
about the policy, not about the machine."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench.compute import ceiling, packing
from bench.tools import workload
from kembed.engine.batcher import BatchPolicy
from kembed.policy.shapes import BatchShapes, clip_buckets

SHAPES = BatchShapes.build(64, 2048, fixed=False)
COST = packing.CostModel(tokens_per_s=12_200, overhead_tokens=74)


def run(policy: BatchPolicy, texts: int) -> dict[str, float]:
    lengths = [min(n, packing.MAX_TOKENS) for n in workload.load().tokens]
    opts = argparse.Namespace(callers=32, texts=texts, turnaround_ms=2.0, batches=300)
    return packing.simulate(policy, clip_buckets(packing.DEFAULT_BUCKETS, 256), lengths, COST, opts)


@pytest.mark.process
@pytest.mark.usefixtures("workload_corpus")
@pytest.mark.parametrize("texts", [1, 16])
def test_packed_batches_pad_less_and_serve_more_than_batches_confined_to_a_bucket(texts: int) -> None:
    packed = run(BatchPolicy(SHAPES, max_wait=0.02, packed=True, overhead_tokens=80), texts)
    bucket = run(BatchPolicy(SHAPES, max_wait=0.02), texts)
    assert packed["padding_ratio"] < bucket["padding_ratio"] and packed["emb_per_s"] > bucket["emb_per_s"]


@pytest.mark.process
@pytest.mark.usefixtures("workload_corpus")
def test_simulated_runs_are_deterministic_and_the_ceiling_is_above_them() -> None:
    policy = BatchPolicy(SHAPES, max_wait=0.02, packed=True, overhead_tokens=80)
    first, again = run(policy, 1), run(policy, 1)
    assert first == again
    lengths = [min(n, packing.MAX_TOKENS) for n in workload.load().tokens]
    assert first["emb_per_s"] < packing.sorted_ceiling(lengths, SHAPES, COST)


def test_the_batch_curve_reports_each_dtype_and_where_it_turns_efficient() -> None:
    """Forwards that cost a fixed overhead plus their tokens, on a fake clock."""
    now = [0.0]

    def forward(overhead_s: float) -> ceiling.inprocess.Forward:
        def run(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            now[0] += overhead_s + ids.numel() * 1e-5
            return torch.zeros(ids.shape[0], 4)

        return run

    forwards = {"slow": forward(0.0008), "fast": forward(0.0)}
    curve = ceiling.batch_curve(forwards, (64, 256, 1024), passes=2, clock=lambda: now[0])
    assert [p["tokens"] for p in curve["slow"]["points"]] == [64, 256, 1024]
    assert [p["tokens_per_s"] for p in curve["fast"]["points"]] == [100_000] * 3
    assert (curve["fast"]["budget_90"], curve["slow"]["budget_90"]) == (64, 1024)
    assert (curve["fast"]["overhead_tokens"], curve["slow"]["overhead_tokens"]) == (0.0, pytest.approx(80, abs=0.1))
