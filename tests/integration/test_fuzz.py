"""The worker under a few thousand fuzzed calls (benchmarks/fuzz.py, built from the proto): a real
``worker serve`` process never dies or hangs, never answers INTERNAL or UNKNOWN, keeps its memory bounded,
and serves a normal round afterwards."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from benchmarks.fuzz import fuzz
from gradwire import protocol
from gradwire.compression import CodecConfig
from gradwire.coordinator.client import WorkerClient
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, ModelState, WorkOrder
from gradwire.replica import Replica, StateUpdate

from .conftest import served_worker

SPEC = model_spec("gpt-tiny")
RULE = UpdateRule(optimizer="sgd")
RUN = "fuzzed"


def valid_messages(client: WorkerClient) -> tuple[ModelState, WorkOrder, Replica]:
    replica = Replica(build_from_spec(SPEC, seed=0), RULE)
    state = ModelState(
        RUN, 0, json.dumps(SPEC), {n: p.detach().clone() for n, p in replica.model.named_parameters()}, RULE.to_json()
    )
    client.push_state(state)
    batch = np.random.default_rng(0).integers(0, 8192, (2, 17)).astype(np.uint16)
    first, _ = client.run_round(WorkOrder(RUN, 0, 0, batch, CodecConfig(), replica.fingerprint()))
    update = StateUpdate(0.1, (first.gradient,), (float(first.tokens),))
    return state, WorkOrder(RUN, 1, 0, batch, CodecConfig(), replica.fingerprint(), update), replica


@pytest.mark.slow
def test_the_worker_survives_fuzzing_and_serves_a_round_afterwards(tmp_path) -> None:
    with served_worker(tmp_path, "--max-model-params", "5000000") as worker:
        client = worker.client
        state, order, replica = valid_messages(client)
        start_mb = worker.peak_rss_mb()
        t0 = time.monotonic()
        counts = fuzz(
            client.channel,
            protocol.state_to_proto(state),
            protocol.order_to_proto(order),
            calls=1200,
            seconds=150,
            seed=1,
            metadata=client.call_metadata,
            deadline=10.0,
        )
        elapsed = time.monotonic() - t0
        total = sum(sum(c.values()) for c in counts.values())
        assert worker.proc.poll() is None, "the worker died"
        assert total >= 800, f"only {total} calls in {elapsed:.0f} s"
        for rpc, answers in counts.items():
            assert "INTERNAL" not in answers and "UNKNOWN" not in answers, (
                rpc,
                answers,
                open(worker.log).read()[-3000:],
            )
            assert "DEADLINE_EXCEEDED" not in answers, (rpc, answers)  # nothing hangs
            assert "RESOURCE_EXHAUSTED" not in answers, (rpc, answers)  # no error text too large to send back
        assert (
            counts["PushState"].get("INVALID_ARGUMENT", 0) > 50 and counts["RunRound"].get("INVALID_ARGUMENT", 0) > 50
        )
        assert worker.peak_rss_mb() < start_mb + 600, (start_mb, worker.peak_rss_mb())
        # Still a working worker: a fresh state and a plain round.
        client.push_state(state)
        batch = np.random.default_rng(9).integers(0, 8192, (2, 17)).astype(np.uint16)
        result, _ = client.run_round(WorkOrder(RUN, 5, 0, batch, CodecConfig(), replica.fingerprint()))
        assert result.status == OK
        client.close()
