"""Shared fixtures for integration tests: real worker servers on loopback port 0, in this process."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

import grpc
import pytest

from gradwire.coordinator.client import WorkerClient
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
def live_workers(n: int, engine_factory: Callable[[], WorkerEngine] = lambda: WorkerEngine("cpu")) -> Iterator[list[LiveWorker]]:
    workers = []
    try:
        for _ in range(n):
            engine = engine_factory()
            server, port, _ = make_server(WorkerServicer(engine), host="127.0.0.1", port=0)
            workers.append(LiveWorker(engine, server, f"127.0.0.1:{port}"))
        yield workers
    finally:
        for w in workers:
            w.server.stop(grace=None)


@pytest.fixture
def two_workers() -> Iterator[list[LiveWorker]]:
    with live_workers(2) as workers:
        yield workers
