"""Delayed rounds (``--overlap``) on the worker: compute before the round's update, and the look-ahead.

A delayed order's contribution is the gradient at the replica *before* its update; the gradient a worker
computes ahead on the announced next batch is used only by the order that asks for exactly it, and using
it changes no bit of what the worker sends.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, LocalSteps, ModelState, ProtocolError, WorkOrder
from gradwire.replica import Fingerprint, Replica, StateUpdate
from gradwire.worker.compute import Contribution
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.lookahead import Lookahead, preview

SPEC = model_spec("gpt-tiny")
CODEC = CodecConfig(chunk=16, topk=8)


def _state(version: int = 4) -> ModelState:
    replica = Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"))
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    return ModelState("run", version, json.dumps(SPEC), params, replica.rule.to_json())


def _batch(seed: int, rows: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8192, (rows, 17)).astype(np.uint16)


def _engine() -> WorkerEngine:
    engine = WorkerEngine("cpu")
    engine.push_state(_state())
    return engine


def _order(engine: WorkerEngine, round_: int, batch: np.ndarray, **changes: object) -> WorkOrder:
    (session,) = engine.sessions.values()
    base = WorkOrder(
        "run", round_, session.replica.version, batch, CODEC, session.replica.fingerprint(), compute_before_update=True
    )
    return dataclasses.replace(base, **changes)


def _payload_bytes(result) -> bytes:
    return protocol.result_to_proto(result).gradient.SerializeToString()


def test_the_gradient_computed_ahead_is_used_and_changes_nothing():
    ahead, plain = _engine(), _engine()
    first, second = _batch(1), _batch(2)
    ahead.run_round(_order(ahead, 0, first, next_batch=second))
    plain.run_round(_order(plain, 0, first))  # announces nothing: computes round 1 when it arrives
    a = ahead.run_round(_order(ahead, 1, second))
    b = plain.run_round(_order(plain, 1, second))
    assert a.status == b.status == OK
    assert ahead.lookaheads == {"used": 1} and not plain.lookaheads
    assert _payload_bytes(a) == _payload_bytes(b) and a.loss == b.loss and a.tokens == b.tokens


@pytest.mark.parametrize("change", ["batch", "round", "micro_batch_size"])
def test_an_order_other_than_the_announced_one_drops_the_lookahead(change):
    ahead, plain = _engine(), _engine()
    first, announced = _batch(1), _batch(2)
    ahead.run_round(_order(ahead, 0, first, next_batch=announced))
    plain.run_round(_order(plain, 0, first))
    changes = {"batch": dict(batch=_batch(3)), "round": dict(round=2), "micro_batch_size": dict(micro_batch_size=2)}[
        change
    ]
    order = {**dict(round=1, batch=announced), **changes}
    a = ahead.run_round(_order(ahead, order.pop("round"), order.pop("batch"), **order))
    b = plain.run_round(
        _order(plain, 2 if change == "round" else 1, _batch(3) if change == "batch" else announced, **order)
    )
    assert ahead.lookaheads == {"dropped": 1}
    assert _payload_bytes(a) == _payload_bytes(b)


def test_a_delayed_order_computes_before_its_update_then_applies_it():
    delayed, plain, still = _engine(), _engine(), _engine()
    for engine in (delayed, plain, still):
        engine.run_round(_order(engine, 0, _batch(1)))
    (session,) = delayed.sessions.values()
    _, sent = session.last_sent
    update = StateUpdate(0.1, (sent,), (1.0,))  # the replica's rule is SGD: params -= 0.1 x the payload
    a = delayed.run_round(_order(delayed, 1, _batch(2), update=update))
    b = plain.run_round(_order(plain, 1, _batch(2), update=update, compute_before_update=False))
    c = still.run_round(_order(still, 1, _batch(2)))  # no update: the gradient at version 4
    assert (a.version, b.version, c.version) == (5, 5, 4)
    assert _payload_bytes(a) == _payload_bytes(c) != _payload_bytes(b)
    for name, p in session.replica.params.items():  # the update is applied all the same
        assert torch.equal(p, next(iter(plain.sessions.values())).replica.params[name]), name


def test_lookahead_serves_only_the_computation_it_made():
    order = WorkOrder("run", 3, 7, _batch(1), CODEC, Fingerprint((), (), ()), compute_before_update=True)
    ahead = Lookahead(dataclasses.replace(order, batch=order.batch.copy()), Contribution({}, 0.0, 0), 0.1)
    assert ahead.serves(order, 7)[0]
    for changed, version, why in (
        (dict(round=4), 7, "round"),
        (dict(run_id="other"), 7, "round"),
        (dict(compute_before_update=False), 7, "delayed"),
        (dict(local_steps=LocalSteps(1, InnerOptimizerConfig(), (1e-3,))), 7, "inner steps"),
        ({}, 8, "version"),
        (dict(micro_batch_size=2), 7, "micro-batching"),
        (dict(batch=_batch(2)), 7, "batch"),
        (dict(batch=order.batch[:2]), 7, "batch"),
    ):
        ok, reason = ahead.serves(dataclasses.replace(order, **changed), version)
        assert not ok and why in reason, (changed, reason)


def test_preview_is_the_next_round_on_the_announced_batch():
    order = WorkOrder(
        "run", 3, 7, _batch(1), CODEC, Fingerprint((), (), ()), compute_before_update=True, next_batch=_batch(2)
    )
    nxt = preview(order, 8)
    assert (nxt.round, nxt.base_version, nxt.update, nxt.next_batch) == (4, 8, None, None)
    assert np.array_equal(nxt.batch, order.next_batch)
    assert preview(dataclasses.replace(order, next_batch=None), 8) is None
    assert preview(dataclasses.replace(order, compute_before_update=False), 8) is None


def test_next_batch_crosses_the_wire_and_is_validated():
    engine = _engine()
    order = _order(engine, 0, _batch(1), next_batch=_batch(2, rows=3))
    back = protocol.order_from_proto(protocol.order_to_proto(order))
    assert back.compute_before_update and np.array_equal(back.next_batch, order.next_batch)
    m = protocol.order_to_proto(order)
    m.next_batch.data = m.next_batch.data[:-2]
    with pytest.raises(ProtocolError, match="next token batch of 3x17"):
        protocol.order_from_proto(m)
    m = protocol.order_to_proto(dataclasses.replace(order, compute_before_update=False))
    with pytest.raises(ProtocolError, match="only by orders with compute_before_update"):
        protocol.order_from_proto(m)
    m = protocol.order_to_proto(dataclasses.replace(order, next_batch=_batch(2)[:, :9]))
    with pytest.raises(ProtocolError, match="rows of 9 tokens"):
        protocol.order_from_proto(m)
    # Token ids past the embedding are refused before anything runs, in the announced batch too.
    bad = _batch(2)
    bad[0, 0] = 60000
    with pytest.raises(ProtocolError, match="outside the model's vocabulary"):
        engine.run_round(_order(engine, 0, _batch(1), next_batch=bad))
    assert not engine.lookaheads


def test_the_own_payload_decoded_while_waiting_is_what_the_replay_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker decodes the payload it sent while its result travels; the next replay (which leaves that
    payload out on the wire) sums the decoded form instead of decoding it again, to the same bits."""
    from gradwire.compression import GradientCodec

    engine = WorkerEngine("cpu")
    engine.push_state(_state())
    (session,) = engine.sessions.values()
    reference = Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"), version=4)
    first = engine.run_round(_order(engine, 0, _batch(1), compute_before_update=False))
    assert first.status == OK and session.sent_decoded is not None
    shapes = {n: tuple(p.shape) for n, p in reference.params.items()}
    other = GradientCodec(shapes, CODEC).compress(
        {n: torch.randn(s, generator=torch.Generator().manual_seed(7)) for n, s in shapes.items()}
    )
    update = StateUpdate(0.5, (first.gradient, other), (1.0, 3.0))
    decoded = []
    real_decode = GradientCodec.decode
    monkeypatch.setattr(
        GradientCodec, "decode", lambda codec, payload: decoded.append(payload) or real_decode(codec, payload)
    )
    second = engine.run_round(_order(engine, 1, _batch(2), compute_before_update=False, update=update.without(0, 0)))
    assert second.status == OK and second.version == 5
    assert decoded[0] is other and not any(p is first.gradient for p in decoded)  # its own came decoded
    reference.apply(update)  # the whole replay, every payload decoded as it arrives
    for name, p in session.replica.params.items():
        assert torch.equal(p, reference.params[name]), name


