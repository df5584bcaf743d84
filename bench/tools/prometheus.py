"""A real Prometheus (Debian's ``prometheus`` binary) on a free loopback port, for benches and tests.

It scrapes what ``scrape_configs`` name every second and answers PromQL on its HTTP API, as the
Prometheus that prometheus-adapter and KEDA query in a cluster.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.tools.server import HOST, free_port

BINARY = shutil.which("prometheus") or "/usr/bin/prometheus"
START_TIMEOUT_S = 60.0


def ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/-/ready", timeout=2) as reply:
            return int(reply.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextlib.contextmanager
def running(work: Path, scrape_configs: Sequence[dict[str, Any]]) -> Iterator[str]:
    """Prometheus with its config, data and log in ``work``; yields its base URL once ready."""
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": list(scrape_configs)}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    base = f"http://{HOST}:{free_port()}"
    command = [
        BINARY,
        f"--config.file={work / 'prometheus.yml'}",
        f"--storage.tsdb.path={work / 'tsdb'}",
        f"--web.listen-address={base.removeprefix('http://')}",
    ]
    with (work / "prometheus.log").open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready(base):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"prometheus did not become ready; see {work / 'prometheus.log'}")
            time.sleep(0.2)  # start-up only
        yield base
    finally:
        process.kill()
        process.wait(10)
