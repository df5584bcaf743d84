"""The headline ratios and tables, computed from the result JSONs (never typed by hand): one module
per question (``cpu``: the machine and the load runs; ``hostpath``; ``admission``), with the cells
they share in ``figures``. This package is their one face: ``bench.plot`` and the benchmarks that
judge themselves import it as ``headline``."""

from bench.headline.admission import (
    ABUSE_PHASES,
    abuse_ratios,
    abuse_table,
    corpus_ratios,
    corpus_table,
    fairness_ratios,
    fairness_table,
    priority_ratios,
    priority_table,
)
from bench.headline.cpu import (
    ceiling_table,
    cpu_ratios,
    curve_table,
    gpu_table,
    limits_table,
    phase_table,
    ratios,
    startup_ratios,
    startup_table,
    workload_text,
)
from bench.headline.efficiency import efficiency_ratios, gpu_projection
from bench.headline.hostpath import hostpath_ratios, hostpath_table, serve_ratios

__all__ = [
    "ABUSE_PHASES",
    "abuse_ratios",
    "abuse_table",
    "ceiling_table",
    "corpus_ratios",
    "corpus_table",
    "cpu_ratios",
    "curve_table",
    "efficiency_ratios",
    "fairness_ratios",
    "fairness_table",
    "gpu_projection",
    "gpu_table",
    "hostpath_ratios",
    "hostpath_table",
    "limits_table",
    "phase_table",
    "priority_ratios",
    "priority_table",
    "ratios",
    "serve_ratios",
    "startup_ratios",
    "startup_table",
    "workload_text",
]
