"""The host-path machinery in seconds: the echo yardstick, the multi-process load and the bursts,
and the arithmetic that judges kembed against the echo. kembed itself is never started here."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench import headline, run_all
from bench.serving.hostpath import deadlines, engine_bound, host_path, measure
from bench.tools import echo, loadgen, machine
from bench.tools.loadgen import OK, CallRecord
from bench.tools.report import Spread
from bench.tools.server import echo_running, process_tree
from kembed.v1 import embedder_pb2, embedder_pb2_grpc
from tests.server.serving import wait_until

EIGHT_TEXTS = embedder_pb2.EmbedRequest(texts=["a short text"] * 8).SerializeToString()


async def test_grpc_shares_a_port_by_default() -> None:
    """What echo (and kembed's front ends) rely on: grpc sets SO_REUSEPORT unless told not to."""
    first, second = grpc.aio.server(), grpc.aio.server()
    port = first.add_insecure_port("127.0.0.1:0")
    try:
        assert second.add_insecure_port(f"127.0.0.1:{port}") == port
        with pytest.raises(RuntimeError):
            grpc.aio.server(options=[("grpc.so_reuseport", 0)]).add_insecure_port(f"127.0.0.1:{port}")
    finally:
        await first.stop(None)
        await second.stop(None)


def test_echo_answers_kembed_sized_responses() -> None:
    reply = embedder_pb2.EmbedResponse.FromString(echo.response_bytes(8))
    assert (reply.count, reply.dimensions, len(reply.embeddings)) == (8, 384, 8 * 384 * 4)
    assert echo.response_bytes(8) is echo.response_bytes(8)  # precomputed


def _kwargs(target: str, **extra: Any) -> list[dict[str, Any]]:
    return [{"target": target, "deadline": 10, "channels": 2, **extra}] * 2


@pytest.mark.process
async def test_two_echo_processes_answer_the_multiprocess_load_and_bursts(tmp_path: Path) -> None:
    with echo_running(2, tmp_path / "echo.log") as server:
        assert len(process_tree(server.pid)) >= 3  # the parent and both echo processes
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            reply = await embedder_pb2_grpc.EmbedderStub(channel).Embed(embedder_pb2.EmbedRequest(texts=["x", "y"]))
        assert (reply.count, len(reply.embeddings)) == (2, 2 * 384 * 4)
        load = _kwargs(server.grpc_target, requests=[EIGHT_TEXTS], concurrency=4, duration=5, count=150)
        parts, client_cpu = loadgen.in_processes(loadgen.closed_loop, load)
        bursts, _ = loadgen.in_processes(
            loadgen.burst, _kwargs(server.grpc_target, request=EIGHT_TEXTS, calls=40, rounds=2)
        )
    assert [len(p) for p in parts] == [150, 150]  # the count bound, in each process
    assert {o.code for p in parts for o in p} == {OK}
    assert client_cpu > 0
    assert [[len(r) for r in p] for p in bursts] == [[40, 40], [40, 40]]
    figures = measure.burst_figures([[o for p in bursts for o in p[r]] for r in range(2)])
    assert figures["calls"] == 160
    assert figures["codes"] == {OK: 160}
    assert figures["rejected_share"] == 0
    assert 0 < figures["p99_ms"]["median"] <= figures["last_ms"]["median"]  # an order, not a time bound


def _outcome(done: float, code: str = OK) -> CallRecord:
    return CallRecord(item=0, scheduled=0.0, sent=0.0, done=done, code=code)


def test_burst_figures_per_round() -> None:
    rounds = [[_outcome(t / 100, measure.EXHAUSTED) for t in range(1, 101)], [_outcome(0.5), _outcome(2.0)]]
    figures = measure.burst_figures(rounds)
    assert figures["last_ms"] == Spread(1500.0, 1000.0, 2000.0).to_dict()
    assert figures["p99_ms"]["lo"] == pytest.approx(990.1)  # 10 ms .. 1000 ms: rank 98.01 of 0..99
    assert figures["rejected_share"] == pytest.approx(100 / 102)
    assert figures["codes"] == {measure.EXHAUSTED: 100, OK: 2}


def test_split_shares_out_every_call() -> None:
    assert loadgen.split(600, 2) == [300, 300]
    assert loadgen.split(7, 3) == [3, 2, 2]


def _spread(value: float) -> dict[str, float]:
    return Spread(value, value, value).to_dict()


def _result(zero_cost: float, p99_kembed: float, storm: float) -> dict[str, Any]:
    def closed(calls: float) -> dict[str, Any]:
        return {"calls_per_s": _spread(calls), "latency_ms": {"p99": 5.0}, "codes": {OK: 10}, "peak_rss_mib": 50,
                "server_cpu_ms_per_call": 1000 / calls}  # fmt: skip

    def burst(p99: float, share: float) -> dict[str, Any]:
        return {"p99_ms": _spread(p99), "last_ms": _spread(p99 * 1.1), "server_cpu_ms_per_call": p99 / 100,
                "rejected_share": share, "codes": {}, "peak_rss_mib": 60}  # fmt: skip

    def storm_phase(emb: float) -> dict[str, Any]:
        return {"emb_per_s": _spread(emb), "offered_calls_per_s": 4.0, "codes": {OK: 3}, "peak_rss_mib": 700}

    settings = {"client_processes": 2, "concurrency": 32, "burst_rounds": 3, "burst_calls": 600, "burst_texts": 8,
                "storm_texts": 64, "retry_after_ms": 20.0}  # fmt: skip
    return {
        "settings": settings,
        "host_path": [
            {"processes": 1, "echo": closed(4000), "zero_cost": closed(zero_cost)},
            {"processes": 2, "echo": closed(8000), "zero_cost": closed(2000)},
        ],
        "rejection": {
            "echo": burst(400, 0.0),
            "kembed": burst(p99_kembed, 1.0),
            "computing": burst(600, 0.97),
            "one_channel": {"echo": burst(300, 0.0), "computing": burst(900, 0.97)},
        },
        "retry_storm": {"multiple": 4.0, "saturation": storm_phase(100), "storm": storm_phase(storm)},
    }


def test_hostpath_ratios_and_targets() -> None:
    rows = {r.name: r for r in headline.hostpath_ratios(_result(zero_cost=2400, p99_kembed=1000, storm=95))}
    one, two = (
        rows["Host path, 1 process(es): zero-cost server / echo (calls/s)"],
        rows["Host path, 2 process(es): zero-cost server / echo (calls/s)"],
    )
    assert (one.value.median, one.met()) == (pytest.approx(0.6), True)
    assert (two.value.median, two.met()) == (0.25, None)  # informative: the target is for one front end
    cpu = rows["Host path, 1 process(es): zero-cost server / echo, server CPU per call"]
    assert (cpu.value.median, cpu.met()) == (pytest.approx(4000 / 2400), None)
    p99 = rows["Rejected burst / echo burst, p99"]
    assert (p99.value.median, p99.met()) == (2.5, False)
    assert rows["Rejected burst / echo burst, time to last answer"].value.median == pytest.approx(2.5)
    assert rows["Rejected burst / echo burst, server CPU per call"].value.median == pytest.approx(2.5)
    assert rows["Share of the rejected burst answered RESOURCE_EXHAUSTED"].met() is True
    computing = rows["Rejections while the engine computes / echo burst, p99"]
    assert (computing.value.median, computing.met()) == (1.5, True)
    one = rows["Rejections while the engine computes, one channel / echo burst, p99"]
    assert (one.value.median, one.met()) == (3.0, False)  # against the echo's burst on one channel
    storm = rows["Goodput, 4x retry storm / saturation (emb/s)"]
    assert (storm.value.median, storm.met()) == (pytest.approx(0.95), True)
    missed = {r.name: r.met() for r in headline.hostpath_ratios(_result(zero_cost=1000, p99_kembed=800, storm=80))}
    assert missed["Host path, 1 process(es): zero-cost server / echo (calls/s)"] is False
    assert missed["Rejected burst / echo burst, p99"] is True  # exactly 2x is within the target
    assert missed["Goodput, 4x retry storm / saturation (emb/s)"] is False


def _spikes(goodput_4x: float, refusal_p99_2x: float, accepted_p95_ms: float) -> dict[str, Any]:
    def load(x: float, emb: float, p99: float) -> dict[str, Any]:
        return {"offered_x": x, "emb_per_s": _spread(emb), "latency_ms": {"p95": accepted_p95_ms},
                "rejection_latency_ms": {"p99": p99}}  # fmt: skip

    return {"channels": 4, "drain_budget_ms": 2000, "saturation": {"emb_per_s": _spread(100)},
            "loads": [load(2.0, 95, refusal_p99_2x), load(4.0, 100 * goodput_4x, math.nan)]}  # fmt: skip


def test_spikes_and_short_deadlines_are_judged_against_their_targets() -> None:
    deadlines = {"exported_p95_ms": _spread(31.0), "served_p95_ms": 1137.0}
    result = {"spikes": _spikes(0.8, 90, 1900), "short_deadlines": deadlines}
    rows = {r.name: r for r in headline.hostpath_ratios(result)}
    two, four = "Open-loop 2x, 1 text a call, 4 channels", "Open-loop 4x, 1 text a call, 4 channels"
    goodput = rows[f"{two}: goodput / saturation (emb/s)"]
    assert (goodput.value.median, goodput.met()) == (pytest.approx(0.95), True)
    assert rows[f"{four}: goodput / saturation (emb/s)"].met() is False  # 0.8 against 0.85
    assert rows[f"{two}: refusals p99 (ms)"].met() is True
    assert rows[f"{four}: refusals p99 (ms)"].value.median == 0.0  # none refused: none late
    assert rows[f"{two}: accepted p95 / drain budget"].value.median == pytest.approx(0.95)
    exported = rows["Exported P95 beside 30 ms callers vs the served callers' p95 (larger / smaller)"]
    assert (exported.value.median, exported.met()) == (pytest.approx(1137 / 31), False)  # the figures
    late = {r.name: r.met() for r in headline.hostpath_ratios({"spikes": _spikes(0.9, 300, 2500)})}
    assert late[f"{two}: refusals p99 (ms)"] is False
    assert late[f"{two}: accepted p95 / drain budget"] is False


def test_hostpath_table_and_partial_results() -> None:
    table = headline.hostpath_table(_result(zero_cost=2400, p99_kembed=1000, storm=95))
    # header rule, host path, rejection (echo, idle, computing; echo and computing on one channel), storm
    assert table.count("\n") == 1 + 4 + 3 + 2 + 2
    assert "zero-cost kembed, 1 proc" in table
    only_host_path = {"settings": _result(1, 1, 1)["settings"], "host_path": _result(2400, 1, 1)["host_path"]}
    assert len(headline.hostpath_ratios(only_host_path)) == 4
    assert math.isclose(headline.hostpath_ratios(only_host_path)[0].value.median, 0.6)


def _serve(device: str, emb_1: float, p95_1: float, emb_16: float, busy: float) -> dict[str, Any]:
    def load(n: int, emb: float, p95: float) -> dict[str, Any]:
        return {"texts_per_call": n, "emb_per_s": _spread(emb), "latency_ms": {"p95": p95}, "codes": {OK: 10},
                "peak_rss_mib": 900, "gpu_busy_pct": {"samples": 16, "mean": busy, "median": busy}}  # fmt: skip

    return {
        "settings": {"frontends": "auto"},
        "info": {"device": device},
        "ceiling": {"batching": "bucketed", "compiled": True, "emb_per_s": _spread(40_000)},
        "loads": [load(1, emb_1, p95_1), load(16, emb_16, 300.0)],
    }


def test_serve_rows_judge_the_gpu_targets_only_on_cuda() -> None:
    rows = {r.name: r for r in headline.serve_ratios(_serve("cuda:0", 16_000, 80.0, 24_000, 45.0))}
    assert rows["Serving, 1 text a call: emb/s"].met() is True
    assert rows["Serving, 1 text a call: accepted p95 (ms)"].met() is True
    assert rows["Serving, 16 texts a call: emb/s"].met() is False
    share = rows["Serving, 16 texts a call / in-process ceiling, compiled bucketed (emb/s)"]
    assert (share.value.median, share.met()) == (pytest.approx(0.6), True)
    assert rows["Serving, 1 text a call / in-process ceiling, compiled bucketed (emb/s)"].met() is None
    assert rows["Serving, 16 texts a call: accepted p95 (ms)"].met() is None  # no latency target at 16
    assert rows["Serving, 1 text a call: GPU busy (nvidia-smi)"].value.median == pytest.approx(0.45)
    assert rows["Serving, 1 text a call: GPU busy (nvidia-smi)"].met() is False
    on_cpu = headline.serve_ratios(_serve("cpu", 100, 900.0, 200, 0.0))
    assert {r.met() for r in on_cpu} == {None}  # the targets are the GPU's
    table = headline.hostpath_table({"settings": _result(1, 1, 1)["settings"], "serve": _serve("cuda:0", 1, 1, 1, 50)})
    assert table.count("serving") == 2


def test_gpu_busy_summary_keeps_the_readings_in_the_window() -> None:
    readings = [(1.0, 0.0), (2.0, 60.0), (3.0, 80.0), (4.0, 100.0)]
    assert machine.busy_summary(readings, 1.5, 3.5) == {"samples": 2, "mean": 70.0, "median": 70.0}
    assert machine.busy_summary(readings)["samples"] == 4
    assert machine.busy_summary([])["samples"] == 0


def test_burst_figures_of_one_code() -> None:
    rounds = [[_outcome(0.1, measure.EXHAUSTED), _outcome(5.0)], [_outcome(0.2, measure.EXHAUSTED)]]
    figures = measure.burst_figures(rounds, measure.EXHAUSTED)
    assert figures["last_ms"] == Spread(150.0, 100.0, 200.0).to_dict()  # the OK answer's 5 s left out
    assert figures["calls"] == 3


def test_give_ups_against_the_fewest_possible() -> None:
    attempts = [
        CallRecord(item=0, scheduled=0.0, sent=0.0, done=0.1, code=measure.EXHAUSTED),
        CallRecord(item=0, scheduled=0.11, sent=0.11, done=0.2, code=OK),  # retried, then answered
        CallRecord(item=1, scheduled=1.0, sent=1.0, done=1.1, code=measure.EXHAUSTED),
        CallRecord(item=1, scheduled=1.2, sent=1.2, done=1.3, code=measure.EXHAUSTED),  # gave up
    ]
    # Arrivals over 1 s, give-ups 9 s later: 0.1 calls/s serves 1 of the 2 calls within 10 s.
    assert deadlines.give_ups(attempts, capacity_calls_per_s=0.1, give_up_s=9) == {
        "calls": 2,
        "gave_up": 1,
        "fewest_possible": 1,
    }


def _rest(rest_calls: float, kembed_calls: float | None) -> dict[str, Any]:
    def loop(calls: float, code: str) -> dict[str, Any]:
        return {"calls_per_s": _spread(calls), "latency_ms": {"p99": 5.0}, "codes": {code: 10}, "peak_rss_mib": 50,
                "server_cpu_ms_per_call": 1000 / calls}  # fmt: skip

    host = {"settings": {"frontends": "1"}, "grpc": loop(4000, OK), "rest": loop(rest_calls, "200")}
    peer: dict[str, Any]
    if kembed_calls is None:
        peer = {
            "skipped": "no Infinity in /nowhere",
            "setup_command": "python -m bench.serving.peers setup --venv /nowhere",
        }
    else:
        peer = {"peer": "infinity-emb 0.0.78", "settings": {"frontends": "auto"}, "infinity": loop(200, "200"),
                "kembed": loop(kembed_calls, "200")}  # fmt: skip
    settings = {**_result(1, 1, 1)["settings"], "peer_duration": 20.0}
    return {"settings": settings, "rest": {"host_path": host, "peer": peer}}


def test_rest_ratios_against_grpc_and_the_peer() -> None:
    rows = {r.name: r for r in headline.hostpath_ratios(_rest(rest_calls=3400, kembed_calls=450))}
    grpc = rows["REST / gRPC, zero-cost server, 1 front end (calls/s)"]
    assert (grpc.value.median, grpc.met()) == (pytest.approx(0.85), True)
    cpu = rows["REST / gRPC, zero-cost server, 1 front end, server CPU per call"]
    assert (cpu.value.median, cpu.met()) == (pytest.approx(4000 / 3400), None)
    peer = rows["REST, real model: kembed / infinity-emb 0.0.78 (calls/s)"]
    assert (peer.value.median, peer.met()) == (pytest.approx(2.25), False)
    missed = {r.name: r.met() for r in headline.hostpath_ratios(_rest(rest_calls=3000, kembed_calls=499))}
    assert missed["REST / gRPC, zero-cost server, 1 front end (calls/s)"] is False
    assert missed["REST, real model: kembed / infinity-emb 0.0.78 (calls/s)"] is False
    exactly = {r.name: r.met() for r in headline.hostpath_ratios(_rest(rest_calls=3200, kembed_calls=500))}
    assert set(exactly.values()) == {True, None}  # 0.8 and 2.5x are within the targets


def test_rest_rows_without_the_peer_say_why_and_how_to_set_it_up() -> None:
    skipped = _rest(rest_calls=3400, kembed_calls=None)
    assert [r.name for r in headline.hostpath_ratios(skipped)] == [
        "REST / gRPC, zero-cost server, 1 front end (calls/s)",
        "REST / gRPC, zero-cost server, 1 front end, server CPU per call",
    ]
    table = headline.hostpath_table(skipped)
    assert table.count("\n") == 1 + 3  # header rule; gRPC, REST and the skipped peer
    assert "REST closed loop, 2 x 32 connections, 1 text" in table
    assert "skipped: no Infinity in /nowhere (`python -m bench.serving.peers setup --venv /nowhere`)" in table
    ran = headline.hostpath_table(_rest(rest_calls=3400, kembed_calls=450))
    assert "| REST, real model | infinity-emb 0.0.78 | REST closed loop, 2 x 32 connections, 1 text, 20 s |" in ran
    assert "| REST, real model | kembed, frontends=auto |" in ran


def test_the_peer_is_skipped_without_its_venv(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv"
    opts = measure.parse_options(["--parts", "rest", "--peer-venv", str(missing)])
    assert host_path.rest_peer(opts, ["a short text"]) == {
        "skipped": f"no Infinity in {missing}",
        "setup_command": f"python -m bench.serving.peers setup --venv {missing}",
    }
    assert not missing.exists()  # nothing installed


def test_make_bench_runs_the_rest_part_and_its_flags_parse() -> None:
    assert "rest" in measure.parse_options(run_all.HOSTPATH).parts
    quick = measure.parse_options(run_all.QUICK_HOSTPATH)
    assert "rest" in quick.parts
    assert quick.peer_duration > quick.warmup


@pytest.mark.process
def test_spinners_stay_on_their_cpu_and_end_with_the_block() -> None:
    """What part ``engine_bound`` starves the engine's loop with."""
    cpu = max(os.sched_getaffinity(0))
    with engine_bound.spinning(2, {cpu}) as spinners:
        assert len(spinners) == 2
        # A child shows its own command line once it has exec'd, which a loaded machine delays.
        wait_until(lambda: all(engine_bound.SPIN.encode() in _cmdline(pid) for pid in spinners), 60, "spinners")
        assert all(os.sched_getaffinity(pid) == {cpu} for pid in spinners)
    assert not any(Path(f"/proc/{pid}").exists() for pid in spinners)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
