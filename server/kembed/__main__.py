"""``python -m kembed``: serve until SIGTERM, then drain. ``--env-table`` prints the settings tables."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kembed import tls
from kembed.app import Supervisor
from kembed.config import ConfigError, Settings, env_tables
from kembed.contract import EXIT_CONFIG, EXIT_STARTUP_FAILED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kembed", description="kembed embedding server (configured by KEMBED_*)")
    parser.add_argument("--env-table", action="store_true", help="print the KEMBED_* settings tables (Markdown)")
    args = parser.parse_args(argv)
    if args.env_table:
        print(env_tables())
        return 0
    try:
        settings = Settings.from_env()
        tls.check(settings)  # before any child starts: a bad Secret fails the pod with one clear line
    except ConfigError as error:
        print(f"kembed: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(settings)


def serve(settings: Settings, model_loader: str | None = None) -> int:
    """Run the server until SIGTERM; ``model_loader`` (``module:callable``) is for benchmarks."""
    return asyncio.run(_supervise(settings, model_loader))


async def _supervise(settings: Settings, model_loader: str | None) -> int:
    try:
        supervisor = Supervisor(settings, model_loader)
    except OSError as error:  # a port in use, an unwritable temporary directory
        print(f"kembed: cannot start: {error}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    return await supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
