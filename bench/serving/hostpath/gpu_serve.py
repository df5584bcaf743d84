"""Part ``serve``: the GPU targets' load (real model, ``KEMBED_FRONTENDS=auto``, 1 and 16 texts a
call), judged against an in-process ceiling, the GPU's busy share beside it."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import RESULTS_DIR
from bench.serving.hostpath.measure import (
    Options,
    counter_figures,
    encode,
    frontends_setting,
    grpc_closed_loop,
    log_file,
)
from bench.tools import machine
from bench.tools.server import Server, process_tree, running
from kembed.config.settings import Settings
from kembed.contract import env_name


def serve(opts: Options, texts: list[str]) -> dict[str, Any]:
    """The real model, ``frontends=auto``, one server for every load: the closed loop at each of
    ``serve_texts`` texts a call, with the server's counters and GPU busy over each load."""
    settings = {**frontends_setting("auto"), **dict(kv.split("=", 1) for kv in opts.serve_env)}
    window_s = Settings.from_env({env_name(k): v for k, v in settings.items()}).latency_window_s
    ceiling = ceiling_reference(opts.serve_ceiling)
    loads = []
    with running(settings, log_file("serve"), module="kembed", start_timeout=opts.serve_start_timeout) as server:
        info = server.info()
        print(f"  serve: {info.get('modelId')} on {info.get('device')} ({info.get('dtype')}), {settings}")
        for i, n in enumerate(opts.serve_texts):
            if i:
                time.sleep(window_s)  # the server's latency window forgets the last load
            before = server.metrics()
            with machine.gpu_busy() as busy:
                figures = grpc_closed_loop(server, encode(texts, n), opts, n)
                ended = time.monotonic()
            # GPU busy over the load's last (duration - warmup) s: client start-up and warm-up left out.
            steady = machine.busy_summary(busy, ended - (opts.duration - opts.warmup), ended)
            figures.update(texts_per_call=n, gpu_busy_pct=steady, gpu_busy_pct_whole_load=machine.busy_summary(busy))
            figures.update(counter_figures(before, server.metrics(), figures["span_s"]))
            loads.append(figures)
            print(f"  serve, {n} text(s) a call: {figures['emb_per_s']['median']:.0f} emb/s, "
                  f"p95 {figures['latency_ms']['p95']:.0f} ms, GPU busy {figures['gpu_busy_pct']['mean']:.0f}%, "
                  f"codes {figures['codes']}")  # fmt: skip
        profile = None
        if opts.py_spy_seconds > 0:
            time.sleep(window_s)
            profile = _profiled(server, encode(texts, 1), opts)
    return {"settings": settings, "info": info, "ceiling": ceiling, "loads": loads, "py_spy": profile}


def ceiling_reference(name: str) -> dict[str, Any] | None:
    """The in-process ceiling the serve loads are judged against, from ``bench/results/<name>.json``:
    its ``sorted`` batching, or ``bucketed`` when compiled, with when and on what it ran."""
    if not name:
        return None
    result = machine.read_result(name)
    if result is None:
        print(f"  serve: no {RESULTS_DIR / name}.json; the loads are not judged against a ceiling")
        return None
    batching = "sorted" if "sorted" in result else "bucketed"
    ran = result["machine"]
    return {"name": name, "batching": batching, "compiled": bool(result.get("compiled")),
            "emb_per_s": result[batching]["emb_per_s"], "time_utc": ran["time_utc"], "gpu": ran["gpu"],
            "torch": ran["torch"]}  # fmt: skip


def _profiled(server: Server, requests: list[bytes], opts: Options) -> dict[str, Any]:
    """One more 1-text load, not judged, with ``py-spy record`` (raw collapsed stacks, per thread,
    non-blocking) on each server process for ``py_spy_seconds``, started as the clients start."""
    exe = shutil.which("py-spy")
    if exe is None:
        print("  serve: no py-spy on PATH; not profiled")
        return {"error": "no py-spy on PATH"}
    seconds = str(max(1, round(opts.py_spy_seconds)))
    spies = []
    for pid in process_tree(server.pid):
        out = RESULTS_DIR / f"pyspy_{pid}.txt"
        argv = [exe, "record", "--pid", str(pid), "--duration", seconds, "--threads", "--nonblocking",
                "--format", "raw", "--output", str(out)]  # fmt: skip
        spies.append((pid, out, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    figures = grpc_closed_loop(server, requests, opts)
    processes = []
    for pid, out, spy in spies:
        try:
            _, err = spy.communicate(timeout=opts.py_spy_seconds + 30)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
        processes.append({"pid": pid, "cmdline": _cmdline(pid), "file": out.name if out.exists() else None,
                          "exit": spy.returncode, "stderr": err.decode(errors="replace")[-400:]})  # fmt: skip
    print(f"  serve, profiled: {sum(p['file'] is not None for p in processes)} of {len(processes)} processes recorded")
    return {"load": figures, "processes": processes}


def _cmdline(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")).strip()
    except OSError:
        return ""
