"""``--local N``: worker daemons as local subprocesses on free loopback ports, for demos and tests.

``local_devices`` decides where they run (``--local-device``), a pure function of the worker count, the
request and the GPUs this machine has; ``local_workers`` starts them there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Iterator

from gradwire.processes import Child, worker_process
from gradwire.security import TOKEN_ENV
from gradwire.transport import free_port

log = logging.getLogger(__name__)

LOCAL_DEVICES = ("auto", "cpu", "cuda")


def local_devices(n: int, requested: str, gpu_count: int) -> tuple[list[str], str]:
    """Each of ``n`` local workers' ``--device``, and why, for ``--local-device requested`` on a machine with
    ``gpu_count`` CUDA devices. ``ValueError`` naming --local-device for a request that cannot be met.

    auto: one GPU per worker when there are enough, else every worker on the CPU (workers sharing a GPU
    would fight over its memory, and a mix of CPU and GPU workers waits for the slowest); cuda: worker i on
    GPU i, round-robin when there are fewer GPUs than workers; cpu: every worker on the CPU.
    """
    if requested not in LOCAL_DEVICES:
        raise ValueError(f"--local-device must be one of {', '.join(LOCAL_DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return ["cpu"] * n, f"--local-device cpu: {n} local worker(s) on the CPU"
    if requested == "cuda":
        if gpu_count < 1:
            raise ValueError("--local-device cuda: no CUDA device is available here (use --local-device cpu or auto)")
        devices = [f"cuda:{i % gpu_count}" for i in range(n)]
        if gpu_count < n:
            return devices, f"--local-device cuda: {n} local workers share {gpu_count} GPU(s), round-robin"
        return devices, f"--local-device cuda: one GPU per local worker (cuda:0..cuda:{n - 1})"
    if gpu_count >= n:
        return [f"cuda:{i}" for i in range(n)], f"one GPU per local worker (cuda:0..cuda:{n - 1} of {gpu_count})"
    if gpu_count == 0:
        return ["cpu"] * n, f"no CUDA device here: {n} local worker(s) on the CPU"
    return ["cpu"] * n, (
        f"{gpu_count} GPU(s) for {n} local workers: all on the CPU (--local-device cuda shares the GPUs instead)"
    )


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@contextlib.contextmanager
def local_workers(
    n: int,
    *,
    threads: int | None = None,
    device: str = "cpu",
    token: str | None = None,
    precision: str | None = None,
) -> Iterator[list[str]]:
    """Start ``n`` ``worker serve`` processes; yield their addresses; stop them (SIGTERM, then kill).

    ``device`` is ``--local-device``: auto, cpu or cuda (see ``local_devices``); ValueError if it cannot be
    met. With ``token`` the workers require it (handed over in the environment, not on a command line).
    ``precision``: their ``--precision`` (auto, fp32 or bf16; None: the worker's default)."""
    if n < 1:
        raise ValueError(f"--local must be >= 1, got {n}")
    devices, reason = local_devices(n, device, 0 if device == "cpu" else _gpu_count())
    log.info("local workers: %s", reason)
    # Split the cores: n processes each using every core would only thrash.
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if token is not None:
        env[TOKEN_ENV] = token
    procs: list[Child] = []
    addresses: list[str] = []
    try:
        for worker_device in devices:
            port = free_port()
            argv = [
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                worker_device,
                *(["--precision", precision] if precision is not None else []),
            ]
            # A session of their own: Ctrl-C in the terminal reaches the coordinator alone, which finishes its
            # round and checkpoints with the workers still up, then stops them; if it is killed outright,
            # they die with it.
            procs.append(worker_process(argv, env))
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
