"""What a watch gap hides: objects kopf's indexes still hold that the API server has deleted.

When a resumed watch is answered ``410 Gone``, kopf lists the resource again and feeds what it
lists to its indexes, but does not compare the list with them (client-go's informers do, in
``Replace``): an object deleted while the watch was down stays in the indexes, and no event ever
says it went. So the operator audits: it lists the uids of the objects its indexes hold (metadata
only, one list per kind) and compares. What the API server no longer has is marked gone, reads
skip it from then on (kopf never drops it), and its owner's loop is woken to make it again.

An audit runs soon after kopf re-lists a resource (kopf hands each listed object to the event
handlers as an event of type None), and every :data:`AUDIT_S` in any case: a re-list that found
nothing sends no event at all. Only objects whose owner's loop runs here are audited, so a replica
standing by lists nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kembed_operator import kube
from kembed_operator.kinds import Kind, Manifest

AUDIT_S = 30.0  # for a re-list that came back empty; one with objects in it is audited SETTLE_S after
SETTLE_S = 1.0  # a re-list sends one event per object: one audit for the lot
_GONE: set[str] = set()  # uids the indexes hold that the API server deleted (uids are never reused)
_RELISTED = asyncio.Event()
_LOG = logging.getLogger(__name__)

OwnerKey = tuple[str, str]  # (namespace, owner name): how the indexes file what they hold
Owned = Callable[[Kind, str, str], bool]  # whether the owner's loop runs here
Wake = Callable[[Kind, str, str], None]


@dataclass(frozen=True)
class Watched:
    """One kind the operator watches and indexes by owner, as the audit lists it."""

    kind: Kind
    index: Mapping[Any, Iterable[Manifest]]  # kopf's index: (namespace, owner name) -> objects
    labels: Mapping[str, str]  # the watch's label selector
    owner: Kind


def live(held: Iterable[Manifest]) -> Iterator[Manifest]:
    """What an index holds, less what an audit found deleted."""
    return (body for body in held if body.get("metadata", {}).get("uid") not in _GONE)


def forget_released(indexes: Iterable[Mapping[Any, Iterable[Manifest]]]) -> None:
    """Forget the gone uids no index holds any more (kopf dropped the object after all, say on a
    later deletion event): the set stays no larger than what the indexes still hold."""
    bodies = (body for index in indexes for owned in list(index.values()) for body in owned)
    _GONE.intersection_update({body.get("metadata", {}).get("uid") for body in bodies})


def relisted() -> None:
    """kopf has listed a resource again: audit soon."""
    _RELISTED.set()


@dataclass(frozen=True)
class Auditor:
    """Audits the kinds it watches for as long as :meth:`run` runs."""

    watched: list[Watched]
    client: kube.KubeClient
    clusterwide: bool  # one list per kind for every namespace, else one per namespace audited
    owned: Owned
    wake: Wake

    async def run(self) -> None:
        """Audit after every re-list and every :data:`AUDIT_S`; a failed audit waits for the next round."""
        while True:
            try:
                async with asyncio.timeout(AUDIT_S):
                    await _RELISTED.wait()
                await asyncio.sleep(SETTLE_S)
            except TimeoutError:
                pass
            _RELISTED.clear()
            for one in self.watched:
                try:
                    await self.audit(one)
                except Exception as err:  # an API error: the next round lists again
                    _LOG.warning("auditing %s failed, will retry: %r", one.kind.plural, err)
            forget_released(one.index for one in self.watched)

    async def audit(self, one: Watched) -> None:
        """Mark gone what the index holds and the API server lacks, and wake its owners.

        What the index holds is read before the list is asked for, and the list is consistent (no
        resourceVersion), so an object missing from it was deleted: it cannot be one made meanwhile."""
        held: dict[str, OwnerKey] = {
            body["metadata"]["uid"]: (namespace, name)
            for (namespace, name), bodies in list(one.index.items())
            if self.owned(one.owner, namespace, name)
            for body in live(bodies)
        }
        if not held:
            return
        scopes = [""] if self.clusterwide else sorted({namespace for namespace, _ in held.values()})
        present: set[str] = set()
        for namespace in scopes:
            present |= await asyncio.to_thread(self.client.uids, one.kind, namespace, one.labels)
        for uid, (namespace, name) in held.items():
            if uid not in present:
                _GONE.add(uid)
                _LOG.info("%s of %s/%s deleted unseen (a watch gap): waking its loop", one.kind.kind, namespace, name)
                self.wake(one.owner, namespace, name)
