"""The eager batcher's policy on its own, without the machine's noise: ``python -m bench.compute.packing``.

The engine's own batcher (``kembed.engine.batcher``: its queue, its rules, its packing) driven by a
simulated clock. ``--callers`` closed-loop callers send texts of the workload (their token counts,
truncated at 256), ``--texts`` a call, each sending its next call ``--turnaround-ms`` after its
last answer; the worker computes one batch at a time (eager), a batch of ``rows x longest`` padded
tokens taking ``overhead + tokens`` token-times at ``--tokens-per-s``. The cost model is the CPU
batch curve's (``bench.compute.ceiling``: 12,200 bf16 tokens/s at 2048 tokens and 74 tokens of
overhead on the 2-core EPYC with ``avx512_bf16``; ``--ceiling NAME`` takes the model from a
``bench.compute.ceiling`` result instead). Compared in one run, on the same arrivals:

- *packed*: what the server does on CPU (lead bucket and neighbours, sorted, split at least cost);
- *bucket*: batches confined to the lead bucket, trimmed to their longest (the eager batcher before packing);
- the *sorted ceiling* under the same cost model: every text of the workload sorted by length and
  packed greedily under the same limits (``bench.compute.ceiling``'s ``sorted``).

Per policy: embeddings per simulated second and their share of the ceiling, padding, rows a batch.
Deterministic: what changes a figure is the policy or the cost model, never the load elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.compute import batches
from bench.tools import machine, workload
from kembed.engine.batcher import Batcher, BatchPolicy
from kembed.engine.buckets import BucketQueue
from kembed.engine.units import Batch, Chunk, Job
from kembed.policy.shapes import BatchShapes, clip_buckets

MAX_TOKENS = 256  # the model's limit: longer texts are truncated
TUNED_BUCKETS = (16, 24, 32, 48, 64, 96, 128, 192, 256)  # bench.run_all's ladder
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class CostModel:
    tokens_per_s: float
    overhead_tokens: float

    def seconds(self, batch: Batch) -> float:
        return (self.overhead_tokens + batch.padded_tokens) / self.tokens_per_s


def simulate(
    policy: BatchPolicy, ladder: list[int], lengths: Sequence[int], cost: CostModel, opts: argparse.Namespace
) -> dict[str, Any]:
    """Closed-loop callers against the batcher, on a simulated clock, for ``opts.batches`` batches."""
    clock = [0.0]
    batches: list[Batch] = []
    batcher = Batcher(BucketQueue(ladder), policy, batches.append, expire=lambda job: None, clock=lambda: clock[0])
    draw = random.Random(workload.SEED)
    arrivals: list[tuple[float, int]] = [(0.0, caller) for caller in range(opts.callers)]
    done = items = real = padded = computed = 0
    while computed < opts.batches:
        while arrivals and arrivals[0][0] <= clock[0]:
            _, caller = heapq.heappop(arrivals)
            batcher.submit(_call(caller, [draw.choice(lengths) for _ in range(opts.texts)], ladder, clock[0]))
        batcher.dispatch_ready()  # eager: a batch is formed only when the worker is free
        if not batches:
            clock[0] = arrivals[0][0]
            continue
        batch = batches.pop()
        clock[0] += cost.seconds(batch)
        batcher.batch_done(batch)
        computed += 1
        items += batch.items
        real += batch.real_tokens
        padded += batch.padded_tokens
        for chunk in batch.chunks:
            chunk.job.remaining -= chunk.items
            if chunk.job.remaining == 0:
                done += chunk.job.count
                heapq.heappush(arrivals, (clock[0] + opts.turnaround_ms / 1000, chunk.job.tag))
    return {
        "emb_per_s": done / clock[0],
        "padding_ratio": 1 - real / padded,
        "rows_per_batch": items / computed,
        "batches": computed,
    }


def _call(caller: int, lengths: list[int], ladder: list[int], now: float) -> list[tuple[int, Chunk]]:
    """One call's texts as queued chunks, one per text (ids do not matter here, only lengths)."""
    job = Job(link_id=0, tag=caller, count=len(lengths), deadline=float("inf"))
    parts = []
    for slot, length in enumerate(lengths):
        bucket = next(i for i, b in enumerate(ladder) if b >= length)
        ids = np.zeros((1, ladder[bucket]), np.int32)
        parts.append((bucket, Chunk(job, np.array([slot]), ids, np.array([length], np.int32), now)))
    return parts


