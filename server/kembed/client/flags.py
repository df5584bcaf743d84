"""Argument types the client's commands share."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from kembed.client.requests import PRIORITIES, TRUNCATION_DIRECTIONS, Prompt

Number = TypeVar("Number", int, float)


def at_least(kind: Callable[[str], Number], minimum: Number) -> Callable[[str], Number]:
    """An argparse type: a number of ``kind`` no smaller than ``minimum``."""

    def parse(value: str) -> Number:
        number = kind(value)
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return number

    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names it in "invalid int value"
    return parse


def add_dimensions(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dimensions", type=at_least(int, 0), default=0, help="0 (default): the model's")


def add_chunk(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chunk",
        action=argparse.BooleanOptionalAction,
        help="embed a text longer than the model's limit as chunks, their vectors averaged (--no-chunk: "
        "refuse or truncate it; neither: the server's default)",
    )


def add_truncation_direction(parser: argparse.ArgumentParser) -> None:
    # Without truncation it changes nothing, as the request's field changes nothing without truncate.
    parser.add_argument(
        "--truncation-direction",
        type=str.lower,  # in any case, as TEI writes it (Left) and the REST API takes it
        choices=TRUNCATION_DIRECTIONS,
        default="right",
        help="which end of a long text truncation cuts: right (default) keeps its start, left its end (its "
        "last tokens); with truncation off it changes nothing",
    )


def add_priority(parser: argparse.ArgumentParser, default: str) -> None:
    help = {
        "batch": "the requests' class (default batch: an ingest, which queries go ahead of)",
        "interactive": "the requests' class (default interactive: a caller waits; batch for an ingest)",
    }[default]
    parser.add_argument("--priority", choices=PRIORITIES, default=default, help=help)


INPUT_TYPES = ("query", "passage", "document")


def add_prompt(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prompt (at most one; none: the model's default prompt)")
    one = group.add_mutually_exclusive_group()
    one.add_argument("--prompt-name", default="", help="one of the model's prompts, by name (Info lists them)")
    one.add_argument("--prompt", help='the prompt\'s text itself, put before each text; "" for none')
    one.add_argument("--input-type", choices=INPUT_TYPES, default="", help="the model's prompt for that side")


def prompt_of(args: argparse.Namespace) -> Prompt:
    return Prompt(args.prompt_name, args.prompt, args.input_type)
