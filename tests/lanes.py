"""The suite's two lanes, and the guard that keeps the ``process`` mark honest.

A test that starts a process (a kembed server, ``kopf run``, a subprocess, a venv, a pool of
workers), by itself or through a fixture, is marked ``process``; no other test is. ``make unit``
runs the rest (``-m "not process"``): every pure test, no process started, in minutes. ``make
test`` runs everything (``.ci/run`` calls it).

The mark is held to that at run time, in every run (this plugin, loaded by ``tests/conftest.py``):
each way Python starts a process (``subprocess``, ``multiprocessing``, ``os.fork``,
``os.posix_spawn``, ``os.system``, and what builds on them) is wrapped for the session, and

- a test without the mark that starts one is refused at once: the call raises
  :class:`ProcessRefused` and no process is started, so ``make unit`` starts none;
- a test without the mark that uses a fixture which started a process fails: in the full run that
  fixture may already be running, set up by a marked test before it, so nothing is refused;
- a marked test that passes without a process of its own or of its fixtures fails, so the mark
  leaves out of ``make unit`` only what must be left out;
- a process still running after a test without the mark fails it, whatever started it (a C
  library's ``fork`` goes around the wrappers; its process does not go unseen while it lives).

Collecting is a phase without a test: a process started then (an import that runs one) is refused.
A process started once and cached for the session belongs in a session fixture, which every test
that relies on it asks for: then it is the fixture's, whichever of them ran first.
"""

from __future__ import annotations

import _posixsubprocess
import functools
import os
import subprocess
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

MARK = "process"
DESCRIPTION = (
    f"{MARK}: starts a process (a server, `kopf run`, a subprocess, a venv), itself or by a fixture;"
    " `make unit` leaves these out (tests/lanes.py)"
)
# Every call through which Python starts a process: subprocess (and asyncio's, and os.popen) forks
# through _fork_exec or os.posix_spawn; multiprocessing through os.fork or _posixsubprocess; os.spawn*
# and pty through os.fork and os.forkpty; os.system through the C library.
SPAWNERS: list[tuple[Any, str]] = [
    (subprocess, "_fork_exec"),
    (_posixsubprocess, "fork_exec"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
]


class ProcessRefused(Exception):  # not an OSError: callers catch those
    """A process started by a test without the ``process`` mark, or while collecting."""


class Guard:
    """The session's wrappers, and what the test running now has started."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.started = 0  # processes the running test started
        self.refused: list[str] = []  # and the ones refused to it
        self.children: set[int] = set()  # this process's children when the test began
        self.passed = False  # the test's call passed
        self.failed = False  # a phase of it failed already (a refusal raised there is reported)
        self.spawning: set[object] = set()  # the fixture definitions whose setup started a process
        self.total = 0  # every process started this session
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []

    def install(self) -> None:
        for owner, name in SPAWNERS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original, f"{owner.__name__}.{name}"))

    def uninstall(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def _wrap(self, spawn: Callable[..., Any], how: str) -> Callable[..., Any]:
        @functools.wraps(spawn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.allow(how)
            return spawn(*args, **kwargs)

        return guarded

    def allow(self, how: str) -> None:
        if self.item is not None and self.item.get_closest_marker(MARK) is not None:
            self.started += 1
            self.total += 1
            return
        where = self.item.nodeid if self.item is not None else "collecting"
        message = f"{where}: started a process ({how}) without the `{MARK}` mark (tests/lanes.py)"
        self.refused.append(message)
        raise ProcessRefused(message)

    def begin(self, item: pytest.Item) -> None:
        self.item, self.started, self.refused, self.passed, self.failed = item, 0, [], False, False
        self.children = children()

    def end(self) -> None:
        self.item = None

    def verdict(self, item: pytest.Item) -> str | None:
        """Why ``item`` breaks the rule, or None."""
        uses = sorted(name for name, defs in _fixture_defs(item) if any(d in self.spawning for d in defs))
        if item.get_closest_marker(MARK) is None:
            if self.refused and not self.failed:  # refused, and the test went on: it caught the refusal
                return "\n".join(self.refused)
            if uses:
                return f"uses fixtures that start processes ({', '.join(uses)}) without the `{MARK}` mark"
            alive = children() - self.children
            if alive:
                return f"left processes running ({sorted(alive)}) without the `{MARK}` mark"
            return None
        if self.passed and not self.started and not uses:
            return f"is marked `{MARK}` and started none, nor did its fixtures: take the mark off"
        return None


def children() -> set[int]:
    """The pids of this process's children (of any of its threads), from /proc."""
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            found.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:  # the thread ended
            continue
    return found


def _fixture_defs(item: pytest.Item) -> list[tuple[str, list[object]]]:
    """The fixtures ``item`` uses, transitively, with their definitions (pytest keeps the closure on
    the item; ``_fixtureinfo`` is pytest's own, stable since pytest 3)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [(name, list(defs)) for name, defs in info.name2fixturedefs.items()]


GUARD = pytest.StashKey[Guard]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", DESCRIPTION)
    guard = Guard()
    config.stash[GUARD] = guard
    guard.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    config.stash[GUARD].uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    guard = item.config.stash[GUARD]
    guard.begin(item)
    try:
        return (yield)
    finally:
        guard.end()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Generator[None, object, object]:
    guard = request.config.stash[GUARD]
    before = guard.total
    result = yield
    if guard.total > before:
        guard.spawning.add(fixturedef)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    guard = item.config.stash[GUARD]
    guard.failed |= report.failed
    if report.when == "call":
        guard.passed = report.passed
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    result = yield
    broken = item.config.stash[GUARD].verdict(item)
    if broken is not None:
        pytest.fail(f"{item.nodeid} {broken}", pytrace=False)
    return result
