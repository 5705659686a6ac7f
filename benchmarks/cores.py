"""A benchmark's processes on cores of their own (Linux): the coordinator on some, the workers on the rest.

On one machine a coordinator and its workers share the cores, and whatever one of them does between two
rounds takes time from the other: a worker's work after its result (its fingerprint, the decode of its own
payload ahead of the replay) lands in the coordinator's turnaround. On separate machines it would not.
``split`` gives the coordinator the first cores this process may use and the workers the rest; ``pinned``
holds every thread of this process on a set while a block runs; ``pin_descendants`` moves every thread of
every process this one started (the fork server and the workers it forked) onto another. Threads started
later inherit the set of the thread that starts them, so a process pinned whole stays pinned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def available() -> bool:
    """Whether this platform can pin threads to cores (Linux: ``sched_setaffinity`` and ``/proc``)."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def split(coordinator: int) -> tuple[frozenset[int], frozenset[int]]:
    """The coordinator's ``coordinator`` cores (the first this process may use) and the rest, the workers'.
    ``ValueError`` unless both get at least one."""
    cores = sorted(os.sched_getaffinity(0))
    if not 0 < coordinator < len(cores):
        raise ValueError(
            f"{coordinator} core(s) for the coordinator, of the {len(cores)} this process may use: "
            "both it and the workers need at least one"
        )
    return frozenset(cores[:coordinator]), frozenset(cores[coordinator:])


def pin(pid: int, cores: frozenset[int]) -> None:
    """Every thread of process ``pid`` onto ``cores`` (threads that end meanwhile are passed over)."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), cores)


@contextlib.contextmanager
def pinned(cores: frozenset[int] | None) -> Iterator[None]:
    """Every thread of this process on ``cores`` while the block runs (None: left where they are), then back
    on the cores it had."""
    if cores is None:
        yield
        return
    before = frozenset(os.sched_getaffinity(0))
    pin(os.getpid(), cores)
    try:
        yield
    finally:
        pin(os.getpid(), before)


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, theirs, and so on (read from ``/proc``), in no particular order."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the name
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def pin_descendants(cores: frozenset[int], root: int | None = None) -> list[int]:
    """Every thread of every process this one (or ``root``) started onto ``cores``; returns their process ids.
    A fork server among them stays there for what it forks later: pin them back when done."""
    pids = descendants(os.getpid() if root is None else root)
    for pid in pids:
        pin(pid, cores)
    return pids
