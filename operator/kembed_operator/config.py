"""The operator's own configuration, from ``KEMBED_OPERATOR_*`` environment variables (set by the chart)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "KEMBED_OPERATOR_"


@dataclass(frozen=True)
class OperatorConfig:
    default_image: str = "ghcr.io/kembed/kembed-server:0.1.0"
    keda_server_address: str = ""  # the Prometheus that KEDA queries when a spec names none

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            default_image=env.get(PREFIX + "DEFAULT_IMAGE", defaults.default_image),
            keda_server_address=env.get(PREFIX + "KEDA_SERVER_ADDRESS", defaults.keda_server_address),
        )
