"""Admission's figures: queries beside an ingest (priority classes), pings beside a hostile client
(abuse), fairness against one greedy client (lockout, poison) and a corpus job beside queries."""

from __future__ import annotations

import math
from typing import Any

from bench.headline.figures import exact, ms_text
from bench.tools.report import Ratio, Spread, percentile, spread_text

QUERY_P95_TARGET = "<= 1.00"  # of the idle p95 plus two batch durations
QUERY_OVER_BATCH_TARGET = "<= 0.35"
PRIORITY_GOODPUT_TARGET = ">= 0.90"
NONE = "<= 0"


def query_ratios(loads: dict[str, Any], queries: dict[str, Any], beside: str) -> list[Ratio]:
    """Queries beside other work (``beside`` names it) against the queries alone: none refused, and
    their p95 within the idle p95 plus two batch durations at saturation (a batch already in the
    model cannot be preempted; the query's own is the second)."""
    batch_s = loads["saturation"]["server"]["batch_seconds"]
    allowance = loads["idle"]["interactive"]["latency_ms"]["p95"] + 2 * batch_s * 1000
    return [
        Ratio(f"Queries rejected beside {beside}", exact(_refused(queries)), NONE),
        Ratio(
            f"Query p95 beside {beside} / (idle p95 + 2 batch durations: {allowance:.0f} ms)",
            exact(queries["latency_ms"]["p95"] / allowance),
            QUERY_P95_TARGET,
        ),
    ]


def priority_ratios(result: dict[str, Any]) -> list[Ratio]:
    """The figures of a ``priority.json``: the queries beside the ingest against their idle latency,
    the ingest's latency and saturation; the one-class and starved loads, informative."""
    loads = result["loads"]
    saturation = Spread.from_dict(loads["saturation"]["batch"]["emb_per_s"])
    beside = loads["beside"]
    query_p95 = beside["interactive"]["latency_ms"]["p95"]
    goodput = Spread.from_dict(beside["total_emb_per_s"])
    rows = [
        *query_ratios(loads, beside["interactive"], "the ingest"),
        Ratio(
            "Query p95 / ingest p95, beside the ingest",
            exact(query_p95 / beside["batch"]["latency_ms"]["p95"]),
            QUERY_OVER_BATCH_TARGET,
        ),
        Ratio(
            "Goodput beside the ingest (queries + ingest) / saturation (emb/s)",
            goodput.over(saturation),
            PRIORITY_GOODPUT_TARGET,
        ),
    ]
    if one_class := loads.get("one_class"):
        p95 = one_class["interactive"]["latency_ms"]["p95"]
        rows.append(Ratio("Query p95 with one class for both / with classes", exact(p95 / query_p95), ""))
        rows.append(Ratio("Queries rejected with one class for both", exact(_refused(one_class["interactive"])), ""))
    if starved := loads.get("starved"):
        rows.append(Ratio("Ingest p95 under saturating queries (ms)", exact(starved["batch"]["latency_ms"]["p95"]), ""))
    return rows


def _refused(side: dict[str, Any]) -> float:
    return float(sum(n for code, n in side["codes"].items() if code != "OK"))


