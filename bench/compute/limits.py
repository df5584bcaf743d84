"""What kembed is judged against on a CPU, in one process, on the same texts, in the serving dtype
(``bench.compute.ceiling``'s ``limits`` block):

- ``st_encode``: sentence-transformers' own ``SentenceTransformer.encode`` on the model's folder,
  ``batch_size`` 32 (its default), at torch's default threads, one batch at a time: what users run
  without a server. It sorts the texts by length itself (characters, longest first) and tokenizes
  each batch; its time is all of it (tokenization, forward, pooling).
- ``eager``: kembed's model (the server's ``EmbeddingModel``) on every text sorted by token count and
  packed under the server's limits (the ceiling's ``sorted`` batches), computed as the server's
  worker computes: in its lanes, each at a lane's threads. Forward passes only.
- ``compiled``: the same batches through the server's own CPU compile (``cpu_compile``:
  ``torch.compile(dynamic=True)``, kernels for a lane's threads, caches in a fresh folder) in the
  same lanes: the compiled in-process ceiling. Its first call, the cold compile, is timed apart.

Interleaved, so load elsewhere on the machine meets each alike: a pass is cut into rounds; a round
runs a slice of sentence-transformers' batches (each an ``encode`` call of one of its batches, in
its own order), then the same slice of kembed's eager and compiled batches mixed in one queue the
lanes take from. Each kembed batch is timed in its lane, so eager's and compiled's seconds are
lane-seconds over the lanes (the lanes are busy throughout but for each round's last batch).
Before timing, one untimed pass gives every contender's vectors: the min cosine of each against
sentence-transformers in fp32 on every text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

from bench.compute import inprocess
from bench.compute.batches import PaddedBatch, compiles, materialize, plan_groups, rates
from bench.tools.report import padding_ratio
from kembed.engine import cpu
from kembed.engine.warmup import min_cosine

ST_BATCH_SIZE = 32  # SentenceTransformer.encode's default
CONTENDERS = ("st_encode", "eager", "compiled")


@dataclass(frozen=True)
class Kembed:
    """One of kembed's forwards on the sorted batches, with each batch's text indices."""

    forward: inprocess.Forward
    batches: list[PaddedBatch]
    groups: list[list[int]]


def st_order(texts: Sequence[str]) -> list[int]:
    """sentence-transformers' own order for text: by characters, longest first (its ``_input_length``)."""
    return sorted(range(len(texts)), key=lambda i: -len(texts[i]))


def st_groups(texts: Sequence[str], batch_size: int) -> list[list[int]]:
    order = st_order(texts)
    return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]


def round_of(index: int, rounds: int) -> int:
    """A batch's round: every ``rounds``-th batch, so each round holds long and short ones alike."""
    return index % rounds


def sentence_transformer(path: str, dtype: torch.dtype) -> SentenceTransformer:
    return SentenceTransformer(path, device="cpu").to(dtype)


def _encode(model: SentenceTransformer, texts: list[str]) -> np.ndarray:
    return np.asarray(model.encode(texts, batch_size=ST_BATCH_SIZE, convert_to_numpy=True), dtype=np.float32)


def _lane_call(forward: inprocess.Forward, batch: PaddedBatch) -> tuple[float, np.ndarray]:
    with torch.inference_mode():
        start = time.perf_counter()
        out = forward(batch.ids, batch.mask)
        return time.perf_counter() - start, out.float().numpy()


def _vectors(n: int, groups: list[list[int]], outputs: list[np.ndarray]) -> np.ndarray:
    """Rows of each batch's output put back at their texts' indices."""
    vectors = np.zeros((n, outputs[0].shape[1]), dtype=np.float32)
    for group, out in zip(groups, outputs, strict=True):
        vectors[group] = out[: len(group)]
    return vectors


def timed_pass(
    st: Callable[[list[int]], float],
    st_batches: list[list[int]],
    kembed: dict[str, Kembed],
    lanes: ThreadPoolExecutor,
    rounds: int,
) -> dict[str, list[float]]:
    """Seconds of each batch: sentence-transformers' alone on the machine, kembed's in its lane."""
    seconds = {"st_encode": [0.0] * len(st_batches)} | {name: [0.0] * len(k.batches) for name, k in kembed.items()}
    for r in range(rounds):
        for i, group in enumerate(st_batches):
            if round_of(i, rounds) == r:
                seconds["st_encode"][i] = st(group)
        # Eager's and compiled's batches alternate in the queue: neighbours in time, in the lanes alike.
        jobs = [(name, i) for i in range(max(len(k.batches) for k in kembed.values())) for name in kembed]
        jobs = [(name, i) for name, i in jobs if i < len(kembed[name].batches) and round_of(i, rounds) == r]
        futures = [lanes.submit(_lane_call, kembed[name].forward, kembed[name].batches[i]) for name, i in jobs]
        for (name, i), future in zip(jobs, futures, strict=True):
            seconds[name][i] = future.result()[0]
    return seconds


