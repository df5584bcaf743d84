"""The ceiling: the same model on the same texts in one process, no server, no network.

Batchings of the same texts, their batches interleaved in one timed pass (so a burst of load
elsewhere slows each alike; forward passes only, tokenization is reported apart):
- ``sorted``: all texts sorted by length, packed greedily under the server's limits (rows, padded
  tokens), each batch padded to its longest: the most embeddings per second this machine gives,
  the figure the server is measured against;
- ``naive``: arrival order, same packing, padded to the longest: a batcher that ignores length;
- ``bucketed``: the server's fixed shapes at their best (each text in its bucket, full batches,
  rows padded to the fixed sizes when compiled): what compiled CUDA graphs need.

The model loads as the server would, in the dtype the server would serve in (``KEMBED_DTYPE=auto``
measures bf16 against fp32 where the CPU has bf16 units): the ceiling the server is judged against.

Then, on CPU, the *batch curve*: tokens per second of one batch of 64 .. 4096 tokens (rows of
``CURVE_LENGTH``), in fp32 and in bf16, interleaved: where the matrix units turn efficient (the
smallest batch within 10% of the best, ``budget_90``), and a straight-line fit of seconds against
tokens whose intercept, in tokens, is what a batch costs beyond its tokens (what the server's
packing weighs; its warmup measures its own).

On a CPU that computes eager batches, the *limits* (``bench.compute.limits``, the ``limits`` block): the
*sorted* batches in the server's lanes, eager and through the server's CPU compile, interleaved with
sentence-transformers' own ``encode`` on the same texts, and each one's vectors against
sentence-transformers in fp32.

``python -m bench.compute.ceiling`` (eager: all three; compiled: bucketed only, as other shapes recompile).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.compute import inprocess
from bench.compute.batches import PaddedBatch, compiles, materialize, plan_groups, rates
from bench.tools import machine, workload
from bench.tools.report import padding_ratio


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Plans = dict[str, list[PaddedBatch]]  # batching name -> its batches


def interleave(plans: Plans) -> list[tuple[str, int]]:
    """Every (batching, batch index), each batching's batches evenly spread over the pass: a burst
    of load elsewhere on the machine slows every batching alike, so their ratios hold."""
    slots = sorted(((i + 0.5) / len(batches), name, i) for name, batches in plans.items() for i in range(len(batches)))
    return [(name, i) for _, name, i in slots]


def timed_pass(loaded: inprocess.InProcessModel, plans: Plans) -> dict[str, list[float]]:
    """Seconds each batch took, device work included (synchronized after each)."""
    seconds = {name: [0.0] * len(batches) for name, batches in plans.items()}
    with torch.inference_mode():
        _sync(loaded.device)
        for name, i in interleave(plans):
            batch = plans[name][i]
            start = time.perf_counter()
            loaded.forward(batch.ids, batch.mask)
            _sync(loaded.device)
            seconds[name][i] = time.perf_counter() - start
    return seconds


def gpu_busy_share(loaded: inprocess.InProcessModel, batches: list[PaddedBatch]) -> float:
    """Share of one pass's wall time during which a CUDA kernel ran (profiled, merged intervals)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = sum(timed_pass(loaded, {"": batches})[""])
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy, reach = 0.0, -np.inf
    for start, end in spans:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy / 1e6 / wall  # profiler times are microseconds


def _warmup(batches: list[PaddedBatch], compiled: bool) -> list[PaddedBatch]:
    """Compiled, one batch of every shape (each is a graph); eager, the largest batch."""
    if compiled:
        return list({(b.rows, int(b.ids.shape[1])): b for b in batches}.values())
    return [max(batches, key=lambda b: b.padded_tokens)]


def _summary(loaded: inprocess.InProcessModel, batches: list[PaddedBatch], passes: list[list[float]]) -> dict[str, Any]:
    real = sum(b.real_tokens for b in batches)
    padded = sum(b.padded_tokens for b in batches)
    result: dict[str, Any] = {
        "batches": len(batches),
        "shapes": len({(b.rows, int(b.ids.shape[1])) for b in batches}),
        "passes": len(passes),
        "emb_per_s": rates(passes, [b.texts for b in batches]).to_dict(),
        "tokens_per_s": rates(passes, [b.real_tokens for b in batches]).to_dict(),
        "padding_ratio": padding_ratio(real, padded - real),
    }
    if loaded.device.type == "cuda":
        result["gpu_busy_share"] = gpu_busy_share(loaded, batches)
    return result


def measure(loaded: inprocess.InProcessModel, plans: Plans, repeats: int, max_seconds: float) -> dict[str, Any]:
    """Warm, then time interleaved passes over every batching until ``repeats`` or ``max_seconds``."""
    plans = {name: [b.to(loaded.device) for b in batches] for name, batches in plans.items()}
    timed_pass(loaded, {name: _warmup(batches, loaded.compiled) for name, batches in plans.items()})
    compiles_after_warmup = compiles()
    passes: list[dict[str, list[float]]] = []
    deadline = time.monotonic() + max_seconds
    while len(passes) < repeats and (not passes or time.monotonic() < deadline):
        passes.append(timed_pass(loaded, plans))
    result: dict[str, Any] = {"recompiles_after_warmup": compiles() - compiles_after_warmup}
    for name, batches in plans.items():
        result[name] = _summary(loaded, batches, [p[name] for p in passes])
        print(f"  {name}: {result[name]['emb_per_s']['median']:.1f} emb/s, padding {result[name]['padding_ratio']:.1%}")
    return result