def priority_table(result: dict[str, Any]) -> str:
    """Every load of a ``priority.json``, each side's figures, and the server's once per load: its
    batches' mean compute time and its rejections by class (the class, not the side: in the
    one-class load both sides are interactive)."""
    s = result["settings"]
    columns = ["Load", "Side", "Calls", "emb/s", "p50 / p95 / p99 ms", "Codes", "Batch compute ms"]
    columns.append("Server rejections by class")
    lines = ["| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|"]
    describe = {
        "batch": f"ingest, {s['concurrency']} closed-loop callers x {s['texts']} texts",
        "interactive": f"queries, 1 short text, {result['loads']['query_rate']:.1f}/s Poisson",
    }
    for name, load in result["loads"].items():
        if not isinstance(load, dict):
            continue
        server = f"| {load['server']['batch_seconds'] * 1000:.0f} | {_by_class(load['server']['rejections'])} |"
        for side_name, side in ((k, v) for k, v in load.items() if k in describe):
            label = describe[side_name]
            if name == "starved":
                label = "ingest, 1 caller" if side_name == "batch" else f"queries, {s['starve_concurrency']} callers"
            lat = side["latency_ms"]
            codes = ", ".join(f"{code} {n}" for code, n in sorted(side["codes"].items()))
            lines.append(
                f"| {name} | {label} | {side['calls']} | {spread_text(Spread.from_dict(side['emb_per_s']))} "
                f"| {ms_text(lat['p50'])} / {ms_text(lat['p95'])} / {ms_text(lat['p99'])} | {codes} {server}"
            )
            server = "| | |"  # once per load
    return "\n".join(lines)


def _by_class(rejections: dict[str, dict[str, float]]) -> str:
    counted = [
        f"{priority}: " + ", ".join(f"{reason} {n:.0f}" for reason, n in reasons.items() if n)
        for priority, reasons in rejections.items()
        if any(reasons.values())
    ]
    return "; ".join(counted) or "—"


ABUSE_PHASES = ("idle", "bad_bodies", "slow_bodies")
ABUSE_TARGET = "<= 3.00"  # a ping's p99 beside a hostile client, over its idle p99


def abuse_ratios(result: dict[str, Any]) -> list[Ratio]:
    """Each abused phase's ping p99 over the idle phase's, per kind of ping."""
    phases, rows = result["phases"], []
    for name, label in (("bad_bodies", "maximal bad REST bodies back to back"), ("slow_bodies", "slow bodies held")):
        for kind, ping_name in (("models", "GET /v1/models"), ("info", "gRPC Info")):
            idle = phases["idle"]["pings"][kind]["latency_ms"]["p99"]
            abused = phases[name]["pings"][kind]["latency_ms"]["p99"]
            value = exact(abused / idle)
            rows.append(Ratio(f"{ping_name} p99 beside {label} / idle", value, ABUSE_TARGET))
    return rows


def abuse_table(result: dict[str, Any]) -> str:
    """Every phase's pings and what its abuser got."""
    lines = ["| Phase | Ping | Pings | p50 / p95 / p99 ms | Codes | Abuser |", "| --- " * 6 + "|"]
    for name in ABUSE_PHASES:
        phase = result["phases"][name]
        abuser = ", ".join(f"{key} {value}" for key, value in phase.get("abuser", {}).items()) or "—"
        for kind in ("models", "info"):
            ping = phase["pings"][kind]
            ms = " / ".join(f"{ping['latency_ms'][q]:.1f}" for q in ("p50", "p95", "p99"))
            codes = ", ".join(f"{code} {n}" for code, n in sorted(ping["codes"].items()))
            lines.append(f"| {name} | {kind} | {ping['pings']} | {ms} | {codes} | {abuser} |")
    return "\n".join(lines)


EXPORTED_P95_TARGET = "<= 1.50"  # of the served queries' own p95


def fairness_ratios(result: dict[str, Any]) -> list[Ratio]:
    """The figures of a ``fairness.json``: queries beside a maximal ingest against their idle p95,
    and the exported P95 beside refused maximal requests against the served queries' own."""
    rows = []
    if lockout := result.get("lockout"):
        beside, idle = lockout["beside"], lockout["idle"]
        allowance = idle["latency_ms"]["p95"] + 2 * beside["batch_seconds"] * 1000
        name = f"maximal ingest ({lockout['texts']} texts, REST, no priority)"
        rows += [
            Ratio(f"Queries refused beside a {name}", exact(_refused(beside)), NONE),
            Ratio(
                f"Query p95 beside it / (idle p95 + 2 batch durations: {allowance:.0f} ms)",
                exact(beside["latency_ms"]["p95"] / allowance),
                QUERY_P95_TARGET,
            ),
            Ratio("The ingest answered 200 (1 = yes)", exact(float(lockout["ingest"].get("status") == 200)), ""),
        ]
    if poison := result.get("poison"):
        served = poison["beside"]["latency_ms"]["p95"]
        exported = max(poison["exported_p95_ms"], default=math.nan)
        rows += [
            Ratio(
                f"Exported P95 beside {poison['attackers']} clients of refused maximal requests / served queries' p95",
                exact(exported / served),
                EXPORTED_P95_TARGET,
            ),
            Ratio("Maximal requests refused", exact(_refused(poison["attack"])), ""),
            Ratio("Queries refused beside them", exact(_refused(poison["beside"])), ""),
        ]
    return rows


