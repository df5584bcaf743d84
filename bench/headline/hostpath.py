"""The host path's figures: kembed's zero-cost server over the bare gRPC echo, refusals, the retry
storm, spikes, short deadlines, REST against gRPC and the peer, and the GPU targets' serve loads."""

from __future__ import annotations

import math
from typing import Any

from bench.headline.figures import calls_rate, cores_text, emb_rate, exact, ms_text
from bench.tools.report import Ratio, Spread, spread_text

HOST_PATH_TARGET = ">= 0.50"  # one front end against a one-process echo
REJECTION_TARGET = "<= 2.00"
STORM_TARGET = ">= 0.90"
# Open-loop spikes over a connection pool, by offered multiple of saturation: goodput, and the
# refusals' p99 in ms; the accepted calls' p95 within the drain budget at every multiple.
SPIKE_GOODPUT_TARGETS = {2.0: ">= 0.90", 4.0: ">= 0.85"}
SPIKE_REFUSAL_P99_TARGETS = {2.0: "<= 100", 4.0: "<= 250"}
SPIKE_ACCEPTED_TARGET = "<= 1.00"
EXPORTED_P95_TARGET = "<= 1.50"  # the exported P95 and the served callers' p95, the larger over the smaller
REST_TARGET = ">= 0.80"  # REST's calls/s over gRPC's, one front end
PEER_TARGET = ">= 2.50"  # kembed's REST calls/s over the peer's, the real model, each in its own bf16 on a bf16 CPU
# The GPU targets of the serve part, judged only where the server ran on CUDA: texts a call -> target.
SERVE_EMB_TARGETS = {1: ">= 15000", 16: ">= 25000"}
SERVE_P95_MS_TARGETS = {1: "<= 100"}
SERVE_CEILING_TARGETS = {16: ">= 0.55"}
GPU_BUSY_TARGET = ">= 0.50"


def hostpath_ratios(result: dict[str, Any]) -> list[Ratio]:
    """The host-path figures of a ``hostpath.json``: each part's ratio against its reference."""
    rows = []
    for pair in result.get("host_path", []):
        n, zero_cost, echo = pair["processes"], pair["zero_cost"], pair["echo"]
        calls = calls_rate(zero_cost).over(calls_rate(echo))
        rows.append(
            Ratio(
                f"Host path, {n} process(es): zero-cost server / echo (calls/s)",
                calls,
                HOST_PATH_TARGET if n == 1 else "",
            )
        )
        cpu = exact(_cpu_ratio(zero_cost, echo))
        rows.append(Ratio(f"Host path, {n} process(es): zero-cost server / echo, server CPU per call", cpu, ""))
    if rejection := result.get("rejection"):
        echo, kembed = rejection["echo"], rejection["kembed"]
        rows += _burst_ratios("Rejected burst", kembed, echo)
        rows.append(Ratio("Rejected burst / echo burst, server CPU per call", exact(_cpu_ratio(kembed, echo)), ""))
        share = exact(kembed["rejected_share"])
        rows.append(Ratio("Share of the rejected burst answered RESOURCE_EXHAUSTED", share, ">= 1.00"))
        if computing := rejection.get("computing"):
            rows += _burst_ratios("Rejections while the engine computes", computing, echo)
        if one := rejection.get("one_channel"):
            rows += _burst_ratios("Rejections while the engine computes, one channel", one["computing"], one["echo"])
    if rest := result.get("rest"):
        rows += rest_ratios(rest)
    if storm := result.get("retry_storm"):
        goodput = Spread.from_dict(storm["storm"]["emb_per_s"]).over(Spread.from_dict(storm["saturation"]["emb_per_s"]))
        rows.append(Ratio(f"Goodput, {storm['multiple']:g}x retry storm / saturation (emb/s)", goodput, STORM_TARGET))
    if spikes := result.get("spikes"):
        rows += spike_ratios(spikes)
    if deadlines := result.get("short_deadlines"):
        exported, served = deadlines["exported_p95_ms"]["median"], deadlines["served_p95_ms"]
        apart = exact(max(exported, served) / min(exported, served))
        rows.append(Ratio("Exported P95 beside 30 ms callers vs the served callers' p95 (larger / smaller)", apart,
                          EXPORTED_P95_TARGET))  # fmt: skip
    if serve := result.get("serve"):
        rows += serve_ratios(serve)
    return rows


