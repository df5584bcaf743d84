"""Prompts: text put before each input, as sentence-transformers does (``"query: " + text``, then
the two tokenized together), so that a model trained with instructions gets them.

A model folder declares its prompts, and which one applies when a request names none, in
``config_sentence_transformers.json`` (``prompts``, ``default_prompt_name``); ``KEMBED_PROMPTS``
and ``KEMBED_DEFAULT_PROMPT_NAME`` override them. A request picks at most one of ``prompt_name``
(one of the model's), ``prompt`` (literal text) and ``input_type`` (``query``, or ``passage``/
``document``: the model's prompt for that side, chosen as ``encode_query``/``encode_document``
choose it). Shared by the engine (what the model declares) and the front ends (what a request picks).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kembed.domain.errors import Field, InvalidInput

MAX_PROMPT_CHARS = 1024  # a prompt's text: an instruction, not a document
MAX_PROMPTS = 64
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"  # also the CRDs' pattern for a prompt name
_NAME = re.compile(NAME_PATTERN)  # used with fullmatch: "$" alone matches before a final newline
ST_CONFIG = "config_sentence_transformers.json"
# An input type's prompt: the first of these names the model declares (sentence-transformers'
# encode_query and encode_document look for the same names).
INPUT_TYPES: dict[str, tuple[str, ...]] = {
    "query": ("query",),
    "passage": ("document", "passage", "corpus"),
    "document": ("document", "passage", "corpus"),
}


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a prompt's name, or None."""
    return None if _NAME.fullmatch(name) else f"prompt name {name[:64]!r} must match {NAME_PATTERN}"


def problem(prompts: Mapping[str, Any], default: str) -> str | None:
    """What is wrong with a model's prompts and default prompt name (empty: none), or None."""
    if len(prompts) > MAX_PROMPTS:
        return f"{len(prompts)} prompts, at most {MAX_PROMPTS}"
    for name, text in prompts.items():
        if (reason := name_problem(name)) is not None:
            return reason
        if not isinstance(text, str) or len(text) > MAX_PROMPT_CHARS:
            return f"prompt {name!r} must be text of at most {MAX_PROMPT_CHARS} characters"
    if default and default not in prompts:
        return f"default prompt name {default!r} is not one of the prompts ({', '.join(prompts) or 'none'})"
    return None


@dataclass(frozen=True, slots=True)
class ModelPrompts:
    """The prompts a model serves with, by name, and the one applied when a request picks none."""

    prompts: dict[str, str]
    default_name: str = ""  # empty: none

    @classmethod
    def of(cls, folder: Path, overrides: dict[str, str] | None, default_name: str) -> ModelPrompts:
        """The folder's prompts, or ``overrides``; the folder's default, or ``default_name``. Raises
        ValueError naming what is wrong."""
        path = folder / ST_CONFIG
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        declared = config.get("prompts") or {}
        if not isinstance(declared, dict):
            raise ValueError(f"{path}: prompts must be an object of names to texts")
        prompts = declared if overrides is None else overrides
        default = default_name or (config.get("default_prompt_name") or "")
        if (reason := problem(prompts, default)) is not None:
            raise ValueError(reason)
        return cls(dict(prompts), default)

    def text(self, choice: PromptChoice) -> str:
        """The text put before each of a request's texts (empty: none)."""
        if choice.text is not None:
            return choice.text
        if choice.name:
            if choice.name not in self.prompts:
                reason = f"{choice.name!r} is not one of this model's prompts ({self._known})"
                raise InvalidInput(Field.PROMPT_NAME, reason)
            return self.prompts[choice.name]
        if choice.input_type:
            name = next((n for n in INPUT_TYPES[choice.input_type] if n in self.prompts), None)
            if name is None:
                names = " or ".join(INPUT_TYPES[choice.input_type])
                reason = f"{choice.input_type!r}: this model declares no prompt named {names} ({self._known})"
                raise InvalidInput(Field.INPUT_TYPE, reason)
            return self.prompts[name]
        return self.prompts.get(self.default_name, "")

    @property
    def _known(self) -> str:
        return f"its prompts: {', '.join(self.prompts)}" if self.prompts else "it declares none"


@dataclass(frozen=True, slots=True)
class PromptChoice:
    """What a request asked for: at most one of a prompt's name, a literal prompt and an input type."""

    name: str = ""
    text: str | None = None  # "" is no prompt, not even the default
    input_type: str = ""

    @property
    def given(self) -> list[Field]:
        """The fields the request set, in the API's order."""
        which = {
            Field.PROMPT_NAME: bool(self.name),
            Field.PROMPT: self.text is not None,
            Field.INPUT_TYPE: bool(self.input_type),
        }
        return [field for field, is_set in which.items() if is_set]

    def check(self) -> None:
        """What needs no model: one choice at most, a bounded text, a name that could be one, a known type."""
        given = self.given
        if len(given) > 1:
            both = f"set together with {given[0]}: set at most one of prompt_name, prompt, input_type"
            raise InvalidInput(given[1], both)
        if self.text is not None and len(self.text) > MAX_PROMPT_CHARS:
            raise InvalidInput(Field.PROMPT, f"{len(self.text)} characters, more than {MAX_PROMPT_CHARS}")
        if self.name and (reason := name_problem(self.name)) is not None:
            raise InvalidInput(Field.PROMPT_NAME, reason)
        if self.input_type and self.input_type not in INPUT_TYPES:
            raise InvalidInput(Field.INPUT_TYPE, f"{self.input_type[:64]!r} is not one of {', '.join(INPUT_TYPES)}")


NO_CHOICE = PromptChoice()  # a request that picks no prompt: the model's default applies
