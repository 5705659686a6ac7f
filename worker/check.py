"""The first stage of a round: may this worker compute the order at all? Pure, with the reason.

A round is staged check -> advance the replica -> compute -> encode (``engine``). This stage changes
nothing: it compares what the order expects with what the worker holds. A replica that cannot be trusted
is a ``Verdict`` asking for the state (the coordinator pushes it and the worker carries on); an order that
is malformed for this replica (a token id past the embedding, an inner learning rate for a parameter the
model lacks) raises ``ProtocolError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.lr_scales import unknown_names
from gradwire.protocol import ProtocolError, WorkOrder
from gradwire.replica import Fingerprint, compare_fingerprints


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str
    stale: bool = False  # the replica itself is suspect (not merely at another version): only a push helps


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    """What the check needs to know of a session's replica."""

    version: int
    fingerprint: Fingerprint
    numels: Sequence[int]
    vocab_size: int | None
    stale: bool
    parameter_names: frozenset[str]  # the whole model's, as named_parameters() names them


def check_order(order: WorkOrder, replica: ReplicaView | None) -> Verdict:
    """Whether ``replica`` can serve ``order``: ok, or why the state must be pushed first.

    Token ids are checked before anything changes: an id past the embedding is an IndexError on a CPU and
    a device-side assert on a GPU, which leaves the worker's CUDA context unusable.
    """
    if replica is None:
        return Verdict(False, f"no replica for run {order.run_id!r}")
    if replica.stale:
        return Verdict(False, "replica was found out of sync; waiting for a state push", stale=True)
    check_token_range(order.batch, replica.vocab_size)
    if order.next_batch is not None:
        check_token_range(order.next_batch, replica.vocab_size)
    for steps in (order.local_steps, order.next_local_steps):
        if steps is not None:
            check_lr_scale_names(steps.optimizer, replica.parameter_names)
    if replica.version != order.base_version:
        return Verdict(False, f"replica at version {replica.version}, order starts from {order.base_version}")
    # The fingerprint is the coordinator's replica at base_version: check before moving on, so the
    # coordinator can send the order while it is still applying the same update to its own copy.
    same, why = compare_fingerprints(order.fingerprint, replica.fingerprint, replica.numels, order.sync_tolerance)
    if not same:
        return Verdict(False, f"fingerprint mismatch at version {replica.version}: {why}", stale=True)
    return Verdict(True, "replica is at the order's base version")


def check_lr_scale_names(optimizer: InnerOptimizerConfig, names: frozenset[str]) -> None:
    unknown = unknown_names(optimizer.lr_scales, names)
    if unknown:
        raise ProtocolError(
            f"local steps: inner optimizer lr_scales name parameters the model does not have: {unknown[:4]}"
        )


def check_token_range(batch: np.ndarray, vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    low, high = int(batch.min()), int(batch.max())
    if low < 0 or high >= vocab_size:
        raise ProtocolError(
            f"token id {high if high >= vocab_size else low} is outside the model's vocabulary [0, {vocab_size})"
        )
