"""``worker serve --nproc-per-node N``: start the node's N ranks and keep them running, as torchrun would.

Each rank is this same command in a process of its own, with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so ``torchrun --nproc-per-node N -m gradwire.worker serve ...``
runs the very same code. The launcher only supervises:

* SIGTERM/SIGINT go to rank 0, which stops serving gracefully and tells the other ranks to stop;
* when any rank exits (a crash, a lost rank, rank 0 giving up after a failed collective), the others are
  stopped and the whole node starts again on a fresh process group - up to ``max_restarts`` times. The
  coordinator sees the node fail for a round and pushes it the state when it is back, as for any worker.

Each rank is started by ``processes.worker_process``: on Linux, forked from a server that loaded torch once.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Sequence

from gradwire.processes import Child, worker_process
from gradwire.transport import free_port

log = logging.getLogger(__name__)

_POLL = 0.2


def rank_env(rank: int, world: int, port: int, restart: int) -> dict[str, str]:
    """torchrun's variables for one rank (on top of the launcher's environment)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
    }


def launch(argv: Sequence[str], nproc: int, *, max_restarts: int = 3, grace: float = 5.0) -> int:
    """Run ``python -m gradwire.worker *argv`` as ranks 0..nproc-1 until a signal; return the exit code."""
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for restart in range(max_restarts + 1):
            port = free_port()
            procs = [worker_process(argv, rank_env(r, nproc, port, restart)) for r in range(nproc)]
            log.info(
                "node of %d ranks started (pids %s)%s",
                nproc,
                [p.pid for p in procs],
                f", restart {restart}" if restart else "",
            )
            while not stopping and all(p.poll() is None for p in procs):
                time.sleep(_POLL)
            if stopping:
                procs[0].send_signal(signal.SIGTERM)  # rank 0 stops serving, then stops the others
                _reap(procs, grace + 30)
                return 0
            failed = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
            log.error(
                "node rank(s) exited: %s; stopping the rest", ", ".join(f"rank {r} with {code}" for r, code in failed)
            )
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            _reap(procs, 10)
        log.error("node failed %d times; giving up", max_restarts + 1)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _reap(procs: list[Child], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
