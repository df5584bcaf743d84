"""The engine's own path without a model: a WORK message through the intake into the buckets, and
finished batches through the responder back to the front ends, with fake clocks and a fake replies."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import pytest

from kembed.config.settings import Settings
from kembed.domain.errors import EmbedError, Failure
from kembed.engine.batcher import Batcher, BatchPolicy, BatchShapes
from kembed.engine.buckets import BucketQueue
from kembed.engine.intake import Intake
from kembed.engine.jobs import Jobs
from kembed.engine.responder import Responder
from kembed.engine.units import Batch, Chunk, Computed, Job, Outcome
from kembed.ipc.protocol import Result, Work
from kembed.metrics import EngineMetrics
from kembed.policy.admission import AdmissionController, Backlog
from kembed.policy.load import MeasuredLoad
from kembed.policy.priority import Priority
from tests.server.queueing import work

LENGTHS = [16, 32]
DIMS = 4
INTERACTIVE, BATCH = Priority


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Replies:
    def __init__(self) -> None:
        self.results: list[tuple[int, Result]] = []
        self.errors_sent: list[tuple[int, list[int], list[EmbedError]]] = []

    def result(self, link: int, result: Result) -> None:
        self.results.append((link, result))

    def errors(self, link: int, tags: list[int], errors: list[EmbedError]) -> None:
        self.errors_sent.append((link, tags, errors))


def work_frame(
    requests: list[list[int]], tags: list[int], deadline: float = 1e9, cancels=(), latencies=(), priorities=()
) -> Work:
    """A WORK message as the engine reads it off the link: each request a list of sequence lengths."""
    return decoded(work(requests, tags, LENGTHS, deadline, cancels, latencies, priorities))


def decoded(sent: Work) -> Work:
    return Work.decode([memoryview(np.ascontiguousarray(part).tobytes()) for part in sent.encode()])


@pytest.fixture
def engine_path():
    settings = Settings(admission=["throughput"], max_queued_tokens=150, buckets=LENGTHS)
    clock = FakeClock()
    load = MeasuredLoad(settings, clock=clock)
    admission = AdmissionController(settings, load, rng=random.Random(1))
    dispatched: list[Batch] = []
    queue = BucketQueue(LENGTHS)
    jobs = Jobs(queue)
    policy = BatchPolicy(BatchShapes.build(8, 256, fixed=False), max_wait=0.02, packed=True)
    batcher = Batcher(queue, policy, dispatched.append, expire=jobs.expire)
    replies = Replies()
    metrics = EngineMetrics()
    intake = Intake(admission, load, batcher, jobs, replies, metrics, pad_token_id=0, clock=clock)
    responder = Responder(batcher, load.rate, jobs, replies, metrics, clock=clock)
    return intake, batcher, jobs, replies, responder, load, clock


def queued(batcher: Batcher, bucket: int) -> list[Chunk]:
    return batcher.queue.take(bucket, 100, now=0.0)[0]


def test_a_frame_of_requests_is_admitted_against_one_backlog(engine_path):
    intake, batcher, _, replies, *_ = engine_path
    # Costs 48, 16, 128 and 16: the third would take the backlog to 192, over the 150-token cap.
    intake.accept(7, work_frame([[3, 20], [5], [30, 30, 30, 30], [1]], tags=[11, 12, 13, 14]))
    assert [(link, tags, [e.failure for e in errors]) for link, tags, errors in replies.errors_sent] == [
        (7, [13], [Failure.REJECTED])
    ]
    assert batcher.backlog.total == 48 + 16 + 16
    short, long = queued(batcher, 0), queued(batcher, 1)
    assert [(c.job.tag, c.slots.tolist(), c.lengths.tolist()) for c in short] == [
        (11, [0], [3]),
        (12, [0], [5]),
        (14, [0], [1]),
    ]
    assert [(c.job.tag, c.slots.tolist()) for c in long] == [(11, [1])]
    assert long[0].ids[0, :20].tolist() == list(range(1, 21)) and (long[0].ids[0, 20:] == 0).all()


def test_cancellations_drop_queued_work_and_samples_reach_the_p95(engine_path):
    intake, batcher, _, _, _, load, _ = engine_path
    intake.accept(1, work_frame([[4, 4]], tags=[5]))
    assert batcher.backlog.total == 32
    intake.accept(1, work_frame([], tags=[], cancels=[5], latencies=[0.5] * 6))
    assert batcher.backlog.total == 0 and queued(batcher, 0) == []
    assert load.p95_seconds() == pytest.approx(0.5)


def test_responder_sends_each_front_end_its_rows_and_finishes_jobs(engine_path):
    intake, batcher, _, replies, responder, _, _ = engine_path
    intake.accept(1, work_frame([[2, 3]], tags=[21]))
    intake.accept(2, work_frame([[4]], tags=[22]))
    chunks = queued(batcher, 0)
    batch = Batch(chunks, 4, 3)
    batcher.in_flight, batcher.in_flight_tokens = 1, batch.cost
    embeddings = np.arange(3 * DIMS, dtype=np.float32).reshape(3, DIMS)
    responder.deliver(batch, [Outcome(chunks, embeddings, None, 12, 9)], Computed(lane=0, started=99.0, seconds=0.5))
    by_link = {link: (r.tags.tolist(), r.slots.tolist(), r.rows) for link, r in replies.results}
    assert by_link[1][:2] == ([21, 21], [0, 1]) and by_link[2][:2] == ([22], [0])
    np.testing.assert_array_equal(by_link[2][2], embeddings[2:])
    assert all(chunk.job.closed for chunk in chunks)  # every item answered: nothing left to route


def finish_batch(responder: Responder, batcher: Batcher, clock: FakeClock, computed: Computed, done: float) -> None:
    """Deliver a batch of one 16-token item, computed as ``computed`` says, answered at ``done``."""
    job = Job(link_id=1, tag=1, count=1, deadline=1e9)
    chunk = Chunk(job, np.array([0]), np.ones((1, 16), np.int32), np.array([16], np.int32), 0.0)
    clock.now = done
    batch = Batch([chunk], 16, 8)
    batcher.in_flight, batcher.in_flight_tokens = 1, batch.cost
    responder.deliver(batch, [Outcome([chunk], None, RuntimeError("x"), 128, 16)], computed)


def test_service_rate_counts_wall_time_between_completions(engine_path):
    """Compute time alone misses the gaps a busy loop and shared cores put between batches: the rate
    is the batch's cost (its items padded to their buckets, the backlog's unit, whatever the batch
    computed) over max(compute, wall time since the batch could start)."""
    _, batcher, _, _, responder, load, clock = engine_path
    finish_batch(responder, batcher, clock, Computed(0, started=100.0, seconds=0.5), done=101.0)  # 1 s wall
    assert load.tokens_per_second == pytest.approx(16 / 1.0)
    # Started before the last completion: 0.2 s of wall time.
    finish_batch(responder, batcher, clock, Computed(0, started=100.5, seconds=0.9), done=101.2)
    assert load.tokens_per_second == pytest.approx((16 * 0.9 + 16) / (1.0 * 0.9 + 0.9))


def test_lanes_side_by_side_each_hold_their_share_of_the_worker(engine_path):
    """Two lanes that each take 1 s for 16 tokens deliver 32 tokens a second between them; a lane's
    wall time runs from its own previous answer, not the other lane's."""
    _, batcher, jobs, replies, _, load, clock = engine_path
    responder = Responder(batcher, load.rate, jobs, replies, EngineMetrics(), clock=clock, lanes=2)
    for second in range(4):  # lane 1 half a second behind lane 0, both always busy
        finish_batch(responder, batcher, clock, Computed(0, 100.0 + second, 1.0), done=101.0 + second)
        finish_batch(responder, batcher, clock, Computed(1, 100.5 + second, 1.0), done=101.5 + second)
    assert load.tokens_per_second == pytest.approx(32.0)


