"""Many EmbeddingServices created at once, against one real `kopf run`: time to converge, API calls
per resource, the operator's memory, and quiet once converged.

`make test` runs 20; `KEMBED_SCALE_N=200 .venv/bin/python -m pytest tests/operator/test_scale.py -s`
runs the issue's 200 (docs/operator.md records the figures; KEMBED_SCALE_QUIET_S=180 watches
for writes at rest over three minutes instead of 10 s). The time to converge is printed, not
asserted (a busy machine is slower, not wrong): what is asserted is that everything converges,
how many API calls it took, and that nothing is written once it has.
"""

from __future__ import annotations

import collections
import os
import subprocess
import time
from pathlib import Path

import pytest
from kubernetes import client

from tests.operator.cluster import DEPLOYMENTS, HPAS, PDBS, SERVICES, Kube, condition, operator_calls, operator_writes
from tests.operator.conftest import wait_for
from tests.operator.emulator import EmulatorThread

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]
N = int(os.environ.get("KEMBED_SCALE_N", "20"))
CONVERGE_TIMEOUT_S = 300.0 + 3.0 * N  # a hang, not a speed: converging takes about 10 s for 200 here
QUIET_S = float(os.environ.get("KEMBED_SCALE_QUIET_S", "10"))  # the window with nothing changing


def all_converged(kube: Kube) -> bool:
    kube.roll_out()
    counts = collections.Counter(
        c["metadata"]["name"] for p in (DEPLOYMENTS, SERVICES, PDBS, HPAS) for c in kube.children(p)
    )
    ready = [es for es in kube.all_es() if condition(es, "Ready").get("status") == "True"]
    return len(ready) == N and len(counts) == N and set(counts.values()) == {4}


def memory_kib(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}


def test_many_resources_converge_with_few_calls_and_then_stay_quiet(
    api: client.ApiClient, emulator: EmulatorThread, operator_process: subprocess.Popen[bytes]
) -> None:
    kube = Kube(api)
    mark, started = len(emulator.requests()), time.monotonic()
    for index in range(N):
        kube.create_es(f"es-{index:03d}", maxReplicas=2, resources={"gpu": 0})
    wait_for(f"{N} resources converged", lambda: all_converged(kube), timeout=CONVERGE_TIMEOUT_S, interval=1.0)
    elapsed = time.monotonic() - started
    calls = collections.Counter((verb, resource) for _, resource, verb in operator_calls(emulator.requests()[mark:]))
    memory = memory_kib(operator_process.pid)

    quiet_mark = len(emulator.requests())
    time.sleep(QUIET_S)
    at_rest = operator_writes(emulator.requests()[quiet_mark:])

    per_resource = {f"{verb} {resource}": round(count / N, 2) for (verb, resource), count in sorted(calls.items())}
    print(f"\n{N} resources converged (Ready) in {elapsed:.1f} s; operator memory {memory} KiB")
    print(f"API calls per resource: {per_resource}; writes over {QUIET_S:.0f} s at rest: {len(at_rest)}")
    assert at_rest == []
    # Reads come from kopf's indexes: a GET only on a retry after a failure (none expected here).
    assert sum(count for (verb, _), count in calls.items() if verb == "get") <= 0.1 * N
    assert all(calls["create", plural.split("/")[-1]] == N for plural in (DEPLOYMENTS, SERVICES, PDBS, HPAS)), calls