def _figures(passes: list[list[float]], texts: list[int], tokens: list[int], cosine: float) -> dict[str, Any]:
    """A contender's rates from its batches' seconds in each pass, and its least cosine."""
    return {
        "batches": len(passes[0]),
        "emb_per_s": rates(passes, texts).to_dict(),
        "tokens_per_s": rates(passes, tokens).to_dict(),
        "min_cosine_to_st_fp32": cosine,
    }


def measure(
    loaded: inprocess.InProcessModel, texts: list[str], repeats: int, rounds: int, cache_root: str
) -> dict[str, Any]:
    """The three contenders on ``texts``: rates over ``repeats`` interleaved passes, cosines, compile time."""
    if loaded.compile_on_cpu is None:
        raise ValueError("the limits are a CPU's: this model is not served eager on a CPU")
    ids, lengths = loaded.tokenize(texts, True)
    groups, shape = plan_groups("sorted", lengths.tolist(), loaded)
    batches = materialize(groups, shape, ids, lengths, loaded.pad_token_id)
    real_tokens = [int(t) for t in lengths]
    path = str(loaded.path)
    reference = _encode(sentence_transformer(path, torch.float32), texts)  # fp32, untimed
    served = sentence_transformer(path, loaded.dtype)
    st_batches = st_groups(texts, ST_BATCH_SIZE)

    def st(group: list[int]) -> float:
        start = time.perf_counter()
        _encode(served, [texts[i] for i in group])
        return time.perf_counter() - start

    lanes = ThreadPoolExecutor(loaded.lanes, "limits-lane", initializer=cpu.enter_lane, initargs=(loaded.lane_threads,))
    with lanes:
        compiled_forward = loaded.compile_on_cpu(cache_root)
        largest = max(batches, key=lambda b: b.padded_tokens)  # the first call sets inductor's size hints
        compile_s = lanes.submit(_lane_call, compiled_forward, largest).result()[0]
        kembed = {
            "eager": Kembed(loaded.forward, batches, groups),
            "compiled": Kembed(compiled_forward, batches, groups),
        }
        # Untimed: every batch once, one at a time (a one-row batch compiles a graph of its own).
        vectors = {
            name: _vectors(
                len(texts), k.groups, [lanes.submit(_lane_call, k.forward, b).result()[1] for b in k.batches]
            )
            for name, k in kembed.items()
        }
        vectors["st_encode"] = _encode(served, texts)
        graphs = compiles()
        passes = [timed_pass(st, st_batches, kembed, lanes, rounds) for _ in range(repeats)]
    texts_of = {"st_encode": [len(g) for g in st_batches], **{n: [b.texts for b in batches] for n in kembed}}
    tokens_of = {"st_encode": [sum(real_tokens[i] for i in g) for g in st_batches]}
    tokens_of |= {n: [b.real_tokens for b in batches] for n in kembed}
    scale = {"st_encode": 1, "eager": loaded.lanes, "compiled": loaded.lanes}  # lane-seconds over the lanes
    result: dict[str, Any] = {
        "texts": len(texts),
        "passes": repeats,
        "rounds": rounds,
        "lanes": loaded.lanes,
        "lane_threads": loaded.lane_threads,
        "st_threads": torch.get_num_threads(),
        "dtype": str(loaded.dtype),
    }
    for name in CONTENDERS:
        per_pass = [[s / scale[name] for s in p[name]] for p in passes]
        result[name] = _figures(per_pass, texts_of[name], tokens_of[name], min_cosine(vectors[name], reference))
        print(f"  limits, {name}: {result[name]['emb_per_s']['median']:.1f} emb/s, "
              f"min cosine to sentence-transformers fp32 {result[name]['min_cosine_to_st_fp32']:.5f}")  # fmt: skip
    result["st_encode"] |= {"batch_size": ST_BATCH_SIZE, "version": sentence_transformers.__version__}
    padded = sum(b.padded_tokens for b in batches)
    for name in kembed:
        result[name]["padding_ratio"] = padding_ratio(sum(real_tokens), padded - sum(real_tokens))
    result["compiled"] |= {"compile_s": compile_s, "recompiles_after_warmup": compiles() - graphs}
    print(f"  limits, compiled: cold compile {compile_s:.1f} s")
    return result
