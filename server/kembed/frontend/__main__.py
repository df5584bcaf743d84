"""``python -m kembed.frontend --runtime DIR --index I --grpc-port P --rest-port R``: a front end,
started by the supervisor, on the ports it bound (a port of 0 in the settings is resolved there)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from kembed.config.settings import Settings
from kembed.config.values import ConfigError
from kembed.contract import EXIT_CONFIG
from kembed.frontend import tracing
from kembed.frontend.process import FrontendProcess
from kembed.plumbing import request_log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kembed.frontend")
    parser.add_argument("--runtime", type=Path, required=True, help="the supervisor's runtime folder")
    parser.add_argument("--index", type=int, required=True, help="this front end's number, from 0")
    parser.add_argument("--grpc-port", type=int, required=True, help="the port every front end shares")
    parser.add_argument("--rest-port", type=int, required=True, help="likewise for REST (0: off)")
    args = parser.parse_args(argv)
    # Front ends are the tokenizing parallelism: a request's texts are tokenized on one thread, and
    # the Rust tokenizer's own thread pool would only spin on the cores the engine computes with.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        settings = Settings.from_env(grpc_port=args.grpc_port, rest_port=args.rest_port)
    except ConfigError as error:
        print(f"kembed front end: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    request_log.configure(settings.log_level, f"frontend-{args.index}")
    try:
        tracing.start()
    except tracing.TracingUnavailable as error:
        print(f"kembed front end: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    return asyncio.run(_serve(settings, args.runtime, args.index))


async def _serve(settings: Settings, runtime: Path, index: int) -> int:
    return await FrontendProcess(settings, runtime, index).run()  # gRPC's aio server binds to this loop


if __name__ == "__main__":
    sys.exit(main())