def test_a_lost_front_end_takes_its_queued_work_with_it(engine_path):
    intake, batcher, jobs, *_ = engine_path
    intake.accept(1, work_frame([[4]], tags=[1]))
    intake.accept(2, work_frame([[4]], tags=[1]))
    jobs.drop_link(1)
    assert batcher.backlog.total == 16
    assert [c.job.link_id for c in queued(batcher, 0)] == [2]


def test_a_frame_decides_its_interactive_requests_first(engine_path):
    intake, batcher, _, replies, *_ = engine_path
    # 128 tokens of batch work, then a 32-token query: together over the 150-token cap.
    intake.accept(1, work_frame([[30] * 4, [20]], tags=[1, 2], priorities=[BATCH, INTERACTIVE]))
    assert [(tags, errors[0].failure) for _, tags, errors in replies.errors_sent] == [([1], Failure.REJECTED)]
    assert batcher.backlog == Backlog(interactive=32)


def test_an_interactive_request_displaces_the_youngest_batch_work_not_started(engine_path):
    intake, batcher, jobs, replies, _, load, _ = engine_path
    intake.accept(1, work_frame([[4] * 3], tags=[1], priorities=[BATCH]))  # 48 tokens
    intake.accept(1, work_frame([[4] * 6], tags=[2], priorities=[BATCH]))  # 96 tokens, the youngest
    intake.accept(2, work_frame([[20]], tags=[3]))  # a 32-token query: 176 > 150
    [(link, tags, [error])] = replies.errors_sent
    assert (link, tags, error.failure) == (1, [2], Failure.REJECTED) and error.retry_after_ms > 0
    assert batcher.backlog == Backlog(interactive=32, batch=48, displaceable=48)
    assert len(jobs) == 2 and load.p95_seconds(BATCH) == 0.0  # a refusal's sample: one is not enough


