"""A fleet of real ``kembed`` server processes on loopback, handled as a Deployment's pods would be.

A pod starts as ``python -m bench.fleet.device`` (the real server, the device modeled), is probed on
``/readyz`` like the readiness probe, joins the endpoints once ready, and on deletion leaves them, waits
the preStop sleep, gets SIGTERM and drains. Prometheus discovers every pod (ready or not, as a
PodMonitor does) from a file_sd file with the ``namespace`` and ``pod`` labels Kubernetes would attach.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.fleet.hpa import Pod
from bench.tools.server import Server, is_ready, process_tree, server_env


@dataclass
class Replica:
    name: str
    server: Server
    process: subprocess.Popen[bytes]
    started_at: float
    ready_at: float | None = None
    ready: bool = False
    deleting_at: float | None = None
    exited_at: float | None = None
    cpu_samples: list[tuple[float, float]] = field(default_factory=list)  # (t, CPU seconds of its tree)

    @property
    def serving(self) -> bool:
        return self.ready and self.deleting_at is None

    def as_pod(self) -> Pod:
        return Pod(
            self.name,
            deleting=self.deleting_at is not None,
            ready=self.ready,
            started_at=self.started_at,
            ready_since=self.ready_at,
        )


@dataclass
class Fleet:
    """One Deployment's pods; times in seconds on ``clock`` (the run's)."""

    namespace: str
    settings: Mapping[str, str]
    log_dir: Path
    targets_file: Path
    prestop_s: float
    clock: float = field(default_factory=time.monotonic)  # the run's zero
    replicas: list[Replica] = field(default_factory=list)
    serial: int = 0
    leaving: set[asyncio.Task[None]] = field(default_factory=set)  # held: the loop keeps weak references

    def now(self) -> float:
        return time.monotonic() - self.clock

    @property
    def live(self) -> list[Replica]:
        """Pods that exist (started, not yet exited): what the cluster bills."""
        return [r for r in self.replicas if r.exited_at is None]

    @property
    def scale(self) -> int:
        """The Deployment's replica count: pods not being deleted."""
        return sum(1 for r in self.live if r.deleting_at is None)

    def restart_clock(self) -> None:
        """Time zero is now (the load's start); the pods' times move with it."""
        shift = self.now()
        self.clock += shift
        for replica in self.replicas:
            replica.started_at -= shift
            replica.ready_at = None if replica.ready_at is None else replica.ready_at - shift

    def endpoints(self) -> list[Replica]:
        return [r for r in self.live if r.serving]

    def spawn(self) -> Replica:
        self.serial += 1
        name = f"emb-5f7d9c-{self.serial:05d}"
        env, server = server_env(self.settings)
        log = (self.log_dir / f"{self.namespace}-{name}.log").open("wb")
        command = [sys.executable, "-m", "bench.fleet.device"]
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child holds its own descriptor
        replica = Replica(name, dataclasses.replace(server, pid=process.pid), process, self.now())
        self.replicas.append(replica)
        self.publish()
        return replica

    def scale_to(self, count: int) -> None:
        """Create pods, or delete the ones a ReplicaSet deletes first: not ready, then newest ready."""
        while self.scale < count:
            self.spawn()
        doomed = sorted(
            (r for r in self.live if r.deleting_at is None), key=lambda r: (r.ready, -(r.ready_at or r.started_at))
        )
        for replica in doomed[: max(0, self.scale - count)]:
            replica.deleting_at = self.now()
            task = asyncio.get_running_loop().create_task(self._terminate(replica))
            self.leaving.add(task)
            task.add_done_callback(self.leaving.discard)

    async def _terminate(self, replica: Replica) -> None:
        await asyncio.sleep(self.prestop_s)  # the preStop hook: endpoints drop it first
        with contextlib.suppress(ProcessLookupError):
            replica.process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(_wait_or_kill, replica.process, 60.0)
        replica.exited_at = self.now()
        self.publish()

    async def probe(self) -> None:
        """One readiness probe of every live pod (on failure a pod leaves the endpoints)."""
        live = [r for r in self.live if r.deleting_at is None]
        results = await asyncio.gather(*(asyncio.to_thread(is_ready, r.server.http_url) for r in live))
        for replica, ok in zip(live, results, strict=True):
            if ok and replica.ready_at is None:
                replica.ready_at = self.now()
            replica.ready = ok
            if replica.process.poll() is not None:
                raise RuntimeError(f"{replica.name} exited; see {self.log_dir}")

    def sample_cpu(self) -> None:
        for replica in self.live:
            replica.cpu_samples.append((self.now(), replica.server.cpu_seconds()))

    def publish(self) -> None:
        """The file_sd targets: every pod that exists, with the labels its series get."""
        groups = [
            {
                "targets": [urllib.parse.urlsplit(r.server.http_url).netloc],
                "labels": {"namespace": self.namespace, "pod": r.name},
            }
            for r in self.live
        ]
        staged = self.targets_file.with_suffix(".tmp")
        staged.write_text(json.dumps(groups))
        staged.replace(self.targets_file)

    async def close(self) -> None:
        """Every pod deleted at once, and waited for (those already leaving included)."""
        self.scale_to(0)
        await asyncio.gather(*self.leaving)


def _wait_or_kill(process: subprocess.Popen[bytes], grace: float) -> None:
    tree = process_tree(process.pid)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        for pid in reversed(tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