def test_the_own_payload_transformed_while_waiting_replays_to_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a replay of two senders (the sparse path), a worker also takes its next payload's inverse DCT
    while the result travels; the replay that sums it transforms only the other sender's, to the same bits
    as a replica that transforms both."""
    from gradwire.compression import GradientCodec, aggregate

    engine = WorkerEngine("cpu")
    engine.push_state(_state())
    (session,) = engine.sessions.values()
    reference = Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"), version=4)
    shapes = {n: tuple(p.shape) for n, p in reference.params.items()}
    codec = GradientCodec(shapes, CODEC)
    assert aggregate.sparse_senders(codec) >= 2

    def other(seed: int):
        return codec.compress(
            {n: torch.randn(s, generator=torch.Generator().manual_seed(seed)) for n, s in shapes.items()}
        )

    first = engine.run_round(_order(engine, 0, _batch(1), compute_before_update=False))
    assert session.sent_decoded.result().inverse is None  # no replay seen yet: nothing says it will be sparse
    update = StateUpdate(0.5, (first.gradient, other(7)), (1.0, 3.0))
    second = engine.run_round(_order(engine, 1, _batch(2), compute_before_update=False, update=update.without(0, 0)))
    reference.apply(update)
    assert second.status == OK and session.last_replay == (2, update.rule)
    own_ahead = session.sent_decoded.result()
    assert own_ahead.inverse is not None  # two senders: its own transform, taken ahead
    transformed = []
    real = aggregate.sender_inverse
    monkeypatch.setattr(aggregate, "sender_inverse", lambda c, d, *a: transformed.append(d) or real(c, d, *a))
    update = StateUpdate(0.5, (other(8), second.gradient), (2.0, 1.0))
    third = engine.run_round(_order(engine, 2, _batch(3), compute_before_update=False, update=update.without(1, 1)))
    assert third.status == OK and third.version == 6
    assert transformed and not any(d is own_ahead for d in transformed)  # the other's alone was transformed
    monkeypatch.setattr(aggregate, "sender_inverse", real)
    reference.apply(update)  # every payload decoded and transformed as it arrives
    for name, p in session.replica.params.items():
        assert torch.equal(p, reference.params[name]), name
    # A GPU without twice the transform's bytes free does without it.
    from gradwire.worker import session as sessions

    held = 4 * aggregate.inverse_numel(codec)  # float32 bytes of every chunk
    assert held == sum(4 * t.numel() for t in own_ahead.inverse.values())
    monkeypatch.setattr(sessions, "free_device_memory", lambda device: 2 * held - 1)
    assert session.inverse_ahead(codec) is None
    monkeypatch.setattr(sessions, "free_device_memory", lambda device: 2 * held)
    assert session.inverse_ahead(codec) == torch.float32


# ------------------------------------------------------------------------------------- local-SGD rounds

STEPS = LocalSteps(2, InnerOptimizerConfig(name="adamw"), (1e-3, 5e-4))
NEXT_STEPS = LocalSteps(2, InnerOptimizerConfig(name="adamw"), (4e-4, 2e-4))  # the schedule moves on


def _local(engine: WorkerEngine, round_: int, batch: np.ndarray, **changes: object) -> WorkOrder:
    return _order(engine, round_, batch, **{"local_steps": STEPS, **changes})


def _inner(engine: WorkerEngine) -> dict[str, torch.Tensor]:
    return engine.worker_state("run").inner_optimizer


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_local_sgd_round_taken_ahead_is_used_and_changes_nothing():
    """The inner steps of round 1, taken while round 0's result travels, give the payload, loss and inner
    optimizer state the round would have computed when its order came."""
    ahead, plain = _engine(), _engine()
    first, second = _batch(1), _batch(2)
    ahead.run_round(_local(ahead, 0, first, next_batch=second, next_local_steps=NEXT_STEPS))
    plain.run_round(_local(plain, 0, first))
    a = ahead.run_round(_local(ahead, 1, second, local_steps=NEXT_STEPS))
    b = plain.run_round(_local(plain, 1, second, local_steps=NEXT_STEPS))
    assert a.status == b.status == OK and ahead.lookaheads == {"used": 1}
    assert _payload_bytes(a) == _payload_bytes(b) and a.loss == b.loss
    assert a.timings["compute"] > 0 and a.timings["wall"] >= a.timings["total"]
    assert _same_tensors(_inner(ahead), _inner(plain))


@pytest.mark.parametrize("change", ["batch", "local_steps"])
def test_a_dropped_local_sgd_lookahead_leaves_no_inner_state_behind(change):
    ahead, plain = _engine(), _engine()
    first, announced = _batch(1), _batch(2)
    ahead.run_round(_local(ahead, 0, first, next_batch=announced, next_local_steps=NEXT_STEPS))
    plain.run_round(_local(plain, 0, first))
    batch, steps = {"batch": (_batch(3), NEXT_STEPS), "local_steps": (announced, STEPS)}[change]
    a = ahead.run_round(_local(ahead, 1, batch, local_steps=steps))
    b = plain.run_round(_local(plain, 1, batch, local_steps=steps))
    assert ahead.lookaheads == {"dropped": 1}
    assert _payload_bytes(a) == _payload_bytes(b)
    assert _same_tensors(_inner(ahead), _inner(plain))


def test_a_checkpoint_taken_while_a_round_is_ahead_saves_the_committed_inner_state():
    ahead, plain = _engine(), _engine()
    ahead.run_round(_local(ahead, 0, _batch(1), next_batch=_batch(2), next_local_steps=NEXT_STEPS))
    plain.run_round(_local(plain, 0, _batch(1)))
    # The checkpoint's state is read on the compute thread, after the round ahead queued there before it.
    saved = _inner(ahead)
    (session,) = ahead.sessions.values()
    assert session.lookahead is not None and session.lookahead.inner_before  # the round ahead has run
    assert _same_tensors(saved, _inner(plain))  # the state after round 0, not after round 1's steps


def test_wait_is_the_time_idle_between_a_result_and_the_next_round():
    engine = _engine()
    first = engine.run_round(_order(engine, 0, _batch(1)))
    assert first.timings["wait"] == 0 and first.timings["wall"] == first.timings["total"]
    time.sleep(0.2)
    second = engine.run_round(_order(engine, 1, _batch(2)))
    assert 0.2 <= second.timings["wait"] < second.timings["wall"]
    assert second.timings["wall"] >= second.timings["wait"] + second.timings["total"] - 1e-6


def test_next_local_steps_cross_the_wire_and_are_validated():
    engine = _engine()
    order = _local(engine, 0, _batch(1), next_batch=_batch(2), next_local_steps=NEXT_STEPS)
    back = protocol.order_from_proto(protocol.order_to_proto(order))
    assert back.next_local_steps == NEXT_STEPS and np.array_equal(back.next_batch, order.next_batch)
    nxt = preview(back, 5)
    assert nxt.local_steps == NEXT_STEPS and nxt.next_local_steps is None
    with pytest.raises(ProtocolError, match="needs next_local_steps"):
        protocol.order_from_proto(protocol.order_to_proto(dataclasses.replace(order, next_local_steps=None)))
    with pytest.raises(ProtocolError, match="does not split into 2 equal inner steps"):
        protocol.order_from_proto(protocol.order_to_proto(dataclasses.replace(order, next_batch=_batch(2, rows=3))))
    with pytest.raises(ProtocolError, match="comes only with next_batch"):
        protocol.order_from_proto(protocol.order_to_proto(dataclasses.replace(order, next_batch=None)))
