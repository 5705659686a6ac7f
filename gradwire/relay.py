"""Relayed star rounds (``coordinator train --relay peers``): the round's update travels peer to peer.

In a star round every worker replays the same update: the senders' payloads (the replay downlink). Sent by
the coordinator, that costs its uplink N x (N - 1) payloads a round. Relayed, a work order names each
payload instead of carrying it (``PieceRef``: its SHA-256, its size, and the workers that hold it, its
sender first), and the worker pulls it from them (``Worker.PullPiece``). The coordinator names only bytes it
holds and has checked: the digest is of the payload it aggregated, in its one serialization
(``payload_bytes``), so a source that answers any other bytes is refused, and the worker tries the next.

``Held`` is what a worker keeps for its peers: the payloads it sent and those it pulled, of its last few
rounds, by digest. A piece is asked for by digest, with the run's peer key; it never names a file, a round
or a tensor, so a caller gets only bytes it already knows the hash of.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading

from gradwire.compression import CompressedGradient
from gradwire.compression import serde as codec_serde

DIGEST_BYTES = 32  # SHA-256
MAX_SOURCES = 16  # workers a PieceRef names: its sender and a few that pulled it, never the whole swarm
HELD_ROUNDS = 4  # rounds of payloads a worker keeps for its peers (a late puller, a catch-up)
ARRIVAL_WAIT = 10.0  # seconds a pull waits for a payload the worker asked is about to get (it is a seed, or pulls)


def payload_bytes(payload: CompressedGradient) -> bytes:
    """The payload's serialized ``CompressedGradient``: what a piece's digest and size are of, and what a
    worker serves for it (deterministic: the same payload gives the same bytes)."""
    return codec_serde.gradient_to_proto(payload).SerializeToString(deterministic=True)


def digest_of(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclasses.dataclass(frozen=True)
class PieceRef:
    """A payload of a replay that a worker pulls from its peers: at ``position`` among the update's senders,
    ``size`` bytes whose SHA-256 is ``digest``, held by ``sources`` (host:port, in the order to ask them)."""

    position: int
    digest: bytes
    size: int
    sources: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.position < 0:
            raise ValueError(f"a relayed payload's position is >= 0, got {self.position}")
        if len(self.digest) != DIGEST_BYTES:
            raise ValueError(f"a relayed payload's digest is {DIGEST_BYTES} bytes, got {len(self.digest)}")
        if self.size <= 0:
            raise ValueError(f"a relayed payload has a size > 0, got {self.size}")
        if not 1 <= len(self.sources) <= MAX_SOURCES:
            raise ValueError(f"a relayed payload names 1-{MAX_SOURCES} sources, got {len(self.sources)}")
        for address in self.sources:
            if not address or len(address) > 256 or not address.isprintable():
                raise ValueError("a relayed payload's source is 1-256 printable characters")


class Held:
    """The pieces a worker holds for its peers, by digest: those of its last ``HELD_ROUNDS`` rounds. A payload
    it sent or was sent (``keep_payload``) is serialized and hashed only when a peer first asks for some
    piece, off the round's path: with the compressed downlink nobody ever does. Thread-safe: the round's
    thread adds, the server's threads read."""

    def __init__(self, rounds: int = HELD_ROUNDS) -> None:
        self.rounds = rounds
        self._pieces: dict[bytes, tuple[int, bytes]] = {}  # digest: (round, bytes)
        self._unhashed: list[tuple[int, CompressedGradient]] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)

    def keep(self, round_: int, data: bytes, digest: bytes | None = None) -> bytes:
        """Hold ``data`` (a serialized payload of ``round_``, whose digest is ``digest`` if known); returns the
        digest."""
        digest = digest or digest_of(data)
        with self._lock:
            self._pieces[digest] = (round_, data)
            self._arrived_at(round_)
        return digest

    def keep_payload(self, round_: int, payload: CompressedGradient) -> None:
        """Hold ``payload`` of ``round_``, serialized and hashed when a peer first asks."""
        with self._lock:
            self._unhashed.append((round_, payload))
            self._arrived_at(round_)

    def get(self, digest: bytes, wait: float = 0.0) -> bytes | None:
        """The piece with ``digest``; if not held yet, waiting up to ``wait`` seconds for it to arrive (a
        peer that asks for an update's payload before this worker's own order brought or pulled it)."""

        def held() -> bool:
            self._hash()
            return digest in self._pieces

        with self._arrived:
            self._arrived.wait_for(held, timeout=wait)
            piece = self._pieces.get(digest)
        return piece[1] if piece is not None else None

    def _hash(self) -> None:
        """Serialize and hash the payloads held unhashed (under the lock)."""
        for round_, payload in self._unhashed:
            data = payload_bytes(payload)
            self._pieces[digest_of(data)] = (round_, data)
        self._unhashed.clear()

    def _arrived_at(self, round_: int) -> None:
        """Under the lock: drop what is older than the last ``rounds`` rounds, and wake the waiting pulls."""
        newest = max([round_, *(r for r, _ in self._pieces.values()), *(r for r, _ in self._unhashed)])
        self._pieces = {d: p for d, p in self._pieces.items() if p[0] > newest - self.rounds}
        self._unhashed = [(r, p) for r, p in self._unhashed if r > newest - self.rounds]
        self._arrived.notify_all()

    def __len__(self) -> int:
        with self._lock:
            return len(self._pieces) + len(self._unhashed)
