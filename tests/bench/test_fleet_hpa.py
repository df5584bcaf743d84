"""The HPA controller's algorithm as bench.fleet runs it: the documented rules, case by case."""

from __future__ import annotations

from bench.fleet.hpa import (
    DEFAULT_DOWN,
    DEFAULT_UP,
    Behavior,
    Controller,
    Pod,
    Policy,
    Rules,
    behavior,
    desired_for_metric,
    desired_for_total,
)


def pods(*names: str, **overrides: object) -> list[Pod]:
    return [Pod(name, **overrides) for name in names]  # type: ignore[arg-type]


def test_desired_is_ceil_of_ratio_times_ready_pods() -> None:
    # average 0.5 against 0.25: twice the target over two pods asks for four
    assert desired_for_metric(pods("a", "b"), {"a": 0.4, "b": 0.6}, 0.25, current=2) == 4


def test_within_tolerance_nothing_changes() -> None:
    assert desired_for_metric(pods("a", "b"), {"a": 0.27, "b": 0.27}, 0.25, current=2) == 2  # 8% over
    assert desired_for_metric(pods("a", "b"), {"a": 0.28, "b": 0.28}, 0.25, current=2) == 3  # 12% over


def test_no_values_gives_no_proposal() -> None:
    assert desired_for_metric(pods("a"), {}, 0.25, current=1) is None


def test_missing_pods_count_zero_on_scale_up() -> None:
    # a: 1.0 against 0.25 (4x); b starting, no value yet: counted at 0, so 2 x avg(1.0, 0) / 0.25 = 4
    assert desired_for_metric(pods("a", "b"), {"a": 1.0}, 0.25, current=2) == 4


def test_missing_pods_count_at_target_on_scale_down() -> None:
    # a at 0 alone would ask for 0; b and c missing count at the target: avg(0, .25, .25)/.25 x 3 -> 2
    assert desired_for_metric(pods("a", "b", "c"), {"a": 0.0}, 0.25, current=3) == 2


def test_pending_pods_left_out_then_zero_on_scale_up() -> None:
    starting = [Pod("a"), Pod("b", pending=True)]
    assert desired_for_metric(starting, {"a": 0.5}, 0.25, current=2) == 2  # avg(0.5, 0)/0.25 = 1: no change


def test_deleting_pods_are_ignored() -> None:
    leaving = [Pod("a"), Pod("b", deleting=True)]
    assert desired_for_metric(leaving, {"a": 0.25, "b": 5.0}, 0.25, current=1) == 1


def test_a_rebalanced_ratio_that_reverses_keeps_the_scale() -> None:
    # ratio 1.2 over the pod with a value, but two pending pods at 0 make it 0.4: no scale-down from it
    starting = [Pod("a"), Pod("b", pending=True), Pod("c", pending=True)]
    assert desired_for_metric(starting, {"a": 0.3}, 0.25, current=3) == 3


def test_cpu_of_a_pod_not_ready_within_initialization_is_left_out() -> None:
    warming = [Pod("a", started_at=0, ready_since=0), Pod("b", started_at=100, ready=False, ready_since=None)]
    values = {"a": 140.0, "b": 400.0}  # b burns CPU loading its model
    # b counts at 0 (scale-up with unready pods): avg(140, 0)/70 = 1 -> no change, not 2 x 270/70
    assert desired_for_metric(warming, values, 70.0, 2, cpu_window_start=110, now=120) == 2


def test_cpu_sample_from_before_readiness_is_left_out() -> None:
    fresh = [Pod("a", started_at=0, ready_since=0), Pod("b", started_at=100, ready_since=115)]
    values = {"a": 70.0, "b": 300.0}
    assert desired_for_metric(fresh, values, 70.0, 2, cpu_window_start=110, now=120) == 2


def controller(up: Rules = DEFAULT_UP, down: Rules = DEFAULT_DOWN, max_replicas: int = 10) -> Controller:
    return Controller(Behavior(up, down), min_replicas=1, max_replicas=max_replicas)


def test_default_scale_up_doubles_or_adds_four_per_period() -> None:
    hpa = controller()
    assert hpa.decide(0, 1, [20]) == 5  # max(100% of 1 -> 2, 1 + 4 pods)
    assert hpa.decide(5, 5, [20]) == 5  # same 15 s period: 1 at its start, already +4
    assert hpa.decide(16, 5, [20]) == 10  # a new period: max(10, 9), capped by maxReplicas


def test_select_min_takes_the_smaller_change() -> None:
    up = Rules(0, (Policy("Percent", 100, 15), Policy("Pods", 1, 15)), "Min")
    assert controller(up=up).decide(0, 4, [20]) == 5


def test_disabled_direction_never_moves() -> None:
    assert controller(down=Rules(0, DEFAULT_DOWN.policies, "Disabled")).decide(0, 4, [1]) == 4


def test_scale_down_waits_out_the_stabilization_window() -> None:
    hpa = controller()
    assert hpa.decide(0, 4, [4]) == 4
    assert hpa.decide(15, 4, [1]) == 4  # the highest recommendation of the last 300 s is 4
    assert hpa.decide(299, 4, [1]) == 4
    assert hpa.decide(301, 4, [1]) == 1  # the 4 has left the window


def test_scale_up_stabilization_takes_the_lowest_recommendation() -> None:
    hpa = controller(up=Rules(60, DEFAULT_UP.policies))
    assert hpa.decide(0, 2, [2]) == 2
    assert hpa.decide(15, 2, [6]) == 2  # the window still holds a 2
    assert hpa.decide(61, 2, [6]) == 6


def test_scale_down_rate_limited_by_pods_policy() -> None:
    down = Rules(0, (Policy("Pods", 1, 60),))
    hpa = controller(down=down)
    assert hpa.decide(0, 5, [1]) == 4
    assert hpa.decide(15, 4, [1]) == 4  # one pod already removed in this 60 s period
    assert hpa.decide(61, 4, [1]) == 3


def test_largest_metric_proposal_wins_and_unknown_ones_are_skipped() -> None:
    assert controller().decide(0, 2, [1, None, 3]) == 3
    assert controller().decide(0, 2, [None, None]) == 2


def test_min_and_max_replicas_bound_the_decision() -> None:
    assert controller(max_replicas=3).decide(0, 2, [9]) == 3
    assert controller(down=Rules(0, DEFAULT_DOWN.policies)).decide(0, 2, [0]) == 1


def test_behavior_reads_a_manifest_and_fills_the_api_defaults() -> None:
    manifest = {
        "scaleDown": {"stabilizationWindowSeconds": 60, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 30}]}
    }
    read = behavior(manifest)
    assert read.up == DEFAULT_UP
    assert read.down == Rules(60, (Policy("Pods", 1, 30),), "Max")
    assert behavior(None) == Behavior(DEFAULT_UP, DEFAULT_DOWN)


def test_compression_divides_every_period() -> None:
    scaled = behavior(None).scaled(5)
    assert scaled.down.stabilization_s == 60
    assert {p.period_s for p in scaled.up.policies} == {3}


def test_an_external_total_asks_for_its_ceiling_over_the_target() -> None:
    assert desired_for_total(23.0, 5.0, current=2) == 5  # KEDA: 23 waiting at 5 a pod
    assert desired_for_total(10.5, 5.0, current=2) == 2  # 5% over: within the tolerance
    assert desired_for_total(None, 5.0, current=2) is None
