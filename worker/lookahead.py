"""Look-ahead for one-step-delayed rounds (``coordinator train --overlap``). No networking here.

In a delayed round a worker computes its contribution at the replica *before* the round's update (the
order's ``compute_before_update``), so round r + 1's contribution needs nothing that round r's result
decides: it can be computed while round r's result travels and the coordinator aggregates. An order that
carries ``next_batch`` (and, in local-SGD rounds, ``next_local_steps``) lets the worker do just that: once
the round's result is out, it computes the next round's gradient, or takes its H inner steps, at its
replica's version and keeps the result as a ``Lookahead``. The next order uses it only if it asks for
exactly that computation (``serves``): same run, the next round, starting from that version with no
catch-up, the same batch, micro-batching, clipping and inner steps. Anything else discards it and the round
computes afresh, so what a round returns never depends on whether the look-ahead ran.

Only the contribution is computed ahead, not its encoding: error feedback changes with every encode, and a
discarded look-ahead must leave nothing behind. Inner steps move the inner optimizer's state, so a local-SGD
look-ahead keeps a copy of that state as it was (``inner_before``): a discarded one puts it back, and a
checkpoint taken while one is held saves it, not the state of a round not yet asked for. The rounds of a
node of several ranks are not looked ahead (its ranks move in lockstep on the coordinator's calls), nor are
streamed fragments' (their working model carries on from round to round: a dropped look-ahead would move it).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gradwire.protocol import WorkOrder
from gradwire.worker.compute import Contribution


@dataclasses.dataclass(frozen=True)
class Lookahead:
    """The contribution ``expected`` (a ``preview``) asks for, computed ahead."""

    expected: WorkOrder
    contribution: Contribution
    seconds: float  # the compute it took (reported as the round's compute time when used)
    inner_before: dict[str, torch.Tensor] | None = None  # local-SGD: the inner optimizer's state before it

    def serves(self, order: WorkOrder, version: int) -> tuple[bool, str]:
        """Whether ``order``, with the replica at ``version`` when its compute would start, asks for this
        very computation; and why not, when it does not."""
        made = self.expected
        if order.run_id != made.run_id or order.round != made.round:
            return False, f"computed ahead for round {made.round}, the order is round {order.round}"
        if not order.compute_before_update:
            return False, "the order is not a delayed round"
        if order.catch_up or version != made.base_version:
            return False, f"computed ahead at version {made.base_version}, the order computes at {version}"
        if (why := other_work(order, made)) is not None:
            return False, why
        return True, "the order asks for the gradient computed ahead"


def other_work(order: WorkOrder, made: WorkOrder) -> str | None:
    """How ``order``'s contribution would differ from ``made``'s at the same version (None: it would not):
    its inner steps, micro-batching, clipping or batch."""
    if order.local_steps != made.local_steps:
        return "the order's inner steps differ"
    if order.micro_batch_size != made.micro_batch_size:
        return "the order's micro-batching differs"
    if order.clip_grad_norm != made.clip_grad_norm:
        return "the order's gradient clipping differs"
    if order.batch.shape != made.batch.shape or not np.array_equal(order.batch, made.batch):
        return "the order's batch differs"
    return None


def preview(order: WorkOrder, version: int) -> WorkOrder | None:
    """The order the worker expects next after ``order`` (its replica now at ``version``), if ``order``
    announces one that may be looked ahead; else ``None``."""
    if order.next_batch is None or not order.compute_before_update:
        return None
    if order.local_steps is not None and (order.next_local_steps is None or order.local_steps.fragment is not None):
        return None  # streamed fragments: the working model carries on, and a dropped look-ahead would move it
    return dataclasses.replace(
        order,
        round=order.round + 1,
        base_version=version,
        batch=order.next_batch,
        update=None,
        catch_up=(),
        next_batch=None,
        local_steps=order.next_local_steps,
        next_local_steps=None,
    )
