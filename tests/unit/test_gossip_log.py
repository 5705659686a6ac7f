"""A gossip run's update log without a network (``coordinator.gossip_log``): rounds driven by hand through a
coordinator's ``GossipRounds``, logged, written and read back, then replayed onto a fresh one (from the
start, or from a checkpoint and the round before it): the public copies and the bookkeeping are the live
ones, bit for bit, through a worker that misses a round, one that leaves and one that joins from the
consensus. The replay plan refuses a log with a gap or without the checkpoint's anchor."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradwire.compression import CodecConfig, GradientCodec
from gradwire.coordinator.durable import plan_gossip_replay
from gradwire.coordinator.gossip import GossipRounds
from gradwire.coordinator.gossip_log import GossipLog, GossipRecord
from gradwire.coordinator.updatelog import LogRecord, UpdateLog, record_from_bytes, record_to_bytes
from gradwire.protocol import OK, GossipSent, RoundResult

SHAPES = {"w": (64, 64), "b": (64,)}
CODEC = GradientCodec(SHAPES, CodecConfig(topk=512, bins=16, min_sparse_numel=65))

# Who is in each round and who answers it: b misses round 1, c leaves after round 1 and d joins in round 2.
ROUNDS = [("abc", "abc"), ("abc", "ac"), ("abd", "abd"), ("abd", "abd")]


def start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def message(member: str, round_: int) -> RoundResult:
    g = torch.Generator().manual_seed(100 * round_ + ord(member))
    payload = CODEC.compress({k: 0.1 * torch.randn(s, generator=g) for k, s in SHAPES.items()})
    return RoundResult(OK, round_, "", payload, 1.0, 8, 0)


def live(through: int) -> tuple[GossipRounds, list[LogRecord]]:
    """The relayed ring driven for ``ROUNDS[:through]``, each round logged (and written and read back)."""
    rounds = GossipRounds("ring", 0.5, start())
    logged = GossipLog(rounds)
    records = []
    for n, (present, answering) in enumerate(ROUNDS[:through]):
        rounds.leave(list(present))
        rounds.links(list(present))
        rounds.finish({m: message(m, n) if m in answering else None for m in present}, CODEC)
        record = LogRecord(n, 0, 0, None, coordinator_state=b"{}", gossip=logged.record())
        records.append(record_from_bytes(record_to_bytes(record)))
    return rounds, records


def assert_same(a: GossipRounds, b: GossipRounds) -> None:
    assert a.copies.members == b.copies.members
    for m in a.copies.members:
        assert all(torch.equal(v, b.copies.copy_of(m)[k]) for k, v in a.copies.copy_of(m).items()), m
    assert (a.at_start, a.held, a.held_before, a.last_accepted) == (b.at_start, b.held, b.held_before, b.last_accepted)
    assert a.accepted.keys() == b.accepted.keys()
    assert all(a.accepted[m] == b.accepted[m] for m in a.accepted)


def test_replaying_the_logged_rounds_from_the_start_gives_the_live_copies() -> None:
    rounds, records = live(len(ROUNDS))
    assert "c" not in rounds.copies and "d" in rounds.copies and "d" not in rounds.at_start  # the consensus
    fresh = GossipRounds("ring", 0.5, start())
    GossipLog(fresh).replay([r.gossip for r in records], CODEC, anchored=False)
    assert_same(rounds, fresh)
    # The next round's links are the live coordinator's: the same relays, nothing sent whole.
    links, again = rounds.links(list("abd")), fresh.links(list("abd"))
    assert {m: (set(x.relays), set(x.fresh)) for m, x in links.items()} == {
        m: (set(x.relays), set(x.fresh)) for m, x in again.items()
    }
    assert all(not x.fresh for x in again.values())


def test_replaying_from_a_checkpoint_takes_its_copies_on_by_the_rounds_after_it() -> None:
    at_checkpoint, _ = live(2)
    groups, meta = at_checkpoint.checkpoint()  # the copies after round 1: a checkpoint at step 2
    rounds, records = live(len(ROUNDS))
    resumed = GossipRounds("ring", 0.5, start())
    resumed.restore(groups, meta)
    plan, why = plan_gossip_replay(records, 2)
    assert [r.round for r in plan] == [1, 2, 3], why  # round 1 anchors the checkpoint
    GossipLog(resumed).replay([r.gossip for r in plan], CODEC, anchored=True)
    assert_same(rounds, resumed)


def test_a_replayed_round_that_does_not_rebuild_its_members_is_refused() -> None:
    _, records = live(2)
    wrong = dataclasses.replace(records[1].gossip, state={**records[1].gossip.state, "members": ["a", "c", "b"]})
    with pytest.raises(ValueError, match="members"):
        GossipLog(GossipRounds("ring", 0.5, start())).replay([records[0].gossip, wrong], CODEC, anchored=False)


def test_the_replay_plan_needs_the_anchor_and_no_gap() -> None:
    _, records = live(len(ROUNDS))
    assert [r.round for r in plan_gossip_replay(records, 0)[0]] == [0, 1, 2, 3]
    assert [r.round for r in plan_gossip_replay(records, 4)[0]] == [3]  # just after a checkpoint
    plan, why = plan_gossip_replay(records[2:], 2)
    assert plan == () and "round 1" in why
    plan, why = plan_gossip_replay([records[0], records[2]], 1)
    assert plan == () and "gap" in why
    central = dataclasses.replace(records[1], gossip=None)
    plan, why = plan_gossip_replay([records[0], central], 1)
    assert plan == () and "not gossip rounds" in why


def test_a_peer_to_peer_record_keeps_digests_and_exact_sketches() -> None:
    sent = GossipSent(bytes(range(32)), 1234)
    sketch = torch.randn(2048, dtype=torch.float64)
    state = {"format": 1, "members": ["a"]}
    record = LogRecord(5, 0, 0, None, gossip=GossipRecord({}, {"a": (4, sent)}, {"a": sketch}, state))
    back = record_from_bytes(record_to_bytes(record)).gossip
    assert back is not None and back.accepted == {} and back.sent == {"a": (4, sent)} and back.state == state
    assert torch.equal(back.sketches["a"], sketch)  # doubles, bit for bit


def test_the_log_that_holds_the_peer_key_is_its_owners_alone(tmp_path) -> None:
    with UpdateLog(tmp_path / "updates.log"):
        pass
    assert (tmp_path / "updates.log").stat().st_mode & 0o077 == 0
    compacted = UpdateLog(tmp_path / "updates.log")
    compacted.compact(0)
    compacted.close()
    assert (tmp_path / "updates.log").stat().st_mode & 0o077 == 0
