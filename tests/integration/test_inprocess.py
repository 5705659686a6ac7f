"""In-process workers (benchmarks' simulation) are the service minus gRPC: the same run, the same bytes."""

from __future__ import annotations

import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.inprocess import in_process_clients
from gradwire.coordinator.metrics import read_metrics

from .conftest import live_workers, run_trainer


def test_in_process_workers_train_exactly_as_served_ones(tmp_path):
    settings = dict(model="gpt-tiny", steps=3, batch_size=2, sequence_length=32, inner_steps=2, inner_learning_rate=3e-3)
    with live_workers(2) as workers:
        served = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "a")), [w.client() for w in workers])
    simulated = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "b")), in_process_clients(2))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    # The same messages, byte for byte (both count the serialized messages, not gRPC's framing).
    assert [(r["bytes_up"], r["bytes_down"]) for r in a] == [(r["bytes_up"], r["bytes_down"]) for r in b]
    for (name, p), (_, q) in zip(served.model.named_parameters(), simulated.model.named_parameters()):
        assert torch.equal(p, q), name
