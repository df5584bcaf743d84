"""The CPU limits' machinery (``bench.compute.limits``), the start-up bench's parsing, and how the headline
judges the server against sentence-transformers, the compiled ceiling, Infinity and its start-up."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from bench import headline, plot
from bench.compute import batches, inprocess, limits
from bench.serving import startup
from bench.tools import machine, workload
from bench.tools.report import Spread, ratio_table
from kembed.engine import cpu


def test_sentence_transformers_batches_follow_its_own_length_order() -> None:
    texts = ["a", "abc", "ab", "abcd", "x"]
    groups = limits.st_groups(texts, 2)
    assert groups == [[3, 1], [2, 0], [4]]
    measured = [SentenceTransformer._input_length(texts[i]) for group in groups for i in group]
    assert measured == sorted(measured, reverse=True)  # longest first, as its encode sorts


def _batch(rows: int, length: int) -> batches.PaddedBatch:
    ids = torch.ones(rows, length, dtype=torch.int64)
    return batches.PaddedBatch(ids, torch.ones_like(ids), rows, rows * length)


def test_a_timed_pass_runs_every_batch_once_a_round_at_a_time_in_the_lanes() -> None:
    st_calls: list[list[int]] = []
    computed: list[tuple[str, int, int]] = []  # (forward, rows, the lane's threads)
    lock = threading.Lock()

    def forward_of(name: str) -> inprocess.Forward:
        def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            with lock:
                computed.append((name, int(ids.shape[0]), torch.get_num_threads()))
            return torch.zeros(ids.shape[0], 4)

        return forward

    batches = [_batch(rows, 8) for rows in (1, 2, 3)]
    kembed = {name: limits.Kembed(forward_of(name), batches, [[0]] * 3) for name in ("eager", "compiled")}
    st_batches = [[0], [1], [2], [3], [4]]

    def st(group: list[int]) -> float:
        st_calls.append(group)
        return 0.5

    with ThreadPoolExecutor(2, initializer=cpu.enter_lane, initargs=(1,)) as lanes:
        seconds = limits.timed_pass(st, st_batches, kembed, lanes, rounds=2)
    assert st_calls == [[0], [2], [4], [1], [3]]  # round 0's slice, then round 1's
    assert seconds["st_encode"] == [0.5] * 5
    assert sorted(computed) == sorted((name, rows, 1) for name in kembed for rows in (1, 2, 3))
    assert all(len(s) == 3 and min(s) >= 0 for name, s in seconds.items() if name != "st_encode")


def test_vectors_go_back_to_their_texts() -> None:
    outputs = [np.array([[2.0], [0.0]]), np.array([[1.0], [9.0]])]  # the second batch has a padded row
    assert limits._vectors(3, [[2, 0], [1]], outputs).ravel().tolist() == [0.0, 1.0, 2.0]


MACHINE = {"cpu": "Test CPU", "cores": 2, "cpu_flags": ["avx512_bf16", "amx_bf16"], "time_utc": "2026-11-26T10:00:00Z"}


def _contender(rate: float, cosine: float = 0.9999) -> dict[str, Any]:
    spread = Spread(rate, rate * 0.95, rate * 1.05).to_dict()
    return {"emb_per_s": spread, "tokens_per_s": spread, "min_cosine_to_st_fp32": cosine, "batches": 3}


def _ceiling(st: float, eager: float, compiled: float, cosine: float = 0.9999) -> dict[str, Any]:
    return {
        "machine": MACHINE,
        "limits": {
            "texts": 1024,
            "passes": 2,
            "lanes": 2,
            "lane_threads": 1,
            "st_threads": 2,
            "dtype": "torch.bfloat16",
            "st_encode": {**_contender(st), "batch_size": 32, "version": "6.2.0"},
            "eager": _contender(eager),
            "compiled": {**_contender(compiled, cosine), "compile_s": 41.0, "recompiles_after_warmup": 0},
        },
    }


def _serve(rate: float, texts: int, callers: int, padding: float = 0.05) -> dict[str, Any]:
    phase = {"emb_per_s": Spread(rate, rate, rate).to_dict(), "padding_ratio": padding}
    options = {"texts_per_call": texts, "concurrency": callers}
    return {
        "saturation": phase,
        "options": options,
        "dtype": "torch.bfloat16",
        "forward": "compiled",
        "machine": MACHINE,
    }


def _hostpath(kembed: float, infinity: float) -> dict[str, Any]:
    def calls(rate: float) -> dict[str, Any]:
        return {"calls_per_s": Spread(rate, rate, rate).to_dict(), "dtype": "bfloat16"}

    return {"rest": {"peer": {"peer": "infinity-emb 0.0.78", "kembed": calls(kembed), "infinity": calls(infinity)}}}


def _startup(cold: list[float], warm: list[float]) -> dict[str, Any]:
    def start(seconds: float) -> dict[str, Any]:
        return {"ready_s": seconds, "forward": "compiled", "forward_reason": "auto: 1.2x", "dtype": "torch.bfloat16"}

    return {"rounds": [{"cold": start(c), "warm": start(w)} for c, w in zip(cold, warm, strict=True)]}


def test_the_server_is_judged_against_sentence_transformers_the_compiled_ceiling_and_infinity() -> None:
    rows = headline.cpu_ratios(
        _ceiling(st=100, eager=150, compiled=180),
        _serve(170, texts=1, callers=32),
        _serve(130, texts=16, callers=16),
        _hostpath(kembed=600, infinity=200),
        _startup(cold=[38, 44, 39], warm=[16, 12, 14]),
    )
    by_name = {r.name: r for r in rows}
    encode = "sentence-transformers encode (sorted, batch 32, torch.bfloat16) (emb/s)"
    one = by_name[f"1 text a call, 32 callers: kembed / {encode}"]
    assert one.value.median == pytest.approx(1.7) and one.target == ">= 1.10" and one.met() is True
    many = by_name[f"16 texts a call, 16 callers: kembed / {encode}"]
    assert many.value.median == pytest.approx(1.3) and many.met() is True
    compiled = by_name["1 text a call, 32 callers: kembed / compiled in-process ceiling (emb/s)"]
    assert compiled.value.median == pytest.approx(170 / 180) and compiled.met() is True
    peer = by_name["REST, 1 text a call: kembed / infinity-emb 0.0.78 in its bfloat16 (calls/s)"]
    assert peer.value.median == pytest.approx(3.0) and peer.met() is True
    cold = by_name["Ready after start (s), default settings, an empty compile cache"]
    assert cold.value.median == 39 and (cold.value.lo, cold.value.hi) == (38, 44) and cold.met() is True
    assert by_name["Ready after start (s), default settings, the compile cache the cold start filled"].met() is True
    assert by_name["Padding share of computed tokens, 1 text a call, 32 callers"].met() is True
    assert all(r.met() for r in rows if r.name.startswith("Min cosine"))
    assert "| 0.99990 | >= 0.999 | yes |" in ratio_table(rows)  # a cosine shown finer than its target
    assert "| 1.70 (1.62–1.79) | >= 1.10 | yes |" in ratio_table(rows)
    assert by_name["Compiled in-process ceiling / eager, same batches and lanes (emb/s)"].met() is None


def test_each_target_can_be_missed_and_a_missing_result_leaves_its_rows_out() -> None:
    rows = headline.cpu_ratios(
        _ceiling(st=100, eager=150, compiled=200, cosine=0.998),
        _serve(105, texts=1, callers=32, padding=0.09),
        None,
        _hostpath(kembed=500, infinity=200),
        _startup(cold=[41], warm=[16]),
    )
    missed = {r.name for r in rows if r.met() is False}
    assert len(missed) == 7, missed  # ST, compiled ceiling, Infinity, compiled cosine, padding, cold, warm
    assert not any(r.name.startswith("16 texts") for r in rows)
    only_ceiling = headline.cpu_ratios(_ceiling(100, 150, 180), None, None, None, None)
    assert [r.name.split(",")[0] for r in only_ceiling][:2] == ["Min cosine to sentence-transformers fp32"] * 2
    assert headline.cpu_ratios(None, _serve(1, 1, 32), None, None, None)[0].name.startswith("Padding")


def test_the_headline_block_names_the_cpu_and_its_flags() -> None:
    block = plot.cpu_block(_ceiling(100, 150, 180), _serve(170, 1, 32), None, {})
    assert block.startswith(
        "Against what users would otherwise run, on Test CPU (2 cores; flags: avx512_bf16, amx_bf16)"
    )
    assert "kembed served torch.bfloat16, forward compiled" in block
    assert block.endswith(
        "From bench.compute.ceiling at 2026-11-26T10:00:00Z on Test CPU; "
        "bench.serving.serve_load at 2026-11-26T10:00:00Z on Test CPU."
    )
    table = headline.limits_table(_ceiling(100, 150, 180))
    assert "cold compile 41.0 s" in table and "| st_encode |" in table and "2 lane(s) x 1 thread(s)" in table
    assert headline.limits_table({}) == ""


@pytest.mark.process
def test_every_result_names_the_cpus_math_flags() -> None:
    described = machine.describe()
    assert set(described["cpu_flags"]) <= set(machine.MATH_FLAGS)
    assert set(described["cpu_bf16_flags"]) <= set(described["cpu_flags"])


def test_the_start_up_bench_reads_the_engines_own_log_lines() -> None:
    log = (
        "INFO forward: compiled (auto: compiled 1.20x eager's speed), compiled and compared in 21.5 s\n"
        "INFO warm: 14 shapes in 30.25 s, 9000 padded tokens/s, batch overhead 60 tokens (cpu, ...)\n"
    )
    assert startup.logged_seconds(log) == {"compile_s": 21.5, "warmup_s": 30.25}
    assert startup.logged_seconds("INFO forward: eager (KEMBED_COMPILE=off)") == {}
    table = headline.startup_table(_startup(cold=[38], warm=[12]))
    assert table.splitlines()[2].startswith("| 1 | cold | 38.0 | — | — | — | compiled (auto: 1.2x)")


@pytest.mark.process
@pytest.mark.usefixtures("workload_corpus")
def test_the_limits_of_a_few_texts_compile_and_match_sentence_transformers(tmp_path: Any) -> None:
    """The real path, too short to time anything: the server's compile in its lanes, every batch
    computed, every contender's vectors within the target of sentence-transformers fp32."""
    loaded = inprocess.load({"compile": "auto"})
    texts = workload.load().texts[:12]
    result = limits.measure(loaded, texts, repeats=1, rounds=2, cache_root=str(tmp_path))
    for name in limits.CONTENDERS:
        assert result[name]["emb_per_s"]["median"] > 0, name
        assert result[name]["min_cosine_to_st_fp32"] >= 0.999, name
    assert result["compiled"]["compile_s"] > 0 and result["lanes"] == loaded.lanes
