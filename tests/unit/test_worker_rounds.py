"""A worker's round as stages (``worker.rounds``), each on its own: which updates go before the compute, the
check's answers, the look-ahead taken or dropped, where the time went, and ``run`` as the stages' sequence."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from gradwire.compression import CodecConfig
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import BEHIND, NEEDS_STATE, OK, ModelState, WorkOrder
from gradwire.replica import Replica, StateUpdate
from gradwire.worker import rounds
from gradwire.worker.compute import Contribution
from gradwire.worker.lookahead import Lookahead
from gradwire.worker.session import Session

SPEC = model_spec("gpt-tiny")
CODEC = CodecConfig(chunk=16, topk=8)


def _session() -> Session:
    replica = Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"))
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    state = ModelState("run", 4, json.dumps(SPEC), params, replica.rule.to_json())
    return Session.from_state(state, torch.device("cpu"))


def _batch(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8192, (4, 17)).astype(np.uint16)


def _order(session: Session, **changes: object) -> WorkOrder:
    r = session.replica
    return dataclasses.replace(WorkOrder("run", 0, r.version, _batch(0), CODEC, r.fingerprint()), **changes)


@pytest.fixture
def stages() -> Iterator[tuple[rounds.Rounds, list[WorkOrder]]]:
    """Stages off a node, with what they queue for the compute thread recorded instead of run."""
    queued: list[WorkOrder] = []
    with ThreadPoolExecutor(1) as ahead, ThreadPoolExecutor(1) as encoder:
        yield (
            rounds.Rounds(torch.device("cpu"), None, ahead, encoder, lambda s, o: queued.append(o), lambda: 0),
            queued,
        )


def _update(session: Session, seed: int) -> StateUpdate:
    grads = {
        n: torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
        for n, p in session.replica.params.items()
    }
    return StateUpdate(0.1, (session.replica.codec(CODEC).compress(grads),), (1.0,))


def test_a_delayed_round_applies_its_own_update_after_the_compute_and_the_catch_up_before() -> None:
    session = _session()
    catch_up, own = _update(session, 1), _update(session, 2)
    plain = _order(session, update=own, catch_up=(catch_up,))
    assert rounds.split_updates(plain) == ((catch_up, own), ())
    assert rounds.split_updates(dataclasses.replace(plain, compute_before_update=True)) == ((catch_up,), (own,))
    assert rounds.split_updates(dataclasses.replace(plain, update=None)) == ((catch_up,), ())


def test_advance_replays_each_update_in_turn() -> None:
    session, twin = _session(), _session()
    updates = (_update(session, 1), _update(session, 2))
    rounds.advance(session, updates, None)
    for u in updates:
        twin.replica.apply(u)
    assert session.replica.version == twin.replica.version == 6
    assert session.replica.fingerprint() == twin.replica.fingerprint()


def test_the_check_answers_behind_for_a_sound_replica_at_another_version_and_needs_state_for_a_bad_one(
    stages: tuple[rounds.Rounds, list[WorkOrder]],
) -> None:
    runner, _ = stages
    session = _session()
    assert runner.check(_order(session), session) is None
    behind = runner.check(_order(session, base_version=7), session)
    assert behind is not None and behind.status == BEHIND and behind.version == 4 and not session.stale
    assert runner.check(_order(session), None).status == NEEDS_STATE
    fingerprint = session.replica.fingerprint()
    wrong = _order(session, fingerprint=dataclasses.replace(fingerprint, sums=tuple(s + 1 for s in fingerprint.sums)))
    refused = runner.check(wrong, session)
    assert refused is not None and refused.status == NEEDS_STATE and session.stale  # until the next push
    assert runner.check(_order(session), session).status == NEEDS_STATE


def test_work_computed_ahead_serves_only_the_order_it_was_computed_for(
    stages: tuple[rounds.Rounds, list[WorkOrder]],
) -> None:
    runner, _ = stages
    session = _session()
    order = _order(session, compute_before_update=True)
    contribution = Contribution({}, 2.0, 64)
    session.lookahead = Lookahead(order, contribution, 0.5)
    taken = runner.take_ahead(session, order)
    assert taken is not None and taken.contribution is contribution and session.lookahead is None
    session.lookahead = Lookahead(order, contribution, 0.5)
    assert runner.take_ahead(session, dataclasses.replace(order, batch=_batch(9))) is None
    assert session.lookahead is None and runner.lookaheads == {"used": 1, "dropped": 1}
    assert runner.compute(session, order, taken, lambda: False, None) == (contribution, 0.5)


def test_the_wait_is_the_time_since_the_last_result_that_no_work_ahead_filled() -> None:
    session = _session()
    first = rounds.timings(session, rounds.Marks(10.0, 10.1, 10.5, 10.6, 10.7), 0.4)
    assert first["wait"] == 0.0 and first["wall"] == pytest.approx(0.7)
    session.ahead_seconds = 0.2  # a look-ahead ran for 0.2 s of the 0.5 s between the two rounds
    second = rounds.timings(session, rounds.Marks(11.2, 11.25, 11.3, 11.3, 11.4), 0.0)
    assert second["wait"] == pytest.approx(0.3) and second["wall"] == pytest.approx(0.7)
    assert second["update"] == pytest.approx(0.05) and second["compress"] == pytest.approx(0.1)
    assert second["total"] == pytest.approx(0.2)
    assert session.done_at == 11.4 and session.ahead_seconds == 0.0


def test_run_is_its_stages_in_sequence_and_readies_the_next_round(
    stages: tuple[rounds.Rounds, list[WorkOrder]],
) -> None:
    runner, queued = stages
    ran, staged = _session(), _session()
    own = _update(ran, 3)
    order = _order(ran, update=own, compute_before_update=True, next_batch=_batch(5))
    result = runner.run(ran, order, lambda: False, None, 0.0)
    assert result.status == OK and result.version == 5 and ran.last_sent == (0, result.gradient)

    # The same stages called one by one on a twin session give the same bits.
    now, later = rounds.split_updates(order)
    rounds.advance(staged, now, None)
    contribution, _ = runner.compute(staged, order, None, lambda: False, None)
    rounds.advance(staged, later, None)
    staged.feedback.beta = order.feedback_beta
    payload = runner.encode(staged, order, contribution, None, None)
    assert payload == result.gradient and result.loss == contribution.loss
    assert staged.replica.fingerprint() == ran.replica.fingerprint()

    # What the next round needs is under way: the fingerprint, this payload decoded, the next batch's compute.
    assert ran.fingerprint_ahead is not None and ran.fingerprint_ahead.result() == ran.replica.fingerprint()
    known = rounds.sent_decoded(ran)
    assert known is not None and known[0] is result.gradient
    (expected,) = queued
    assert expected.round == 1 and expected.base_version == 5 and np.array_equal(expected.batch, _batch(5))


def test_a_round_asked_for_again_at_the_version_it_left_goes_again(
    stages: tuple[rounds.Rounds, list[WorkOrder]],
) -> None:
    """A delayed round (computed before its own update, applied after) asked for again at the version it left
    the replica at, as a coordinator resumed from its log asks: the same result, not computed again. Another
    round, batch, version or kind of round is computed anew."""
    runner, _ = stages
    session = _session()
    order = _order(session, update=_update(session, 3), compute_before_update=True)
    result = runner.run(session, order, lambda: False, None, 0.0)
    assert result.status == OK and result.version == 5 and session.last_done is not None
    again = dataclasses.replace(order, base_version=5, update=None)  # round 0 at the version it holds now
    assert runner.run(session, again, lambda: False, None, 0.0) is result and runner.resent == 1
    done = session.last_done
    assert done.serves(again, 5) == (True, "the same round again")
    same, why = done.serves(again, 4)
    assert not same and "version 5" in why
    for other, reason in (
        (dataclasses.replace(again, round=1), "round 0 was computed"),
        (dataclasses.replace(again, batch=_batch(9)), "batch differs"),
        (dataclasses.replace(again, compute_before_update=False), "delays its update"),
    ):
        same, why = done.serves(other, 5)
        assert not same and reason in why, why
