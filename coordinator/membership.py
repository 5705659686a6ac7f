"""Which workers a run has: a fixed list (``--workers``), or a file re-read every round (``--workers-file``).

``WorkersFile.poll`` returns the addresses the file names now (one per line or comma-separated; ``#``
starts a comment), or ``None`` when it has not changed or cannot be read (a half-written file is not
a reason to drop every worker). ``diff_members`` is the pure part: who joins and who leaves.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

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
