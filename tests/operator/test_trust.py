"""Who may do what: the images a spec may name, and the operator's own settings from the chart."""

from __future__ import annotations

import json

import pytest

from kembed_operator import trust
from kembed_operator.config import PREFIX, OperatorConfig
from kembed_operator.spec import InvalidSpec, parse_spec

DEFAULT = "registry.example/kembed/kembed-server:1.0"

IMAGES = {
    # allowed patterns, the spec's image: allowed
    "no image named: the default": ((), "", True),
    "the default named again": ((), DEFAULT, True),
    "no patterns: nothing else": ((), "registry.example/kembed/kembed-server:1.1", False),
    "a repository's tags": (
        ("registry.example/kembed/kembed-server:*",),
        "registry.example/kembed/kembed-server:1.1",
        True,
    ),
    "a repository's digests": (
        ("registry.example/kembed/kembed-server@sha256:*",),
        "registry.example/kembed/kembed-server@sha256:" + "a" * 64,
        True,
    ),
    "the whole reference must match": (
        ("registry.example/kembed/*",),
        "evil.example/registry.example/kembed/x:1",
        False,
    ),
    "a lookalike registry": (("registry.example/kembed/*",), "registry.example.evil/kembed/x:1", False),
    "a lookalike path": (("registry.example/kembed/*",), "registry.example/kembedevil/x:1", False),
    "* spans paths": (("registry.example/kembed/*",), "registry.example/kembed/team/x:1", True),
    "any": (("*",), "docker.io/library/python:3", True),
    "one of several": (("a.example/*", "b.example/*"), "b.example/x:1", True),
}


@pytest.mark.parametrize(("patterns", "image", "allowed"), IMAGES.values(), ids=IMAGES.keys())
def test_images(patterns: tuple[str, ...], image: str, allowed: bool) -> None:
    config = OperatorConfig(default_image=DEFAULT, allowed_images=patterns)
    spec = parse_spec({"image": image})
    if allowed:
        trust.check_image(spec, config)
        return
    with pytest.raises(trust.ImageNotAllowed, match=r"spec\.image") as refused:
        trust.check_image(spec, config)
    assert isinstance(refused.value, InvalidSpec) and refused.value.reason == "ImageNotAllowed"
    assert image in str(refused.value) and DEFAULT in str(refused.value)


def test_settings_from_the_chart() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    config = OperatorConfig.from_env(
        {PREFIX + "ALLOWED_IMAGES": " a.example/*, b.example/x:* ,", PREFIX + "METRICS_FROM": json.dumps(peers)}
    )
    assert config.allowed_images == ("a.example/*", "b.example/x:*")
    assert config.metrics_from == tuple(peers)
    assert OperatorConfig.from_env({}) == OperatorConfig()


@pytest.mark.parametrize(
    "text", ["{", '{"podSelector": {}}', "[1]", "[{}]", '[{"podSelector": {}, "ports": []}]'], ids=str
)
def test_malformed_metrics_peers_name_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match=PREFIX + "METRICS_FROM"):
        OperatorConfig.from_env({PREFIX + "METRICS_FROM": text})
