"""GPU extras, when CUDA is present: ``python -m bench.gpu``.

The ceiling (length-sorted, the server's fixed bucketed shapes) for the bundled all-MiniLM-L6-v2
and for a BERT-base-sized model (12 layers x 768; random weights, since no package ships that
size offline: speed does not depend on weight values), each compiled (torch.compile, CUDA graphs,
as the server does on CUDA) and eager, in the server's CUDA dtype (bf16). Reports embeddings/s,
tokens/s, the share of wall time a kernel ran (profiled), and recompiles after warmup.

Without CUDA it writes ``gpu.json`` saying it was not run, and exits cleanly. The server runs of
``bench.run_all`` need nothing special: the server and the ceiling pick CUDA when present.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench import ceiling, engine, machine, workload

MODELS = {"all-MiniLM-L6-v2": "", "bert-base-random": "bert-base-random"}


def _measure(model_dir: str, compile: str, texts: list[str], repeats: int) -> dict[str, Any]:
    eng = engine.load({"model": model_dir, "device": "cuda", "compile": compile})
    print(f"gpu: {eng.model}, compiled={eng.compiled}, {eng.dtype}")
    result = ceiling.run(eng, texts, repeats, max_seconds=120, batchings=["bucketed"])
    return {
        "dtype": str(eng.dtype),
        "compiled": eng.compiled,
        **result["bucketed"],
        "recompiles_after_warmup": result["recompiles_after_warmup"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu: no CUDA device on this machine; not run")
        machine.write_result("gpu", {"run": False, "reason": "no CUDA device"})
        return
    texts = workload.load().texts[: 256 if args.quick else None]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, model in MODELS.items():
            model_dir = ceiling.model_dir(model, Path(scratch))
            for compile in ("on", "off"):
                runs[f"{name} {'compiled' if compile == 'on' else 'eager'}"] = _measure(
                    model_dir, compile, texts, repeats=1 if args.quick else 3
                )
                torch.compiler.reset()  # graphs of one model must not count as the next one's recompiles
    machine.write_result("gpu", {"run": True, "texts": len(texts), "runs": runs})


if __name__ == "__main__":
    main()