def run(
    loaded: inprocess.InProcessModel, texts: list[str], repeats: int, max_seconds: float, batchings: Sequence[str]
) -> dict[str, Any]:
    start = time.perf_counter()
    ids, lengths = loaded.tokenize(texts, True)
    tokenize_s = time.perf_counter() - start
    plans = {
        name: materialize(*plan_groups(name, lengths.tolist(), loaded), ids, lengths, loaded.pad_token_id)
        for name in batchings
    }
    return {"texts": len(texts), "tokenize_s": tokenize_s, **measure(loaded, plans, repeats, max_seconds)}


CURVE_LENGTH = 64
CURVE_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)
CURVE_DTYPES = ("float32", "bfloat16")


def batch_curve(
    forwards: dict[str, inprocess.Forward],
    sizes: Sequence[int],
    passes: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Per dtype, each batch size's tokens/s (its fastest of ``passes`` interleaved passes), the
    smallest batch within 10% of the best, and the fitted per-batch overhead in tokens."""
    generator = torch.Generator().manual_seed(0)
    batches = {n: torch.randint(1000, 20000, (n // CURVE_LENGTH, CURVE_LENGTH), generator=generator) for n in sizes}
    fastest = {(name, n): math.inf for name in forwards for n in sizes}
    with torch.inference_mode():
        for forward in forwards.values():
            forward(batches[sizes[-1]], torch.ones_like(batches[sizes[-1]]))  # one-off allocations
        for _ in range(passes):
            for (name, n), best in fastest.items():
                start = clock()
                forwards[name](batches[n], torch.ones_like(batches[n]))
                fastest[name, n] = min(best, clock() - start)
    curve: dict[str, Any] = {"length": CURVE_LENGTH, "passes": passes}
    for name in forwards:
        seconds = [fastest[name, n] for n in sizes]
        rates = [n / t for n, t in zip(sizes, seconds, strict=True)]
        slope, intercept = np.polyfit(sizes, seconds, 1)
        points = [
            {"tokens": n, "rows": n // CURVE_LENGTH, "tokens_per_s": round(n / t)}
            for n, t in zip(sizes, seconds, strict=True)
        ]
        curve[name] = {
            "points": points,
            "budget_90": next(n for n, r in zip(sizes, rates, strict=True) if r >= 0.9 * max(rates)),
            "overhead_tokens": round(max(0.0, intercept / slope), 1) if slope > 0 else None,
        }
        print(f"  batch curve, {name}: {', '.join(f'{n}: {r:.0f}' for n, r in zip(sizes, rates, strict=True))} tok/s; "
              f"within 10% of the best from {curve[name]['budget_90']} tokens")  # fmt: skip
    return curve


def curve_models(settings: dict[str, str]) -> dict[str, inprocess.Forward]:
    """The model's forward in each dtype of the curve, as the server would load it."""
    return {dtype: inprocess.load({**settings, "dtype": dtype}).forward for dtype in CURVE_DTYPES}


def model_dir(model: str, scratch: Path) -> str:
    return str(inprocess.write_random_bert_base(scratch / "bert-base-random")) if model == "bert-base-random" else model


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="model folder; empty = bundled MiniLM; bert-base-random")
    parser.add_argument("--device", default="auto", help="auto (as the server: CUDA when present), cpu or cuda")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="auto: on for CUDA")
    parser.add_argument("--env", action="append", default=[], metavar="SETTING=VALUE", help="other server setting")
    parser.add_argument("--batchings", default="", help="sorted, naive, bucketed; default: all (eager) or bucketed")
    parser.add_argument("--texts", type=int, default=workload.SIZE, help="first N texts of the workload")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes (their spread is the range)")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="no new pass after this")
    parser.add_argument("--curve-passes", type=int, default=3, help="CPU batch curve passes; 0 = no curve")
    parser.add_argument("--limits-rounds", type=int, default=8, help="CPU limits: rounds a pass; 0 = no limits")
    parser.add_argument("--name", default="ceiling", help="result file: bench/results/NAME.json")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("ceiling: no CUDA device here; skipped")
        return None
    with tempfile.TemporaryDirectory() as scratch:
        settings = {"model": model_dir(args.model, Path(scratch)), "device": args.device, "compile": args.compile}
        settings.update(kv.split("=", 1) for kv in args.env)
        loaded = inprocess.load(settings)
        batchings = args.batchings or ("bucketed" if loaded.compiled else "sorted,bucketed,naive")
        texts = workload.load().texts[: args.texts]
        print(
            f"ceiling: {loaded.model} on {loaded.device} ({loaded.dtype}), {len(texts)} texts, compile={args.compile}"
        )
        print(f"  {loaded.dtype}: {loaded.dtype_reason}")
        result = run(loaded, texts, args.repeats, args.max_seconds, batchings.split(","))
        if loaded.compile_on_cpu is not None and args.limits_rounds:
            from bench.compute import limits  # sentence-transformers loads only where the limits run

            print(f"  limits: sentence-transformers encode, eager and compiled, {loaded.lanes} lane(s)")
            cache = str(Path(scratch) / "compile-cache")
            result["limits"] = limits.measure(loaded, texts, args.repeats, args.limits_rounds, cache)
        if loaded.device.type == "cpu" and args.curve_passes:
            result["batch_curve"] = batch_curve(curve_models(settings), CURVE_TOKENS, args.curve_passes)
    result.update(model=args.model or loaded.model, device=str(loaded.device), dtype=str(loaded.dtype),
                  dtype_reason=loaded.dtype_reason, compiled=loaded.compiled)  # fmt: skip
    result["settings"] = settings
    result["workload"] = workload.load().describe()
    machine.write_result(args.name, result)
    return result


if __name__ == "__main__":
    main()
