"""Relayed star rounds, the coordinator's side (``coordinator train --relay peers``; ``gradwire.relay``).

A replayed update is its senders' payloads, and each sender holds its own. Relayed, the coordinator does not
send them: each work order names the payloads it replays (``PieceRef``: the SHA-256 and size of the bytes
the coordinator aggregated, and their sender's address), and the worker pulls them from their senders.

``Relay`` keeps what the pending update's payloads are (``hold``, after each outer step) and which sources
failed a pull lately; ``sources`` is the pure decision of whom an order names for a payload and why not. A
payload is sent in the order instead when its sender cannot be named: a ``--tunnel`` worker (nobody dials
it), a source that failed a pull in the last ``QUIET_ROUNDS`` rounds, or for the worker that reported the
failure, for the rest of the round (``RoundDispatcher`` sends it the order again, the payloads in it). The
receiver's own payload is never named: it holds it.

``--relay auto`` judges sources per receiver instead (``coordinator.reach``): by the address (a loopback name
is no use to a worker elsewhere) and by what the pulls showed, each pair of workers apart, so that one worker
behind a NAT turns the relay off for itself alone, and a source nobody reaches for nobody but itself.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Iterable, Mapping, Sequence

from gradwire.compression import CompressedGradient
from gradwire.coordinator.reach import Reach, Standing, dialable, loopback
from gradwire.relay import HELD_ROUNDS, PieceRef, digest_of, payload_bytes
from gradwire.replica import StateUpdate

QUIET_ROUNDS = 10  # rounds a source that failed a pull is not named for any payload
PEER_KEY_BYTES = 32


@dataclasses.dataclass(frozen=True)
class Held:
    """A payload of the pending update: its digest and size (``relay.payload_bytes``), and who sent it."""

    digest: bytes
    size: int
    sender: str  # the sender's address, as the coordinator reaches it


def held_piece(payload: CompressedGradient, sender: str) -> Held:
    """What a worker needs to pull ``payload`` from ``sender`` and check it (a serialization and a hash: on
    the dispatch thread, as each result comes in)."""
    data = payload_bytes(payload)
    return Held(digest_of(data), len(data), sender)


def unservable(address: str, failed: Mapping[str, int], round_: int) -> str:
    """Why the worker at ``address`` cannot be named as a source this round ("" if it can). Pure."""
    if why := dialable(address, from_elsewhere=False):  # a tunnelled worker
        return why
    last = failed.get(address)
    if last is not None and round_ - last < QUIET_ROUNDS:
        return f"a pull from {address} failed in round {last}"
    return ""


def sources(held: Held, failed: Mapping[str, int], round_: int) -> tuple[tuple[str, ...], str]:
    """Whom an order names for ``held`` (none: send it in the order), and why not. Pure."""
    why = unservable(held.sender, failed, round_)
    return ((), why) if why else ((held.sender,), "")


def fanout_tree(receivers: Sequence[str], fanout: int, serves: Mapping[str, bool]) -> dict[str, tuple[str, ...]]:
    """Who pulls a payload only the coordinator holds (a compressed aggregate) from whom: each receiver's
    sources, in round order; ``()`` for one the coordinator sends it to (a seed, or one that cannot serve:
    ``serves`` False). Among those that serve, the first ``fanout`` are seeds, and the k-th after them pulls
    from the ((k - fanout) // fanout)-th, then from a seed: each serves at most ``fanout`` pulls, and the
    coordinator sends ``fanout`` payloads however many workers there are. Pure."""
    servers = [r for r in receivers if serves.get(r, False)]
    seeds = servers[:fanout]
    out = {r: () for r in receivers if not serves.get(r, False)}
    out.update({s: () for s in seeds})
    for k, r in enumerate(servers[fanout:]):
        parent, seed = servers[k // fanout], seeds[k % len(seeds)]
        out[r] = (parent,) if parent == seed else (parent, seed)
    return out


class Relay:
    """The relay of one run: its peer key, the pending update's payloads, the sources that failed lately."""

    def __init__(self, enabled: bool, fanout: int = 2, learn: bool = False) -> None:
        """``learn``: ``--relay auto``, sources judged per receiver by what pulls showed (``coordinator.reach``)."""
        self.enabled = enabled
        self.fanout = fanout
        self.reach = Reach() if enabled and learn else None
        self._standing = Standing()  # the round's, under auto
        self.peer_key = secrets.token_bytes(PEER_KEY_BYTES) if enabled else b""
        self._held: tuple[Held | None, ...] = ()  # by sender position; None: sent in the order
        self._aggregate: Held | None = None  # a compressed aggregate: the coordinator's, spread from seeds
        # The senders' payloads of the last updates, by the version each starts from: a catch-up names them too
        # (their senders keep them ``relay.HELD_ROUNDS`` rounds; one gone since costs a resend).
        self._earlier: dict[int, tuple[Held | None, ...]] = {}
        self._tree: dict[str, tuple[str, ...]] = {}  # the round's sources of the aggregate, by receiver
        self._failed: dict[str, int] = {}  # a source's address: the round its last failed pull was reported in
        self._lock = threading.Lock()
        # Whether the round's payloads are worth their digests as they come in (``held_piece``): the round's
        # update will likely replay them (the trainer's guess from its downlink decision).
        self.digest_payloads = enabled

    def hold(self, payloads: Sequence[Held | None], version: int = -1) -> None:
        """The pending update's payloads, by sender position (None: not relayed), the update moving the replica
        from ``version``; ``()`` when the pending update is no replay of the senders' payloads (a compressed
        aggregate: ``hold_aggregate``; a delta)."""
        with self._lock:
            self._held, self._aggregate = tuple(payloads), None
            self._remember(version, self._held)

    def hold_aggregate(self, aggregate: Held, version: int = -1) -> None:
        """The pending update is one compressed aggregate, or an adamw delta, which only the coordinator holds
        (a catch-up sends it: no tree spreads it then)."""
        with self._lock:
            self._held, self._aggregate = (), aggregate
            self._remember(version, ())

    def _remember(self, version: int, held: tuple[Held | None, ...]) -> None:
        self._earlier[version] = held
        for old in [v for v in self._earlier if v <= version - HELD_ROUNDS]:
            del self._earlier[old]

    def plan_round(self, receivers: Sequence[str], round_: int) -> None:
        """Who pulls the aggregate from whom this round (``fanout_tree``), the receivers in dispatch order."""
        with self._lock:
            if self.reach is None:
                serves = {r: not unservable(r, self._failed, round_) for r in receivers}
            else:  # a source every receiver can dial, not down, not cut off itself
                self._standing = standing = self.reach.standing(round_)
                elsewhere = any(not loopback(r) for r in receivers)
                serves = {
                    r: r not in standing.down and r not in standing.cut_off and not dialable(r, elsewhere)
                    for r in receivers
                }
            self._tree = fanout_tree(receivers, self.fanout, serves) if self._aggregate is not None else {}

    def seeds(self, receiver: str) -> bool:
        """Whether ``receiver`` keeps the payloads its order carries for its peers (it is in the round's tree)."""
        with self._lock:
            return receiver in self._tree and self._aggregate is not None

    def update_for(
        self, update: StateUpdate | None, round_: int, receiver: str = "", version: int | None = None
    ) -> StateUpdate | None:
        """``update`` as ``receiver``'s order names its payloads instead of carrying them, where peers hold
        them: the senders' own payloads, or the aggregate up the round's tree. ``version``: a catch-up's
        update from that version, whose senders' payloads are named if it was a replay and they are still held
        (the receiver's own left in the order)."""
        if not self.enabled or update is None:
            return update
        with self._lock:
            held, failed, aggregate = self._held, dict(self._failed), self._aggregate
            tree_sources = self._tree.get(receiver, ())
            if version is not None:
                held, aggregate = self._earlier.get(version, ()), None
            if self.reach is not None:
                if receiver in self._standing.cut_off:
                    return update
                tree_sources = tuple(s for s in tree_sources if self._usable(receiver, s, round_))
        if aggregate is not None:  # one payload only the coordinator made: an aggregate or an adamw delta
            if not tree_sources or update.own is not None:
                return update
            ref = PieceRef(0, aggregate.digest, aggregate.size, tree_sources)
            if update.delta is not None:
                return update.relaying_delta(ref)
            return update.relaying([ref]) if update.senders == 1 else update
        if update.delta is not None:
            return update
        if len(held) != update.senders:
            return update
        own = update.own[0] if update.own is not None else None
        refs = []
        for position, piece in enumerate(held):
            if piece is None or position == own or piece.sender == receiver:  # a catch-up's own stay in its order
                continue
            if self.reach is not None:
                named = (piece.sender,) if self._usable(receiver, piece.sender, round_) else ()
            else:
                named, _ = sources(piece, failed, round_)
            if named:
                refs.append(PieceRef(position, piece.digest, piece.size, named))
        return update.relaying(refs) if refs else update

    def _usable(self, receiver: str, source: str, round_: int) -> bool:
        assert self.reach is not None
        return self.reach.usable(receiver, source, round_, self._standing)[0]

    def unreachable(self, addresses: Iterable[str], round_: int) -> None:
        """A worker could not pull from these sources this round: name them for nothing for a while."""
        with self._lock:
            for address in addresses:
                self._failed[address] = round_

    def report(
        self, receiver: str, updates: Sequence[StateUpdate | None], unreachable: Sequence[str], round_: int, took: bool
    ) -> None:
        """What ``receiver``'s pulls of the pieces ``updates`` named showed: the ``unreachable`` sources failed;
        where it ``took`` them all, each piece came from the first of its sources that did not fail. Under
        ``auto`` this is what ``coordinator.reach`` judges by; else the failed sources are named for nobody a
        while (``unreachable``)."""
        if self.reach is None:
            self.unreachable(unreachable, round_)
            return
        failed = set(unreachable)
        served = set()
        if took:
            for update in updates:
                for ref in update.relayed if update is not None else ():
                    served.update([s for s in ref.sources if s not in failed][:1])
        with self._lock:
            self.reach.failed(receiver, sorted(failed), round_)
            self.reach.pulled(receiver, sorted(served), round_)
