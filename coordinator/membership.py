"""Which workers a run has: a fixed list (``--workers``), or a file re-read every round (``--workers-file``).

``WorkersFile.poll`` returns the addresses the file names now (one per line or comma-separated; ``#``
starts a comment), or ``None`` when it has not changed or cannot be read (a half-written file is not
a reason to drop every worker). ``diff_members`` is the pure part: who joins and who leaves.
``Roster`` holds the run's workers (its slots) and applies a source's changes before each round.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from gradwire.coordinator.round import WorkerSlot
from gradwire.link import WorkerError, WorkerLink

log = logging.getLogger(__name__)


def parse_addresses(text: str) -> list[str]:
    """``host:port`` entries, one per line or comma-separated, ``#`` comments; duplicates dropped, order kept."""
    out: list[str] = []
    for line in text.splitlines():
        for item in line.split("#", 1)[0].split(","):
            address = item.strip()
            if not address:
                continue
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"not a host:port address: {address!r}")
            if address not in out:
                out.append(address)
    return out


def diff_members(current: Sequence[str], wanted: Sequence[str]) -> tuple[list[str], list[str]]:
    """(joining, leaving): addresses in ``wanted`` but not ``current``, and the other way round."""
    return [a for a in wanted if a not in current], [a for a in current if a not in wanted]


class MemberSource(Protocol):
    """Where a run's workers come from, asked before every round (``WorkersFile``, ``join.JoinRegistry``)."""

    def poll(self) -> list[str] | None:
        """The addresses now, if they changed since the last poll; else ``None``."""

    def forget(self) -> None:
        """Make the next ``poll`` answer even without a change (an address was not ready to join)."""


class WorkersFile:
    """``--workers-file FILE``: the run's workers are whatever FILE names, re-read before every round."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None

    def read(self) -> list[str]:
        """The addresses now; ``ValueError`` naming the file if it cannot be read or parsed."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--workers-file {self.path}: cannot read it ({e.strerror or e})") from None
        try:
            return parse_addresses(text)
        except ValueError as e:
            raise ValueError(f"--workers-file {self.path}: {e}") from None

    def forget(self) -> None:
        """Make the next ``poll`` return the addresses even if the file did not change (a worker it names
        was not ready: try it again)."""
        self._stamp = None

    def poll(self) -> list[str] | None:
        """The addresses if the file changed since the last poll (by size and mtime), else ``None``."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            log.warning("--workers-file %s: %s; keeping the current workers", self.path, e.strerror or e)
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return None
        try:
            addresses = self.read()
        except ValueError as e:
            log.warning("%s; keeping the current workers", e)
            return None
        self._stamp = stamp
        return addresses


class Roster:
    """The run's workers as slots, and how they change between rounds.

    ``source`` (``--workers-file``, ``--listen``), with ``connect`` to make a link for a new address, is
    asked before every round (``update``): workers it adds join after a state push, workers it drops stop
    getting work. Without a source the workers are the fixed ``links``.
    """

    def __init__(
        self,
        links: Sequence[WorkerLink],
        *,
        source: MemberSource | None = None,
        connect: Callable[[str], WorkerLink] | None = None,
        connect_timeout: float = 60.0,
    ) -> None:
        if not links:
            raise ValueError("--workers (or --local N) must name at least one worker")
        if source is not None and connect is None:
            raise ValueError("--workers-file and --listen need a client factory")
        self.slots = [WorkerSlot(i, link) for i, link in enumerate(links)]
        self.source, self._connect = source, connect
        self.connect_timeout = connect_timeout
        self._next_index = len(self.slots)

    def describe_all(self) -> None:
        """Describe every worker; a protocol mismatch or an unreachable worker stops here, clearly."""
        for slot in self.slots:
            slot.client.wait_ready(self.connect_timeout)
            info = slot.client.describe()
            slot.ranks, slot.device, slot.node_mode = info.ranks, info.device, info.node_mode
            slot.precision = info.precision
            slot.held = dict(info.replicas)
            node = (
                f", a node of {info.ranks} ranks ({info.node_mode}: {', '.join(info.rank_devices)})"
                if info.ranks > 1
                else ""
            )
            log.info(
                "worker %d at %s: %s (%s), torch %s%s",
                slot.index,
                slot.client.address,
                info.device,
                info.device_name,
                info.torch_version,
                node,
            )

    def active(self, step: int) -> list[WorkerSlot]:
        """The slots that work round ``step``: all but the benched (all of them if every one is)."""
        slots = [s for s in self.slots if not s.standing.benched(step)]
        if not slots:
            log.warning("step %d: every worker is benched; trying them all", step)
            return list(self.slots)
        return slots

    def update(self, step: int) -> None:
        """Apply a change of the source: add the workers it names anew (each after a short readiness
        check; one that is not ready yet is tried again next round), then drop those it no longer names
        (never the last one)."""
        if self.source is None:
            return
        wanted = self.source.poll()
        if wanted is None:
            return
        joining, leaving = diff_members([s.client.address for s in self.slots], wanted)
        # Joiners first: a list that replaces the last worker drops it once its replacement is in.
        for address in joining:
            assert self._connect is not None
            link = self._connect(address)
            try:
                link.wait_ready(min(5.0, self.connect_timeout))
                info = link.describe()
            except WorkerError as e:
                log.warning("step %d: %s is not ready to join yet (%s); trying again next round", step, address, e)
                link.close()
                self.source.forget()
                continue
            slot = WorkerSlot(
                self._next_index,
                link,
                ranks=info.ranks,
                device=info.device,
                node_mode=info.node_mode,
                precision=info.precision,
            )
            self._next_index += 1
            self.slots.append(slot)
            log.info(
                "step %d: worker %d (%s) joins the run (%s, %d rank(s)%s)",
                step,
                slot.index,
                address,
                info.device,
                info.ranks,
                f", {info.node_mode}" if info.node_mode else "",
            )
        for slot in [s for s in self.slots if s.client.address in leaving]:
            if len(self.slots) == 1:
                log.warning("step %d: the run's last worker (%s) left its list; keeping it", step, slot.client.address)
                break
            self.slots.remove(slot)
            slot.client.close()
            log.info("step %d: worker %d (%s) left the run", step, slot.index, slot.client.address)

    def close_sessions(self, run_id: str, timeout: float) -> None:
        """Ask every worker to drop ``run_id``'s session (best effort: a worker that is gone has none)."""
        for slot in self.slots:
            try:
                slot.client.close_run(run_id, timeout=timeout)
            except WorkerError as e:
                log.info("worker %d: could not close the session: %s", slot.index, e)
