"""An fsdp node's ZeRO stages (``worker serve --node-mode fsdp --node-shard optimizer|gradients``, real
processes, gloo on CPU): each computes what a DDP node computes, a ZeRO-1 node resumes every rank's
partition of the inner state, and each of its ranks holds about half of a DDP rank's inner state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.shard import Job, measure
from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import DENSE_CODEC
from gradwire.models import build_from_spec
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.protocol import LocalSteps, ModelState, WorkOrder
from gradwire.replica import StateUpdate

from .test_node import (
    SPEC,
    TIMEOUT,
    Node,
    assert_close,
    batch,
    contribution,
    nodes,
    resume_against_straight,
    state,
    versus_ddp,
)

pytestmark = pytest.mark.slow

ZERO = {stage: ("--node-mode", "fsdp", "--node-shard", stage) for stage in ("optimizer", "gradients")}


@pytest.mark.parametrize("shard", ["gradients", "optimizer"], ids=["zero2", "zero1"])
def test_a_zero_stages_local_sgd_rounds_are_a_ddp_nodes(tmp_path, shard: str):
    # Against a DDP node's local-SGD rounds (computed once a session: versus_ddp). (Gradient mode differs
    # from ZeRO-3's, which test_fsdp_node checks, only in when FSDP2 regathers a block's parameters.)
    got, ddp = versus_ddp(tmp_path, *ZERO[shard], local=True)
    for a, b in zip(got[:2], ddp[:2]):
        assert_close(a, b, atol=1e-4)
    # Compressed: a coefficient on the edge of a top-k may tip the other way under float noise.
    for name, g in ddp[2].items():
        cos = torch.nn.functional.cosine_similarity(got[2][name].flatten(), g.flatten(), dim=0)
        assert cos > 0.99 or g.abs().max() < 1e-7, name


def _stateful_rounds(tmp_path: Path, *flag_sets: tuple[str, ...]) -> list[dict]:
    """For a node of each of ``flag_sets`` (two at a time, started together): two exact local-SGD rounds of
    AdamW and of Muon (one run each, on one node): the second round steps on from the inner state the first
    left, on every rank's partition of it. Also the node's mode, as its Describe says ("describe")."""
    out = []
    for pair in (flag_sets[i : i + 2] for i in range(0, len(flag_sets), 2)):
        with nodes(tmp_path, *(Node(flags) for flags in pair)) as started:
            out += [_stateful_rounds_on(address) for address, _ in started]
    return out


def _stateful_rounds_on(address: str) -> dict:
    out = {}
    with WorkerClient(address, timeout=TIMEOUT) as client:
        out["describe"] = client.describe().node_mode
        # AdamW with the embedding at twice the rate: a param group of its own, partitioned like any other
        adamw = InnerOptimizerConfig(name="adamw", lr_scales=(("tok_emb.weight", 2.0),))
        for config in (adamw, InnerOptimizerConfig(name="muon", momentum=0.95)):
            replica, st = state()
            client.push_state(ModelState(config.name, 0, st.model_json, st.parameters, st.update_rule_json))
            steps = LocalSteps(2, config, (0.01, 0.01))
            order = WorkOrder(config.name, 0, 0, batch(8), DENSE_CODEC, replica.fingerprint(), local_steps=steps)
            first, _ = client.run_round(order)
            before = replica.fingerprint()
            update = StateUpdate(1.0, (first.gradient,), (1.0,))
            replica.apply(update)
            second, _ = client.run_round(
                WorkOrder(config.name, 1, 0, batch(8, seed=1), DENSE_CODEC, before, update, local_steps=steps)
            )
            out[config.name] = [contribution(replica, first), contribution(replica, second)]
    return out


def test_zero_and_pipeline_nodes_step_adamw_and_muon_as_a_ddp_node(tmp_path):
    """ZeroRedundancyOptimizer wraps AdamW, and Muon's two optimizers, each partitioned over the ranks: the
    same steps as DDP's. ZeRO-3's Muon orthogonalizes DTensor shards (torch gathers what each product
    needs) and a pipeline's each stage's whole matrices: the same steps up to the float noise Newton-Schulz
    magnifies (two pipelines that differ only in their micro-batches differ as much), so only directions
    are compared there."""
    zero, ddp, full, pipe = _stateful_rounds(
        tmp_path, ZERO["optimizer"], ("--node-mode", "ddp"), ("--node-mode", "fsdp"), ("--node-mode", "pipeline")
    )
    assert (zero["describe"], ddp["describe"]) == ("fsdp:optimizer", "ddp")  # Describe names the ZeRO stage
    for name in ("adamw", "muon"):
        for a, b in zip(zero[name], ddp[name]):
            assert_close(a, b, atol=1e-4)
    for a, b in zip(full["adamw"] + pipe["adamw"], ddp["adamw"] * 2):
        assert_close(a, b, atol=1e-4)
    for a, b in zip(full["muon"] + pipe["muon"], ddp["muon"] * 2):
        whole = torch.nn.functional.cosine_similarity(
            torch.cat([a[n].flatten() for n in b]), torch.cat([t.flatten() for t in b.values()]), dim=0
        )
        assert whole > 0.99


def test_a_zero1_node_resumes_every_ranks_partition_of_the_inner_state(tmp_path):
    """Each rank saves the inner AdamW state of its own partition of the parameters: the checkpoint holds
    both ranks', together every parameter's, and a fresh node resumed from it trains on bit for bit."""
    saved = resume_against_straight(tmp_path, *ZERO["optimizer"])
    (inner,) = [g for name, g in saved.items() if name.startswith("inner-")]
    mine = {n.rpartition("/")[0] for n in inner if not n.startswith("rank1.")}
    theirs = {n.removeprefix("rank1.").rpartition("/")[0] for n in inner if n.startswith("rank1.")}
    assert mine and theirs and not mine & theirs  # two partitions
    assert mine | theirs == {n for n, _ in build_from_spec(SPEC).named_parameters()}
    (feedback,) = [g for name, g in saved.items() if name.startswith("feedback-")]
    assert not any(n.startswith("rank1.") for n in feedback)  # rank 0 encodes the node's payload, as DDP's


def test_each_zero1_rank_holds_half_the_inner_state_and_zero2_half_of_everything(tmp_path):
    """gpt-5m (no tensor is near half of it, so ZeRO-1's whole-tensor partitions balance), 2 ranks, after a
    local-SGD round: ZeRO-1 splits only the inner state, ZeRO-2 the replica and working copy too."""
    held = {}
    for mode, shard in (("ddp", "full"), ("fsdp", "optimizer"), ("fsdp", "gradients")):
        job = Job("gpt-5m", mode, 2, 1, 1, 1, 16, "cpu", str(tmp_path / f"store-{shard}"), str(tmp_path / shard), shard)
        held[shard] = measure(job)["state_bytes_by_part"]  # the benchmark's own measurement (benchmarks.shard)
    ddp, zero1, zero2 = held["full"][0], held["optimizer"], held["gradients"]
    assert sum(rank["inner"] for rank in zero1) == ddp["inner"]  # two partitions of one state
    for rank in zero1:
        assert 0.4 * ddp["inner"] < rank["inner"] < 0.6 * ddp["inner"], (rank, ddp)
        assert (rank["replica"], rank["working"]) == (ddp["replica"], ddp["working"])  # whole on each rank
    for part in ("replica", "working", "inner"):
        assert all(0.45 * ddp[part] < rank[part] < 0.55 * ddp[part] for rank in zero2), part