def test_batch_work_that_started_is_not_displaced(engine_path):
    intake, batcher, _, replies, *_ = engine_path
    intake.accept(1, work_frame([[4] * 9], tags=[1], priorities=[BATCH]))  # 144 tokens
    batcher.queue.take(0, 1, now=0.0)  # one of its items is in a batch: the request has started
    intake.accept(2, work_frame([[20, 20]], tags=[2]))  # 128 + 64: over the cap and its reserve (168)
    [(link, tags, [error])] = replies.errors_sent
    assert (link, tags, error.failure) == (2, [2], Failure.REJECTED) and "queue is full" in error.message
    assert batcher.backlog == Backlog(batch=128)


def test_latency_samples_reach_their_class_window(engine_path):
    intake, *_, load, _ = engine_path
    sent = work([], [], LENGTHS, latencies=[2.0] * 6)
    intake.accept(1, decoded(dataclasses.replace(sent, sample_priorities=np.full(6, BATCH, "u1"))))
    assert (load.p95_seconds(BATCH), load.p95_seconds()) == (pytest.approx(2.0), 0.0)


def test_work_stops_counting_as_its_deadline_passes(engine_path):
    """Work that expires in 6 s is not weighed for longer: the engine closes it at its deadline, not
    when the batcher reaches it, and the query it kept out is admitted."""
    intake, batcher, jobs, replies, _, load, clock = engine_path
    load.rate.seed(tokens=120, seconds=1.0)  # the 2 s budget holds 120 padded tokens (2x the drain)
    intake.accept(1, work_frame([[4] * 6], tags=[1], deadline=clock.now + 6))  # 96 tokens of queries
    intake.accept(1, work_frame([[4]], tags=[2], deadline=clock.now + 60))  # 16 more
    assert jobs.next_deadline() == clock.now + 6
    intake.accept(2, work_frame([[4]], tags=[3]))
    [(_, [refused], _)] = replies.errors_sent
    assert refused == 3
    clock.now += 5.9
    assert jobs.expire_due(clock.now) == 0 and batcher.backlog == Backlog(interactive=112)
    clock.now += 0.1
    assert jobs.expire_due(clock.now) == 1 and batcher.backlog == Backlog(interactive=16)
    assert len(replies.errors_sent) == 1  # the expired job's front end answers it itself
    assert jobs.next_deadline() == clock.now + 54
    intake.accept(2, work_frame([[4]], tags=[4]))
    assert len(replies.errors_sent) == 1 and len(jobs) == 2  # admitted


def test_the_deadline_heap_stays_within_a_multiple_of_the_open_jobs(engine_path):
    intake, _, jobs, *_ = engine_path
    for tag in range(1, 1000):
        intake.accept(1, work_frame([[4]], tags=[tag]))
        jobs.cancel(1, tag)  # closed long before its deadline
    assert len(jobs) == 0 and len(jobs._deadlines) <= 64 + 1 and len(jobs._latest[INTERACTIVE]) <= 64 + 1
    assert jobs.next_deadline() is None


