"""kembed benchmarks: the workload, the in-process ceiling, server load runs, plots.

Every entry point is one command (``python -m bench.<room>.<name>``, ``python -m bench.fleet``),
bounded in count and time, and writes JSON to ``bench/results/``. See ``bench/README.md``.
"""

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
