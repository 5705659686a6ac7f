"""The coordinator's decisions, as pure functions that say why: testable with no network and no model.

Each takes plain values and returns ``(decision, reason)``; the round loop acts on the decision and logs
the reason.
"""

from __future__ import annotations

from typing import Literal

SyncAction = Literal["push", "replay", "current"]


def decide_sync(known_version: int | None, base_version: int, target_version: int) -> tuple[SyncAction, str]:
    """What a worker needs before it computes at ``target_version``.

    ``base_version`` is where every in-sync worker starts the round; the pending update (if any) moves it
    to ``target_version``. ``known_version`` is the replica version we know the worker holds.
    """
    if known_version is None:
        return "push", "worker state unknown (new, failed or resumed)"
    if known_version == target_version:
        return "current", "worker is at the round's version"
    if known_version == base_version:
        return "replay", "worker replays the pending update"
    return "push", f"worker at version {known_version}, round starts at {base_version}"
