"""One coordinator per run directory: an exclusive lock that a dead holder does not keep.

Two coordinators writing one run directory (a supervisor's restart racing a process that is not dead yet, a
second command on the same --output-dir) would interleave update-log records and checkpoints. ``RunLock``
takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<run dir>/coordinator.lock``: the kernel drops a flock when
its holder's last descriptor closes, so a process that dies, even by SIGKILL, frees the directory with no
stale pid file to clean up. The holder writes its pid and host into the file only so that the refusal can
name it; the lock is the flock, never the file's contents.

Notes: the descriptor is close-on-exec, so subprocesses the coordinator starts do not inherit the lock, but
a child it forks does (it shares the open file) and keeps the lock until it exits too. On NFS, Linux maps
flock to a POSIX byte-range lock, which holds across hosts where the server supports locking.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_FILE = "coordinator.lock"
_MAX_HOLDER_BYTES = 4096  # the holder's note is one short JSON line; read no more than this of it


class RunLocked(RuntimeError):
    """Another live process holds the run directory's lock."""


def _holder(fd: int) -> str:
    """Who holds the lock, from the note its holder wrote, for the error message."""
    raw = os.pread(fd, _MAX_HOLDER_BYTES, 0)
    try:
        note = json.loads(raw)
        return f"pid {int(note['pid'])} on host {note['host']}, since {note['since']}"
    except (ValueError, KeyError, TypeError):
        # A holder between taking the lock and writing its note, or an older note: show what is there.
        return f"its note reads {raw[:200]!r}" if raw else "it has not written its pid yet"


class RunLock:
    """``with RunLock(run_dir):`` holds ``run_dir``'s lock (creating the directory), or raises ``RunLocked``
    naming the directory and the holder's pid and host."""

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunLocked(
                f"run directory {self.run_dir} is in use by another coordinator ({holder}); stop it first, or "
                "pick another --output-dir (the lock is freed as soon as its holder exits, however it exits)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, note.encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Free the lock. The file stays: removing it would let a process that opened it just before lock an
        unlinked file while a third locks a new one."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
