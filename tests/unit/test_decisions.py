"""The coordinator's pure decisions: each returns what to do and why."""

import pytest

from gradwire.coordinator.decisions import decide_sync


@pytest.mark.parametrize(
    ("known", "base", "target", "action"),
    [
        (None, 2, 3, "push"),
        (3, 2, 3, "current"),
        (2, 2, 3, "replay"),
        (2, 2, 2, "current"),
        (1, 2, 3, "push"),
        (4, 2, 3, "push"),
    ],
)
def test_decide_sync(known, base, target, action):
    got, reason = decide_sync(known, base, target)
    assert got == action and reason


def test_grace_parses_seconds_and_factors() -> None:
    from gradwire.coordinator.decisions import Grace

    assert Grace.parse("10") == Grace(seconds=10.0) and Grace.parse("1.5x") == Grace(factor=1.5)
    assert Grace.parse("2x").after([1.0, 3.0, 2.0]) == 4.0  # twice the median arrival
    assert Grace.parse("0.5").after([9.0]) == 0.5
    for bad in ("soon", "-1", "inf", "x"):
        with pytest.raises(ValueError, match="--straggler-grace"):
            Grace.parse(bad)


def test_decide_close_waits_for_the_quorum_then_the_grace() -> None:
    from gradwire.coordinator.decisions import Grace, decide_close

    grace = Grace(seconds=1.0)
    assert decide_close(5.0, [1.0], 2, quorum=2, grace=grace)[:2] == (False, float("inf"))  # no quorum yet
    close, wait, why = decide_close(2.5, [1.0, 2.0], 1, quorum=2, grace=grace)
    assert (close, wait) == (False, 0.5) and "waiting up to 0.50 s for 1 more" in why
    close, _, why = decide_close(3.0, [1.0, 2.0], 1, quorum=2, grace=grace)
    assert close and "1 straggler(s) cut off after 3.00 s" in why
    assert decide_close(99.0, [1.0], 1, quorum=0, grace=grace)[0] is False  # quorum 0: wait for every worker
    assert decide_close(0.1, [0.1, 0.1], 0, quorum=0, grace=grace) == (True, 0.0, "every worker answered")
    assert decide_close(2.0, [1.0, 1.0, 2.0], 1, quorum=2, grace=Grace(factor=1.0))[0] is True  # 1 + median 1.0


def test_decide_close_never_waits_past_the_limit_whatever_the_quorum() -> None:
    """A call still open when every deadline has passed is stuck: the round closes without it."""
    from gradwire.coordinator.decisions import Grace, decide_close

    grace = Grace(seconds=100.0)
    assert decide_close(5.0, [1.0], 1, quorum=0, grace=grace, limit=45.0)[:2] == (False, 40.0)  # waits, bounded
    close, wait, why = decide_close(45.0, [1.0], 1, quorum=0, grace=grace, limit=45.0)
    assert (close, wait) == (True, 0.0) and "outlived every deadline" in why
    assert decide_close(10.0, [1.0, 2.0], 1, quorum=2, grace=grace, limit=45.0)[:2] == (False, 35.0)  # grace capped


def test_decide_sync_catches_up_when_the_missed_updates_are_in_the_window() -> None:
    action, why = decide_sync(1, 4, 5, catch_up_bytes=1200)
    assert action == "catch-up" and "replays 3 missed update(s) (1200 bytes)" in why
    assert decide_sync(1, 4, 5, catch_up_bytes=None)[0] == "push"  # out of the window, or dearer than the state
    assert decide_sync(6, 4, 5, catch_up_bytes=10)[0] == "push"  # ahead of the coordinator: never replayed


def test_replay_precision_is_float64_only_across_device_kinds_not_measured_to_agree() -> None:
    from gradwire.coordinator.decisions import replay_precision

    assert replay_precision("auto", "cpu", ["cpu", "cpu"])[0] is False
    exact, why = replay_precision("auto", "cpu", ["cuda:0", "cpu", ""])  # "": not described yet
    assert not exact and "measured to agree" in why  # CPU and CUDA float32 replays: measured bit-identical
    exact, why = replay_precision("auto", "cuda:0", ["mps", "cuda:0"])
    assert exact and "mps" in why and "float64" in why
    assert replay_precision("auto", "mps", ["mps"])[0] is False  # one kind: the same kernels everywhere
    assert replay_precision("auto", "cuda", ["cuda:1", "cuda:0"])[0] is False  # same kind, other index
    assert replay_precision("float64", "cpu", ["cpu"]) == (True, "--replay-precision float64")
    assert replay_precision("float32", "cpu", ["cuda"])[0] is False


def test_first_pushes_block_only_when_nobody_else_can_work() -> None:
    from gradwire.coordinator.decisions import decide_first_push

    how, why = decide_first_push(2, 0)
    assert how == "block" and "no other" in why  # the run's start: nothing to do but wait for the state
    how, why = decide_first_push(1, 3)
    assert how == "background" and "3 other" in why  # a joiner: the others train meanwhile


def test_a_streak_of_failed_rounds_backs_off_gives_up_and_ends_with_a_good_round() -> None:
    from gradwire.coordinator.decisions import FailedRounds

    streak = FailedRounds(max_rounds=3, max_seconds=10.0)
    assert [streak.failed(t)[:2] for t in (100.0, 101.0)] == [("retry", 0.5), ("retry", 1.0)]
    action, _, reason = streak.failed(105.0)  # 3 in a row, but over 5 s only
    assert action == "retry" and "3 round(s) in a row, 5.0 s" in reason
    action, delay, reason = streak.failed(110.0)  # 4 in a row over 10 s (the streak began at 100)
    assert (action, delay) == ("give-up", 0.0) and "--max-failed-seconds 10" in reason
    streak.succeeded()
    assert streak.failed(500.0)[:2] == ("retry", 0.5)  # a new streak, timed from its own start
    assert streak.since == 500.0
