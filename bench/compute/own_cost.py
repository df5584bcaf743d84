"""The model's own CPU per embedding, in one process, no server: what serving's CPU is judged against.

On the workload's texts, at each contender's best:
- ``eager`` and ``compiled``: kembed's model (the server's ``EmbeddingModel``, in the dtype the server
  chooses) on every text sorted by token count and packed under the server's limits, computed in
  the server's lanes (each at a lane's threads); compiled through the server's CPU compile, its cold
  compile untimed;
- ``st_encode``: sentence-transformers' own ``encode`` (batch 32, its own length sort, tokenizing
  included), in fp32 and, where the CPU has bf16 units, in bf16; the faster is kept.

Each is timed over whole passes by the wall clock and by the process's CPU clock (every thread), its
passes interleaved with the others'. ``own``: the least CPU per embedding of eager and compiled.

``python -m bench.compute.own_cost --model DIR`` prints the JSON (``bench.serving.efficiency`` runs it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bench.compute import inprocess
from bench.compute.batches import PaddedBatch, materialize, plan_groups
from bench.tools import machine, workload
from kembed.engine import cpu
from kembed.engine.warmup import bf16_units

PASSES = 3


def _timed(run: Callable[[], None]) -> tuple[float, float]:
    """Wall and process-CPU seconds of ``run()``."""
    wall, used = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - used


def _figures(texts: int, timings: list[tuple[float, float]]) -> dict[str, Any]:
    wall = sum(t[0] for t in timings)
    used = sum(t[1] for t in timings)
    return {
        "emb_per_s": texts * len(timings) / wall,
        "cpu_ms_per_emb": used * 1000 / (texts * len(timings)),
        "cores": used / wall,
        "passes": len(timings),
    }


def _in_lanes(lanes: ThreadPoolExecutor, forward: inprocess.Forward, batches: list[PaddedBatch]) -> Callable[[], None]:
    def call(batch: PaddedBatch) -> None:
        with torch.inference_mode():
            forward(batch.ids, batch.mask)

    def run() -> None:
        for future in [lanes.submit(call, batch) for batch in batches]:
            future.result()

    return run


def _st_encoders(path: str, texts: list[str]) -> dict[str, Callable[[], None]]:
    from sentence_transformers import SentenceTransformer

    dtypes = [torch.float32] + ([torch.bfloat16] if bf16_units("cpu") else [])
    encoders: dict[str, Callable[[], None]] = {}
    for dtype in dtypes:
        model = SentenceTransformer(path, device="cpu").to(dtype)
        model.encode(texts[:64], batch_size=32)  # allocations, first-call costs

        def encode(model: Any = model) -> None:
            model.encode(texts, batch_size=32)

        encoders[str(dtype).removeprefix("torch.")] = encode
    return encoders


def measure(model: str, passes: int) -> dict[str, Any]:
    texts = workload.load().texts
    loaded = inprocess.load({"model": model} if model else {})
    ids, lengths = loaded.tokenize(texts, True)
    groups, shape = plan_groups("sorted", lengths.tolist(), loaded)
    batches = materialize(groups, shape, ids, lengths, loaded.pad_token_id)
    runs: dict[str, Callable[[], None]] = {}
    with ThreadPoolExecutor(loaded.lanes, initializer=cpu.enter_lane, initargs=(loaded.lane_threads,)) as lanes:
        runs["eager"] = _in_lanes(lanes, loaded.forward, batches)
        with tempfile.TemporaryDirectory() as cache:
            if loaded.compile_on_cpu is not None:
                compiled = loaded.compile_on_cpu(cache)
                largest = max(batches, key=lambda b: b.padded_tokens)  # sets inductor's size hints
                lanes.submit(lambda: compiled(largest.ids, largest.mask)).result()
                runs["compiled"] = _in_lanes(lanes, compiled, batches)
            runs |= {f"st_encode_{d}": encode for d, encode in _st_encoders(str(loaded.path), texts).items()}
            for run in runs.values():  # untimed: every shape once
                run()
            timings: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
            for _ in range(passes):
                for name, run in runs.items():
                    timings[name].append(_timed(run))
    figures = {name: _figures(len(texts), t) for name, t in timings.items()}
    st = min((n for n in figures if n.startswith("st_encode")), key=lambda n: figures[n]["cpu_ms_per_emb"])
    own = min(("eager", "compiled"), key=lambda n: figures.get(n, {}).get("cpu_ms_per_emb", float("inf")))
    return {
        "model": loaded.model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "dtype_reason": loaded.dtype_reason,
        "lanes": loaded.lanes,
        "lane_threads": loaded.lane_threads,
        "texts": len(texts),
        "contenders": figures,
        "own": {"name": own, **figures[own]},
        "st_encode": {"name": st, **figures[st]},
        "machine": machine.describe(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="model folder; empty = the bundled MiniLM")
    parser.add_argument("--passes", type=int, default=PASSES)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.passes)))


if __name__ == "__main__":
    main()
