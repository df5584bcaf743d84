"""PNGs and the READMEs' result tables, from the JSON in ``bench/results/``.

``python -m bench.plot`` writes ``throughput.png``, ``latency.png``, ``padding.png`` and
``summary.md`` (with the host-path, priority and corpus-job tables where their JSONs are), replaces the
block between the ``bench:results`` markers of ``bench/README.md``, and the block between the
``bench:headline`` markers of the top-level README, where it has them (the headline ratios and
the throughput plot).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from bench import RESULTS_DIR, headline
from bench.tools.machine import read_result
from bench.tools.report import Ratio, ratio_table, splice

README = RESULTS_DIR.parent / "README.md"
TOP_README = RESULTS_DIR.parent.parent / "README.md"
RESULTS_MARKERS = ("<!-- bench:results:begin -->", "<!-- bench:results:end -->")
HEADLINE_MARKERS = ("<!-- bench:headline:begin -->", "<!-- bench:headline:end -->")
COLORS = {"token_bucket": "tab:blue", "naive": "tab:orange"}
CEILING_STYLES = {"sorted": "-", "bucketed": "-.", "naive": ":"}


def _offered(serve: dict[str, Any]) -> list[float]:
    return [p["offered_rps"] for p in serve["open_loop"]]


def _errorbar(ax: Any, xs: list[float], spreads: list[dict[str, float]], **style: Any) -> None:
    ys = [s["median"] for s in spreads]
    err = [
        [y - s["lo"] for y, s in zip(ys, spreads, strict=True)],
        [s["hi"] - y for y, s in zip(ys, spreads, strict=True)],
    ]
    ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, **style)


def throughput(ceiling: dict[str, Any], serves: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for serve in serves:
        color = COLORS[serve["batching"]]
        spreads = [p["emb_per_s"] for p in serve["open_loop"]]
        _errorbar(ax, _offered(serve), spreads, label=f"server, {serve['batching']}, open loop", color=color)
        saturated = serve["saturation"]["emb_per_s"]["median"]
        ax.axhline(saturated, color=color, linestyle="--", linewidth=0.8, label=f"{serve['batching']}, closed loop")
    for order, style in CEILING_STYLES.items():
        if order in ceiling:
            ax.axhline(ceiling[order]["emb_per_s"]["median"], color="gray", linestyle=style, label=f"ceiling, {order}")
    top = max(x for s in serves for x in _offered(s))
    ax.plot([0, top], [0, top], color="lightgray", linewidth=0.8, label="delivered = offered")
    ax.set(xlabel="offered load (requests/s, one text each)", ylabel="embeddings/s delivered", ylim=(0, None))
    ax.set_title("Throughput vs offered load")
    _save(fig, ax, path)


def latency(serves: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for serve in serves:
        for q, style in (("p50", ":"), ("p95", "-"), ("p99", "--")):
            ys = [p["latency_ms"][q] for p in serve["open_loop"]]
            ax.plot(_offered(serve), ys, style, marker="o", color=COLORS[serve["batching"]],
                    label=f"{serve['batching']} {q}")  # fmt: skip
    ax.axhline(serves[0]["max_drain_ms"], color="red", linewidth=0.8, label="drain budget")
    ax.set(xlabel="offered load (requests/s)", ylabel="latency of accepted requests (ms)", yscale="log")
    ax.set_title("Latency vs offered load")
    _save(fig, ax, path)


def padding(ceiling: dict[str, Any], serves: list[dict[str, Any]], path: Path) -> None:
    orders = [o for o in CEILING_STYLES if o in ceiling]
    labels = [f"ceiling {o}" for o in orders]
    values = [ceiling[o]["padding_ratio"] for o in orders]
    colors = ["gray"] * len(orders)
    for serve in serves:
        for p in [serve["saturation"], *serve["open_loop"]]:
            load = f"{p['offered_x']:g}x" if "offered_x" in p else "closed loop"
            labels.append(f"{serve['batching']} {load}")
            values.append(p["padding_ratio"])
            colors.append(COLORS[serve["batching"]])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(range(len(values)), [v * 100 for v in values], color=colors)
    ax.set_xticks(range(len(values)), labels, fontsize=7, rotation=30, ha="right")
    ax.axhline(15, color="red", linewidth=0.8, label="target: 15%")
    ax.set(ylabel="padding, % of computed tokens")
    ax.set_title("Padding ratio (server: from kembed_tokens_total)")
    _save(fig, ax, path)


def _save(fig: Any, ax: Any, path: Path) -> None:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


@dataclass(frozen=True)
class Section:
    """A benchmark judged in the summary: ``results/<name>.json``, written by ``python -m bench.<name>``."""

    name: str
    title: str  # said when it was not run
    what: str  # its heading's subject
    ratios: Callable[[dict[str, Any]], list[Ratio]]
    table: Callable[[dict[str, Any]], str]

    def text(self, result: dict[str, Any] | None) -> str:
        """Its heading, ratios and table, or why there are none."""
        if not result:
            return f"{self.title}: not run (no results/{self.name}.json; `python -m bench.{self.name}`)."
        return _judged(self.what, result, self.ratios(result), self.table(result))


SECTIONS = (
    Section("hostpath", "Host path", "Host path against a bare gRPC echo, side by side",
            headline.hostpath_ratios, headline.hostpath_table),
    Section("priority", "Priority classes", "Queries beside an ingest, one server,",
            headline.priority_ratios, headline.priority_table),
    Section("abuse", "Pings beside a hostile client", "Pings beside a hostile client, one front end,",
            headline.abuse_ratios, headline.abuse_table),
    Section("fairness", "Admission one client cannot game",
            "Queries beside a maximal ingest, and beside refused maximal requests,",
            headline.fairness_ratios, headline.fairness_table),
    Section("corpus", "Corpus job", "A corpus job's shards beside queries, one server,",
            headline.corpus_ratios, headline.corpus_table),
    Section("startup", "Start-up", "Ready after start, default settings, each start alone,",
            headline.startup_ratios, headline.startup_table),
)  # fmt: skip


def _judged(what: str, result: dict[str, Any], rows: list[Ratio], table: str) -> str:
    """A result's heading (when, under what load, which commit), its ratios and its table."""
    m = result["machine"]
    heading = f"{what} in one run at {m['time_utc']} (load {m['loadavg_1_5_15'][0]}, git {m['git']}):"
    return "\n\n".join([heading, ratio_table(rows), table])


