"""A gossip round in the update log: what the coordinator keeps of it, and how a resume rebuilds from it.

A gossip round moves no replica, so its log record (proto ``gradwire.v1.GossipRound``) holds what the
coordinator's own gossip state (``gossip.GossipRounds``) is made of instead:

* the messages it accepted: relayed, their payloads (every holder adds each to its sender's public copy, and
  the next round's orders relay them); peer-to-peer, the round each was sent in and its digest and size (what
  the neighbours pull by), with the payload only where its sender uploaded it;
* peer-to-peer, the count sketches that changed since the record before;
* the bookkeeping after the round, as JSON: the members in join order, those whose copy is still the start,
  the copies each holds in step, who took links before, each one's latest accepted message, the failed pulls,
  and the run's peer key.

A resume (``replay``) starts from the checkpoint's public copies, exact as of its step, and takes the rounds
after it in order. Relayed, it re-runs what each round did to the copies (members that left, members admitted
from the start or the consensus, the accepted messages added), so the copies are the live run's bit for bit.
Peer-to-peer the coordinator never saw the messages: each copy a logged round moved (or made) is marked stale,
to be pulled from its owner when an order or the consensus needs it whole, which gives the same bits. The
bookkeeping is the last round's. A checkpoint keeps the record of the round before it (``ANCHOR``): a resume
just after it still knows what each worker holds, and goes on without a push.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import torch

from gradwire.compression import CompressedGradient, GradientCodec, serde
from gradwire.coordinator.gossip import GossipRounds, PublicCopies, decode_message
from gradwire.protocol import GossipSent
from gradwire.v1 import log_pb2

STATE_FORMAT = 1  # the bookkeeping's JSON layout
ANCHOR = 1  # the rounds before a checkpoint's step its compaction keeps: their bookkeeping continues it


@dataclasses.dataclass(frozen=True)
class GossipRecord:
    """One gossip round as the log keeps it (see the module)."""

    accepted: dict[str, CompressedGradient]  # relayed, and peer-to-peer uploads: the payloads to relay
    sent: dict[str, tuple[int, GossipSent]]  # peer-to-peer: the round each was sent in, its digest and size
    sketches: dict[str, torch.Tensor]  # peer-to-peer: the sketches that changed since the record before
    state: dict  # the bookkeeping (``bookkeeping``)


def record_to_proto(r: GossipRecord) -> log_pb2.GossipRound:
    msg = log_pb2.GossipRound(state=json.dumps(r.state, separators=(",", ":"), sort_keys=True).encode())
    for m in sorted(set(r.accepted) | set(r.sent)):
        one = msg.accepted.add(member=m)
        if m in r.accepted:
            one.message.CopyFrom(serde.gradient_to_proto(r.accepted[m]))
        if m in r.sent:
            round_, sent = r.sent[m]
            one.round, one.digest, one.nbytes = round_, sent.digest, sent.nbytes
    for m, values in sorted(r.sketches.items()):
        msg.sketches.add(member=m, values=values.tolist())
    return msg


def record_from_proto(msg: log_pb2.GossipRound) -> GossipRecord:
    """The inverse of ``record_to_proto``; ``ValueError`` for a record that does not read."""
    try:
        state = json.loads(msg.state)
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"its bookkeeping is of format {state.get('format')}, not {STATE_FORMAT}")
        accepted = {a.member: serde.gradient_from_proto(a.message) for a in msg.accepted if a.HasField("message")}
        sent = {a.member: (a.round, GossipSent(a.digest, a.nbytes)) for a in msg.accepted if a.digest}
    except (ValueError, TypeError, AttributeError) as e:  # PayloadError and ProtocolError are ValueErrors
        raise ValueError(f"update log: a gossip round does not read: {e}") from None
    sketches = {s.member: torch.tensor(list(s.values), dtype=torch.float64) for s in msg.sketches}
    return GossipRecord(accepted, sent, sketches, state)


def bookkeeping(rounds: GossipRounds) -> dict:
    """What ``rounds`` knows besides its copies, messages and sketches, as JSON."""
    return {
        "format": STATE_FORMAT,
        "members": list(rounds.copies.members),
        "at_start": sorted(rounds.at_start),
        "held": {m: sorted(h) for m, h in rounds.held.items()},
        "held_before": sorted(rounds.held_before),
        "last_accepted": dict(rounds.last_accepted),
        "failed_pulls": sorted([r, s, n] for (r, s), n in rounds.failed_pulls.items()),
        "peer_key": rounds.peer_key.hex(),
    }


class GossipLog:
    """A gossip run's side of the update log: the record of each round (``record``), and the resume from the
    checkpoint's copies and the records after it (``replay``)."""

    def __init__(self, rounds: GossipRounds) -> None:
        self.rounds = rounds
        self._logged_sketches: dict[str, torch.Tensor] = {}  # as the last record left them

    def record(self) -> GossipRecord:
        """The round just finished, as the log keeps it."""
        g = self.rounds
        sketches = {m: s for m, s in g.sketches.items() if self._logged_sketches.get(m) is not s}
        self._logged_sketches = dict(g.sketches)
        return GossipRecord(dict(g.accepted), dict(g.sent), sketches, bookkeeping(g))

    def replay(self, records: Sequence[GossipRecord], codec: GradientCodec, anchored: bool) -> None:
        """Bring the gossip state from the checkpoint's (or a fresh run's) to where it stood after the last of
        ``records``; ``anchored``: the first is the round before the checkpoint, which its copies hold already.
        ``ValueError`` where a relayed round does not rebuild the bookkeeping it logged."""
        g = self.rounds
        moved = self._replay_copies(records[int(anchored) :], codec)
        last = records[-1].state
        members = list(last["members"])
        if g.peer_to_peer:  # copies a logged round moved or made are pulled from their owners when needed
            copies = PublicCopies()
            for m in members:
                copies.add(m, g.copies.copy_of(m) if m in g.copies and m not in moved else g.start)
            g.copies = copies
            g.stale = {m for m in members if m in moved and m not in last["at_start"]}
        elif list(g.copies.members) != members or sorted(g.at_start) != last["at_start"]:
            raise ValueError("update log: the gossip rounds replayed do not give the members the last one logged")
        g.at_start = set(last["at_start"])
        g.held = {m: frozenset(h) for m, h in last["held"].items()}
        g.held_before = set(last["held_before"])
        g.last_accepted = {m: int(r) for m, r in last["last_accepted"].items()}
        g.failed_pulls = {(r, s): int(n) for r, s, n in last["failed_pulls"]}
        g.peer_key = bytes.fromhex(last["peer_key"])
        g.accepted, g.sent, g.graph = dict(records[-1].accepted), dict(records[-1].sent), None
        sketches: dict[str, torch.Tensor] = {}
        for r in records:
            sketches.update(r.sketches)
        if g.peer_to_peer:
            g.sketches = {m: sketches[m] if m in sketches else g.sketch_of(g.copies.copy_of(m)) for m in members}
        self._logged_sketches = dict(g.sketches)

    def _replay_copies(self, records: Sequence[GossipRecord], codec: GradientCodec) -> set[str]:
        """Each round's changes to the public copies, as the live round made them; returns the members whose
        copy a round moved, made, or took away (peer-to-peer: all the coordinator can say of them)."""
        g, moved = self.rounds, set()
        for r in records:
            members = r.state["members"]
            for m in [m for m in g.copies.members if m not in members]:
                g.copies.remove(m)
                g.at_start.discard(m)
                moved.add(m)
            if g.peer_to_peer:
                moved |= {m for m in members if m not in g.copies} | set(r.sent)
                continue
            g.admit(members)
            for m, payload in r.accepted.items():
                q, why = decode_message(payload, codec, g.start)
                if q is None:
                    raise ValueError(f"update log: an accepted gossip message of {m} does not decode: {why}")
                g.copies.receive(m, q)
                g.at_start.discard(m)
        return moved
