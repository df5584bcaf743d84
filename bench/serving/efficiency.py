"""Where the server's CPU goes, against the model's own (issue 56).

For each model (the bundled MiniLM, and the stand-in for fast compute: ``bench.tools.standin``, its
first two layers) and each load (closed-loop gRPC callers of one text, 32 and 128, and of 16 texts):

1. the model's own CPU per embedding in one process (``bench.compute.own_cost``, run apart before
   the server starts): eager and compiled in the server's lanes, and sentence-transformers' encode,
   each at its best dtype;
2. a real server (``python -m kembed``, default settings, once its forward is chosen for good): the
   load's emb/s, the server's CPU per embedding by process (``/proc``, the load generator's never
   counted), rows a batch and the padding share from the server's counters;
3. the same load again under py-spy (``bench.tools.cpu_account``): the process CPU of (2) split by
   stage (parse, tokenize, screen and admission, link, engine loop, batch formation, forward,
   pooling, answer, the runtimes).

Judged: served CPU per embedding over the model's own (target <= 1.25), emb/s over
sentence-transformers' encode (target >= 1.1), 32 callers of one text. Writes
``bench/results/efficiency.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from bench import RESULTS_DIR, headline
from bench.serving import efficiency_plot
from bench.tools import loadgen, machine, workload
from bench.tools.cpu_account import Accounted, CpuSnapshot, Proc, account, sample_stages, server_processes
from bench.tools.loadgen import OK, CallRecord
from bench.tools.report import Spread, latency_summary, metric_delta, padding_ratio, server_tokens, window_rates
from bench.tools.server import Server, running
from bench.tools.standin import standin_model
from kembed.contract import Metric
from kembed.v1 import embedder_pb2

MAX_CALLS = 1_000_000
DEADLINE_S = 30.0
# Ready and its forward chosen for good: the compile beside serving waits up to 5 minutes for spare
# CPU on a busy machine, then compiles.
START_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Load:
    texts: int  # a call's
    callers: int

    @property
    def name(self) -> str:
        return f"{self.texts}x{self.callers}"

    @classmethod
    def parse(cls, spec: str) -> Load:
        texts, callers = spec.split("x")
        return cls(int(texts), int(callers))


REFUSED = Load(1, 32)  # the refusals' load: one-text callers, as the served load it is judged against


@dataclass(frozen=True)
class Options:
    models: tuple[str, ...]
    loads: tuple[Load, ...]
    duration: float
    warmup: float
    profile_s: float
    client_processes: int
    channels: int
    passes: int
    env: tuple[str, ...]
    name: str


def model_dir(name: str) -> str:
    return "" if name == "bundled" else str(standin_model()) if name == "standin" else name


def own_cost(model: str, passes: int) -> dict[str, Any]:
    """``bench.compute.own_cost`` in a process of its own (torch's threads and caches stay there)."""
    argv = [sys.executable, "-m", "bench.compute.own_cost", "--model", model, "--passes", str(passes)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def requests_of(texts: list[str], per_call: int) -> list[bytes]:
    calls = max(1, len(texts) // per_call)
    return [
        embedder_pb2.EmbedRequest(texts=texts[i * per_call : (i + 1) * per_call], truncate=True).SerializeToString()
        for i in range(calls)
    ]


def closed_loop(
    server: Server, requests: list[bytes], load: Load, opts: Options, duration: float, pushback: bool = True
) -> list[CallRecord]:
    processes = min(opts.client_processes, load.callers)
    kwargs = [
        {"target": server.grpc_target, "requests": requests, "concurrency": callers, "duration": duration,
         "count": MAX_CALLS, "deadline": DEADLINE_S, "channels": opts.channels, "pushback": pushback}
        for callers in loadgen.split(load.callers, processes)
    ]  # fmt: skip
    results, _ = loadgen.in_processes(loadgen.closed_loop, kwargs)
    return [o for r in results for o in r]


def measure_load(
    server: Server, procs: list[Proc], load: Load, texts: list[str], opts: Options, pushback: bool = True
) -> dict[str, Any]:
    """``load`` (its callers waiting out each refusal's pushback, or not) measured, then profiled."""
    requests = requests_of(texts, load.texts)
    closed_loop(server, requests, load, opts, opts.warmup, pushback)  # settle: lanes busy, frames flowing
    before, metrics_before = CpuSnapshot.take(procs), server.metrics()
    outcomes = closed_loop(server, requests, load, opts, opts.duration, pushback)
    after, metrics_after = CpuSnapshot.take(procs), server.metrics()
    samples: dict[int, Any] = {}
    sampler = threading.Thread(target=lambda: samples.update(sample_stages(procs, opts.profile_s)))
    threading.Timer(1.0, sampler.start).start()  # past the profiled load's ramp
    closed_loop(server, requests, load, opts, opts.profile_s + 2.0, pushback)
    time.sleep(1.5)
    sampler.join()
    accounted = account(procs, before, after, samples)
    return _figures(outcomes, load, opts, (metrics_before, metrics_after), accounted)


def _figures(
    outcomes: list[CallRecord], load: Load, opts: Options, metrics: tuple[Any, Any], accounted: dict[str, Accounted]
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.code == OK]
    embeddings = len(ok) * load.texts
    rates = window_rates([o.done for o in ok], [float(load.texts)] * len(ok), 0.0, opts.duration, 4)
    by_process = {role: sum(a.stages.values()) for role, a in accounted.items()}
    by_stage: dict[str, float] = {}
    for role_stages in (a.stages for a in accounted.values()):
        for stage, seconds in role_stages.items():
            by_stage[stage] = by_stage.get(stage, 0.0) + seconds
    by_thread = {f"{role}: {name}": s for role, a in accounted.items() for name, s in a.threads.items()}
    before, after = metrics
    real, padding = server_tokens(before, after)
    batches = metric_delta(before, after, Metric.BATCH_SIZE + "_count")
    return {
        "load": load.name,
        "calls": len(outcomes),
        "codes": dict(Counter(o.code for o in outcomes)),
        "emb_per_s": Spread.of(rates).to_dict(),
        "latency_ms": latency_summary([o.latency for o in ok]),
        "calls_per_s": len(outcomes) / opts.duration,
        "server_cores": sum(by_process.values()) / opts.duration,
        "server_cpu_ms_per_emb": _per(sum(by_process.values()), embeddings),
        "server_cpu_ms_per_call": _per(sum(by_process.values()), len(outcomes)),
        "cpu_ms_per_emb_by_process": {role: _per(s, embeddings) for role, s in by_process.items()},
        "cpu_ms_per_call_by_process": {role: _per(s, len(outcomes)) for role, s in by_process.items()},
        "cpu_ms_per_call_by_thread": {k: _per(v, len(outcomes)) for k, v in by_thread.items()},
        "cpu_ms_per_call_by_stage": {
            k: _per(v, len(outcomes)) for k, v in sorted(by_stage.items(), key=lambda kv: -kv[1])
        },
        "rows_per_batch": metric_delta(before, after, Metric.BATCH_SIZE + "_sum") / batches if batches else 0.0,
        "padding_share": padding_ratio(real, padding),
    }


def _per(seconds: float, count: int) -> float:
    """Milliseconds of ``seconds`` per one of ``count``."""
    return seconds * 1000 / count if count else float("nan")


def run_model(name: str, opts: Options, texts: list[str]) -> dict[str, Any]:
    model = model_dir(name)
    print(f"efficiency, {name}: the model's own cost in one process")
    own = own_cost(model, opts.passes)
    settings = dict(s.split("=", 1) for s in opts.env) | ({"model": model} if model else {})
    log = RESULTS_DIR / f"efficiency_{name}.log"
    loads = []
    with running(settings, log, start_timeout=START_TIMEOUT_S) as server:
        served = server.served()
        procs = server_processes(server.pid)
        for load in opts.loads:
            figures = measure_load(server, procs, load, texts, opts)
            figures["cpu_over_own"] = figures["server_cpu_ms_per_emb"] / own["own"]["cpu_ms_per_emb"]
            figures["emb_per_s_over_st_encode"] = figures["emb_per_s"]["median"] / own["st_encode"]["emb_per_s"]
            print(f"  {load.name}: {figures['emb_per_s']['median']:.0f} emb/s, "
                  f"{figures['server_cpu_ms_per_emb']:.2f} ms CPU/emb ({figures['cpu_over_own']:.2f}x own), "
                  f"{figures['rows_per_batch']:.1f} rows/batch")  # fmt: skip
            loads.append(figures)
    refusals = measure_refusals(settings, name, opts, texts)
    projection = headline.gpu_projection({"loads": loads})
    for row in projection:
        print(f"  a 16-core GPU host at this CPU's speed, {row['load']}: {row['calls_per_s']:.0f} calls/s, "
              f"{row['emb_per_s']:.0f} emb/s, bound by the {row['bound_by']}")  # fmt: skip
    served_fe = _frontend_ms(loads[0]["cpu_ms_per_call_by_process"])
    refusals["frontend_over_served_call"] = _frontend_ms(refusals["cpu_ms_per_call_by_process"]) / served_fe
    print(f"  refusals: {refusals['frontend_over_served_call']:.2f}x a served {loads[0]['load']} call's front-end CPU")
    return {"model": name, "own": own, "served": served, "settings": settings, "loads": loads, "refusals": refusals,
            "gpu_projection": projection}  # fmt: skip


def measure_refusals(settings: dict[str, str], name: str, opts: Options, texts: list[str]) -> dict[str, Any]:
    """A server that refuses every call at its pre-screen (its queue holds one token), under
    closed-loop callers of one text who ignore the pushback: what a refusal costs. Its forward is
    never used, so it is not compiled."""
    log = RESULTS_DIR / f"efficiency_{name}_refusing.log"
    with running(
        {**settings, "max_queued_tokens": "1", "compile": "off"}, log, start_timeout=START_TIMEOUT_S
    ) as server:
        return measure_load(server, server_processes(server.pid), REFUSED, texts, opts, pushback=False)


def _frontend_ms(by_process: dict[str, float]) -> float:
    return sum(ms for role, ms in by_process.items() if role.startswith("frontend"))


def parse_args() -> Options:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bundled,standin", help="bundled, standin, or a model folder")
    parser.add_argument("--loads", default="1x32,1x128,16x16", help="TEXTSxCALLERS, comma-separated")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of the measured load")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds of load before it")
    parser.add_argument("--profile-s", type=float, default=6.0, help="seconds py-spy samples (a load of its own)")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--channels", type=int, default=4, help="per client process")
    parser.add_argument("--passes", type=int, default=3, help="in-process passes of each contender")
    parser.add_argument("--env", action="append", default=[], metavar="SETTING=VALUE")
    parser.add_argument("--name", default="efficiency")
    a = parser.parse_args()
    return Options(
        tuple(a.models.split(",")), tuple(Load.parse(s) for s in a.loads.split(",")), a.duration, a.warmup,
        a.profile_s, a.client_processes, a.channels, a.passes, tuple(a.env), a.name,
    )  # fmt: skip


def main() -> None:
    opts = parse_args()
    wl = workload.load()
    models = [run_model(name, opts, wl.texts) for name in opts.models]
    result = {"options": {**opts.__dict__, "loads": [load.name for load in opts.loads]}, "models": models}
    machine.write_judged(opts.name, result, headline.efficiency_ratios(result), wl.describe())
    efficiency_plot.plot({"machine": machine.describe(), **result}, RESULTS_DIR / f"{opts.name}.png")


if __name__ == "__main__":
    main()
