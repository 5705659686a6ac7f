"""Learning-rate schedules: the multiplier on a base learning rate, as one pure function of the step.

A ``Schedule`` is a frozen value, so the coordinator can hand the same one to the outer step and record it
in checkpoints, and a resumed run computes exactly the learning rates a straight run would have. Steps are
0-based. Every schedule starts with an optional linear warmup, ``factor = (step + 1) / warmup`` for
``step < warmup`` (the formula the coordinator has always used, kept to the bit), and then:

* ``constant``: 1.
* ``cosine``: half a cosine from 1 down to ``min_ratio`` over the ``total - warmup`` steps after warmup.
  With ``cycles > 1`` that span is cut into equal cycles, each decaying from 1 to ``min_ratio`` and then
  restarting at 1 (warm restarts, as in SGDR).
* ``linear``: a straight line from 1 at the end of warmup down to ``min_ratio`` at ``total``.
* ``inverse-sqrt``: ``sqrt(max(warmup, 1) / (step + 1))``, which meets the warmup's end at 1 and then
  decays without a horizon (no ``total`` needed); with no warmup it is ``1 / sqrt(step + 1)``.

Cosine and linear hold ``min_ratio`` from ``total`` on, so running past the planned length is safe.

Where they come from: the torchrun-ddp seed trains with linear warmup then cosine (optionally with
restarts); DeMuon's ``--lr_schedule 1|2|3`` picks constant, inverse-sqrt, or a cosine-like decay.
"""

from __future__ import annotations

import dataclasses
import math

SCHEDULES = ("constant", "cosine", "linear", "inverse-sqrt")
# Only these schedules decay towards a floor over a known horizon.
_DECAYING = ("cosine", "linear")


def _is_int(value: object) -> bool:
    # bool is an int subclass; `true` from a YAML file is a mistake, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """A learning-rate schedule; ``factor(step)`` multiplies the base learning rate.

    Attributes:
        kind: one of ``SCHEDULES``.
        warmup: linear warmup steps (0: none).
        total: the step at which cosine/linear reach ``min_ratio``; must exceed ``warmup`` for them,
            ignored by constant and inverse-sqrt.
        min_ratio: the floor of cosine/linear, as a fraction of the base learning rate, in [0, 1].
        cycles: cosine only: equal cycles (warm restarts) the decay after warmup is cut into.
        flag_prefix: put in front of every flag an error names, e.g. ``"inner-"`` makes them say
            ``--inner-lr-schedule``: the coordinator exposes an outer and an inner schedule.
    """

    kind: str = "constant"
    warmup: int = 0
    total: int = 0
    min_ratio: float = 0.0
    cycles: int = 1
    flag_prefix: str = ""

    def __post_init__(self) -> None:
        if type(self.flag_prefix) is not str:
            raise ValueError(f"flag_prefix must be a string, got {self.flag_prefix!r}")
        schedule, warmup = self._flag("lr-schedule"), self._flag("warmup-steps")
        min_ratio, cycles = self._flag("min-lr-ratio"), self._flag("lr-cycles")
        if self.kind not in SCHEDULES:
            raise ValueError(f"{schedule} must be one of {', '.join(SCHEDULES)}; got {self.kind!r}")
        if not _is_int(self.warmup) or self.warmup < 0:
            raise ValueError(f"{warmup} must be an integer >= 0, got {self.warmup!r}")
        if not _is_int(self.total) or self.total < 0:
            raise ValueError(f"the total steps of {schedule} must be an integer >= 0, got {self.total!r}")
        if not (_is_number(self.min_ratio) and math.isfinite(self.min_ratio) and 0.0 <= self.min_ratio <= 1.0):
            raise ValueError(f"{min_ratio} must be a number in [0, 1], got {self.min_ratio!r}")
        if not _is_int(self.cycles) or self.cycles < 1:
            raise ValueError(f"{cycles} must be an integer >= 1, got {self.cycles!r}")
        # A setting the chosen schedule would ignore is almost certainly a mistake (a schedule switched in
        # one place and not the other): refuse it rather than train with something other than was asked.
        if self.kind not in _DECAYING and self.min_ratio != 0.0:
            raise ValueError(f"{min_ratio} applies to the cosine and linear schedules, not {schedule} {self.kind}")
        if self.kind != "cosine" and self.cycles != 1:
            raise ValueError(f"{cycles} applies to the cosine schedule, not {schedule} {self.kind}")
        if self.kind in _DECAYING and self.total <= self.warmup:
            raise ValueError(
                f"{schedule} {self.kind} decays until the run's total steps ({self.total}), which must exceed "
                f"{warmup} ({self.warmup})"
            )
        if self.kind == "cosine" and self.cycles > self.total - self.warmup:
            raise ValueError(
                f"{cycles} ({self.cycles}) must not exceed the {self.total - self.warmup} steps after "
                f"{warmup}: every cycle needs at least one step"
            )

    def _flag(self, name: str) -> str:
        return f"--{self.flag_prefix}{name}"

    def factor(self, step: int) -> float:
        """The multiplier on the base learning rate at 0-based ``step``."""
        if not _is_int(step) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        if self.kind == "inverse-sqrt":
            return math.sqrt(max(self.warmup, 1) / (step + 1))
        if step >= self.total:
            return self.min_ratio
        span = self.total - self.warmup  # > 0: checked in __post_init__
        t = step - self.warmup  # steps since warmup ended, in [0, span)
        if self.kind == "linear":
            return 1.0 - (1.0 - self.min_ratio) * t / span
        # cosine: the position within the current cycle, in integers so that cycle boundaries land exactly
        # (t * cycles / span is an integer there) rather than a rounding error away.
        progress = (t * self.cycles) % span / span  # in [0, 1)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(base: float, schedule: Schedule, step: int) -> float:
    """The learning rate at ``step``: ``base * schedule.factor(step)``."""
    return base * schedule.factor(step)
