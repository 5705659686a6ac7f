"""worker.budget: the bytes the state pushes in flight may hold together."""

from __future__ import annotations

import pytest

from gradwire.errors import TooLarge
from gradwire.worker.budget import PushBudget


def test_pushes_share_one_budget_and_give_it_back_however_they_end() -> None:
    budget = PushBudget(100)
    with budget.push() as a:
        a.take(60)
        with pytest.raises(RuntimeError), budget.push() as b:
            b.take(30)
            assert budget.held == 90
            raise RuntimeError("the push failed half way")
        assert budget.held == 60  # b's 30 came back
        with budget.push() as c:
            with pytest.raises(TooLarge, match=r"would hold 0\.0 MiB.*push budget of 0\.0 MiB.*--push-budget-gb"):
                c.take(41)
            assert c.held == 0 and budget.held == 60  # refused: it holds nothing more
            c.take(40)
            assert budget.held == 100
        assert budget.held == 60
    assert budget.held == 0


def test_a_budget_is_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        PushBudget(0)


def test_a_push_gives_back_what_it_needed_only_for_a_while() -> None:
    budget = PushBudget(100)
    with budget.push() as a:
        a.take(50)  # its shards, for as long as the push lasts
        for _ in range(5):  # five tensors of 40 bytes, each held only while it loads
            a.take(40)
            a.give_back(40)
        assert a.held == budget.held == 50
        a.give_back(80)  # never more than it holds
        assert a.held == budget.held == 0
