"""How ``KEMBED_*`` variables become settings (:func:`read_env`: an unknown name or a bad value is a
:class:`~kembed.config.values.ConfigError` naming the variable; a list from JSON or commas). The
operator reads its own settings so too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kembed.config.values import ConfigError


def env_list(value: Any) -> Any:
    """A list setting's variable: a JSON list, whose items may hold anything (`["[query]", ","]`), else
    comma-separated items, stripped, empty ones left out (`[query],[title]`)."""
    if not isinstance(value, str):
        return value
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError:  # `[query]` is no JSON: one comma-separated item
            items = None
        if isinstance(items, list):
            return items
    return [part.strip() for part in value.split(",") if part.strip()]


M = TypeVar("M", bound=BaseModel)


def read_env(
    model: type[M],
    prefix: str,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    besides: str = "",
) -> M:
    """A settings model from the variables ``prefix + FIELD`` (``besides``: a longer prefix that is
    someone else's); :class:`ConfigError` naming the variable for an unknown name or a bad value."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(prefix) or (besides and key.startswith(besides)):
            continue
        name = key[len(prefix) :].lower()
        if name not in model.model_fields:
            raise ConfigError(f"{key}: unknown setting")
        values[name] = raw
    values.update(overrides or {})
    try:
        return model(**values)
    except ValidationError as err:
        raise ConfigError(_describe(err, prefix)) from None


def _describe(err: ValidationError, prefix: str) -> str:
    problems = []
    for error in err.errors():
        loc = error["loc"]
        where = prefix + str(loc[0]).upper() if loc else "settings"
        problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems)
