"""``python -m kembed``: serve until SIGTERM, then drain. ``--env-table`` prints the settings table."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kembed.app import KembedServer, StartupError
from kembed.config import ConfigError, Settings, env_table

log = logging.getLogger("kembed")


async def serve(settings: Settings) -> int:
    server = KembedServer(settings)
    await server.start()
    print(
        f"kembed: gRPC on {settings.grpc_host}:{server.grpc_port}, health and metrics on "
        f"http://{settings.http_host}:{server.http.port} (warming up; /readyz turns 200 when ready)",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    ready = asyncio.create_task(server.wait_ready())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is None:
        print(
            f"kembed: ready. Try: .venv/bin/python -m kembed.client --target "
            f"{settings.grpc_host}:{server.grpc_port} 'hello world'",
            flush=True,
        )
        await stopped
    elif ready.done():
        await server.stop()
        error = ready.exception()
        log.error("start-up failed: %s", error)
        return 1 if isinstance(error, StartupError) else 2
    log.info("signal received: draining")
    ready.cancel()
    await server.drain()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kembed", description="kembed embedding server (configured by KEMBED_*)")
    parser.add_argument("--env-table", action="store_true", help="print the KEMBED_* settings as a Markdown table")
    args = parser.parse_args(argv)
    if args.env_table:
        print(env_table())
        return 0
    try:
        settings = Settings.from_env()
    except ConfigError as error:
        print(f"kembed: configuration error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
