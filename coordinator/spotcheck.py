"""Spot checks: now and then the coordinator recomputes one sender's gradient and compares fingerprints.

While checks are on (``--spot-check-every N``) every work order asks for the fingerprint of the round's
first gradient (``WorkOrder.fingerprint_gradient``): the batch's gradient in gradient mode, the first inner
step's in a local-SGD round, at the replica and before clipping, summarised as a replica is
(``replica.Fingerprint``: per tensor its sum and sum of squares, and values at fixed positions). Every order
asks, so a worker cannot tell which rounds are checked. In about one round in N (``decisions.spot_check``,
drawn from the run's seed and the step) the coordinator takes one sender at random, computes that gradient itself on its
own copy of the workers' replica (bit-identical to theirs) from the rows it sent, and compares
(``compare``). A sender whose fingerprint is missing or differs beyond ``--spot-check-tolerance`` is caught:
its payload is left out and it is benched at once (``decisions.judge``).

Where the coordinator cannot afford that (``decisions.spot_check_method``: a large model on a CPU), the
same rows go to up to three workers instead (``decisions.redundancy_group``, drawn as rarely): their
replicas are bit-identical, so honest fingerprints of the same rows agree to float noise, and one that
differs from two that agree is caught (``decisions.redundancy_verdict``). Their payloads share those rows'
weight (the rows count once) and are not taken for copies of each other; their own rows of that round are
not trained.

What it catches: a gradient computed on rows other than those sent (a worker saving its data, or training
on its own), a made-up or stale gradient, a payload of zeros or noise with tokens claimed for it: whatever
was not computed on the round's rows at the round's replica. What it cannot: a worker that computes the
honest gradient, reports its fingerprint, and sends another payload (a sign flip, a copy): the fingerprint
says the work was done, not that the payload is its result; agreement (``coordinator.agreement``) and the
copy check (``coordinator.copies``) are for those. The inner steps after a local-SGD round's first are not
checked. A model that draws dropout while training cannot be recomputed (``deterministic``): checks are
then off, and say why. Rounds that compute before the update (``--overlap``) are computed at the version
before the coordinator's copy: they are not checked.

Float noise: the same kind of device and precision recomputes the same bits (the tests' case). A bf16 worker's
gradient is recomputed in bf16 (autocast) too, as its Describe says it computes: against a float32 recompute
it drifts as the model trains (a gradient of gpt-tiny's embedding by 9% in its sum of squares after 12 local
rounds, a norm's weight by 34% of its own tiny norm), so a float32 recompute would bench honest workers.
``fingerprint.compare_gradients`` weighs each tensor against the whole gradient; another batch's gradient
differs in most sampled values by their whole size.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.decisions import (
    SPOT_TOLERANCE,
    redundancy_verdict,
    spot_check,
    spot_check_method,
)
from gradwire.coordinator.round import RoundOutcome, RoundWork
from gradwire.fingerprint import Fingerprint, compare_gradients
from gradwire.models import lm_loss
from gradwire.protocol import LocalSteps, RoundResult
from gradwire.replica import Replica

log = logging.getLogger("gradwire.coordinator")


def deterministic(spec: Mapping[str, Any]) -> tuple[bool, str]:
    """Can a gradient of this model (``registry`` spec) be recomputed bit for bit (up to float noise) from
    the rows and the replica? Not if it draws dropout while training."""
    if spec.get("arch") == "gpt":
        return True, "the built-in GPT draws no dropout"
    rates = {k: v for k, v in dict(spec.get("config", {})).items() if ("dropout" in k or "pdrop" in k)}
    drawn = {k: v for k, v in rates.items() if isinstance(v, int | float) and v > 0}
    if drawn:
        names = ", ".join(f"{k} {v:g}" for k, v in sorted(drawn.items()))
        return False, f"the model draws dropout while training ({names}): its gradients cannot be recomputed"
    return True, "the model draws no dropout"


def first_rows(batch: np.ndarray, local_steps: LocalSteps | None) -> np.ndarray:
    """The rows of a round's first gradient: the whole batch, or a local-SGD round's first inner step's."""
    if local_steps is None:
        return batch
    return batch[: batch.shape[0] // local_steps.steps]


def batch_gradient(
    model: torch.nn.Module, tokens: torch.Tensor, micro_batch_size: int, precision: str = "fp32"
) -> dict[str, torch.Tensor]:
    """The mean gradient of the loss over ``tokens`` (rows, T + 1), by micro-batches of ``micro_batch_size``
    rows (0: all at once) weighted by their share of rows, in ``precision`` (bf16: autocast), as a worker
    computes it; every parameter gets one."""
    rows = tokens.shape[0]
    step = micro_batch_size or rows
    model.zero_grad(set_to_none=True)
    for start in range(0, rows, step):
        micro = tokens[start : start + step]
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_loss(model, micro)
        (loss * (micro.shape[0] / rows)).backward()
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


class SpotChecker:
    """Recomputes a sender's first gradient on the coordinator's copy of the workers' replica."""

    def __init__(self, replica: Replica, tolerance: float = SPOT_TOLERANCE) -> None:
        self.replica, self.tolerance = replica, tolerance

    def expected(self, rows: np.ndarray, micro_batch_size: int, precision: str = "fp32") -> Fingerprint:
        """The fingerprint of the gradient at the replica on ``rows``, computed in the sender's ``precision``;
        the replica's parameters do not move (their ``.grad`` is cleared afterwards)."""
        model = self.replica.model
        device = next(iter(self.replica.params.values())).device
        was_training = model.training
        model.train()
        try:
            tokens = torch.from_numpy(rows.astype("int64")).to(device)
            grads = batch_gradient(model, tokens, micro_batch_size, precision)
            return self.replica.fingerprint_of(grads)
        finally:
            model.zero_grad(set_to_none=True)
            model.train(was_training)

    def check(
        self,
        result: RoundResult,
        batch: np.ndarray,
        local_steps: LocalSteps | None,
        micro_batch_size: int,
        precision: str = "fp32",
    ) -> tuple[bool | None, str]:
        """Did ``result``'s sender (computing in ``precision``) compute its first gradient on ``batch`` (the
        rows it was sent) at this replica? True, False (caught), or None when this result cannot be checked
        here (another version); with the reason."""
        if result.version != self.replica.version:
            return None, f"computed at version {result.version}, the coordinator's copy is at {self.replica.version}"
        if result.gradient_fingerprint is None:
            return False, "spot check: no gradient fingerprint returned, though every order asks for one"
        t0 = time.perf_counter()
        expected = self.expected(first_rows(batch, local_steps), micro_batch_size, precision)
        same, why = compare_gradients(expected, result.gradient_fingerprint, self.replica.numels, self.tolerance)
        seconds = time.perf_counter() - t0
        if same:
            return True, f"spot check passed: its gradient was recomputed ({seconds:.2f} s)"
        return False, f"spot check failed: the gradient recomputed from the rows it was sent differs ({why})"


class SpotChecks:
    """A run's spot checks: how they are made (``decisions.spot_check_method``), which rounds they draw (from
    a secret drawn here: no worker can tell), and the check of a round once its results are in."""

    def __init__(self, config: TrainConfig, spec: Mapping[str, Any], replica: Replica) -> None:
        self.every, self.method = config.spot_check_every, "off"
        self.tolerance = config.spot_check_tolerance
        self.secret = secrets.randbits(63)
        self.checker = SpotChecker(replica, self.tolerance)
        if self.every and config.fragments > 1:
            # Each worker's working model carries on from round to round: no one else holds the model its first
            # gradient is taken at, and workers given the same rows still send what their own pasts make.
            log.warning("spot checks are off: streamed fragments (--fragments) train a working model no one shares")
            self.every = 0
        if self.every:
            recomputable, why = deterministic(spec)
            params = sum(p.numel() for p in replica.params.values())
            device = str(next(iter(replica.params.values())).device)
            self.method, how = spot_check_method(config.spot_check_by, params, device, recomputable)
            if self.method == "off":
                log.warning("spot checks are off: %s", why)
                self.every = 0
            else:
                log.info("spot checks: %s (%s)", self.method, how)

    @property
    def fingerprint_gradient(self) -> bool:
        """Whether every order asks for its gradient's fingerprint (``WorkOrder.fingerprint_gradient``)."""
        return self.every > 0

    @property
    def redundancy(self) -> tuple[int, int]:
        """(every, secret) for the work planner's redundancy groups; every 0: none."""
        return (self.every if self.method == "redundancy" else 0, self.secret)

    def __call__(
        self, step: int, round_: RoundOutcome, work: RoundWork, apply_pending: Callable[[], None]
    ) -> tuple[dict[int, str], dict]:
        """Round ``step``'s check, if it draws one: the senders caught (slot -> why), and what the metrics
        record says of it. ``apply_pending`` brings the coordinator's replica to the round's version."""
        if work.redundant:
            return self._redundancy(step, round_, work)
        if self.method != "recompute" or work.compute_before_update:  # --overlap: computed a version back
            return {}, {}
        senders = {o.slot.index: o for o in round_.outcomes if o.result is not None}
        chosen, _ = spot_check(step, list(senders), self.every, self.secret)
        if chosen is None:
            return {}, {}
        apply_pending()
        o = senders[chosen]
        assert o.result is not None
        passed, why = self.checker.check(
            o.result, work.batches[chosen], work.local_steps_of(chosen), work.micro_batch_size, o.slot.precision
        )
        if passed is not None:
            ok, failed = o.slot.checks
            o.slot.checks = (ok + passed, failed + (not passed))
        log.log(
            logging.WARNING if passed is False else logging.DEBUG,
            "step %d: worker %d (%s): %s",
            step,
            chosen,
            o.slot.client.address,
            why,
        )
        record = {"worker": o.slot.client.address, "passed": passed, "reason": why, "by": "recompute"}
        return ({chosen: why} if passed is False else {}), record

    def _redundancy(self, step: int, round_: RoundOutcome, work: RoundWork) -> tuple[dict[int, str], dict]:
        """Compare the fingerprints of the senders given the same rows (``decisions.redundancy_verdict``)."""
        given = {o.slot.index: o for o in round_.outcomes if o.result is not None and o.slot.index in work.redundant}
        prints = {i: o.result.gradient_fingerprint for i, o in given.items() if o.result is not None}
        caught = {
            i: "spot check: no gradient fingerprint returned, though every order asks for one"
            for i, fp in prints.items()
            if fp is None
        }
        fingerprints = {i: fp for i, fp in prints.items() if fp is not None}
        numels = self.checker.replica.numels
        # Only workers computing in the same precision can agree: bf16 and float32 drift apart as a model
        # trains. Each precision's members are judged among themselves; one alone in its precision is not.
        classes: dict[str, list[int]] = {}
        for i in sorted(fingerprints):
            classes.setdefault(given[i].slot.precision, []).append(i)
        agree: dict[tuple[int, int], bool] = {}
        summaries = []
        for precision, members in classes.items():
            pairs = {
                (a, b): compare_gradients(fingerprints[a], fingerprints[b], numels, self.tolerance)[0]
                for n, a in enumerate(members)
                for b in members[n + 1 :]
            }
            found, said = redundancy_verdict(members, pairs)
            caught.update(found)
            agree.update(pairs)
            summaries.append(said if len(classes) == 1 else f"{precision}: {said}")
        summary = "; ".join(summaries) or redundancy_verdict([], {})[1]
        vouched = {m for pair, same in agree.items() if same for m in pair}  # agrees with another: passed
        for i, o in given.items():  # a dispute counts for nobody
            ok, failed = o.slot.checks
            o.slot.checks = (ok + (i in vouched and i not in caught), failed + (i in caught))
        for i, why in caught.items():
            log.warning("step %d: worker %d (%s): %s", step, i, given[i].slot.client.address, why)
        if not caught and "disputed" in summary:
            log.warning("step %d: spot check by redundancy: %s", step, summary)
        unanimous = bool(agree) and all(agree.values()) and all(len(m) >= 2 for m in classes.values())
        passed = False if caught else True if unanimous else None
        addresses = [given[i].slot.client.address for i in sorted(given)]
        return caught, {"workers": addresses, "passed": passed, "reason": summary, "by": "redundancy"}
