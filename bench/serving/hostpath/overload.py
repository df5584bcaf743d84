"""The overload shapes (real model): part ``rejection``, a burst refused by kembed against the same
burst answered by the echo; part ``storm``, a retry storm; part ``spikes``, open-loop spikes over
the saturation."""

from __future__ import annotations

import time
from typing import Any

from bench.serving.hostpath.deadlines import give_ups
from bench.serving.hostpath.measure import (
    EXHAUSTED,
    MAX_CALLS,
    ONE_CHANNEL,
    Options,
    Senders,
    bursts,
    encode,
    frontends_setting,
    log_file,
    many_senders,
    niced,
    phase_figures,
    real_model,
)
from bench.tools import loadgen, workload
from bench.tools.loadgen import CallRecord
from bench.tools.report import (
    deltas_by_label,
    metric_delta,
)
from bench.tools.server import Server, echo_running, running
from kembed.config.settings import Settings
from kembed.contract import Metric


def rejection(opts: Options, texts: list[str]) -> dict[str, Any]:
    """The same bursts against the echo (1 process), a kembed that rejects every call on an idle
    engine, and a kembed that rejects what its drain budget cannot hold while it computes the rest;
    each burst sent over many channels, and, to the echo and the computing kembed, over one."""
    request = encode(texts[: opts.burst_texts], opts.burst_texts)[0]
    with echo_running(1, log_file("echo_burst")) as echo:
        echo_figures = bursts(echo, request, opts, many_senders(opts))
        echo_one = bursts(echo, request, opts, ONE_CHANNEL)
    idle_settings = {**frontends_setting(1), "max_queued_tokens": "1"}
    with running(idle_settings, log_file("rejecting"), module="kembed") as server:
        idle = _rejecting_bursts(server, request, opts, many_senders(opts))
    computing_settings = real_model(opts)
    with running(computing_settings, log_file("computing"), module="kembed") as server:
        computing = _rejecting_bursts(server, request, opts, many_senders(opts), code=EXHAUSTED)
        computing_one = _rejecting_bursts(server, request, opts, ONE_CHANNEL, code=EXHAUSTED)
    shown = (("echo", echo_figures), ("kembed, idle engine", idle), ("kembed, engine computing", computing),
             ("echo, one channel", echo_one), ("kembed, engine computing, one channel", computing_one))  # fmt: skip
    for name, f in shown:
        p99, last = f["p99_ms"]["median"], f["last_ms"]["median"]
        print(f"  burst, {name}: p99 {p99:.0f} ms, last {last:.0f} ms, codes {f['codes']}, "
              f"server {f['server_cpu_ms_per_call']:.2f} CPU ms/call")  # fmt: skip
    return {"echo": echo_figures, "kembed": idle, "computing": computing,
            "one_channel": {"echo": echo_one, "computing": computing_one},
            "settings": {"idle": idle_settings, "computing": computing_settings}}  # fmt: skip


def _rejecting_bursts(
    server: Server, request: bytes, opts: Options, senders: Senders, code: str | None = None
) -> dict[str, Any]:
    """Bursts against a kembed, with which admission rule said no and how many refusals were
    answered late for their client's refusal rate (from the server's own counters)."""
    before = server.metrics()
    figures = bursts(server, request, opts, senders, code)
    after = server.metrics()
    figures["server_rejections"] = deltas_by_label(before, after, Metric.REJECTED + "_total", "reason")
    figures["refusals_paced"] = metric_delta(before, after, Metric.REFUSALS_PACED + "_total")
    return figures