def fairness_table(result: dict[str, Any]) -> str:
    """Every load of a ``fairness.json``: what was sent, what came back."""
    s = result["settings"]
    lines = ["| Part | Load | Calls | p50 / p95 / p99 ms | Codes | Notes |", "| --- " * 6 + "|"]
    queries = f"queries, 1 short text, {s['query_rate']:g}/s Poisson"
    for part, notes in (("lockout", _lockout_notes), ("poison", _poison_notes)):
        if not (found := result.get(part)):
            continue
        for name, load in (("idle", f"{queries}, alone"), ("beside", f"{queries}, beside")):
            side = found[name]
            lat = side["latency_ms"]
            codes = ", ".join(f"{code} {n}" for code, n in sorted(side["codes"].items()))
            lines.append(
                f"| {part} | {load} | {side['calls']} "
                f"| {ms_text(lat['p50'])} / {ms_text(lat['p95'])} / {ms_text(lat['p99'])} "
                f"| {codes} | {notes(found) if name == 'beside' else ''} |"
            )
    return "\n".join(lines)


def _lockout_notes(lockout: dict[str, Any]) -> str:
    ingest = lockout["ingest"]
    return (
        f"beside one ingest of {lockout['texts']} texts (REST, no priority): {ingest.get('status')} after "
        f"{ingest.get('seconds', math.nan):.0f} s; batch {lockout['beside']['batch_seconds'] * 1000:.0f} ms"
    )


def _poison_notes(poison: dict[str, Any]) -> str:
    codes = ", ".join(f"{code} {n}" for code, n in sorted(poison["attack"]["codes"].items()))
    health = ", ".join(f"{status} {n}" for status, n in sorted(poison["health"].items()))
    exported = max(poison["exported_p95_ms"], default=math.nan)
    return (
        f"beside {poison['attackers']} clients of maximal requests ({codes}); exported P95 at most "
        f"{ms_text(exported)} ms; /health: {health}"
    )


CORPUS_GOODPUT_TARGET = ">= 0.90"
SAME_ROW_TARGET = ">= 0.9999"  # one text in two batches: float rounding apart (the corpus command's SAME_ROW)


def corpus_ratios(result: dict[str, Any]) -> list[Ratio]:
    """The figures of a ``corpus.json``: the server's embeddings/s with the shards and queries
    against saturation's (both from its own counters), the queries against their idle latency, and
    the output against the corpus; the shards' own rate and refusals, informative."""
    loads = result["loads"]
    shards, output = loads["shards"], loads["shards"]["output"]
    ran, n = shards["shards"], len(shards["shards"]["exit_codes"])
    saturation = _server_rate(loads["saturation"])
    delivered = _server_rate(shards)
    return [
        Ratio(f"Server emb/s, {n} shards + queries / saturation (server's rows)", delivered.over(saturation),
              CORPUS_GOODPUT_TARGET),
        *query_ratios(loads, shards["interactive"], f"{n} shards"),
        Ratio("Shards that ended before the measured window did", exact(n - shards["shards_running_at_end"]), NONE),
        Ratio("Rows missing or extra in the parts, in the manifest's order",
              exact(abs(output["rows"] - output["lines"])), NONE),
        Ratio("Parts out of the shards' order, or not as the manifest counts them",
              exact(0.0 if output["parts_in_order"] else 1.0), NONE),
        Ratio(f"Rows at the parts' ends against their lines embedded anew, least cosine ({output['seam_rows']} rows)",
              exact(output["seam_min_cosine"]), SAME_ROW_TARGET),
        Ratio("Shards' rows/s (each over its own run, summed) / saturation (server's rows)",
              exact(ran["rows_per_s"]).over(saturation), ""),
        Ratio("Shards' refusals", exact(ran["refusals"]), ""),
    ]  # fmt: skip


