"""The compile-cache volume and the startup probe's budget, per warmup mechanism (measured or assumed)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kembed.config.settings import Settings
from kembed.contract import env_name
from kembed_operator import render, startup
from kembed_operator.spec import parse_spec
from tests.operator.test_render import children, container, env

# Measured on an H100, torch 2.11: MiniLM (256 input tokens) warmed 35 shapes, ready 186 s after start.
MEASURED_SHAPES = 35
MEASURED_READY_S = 186
MINILM_BUCKETS = [16, 32, 64, 128, 256]  # the default ladder clipped to MiniLM's 256 tokens


def pod(spec: dict[str, Any]) -> dict[str, Any]:
    return dict(children(spec)["Deployment"]["spec"]["template"]["spec"])


def probe_seconds(spec: dict[str, Any]) -> int:
    probe = container(spec)["startupProbe"]
    return int(probe["periodSeconds"] * probe["failureThreshold"])


def compile_cache_volume(spec: dict[str, Any]) -> dict[str, Any] | None:
    return next((v for v in pod(spec)["volumes"] if v["name"] == "compile-cache"), None)


def test_the_compile_cache_is_an_empty_dir_mounted_where_the_server_looks() -> None:
    volume = compile_cache_volume({})
    assert volume is not None and "emptyDir" in volume  # survives container restarts
    mounts = {m["name"]: m["mountPath"] for m in container({})["volumeMounts"]}
    assert env({})[env_name("compile_cache_dir")] == mounts["compile-cache"]
    assert Settings.from_env(env({})).compile_cache_dir == mounts["compile-cache"]


def test_the_compile_cache_can_be_a_pvc_or_off() -> None:
    on_pvc = {"compileCache": {"claimName": "kembed-compile"}}
    volume = compile_cache_volume(on_pvc)
    assert volume == {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "kembed-compile"}}
    off = {"compileCache": {"enabled": False}}
    assert compile_cache_volume(off) is None
    assert env_name("compile_cache_dir") not in env(off)
    assert "compile-cache" not in {m["name"] for m in container(off)["volumeMounts"]}


def test_the_shape_count_matches_what_the_server_warmed_on_the_gpu() -> None:
    settings = Settings.from_env({}, buckets=MINILM_BUCKETS)
    assert startup.warmup_shapes(settings, "cuda") == MEASURED_SHAPES
    assert startup.warmup_shapes(settings, "cpu") == len(MINILM_BUCKETS)  # eager: one shape a bucket


def test_the_static_budget_covers_the_measured_cold_start_and_grows_with_the_shapes() -> None:
    measured = Settings.from_env({}, buckets=MINILM_BUCKETS, graphs="static")
    assert startup.startup_budget_seconds(measured, "cuda") >= MEASURED_READY_S
    fewer = Settings.from_env({}, buckets=MINILM_BUCKETS, graphs="static", max_batch_size=8)
    extra = startup.warmup_shapes(measured, "cuda") - startup.warmup_shapes(fewer, "cuda")
    grown = startup.startup_budget_seconds(measured, "cuda") - startup.startup_budget_seconds(fewer, "cuda")
    expected = startup.SAFETY_FACTOR * startup.STATIC.per_shape_s * extra
    assert extra > 0 and grown == pytest.approx(expected, abs=1)
    naive = Settings.from_env({}, buckets=MINILM_BUCKETS, batching="naive")
    assert startup.startup_budget_seconds(naive, "cuda") < startup.startup_budget_seconds(measured, "cuda")


def budget(cost: startup.WarmupCost, shapes: int) -> int:
    return math.ceil(startup.SAFETY_FACTOR * (startup.LOAD_SECONDS + cost.once_s + cost.per_shape_s * shapes))


MECHANISMS = {
    # (settings, device): the cost the server's warmup pays
    "capture on a GPU (the default)": ({}, "cuda", startup.ASSUMED_CAPTURE),
    "static on a GPU": ({"graphs": "static"}, "cuda", startup.STATIC),
    "static on a CPU compiles per shape": ({"compile": "on", "graphs": "static"}, "cpu", startup.STATIC),
    "a CPU compiles its forward once it serves (auto)": ({}, "cpu", startup.EAGER),
    "a CPU compiles its forward once it serves (on)": ({"compile": "on"}, "cpu", startup.EAGER),
    "eager on a CPU": ({"compile": "off"}, "cpu", startup.EAGER),
    "naive batching on a CPU never compiles": ({"batching": "naive"}, "cpu", startup.EAGER),
    "compile off on a GPU": ({"compile": "off"}, "cuda", startup.EAGER),
    "naive batching never compiles": ({"batching": "naive"}, "cuda", startup.EAGER),
}


@pytest.mark.parametrize(("overrides", "device", "cost"), MECHANISMS.values(), ids=MECHANISMS.keys())
def test_the_budget_follows_the_warmup_mechanism(
    overrides: dict[str, str], device: str, cost: startup.WarmupCost
) -> None:
    settings = Settings.from_env({}, **overrides)
    assert startup.warmup_cost(settings, device) == cost
    shapes = startup.warmup_shapes(settings, device)
    assert startup.startup_budget_seconds(settings, device) == budget(cost, shapes)


def test_capture_pays_its_compile_once_so_it_is_cheaper_than_static_past_a_few_shapes() -> None:
    capture = Settings.from_env({})
    static = Settings.from_env({}, graphs="static")
    shapes = startup.warmup_shapes(capture, "cuda")
    assert shapes == startup.warmup_shapes(static, "cuda") == 41  # the default GPU plan
    assert startup.startup_budget_seconds(capture, "cuda") < startup.startup_budget_seconds(static, "cuda")
    # The assumed figures, spelt out: 2 x (20 s load + 60 s compile + 41 x 1 s captures).
    assert startup.startup_budget_seconds(capture, "cuda") == 242


def test_the_probe_follows_the_spec_and_its_device() -> None:
    gpu: dict[str, Any] = {}
    cpu: dict[str, Any] = {"resources": {"gpu": 0}}
    for spec, device in ((gpu, "cuda"), (cpu, "cpu")):
        budget = startup.startup_budget_seconds(Settings.from_env(env(spec)), device)
        assert budget <= probe_seconds(spec) < budget + render.STARTUP_PERIOD_S
    assert probe_seconds(cpu) < probe_seconds(gpu)  # a CPU warms up eager; it compiles once it serves
    smaller = {"batching": {"buckets": [16, 32], "maxBatchSize": 8}}
    assert probe_seconds(smaller) < probe_seconds(gpu)
    assert probe_seconds({"startupTimeoutSeconds": 1234}) >= 1234
    settings = Settings.from_env(env({}))
    assert render.startup_seconds(parse_spec({"startupTimeoutSeconds": 1234}), settings) == 1234


def test_the_probe_follows_the_graph_mode_set_in_env() -> None:
    """``KEMBED_GRAPHS`` has no spec field: set through spec.env, it changes the budget as well."""
    static = {"env": [{"name": "KEMBED_GRAPHS", "value": "static"}]}
    static_budget = startup.startup_budget_seconds(Settings.from_env(env({}), graphs="static"), "cuda")
    assert static_budget <= probe_seconds(static) < static_budget + render.STARTUP_PERIOD_S
    assert probe_seconds({}) < probe_seconds(static)
