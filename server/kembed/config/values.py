"""The kinds of value a setting takes (its enums), the error a bad one raises, who sets a setting
(:class:`Group`), and the CPUs a process may use: what :mod:`kembed.config.settings` declares its
fields with, and what the processes read off them.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Final

from pydantic.config import JsonDict

MAX_FRONTENDS = 64
AUTO_MAX_FRONTENDS = 8
# auto: two CPUs for the engine (its event loop and the worker thread), then one front end per two
# CPUs (a busy front end takes about a core on its event loop plus gRPC's poller and tokenizer
# threads), from 1 to 8. On 2 CPUs one front end measured faster than two (docs/decisions/cpu-sizing.md).
ENGINE_CPUS = 2
CPUS_PER_FRONTEND = 2


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus(request_millicores: int = 0, cpu_max: Path | None = None) -> float:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a pod's limit) and
    by the container's CPU request (``request_millicores``, 0 = none): a pod without a CPU limit
    sees the node's cores, but was scheduled for its request."""
    cpus = float(len(os.sched_getaffinity(0)))
    if request_millicores:
        cpus = min(cpus, request_millicores / 1000)
    try:
        quota, period = (cpu_max or CGROUP_CPU_MAX).read_text().split()
    except (OSError, ValueError):
        return cpus
    return cpus if quota == "max" else min(cpus, int(quota) / int(period))


def frontends_for(cpus: float) -> int:
    """How many front ends ``KEMBED_FRONTENDS=auto`` starts on this many CPUs (docs/decisions/cpu-sizing.md)."""
    return max(1, min(AUTO_MAX_FRONTENDS, (int(cpus) - ENGINE_CPUS) // CPUS_PER_FRONTEND))


class ConfigError(ValueError):
    """A setting is invalid; the message names the ``KEMBED_*`` variable."""


class Batching(StrEnum):
    TOKEN_BUCKET = "token_bucket"  # per-item length buckets, fixed batch shapes
    NAIVE = "naive"  # whatever is queued, padded to the longest: the ablation baseline


class Admission(StrEnum):
    THROUGHPUT = "throughput"
    LATENCY = "latency"


class Toggle(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class Pooling(StrEnum):
    AUTO = "auto"  # from the model folder's sentence-transformers config
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


class Dtype(StrEnum):
    AUTO = "auto"  # bf16 on CUDA; on a CPU, bf16 where it has bf16 units and warmup finds it faster and accurate
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class Warmup(StrEnum):
    AUTO = "auto"  # grid when compiling (always: graphs must be captured), else largest
    GRID = "grid"  # every (bucket, batch size) shape
    LARGEST = "largest"  # the largest batch of every bucket: enough to seed the service rate


class Graphs(StrEnum):
    CAPTURE = "capture"  # one dynamic-shape compile, a torch.cuda.CUDAGraph captured per planned shape
    STATIC = "static"  # a reduce-overhead compile per planned shape (the mechanism measured first)


class Group(StrEnum):
    """Who sets a setting, which is how the settings table is split."""

    USER = "user"  # the model, binds and ports, TLS, logging, the latency targets
    TUNING = "tuning"  # batching, admission and limits: defaults measured to hold, changed with a reason
    OPERATOR = "operator"  # facts about the pod, which the operator renders from it


# Each field's group, as its json_schema_extra (read by group_of).
USER: Final[JsonDict] = {"group": Group.USER.value}
TUNING: Final[JsonDict] = {"group": Group.TUNING.value}
OPERATOR: Final[JsonDict] = {"group": Group.OPERATOR.value}
