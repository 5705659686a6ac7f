"""benchmarks.cores: a benchmark's processes on cores of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from benchmarks import cores

pytestmark = pytest.mark.skipif(
    not cores.available() or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and at least 2 cores"
)


def test_the_coordinator_gets_the_first_cores_and_the_workers_the_rest() -> None:
    mine = sorted(os.sched_getaffinity(0))
    assert cores.split(1) == (frozenset(mine[:1]), frozenset(mine[1:]))
    for bad in (0, len(mine), len(mine) + 1):
        with pytest.raises(ValueError, match="both it and the workers need at least one"):
            cores.split(bad)


def test_pinned_holds_every_thread_and_those_it_starts_then_gives_them_back() -> None:
    before = os.sched_getaffinity(0)
    one = frozenset(sorted(before)[-1:])
    stop = threading.Event()
    old = threading.Thread(target=stop.wait)  # started before: moved too
    old.start()
    seen = []
    try:
        with cores.pinned(one):
            new = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            new.start()
            new.join()
            assert os.sched_getaffinity(0) == one and os.sched_getaffinity(old.native_id) == one
        assert seen == [one]
        assert os.sched_getaffinity(0) == before and os.sched_getaffinity(old.native_id) == before
    finally:
        stop.set()
        old.join()


def test_every_process_a_process_started_is_moved_with_its_threads() -> None:
    one = frozenset(sorted(os.sched_getaffinity(0))[-1:])
    code = (
        "import subprocess, sys, time; p = subprocess.Popen(['sleep', '30']); print(p.pid, flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert {child.pid, grandchild} <= set(cores.descendants(os.getpid()))
        # from the child down, not from here: this test's process may hold other children (a fork server)
        assert cores.pin_descendants(one, root=child.pid) == [grandchild]
        cores.pin(child.pid, one)
        assert os.sched_getaffinity(child.pid) == os.sched_getaffinity(grandchild) == one
        for tid in os.listdir(f"/proc/{child.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == one
        assert os.sched_getaffinity(0) != one  # this process stays where it was
    finally:
        if grandchild is not None:
            os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()
