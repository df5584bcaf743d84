"""What a result was measured on, stored with every JSON so figures are never compared blind."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench import RESULTS_DIR
from bench.tools.report import Ratio, ratio_table
from kembed.engine.precision import bf16_units, cpu_flags

# The vector and matrix units a CPU's forward pass may use (x86, then Arm), recorded where present.
MATH_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
              "amx_int8", "asimd", "sve", "bf16", "i8mm")  # fmt: skip


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def describe() -> dict[str, Any]:
    """CPU, cores, memory, GPU, software versions, and the load average (a noisy-machine flag)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpu_bf16_flags": list(bf16_units()),  # none: bf16 runs emulated here, slower than fp32
        "cpu_flags": [flag for flag in MATH_FLAGS if flag in cpu_flags()],
        "cores": os.cpu_count(),
        "memory_gib": round(_memory_gib(), 1),
        "gpu": gpu,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "git": _git_commit(),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


@contextlib.contextmanager
def gpu_busy(interval_s: float = 0.5) -> Iterator[list[tuple[float, float]]]:
    """(``time.monotonic()``, GPU 0's ``utilization.gpu``) readings every ``interval_s`` while the
    block runs: the percent of the driver's last sample period in which a kernel ran, as nvidia-smi
    reports it. One query per reading, in a thread: a looping nvidia-smi block-buffers into a pipe
    and loses what it holds when stopped. Empty where there is no nvidia-smi."""
    samples: list[tuple[float, float]] = []
    exe = shutil.which("nvidia-smi")
    if exe is None:
        yield samples
        return
    query = [exe, "--id=0", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError, IndexError):
                done = subprocess.run(query, capture_output=True, text=True, timeout=5, check=True)
                samples.append((time.monotonic(), float(done.stdout.split()[0])))

    thread = threading.Thread(target=sample, name="gpu-busy", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(10)


def busy_summary(
    samples: list[tuple[float, float]], start: float = -math.inf, end: float = math.inf
) -> dict[str, float]:
    """Mean and median (percent) of the ``gpu_busy`` readings taken within [start, end], and how many."""
    values = [pct for t, pct in samples if start <= t <= end]
    if not values:
        return {"samples": 0, "mean": math.nan, "median": math.nan}
    return {"samples": len(values), "mean": statistics.fmean(values), "median": statistics.median(values)}


def write_result(name: str, result: dict[str, Any]) -> Path:
    """``bench/results/<name>.json`` with the machine's description attached."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": describe(), **result}, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def write_judged(name: str, result: dict[str, Any], rows: list[Ratio], workload: dict[str, Any]) -> None:
    """A benchmark's result with its judged ratios and its workload, written; the ratios printed."""
    result["ratios"] = [{"name": r.name, "value": r.value.to_dict(), "target": r.target, "met": r.met()} for r in rows]
    result["workload"] = workload
    write_result(name, result)
    print(ratio_table(rows))


def read_result(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None
