"""``--local N``: worker daemons as local subprocesses on free loopback ports, for demos and tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from gradwire.security import TOKEN_ENV
from gradwire.transport import free_port
from gradwire.worker.launch import die_with_parent


@contextlib.contextmanager
def local_workers(
    n: int, *, threads: int | None = None, device: str = "cpu", token: str | None = None
) -> Iterator[list[str]]:
    """Start ``n`` ``worker serve`` processes; yield their addresses; stop them (SIGTERM, then kill).

    With ``token`` the workers require it (handed over in the environment, not on a command line)."""
    if n < 1:
        raise ValueError(f"--local must be >= 1, got {n}")
    # Split the cores: n processes each using every core would only thrash.
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if token is not None:
        env[TOKEN_ENV] = token
    procs, addresses = [], []
    try:
        for _ in range(n):
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "gradwire.worker",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                device,
            ]
            # A session of their own: Ctrl-C in the terminal reaches the coordinator alone, which finishes its
            # round and checkpoints with the workers still up, then stops them; if it is killed outright,
            # they die with it.
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent))  # noqa: PLW1509 - one prctl call
            addresses.append(f"127.0.0.1:{port}")
        yield addresses
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
