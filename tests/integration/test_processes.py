"""``processes.worker_process``: the worker command in a child that answers as ``subprocess.Popen`` does,
forked from the torch-loaded fork server (Linux's default) or a fresh process (elsewhere)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from gradwire.processes import worker_process


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
def test_a_worker_process_runs_the_worker_command_and_exits_with_its_code(fork: bool) -> None:
    assert worker_process(["--help"], fork=fork).wait(timeout=60) == 0
    bad = worker_process(["serve", "--no-such-flag"], fork=fork)
    assert bad.wait(timeout=60) == 2  # argparse's usage error, as the command gives it
    assert bad.returncode == bad.poll() == 2


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
def test_a_serving_worker_process_has_a_session_of_its_own_and_stops_on_sigterm(fork: bool) -> None:
    worker = worker_process(["serve", "--port", "0", "--host", "127.0.0.1", "--device", "cpu"], fork=fork)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(timeout=1.0)  # it serves until told to stop
        assert worker.poll() is None and os.getsid(worker.pid) == worker.pid != os.getsid(0)
        worker.terminate()
        assert worker.wait(timeout=60) in (0, -signal.SIGTERM)  # stopped gracefully, or before it could
    finally:
        worker.kill()


def test_signalling_a_forked_worker_that_is_gone_but_not_yet_reaped_is_harmless() -> None:
    """A rank that died before the fork server reported its exit code: the launcher stopping the rest
    signals a pid with no process behind it, which must not raise (it once took the launcher down)."""
    from gradwire.processes import ForkedChild

    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now

    class Unreported:  # the fork server has not said the child ended
        exitcode = None

    child = object.__new__(ForkedChild)
    child._process, child.pid = Unreported(), gone.pid  # type: ignore[assignment]
    child.terminate()
    child.kill()
    with pytest.raises(ProcessLookupError):  # what the bare signal does
        os.kill(gone.pid, signal.SIGTERM)
