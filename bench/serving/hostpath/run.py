"""The host path run: the chosen parts in turn, judged and written (``python -m bench.serving.hostpath``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from bench import headline
from bench.serving.hostpath.deadlines import short_deadlines
from bench.serving.hostpath.engine_bound import engine_bound
from bench.serving.hostpath.gpu_serve import serve
from bench.serving.hostpath.host_path import host_path, rest
from bench.serving.hostpath.measure import BURST_TOKENS, SHORT_TOKENS, Options, parse_options
from bench.serving.hostpath.overload import rejection, retry_storm, spikes
from bench.tools import machine, workload


def run(opts: Options) -> dict[str, Any]:
    """Every part in ``opts.parts``, each server started and stopped in turn; writes ``hostpath.json``."""
    wl = workload.load()
    short = [t for t, n in zip(wl.texts, wl.tokens, strict=True) if n <= SHORT_TOKENS]
    about_60_words = [t for t, n in zip(wl.texts, wl.tokens, strict=True) if BURST_TOKENS[0] < n <= BURST_TOKENS[1]]
    result: dict[str, Any] = {"settings": asdict(opts), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"hostpath: {', '.join(opts.parts)}; load average {result['loadavg_at_start']}")
    if "host_path" in opts.parts:
        result["host_path"] = host_path(opts, short)
    if "rejection" in opts.parts:
        result["rejection"] = rejection(opts, about_60_words)
    if "rest" in opts.parts:
        result["rest"] = rest(opts, short)
    if "engine_bound" in opts.parts:
        result["engine_bound"] = engine_bound(opts, short)
    if "storm" in opts.parts:
        result["retry_storm"] = retry_storm(opts, wl.texts)
    if "spikes" in opts.parts:
        result["spikes"] = spikes(opts, wl.texts)
    if "deadlines" in opts.parts:
        result["short_deadlines"] = short_deadlines(opts, [t for t in wl.texts if 32 <= len(t.split()) <= 48])
    if "serve" in opts.parts:
        result["serve"] = serve(opts, wl.texts)
    machine.write_judged(opts.name, result, headline.hostpath_ratios(result), wl.describe())
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_options(argv))