def markdown(
    ceiling: dict[str, Any],
    serves: list[dict[str, Any]],
    naive: dict[str, Any] | None,
    gpu: dict[str, Any] | None,
    judged: Mapping[str, dict[str, Any] | None],
    many_texts: dict[str, Any] | None = None,
) -> str:
    """The summary; ``judged`` holds each of :data:`SECTIONS`' results by name (None: not run);
    ``many_texts`` the server's saturation at many texts a call."""
    m = ceiling["machine"]
    runs = "; ".join(
        f"{r.get('batching', 'ceiling')} at {r['machine']['time_utc']} (load {r['machine']['loadavg_1_5_15'][0]})"
        for r in [ceiling, *serves]
    )
    return "\n\n".join(
        [
            f"Measured on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB, {m['gpu'] or 'no GPU'}, "
            f"{_bf16(m)}), torch {m['torch']}, git {m['git']}: {runs}. Ranges: over passes (ceiling) "
            "or time windows (server) within one run; ratios pair the worst and best ends of both ranges.",
            cpu_block(ceiling, serves[0], many_texts, judged),
            ratio_table(headline.ratios(ceiling, serves[0], naive)),
            "![throughput](results/throughput.png)\n![latency](results/latency.png)\n![padding](results/padding.png)",
            f"Ceiling (one process, no server), {ceiling.get('dtype', 'torch.float32')} "
            f"({ceiling.get('dtype_reason', 'before the dtype was recorded')}):\n\n" + headline.ceiling_table(ceiling),
            headline.limits_table(ceiling),
            headline.curve_table(ceiling),
            "Server phases:\n\n" + headline.phase_table(serves),
            headline.workload_text(ceiling["workload"]),
            *(section.text(judged.get(section.name)) for section in SECTIONS),
            headline.gpu_table(gpu),
        ]
    )


