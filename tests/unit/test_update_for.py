"""What each worker is sent: ``OuterStrategy.update_for`` (a sender's replay leaves out its own payload)
and ``RoundWork.order`` (every field of a worker's order taken from the round's plain values)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradwire.compression import CodecConfig, CompressedGradient, GradientCodec, robust
from gradwire.coordinator.outer import DeltaOuter, OuterStrategy, ReplayOuter, make_outer
from gradwire.coordinator.round import RoundWork
from gradwire.models import build_from_spec, resolve_model
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import PROTOCOL_VERSION, GossipLinks, LocalSteps, WorkOrder, order_from_proto, order_to_proto
from gradwire.replica import Fingerprint, Replica, StateUpdate

CODEC = CodecConfig(topk=16)
SGD = UpdateRule(optimizer="sgd", momentum=0.9)


@pytest.fixture(scope="module")
def spec() -> dict:
    return resolve_model("gpt-tiny", from_scratch=True, seed=0).spec


def outer_for(spec: dict, rule: UpdateRule = SGD) -> OuterStrategy:
    return make_outer(build_from_spec(spec, seed=0), rule, CODEC, spec, 0)


def payloads(outer: OuterStrategy, n: int, seed: int) -> tuple[CompressedGradient, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = {name: p.shape for name, p in outer.replica.params.items()}
    return tuple(outer.codec.compress({k: torch.randn(s, generator=g) for k, s in shapes.items()}) for _ in range(n))


def step(
    outer: OuterStrategy, sent: tuple[CompressedGradient, ...], weights: tuple[float, ...], **kwargs: object
) -> float:
    aggregator = robust.aggregate(outer.codec, sent, weights)
    return outer.step(aggregator, sent, weights, 0.1, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- update_for


def test_a_sender_is_sent_the_replay_without_its_own_payload(spec: dict) -> None:
    outer = outer_for(spec)
    assert isinstance(outer, ReplayOuter)
    sent = payloads(outer, 3, seed=0)
    step(outer, sent, (1.0, 2.0, 3.0), senders=(4, 1, 6), round=9)
    pending = outer.pending
    assert pending is not None and pending.own is None
    for position, slot in enumerate((4, 1, 6)):
        update = outer.update_for(slot)
        assert update == pending.without(position, 9)
        assert update is not None and update.own == (position, 9)
        others = [p for i, p in enumerate(sent) if i != position]
        assert len(update.payloads) == 2 and all(a is b for a, b in zip(update.payloads, others))
        assert update.weights == (1.0, 2.0, 3.0)  # the weights still count the payload left out
        assert update.with_own(sent[position]) == pending
    for slot in (0, 2, 5):  # not a sender of that round: the whole replay
        assert outer.update_for(slot) is pending


def test_a_sender_that_puts_its_payload_back_lands_where_the_coordinator_does(spec: dict) -> None:
    outer = outer_for(spec)
    sent = payloads(outer, 2, seed=1)
    step(outer, sent, (3.0, 1.0), senders=(0, 1), round=0)
    worker = Replica(build_from_spec(spec, seed=0), SGD)  # a worker's copy, at the same start
    assert worker.fingerprint() == outer.base_fingerprint
    update = outer.update_for(1)
    assert update is not None
    with pytest.raises(ValueError, match="with_own"):
        worker.apply(update)  # a replay short of the worker's own payload is never applied as is
    worker.apply(update.with_own(sent[1]))
    outer.apply_pending()
    assert worker.version == outer.replica.version == 1
    for name, p in outer.replica.params.items():
        assert torch.equal(worker.params[name], p), name


def test_a_step_without_senders_sends_everyone_the_whole_replay(spec: dict) -> None:
    outer = outer_for(spec)
    step(outer, payloads(outer, 2, seed=2), (1.0, 1.0))
    assert all(outer.update_for(slot) is outer.pending for slot in range(3))


def test_each_round_leaves_out_its_own_senders(spec: dict) -> None:
    outer = outer_for(spec)
    step(outer, payloads(outer, 2, seed=3), (1.0, 1.0), senders=(0, 1), round=0)
    second = payloads(outer, 2, seed=4)
    step(outer, second, (1.0, 1.0), senders=(1, 2), round=1)
    pending = outer.pending
    assert pending is not None and pending.payloads == second
    assert outer.update_for(0) is pending  # sent in round 0, not in this update
    assert outer.update_for(1) == pending.without(0, 1)
    assert outer.update_for(2) == pending.without(1, 1)


def test_a_delta_goes_whole_to_every_worker(spec: dict) -> None:
    outer = outer_for(spec, UpdateRule(optimizer="adamw"))
    assert isinstance(outer, DeltaOuter)
    step(outer, payloads(outer, 2, seed=5), (1.0, 1.0), senders=(0, 1), round=0)
    pending = outer.pending
    assert pending is not None and pending.delta is not None and pending.payloads == ()
    for slot in (0, 1, 2):
        assert outer.update_for(slot) is pending


def test_after_rebase_nothing_is_pending_or_left_out(spec: dict) -> None:
    outer = outer_for(spec)
    step(outer, payloads(outer, 2, seed=6), (1.0, 1.0), senders=(0, 1), round=0)
    outer.apply_pending()
    outer.rebase()
    assert outer.pending is None
    assert [outer.update_for(slot) for slot in (0, 1, 2)] == [None, None, None]
    assert outer.base_version == outer.target_version == outer.replica.version == 1
    assert outer.base_fingerprint == outer.replica.fingerprint()


def test_a_push_before_the_pending_replay_carries_the_slots_own_payload_and_survives_a_checkpoint(spec: dict) -> None:
    """A sender pushed at the base version (a resumed run's first round) gets its own payload of the pending
    replay with the state, so the order that leaves it out still applies; pushed past the replay, or a slot
    that sent nothing, gets none. An --overlap checkpoint keeps who sent which payload."""
    outer = outer_for(spec)
    sent = payloads(outer, 2, seed=8)
    step(outer, sent, (1.0, 1.0), senders=(3, 1), round=4)
    assert outer.model_state("run", spec, {}, {}, slot=1).own == (4, sent[1])
    assert outer.model_state("run", spec, {}, {}, slot=0).own is None  # not a sender of that round
    groups = outer.checkpoint_behind()
    resumed = outer_for(spec)
    resumed.restore(groups, outer.base_version)
    assert resumed.update_for(3) == outer.update_for(3) and resumed.update_for(3).own == (0, 4)
    state = resumed.model_state("run", spec, {}, {}, slot=3)
    assert state.own is not None and state.own[0] == 4 and state.own[1] == sent[0]
    outer.apply_pending()  # past the replay: the state already holds it, and no update follows
    assert outer.model_state("run", spec, {}, {}, slot=1).own is None


def test_senders_must_match_the_payloads(spec: dict) -> None:
    outer = outer_for(spec)
    step(outer, payloads(outer, 2, seed=7), (1.0, 1.0), senders=(0, 1), round=0)
    before = outer.pending
    sent = payloads(outer, 3, seed=8)
    with pytest.raises(ValueError, match="2 senders for 3 payloads"):
        step(outer, sent, (1.0, 1.0, 1.0), senders=(0, 1), round=1)
    # Refused before anything moved: the same update pending, the replica not advanced.
    assert outer.pending is before and outer.base_version == 0 and outer.replica.version == 0
    assert outer.update_for(0) == before.without(0, 0)


# ------------------------------------------------------------------------------------------- RoundWork.order


def rows(n: int, first: int) -> np.ndarray:
    return np.arange(first, first + n * 9, dtype=np.uint16).reshape(n, 9)


def check_fields(order: WorkOrder, want: dict[str, object]) -> None:
    assert set(want) == {f.name for f in dataclasses.fields(WorkOrder)}  # a new field must be checked here
    for name, value in want.items():
        got = getattr(order, name)
        if isinstance(value, np.ndarray) or value is None:
            assert got is value, name
        else:
            assert got == value, name


def test_a_gradient_mode_order_carries_the_rounds_values() -> None:
    batches, ahead = {0: rows(2, 0), 3: rows(2, 100)}, {3: rows(2, 200)}
    work = RoundWork(
        5,
        CODEC,
        batches,
        ahead,
        feedback_beta=0.9,
        micro_batch_size=1,
        sync_tolerance=1e-3,
        compute_before_update=True,
        clip_grad_norm=0.5,
        fingerprint_gradient=True,
        stream_buckets=4,
        fingerprint_every=7,
    )
    fingerprint = Fingerprint((1.0, 2.0), (3.0, 4.0), (0.5,))
    codec = GradientCodec({"w": (16, 16)}, CODEC)
    payload = codec.compress({"w": torch.randn(16, 16, generator=torch.Generator().manual_seed(0))})
    update = StateUpdate(0.25, (payload,), (16.0,))
    missed = (StateUpdate(0.125, (payload,), (8.0,)), StateUpdate(0.0625, (payload, payload), (1.0, 2.0)))
    common = {
        "run_id": "run-a",
        "round": 5,
        "codec": CODEC,
        "fingerprint": fingerprint,
        "feedback_beta": 0.9,
        "micro_batch_size": 1,
        "sync_tolerance": 1e-3,
        "local_steps": None,
        "protocol_version": PROTOCOL_VERSION,
        "compute_before_update": True,
        "clip_grad_norm": 0.5,
        "fingerprint_gradient": True,
        "next_local_steps": None,  # gradient mode
        "stream_buckets": 4,
        "gossip": None,  # a centralized round
        "peer_key": b"",  # --relay peers: the dispatcher adds the run's (RoundDispatcher._order), and seed
        "seed": False,
        "fingerprint_every": 7,
    }
    order = work.order("run-a", 3, 4, update, fingerprint, missed)
    check_fields(
        order,
        {
            **common,
            "base_version": 4,
            "batch": batches[3],
            "update": update,
            "catch_up": missed,
            "next_batch": ahead[3],
        },
    )
    # A slot without a look-ahead batch gets none; without an update, none and no catch-up.
    check_fields(
        work.order("run-a", 0, 5, None, fingerprint),
        {**common, "base_version": 5, "batch": batches[0], "update": None, "catch_up": (), "next_batch": None},
    )
    back = order_from_proto(order_to_proto(order))  # a valid order on the wire
    assert np.array_equal(back.batch, batches[3]) and np.array_equal(back.next_batch, ahead[3])
    assert (back.round, back.base_version, back.clip_grad_norm, back.feedback_beta) == (5, 4, 0.5, 0.9)
    assert back.fingerprint_gradient and back.stream_buckets == 4 and back.fingerprint_every == 7
    assert back.update == update and back.catch_up == missed


def test_a_local_sgd_order_carries_its_inner_steps() -> None:
    local = LocalSteps(2, InnerOptimizerConfig(), (1e-3, 5e-4), clip_grad_norm=1.0)
    batches = {1: rows(4, 0)}
    work = RoundWork(2, CODEC, batches, local_steps=local, stream_buckets=4)  # not for a local-SGD round
    fingerprint = Fingerprint((1.0,), (1.0,), ())
    order = work.order("run-b", 1, 2, None, fingerprint)
    check_fields(
        order,
        {
            "run_id": "run-b",
            "round": 2,
            "base_version": 2,
            "batch": batches[1],
            "codec": CODEC,
            "fingerprint": fingerprint,
            "update": None,
            "feedback_beta": 0.999,
            "micro_batch_size": 0,
            "sync_tolerance": 1e-4,
            "local_steps": local,
            "protocol_version": PROTOCOL_VERSION,
            "catch_up": (),
            "compute_before_update": False,
            "next_batch": None,
            "clip_grad_norm": 0.0,
            "fingerprint_gradient": False,
            "next_local_steps": None,
            "stream_buckets": 0,
            "gossip": None,
            "peer_key": b"",
            "seed": False,
            "fingerprint_every": 1,
        },
    )
    assert order.inner_steps == 2
    assert order_from_proto(order_to_proto(order)).local_steps == local
    # A gossip round: each slot's own links go into its order, and nowhere else.
    links = GossipLinks("1", {"0": 1 / 3, "2": 1 / 3}, 0.5, fresh={"1": None, "0": None, "2": None})
    gossip = dataclasses.replace(work, gossip={1: links}).order("run-b", 1, 0, None, fingerprint)
    assert gossip.gossip == links and order_from_proto(order_to_proto(gossip)).gossip == links


def test_an_overlapped_local_sgd_order_announces_the_next_rounds_rows_and_inner_steps() -> None:
    local = LocalSteps(2, InnerOptimizerConfig(), (1e-3, 5e-4))
    following = LocalSteps(2, InnerOptimizerConfig(), (4e-4, 3e-4))  # the schedule moves on
    work = RoundWork(
        2,
        CODEC,
        {1: rows(4, 0), 2: rows(4, 50)},
        {1: rows(4, 100)},
        local_steps=local,
        compute_before_update=True,
        next_local_steps={1: following, 2: following},
    )
    fingerprint = Fingerprint((1.0,), (1.0,), ())
    order = work.order("run-b", 1, 2, None, fingerprint)
    assert order.next_local_steps == following and np.array_equal(order.next_batch, rows(4, 100))
    assert work.order("run-b", 2, 2, None, fingerprint).next_local_steps is None  # no batch announced: nothing
    back = order_from_proto(order_to_proto(order))
    assert back.next_local_steps == following and np.array_equal(back.next_batch, order.next_batch)
