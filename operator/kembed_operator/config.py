"""The operator's own configuration, from ``KEMBED_OPERATOR_*`` environment variables (set by the chart),
and the choices a spec makes among fixed values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

PREFIX = "KEMBED_OPERATOR_"


class Pooling(StrEnum):
    AUTO = "auto"  # from the model folder's sentence-transformers config
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


class Dtype(StrEnum):
    AUTO = "auto"  # the server's choice: bf16 on CUDA, fp32 on CPU
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


@dataclass(frozen=True)
class OperatorConfig:
    default_image: str = "ghcr.io/kembed/kembed-server:0.1.0"
    keda_server_address: str = ""  # the Prometheus that KEDA queries when a spec names none
    peering_lifetime_s: int = 60  # how long a silent leader holds its lease before a standby takes over

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            default_image=env.get(PREFIX + "DEFAULT_IMAGE", defaults.default_image),
            keda_server_address=env.get(PREFIX + "KEDA_SERVER_ADDRESS", defaults.keda_server_address),
            peering_lifetime_s=int(env.get(PREFIX + "PEERING_LIFETIME_S", defaults.peering_lifetime_s)),
        )