def cpu_block(
    ceiling: dict[str, Any],
    one_text: dict[str, Any],
    many_texts: dict[str, Any] | None,
    judged: Mapping[str, dict[str, Any] | None],
) -> str:
    """The server against sentence-transformers, the compiled ceiling and Infinity, with the CPU named."""
    m = ceiling["machine"]
    rows = headline.cpu_ratios(ceiling, one_text, many_texts, judged.get("hostpath"), judged.get("startup"))
    flags = ", ".join(m.get("cpu_flags", [])) or "not recorded"
    served = f"kembed served {one_text.get('dtype') or '?'}, forward {one_text.get('forward') or '?'}"
    heading = f"Against what users would otherwise run, on {m['cpu']} ({m['cores']} cores; flags: {flags}), {served}:"
    sources = {"bench.compute.ceiling": ceiling, "bench.serving.serve_load": one_text,
               "bench.serving.serve_load, many texts": many_texts, "bench.serving.hostpath": judged.get("hostpath"),
               "bench.serving.startup": judged.get("startup")}  # fmt: skip
    found = [f"{name} at {r['machine']['time_utc']} on {r['machine']['cpu']}" for name, r in sources.items() if r]
    return "\n\n".join([heading, ratio_table(rows), f"From {'; '.join(found)}."])


def _bf16(m: dict[str, Any]) -> str:
    """The CPU's bf16 units, as the result recorded them (results before that say nothing)."""
    if "cpu_bf16_flags" not in m:
        return "bf16 units not recorded"
    return f"bf16 units: {', '.join(m['cpu_bf16_flags'])}" if m["cpu_bf16_flags"] else "no bf16 units"


def headline_block(
    ceiling: dict[str, Any],
    token_bucket: dict[str, Any],
    naive: dict[str, Any] | None,
    many_texts: dict[str, Any] | None = None,
    judged: Mapping[str, dict[str, Any] | None] | None = None,
) -> str:
    """For the top-level README: the server against what users would otherwise run (the CPU named),
    the serving ratios, the throughput plot, a pointer to the method."""
    m = ceiling["machine"]
    return "\n\n".join(
        [
            cpu_block(ceiling, token_bucket, many_texts, judged or {}),
            "Serving against the in-process ceiling of one batch at a time, and under overload:",
            ratio_table(headline.ratios(ceiling, token_bucket, naive)),
            "![throughput vs offered load](bench/results/throughput.png)",
            f"One run of `make bench` on {m['cpu']} ({m['cores']} cores, {m['gpu'] or 'no GPU'}), "
            f"{m['time_utc']}; method, every phase and the other plots: [bench/README.md](bench/README.md).",
        ]
    )


def main() -> None:
    ceiling, token_bucket, naive, gpu = map(read_result, ("ceiling", "serve_token_bucket", "serve_naive", "gpu"))
    many_texts = read_result("serve_token_bucket_16texts")
    if ceiling is None or token_bucket is None:
        raise SystemExit("need bench/results/ceiling.json and serve_token_bucket.json: run python -m bench.run_all")
    serves = [token_bucket] + ([naive] if naive else [])
    throughput(ceiling, serves, RESULTS_DIR / "throughput.png")
    latency(serves, RESULTS_DIR / "latency.png")
    padding(ceiling, serves, RESULTS_DIR / "padding.png")
    judged = {section.name: read_result(section.name) for section in SECTIONS}
    block = markdown(ceiling, serves, naive, gpu, judged, many_texts)
    (RESULTS_DIR / "summary.md").write_text(block + "\n")
    README.write_text(splice(README.read_text(), block, RESULTS_MARKERS))
    top = TOP_README.read_text()
    if HEADLINE_MARKERS[0] in top:
        TOP_README.write_text(
            splice(top, headline_block(ceiling, token_bucket, naive, many_texts, judged), HEADLINE_MARKERS)
        )
    print(f"wrote {RESULTS_DIR / 'summary.md'} and the generated blocks of the READMEs")


if __name__ == "__main__":
    main()
