"""Child processes that do not outlive their parent (a node's ranks, ``--local`` workers)."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """In a child, before it starts: a parent that is killed outright takes the child with it (Linux).
    (A node's ranks under their launcher; ``--local`` workers under their coordinator.)"""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: ranks outlive a killed launcher, as under any other supervisor
        pass
