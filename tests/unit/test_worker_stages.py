"""The worker's round stages without a network: the pure check, and the two compute strategies.

The check says why a replica cannot serve an order; the compute stage never moves the replica (gradient
rounds only fill ``.grad``; local-SGD rounds train a working copy and return ``replica - working``).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from gradwire.compression import CodecConfig
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import LocalSteps, ModelState, ProtocolError, WorkOrder
from gradwire.replica import Replica
from gradwire.worker.check import ReplicaView, check_order
from gradwire.worker.compute import Placement, gradient_step, local_steps, strategy_for
from gradwire.worker.node import merge_rank_states, merge_shard_states, rank_state, shard_state
from gradwire.worker.nodeconf import RankInfo, rank_from_env
from gradwire.worker.session import Session

SPEC = model_spec("gpt-tiny")


@pytest.fixture
def session() -> Session:
    replica = Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"))
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    return Session.from_state(
        ModelState("run", 4, json.dumps(SPEC), params, replica.rule.to_json()), torch.device("cpu")
    )


def order_for(session: Session, rows: int = 4, plan: LocalSteps | None = None, **changes: object) -> WorkOrder:
    batch = np.random.default_rng(0).integers(0, 8192, (rows, 17)).astype(np.uint16)
    base = WorkOrder(
        "run", 0, session.replica.version, batch, CodecConfig(), session.replica.fingerprint(), local_steps=plan
    )
    return dataclasses.replace(base, **changes)


def view(session: Session, **changes: object) -> ReplicaView:
    r = session.replica
    return dataclasses.replace(
        ReplicaView(r.version, r.fingerprint(), r.numels, session.vocab_size, session.stale, session.parameter_names),
        **changes,
    )


def test_check_says_why_a_replica_cannot_serve(session: Session) -> None:
    order = order_for(session)
    assert check_order(order, view(session)).ok
    cases = {
        "no replica": None,
        "waiting for a state push": view(session, stale=True),
        "replica at version 3, order starts from 4": view(session, version=3),
    }
    for reason, replica in cases.items():
        verdict = check_order(order, replica)
        assert not verdict.ok and reason in verdict.reason
    with torch.no_grad():
        next(iter(session.replica.params.values())).mul_(1.01)
    verdict = check_order(order, view(session))
    assert not verdict.ok and "fingerprint mismatch" in verdict.reason


def test_check_rejects_tokens_past_the_embedding(session: Session) -> None:
    order = order_for(session, batch=np.full((2, 5), 8192, np.uint16))
    with pytest.raises(ProtocolError, match="token id 8192"):
        check_order(order, view(session))


def test_check_rejects_inner_learning_rates_for_parameters_the_model_lacks(session: Session) -> None:
    scaled = InnerOptimizerConfig(lr_scales=(("tok_emb.weight", 2.0),))
    plan = LocalSteps(2, scaled, (1e-2, 5e-3))
    assert check_order(order_for(session, plan=plan), view(session)).ok
    stray = LocalSteps(
        2, dataclasses.replace(scaled, lr_scales=(("tok_emb.weight", 2.0), ("no.such", 2.0))), (1e-2,) * 2
    )
    for order in (order_for(session, plan=stray), order_for(session, plan=plan, next_local_steps=stray)):
        with pytest.raises(ProtocolError, match=r"the model does not have: \['no.such'\]"):
            check_order(order, view(session))


def test_a_gradient_round_leaves_the_replica_where_it_was(session: Session) -> None:
    before = {n: p.detach().clone() for n, p in session.replica.params.items()}
    order = order_for(session)
    assert strategy_for(order) is gradient_step
    out = gradient_step(session, order, torch.from_numpy(order.batch.astype(np.int64)), lambda: False)
    assert out.tokens == 4 * 16 and np.isfinite(out.loss)
    assert all(torch.equal(p, before[n]) for n, p in session.replica.params.items())
    assert any(g.abs().sum() > 0 for g in out.tensors.values())


def test_local_steps_train_a_working_copy_and_return_the_pseudo_gradient(session: Session) -> None:
    plan = LocalSteps(2, InnerOptimizerConfig(name="adamw"), (1e-2, 5e-3))
    order = order_for(session, rows=4, plan=plan)
    assert strategy_for(order) is local_steps
    before = {n: p.detach().clone() for n, p in session.replica.params.items()}
    out = local_steps(session, order, torch.from_numpy(order.batch.astype(np.int64)), lambda: False)
    assert out.tokens == 4 * 16 and np.isfinite(out.loss)
    working = dict(session._working.named_parameters())
    for name, p in session.replica.params.items():
        assert torch.equal(p, before[name]), name  # the replica is never trained on
        torch.testing.assert_close(out.tensors[name], p - working[name])
    assert any(d.abs().max() > 0 for d in out.tensors.values())
    steps = {float(v) for k, v in session.inner_state().items() if k.endswith("/step")}
    assert steps == {2.0}
    # The next round starts the working copy from the replica again, and AdamW keeps counting.
    local_steps(
        session, dataclasses.replace(order, round=1), torch.from_numpy(order.batch.astype(np.int64)), lambda: False
    )
    assert {float(v) for k, v in session.inner_state().items() if k.endswith("/step")} == {4.0}


def test_inner_state_from_a_checkpoint_is_loaded_when_the_optimizer_is_built(session: Session) -> None:
    plan = LocalSteps(1, InnerOptimizerConfig(name="adamw"), (1e-2,))
    order = order_for(session, rows=2, plan=plan)
    local_steps(session, order, torch.from_numpy(order.batch.astype(np.int64)), lambda: False)
    saved = session.inner_state()
    params = {n: p.detach().clone() for n, p in session.replica.params.items()}
    restored = Session.from_state(
        ModelState("run", 4, json.dumps(SPEC), params, session.replica.rule.to_json(), inner_optimizer=saved),
        torch.device("cpu"),
    )
    assert set(restored.inner_state()) == set(saved)  # waiting to be loaded, and reported as such
    restored.inner_optimizer(plan.optimizer)
    assert all(torch.equal(restored.inner_state()[k], v) for k, v in saved.items())
    # Another optimizer's state does not fit: the optimizer starts afresh instead of failing the round.
    other = Session.from_state(
        ModelState("run", 4, json.dumps(SPEC), params, session.replica.rule.to_json(), inner_optimizer=saved),
        torch.device("cpu"),
    )
    other.inner_optimizer(InnerOptimizerConfig(name="sgd", momentum=0.9))
    assert other.inner_state() == {}


def test_bf16_autocast_computes_nearly_the_fp32_gradient(session: Session) -> None:
    order = order_for(session)
    tokens = torch.from_numpy(order.batch.astype(np.int64))
    fp32 = gradient_step(session, order, tokens, lambda: False, Placement())
    exact = {n: g.clone() for n, g in fp32.tensors.items()}
    bf16 = gradient_step(session, order, tokens, lambda: False, Placement(precision="bf16"))
    assert abs(bf16.loss - fp32.loss) < 0.05
    for name, g in bf16.tensors.items():
        assert g.dtype == torch.float32  # master weights and gradients stay float32
        cos = torch.nn.functional.cosine_similarity(g.flatten(), exact[name].flatten(), dim=0)
        assert cos > 0.95 or exact[name].abs().max() < 1e-6, name


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"mode": "allreduce"}, "--node-mode"),
        ({"sync_steps": -1}, "--node-sync-steps"),
        ({"comm_hook": "zip"}, "--node-comm-hook"),
        ({"precision": "fp8"}, "--precision"),
        ({"mode": "fsdp", "shard": "params"}, "--node-shard"),
        ({"shard": "optimizer"}, "--node-shard optimizer applies to --node-mode fsdp .* not ddp"),
        ({"mode": "local-sgd", "shard": "gradients"}, "--node-shard gradients applies to --node-mode fsdp"),
        ({"mode": "pipeline", "shard": "optimizer"}, "not pipeline"),
    ],
)
def test_placement_settings_name_their_flag(changes: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        Placement(**changes)


class _Node:  # what Placement's properties ask of a node: that there is one
    world_size = 2


@pytest.mark.parametrize(
    ("mode", "shard", "ddp", "sharded", "reshard", "partitioned", "own"),
    [
        ("fsdp", "full", False, True, True, False, False),  # ZeRO-3
        ("fsdp", "gradients", False, True, False, False, False),  # ZeRO-2: gathered from forward to backward
        ("fsdp", "optimizer", True, False, True, True, True),  # ZeRO-1: DDP's compute, its own inner state
        ("ddp", "full", True, False, True, False, False),
        ("local-sgd", "full", False, False, True, False, True),
    ],
)
def test_what_a_node_shards_at_each_zero_stage(
    mode: str, shard: str, ddp: bool, sharded: bool, reshard: bool, partitioned: bool, own: bool
) -> None:
    p = Placement(_Node(), mode, shard=shard)  # type: ignore[arg-type]
    assert (p.ddp, p.sharded, p.split, p.reshard_after_forward) == (ddp, sharded, sharded, reshard)
    assert (p.partitioned_optimizer, p.own_inner_state) == (partitioned, own)
    # auto takes any stage (it applies where auto picks fsdp); one device has nothing to shard
    assert Placement(mode="auto", shard=shard).shard == shard
    assert not Placement(mode="fsdp", shard=shard).partitioned_optimizer


def test_rank_environment_follows_torchrun() -> None:
    assert rank_from_env({}) is None and rank_from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert rank_from_env({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2"}) == RankInfo(2, 4, 2)
    for bad in (
        {"WORLD_SIZE": "2", "RANK": "2"},
        {"WORLD_SIZE": "x"},
        {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "-1"},
    ):
        with pytest.raises(ValueError, match="RANK|WORLD_SIZE"):
            rank_from_env(bad)


def test_every_ranks_inner_state_travels_under_its_own_names() -> None:
    states = [{"w/exp_avg": torch.zeros(2)}, {"w/exp_avg": torch.ones(2)}, {"w/exp_avg": torch.full((2,), 2.0)}]
    merged = merge_rank_states(states)
    assert set(merged) == {"w/exp_avg", "rank1.w/exp_avg", "rank2.w/exp_avg"}
    for rank, state in enumerate(states):
        assert torch.equal(rank_state(merged, rank)["w/exp_avg"], state["w/exp_avg"])
    # Saved by a single worker, a DDP node or a smaller node: a rank without its own starts from rank 0's.
    assert torch.equal(rank_state(merged, 5)["w/exp_avg"], states[0]["w/exp_avg"])
    assert rank_state({"w/exp_avg": torch.ones(1)}, 1).keys() == {"w/exp_avg"}
    assert merge_rank_states([]) == {}


def test_a_zero1_nodes_partitions_come_back_whole_to_any_rank() -> None:
    """ZeRO-1 ranks each save their partition's state: every rank (of any width, or a DDP node) gets the
    whole state back and keeps its partition; a rank's own entries win, a parameter's keys stay together."""
    one = {"a/exp_avg": torch.zeros(2), "a/step": torch.tensor(3.0)}
    two = {"b/exp_avg": torch.ones(2), "b/step": torch.tensor(3.0)}
    merged = merge_rank_states([one, two])
    for rank in range(4):
        assert rank_state(merged, rank).keys() == {*one, *two}
    assert torch.equal(rank_state(merged, 1)["b/exp_avg"], two["b/exp_avg"])
    # rank 1 saved its own state of "a" too (local-sgd): its own wins, whole, over rank 0's
    mine = {"a/exp_avg": torch.full((2,), 7.0), "a/step": torch.tensor(5.0), **two}
    got = rank_state(merge_rank_states([one, mine]), 1)
    assert torch.equal(got["a/exp_avg"], mine["a/exp_avg"]) and got["a/step"].item() == 5.0


def test_a_sharded_nodes_states_come_back_only_to_a_node_as_wide() -> None:
    states = [{"group0": torch.zeros(2)}, {"group0": torch.ones(3)}]
    merged = merge_shard_states(states, 2)
    assert set(merged) == {"fsdp2.0.group0", "fsdp2.1.group0"}
    assert torch.equal(shard_state(merged, 2, 1)["group0"], torch.ones(3))
    assert shard_state(merged, 4, 1) == {}  # another width cuts other rows: start afresh
    assert rank_state(merged, 0) == {}  # not for a single worker or a DDP node either


@pytest.mark.parametrize(
    ("changes", "torch_parallel"),
    [
        ({}, False),
        ({"node": _Node()}, False),
        ({"node": _Node(), "mode": "local-sgd"}, False),
        ({"node": _Node(), "mode": "fsdp"}, True),
        ({"node": _Node(), "mode": "fsdp", "shard": "optimizer"}, True),  # ZeRO-1 steps inside torch's optimizer
        ({"node": _Node(), "mode": "pipeline"}, True),
    ],
)
def test_only_sharded_zero_and_pipelined_nodes_load_torchs_parallel_stacks(changes: dict, torch_parallel: bool) -> None:
    assert Placement(**changes).torch_parallel is torch_parallel
