"""The coordinator's replica, advanced off the round's critical path.

Between the last result of one round and the orders of the next, the coordinator only validates, judges,
aggregates in the coefficient domain and sends: work that costs payload bytes. Applying the round's update
to its own copy of the workers' replica (decode, outer step, fingerprint) costs the model's size, so it runs
here, on a thread of its own, while the workers compute. Whoever needs the replica at a version waits for
it, only then: a work order for the fingerprint of its base version, a push or a checkpoint for the state,
an evaluation or a spot check for the model.

``ReplicaAdvancer`` owns that thread and what it has reached: one job at a time, in submission order, each an
update's apply followed by the replica's fingerprint. A job that fails (an update the replica refuses) fails
every wait on it with ``ReplicaError``: a coordinator whose own replica cannot follow its updates must stop,
not go on sending orders nobody can check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from gradwire.replica import Fingerprint, Replica


class ReplicaError(RuntimeError):
    """The coordinator's replica could not apply an update (the advancer's job raised)."""


class ReplicaAdvancer:
    """Applies updates to ``replica`` on one background thread, in order; each job ends with the replica's
    fingerprint at the version it reached. ``busy_s`` adds up the seconds the jobs took (the background work
    a metrics record reports)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._pool: ThreadPoolExecutor | None = None  # started with the first job, and again after ``close``
        self._last: Future[Fingerprint] | None = None
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.jobs = 0

    def submit(self, apply: Callable[[], None]) -> Future[Fingerprint]:
        """Run ``apply`` (which moves the replica one version on) after the jobs before it; the future holds
        the replica's fingerprint after it, or raises ``ReplicaError``."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwire-replica")
            self._last = future = self._pool.submit(self._run, apply)
        return future

    def settle(self) -> None:
        """Wait until every submitted job has run: the replica stands still at the version they reach (and
        stays there until the next ``submit``). Raises ``ReplicaError`` if the last job failed."""
        with self._lock:
            last = self._last
        if last is not None:
            last.result()

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._last is None or self._last.done()

    def close(self) -> None:
        """Let the jobs submitted run, and end the thread (a later ``submit`` starts another)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _run(self, apply: Callable[[], None]) -> Fingerprint:
        start = time.perf_counter()
        try:
            apply()
            fingerprint = self.replica.fingerprint()
        except Exception as e:  # raised to every waiter, named for what it is
            raise ReplicaError(f"the coordinator's replica could not apply an update: {e}") from e
        finally:
            self.busy_s += time.perf_counter() - start
            self.jobs += 1
        return fingerprint
