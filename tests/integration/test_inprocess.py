"""In-process workers (benchmarks' simulation) are the service minus gRPC: the same run, the same bytes."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from gradwire.compression import CodecConfig, NonFiniteInput
from gradwire.coordinator.client import WorkerError
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.errors import Cancelled
from gradwire.protocol import ProtocolError, WorkOrder
from gradwire.replica import Fingerprint
from gradwire.worker.inprocess import in_process_clients

from .conftest import live_workers, run_trainer


def test_in_process_workers_train_exactly_as_served_ones(tmp_path):
    settings = dict(
        model="gpt-tiny", steps=3, batch_size=2, sequence_length=32, inner_steps=2, inner_learning_rate=3e-3
    )
    with live_workers(2) as workers:
        served = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "a")), [w.client() for w in workers])
    simulated = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "b")), in_process_clients(2))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    # The same messages, byte for byte (both count the serialized messages, not gRPC's framing).
    assert [(r["bytes_up"], r["bytes_down"]) for r in a] == [(r["bytes_up"], r["bytes_down"]) for r in b]
    for (name, p), (_, q) in zip(served.model.named_parameters(), simulated.model.named_parameters()):
        assert torch.equal(p, q), name


def test_in_process_failures_surface_as_the_served_statuses(monkeypatch):
    """What the servicer would answer (gradwire.errors.status_for), a bug as itself."""
    client = in_process_clients(1)[0]
    for error, code in (
        (NonFiniteInput("w"), grpc.StatusCode.FAILED_PRECONDITION),
        (ProtocolError("bad order"), grpc.StatusCode.INVALID_ARGUMENT),
        (Cancelled("stop"), grpc.StatusCode.CANCELLED),
    ):
        monkeypatch.setattr(client.engine, "run_round", lambda *a, error=error, **k: (_ for _ in ()).throw(error))
        with pytest.raises(WorkerError) as info:
            client.run_round(ORDER)
        assert info.value.code == code and str(error) in info.value.details
    monkeypatch.setattr(client.engine, "run_round", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        client.run_round(ORDER)


ORDER = WorkOrder("r", 0, 0, np.zeros((1, 3), np.uint16), CodecConfig(), Fingerprint((), (), ()))
