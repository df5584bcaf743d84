"""The arithmetic of the reports: percentiles, spreads, ratios, rates and Prometheus text.

Pure functions over plain numbers, so the smoke tests can pin them down.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kembed.contract import Metric


@dataclass(frozen=True)
class Spread:
    """A figure measured several times in one run: its central value and its range.

    The central value is the samples' median, or the overall rate where one exists (the ceiling:
    all texts over all time); the range is always the samples'.
    """

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            return cls(math.nan, math.nan, math.nan)
        return cls(percentile(samples, 50), min(samples), max(samples))

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> Spread:
        return cls(d["median"], d["lo"], d["hi"])

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def over(self, other: Spread) -> Spread:
        """self / other: the ratio of medians, bounded by the worst and best pairing of the ranges."""
        return Spread(_div(self.median, other.median), _div(self.lo, other.hi), _div(self.hi, other.lo))


def _div(a: float, b: float) -> float:
    """a / b; a zero denominator (nothing delivered in a window) gives inf, or NaN for 0 / 0."""
    if b:
        return a / b
    return math.inf if a else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max in milliseconds."""
    ms = [s * 1000 for s in seconds]
    summary = {f"p{q}": percentile(ms, q) for q in (50, 95, 99)}
    summary["max"] = max(ms) if ms else math.nan
    return summary


def window_rates(
    times: Sequence[float], weights: Sequence[float], start: float, end: float, windows: int
) -> list[float]:
    """Sum of ``weights`` whose time falls in each of ``windows`` equal slices of [start, end), per second."""
    width = (end - start) / windows
    sums = [0.0] * windows
    for t, w in zip(times, weights, strict=True):
        if start <= t < end:
            sums[min(int((t - start) / width), windows - 1)] += w
    return [s / width for s in sums]


def padding_ratio(real: float, padding: float) -> float:
    """Share of computed tokens that were padding."""
    total = real + padding
    return padding / total if total else math.nan


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_prometheus(text: str) -> Samples:
    """Prometheus text exposition -> {(name, labels): value}; comments skipped."""
    samples: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            name, labels, value = match.groups()
            samples[name, frozenset(_LABEL.findall(labels or ""))] = float(value)
    return samples


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def metric_delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def server_tokens(before: Samples, after: Samples) -> tuple[float, float]:
    """Real and padding tokens the server computed between two scrapes."""
    name = Metric.TOKENS + "_total"
    return metric_delta(before, after, name, kind="real"), metric_delta(before, after, name, kind="padding")


def worker_figures(before: Samples, after: Samples, wall_s: float) -> dict[str, float]:
    """From the server's own counters over a phase: the share of wall time the worker computed,
    padded tokens per compute-second (drops when something else takes the cores), rows per batch."""
    compute_s = metric_delta(before, after, Metric.INFERENCE_SECONDS + "_sum")
    batches = metric_delta(before, after, Metric.BATCH_SIZE + "_count")
    tokens = metric_delta(before, after, Metric.TOKENS + "_total")
    return {
        "busy_share": _div(compute_s, wall_s),
        "padded_tokens_per_compute_s": _div(tokens, compute_s),
        "rows_per_batch": _div(metric_delta(before, after, Metric.BATCH_SIZE + "_sum"), batches),
    }


def deltas_by_label(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    """Change of each ``label`` value's sample of ``name``, e.g. rejections per reason."""
    values = {dict(ls)[label] for n, ls in after if n == name and label in dict(ls)}
    return {v: metric_delta(before, after, name, **{label: v}) for v in sorted(values)}


@dataclass(frozen=True)
class Ratio:
    name: str
    value: Spread
    target: str  # e.g. ">= 0.90"; empty when the figure is informative only

    def met(self) -> bool | None:
        if not self.target:
            return None
        op, bound = self.target.split()
        return self.value.median >= float(bound) if op == ">=" else self.value.median <= float(bound)

    def digits(self) -> int:
        """Decimals shown: 2, or two more than a finer target has (a cosine's 0.999 shows 0.99993)."""
        decimals = len(self.target.partition(".")[2])
        return decimals + 2 if decimals >= 3 else 2


def spread_text(s: Spread, digits: int = 2) -> str:
    if math.isnan(s.median):
        return "—"
    if math.isclose(s.lo, s.hi):
        return f"{s.median:.{digits}f}"
    return f"{s.median:.{digits}f} ({s.lo:.{digits}f}–{s.hi:.{digits}f})"


def ratio_table(rows: list[Ratio]) -> str:
    lines = ["| Figure | Measured (range) | Target | Met |", "| --- | --- | --- | --- |"]
    for r in rows:
        met = {True: "yes", False: "**no**", None: ""}[r.met()]
        lines.append(f"| {r.name} | {spread_text(r.value, r.digits())} | {r.target} | {met} |")
    return "\n".join(lines)


def splice(readme: str, block: str, markers: tuple[str, str]) -> str:
    """``readme`` with the text between the markers replaced by ``block`` (unchanged without them)."""
    begin, end = markers
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    return pattern.sub(lambda _: f"{begin}\n{block}\n{end}", readme)