def retry_storm(opts: Options, texts: list[str]) -> dict[str, Any]:
    """Saturation with pushback-respecting clients, then a multiple of its calls/s offered by
    clients that retry every rejection ``retry_after_ms`` later until they give up; the real model,
    ``frontends=auto``; the clients ``client_nice`` below the server, in a process of their own."""
    requests = encode(texts, opts.storm_texts)
    with running(real_model(opts), log_file("storm"), module="kembed") as server:
        target = server.grpc_target
        saturate = {"target": target, "requests": requests, "concurrency": opts.storm_concurrency,
                    "duration": opts.storm_duration, "count": MAX_CALLS, "deadline": opts.timeout}  # fmt: skip
        saturation = phase_figures(server, lambda: niced(loadgen.closed_loop, saturate, opts), opts.storm_texts, opts,
                            opts.storm_duration)  # fmt: skip
        print(f"  retry storm: saturation {saturation['emb_per_s']['median']:.1f} emb/s")
        time.sleep(Settings.from_env({}).latency_window_s)  # the server's latency window forgets saturation
        rate = opts.storm_multiple * saturation["calls_per_s"]["median"]
        if not rate > 0:
            raise RuntimeError(f"retry storm: no call succeeded at saturation ({saturation['codes']})")
        flood = {"target": target, "requests": requests, "rate": rate, "duration": opts.storm_duration,
                 "count": MAX_CALLS, "seed": workload.SEED, "deadline": opts.timeout,
                 "retry_after": opts.retry_after_ms / 1000, "give_up": opts.give_up_s}  # fmt: skip
        outcomes: list[CallRecord] = []

        def storm_load() -> tuple[list[CallRecord], float]:
            attempts, cpu = niced(loadgen.open_loop, flood, opts)
            outcomes.extend(attempts)
            return attempts, cpu

        storm = phase_figures(server, storm_load, opts.storm_texts, opts, opts.storm_duration)
        storm["offered_calls_per_s"] = rate
        storm["give_ups"] = give_ups(outcomes, saturation["calls_per_s"]["median"], opts.give_up_s)
        print(f"  retry storm: {storm['emb_per_s']['median']:.1f} emb/s, codes {storm['codes']}, "
              f"gave up {storm['give_ups']}")  # fmt: skip
    return {"multiple": opts.storm_multiple, "client_nice": opts.client_nice, "saturation": saturation,
            "storm": storm}  # fmt: skip


def spikes(opts: Options, texts: list[str]) -> dict[str, Any]:
    """Saturation with one text a call (``spike_concurrency`` closed-loop callers over
    ``spike_channels`` channels), then each of ``spike_multiples`` times its calls/s offered open
    loop (Poisson, no retries) over the same channels, as a connection pool or a mesh sidecar
    sends: goodput over saturation, the accepted calls' p95 against the drain budget and the
    refusals' p99, latency counted from each call's scheduled arrival; the real model,
    ``frontends=auto``, the clients ``client_nice`` below the server."""
    requests = encode(texts, 1)
    budget_ms = Settings.from_env({}).max_drain_ms
    with running(real_model(opts), log_file("spikes"), module="kembed") as server:
        saturate = {"target": server.grpc_target, "requests": requests, "concurrency": opts.spike_concurrency,
                    "duration": opts.storm_duration, "count": MAX_CALLS, "deadline": opts.timeout,
                    "channels": opts.spike_channels}  # fmt: skip
        saturation = phase_figures(
            server, lambda: niced(loadgen.closed_loop, saturate, opts), 1, opts, opts.storm_duration
        )
        print(f"  spikes: saturation {saturation['emb_per_s']['median']:.1f} emb/s")
        loads = []
        for multiple in opts.spike_multiples:
            time.sleep(Settings.from_env({}).latency_window_s)  # the server's latency window forgets the last load
            loads.append(_spike(server, requests, multiple, saturation["calls_per_s"]["median"], opts))
    return {"channels": opts.spike_channels, "drain_budget_ms": budget_ms, "client_nice": opts.client_nice,
            "saturation": saturation, "loads": loads}  # fmt: skip


def _spike(server: Server, requests: list[bytes], multiple: float, saturation_calls: float, opts: Options
           ) -> dict[str, Any]:  # fmt: skip
    """One open-loop load at ``multiple`` times saturation's calls/s, with the refusals the server paced."""
    rate = multiple * saturation_calls
    spike = {"target": server.grpc_target, "requests": requests, "rate": rate, "duration": opts.storm_duration,
             "count": MAX_CALLS, "seed": workload.SEED, "deadline": opts.timeout,
             "channels": opts.spike_channels}  # fmt: skip
    before = server.metrics()
    load = phase_figures(server, lambda: niced(loadgen.open_loop, spike, opts), 1, opts, opts.storm_duration)
    load["refusals_paced"] = metric_delta(before, server.metrics(), Metric.REFUSALS_PACED + "_total")
    load["offered_x"], load["offered_calls_per_s"] = multiple, rate
    accepted, refused = load["latency_ms"]["p95"], load["rejection_latency_ms"]["p99"]
    print(f"  spikes: {multiple:g}x: {load['emb_per_s']['median']:.1f} emb/s, accepted p95 {accepted:.0f} ms, "
          f"refusals p99 {refused:.0f} ms")  # fmt: skip
    return load
