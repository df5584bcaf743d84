"""GPU extras, when CUDA is present: ``python -m bench.compute.gpu``.

- Start-up: the server's own load, compile and warmup of every planned shape (``start_runner``), in a
  fresh process each time, once with an empty ``KEMBED_COMPILE_CACHE_DIR`` (cold) and once reusing it
  (warm restart), per graph mode. Records the seconds, the shapes planned and given a graph, and
  what warmup compiled: dynamo's graphs (per shape and in all: at least one, one per shape in static
  mode), inductor's kernels (generated cold, loaded from the cache warm: at least one) and graph
  breaks (0). Replays and eager forwards move none of these, so an eager warmup shows as 0 graphs.
- The ceiling (length-sorted, the server's fixed bucketed shapes) for the bundled all-MiniLM-L6-v2
  and for a BERT-base-sized model (12 layers x 768; random weights, since no package ships that
  size offline: speed does not depend on weight values), each compiled (as the server does on
  CUDA) and eager, in the server's CUDA dtype (bf16): embeddings/s, tokens/s, the share of wall
  time a kernel ran (profiled), and recompiles after warmup (must be 0); and the same batches
  through a bare ``torch.compile`` of the transformers model, the yardstick the compiled ceiling
  should reach 0.85 of.

``--parts startup`` or ``--parts models`` runs one of the two (each takes minutes on an H100), and
``--models`` picks among the models. The machine block of ``gpu.json`` names the GPU and the torch
version. Without CUDA it writes ``gpu.json`` saying it was not run, and exits cleanly. The server
runs of ``bench.run_all`` need nothing special: the server and the ceiling pick CUDA when present.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.compute import ceiling, inprocess
from bench.tools import machine, workload
from kembed.config.values import Graphs
from kembed.engine.graphs import CompileCount

MODELS = {"all-MiniLM-L6-v2": "", "bert-base-random": "bert-base-random"}
PARTS = ("startup", "models")
START_TIMEOUT_S = 900


def start_once(model_dir: str, graphs: str, cache_dir: str) -> dict[str, Any]:
    """Load and warm up as the server does, in this process; what a start-up took and left."""
    from kembed.config.settings import Settings
    from kembed.engine.model import EmbeddingModel
    from kembed.engine.warmup import start_runner

    settings = Settings.from_env(
        {}, model=model_dir, device="cuda", compile="on", graphs=graphs, compile_cache_dir=cache_dir
    )
    started = time.perf_counter()
    runner = start_runner(settings, EmbeddingModel.load, lambda: None)
    seconds = time.perf_counter() - started
    if runner.graphs is None:
        raise RuntimeError("compile=on planned no graphs")
    planned = {(rows, seq_len) for seq_len, rows in runner.plan.warmup_shapes()}
    compiles = runner.graphs.compiles
    compiled = CompileCount.total(compiles.values())
    return {
        "seconds": round(seconds, 1),
        "shapes": len(planned),
        "shapes_with_graph": len(planned & runner.graphs.shapes),
        "sealed": runner.graphs.sealed,
        "dynamo_graphs": compiled.graphs,
        "inductor_kernels": compiled.kernels,
        "graph_breaks": compiled.graph_breaks,
        "dynamo_graphs_per_shape": {f"{rows}x{seq_len}": count.graphs for (rows, seq_len), count in compiles.items()},
    }


def _start_in_fresh_process(model_dir: str, graphs: str, cache_dir: str) -> dict[str, Any]:
    """A fresh process, so nothing compiled in this one makes the start look warm."""
    command = [sys.executable, "-m", "bench.compute.gpu", "--start-once", model_dir, graphs, cache_dir]
    done = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def startups(model_dir: str, scratch: Path) -> dict[str, Any]:
    """Cold, then warm from the cache the cold start filled, for each graph mode."""
    result: dict[str, Any] = {}
    for graphs in Graphs:
        cache = scratch / f"compile-cache-{graphs}"
        cache.mkdir()
        for start in ("cold", "warm"):
            result[f"{graphs} {start}"] = run = _start_in_fresh_process(model_dir, graphs, str(cache))
            print(f"gpu: start-up, graphs={graphs}, {start}: {run}")
    return result


def _measure(model_dir: str, compile: str, texts: list[str], repeats: int) -> dict[str, Any]:
    loaded = inprocess.load({"model": model_dir, "device": "cuda", "compile": compile})
    print(f"gpu: {loaded.model}, compiled={loaded.compiled}, {loaded.dtype}")
    return _bucketed_ceiling(loaded, texts, repeats)


def _bucketed_ceiling(loaded: inprocess.InProcessModel, texts: list[str], repeats: int) -> dict[str, Any]:
    result = ceiling.run(loaded, texts, repeats, max_seconds=120, batchings=["bucketed"])
    return {
        "dtype": str(loaded.dtype),
        "compiled": loaded.compiled,
        **result["bucketed"],
        "recompiles_after_warmup": result["recompiles_after_warmup"],
    }


def _bare_compiled(model_dir: str, texts: list[str], repeats: int) -> dict[str, Any]:
    """The yardstick for the compiled ceiling: the same bucketed batches through ``torch.compile`` of
    the bare transformers model (CUDA graphs per shape, no pooling, none of the server's graph
    machinery). The server's compiled ceiling should reach 0.85 of it."""
    from transformers import AutoModel

    loaded = inprocess.load({"model": model_dir, "device": "cuda", "compile": "off"})  # tokenizer and shapes
    model = (
        AutoModel.from_pretrained(model_dir or inprocess.bundled_model_dir(), dtype=loaded.dtype)
        .to(loaded.device)
        .eval()
    )
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0].float()

    return _bucketed_ceiling(dataclasses.replace(loaded, forward=forward, compiled=True), texts, repeats)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--start-once", nargs=3, metavar=("MODEL", "GRAPHS", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    parts, models = args.parts.split(","), args.models.split(",")
    if unknown := (set(parts) - set(PARTS)) | (set(models) - set(MODELS)):
        parser.error(f"unknown parts or models: {', '.join(sorted(unknown))}")
    if not torch.cuda.is_available():
        print("gpu: no CUDA device on this machine; not run")
        machine.write_result("gpu", {"run": False, "reason": "no CUDA device"})
        return
    if args.start_once:
        print(json.dumps(start_once(*args.start_once)))
        return
    texts = workload.load().texts[: 256 if args.quick else None]
    runs: dict[str, Any] = {}
    start: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        if "startup" in parts:
            start = startups(ceiling.model_dir("", Path(scratch)), Path(scratch))
        for name, model in MODELS.items():
            if "models" not in parts or name not in models:
                continue
            model_dir = ceiling.model_dir(model, Path(scratch))
            for compile in ("on", "off"):
                runs[f"{name} {'compiled' if compile == 'on' else 'eager'}"] = _measure(
                    model_dir, compile, texts, repeats=1 if args.quick else 3
                )
                torch.compiler.reset()  # graphs of one model must not count as the next one's recompiles
            runs[f"{name} bare compiled forward"] = _bare_compiled(model_dir, texts, repeats=1 if args.quick else 3)
            torch.compiler.reset()
    machine.write_result(
        "gpu",
        {"run": True, "parts": parts, "texts": len(texts), "cuda": torch.version.cuda, "startup": start, "runs": runs},
    )


if __name__ == "__main__":
    main()