def sorted_ceiling(lengths: Sequence[int], shapes: BatchShapes, cost: CostModel) -> float:
    """Embeddings per second of every text sorted by length and packed greedily (``bench.compute.ceiling``)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups = batches.pack(order, lengths, shapes.sizes[-1], shapes.max_tokens)
    seconds = sum((cost.overhead_tokens + len(g) * max(lengths[i] for i in g)) / cost.tokens_per_s for g in groups)
    return len(lengths) / seconds


def measured_cost(name: str) -> CostModel | None:
    """The cost model of a ceiling's CPU batch curve, in the dtype the ceiling served in: its rate at
    its largest batch, its fitted overhead. None without one."""
    result = machine.read_result(name) if name else None
    curve = (result or {}).get("batch_curve", {}).get(str(result and result["dtype"]).removeprefix("torch."))
    if not curve or curve["overhead_tokens"] is None:
        return None
    return CostModel(float(curve["points"][-1]["tokens_per_s"]), float(curve["overhead_tokens"]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--texts", default="1,16", help="texts a call, one simulation each")
    parser.add_argument("--tokens-per-s", type=float, default=12_200.0, help="the worker's rate at a full batch")
    parser.add_argument("--overhead-tokens", type=float, default=74.0, help="a batch's cost beyond its tokens")
    parser.add_argument("--ceiling", default="", help="take both from bench/results/NAME.json's batch curve")
    parser.add_argument("--turnaround-ms", type=float, default=2.0, help="from an answer to the caller's next call")
    parser.add_argument("--batches", type=int, default=2000, help="batches per run (the first callers' burst fades)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--name", default="packing", help="write bench/results/NAME.json")
    opts = parser.parse_args(argv)
    lengths = [min(n, MAX_TOKENS) for n in workload.load().tokens]
    cost = measured_cost(opts.ceiling) or CostModel(opts.tokens_per_s, opts.overhead_tokens)
    shapes = BatchShapes.build(opts.max_batch_size, opts.max_tokens, fixed=False)
    best = sorted_ceiling(lengths, shapes, cost)
    policies = {
        "packed": BatchPolicy(shapes, max_wait=0.02, packed=True, overhead_tokens=cost.overhead_tokens),
        "bucket": BatchPolicy(shapes, max_wait=0.02),
    }
    runs = []
    print(f"packing: sorted ceiling {best:.1f} emb/s ({cost.tokens_per_s:.0f} tokens/s, overhead "
          f"{cost.overhead_tokens:.0f} tokens), {opts.callers} closed-loop callers")  # fmt: skip
    for texts in (int(n) for n in opts.texts.split(",")):
        for name, buckets in (("default", DEFAULT_BUCKETS), ("tuned", TUNED_BUCKETS)):
            ladder = clip_buckets(buckets, MAX_TOKENS)
            for policy, rules in policies.items():
                figures = simulate(rules, ladder, lengths, cost, argparse.Namespace(**{**vars(opts), "texts": texts}))
                run = {"texts_per_call": texts, "buckets": name, "policy": policy, **figures,
                       "share_of_ceiling": figures["emb_per_s"] / best}  # fmt: skip
                runs.append(run)
                print(f"  {texts} text(s) a call, {name} buckets, {policy}: {figures['emb_per_s']:.1f} emb/s "
                      f"({run['share_of_ceiling']:.2f} of the ceiling), padding {figures['padding_ratio']:.1%}, "
                      f"{figures['rows_per_batch']:.1f} rows a batch")  # fmt: skip
    result = {"options": vars(opts), "cost_model": dataclasses.asdict(cost), "sorted_ceiling_emb_per_s": best,
              "runs": runs}  # fmt: skip
    machine.write_result(opts.name, result)
    return result


if __name__ == "__main__":
    main()