def spike_ratios(spikes: dict[str, Any]) -> list[Ratio]:
    """Each open-loop spike: goodput over saturation, accepted p95 over the drain budget, refusals' p99."""
    rows = []
    saturation = Spread.from_dict(spikes["saturation"]["emb_per_s"])
    for load in spikes["loads"]:
        x, name = load["offered_x"], f"Open-loop {load['offered_x']:g}x, 1 text a call, {spikes['channels']} channels"
        goodput = Spread.from_dict(load["emb_per_s"]).over(saturation)
        rows.append(Ratio(f"{name}: goodput / saturation (emb/s)", goodput, SPIKE_GOODPUT_TARGETS.get(x, "")))
        accepted = exact(load["latency_ms"]["p95"] / spikes["drain_budget_ms"])
        rows.append(Ratio(f"{name}: accepted p95 / drain budget", accepted, SPIKE_ACCEPTED_TARGET))
        p99 = load["rejection_latency_ms"]["p99"]
        refused = exact(0.0 if math.isnan(p99) else p99)  # none refused: none late
        rows.append(Ratio(f"{name}: refusals p99 (ms)", refused, SPIKE_REFUSAL_P99_TARGETS.get(x, "")))
    return rows


def rest_ratios(rest: dict[str, Any]) -> list[Ratio]:
    """REST against gRPC on the zero-cost server; kembed against the peer, where it ran."""
    host, peer = rest["host_path"], rest["peer"]
    name = "REST / gRPC, zero-cost server, 1 front end"
    rows = [
        Ratio(f"{name} (calls/s)", calls_rate(host["rest"]).over(calls_rate(host["grpc"])), REST_TARGET),
        Ratio(f"{name}, server CPU per call", exact(_cpu_ratio(host["rest"], host["grpc"])), ""),
    ]
    if "skipped" not in peer:
        name = f"REST, real model: kembed / {peer['peer']}"
        rows.append(
            Ratio(f"{name} (calls/s)", calls_rate(peer["kembed"]).over(calls_rate(peer["infinity"])), PEER_TARGET)
        )
        rows.append(Ratio(f"{name}, server CPU per call", exact(_cpu_ratio(peer["kembed"], peer["infinity"])), ""))
    return rows


def _burst_ratios(name: str, burst: dict[str, Any], echo: dict[str, Any]) -> list[Ratio]:
    """A burst's p99 and time to the last answer, each over the echo's for the same burst."""
    rows = []
    for key, label in (("p99_ms", "p99"), ("last_ms", "time to last answer")):
        value = Spread.from_dict(burst[key]).over(Spread.from_dict(echo[key]))
        rows.append(Ratio(f"{name} / echo burst, {label}", value, REJECTION_TARGET))
    return rows


def serve_ratios(serve: dict[str, Any]) -> list[Ratio]:
    """The serve part's figures (``bench.serving.hostpath --parts serve``): per load, embeddings/s, accepted
    p95, the share of the in-process ceiling and GPU busy; targets only where it ran on CUDA."""
    cuda = str(serve["info"].get("device", "")).startswith("cuda")
    ceiling = serve.get("ceiling")
    rows = []
    for load in serve["loads"]:
        n = load["texts_per_call"]

        def target(targets: dict[int, str], n: int = n) -> str:
            return targets.get(n, "") if cuda else ""

        name = f"Serving, {n} text{'s' if n > 1 else ''} a call"
        rows.append(Ratio(f"{name}: emb/s", emb_rate(load), target(SERVE_EMB_TARGETS)))
        p95 = exact(load["latency_ms"]["p95"])
        rows.append(Ratio(f"{name}: accepted p95 (ms)", p95, target(SERVE_P95_MS_TARGETS)))
        if ceiling:
            kind = f"{'compiled' if ceiling['compiled'] else 'eager'} {ceiling['batching']}"
            value = emb_rate(load).over(Spread.from_dict(ceiling["emb_per_s"]))
            rows.append(Ratio(f"{name} / in-process ceiling, {kind} (emb/s)", value, target(SERVE_CEILING_TARGETS)))
        busy = load.get("gpu_busy_pct") or {}
        if busy.get("samples"):
            share = exact(busy["mean"] / 100)
            rows.append(Ratio(f"{name}: GPU busy (nvidia-smi)", share, GPU_BUSY_TARGET if cuda else ""))
    return rows


def _cpu_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    return float(a["server_cpu_ms_per_call"]) / float(b["server_cpu_ms_per_call"])


def hostpath_table(result: dict[str, Any]) -> str:
    """Every phase of a ``hostpath.json``: which server, what load, what came back."""
    columns = ["Part", "Server", "Load", "Figure", "Codes", "CPU cores: server / client", "Peak RSS MiB"]
    lines = ["| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|"]
    for part, server, load, figure, p in _hostpath_phases(result):
        codes = ", ".join(f"{code} {n}" for code, n in sorted(p["codes"].items())) or "—"
        lines.append(
            f"| {part} | {server} | {load} | {figure} | {codes} | {cores_text(p.get('cpu_cores'))} "
            f"| {ms_text(p['peak_rss_mib'])} |"
        )
    return "\n".join(lines)


