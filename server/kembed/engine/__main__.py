"""``python -m kembed.engine --runtime DIR``: the engine process, started by the supervisor."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from pathlib import Path

from kembed.config.settings import Settings
from kembed.config.values import ConfigError
from kembed.contract import EXIT_CONFIG
from kembed.engine.process import EngineProcess
from kembed.engine.runner import LoadModel
from kembed.plumbing import request_log

DEFAULT_MODEL_LOADER = "kembed.engine.model:EmbeddingModel.load"


def resolve(spec: str) -> LoadModel:
    """``module:attribute.path`` to the callable it names."""
    module, _, path = spec.partition(":")
    target = importlib.import_module(module)
    for name in path.split("."):
        target = getattr(target, name)
    return target  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kembed.engine")
    parser.add_argument("--runtime", type=Path, required=True, help="the supervisor's runtime folder")
    parser.add_argument(
        "--model-loader",
        default=DEFAULT_MODEL_LOADER,
        help="module:callable that loads the model from Settings (benchmarks swap in a zero-cost one)",
    )
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
    except ConfigError as error:
        print(f"kembed engine: configuration error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    request_log.configure(settings.log_level, "engine")
    code = asyncio.run(EngineProcess(settings, args.runtime, resolve(args.model_loader)).run())
    # The worker thread may still be inside torch (stopped while warming up): exit without waiting.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
