"""coordinator/runlock.py: one holder per run directory; a refusal names the directory and the holder's pid;
a holder killed by SIGKILL frees the directory (the lock is a flock, not a pid file)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gradwire.coordinator.runlock import LOCK_FILE, RunLock, RunLocked

# A holder in another process: takes the lock, says so, and waits to be killed.
HOLDER = """
import sys, time
from gradwire.coordinator.runlock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunLock(run_dir) as lock:
        assert lock.held
        note = json.loads((run_dir / LOCK_FILE).read_text())
        assert (note["pid"], note["host"]) == (os.getpid(), socket.gethostname())
        # Another open of the file in the same process is another flock holder: refused too.
        with pytest.raises(RunLocked, match=f"run directory {run_dir} is in use .*pid {os.getpid()} on host"):
            RunLock(run_dir).acquire()
        with pytest.raises(RuntimeError, match="already held by this RunLock"):
            lock.acquire()
    assert not lock.held
    with RunLock(run_dir):  # released on leaving the block
        pass
    assert (run_dir / LOCK_FILE).exists()  # the file stays; only the flock matters


def test_a_holder_that_wrote_no_note_yet_is_still_a_holder(tmp_path: Path) -> None:
    tmp_path.joinpath(LOCK_FILE).touch()
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunLocked, match="it has not written its pid yet"):
            RunLock(tmp_path).acquire()
    finally:
        os.close(fd)
    RunLock(tmp_path).acquire().release()


def test_a_holder_killed_by_sigkill_frees_the_directory(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        with pytest.raises(RunLocked, match=f"pid {holder.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        holder.stdout.close()
        holder.stderr.close()
    assert holder.returncode == -signal.SIGKILL
    with RunLock(tmp_path) as lock:  # no stale pid file to clean: the kernel dropped the flock
        assert lock.held
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