def _hostpath_phases(result: dict[str, Any]) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    s = result["settings"]
    rows = []
    loop = f"closed loop, {s['client_processes']} x {s['concurrency']} callers, 1 text"
    for pair in result.get("host_path", []):
        n = pair["processes"]
        for name, label in (("echo", "echo"), ("zero_cost", "zero-cost kembed")):
            rows.append(("host path", f"{label}, {n} proc", loop, _calls_figure(pair[name]), pair[name]))
    if rest := result.get("rest"):
        rows += _rest_phases(rest, s)
    if rejection := result.get("rejection"):
        load = f"{s['burst_rounds']} bursts of {s['burst_calls']} x {s['burst_texts']} texts"
        labels = (
            ("echo", "echo, 1 proc"),
            ("kembed", "kembed, max_queued_tokens=1"),
            ("computing", "kembed, computing"),
        )
        one = rejection.get("one_channel", {})
        shown = [(label, rejection[name], load) for name, label in labels if name in rejection]
        shown += [(label, one[name], f"{load}, one channel") for name, label in labels if name in one]
        for label, p, sent in shown:
            figure = (
                f"p99 {spread_text(Spread.from_dict(p['p99_ms']))} ms, "
                f"last {spread_text(Spread.from_dict(p['last_ms']))} ms, "
                f"{p['server_cpu_ms_per_call']:.2f} CPU ms/call"
            )
            if "refusals_paced" in p:
                figure += f", {p['refusals_paced']:.0f} paced"
            rows.append(("rejection", label, sent, figure, p))
    if storm := result.get("retry_storm"):
        texts = s["storm_texts"]
        sat, flood = storm["saturation"], storm["storm"]
        rows.append(("retry storm", "kembed", f"closed loop, pushback respected, {texts} texts", _emb(sat), sat))
        offered = f"open loop {flood['offered_calls_per_s']:.1f} calls/s, retry {s['retry_after_ms']:g} ms"
        figure = _emb(flood)
        if gave_up := flood.get("give_ups"):
            figure += (f", {gave_up['gave_up']} of {gave_up['calls']} calls gave up after {s['give_up_s']:g} s "
                       f"(at least {gave_up['fewest_possible']} must)")  # fmt: skip
        rows.append(("retry storm", "kembed", f"{offered}, {texts} texts", figure, flood))
    if serve := result.get("serve"):
        server = f"kembed, frontends={serve['settings'].get('frontends')}, {serve['info'].get('device', '?')}"
        for p in serve["loads"]:
            load = f"closed loop, {s['client_processes']} x {s['concurrency']} callers, {p['texts_per_call']} texts"
            busy = (p.get("gpu_busy_pct") or {}).get("mean", math.nan)
            figure = f"{_emb(p)}, p95 {ms_text(p['latency_ms']['p95'])} ms, GPU busy {ms_text(busy)}%"
            rows.append(("serving", server, load, figure, p))
    return rows


def _rest_phases(rest: dict[str, Any], s: dict[str, Any]) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    over = f"{s['client_processes']} x {s['concurrency']}"
    grpc_load = f"gRPC closed loop, {over} callers, 1 text"
    rest_load = f"REST closed loop, {over} connections, 1 text"
    host = rest["host_path"]
    rows = [("REST", "zero-cost kembed, 1 proc", load, _calls_figure(host[name]), host[name])
            for name, load in (("grpc", grpc_load), ("rest", rest_load))]  # fmt: skip
    peer = rest["peer"]
    if "skipped" in peer:
        figure = f"skipped: {peer['skipped']} (`{peer['setup_command']}`)"
        return [*rows, ("REST, peer", "Infinity", "—", figure, {"codes": {}, "peak_rss_mib": math.nan})]
    peer_load = f"{rest_load}, {s['peer_duration']:g} s"
    for name, label in (("infinity", peer["peer"]), ("kembed", f"kembed, frontends={peer['settings']['frontends']}")):
        served = f", {peer[name]['dtype']}" if peer[name].get("dtype") else ""  # results before the dtype was kept
        rows.append(("REST, real model", label + served, peer_load, _calls_figure(peer[name]), peer[name]))
    return rows


def _calls_figure(phase: dict[str, Any]) -> str:
    return (
        f"{spread_text(calls_rate(phase))} calls/s, p99 {ms_text(phase['latency_ms']['p99'])} ms, "
        f"{phase['server_cpu_ms_per_call']:.2f} CPU ms/call"
    )


def _emb(phase: dict[str, Any]) -> str:
    return f"{spread_text(Spread.from_dict(phase['emb_per_s']))} emb/s"
