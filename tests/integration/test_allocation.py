"""What a caller can make a worker allocate: a push that names a large model but brings none of its
parameters costs a real ``worker serve`` process next to nothing, sixteen at once included; and the pushes in
flight share one budget (``worker.budget``)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gradwire import statestream
from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.models import build_from_spec, model_spec
from gradwire.protocol import ModelState
from gradwire.v1 import worker_pb2 as pb
from gradwire.v1 import worker_pb2_grpc
from gradwire.worker.engine import WorkerEngine

from .conftest import live_workers, served_worker

# 4 layers of d_model 2048: about 235M parameters, 0.94 GB of float32, named in a 300-byte header.
LARGE = {**model_spec("gpt-tiny"), "config": {**model_spec("gpt-tiny")["config"], "n_layer": 4, "d_model": 2048}}
LARGE["config"]["d_ff"] = 8192
RULE = '{"optimizer": "sgd"}'


@pytest.mark.slow
def test_sixteen_pushes_naming_a_large_model_without_its_tensors_keep_the_worker_small(tmp_path) -> None:
    with served_worker(tmp_path, "--max-model-params", "300000000") as worker:
        before = worker.peak_rss_mb()

        def push(i: int) -> grpc.StatusCode | None:
            state = ModelState(f"big-{i}", 0, json.dumps(LARGE), {}, RULE)  # the header, and no tensor
            try:
                WorkerClient(worker.address, timeout=60).push_state(state)
            except WorkerError as e:
                return e.code
            return None

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(push, range(16)))
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 16
        grown = worker.peak_rss_mb() - before
        # Built whole, each would have allocated 0.94 GB (a run of this test with the model built whole
        # measured 9.3 GB); what remains is their buffers (RoPE tables) and the modules' bookkeeping.
        assert grown < 150, f"the worker's peak grew by {grown:.0f} MB"
        # And it still takes a real push.
        spec = model_spec("gpt-tiny")
        model = build_from_spec(spec, seed=0)
        state = ModelState("tiny", 0, json.dumps(spec), {n: p.detach() for n, p in model.named_parameters()}, RULE)
        (version, _), _ = worker.client.push_state(state)
        assert version == 0 and worker.proc.poll() is None


def test_pushes_in_flight_share_one_budget_and_one_that_would_overdraw_it_keeps_nothing() -> None:
    spec = model_spec("gpt-tiny")
    model = build_from_spec(spec, seed=0)
    state = ModelState("run", 0, json.dumps(spec), {n: p.detach() for n, p in model.named_parameters()}, RULE)
    state_bytes = sum(p.numel() * 4 for p in model.parameters())
    engine = WorkerEngine("cpu", push_budget=state_bytes * 3 // 2)  # one push and a half
    with live_workers(1, lambda: engine) as (worker,):
        client = worker.client(timeout=30)
        parts = list(statestream.state_parts(state, part_bytes=64 << 10))
        release = threading.Event()

        def stalled() -> Iterator[pb.Part]:  # a caller on a slow link: all but its last parts, then a pause
            for i, part in enumerate(parts):
                if i == len(parts) - 2:
                    release.wait(30)
                yield part

        stub = worker_pb2_grpc.WorkerStub(client.channel)
        first = stub.PushState.future(stalled(), timeout=30, metadata=client.call_metadata)
        held, deadline = -1, time.monotonic() + 10
        while held != engine.push_budget.held and time.monotonic() < deadline:  # until the stall
            held = engine.push_budget.held
            time.sleep(0.5)
        assert held >= state_bytes // 2

        with pytest.raises(WorkerError) as refused:
            client.push_state(dataclasses.replace(state, run_id="other"))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--push-budget-gb" in str(refused.value)
        assert engine.push_budget.held == held and "other" not in engine.sessions  # it kept nothing

        release.set()
        assert first.result().version == 0
        (version, _), _ = client.push_state(dataclasses.replace(state, run_id="other"))  # room again
        assert version == 0 and set(engine.sessions) == {"run", "other"} and engine.push_budget.held == 0
