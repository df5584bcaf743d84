"""The benchmarks' shared fixture: the workload's corpus."""

from __future__ import annotations

import pytest

from bench.tools import workload


@pytest.fixture(scope="session")
def workload_corpus() -> tuple[str, ...]:
    """The workload's candidate texts (``bench.tools.workload.corpus``), collected in a fresh
    interpreter: a process, started once a session (the function caches it). A test that draws the
    workload asks for this fixture, so that process is its fixture's whichever test came first
    (tests/lanes.py: a test marked ``process`` starts one, itself or by a fixture)."""
    return workload.corpus()
