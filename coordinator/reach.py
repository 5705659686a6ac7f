"""Who reaches whom, as the addresses and the pulls show it (``coordinator train --relay auto``).

``--relay peers`` takes the workers to reach each other, and a pull that fails names its source for nobody a
while. ``auto`` finds out instead, and tells a source that is down from a receiver that is cut off:

  address   a source a receiver cannot dial by the address the coordinator knows it by: a ``--tunnel``
            worker (nobody dials it), or one known by a loopback address, for a receiver known by another
            address (elsewhere, that name means the receiver's own machine)
  pair      a receiver whose pull from a source failed does not pull from it for ``QUIET_ROUNDS`` rounds,
            twice as long after each further failure of the pair since its last success (at most
            ``MAX_QUIET_ROUNDS``): a NAT between two workers costs a few retries in a run, not one every
            ``QUIET_ROUNDS``
  source    a source that failed two receivers or more while none pulled from it since is down: nobody
            pulls from it while their pairs are quiet
  receiver  a receiver that failed from two sources or more while it pulled from none since is cut off: its
            orders carry the payloads while its pairs are quiet; the others still pull from each other

A success resets its pair. ``Reach`` is the memory (what was reported, by round); ``usable`` and
``cut_off`` are its pure decisions, with their reasons.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable

from gradwire.tunnel import TUNNEL_PREFIX

QUIET_ROUNDS = 10  # rounds a pair whose pull failed once is not used; doubled with each further failure
MAX_QUIET_ROUNDS = 1000
WITNESSES = 2  # failures with distinct peers that make a source down, or a receiver cut off


@dataclasses.dataclass(frozen=True)
class Pair:
    """What the pulls of one receiver from one source showed: failures since the last success, the round of
    the last failure, and of the last success."""

    failures: int = 0
    failed: int | None = None
    pulled: int | None = None

    def quiet(self, round_: int) -> bool:
        """Whether the pair is not used in ``round_`` (a failure too recent for its count)."""
        if not self.failures or self.failed is None:
            return False
        return round_ - self.failed < min(QUIET_ROUNDS << (self.failures - 1), MAX_QUIET_ROUNDS)


def loopback(address: str) -> bool:
    """Whether ``address`` (host:port) names the machine it is dialled from."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def dialable(source: str, from_elsewhere: bool) -> str:
    """Why a receiver cannot dial ``source`` by the address the coordinator knows it by ("" if it can);
    ``from_elsewhere``: the receiver is known by an address that is not a loopback one. Pure."""
    if source.startswith(TUNNEL_PREFIX):
        return f"{source} is a tunnelled worker: nobody dials it"
    if loopback(source) and from_elsewhere:
        return f"{source} is a loopback address, of no use to a worker on another machine"
    return ""


@dataclasses.dataclass(frozen=True)
class Standing:
    """Who is down and who is cut off in one round, each with why."""

    down: dict[str, str] = dataclasses.field(default_factory=dict)  # sources nobody pulls from
    cut_off: dict[str, str] = dataclasses.field(default_factory=dict)  # receivers whose orders carry it all


class Reach:
    """The pulls reported in a run: by (receiver, source), a ``Pair``."""

    def __init__(self) -> None:
        self.pairs: dict[tuple[str, str], Pair] = {}

    def failed(self, receiver: str, sources: Iterable[str], round_: int) -> None:
        for source in sources:
            p = self.pairs.get((receiver, source), Pair())
            self.pairs[(receiver, source)] = Pair(p.failures + 1, round_, p.pulled)

    def pulled(self, receiver: str, sources: Iterable[str], round_: int) -> None:
        for source in sources:
            self.pairs[(receiver, source)] = Pair(0, None, round_)

    def standing(self, round_: int) -> Standing:
        """The round's sources that are down and receivers that are cut off (one pass over the pairs). Pure."""
        failed_from: dict[str, list[int]] = {}  # source: the rounds its quiet pairs failed in
        failed_by: dict[str, list[int]] = {}  # receiver: likewise
        served: dict[str, int] = {}  # source: the last round a pull from it worked
        took: dict[str, int] = {}  # receiver: the last round a pull of it worked
        for (receiver, source), p in self.pairs.items():
            if p.pulled is not None:
                served[source] = max(served.get(source, p.pulled), p.pulled)
                took[receiver] = max(took.get(receiver, p.pulled), p.pulled)
            if p.quiet(round_) and p.failed is not None:
                failed_from.setdefault(source, []).append(p.failed)
                failed_by.setdefault(receiver, []).append(p.failed)
        down = {
            s: f"{s} is down: {len(f)} workers failed to pull from it since round {min(f)}, and none pulled"
            for s, f in failed_from.items()
            if len(f) >= WITNESSES and served.get(s, -1) < min(f)
        }
        cut_off = {
            r: f"{r} failed to pull from {len(f)} peers since round {min(f)}, and pulled from none"
            for r, f in failed_by.items()
            if len(f) >= WITNESSES and took.get(r, -1) < min(f)
        }
        return Standing(down, cut_off)

    def usable(self, receiver: str, source: str, round_: int, standing: Standing) -> tuple[bool, str]:
        """Whether ``receiver`` may pull from ``source`` in ``round_`` (``standing``: that round's), and why
        not. Pure."""
        if why := dialable(source, not loopback(receiver)):
            return False, why
        if why := standing.down.get(source, ""):
            return False, why
        pair = self.pairs.get((receiver, source), Pair())
        if pair.quiet(round_):
            return False, f"{receiver} failed to pull from {source} in round {pair.failed} ({pair.failures} x)"
        return True, ""
