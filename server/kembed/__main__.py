"""``python -m kembed``: serve until SIGTERM, then drain. ``--env-table`` prints the settings tables."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import textwrap

from kembed.config.settings import Settings
from kembed.config.table import env_tables
from kembed.config.values import ConfigError
from kembed.contract import EXIT_CONFIG, EXIT_STARTUP_FAILED, env_name
from kembed.plumbing import api_keys, tls
from kembed.supervisor.process import Supervisor

# What most runs set, shown by --help; every setting is in --env-table and docs/configuration.md.
MAIN_SETTINGS = ("model", "served_model_name", "dtype", "device", "grpc_host", "grpc_port", "rest_port", "http_port")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kembed",
        description="kembed embedding server: gRPC, the OpenAI embeddings API (REST), health and metrics. "
        "It takes no other arguments: KEMBED_* environment variables configure it.",
        epilog=settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--env-table", action="store_true", help="print every KEMBED_* setting's table (Markdown)")
    args = parser.parse_args(argv)
    if args.env_table:
        print(env_tables())
        return 0
    try:
        settings = Settings.from_env()
        tls.check(settings)  # before any child starts: a bad Secret fails the pod with one clear line
        api_keys.read(settings)
    except ConfigError as error:
        print(f"kembed: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(settings)


def settings_help() -> str:
    """The main settings, their defaults and meanings, and where the others are."""
    lines = ["main settings (environment variables):"]
    for name in MAIN_SETTINGS:
        field = Settings.model_fields[name]
        default = getattr(field.default, "value", field.default)
        lines.append(f"  {env_name(name)}={default}")
        lines.append(
            textwrap.fill(str(field.description), width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
        )
    lines.append("every setting: python -m kembed --env-table, or docs/configuration.md")
    return "\n".join(lines)


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
