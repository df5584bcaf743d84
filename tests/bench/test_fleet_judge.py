"""bench.fleet's load profile and target judging, on made-up records (no servers, no clocks)."""

from __future__ import annotations

import pytest

from bench.fleet.judge import (
    Call,
    Sample,
    Segment,
    direction_changes,
    ideal_replica_seconds,
    ideal_replicas,
    judge_calls,
    judge_steps,
    level_at,
    profile,
    replica_seconds,
    scale_up_windows,
    slo_seconds,
    traffic_after_ready,
)

SHAPE = ((10, 0.5, "hold"), (5, 1.5, "ramp"), (20, 1.5, "hold"), (2, 3.0, "spike"), (10, 1.5, "hold"))


def test_profile_scales_durations_and_interpolates_ramps() -> None:
    segments = profile(2.0, SHAPE)
    assert [s.start for s in segments] == [0, 20, 30, 70, 74]
    assert level_at(segments, 25) == pytest.approx(1.0)
    assert level_at(segments, 71) == 3.0  # a spike jumps
    assert level_at(segments, 1000) == 1.5


def test_ideal_replicas_is_the_ceiling_of_the_level() -> None:
    assert [ideal_replicas(x) for x in (0.5, 1.0, 1.4, 2.6, 3.0)] == [1, 1, 2, 3, 3]


def test_scale_up_windows_cover_rises_plus_two_syncs_and_a_pod_start() -> None:
    segments = profile(1.0, SHAPE)
    assert scale_up_windows(segments, sync_s=3, pod_start_s=10) == [(10, 31), (35, 53)]


def test_direction_changes_counts_turns_only() -> None:
    assert direction_changes([1, 2, 3, 3, 4]) == 0
    assert direction_changes([1, 3, 2]) == 1
    assert direction_changes([2, 3, 2, 3]) == 2


def samples(*points: tuple[float, int, int]) -> list[Sample]:
    return [Sample(t, replicas, replicas, ready) for t, replicas, ready in points]


def test_a_step_reached_within_the_deadline_and_held() -> None:
    segments = profile(1.0, SHAPE[:3])  # hold 0.5 until 10, ramp to 15, hold 1.5 until 35
    record = samples((0, 1, 1), (12, 2, 1), (20, 2, 2), (30, 2, 2), (34, 2, 2))
    step = judge_steps(segments, record, sync_s=3, pod_start_s=10)[1]
    assert step["ideal"] == 2 and step["reached_at"] == 20 and step["deadline"] == 31
    assert step["reached_in_time"] and step["held_within_one"] and step["no_flapping"]


def test_a_step_reached_late_flapping_and_overshooting_is_judged_so() -> None:
    segments = profile(1.0, SHAPE[:3])
    record = samples((0, 1, 1), (20, 2, 1), (32, 5, 2), (33, 2, 2), (34, 4, 4))
    step = judge_steps(segments, record, sync_s=3, pod_start_s=10)[1]
    assert step["reached_at"] == 32 and not step["reached_in_time"]
    assert not step["held_within_one"]
    assert step["direction_changes"] == 2 and not step["no_flapping"]


def test_a_fleet_that_grows_in_a_hold_after_a_fall_is_judged_on_it() -> None:
    """The retry storm's bound holds on the way down too: a fleet that kept 3 pods as the load fell
    to 1.5x is fine (scaling down is slow by design), one that grew to 6 there is twice what it needed."""
    segments = profile(1.0, SHAPE)  # ... the spike to 3x ends at 37, then a hold at 1.5x until 47
    kept = samples((0, 1, 1), (20, 2, 2), (36, 3, 3), (40, 3, 3), (46, 3, 3))
    after_fall = judge_steps(segments, kept, sync_s=1, pod_start_s=2)[-1]
    assert after_fall["ideal"] == 2 and after_fall["needed"] == 3 and after_fall["largest"] == 3
    grew = samples((0, 1, 1), (20, 2, 2), (36, 3, 3), (40, 3, 3), (42, 6, 6), (46, 6, 6))
    after_fall = judge_steps(segments, grew, sync_s=1, pod_start_s=2)[-1]
    assert after_fall["largest"] / after_fall["needed"] == 2


def test_calls_outside_windows_judged_on_p95_refusals_and_losses() -> None:
    windows = [(10.0, 20.0)]
    calls = [Call(float(t), 0.1, "ok") for t in range(30)] + [Call(12, 0, "refused")]
    verdict = judge_calls(calls, windows, slo_s=0.5)
    assert verdict["p95_met"] and verdict["refusals_only_in_windows"] and verdict["nothing_lost"]
    late = [*calls, Call(25, 2.0, "ok"), Call(25, 2.0, "ok"), Call(26, 0, "refused"), Call(3, 0, "lost")]
    verdict = judge_calls(late, windows, slo_s=0.5)
    assert not verdict["p95_met"]
    assert verdict["refused_outside_windows"] == 1 and not verdict["refusals_only_in_windows"]
    assert verdict["lost"] == 1 and not verdict["nothing_lost"]


def test_replica_seconds_integrate_the_running_pods() -> None:
    record = [Sample(0, 1, 1, 1), Sample(10, 3, 3, 1), Sample(20, 3, 3, 3)]
    assert replica_seconds(record) == 40
    assert replica_seconds(record, "ready") == 20


def test_ideal_replica_seconds_follow_the_profile() -> None:
    segments = [Segment(0, 10, 0.5, 0.5, "hold"), Segment(10, 20, 2.5, 2.5, "hold")]
    assert ideal_replica_seconds(segments) == pytest.approx(10 * 1 + 10 * 3)


def test_an_slo_second_needs_its_p95_met_and_no_refusal() -> None:
    calls = [Call(0.1, 0.2, "ok"), Call(1.5, 0.9, "ok"), Call(2.2, 0.1, "refused"), Call(3.3, 0.1, "ok")]
    assert slo_seconds(calls, slo_s=0.5, end=5) == 3  # bins 0, 3 and the empty 4


def test_a_hold_shorter_than_its_deadline_is_not_judged_on_holding() -> None:
    segments = profile(1.0, SHAPE[:3])
    step = judge_steps(segments, samples((0, 1, 1), (20, 2, 2)), sync_s=3, pod_start_s=30)[1]
    assert step["held_within_one"] is None


def test_traffic_after_ready_counts_pods_that_served_a_sync() -> None:
    # (ready, first connection, serving until): in time, late, never (but served long), too short to judge
    pods = [(10.0, 12.0, 100.0), (20.0, 40.0, 100.0), (30.0, None, 100.0), (50.0, None, 52.0)]
    verdict = traffic_after_ready(pods, sync_s=15.0)
    assert verdict["ready_to_first_connection_s"] == [2.0, 20.0, None]
    assert verdict["traffic_within_one_sync"] is False
    assert traffic_after_ready(pods[:1], sync_s=15.0)["traffic_within_one_sync"] is True
