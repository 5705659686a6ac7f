"""What a caller can make a real ``worker serve`` process allocate: a push that names a large model but
brings none of its parameters costs the worker next to nothing, sixteen at once included."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.models import build_from_spec, model_spec
from gradwire.protocol import ModelState

from .conftest import served_worker

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
