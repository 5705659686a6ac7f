"""--relay auto's judgement of who reaches whom (``coordinator.reach``): by the address, then by what pulls
showed, each pair of workers apart; a source nobody reaches is down, a receiver that reaches nobody is cut
off, and neither stops the others pulling from each other."""

from __future__ import annotations

import pytest

from gradwire.coordinator.reach import MAX_QUIET_ROUNDS, QUIET_ROUNDS, Pair, Reach, dialable, loopback
from gradwire.coordinator.relay import Held, Relay
from gradwire.replica import StateUpdate
from gradwire.tunnel import TUNNEL_PREFIX

from .test_relay import _payloads

A, B, C, D = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:5", True), ("localhost:5", True), ("[::1]:5", True), ("10.0.0.1:5", False), ("box:5", False)],
)
def test_a_loopback_address_names_the_dialler_s_own_machine(address, expected):
    assert loopback(address) is expected


def test_a_receiver_cannot_dial_a_tunnelled_worker_or_another_machine_s_loopback_name():
    assert "tunnelled" in dialable(f"{TUNNEL_PREFIX}w1", from_elsewhere=False)
    assert "loopback" in dialable("127.0.0.1:7", from_elsewhere=True)
    assert dialable("127.0.0.1:7", from_elsewhere=False) == "" and dialable(B, from_elsewhere=True) == ""


def test_a_pair_that_fails_again_keeps_apart_twice_as_long_and_a_success_resets_it():
    reach = Reach()
    reach.failed(A, [B], 5)
    assert reach.pairs[(A, B)] == Pair(1, 5, None)
    assert [reach.pairs[(A, B)].quiet(r) for r in (5, 5 + QUIET_ROUNDS - 1, 5 + QUIET_ROUNDS)] == [True, True, False]
    reach.failed(A, [B], 20)
    assert reach.pairs[(A, B)].quiet(20 + 2 * QUIET_ROUNDS - 1) and not reach.pairs[(A, B)].quiet(20 + 2 * QUIET_ROUNDS)
    assert Pair(30, 0).quiet(MAX_QUIET_ROUNDS - 1) and not Pair(30, 0).quiet(MAX_QUIET_ROUNDS)  # capped
    reach.pulled(A, [B], 21)
    assert reach.pairs[(A, B)] == Pair(0, None, 21) and not reach.pairs[(A, B)].quiet(21)


def test_a_receiver_that_reaches_nobody_is_cut_off_and_its_sources_stay_up():
    reach = Reach()
    reach.failed(A, [B, C, D], 3)  # A cannot dial out
    reach.pulled(B, [C, D], 3)
    reach.pulled(C, [B, D], 3)
    standing = reach.standing(4)
    assert set(standing.cut_off) == {A} and "pulled from none" in standing.cut_off[A]
    assert not standing.down
    assert reach.usable(B, C, 4, standing) == (True, "")
    ok, why = reach.usable(A, B, 4, standing)
    assert not ok and "failed to pull from" in why
    reach.pulled(A, [D], 6)  # a pull worked again: no longer cut off
    assert A not in reach.standing(7).cut_off


def test_a_source_nobody_reaches_is_down_for_everyone_and_one_failure_is_not_enough():
    reach = Reach()
    reach.failed(B, [A], 3)
    assert not reach.standing(4).down and reach.usable(C, A, 4, reach.standing(4))[0]  # one witness
    reach.failed(C, [A], 3)
    standing = reach.standing(4)
    assert set(standing.down) == {A} and not standing.cut_off
    ok, why = reach.usable(D, A, 4, standing)
    assert not ok and "is down" in why
    reach.pulled(D, [A], 5)  # it served someone since: up again
    assert not reach.standing(6).down


def _update(n: int) -> StateUpdate:
    return StateUpdate(0.1, tuple(_payloads(n)), (1.0,) * n)


def test_under_auto_a_loopback_sender_is_named_only_for_receivers_on_its_machine():
    relay = Relay(enabled=True, learn=True)
    senders = ["127.0.0.1:1", B, "localhost:3"]
    relay.hold([Held(bytes([i]) * 32, 100, s) for i, s in enumerate(senders)], version=0)
    relay.plan_round(senders, 1)
    named = {r: {ref.position for ref in relay.update_for(_update(3), 1, r).relayed} for r in senders}
    # B's own stays in its order (a sender holds its own), and the loopback names are no use to it
    assert named == {"127.0.0.1:1": {1, 2}, B: set(), "localhost:3": {0, 1}}


def test_under_auto_a_cut_off_receiver_gets_it_all_in_its_order_and_the_others_still_pull():
    relay = Relay(enabled=True, learn=True)
    relay.hold([Held(bytes([i]) * 32, 100, s) for i, s in enumerate([A, B, C])], version=0)
    update = _update(3)
    relay.plan_round([A, B, C], 2)
    relay.report(A, [relay.update_for(update, 2, A)], [B, C], 2, took=False)  # A reached neither
    relay.report(B, [relay.update_for(update, 2, B)], [], 2, took=True)
    relay.plan_round([A, B, C], 3)
    assert relay.update_for(update, 3, A) is update  # carried whole
    assert {ref.position for ref in relay.update_for(update, 3, B).relayed} == {0, 2}  # A's own too
    peers = Relay(enabled=True)  # --relay peers: the failed sources are named for nobody a while
    peers.hold([Held(bytes([i]) * 32, 100, s) for i, s in enumerate([A, B, C])], version=0)
    peers.report(A, [peers.update_for(update, 2, A)], [B, C], 2, took=False)
    assert {ref.position for ref in peers.update_for(update, 3, B).relayed} == {0}


def test_under_auto_the_aggregate_s_tree_leaves_out_a_loopback_name_where_others_are_elsewhere():
    relay = Relay(enabled=True, fanout=1, learn=True)
    relay.hold_aggregate(Held(b"a" * 32, 100, ""), version=0)
    local = "127.0.0.1:1"
    relay.plan_round([local, B, C], 1)
    aggregate = _update(1)  # one payload: the compressed aggregate
    assert relay.update_for(aggregate, 1, local) is aggregate  # sent by the coordinator, serves nobody
    assert relay.update_for(aggregate, 1, B) is aggregate  # the seed
    assert [ref.sources for ref in relay.update_for(aggregate, 1, C).relayed] == [(B,)]
