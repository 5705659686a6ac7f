"""Shared fixtures for integration tests: real worker servers on loopback port 0, in this process."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

import grpc
import pytest
import torch

from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.trainer import Trainer
from gradwire.transport import free_port
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.server import make_server
from gradwire.worker.servicer import WorkerServicer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@dataclasses.dataclass
class LiveWorker:
    engine: WorkerEngine
    server: grpc.Server
    address: str

    def client(self, timeout: float = 60.0) -> WorkerClient:
        return WorkerClient(self.address, timeout=timeout)


@contextlib.contextmanager
def live_workers(
    n: int,
    engine_factory: Callable[[], WorkerEngine] | Sequence[Callable[[], WorkerEngine]] = lambda: WorkerEngine("cpu"),
) -> Iterator[list[LiveWorker]]:
    """``n`` real servers on loopback; ``engine_factory`` makes every engine, or one per worker (a list)."""
    factories = list(engine_factory) if isinstance(engine_factory, Sequence) else [engine_factory] * n
    assert len(factories) == n
    workers = []
    try:
        for factory in factories:
            engine = factory()
            server, port, _ = make_server(WorkerServicer(engine), host="127.0.0.1", port=0)
            workers.append(LiveWorker(engine, server, f"127.0.0.1:{port}"))
        yield workers
    finally:
        for w in workers:
            w.server.stop(grace=None)


def run_trainer(config: TrainConfig, clients: Sequence) -> Trainer:
    """Train ``config`` with ``clients`` to its last step (metrics, checkpoints and all); return the trainer."""
    trainer = Trainer(config, clients, progress=False)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


def train(config: TrainConfig, workers: Sequence[LiveWorker]) -> Trainer:
    return run_trainer(config, [w.client() for w in workers])


def corrupt_replica(worker: LiveWorker) -> None:
    """Fault: the worker's copy of the (only) run silently drifts from the coordinator's."""
    (session,) = worker.engine.sessions.values()
    with torch.no_grad():
        next(iter(session.replica.params.values())).add_(0.05)


def steps_with_fault(trainer: Trainer, fault: Callable[[], None], before: int = 3, after: int = 3) -> list[dict | None]:
    """``before`` rounds, the fault, ``after`` rounds; the records of every round (None: no usable worker)."""
    try:
        trainer.connect()
        records = [trainer.train_step() for _ in range(before)]
        fault()
        records += [trainer.train_step() for _ in range(after)]
    finally:
        trainer.close()
    return records


def rounds_in_step(config: TrainConfig, workers: Sequence[LiveWorker]) -> tuple[Trainer, list[dict | None]]:
    """``config.steps`` rounds on ``workers``; then every worker's replica is the first's, bit for bit, and
    the first's is the coordinator's (``assert_in_step``). Returns the trainer and each round's record."""
    trainer = Trainer(config, [w.client() for w in workers], progress=False)
    try:
        trainer.connect()
        records = [trainer.train_step() for _ in range(config.steps)]
        replicas = [next(iter(w.engine.sessions.values())).replica for w in workers]
        for other in replicas[1:]:
            for name, p in replicas[0].params.items():
                assert torch.equal(other.params[name], p), name
        assert_in_step(trainer, workers[0])
    finally:
        trainer.close()
    return trainer, records


def assert_in_step(trainer: Trainer, worker: LiveWorker) -> None:
    """The worker's replica is the coordinator's, bit for bit, once both apply the pending update."""
    (session,) = worker.engine.sessions.values()
    assert session.replica.version == trainer.replica.version == trainer.base_version
    trainer.flush()
    session.replica.apply(trainer.pending)
    for name, p in trainer.replica.params.items():
        assert torch.equal(session.replica.params[name], p), name


@pytest.fixture
def two_workers() -> Iterator[list[LiveWorker]]:
    with live_workers(2) as workers:
        yield workers


def worker_process(port: int, *extra: str, log: object = subprocess.DEVNULL) -> subprocess.Popen:
    """A real ``worker serve`` process on loopback ``port`` (one thread), for tests where a process must
    die, stop or restart."""
    argv = [
        sys.executable,
        "-m",
        "gradwire.worker",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


@dataclasses.dataclass
class ServedWorker:
    proc: subprocess.Popen
    client: WorkerClient
    address: str
    log: str  # the path of its log

    def peak_rss_mb(self) -> float:
        """The process's peak resident memory so far (``VmHWM``), in MB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM")


@contextlib.contextmanager
def served_worker(tmp_path: object, *extra: str, timeout: float = 60.0) -> Iterator[ServedWorker]:
    """A ``worker_process`` on a free port, ready, with a client; its output goes to ``tmp_path``/worker.log."""
    port = free_port()
    path = os.path.join(str(tmp_path), "worker.log")
    with open(path, "w") as log:
        proc = worker_process(port, *extra, log=log)
        try:
            client = WorkerClient(f"127.0.0.1:{port}", timeout=timeout)
            client.wait_ready(60)
            yield ServedWorker(proc, client, f"127.0.0.1:{port}", path)
        finally:
            proc.terminate()
            proc.wait(30)
