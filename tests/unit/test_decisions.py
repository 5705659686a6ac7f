"""The coordinator's pure decisions: each returns what to do and why."""

import pytest

from gradwire.coordinator.decisions import decide_sync


@pytest.mark.parametrize(("known", "base", "target", "action"), [(None, 2, 3, "push"), (3, 2, 3, "current"), (2, 2, 3, "replay"), (2, 2, 2, "current"), (1, 2, 3, "push"), (4, 2, 3, "push")])
def test_decide_sync(known, base, target, action):
    got, reason = decide_sync(known, base, target)
    assert got == action and reason