async def test_an_ingest_at_a_low_rate_never_shuts_queries_out():
    """At 1,850 tokens/s a 2,000-token batch of ingest takes 1.1 s, twice that 2.2 s: over the 2 s
    budget. Weighed at the bucket spread with the batch in the worker, every query was refused while
    an ingest ran; weighed on what a query waits behind (interactive work), none is."""
    lengths = [16, 32, 64, 128, 256]
    settings = Settings(buckets=lengths, max_drain_ms=2000)
    clock = FakeClock()
    load = MeasuredLoad(settings, clock=clock)
    load.rate.seed(tokens=1850, seconds=1.0)
    admission = AdmissionController(settings, load, rng=random.Random(1))
    queue = BucketQueue(lengths)
    jobs = Jobs(queue)
    dispatched: list[Batch] = []
    shapes = BatchShapes.build(64, 2048, fixed=False)
    batcher = Batcher(queue, BatchPolicy(shapes, max_wait=0.02), dispatched.append, expire=jobs.expire, clock=clock)
    replies = Replies()
    intake = Intake(admission, load, batcher, jobs, replies, EngineMetrics(), pad_token_id=0, clock=clock)
    task = asyncio.create_task(batcher.run())
    try:
        ingest = [[250] * 1024]  # 262,144 padded tokens: the queue cap, as the request
        intake.accept(1, decoded(work(ingest, [1], lengths, priorities=[BATCH])))
        await asyncio.sleep(0)
        [running] = dispatched
        assert (running.items, batcher.backlog.in_flight, batcher.backlog.in_flight_interactive) == (8, 8 * 256, 0)
        for tag in range(2, 14):  # a query every half second while the batch computes
            intake.accept(2, decoded(work([[10]], [tag], lengths)))
            clock.now += 0.5
        assert replies.errors_sent == [] and len(jobs) == 13
        assert batcher.backlog.interactive == 12 * 16
    finally:
        task.cancel()


def test_work_that_will_expire_is_weighed_by_what_it_can_still_cost():
    """58 s of queries queued at 100 tokens/s, all of them expiring in 6 s: weighed as the 6 s they
    can still take, less as their deadline nears, until a query fits before it has passed."""
    settings = Settings(admission=["throughput"], buckets=LENGTHS, max_drain_ms=2000)
    clock = FakeClock()
    load = MeasuredLoad(settings, clock=clock)
    load.rate.seed(tokens=10_000, seconds=1.0)
    admission = AdmissionController(settings, load, rng=random.Random(1))
    queue = BucketQueue(LENGTHS)
    jobs = Jobs(queue)
    dispatched: list[Batch] = []
    shapes = BatchShapes.build(8, 256, fixed=False)
    batcher = Batcher(queue, BatchPolicy(shapes, max_wait=0.02), dispatched.append, expire=jobs.expire)
    replies = Replies()
    intake = Intake(admission, load, batcher, jobs, replies, EngineMetrics(), pad_token_id=0, clock=clock)
    for tag in range(1, 363):  # 362 one-item requests of 16 tokens: 5,792 tokens, admitted at 10k tokens/s
        intake.accept(1, work_frame([[4]], tags=[tag], deadline=clock.now + 6))
    load.rate.seed(tokens=100, seconds=1.0)  # then the node slows down: 58 s of work
    assert len(jobs) == 362 and intake.backlog().ahead(INTERACTIVE) == 600  # what 6 s can compute
    intake.accept(2, work_frame([[4]], tags=[1000]))
    [(_, [refused], [error])] = replies.errors_sent
    assert refused == 1000 and error.retry_after_ms <= 1.5 * 6160  # the 6 s it spared (+-50%), not 58 s
    clock.now += 5.5
    assert intake.backlog().ahead(INTERACTIVE) == 50  # what half a second can compute
    intake.accept(2, work_frame([[4]], tags=[1001]))
    assert len(replies.errors_sent) == 1  # admitted half a second before the deadline passes
