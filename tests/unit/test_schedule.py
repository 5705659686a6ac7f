"""Learning-rate schedules: the warmup formula, each schedule's shape and endpoints, flags in errors."""

from __future__ import annotations

import itertools
import math

import pytest

from gradwire.optim import SCHEDULES, Schedule, lr_at


@pytest.mark.parametrize("kind", SCHEDULES)
def test_warmup_is_the_historical_formula_for_every_schedule(kind: str) -> None:
    s = Schedule(kind=kind, warmup=7, total=50)
    for step in range(7):
        # The exact expression the coordinator always used: no rounding difference allowed.
        assert s.factor(step) == (step + 1) / 7
        assert lr_at(3e-4, s, step) == 3e-4 * ((step + 1) / 7)
    assert s.factor(6) == 1.0  # the warmup ends at exactly the base learning rate


def test_constant_is_one_after_warmup_and_beyond_any_total() -> None:
    assert [Schedule().factor(t) for t in (0, 1, 10**6)] == [1.0, 1.0, 1.0]
    assert [Schedule(warmup=4, total=10).factor(t) for t in (4, 9, 10, 100)] == [1.0] * 4
    assert lr_at(0.5, Schedule(), 3) == 0.5


def test_cosine_endpoints_and_monotone_decay() -> None:
    s = Schedule(kind="cosine", warmup=10, total=110, min_ratio=0.1)
    assert s.factor(10) == 1.0  # the end of warmup
    assert s.factor(60) == pytest.approx(0.55)  # halfway: the cosine's midpoint
    assert s.factor(110) == 0.1  # min_ratio at total ...
    assert s.factor(111) == s.factor(10**6) == 0.1  # ... and held beyond it
    decay = [s.factor(t) for t in range(10, 111)]
    assert all(a > b for a, b in itertools.pairwise(decay))
    assert decay[-2] > 0.1  # the floor is reached at total, not before


def test_cosine_without_warmup_or_floor() -> None:
    s = Schedule(kind="cosine", total=4)
    expected = [0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(4)] + [0.0]
    assert [s.factor(t) for t in range(5)] == pytest.approx(expected)


def test_cosine_restarts_jump_back_up_at_cycle_boundaries() -> None:
    s = Schedule(kind="cosine", warmup=5, total=35, min_ratio=0.2, cycles=3)  # cycles of 10 steps
    for start in (5, 15, 25):
        cycle = [s.factor(t) for t in range(start, start + 10)]
        assert cycle[0] == 1.0  # every cycle starts at the full learning rate
        assert all(a > b for a, b in itertools.pairwise(cycle))
        assert cycle[-1] == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 0.9)))
        if start > 5:
            assert s.factor(start) > s.factor(start - 1)  # the restart
    assert s.factor(35) == s.factor(50) == 0.2


def test_cosine_cycles_of_unequal_step_counts_still_split_the_span_evenly() -> None:
    s = Schedule(kind="cosine", total=10, cycles=3)  # boundaries at 10/3 and 20/3: steps 4 and 7 restart
    values = [s.factor(t) for t in range(10)]
    rises = [t for t in range(1, 10) if values[t] > values[t - 1]]
    assert rises == [4, 7]
    assert values[0] == 1.0


def test_linear_endpoints_and_monotone_decay() -> None:
    s = Schedule(kind="linear", warmup=2, total=12, min_ratio=0.25)
    assert s.factor(2) == 1.0
    assert s.factor(7) == pytest.approx(0.625)
    assert s.factor(12) == s.factor(13) == s.factor(1000) == 0.25
    decay = [s.factor(t) for t in range(2, 13)]
    assert all(a > b for a, b in itertools.pairwise(decay))
    assert [Schedule(kind="linear", total=4).factor(t) for t in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_inverse_sqrt_values() -> None:
    assert [Schedule(kind="inverse-sqrt").factor(t) for t in (0, 3, 99)] == [1.0, 0.5, 0.1]
    s = Schedule(kind="inverse-sqrt", warmup=4)
    assert [s.factor(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(3) == math.sqrt(4 / 4)  # continuous with the warmup's end
    assert s.factor(15) == 0.5 and s.factor(399) == 0.1  # sqrt(4 / 16), sqrt(4 / 400)
    assert s.factor(10**6) > 0  # no horizon, no floor: total is not needed


def test_bad_step_is_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        Schedule().factor(-1)


BAD = [
    ({"kind": "step"}, "lr-schedule"),
    ({"warmup": -1}, "warmup-steps"),
    ({"warmup": True}, "warmup-steps"),
    ({"kind": "cosine", "total": -5}, "lr-schedule"),
    ({"kind": "cosine", "warmup": 10, "total": 10}, "warmup-steps"),
    ({"kind": "linear", "total": 0}, "warmup-steps"),
    ({"kind": "cosine", "total": 10, "min_ratio": 1.5}, "min-lr-ratio"),
    ({"kind": "linear", "total": 10, "min_ratio": -0.1}, "min-lr-ratio"),
    ({"kind": "cosine", "total": 10, "min_ratio": float("nan")}, "min-lr-ratio"),
    ({"kind": "constant", "min_ratio": 0.1}, "min-lr-ratio"),
    ({"kind": "inverse-sqrt", "min_ratio": 0.1}, "min-lr-ratio"),
    ({"kind": "cosine", "total": 10, "cycles": 0}, "lr-cycles"),
    ({"kind": "cosine", "total": 10, "cycles": 11}, "lr-cycles"),
    ({"kind": "linear", "total": 10, "cycles": 2}, "lr-cycles"),
]


@pytest.mark.parametrize("prefix", ["", "inner-"])
@pytest.mark.parametrize(("kwargs", "flag"), BAD)
def test_every_validation_error_names_the_flag(kwargs: dict, flag: str, prefix: str) -> None:
    with pytest.raises(ValueError, match=f"--{prefix}{flag}") as info:
        Schedule(flag_prefix=prefix, **kwargs)
    if not prefix:
        assert "--inner-" not in str(info.value)
    else:
        assert f"--{flag}" not in str(info.value).replace(f"--{prefix}", "")  # every flag in it is prefixed


def test_schedules_lists_the_cli_choices() -> None:
    assert SCHEDULES == ("constant", "cosine", "linear", "inverse-sqrt")
    for kind in SCHEDULES:
        Schedule(kind=kind, total=10)  # each builds with a total and defaults
