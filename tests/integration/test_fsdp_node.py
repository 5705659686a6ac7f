"""A sharded node (``worker serve --nproc-per-node N --node-mode fsdp``, real processes, gloo on CPU):
rounds computed as a DDP node computes them, replays on the shards, and a coordinator that trains with it."""

from __future__ import annotations

import dataclasses
import json

import grpc
import pytest
import torch

from gradwire import statestream
from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.coordinator.config import DENSE_CODEC
from gradwire.coordinator.metrics import read_metrics
from gradwire.models import spec_elements
from gradwire.protocol import OK, WorkOrder
from gradwire.v1 import worker_pb2 as pb
from gradwire.v1 import worker_pb2_grpc
from gradwire.worker.sizing import GB, HEADROOM, state_bytes

from .conftest import run_trainer
from .test_node import (
    TIMEOUT,
    Node,
    _local,
    assert_close,
    batch,
    node,
    node_config,
    nodes,
    resume_against_straight,
    state,
    versus_ddp,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("local", "ranks"), [(False, 2), (True, 2), (True, 4)], ids=["gradient", "local-sgd", "local-sgd-4-ranks"]
)
def test_a_sharded_node_computes_what_a_ddp_node_computes(tmp_path, local: bool, ranks: int):
    fsdp, ddp = versus_ddp(tmp_path, "--node-mode", "fsdp", local=local, ranks=ranks)
    for a, b in zip(fsdp[:2], ddp[:2]):
        assert_close(a, b, atol=1e-4)
    # Compressed: each rank encoded its own tensors; the payload decodes to what the DDP node's does (a
    # coefficient on the edge of a top-k may tip the other way under float noise: compare directions).
    for name, g in ddp[2].items():
        cos = torch.nn.functional.cosine_similarity(fsdp[2][name].flatten(), g.flatten(), dim=0)
        assert cos > 0.99 or g.abs().max() < 1e-7, name


@pytest.mark.slow
def test_a_push_that_fails_half_way_leaves_every_rank_as_it_was(tmp_path):
    # Every rank keeps its rows of each tensor as the push streams in; a push that fails - a bad tensor half
    # way, or a hash that fails once every tensor is in - is dropped on every rank, and the node serves on.
    replica, st = state()
    names = list(st.parameters)
    middle = names[len(names) // 2]
    bad = dataclasses.replace(st, version=5, parameters={**st.parameters, middle: st.parameters[middle][:1]})
    newer = dataclasses.replace(st, version=5, parameters={n: t + 1 for n, t in st.parameters.items()})
    *parts, last = statestream.state_parts(newer, part_bytes=64 << 10)
    broken = [*parts, pb.Part(data=last.data, last=True, total_bytes=last.total_bytes, sha256=bytes(32))]
    # A push budget of a byte more than a push takes here (_budget_for): every push below fits it.
    flags = ("--node-mode", "fsdp", "--push-budget-gb", f"{(_budget_for(st) + 1) / GB:.12f}")
    with node(tmp_path, *flags) as (address, _), WorkerClient(address, timeout=TIMEOUT) as client:
        client.push_state(st)
        with pytest.raises(WorkerError, match="shape") as info:
            client.push_state(bad)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as rpc:
            worker_pb2_grpc.WorkerStub(client.channel).PushState(
                iter(broken), timeout=TIMEOUT, metadata=client.call_metadata
            )
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "SHA-256" in rpc.value.details()
        assert client.describe().replicas == {"run": 0}
        # The fingerprint is summed over the ranks' shards: it agrees only if every rank kept version 0's.
        result, _ = client.run_round(WorkOrder("run", 0, 0, batch(4), DENSE_CODEC, replica.fingerprint()))
        assert result.status == OK, result.reason
        client.push_state(newer)
        replica.load_state(newer.parameters, version=5)
        result, _ = client.run_round(WorkOrder("run", 1, 5, batch(4), DENSE_CODEC, replica.fingerprint()))
        assert (result.status, result.version) == (OK, 5), result.reason


@pytest.mark.slow
def test_a_coordinator_trains_with_a_sharded_node(tmp_path):
    """An auto node that shards this run's model: the coordinator learns the mode it picked at the push
    (what the status page shows), and trains."""
    with node(tmp_path, "--rank-memory-gb", f"{_between():.9f}") as (address, _):
        client = WorkerClient(address, timeout=TIMEOUT)
        assert client.describe().node_mode == "auto"
        trainer = run_trainer(node_config(tmp_path / "run", 6, checkpoint_every=0), [client])
    assert trainer.roster.slots[0].node_mode == "fsdp"
    records = read_metrics(tmp_path / "run")
    assert all(r["ranks"] == 2 and r["successful_workers"] == 1 and r["pushes"] == 0 for r in records[1:])
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["node_bus_bytes"] > 0 for r in records)  # torch's own collectives, counted (worker.bus)


