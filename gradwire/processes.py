"""Child processes that do not outlive their parent (a node's ranks, ``--local`` workers).

``worker_process`` starts ``python -m gradwire.worker ARGS``. On Linux it forks the worker from a fork
server that has imported torch once (``multiprocessing``'s forkserver: a fresh process, so the parent's
gRPC state never reaches a worker), so N workers, and every restart, pay torch's import once instead of N
times; elsewhere each worker is a fresh process. ``gradwire.forkpreload`` says how the server lives and
dies with its parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Protocol

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child, before it starts: a parent that is killed outright takes the child with it (Linux), by
    sending it ``sig``. (A node's ranks under their launcher or fork server; ``--local`` workers under their
    coordinator.)"""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: ranks outlive a killed launcher, as under any other supervisor
        pass


class Child(Protocol):
    """What a supervisor needs of a worker's process: ``subprocess.Popen``'s names."""

    pid: int

    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


def _forked_worker(argv: list[str], env: dict[str, str]) -> None:
    """In the forked child: SIGTERM as a fresh process has it, a session of its own, death with the fork
    server, the environment it was given (thread counts too: torch read the server's as it loaded), then
    the worker command as ``python -m gradwire.worker`` runs it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()
    die_with_parent()
    os.environ.update(env)
    threads = next((env[v] for v in THREAD_VARIABLES if v in env), None)
    if threads is not None:
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [sys.executable, *argv]
    runpy.run_module("gradwire.worker", run_name="__main__", alter_sys=True)


class ForkedChild:
    """A worker forked by the fork server (a ``multiprocessing.Process``), behind ``Popen``'s names."""

    def __init__(self, context: multiprocessing.context.ForkServerContext, argv: list[str], env: dict[str, str]):
        self._process = context.Process(target=_forked_worker, args=(argv, env))
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the child unless it has ended. It may have exited before its exit code reached the fork
        server's sentinel: then the signal finds no process, and there is nothing to stop."""
        if self._process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return self._process.exitcode


def worker_process(argv: Sequence[str], env: Mapping[str, str] = {}, *, fork: bool | None = None) -> Child:
    """``python -m gradwire.worker *argv`` with ``env`` on top of this process's environment, in a session
    of its own (a terminal's Ctrl-C reaches the parent alone, which stops it in its own way) and dying with
    its parent. ``fork``: from the fork server (default: on Linux)."""
    if fork is None:
        fork = sys.platform == "linux"
    if fork:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["gradwire.forkpreload"])
        return ForkedChild(context, list(argv), dict(env))
    return subprocess.Popen(
        [sys.executable, "-m", "gradwire.worker", *argv],
        env={**os.environ, **env},
        start_new_session=True,
        preexec_fn=die_with_parent,  # noqa: PLW1509 - one prctl call, no locks
    )
