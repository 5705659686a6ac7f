"""Work sized to each worker (``--balance``): how fast each one is, and each round's split of the batch.

The global batch stays what ``--batch-size`` x ranks gives; the balancer only moves its rows between the
workers, in proportion to their throughput, so that they finish together and no round waits for its
slowest worker. Two pure pieces, with no network and no clock of their own:

* ``measure``: a worker's throughput, smoothed (``Throughput``): an exponential moving average of the
  tokens it was sent over the seconds the coordinator waited for its answer, from the round's dispatch
  to its result. The coordinator's clock, not the ``compute`` time a worker reports, for two reasons.
  What must come out equal is the time the round waits for each worker, its link, replay and encoding
  included: a fast GPU behind a slow link finishes late all the same. And splitting rows in proportion
  to rows / observed seconds has exactly "every worker's observed time equal" as its fixed point, whatever
  each worker's fixed costs; with reported compute times the fixed point would equalize only the compute.
  Besides, a worker's timings are its own word and a liar could shift rows with them; the coordinator's
  clock it cannot talk to. A worker cut off as a straggler gives a bound: it had ``seconds`` and did not
  finish, so its rate is at most that; the estimate only ever moves down on it.
* ``shares``: the decision, ``(Split, reason)`` like ``coordinator.decisions``. Each slot's share is a
  multiple of its ``unit`` (a node's ranks: every rank gets rows / ranks) and at least one unit (no worker
  is starved), the total is exact (largest remainders), and it moves only when the workers' predicted
  finish times are more than ``TOLERANCE`` apart for ``PATIENCE`` decisions in a row: measurements are
  noisy, and a share that followed the noise would change the rows (and the run's trajectory) for
  nothing. A worker not measured ``MIN_SAMPLES`` times yet keeps its default share.

``work.WorkPlanner`` holds the estimates and the last shares (a checkpoint keeps them) and turns shares
into rows: in ``rows`` mode a share is rows per step (per inner step in local-SGD rounds), in ``steps``
mode (local-SGD rounds) rows per round, in whole inner steps of the worker's default rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

BALANCE_MODES = ("off", "rows", "steps")
ALPHA = 0.3  # weight of a new measurement in the moving average
MIN_SAMPLES = 2  # measured rounds before a worker's share may move (its first measurement is replaced)
TOLERANCE = 0.25  # predicted finish times this far apart (slowest / fastest - 1) count as imbalanced
PATIENCE = 2  # imbalanced decisions in a row before the shares move


@dataclasses.dataclass(frozen=True)
class Throughput:
    """A worker's smoothed throughput: ``rate`` tokens per second, over ``samples`` measured rounds."""

    rate: float
    samples: int = 1


def measure(
    previous: Throughput | None, tokens: int, seconds: float, *, finished: bool = True, alpha: float = ALPHA
) -> Throughput | None:
    """The estimate after a round in which a worker was sent ``tokens`` and the coordinator waited
    ``seconds`` for it: ``finished`` (its result came), or cut off (a bound: it is no faster than that).

    Until ``MIN_SAMPLES`` rounds are measured the newest replaces the last: a worker's first round pays
    one-time costs (allocations, the codec's bases) that say nothing of the rounds after it.
    """
    if tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
        return previous
    observed = tokens / seconds
    if previous is None:
        return Throughput(observed, 1)
    if not finished and observed >= previous.rate:
        return previous  # the bound says nothing the estimate did not
    if previous.samples < MIN_SAMPLES:
        return Throughput(observed, previous.samples + 1)
    return Throughput((1 - alpha) * previous.rate + alpha * observed, previous.samples + 1)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One worker of a round, as ``shares`` sees it.

    ``default``: its share without balancing (a multiple of ``unit``); ``rate``: its throughput in tokens
    per second (``None``: not measured enough); ``current``: its share in the last round planned for it
    (``None``: none yet).
    """

    unit: int
    default: int
    rate: float | None = None
    current: int | None = None


@dataclasses.dataclass(frozen=True)
class Split:
    """A round's shares, by position among its slots, and how many decisions in a row (this one included)
    found the workers imbalanced without moving the shares."""

    rows: tuple[int, ...]
    imbalanced: int = 0


def shares(
    slots: Sequence[Slot], imbalanced: int = 0, *, tolerance: float = TOLERANCE, patience: int = PATIENCE
) -> tuple[Split, str]:
    """Each slot's share of the round's rows (the sum of the defaults), and why.

    Slots without a rate keep their default; the others share the rest. As long as the shares are
    settled (the last round's, covering every slot, summing to the total), they move only when the
    measured slots' predicted finish times (share / rate) are more than ``tolerance`` apart for
    ``patience`` decisions in a row (``imbalanced`` counts the ones before this); then in proportion to
    the rates. A slot that joins or leaves unsettles them: the measured slots keep their proportions (or
    take their rates', if imbalanced) over the rows left to them.
    """
    total = sum(s.default for s in slots)
    defaults = tuple(s.default for s in slots)
    measured = [i for i, s in enumerate(slots) if s.rate is not None and s.rate > 0]
    if not measured:
        return Split(defaults), "no worker measured yet: the default shares"
    base = [s.current if s.current is not None else s.default for s in slots]
    settled = all(s.current is not None for s in slots) and sum(base) == total
    pool = total - sum(slots[i].default for i in range(len(slots)) if i not in measured)
    times = [base[i] / slots[i].rate for i in measured]  # type: ignore[operator]
    spread = max(times) / min(times) - 1
    if spread <= tolerance:
        if settled:
            return Split(tuple(base)), f"finish times within {spread:.0%} of each other: shares kept"
        weights = {i: float(base[i]) for i in measured}
        why = "the workers changed: the measured ones keep their proportions"
    else:
        if settled and imbalanced + 1 < patience:
            return Split(tuple(base), imbalanced + 1), (
                f"finish times {spread:.0%} apart ({imbalanced + 1} of {patience} rounds before the shares move)"
            )
        weights = {i: float(slots[i].rate) for i in measured}  # type: ignore[arg-type]
        why = f"finish times {spread:.0%} apart: rows in proportion to throughput"
    scale = pool / sum(weights.values())
    targets = [weights[i] * scale if i in weights else float(s.default) for i, s in enumerate(slots)]
    rows = apportion(targets, [s.unit for s in slots], total)
    if rows is None:
        return Split(defaults), f"{total} rows do not split into these units ({[s.unit for s in slots]}): defaults"
    return Split(rows), why


def apportion(targets: Sequence[float], units: Sequence[int], total: int) -> tuple[int, ...] | None:
    """Whole multiples of ``units`` (at least one each) summing to ``total``, as near ``targets`` as largest
    remainders get; ``None`` where the units cannot make the total that way (nodes of unlike ranks)."""
    rows = [max(u, int(x // u) * u) for x, u in zip(targets, units)]
    while sum(rows) > total:  # the floors of the smallest pushed it over: back from the most over target
        over = [i for i, (r, u) in enumerate(zip(rows, units)) if r > u]
        if not over:
            return None
        i = max(over, key=lambda i: (rows[i] - targets[i]) / units[i])
        rows[i] -= units[i]
    while (left := total - sum(rows)) > 0:
        fits = [i for i, u in enumerate(units) if u <= left]
        if not fits:
            return None
        i = max(fits, key=lambda i: (targets[i] - rows[i]) / units[i])
        rows[i] += units[i]
    return tuple(rows)