def _between() -> float:
    """A rank memory in GB that a half share of gpt-tiny's local-SGD state fits (with outer momentum or
    without) and the whole does not."""
    elements = spec_elements(json.loads(state()[1].model_json))
    whole = sum(state_bytes(elements, momentum=False, local_sgd=True).values())  # 28 B/param, 32 with momentum
    return whole * 0.6 / HEADROOM / GB


@pytest.mark.slow
def test_a_sharded_node_resumes_every_ranks_feedback_and_inner_state(tmp_path):
    """Each rank's error feedback (of its tensors) and inner AdamW state (of its rows) is checkpointed and
    restored: a fresh sharded node resumed after 2 rounds ends bit for bit where 4 straight rounds end."""
    saved = resume_against_straight(tmp_path, "--node-mode", "fsdp")
    for kind in ("feedback", "inner"):
        (group,) = [g for name, g in saved.items() if name.startswith(f"{kind}-")]
        assert {n.split(".", 2)[1] for n in group} == {"0", "1"} and all(n.startswith("fsdp2.") for n in group)


@pytest.mark.slow
def test_auto_shards_a_model_that_does_not_fit_a_rank_whole_and_refuses_one_that_never_fits(tmp_path):
    replica, st = state()
    elements = spec_elements(json.loads(st.model_json))
    between = _between()
    order = WorkOrder("run", 0, 0, batch(8), DENSE_CODEC, replica.fingerprint(), local_steps=_local(2, lr=0.05))
    fits, never = Node(("--rank-memory-gb", f"{between:.9f}")), Node(("--rank-memory-gb", f"{between / 4:.9f}"))
    # A gossip run needs the whole model on every rank: ZeRO-1's share does not fit this node either
    # (tests/integration/test_gossip_node.py has an auto node where it fits).
    gossip = dataclasses.replace(st, run_id="gossip", gossip=True)
    with nodes(tmp_path, fits, never) as [(address, _), (small, _)]:
        with WorkerClient(address, timeout=TIMEOUT) as client:
            assert client.describe().node_mode == "auto"  # nothing pushed yet
            client.push_state(st)
            assert client.describe().node_mode == "fsdp"
            result, _ = client.run_round(order)
            assert result.status == OK
            with pytest.raises(WorkerError) as refused:
                client.push_state(gossip)
            assert list(client.describe().replicas) == ["run"] and client.describe().node_mode == "fsdp"
        with WorkerClient(small, timeout=TIMEOUT) as client, pytest.raises(WorkerError) as e:
            client.push_state(st)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{elements:,} parameters" in e.value.details and "even sharded over 2 ranks" in e.value.details
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "with its inner state split over 2 ranks (ZeRO-1)" in refused.value.details
    assert "gossip rounds need the whole model on every rank" in refused.value.details


def _budget_for(st) -> int:
    """What a push of ``st`` takes of a 2-rank split node's push budget at most: its ranks' shards, taken
    as it starts, and its largest tensor while it loads (each rank keeps its rows in its shards)."""
    shards = 4 * -(-spec_elements(json.loads(st.model_json)) // 2)
    return shards + max(len(piece) for piece in statestream.read_state(statestream.state_parts(st), 1 << 30, ""))


@pytest.mark.slow
def test_a_sharded_nodes_push_takes_its_shards_from_the_push_budget_and_a_tensor_only_while_it_loads(tmp_path):
    # One byte short of _budget_for: refused, and nothing kept (test_a_push_that_fails_half_way_... pushes
    # with one byte more).
    _, st = state()
    flags = ("--node-mode", "fsdp", "--push-budget-gb", f"{(_budget_for(st) - 1) / GB:.12f}")
    with node(tmp_path, *flags) as (address, _), WorkerClient(address, timeout=TIMEOUT) as client:
        with pytest.raises(WorkerError) as e:
            client.push_state(st)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--push-budget-gb" in e.value.details
        assert client.describe().replicas == {}
