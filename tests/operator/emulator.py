"""kmock's Kubernetes emulator, stamped like a real API server, served from a background thread.

kmock 0.8 keeps objects in memory and speaks HTTP, but leaves out what kopf and the operator rely
on: uid, resourceVersion, generation (bumped on spec changes only), creationTimestamp, the namespace
from the URL, generateName, a list resourceVersion, and watches that resume from a resourceVersion
instead of replaying every object as ADDED. :class:`StampingEmulator` adds exactly those, and three
behaviours of a real API server the operator must cope with: a JSON patch whose ``test`` fails is
422 (kmock says 500, which clients retry as is), a Service's ``clusterIP`` is assigned and then
immutable, and CPU quantities are stored canonical (``4000m`` reads back as ``4``).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import copy
import datetime
import itertools
import threading
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
from kmock._internal import aiobus, apps, dicts, enums, k8s, references, rendering

TEST_AGENT = "kembed-tests"  # the User-Agent of the tests' own calls, told apart from the operator's
_MUTATIONS = (enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE)
_CURRENT: contextvars.ContextVar[rendering.Request | None] = contextvars.ContextVar("current", default=None)


@attrs.define
class _HistoryBus(aiobus.Bus[Any]):
    """A bus that also keeps every event, so a watch can resume from a resourceVersion."""

    history: list[dict[str, Any]] = attrs.field(factory=list)

    async def put(self, item: Any) -> None:
        self.history.append(item)
        await super().put(item)


@attrs.frozen
class Invalid(k8s.KubernetesError):
    status: int = 422
    reason: str = "Invalid"
    message: str = ""


def _canonical_cpu(manifest: Any) -> None:
    """Rewrite whole-core milli-CPU quantities in a pod template as the API server stores them."""
    template = manifest.get("spec", {}).get("template", {}) if isinstance(manifest, dict) else {}
    for container in template.get("spec", {}).get("containers", []) or []:
        for group in (container.get("resources") or {}).values():
            cpu = group.get("cpu") if isinstance(group, dict) else None
            if isinstance(cpu, str) and cpu.endswith("m") and cpu[:-1].isdigit() and int(cpu[:-1]) % 1000 == 0:
                group["cpu"] = str(int(cpu[:-1]) // 1000)


def _rv(event: dict[str, Any]) -> int:
    return int(event["object"]["metadata"].get("resourceVersion", 0))


@attrs.define(kw_only=True)
class StampingEmulator(k8s.KubernetesEmulator):
    _buses: dict[references.resource, aiobus.Bus[Any]] = attrs.field(
        factory=lambda: collections.defaultdict(_HistoryBus)
    )
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _versions: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_rv: int = attrs.field(default=0, init=False)

    def _next_rv(self) -> str:
        self._last_rv = next(self._versions)
        return str(self._last_rv)

    def __iter__(self) -> Iterator[rendering.Request]:
        # kmock matches a request to its reactions by scanning every request ever served, which
        # grows quadratic over a test run; each request only ever needs to find itself.
        current = _CURRENT.get()
        yield from () if current is None else (current,)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        _CURRENT.set(request)  # aiohttp serves each request in its own task, hence its own context
        if request.resource is None or request.action not in _MUTATIONS:
            return await super()._handle(request)
        async with self._write_lock:  # writes are serialised, as etcd would
            self._stamp(request)
            try:
                return await super()._handle(request)
            except jsonpatch.JsonPatchTestFailed as err:  # kopf's finalizer patch tests the resourceVersion
                raise Invalid(message=str(err)) from None

    def _stamp(self, request: rendering.Request) -> None:
        resource = request.resource
        assert resource is not None
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            if request.namespace:
                meta["namespace"] = request.namespace
            if resource.plural == "services":
                spec = request.data.setdefault("spec", {})
                spec.setdefault("clusterIP", f"10.96.{self._last_rv // 250 % 250}.{self._last_rv % 250 + 1}")
            _canonical_cpu(request.data)
            meta.update(
                uid=str(uuid.uuid4()),
                resourceVersion=self._next_rv(),
                generation=1,
                creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
        elif request.action == enums.action.UPDATE and isinstance(request.data, dict) and request.name:
            key = (resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                return  # the parent answers 404
            current = self.objects[key].raw
            ip = (request.data.get("spec") or {}).get("clusterIP", current.get("spec", {}).get("clusterIP"))
            if resource.plural == "services" and ip != current.get("spec", {}).get("clusterIP"):
                raise Invalid(message="Service spec.clusterIP: Invalid value: field is immutable")
            _canonical_cpu(request.data)
            meta = request.data["metadata"] = dict(request.data.get("metadata") or {})
            for immutable in ("uid", "creationTimestamp"):  # a real server ignores them in patches
                meta.pop(immutable, None)
            meta["resourceVersion"] = self._next_rv()
            new_spec = dicts.patch_dict(current, request.data).get("spec")
            generation = int(current.get("metadata", {}).get("generation", 1))
            changed = new_spec != current.get("spec") and request.subresource != "status"
            meta["generation"] = generation + 1 if changed else generation
        elif request.action == enums.action.DELETE and request.name:
            key = (resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                self.objects[key].patch({"metadata": {"resourceVersion": self._next_rv()}})

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_list(request)
        assert isinstance(payload, dict)
        payload["metadata"] = {"resourceVersion": str(self._last_rv)}
        return payload

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # send the headers now
        assert request.resource is not None
        bus = self._buses[request.resource]
        assert isinstance(bus, _HistoryBus)
        since = request.params.get("resourceVersion")
        async with self._lock:  # no event can slip between the backlog and the live stream
            mark = await bus.mark()
            if since:
                backlog = [e for e in bus.history if _rv(e) > int(since)]
            else:
                backlog = [
                    {"type": "ADDED", "object": copy.deepcopy(obj.raw)}
                    for (res, _, _), obj in self.objects.items()
                    if res == request.resource and not obj.deleted
                ]
        for event in backlog:
            if self._visible(request, event):
                yield event
        async for event in bus.stream(since=mark):
            if self._visible(request, event):
                yield event

    @staticmethod
    def _visible(request: rendering.Request, event: dict[str, Any]) -> bool:
        return request.namespace is None or event["object"]["metadata"].get("namespace") == request.namespace


class EmulatorThread:
    """Runs the emulator's HTTP server on loopback in its own thread and event loop."""

    def __init__(
        self, resources: dict[str, dict[str, Any]], factory: type[StampingEmulator] = StampingEmulator
    ) -> None:
        self._resources = resources
        self._factory = factory
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self.emulator: StampingEmulator | None = None
        self.port = 0

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the emulator did not start")
        return self

    def __exit__(self, *_: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with self._factory() as emulator, apps.Server(emulator) as server:
            with warnings.catch_warnings():  # kmock reads its bundled resources with a deprecated call
                warnings.simplefilter("ignore", DeprecationWarning)
                emulator.resources.load_bundled()
            for name, info in self._resources.items():
                emulator.resources[name] = references.ResourceInfo(**info)
            self.emulator, self.port = emulator, server.port
            self._ready.set()
            await self._stop.wait()

    def requests(self) -> list[rendering.Request]:
        """Every request served so far (a copy, safe to read from another thread)."""
        assert self.emulator is not None
        return list(self.emulator._requests)
