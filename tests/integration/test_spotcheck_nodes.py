"""Spot checks against nodes of several ranks (real processes, gloo on CPU): a DDP, a local-sgd, an fsdp and
a pipeline node each return the fingerprint of the gradient the coordinator recomputes on one device from
the rows it sent them, in gradient mode and in local-SGD rounds (``coordinator.spotcheck``)."""

from __future__ import annotations

import pytest

from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.metrics import read_metrics

from .conftest import run_trainer
from .test_node import TIMEOUT, Node, node_config, nodes

MODES = ("ddp", "local-sgd", "fsdp", "pipeline")


@pytest.mark.slow
def test_every_node_mode_returns_the_fingerprint_the_coordinator_recomputes(tmp_path):
    with nodes(tmp_path, *(Node(("--node-mode", mode)) for mode in MODES)) as started:
        clients = [WorkerClient(address, timeout=TIMEOUT) for address, _ in started]
        for name, inner in (("local-sgd rounds", 2), ("gradient mode", 1)):
            # One round per node, each checked in turn (--spot-check-every 1 goes round the senders).
            config = node_config(
                tmp_path / name,
                len(MODES),
                inner_steps=inner,
                checkpoint_every=0,
                spot_check_every=1,
                spot_check_by="recompute",
            )
            run_trainer(config, clients)
            records = read_metrics(tmp_path / name)
            checks = [r["spot_check"] for r in records]
            assert all(c["passed"] is True for c in checks), (name, checks)
            assert sorted(c["worker"] for c in checks) == sorted(address for address, _ in started), name
            assert all(r["successful_workers"] == len(MODES) for r in records)
