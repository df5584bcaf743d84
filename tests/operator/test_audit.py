"""The audit's memory of deleted objects is bounded by what kopf's indexes still hold."""

from __future__ import annotations

from kembed_operator import audit


def body(uid: str) -> dict[str, dict[str, str]]:
    return {"metadata": {"uid": uid}}


def test_a_gone_uid_is_forgotten_once_no_index_holds_it() -> None:
    deployments = {("search", "bge"): [body("a"), body("b")]}
    services = {("search", "bge"): [body("c")]}
    audit._GONE.update({"a", "c", "z"})  # z: an object kopf has since dropped from its index
    try:
        audit.forget_released([deployments, services])
        assert sorted(audit._GONE) == ["a", "c"]
        assert [b["metadata"]["uid"] for b in audit.live(deployments[("search", "bge")])] == ["b"]
        del deployments[("search", "bge")]
        audit.forget_released([deployments, services])
        assert sorted(audit._GONE) == ["c"]
    finally:
        audit._GONE.clear()