def corpus_table(result: dict[str, Any]) -> str:
    """Every load of a ``corpus.json``: each side's figures and the server's, then the output."""
    s, loads = result["settings"], result["loads"]
    shards, ran, output = loads["shards"], loads["shards"]["shards"], loads["shards"]["output"]
    columns = ["Load", "Side", "emb/s (client)", "emb/s (server's rows)", "p50 / p95 / p99 ms", "Codes"]
    columns += ["Worker: busy / padded tok per compute-s (median of windows)", "Batch compute ms"]
    lines = ["| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|"]
    queries = f"queries, 1 short text, {loads['query_rate']:.1f}/s Poisson"
    ingest = f"ingest, {s['load']['concurrency']} callers x {s['load']['texts']} texts"
    rows = [
        ["saturation", *_side_cells(ingest, loads["saturation"]["batch"]),
         spread_text(_server_rate(loads["saturation"]))],
        ["idle", *_side_cells(queries, loads["idle"]["interactive"]), ""],
        ["shards", f"{len(ran['exit_codes'])} corpus commands, {output['lines']} lines",
         f"{ran['rows_per_s']:.1f} (rows / own s)", "—",
         f"refusals {ran['refusals']}, retries {ran['retries']}, reconnects {ran['reconnects']}",
         spread_text(_server_rate(shards))],
        ["shards", *_side_cells(queries, shards["interactive"]), ""],
    ]  # fmt: skip
    for row, phase in zip(rows, (loads["saturation"], loads["idle"], shards, shards), strict=True):
        label, emb, lat, codes, server = row[1:]
        worker = _window_worker(phase) if server else ""
        cells = [row[0], label, emb, server, lat, codes, worker, f"{phase['server']['batch_seconds'] * 1000:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    parts = ", ".join(map(str, output["part_rows"]))
    lines += ["", f"Output: {output['rows']} rows in {len(output['part_rows'])} parts ({parts}) for {output['lines']} "
                  f"corpus lines; the shards together {ran['rows_per_wall_s']:.1f} rows/s over {ran['wall_s']:.0f} s "
                  "from their start to the last one's end."]  # fmt: skip
    return "\n".join(lines)


def _server_rate(phase: dict[str, Any]) -> Spread:
    return Spread.from_dict(phase["server_windows"]["emb_per_s"])


def _window_worker(phase: dict[str, Any]) -> str:
    """The worker's busy share and compute speed over a load's windows (their medians)."""
    windows = phase["server_windows"]["windows"]
    busy = percentile([w["busy_share"] for w in windows], 50)
    speed = percentile([w["padded_tokens_per_compute_s"] for w in windows], 50)
    return "—" if math.isnan(busy) else f"{busy:.0%} / {speed:.0f}"


def _side_cells(label: str, side: dict[str, Any]) -> list[str]:
    """A side's cells: its label, client emb/s, latency, codes."""
    lat = side["latency_ms"]
    codes = ", ".join(f"{code} {n}" for code, n in sorted(side["codes"].items()))
    emb = spread_text(Spread.from_dict(side["emb_per_s"]))
    return [label, emb, f"{ms_text(lat['p50'])} / {ms_text(lat['p95'])} / {ms_text(lat['p99'])}", codes]
