"""The coordinator's decisions, as pure functions that say why: testable with no network and no model.

Each takes plain values and returns ``(decision, reason)``; the round loop acts on the decision and logs
the reason.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable, Mapping, Sequence
from typing import Literal

SyncAction = Literal["push", "replay", "current", "catch-up"]
REPLAY_PRECISIONS = ("auto", "float32", "float64")


def decide_sync(
    known_version: int | None, base_version: int, target_version: int, catch_up_bytes: int | None = None
) -> tuple[SyncAction, str]:
    """What a worker needs before it computes at ``target_version``.

    ``base_version`` is where every in-sync worker starts the round; the pending update (if any) moves it
    to ``target_version``. ``known_version`` is the replica version we believe the worker holds.
    ``catch_up_bytes`` is what the updates it missed would cost (``None``: out of the replay window, or
    dearer than the state).
    """
    if known_version is None:
        return "push", "worker state unknown (new, failed or resumed)"
    if known_version == target_version:
        return "current", "worker is at the round's version"
    if known_version == base_version:
        return "replay", "worker replays the pending update"
    if known_version < base_version and catch_up_bytes is not None:
        return (
            "catch-up",
            f"worker at version {known_version} replays {base_version - known_version} missed update(s) "
            f"({catch_up_bytes} bytes)",
        )
    return (
        "push",
        f"worker at version {known_version}, round starts at {base_version}, missed updates out of the replay window",
    )


# ------------------------------------------------------------------------------------------- benching

Verdict = Literal["ok", "clipped", "rejected", "caught"]


@dataclasses.dataclass(frozen=True)
class Score:
    """How well a worker's payloads point the way the others' do (``score``): an average of its
    leave-one-out agreement (``coordinator.agreement``, in [-1, 1]) that weighs recent rounds most, over
    the ``rounds`` rounds it was measured since it joined or was last benched (0 before the first)."""

    value: float = 0.0
    rounds: int = 0


@dataclasses.dataclass(frozen=True)
class Standing:
    """How a worker's recent contributions went: ``strikes`` bad rounds in a row, benched before ``until``,
    and its agreement ``score``."""

    strikes: int = 0
    until: int = 0  # the first step it works again (0: never benched)
    score: Score = Score()

    def benched(self, step: int) -> bool:
        return step < self.until


def judge(
    standing: Standing, step: int, verdict: Verdict, *, bench_after: int, bench_rounds: int
) -> tuple[Standing, str]:
    """A worker's standing after round ``step``'s ``verdict``: ``rejected`` (a malformed payload, a false
    token count, a norm the median clip would cut below ``HARD_CLIP`` of itself) is a strike, and so is
    ``clipped`` for callers that count milder clipping, and so is a low agreement ``score``; ``bench_after``
    strikes in a row bench it for ``bench_rounds`` rounds (0 turns benching off). ``caught`` (a failed spot
    check: its gradient was not computed on its rows) is no accident of a round: it benches at once. A good
    round clears the strikes. Benching starts its score over: back from the bench, it is judged on fresh
    rounds."""
    if verdict == "ok":
        return (
            Standing(score=standing.score),
            "contribution accepted"
            if not standing.strikes
            else f"accepted after {standing.strikes} bad round(s): strikes cleared",
        )
    strikes = max(standing.strikes + 1, bench_after if verdict == "caught" else 0)
    if bench_after and strikes >= bench_after:
        until = step + 1 + bench_rounds
        if verdict == "caught":
            return Standing(0, until), f"caught by a spot check: benched until step {until}"
        return Standing(0, until), f"{strikes} bad rounds in a row ({verdict} again): benched until step {until}"
    return Standing(strikes, standing.until, standing.score), f"{verdict}: strike {strikes}" + (
        f" of {bench_after}" if bench_after else ""
    )


HARD_CLIP = 0.25  # a sender the median-norm clip would scale below this is left out, with a strike

# From gpt-tiny runs of 200 rounds (coordinator.agreement): an honest worker's score mostly stayed above
# -0.14, a sign flipper's sat at -0.9 from its fourth round. Once the loss flattens an honest worker can point
# away for a dozen rounds running (one CI run: agreements down to -0.63, its score to -0.41 at round 162).
AGREEMENT_FLOOR = -0.3  # a score below this (pointing away from the others, over rounds) is a strike
AGREEMENT_WEIGHT = 0.25  # this round's share of the score; the rest is the score so far (0 to start)


def score(previous: Score, agreement: float | None, *, floor: float = AGREEMENT_FLOOR) -> tuple[Score, Verdict, str]:
    """A worker's agreement score after a round in which its payload agreed ``agreement`` with the others'
    (``None``: not measured, e.g. alone in the round: the score stands). The verdict is ``rejected`` (a
    strike, for ``judge``) while the score is below ``floor`` *and* this round's agreement is too: it has
    pointed away over rounds and still does. One whose payload comes back towards the others is kept that
    round, even before its score recovers: an honest worker's drift late in training ends in a round like
    that, and then its strikes stop, short of the bench; a sign flipper's rounds almost never do (its
    agreement stayed below +0.01, median -0.68 late).

    Each round moves the score ``AGREEMENT_WEIGHT`` of the way to its agreement, from 0 for a new worker
    or one back from the bench (``judge`` starts its score over): neither trusted nor distrusted, it is not
    struck for one bad round (honest workers had single rounds down to -0.9 late in training), and one
    that keeps pointing away (-0.9) is struck from its second round: -0.23, -0.40, -0.53..."""
    if agreement is None:
        return previous, "ok", "no agreement measured"
    value = (1 - AGREEMENT_WEIGHT) * previous.value + AGREEMENT_WEIGHT * agreement
    new = Score(value, previous.rounds + 1)
    if value < floor and agreement < floor:
        return (
            new,
            "rejected",
            f"points away from the others: agreement {agreement:+.2f} this round, score {value:+.2f} over "
            f"{new.rounds} round(s) (below {floor:+g})",
        )
    return new, "ok", f"agreement {agreement:+.2f}, score {value:+.2f} over {new.rounds} round(s)"


# Relative, of the whole gradient (fingerprint.compare_gradients): a bf16 worker is recomputed in bf16, and float
# noise across device kinds is ~1e-3; another batch's gradient moves most sampled values by their whole size.
SPOT_TOLERANCE = 0.05


def spot_check(step: int, senders: Sequence[int], every: int, secret: int) -> tuple[int | None, str]:
    """The sender round ``step`` checks (one of ``senders``, slot indices), or ``None``, with why: on
    average one round in ``every`` (0: never; 1: every round), drawn from ``secret`` (the coordinator's,
    drawn at its start: no worker can tell which rounds are checked). The checked sender goes round the
    senders in slot order from a secret offset, so every one is checked as often; with ``every`` 1 each of
    n senders is checked once every n rounds."""
    if every <= 0:
        return None, "spot checks are off"
    if not senders:
        return None, "no sender to check"
    if random.Random(f"{secret}:{step}").random() >= 1.0 / every:
        return None, f"not drawn this round (one round in {every})"
    order = sorted(senders)
    chosen = order[(step + secret) % len(order)]
    return chosen, f"drawn (one round in {every}), sender {chosen} of {len(order)}"


SPOT_CHECK_METHODS = ("auto", "recompute", "redundancy")
# auto: the coordinator recomputes a sender's gradient itself when its model is on a GPU or this small (a CPU
# takes a few seconds for one worker's share of a step of a model this size); else the same rows go to more
# than one worker.
RECOMPUTE_PARAMS = 50_000_000
REDUNDANCY_GROUP = 3  # workers given the same rows in a redundancy check: a majority can say who differs


def spot_check_method(setting: str, params: int, device: str, recomputable: bool) -> tuple[str, str]:
    """How spot checks are made (``--spot-check-by``): ``recompute`` (the coordinator recomputes a sender's
    gradient) or ``redundancy`` (now and then the same rows go to several workers and their fingerprints
    are compared), or ``off``, with why. ``recomputable``: whether the model's gradients can be recomputed
    at all (no dropout drawn)."""
    if not recomputable:
        return "off", "the model's gradients cannot be recomputed, by the coordinator or another worker"
    if setting in ("recompute", "redundancy"):
        return setting, f"--spot-check-by {setting}"
    if device.startswith("cuda"):
        return "recompute", "auto: the coordinator holds the model on a GPU"
    if params <= RECOMPUTE_PARAMS:
        return "recompute", f"auto: {params / 1e6:.1f}M parameters, a step's share is cheap on the coordinator's CPU"
    return "redundancy", f"auto: {params / 1e6:.0f}M parameters is too many to recompute on the coordinator's CPU"


def redundancy_group(
    step: int, candidates: Sequence[tuple[int, Hashable]], every: int, secret: int
) -> tuple[tuple[int, ...], str]:
    """The workers (slot indices) that round ``step`` gives the same rows, the first one's, or ``()``, with
    why: on average one round in ``every`` (a draw of its own from ``secret``), up to ``REDUNDANCY_GROUP``
    workers whose work has the same shape (``candidates``: slot index and a key of its batch's shape, its
    inner steps and its ranks), picked round the largest such class from a secret offset."""
    if every <= 0:
        return (), "spot checks are off"
    if random.Random(f"{secret}:redundancy:{step}").random() >= 1.0 / every:
        return (), f"not drawn this round (one round in {every})"
    classes: dict[Hashable, list[int]] = {}
    for slot, key in candidates:
        classes.setdefault(key, []).append(slot)
    largest = max(classes.values(), key=len, default=[])
    if len(largest) < 2:
        return (), "no two workers have work of the same shape"
    members = sorted(largest)
    size = min(REDUNDANCY_GROUP, len(members))
    first = (step + secret) % len(members)
    group = tuple(members[(first + i) % len(members)] for i in range(size))
    return group, f"drawn (one round in {every}): {size} workers on worker {group[0]}'s rows"


def redundancy_verdict(members: Sequence[int], agree: Mapping[tuple[int, int], bool]) -> tuple[dict[int, str], str]:
    """Which members of a redundancy group are caught (slot -> why), and a summary: ``members`` returned a
    fingerprint of the same rows; ``agree[(a, b)]`` (a < b) says whether two fingerprints agree. A member is
    caught when it agrees with none of the others while two others agree with each other (a majority that
    computed the same); two that disagree, with nobody to say which, are a dispute: neither is caught.
    Assumes most of a group is honest: two colluders that send the same fake outvote one honest worker."""
    if len(members) < 2:
        return {}, "fewer than two fingerprints to compare"
    pairs = [(a, b) for i, a in enumerate(members) for b in members[i + 1 :]]
    agreeing = [p for p in pairs if agree[p]]
    if len(agreeing) == len(pairs):
        return {}, f"{len(members)} workers computed the same gradient"
    if not agreeing:
        return {}, f"disputed: none of {len(members)} fingerprints agree with another (nobody can say who differs)"
    caught = {}
    for m in members:
        if not any(m in p for p in agreeing):
            others = [x for x in members if x != m]
            caught[m] = (
                f"spot check failed: its gradient of rows it shared with workers {others} differs from theirs, "
                "which agree with each other"
            )
    return caught, f"{len(caught)} of {len(members)} differ from the others"


# ------------------------------------------------------------------------------------------- failed rounds

RetryAction = Literal["retry", "give-up"]


def after_failed_round(
    failed_in_a_row: int,
    failing_for: float,
    *,
    max_rounds: int,
    max_seconds: float,
    first_delay: float = 0.5,
    max_delay: float = 30.0,
) -> tuple[RetryAction, float, str]:
    """What to do after a round with no usable worker: wait and retry, or give up.

    Waits double from ``first_delay`` up to ``max_delay``, so a restart or a network blip that takes every
    worker away for a few seconds costs a few rounds' waiting, not the run. The run gives up only once
    both ``max_rounds`` rounds in a row have failed and they span ``max_seconds``. Returns (action, seconds
    to wait, reason).
    """
    if failed_in_a_row >= max_rounds and failing_for >= max_seconds:
        return (
            "give-up",
            0.0,
            (
                f"{failed_in_a_row} rounds in a row over {failing_for:.0f} s with no usable worker "
                f"(--max-failed-rounds {max_rounds}, --max-failed-seconds {max_seconds:g})"
            ),
        )
    delay = min(max_delay, first_delay * 2 ** max(0, failed_in_a_row - 1))
    return (
        "retry",
        delay,
        f"no usable worker ({failed_in_a_row} round(s) in a row, {failing_for:.1f} s); next round in {delay:.1f} s",
    )


@dataclasses.dataclass
class FailedRounds:
    """The run's current streak of failed rounds, fed to ``after_failed_round`` (the loop's only state
    for it): ``failed`` after a round with no usable worker, ``succeeded`` after one that counted."""

    max_rounds: int
    max_seconds: float
    in_a_row: int = 0
    since: float = 0.0  # when the streak began (time.monotonic())

    def failed(self, now: float) -> tuple[RetryAction, float, str]:
        self.in_a_row += 1
        if self.in_a_row == 1:
            self.since = now
        return after_failed_round(
            self.in_a_row, now - self.since, max_rounds=self.max_rounds, max_seconds=self.max_seconds
        )

    def succeeded(self) -> None:
        self.in_a_row = 0


# ------------------------------------------------------------------------------------------- stragglers


@dataclasses.dataclass(frozen=True)
class Grace:
    """How long a round waits for stragglers once it has its quorum: ``seconds``, or ``factor`` times the
    median time the quorum's results took (``--straggler-grace 10`` or ``--straggler-grace 1.5x``)."""

    seconds: float = 0.0
    factor: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Grace:
        try:
            grace = cls(factor=float(text[:-1])) if text.endswith("x") else cls(seconds=float(text))
        except ValueError:
            raise ValueError(
                f"--straggler-grace must be seconds (10) or a factor of the median time (1.5x), got {text!r}"
            ) from None
        if not all(v >= 0 and v < float("inf") for v in (grace.seconds, grace.factor)):
            raise ValueError(f"--straggler-grace must be >= 0, got {text!r}")
        return grace

    def after(self, arrivals: list[float]) -> float:
        return self.seconds if not self.factor else self.factor * sorted(arrivals)[len(arrivals) // 2]


def decide_close(
    elapsed: float, arrivals: list[float], waiting: int, *, quorum: int, grace: Grace, limit: float = float("inf")
) -> tuple[bool, float, str]:
    """Whether a round stops waiting for its last workers: (close, seconds until it would, reason).

    ``arrivals`` are the times (since the round began) at which its usable results came in, ``waiting``
    the workers still computing. Until ``quorum`` results are in, or with ``quorum`` 0 (every worker), the
    round waits; once they are, it waits ``grace`` longer for the rest, then closes without them. Whatever
    the quorum, it never waits past ``limit``: by then every call's own deadline has passed, and one still
    open is stuck (a gRPC response stream can miss its deadline when its channel goes away, grpc#20562).
    """
    if waiting == 0:
        return True, 0.0, "every worker answered"
    if elapsed >= limit:
        return True, 0.0, f"{waiting} call(s) outlived every deadline ({limit:.0f} s): cut off"
    if quorum <= 0 or len(arrivals) < quorum:
        return False, limit - elapsed, f"{len(arrivals)} of {quorum or 'all'} results in"
    deadline = min(sorted(arrivals)[quorum - 1] + grace.after(arrivals), limit)
    if elapsed >= deadline:
        return True, 0.0, f"quorum of {quorum} in; {waiting} straggler(s) cut off after {deadline:.2f} s"
    return (
        False,
        deadline - elapsed,
        f"quorum of {quorum} in; waiting up to {deadline - elapsed:.2f} s for {waiting} more",
    )


def decide_first_push(new: int, others: int) -> tuple[Literal["block", "background"], str]:
    """How ``new`` workers that have never had the state get it, with ``others`` able to work this round.

    With nobody else to work (the run's start, or every worker lost its state) the round waits for the
    pushes. Otherwise the state travels in the background and the rounds go on: a whole state over a slow
    link (or a joiner that stalls mid-push) would otherwise hold every other worker for as long.
    """
    if others == 0:
        return "block", f"{new} worker(s) need the state and no other can work this round"
    return "background", f"{others} other worker(s) train meanwhile; it works from the round after the state lands"


# Device kinds whose float32 replays have been measured to agree bit for bit (``benchmarks.gpu``'s drift
# check: a CPU replica and a GPU replica replaying the same sign-SGD updates; docs/benchmarks.md has the runs).
FLOAT32_AGREE = frozenset({"cpu", "cuda"})


def replay_precision(setting: str, coordinator_device: str, worker_devices: Sequence[str]) -> tuple[bool, str]:
    """Whether this round's replay combines in float64 (``AggregationRule.exact``), and why.

    Replicas replay an update by summing the senders' coefficients and transforming them back. Two kinds of
    device could sum in another order and round differently in float32, and then a sign step (signsgd) flips
    wherever a coordinate is near zero: the replicas drift apart and need pushes. In float64, rounded once to
    float32, they agree, at twice the replay's cost. ``auto`` pays for it only where the device kinds present
    (the coordinator's, its workers') include one whose float32 replays have not been measured to agree with
    the others' (``FLOAT32_AGREE``: CPUs and CUDA GPUs agree bit for bit, measured on an H200 and an H100);
    the per-round fingerprint check still catches a drift, and a push mends it. ``float32``/``float64``
    force it.
    """
    if setting == "float64":
        return True, "--replay-precision float64"
    if setting == "float32":
        return False, "--replay-precision float32"
    kinds = {coordinator_device.split(":")[0]} | {d.split(":")[0] for d in worker_devices if d}
    unmeasured = sorted(kinds - FLOAT32_AGREE)
    if unmeasured and len(kinds) > 1:
        return (
            True,
            f"replicas on {', '.join(sorted(kinds))}: float32 replays on {', '.join(unmeasured)} are not measured "
            "to agree with the others', so replays combine in float64 and every replica computes the same bits",
        )
    if len(kinds) > 1:
        return False, f"replicas on {', '.join(sorted(kinds))}, whose float32 replays are measured to agree bit for bit"
    return False, f"every replica on {coordinator_device.split(':')[0]}: float32 replays agree bit for bit"


# ------------------------------------------------------------------------------------------- downlink

DOWNLINKS = ("auto", "replay", "compressed")
DOWNLINK_MARGIN = 2.0  # auto: compress once a replay would carry this many times one compressed aggregate
DOWNLINK_TOPK_FACTOR = 4  # a compressed downlink keeps this many times the workers' top-k (--downlink-topk 0)


def decide_downlink(
    setting: str, senders: int, payload_bytes: int, aggregate_bytes: int, fragments: int = 1
) -> tuple[bool, str]:
    """Whether the round's update goes to the workers as one re-compressed aggregate (``True``) rather than as
    a replay of its ``senders``' payloads (of ``payload_bytes`` on average), and why.

    A replay is exact (every replica combines the senders' own payloads) but each worker receives the other
    senders' payloads: its downlink grows with the swarm, and the coordinator's egress with its square. One
    compressed aggregate (``aggregate_bytes``) costs the same whatever the number of senders, and loses what
    its top-k and quantization leave in the coordinator's error feedback until a later round sends it.
    ``auto`` compresses once a sender's replay (the others' payloads) would exceed ``DOWNLINK_MARGIN`` x one
    compressed aggregate. Streamed fragments (``fragments`` > 1) always replay: each round's update is one
    fragment's payloads.
    """
    if setting == "replay":
        return False, "--downlink replay"
    if fragments > 1:
        return False, f"--fragments {fragments}: each round replays one fragment's payloads"
    if setting == "compressed":
        return True, "--downlink compressed"
    replay = max(0, senders - 1) * payload_bytes
    if replay > DOWNLINK_MARGIN * aggregate_bytes:
        return True, (
            f"{senders} senders: a replay of {replay} bytes per worker is over {DOWNLINK_MARGIN:g} x one compressed "
            f"aggregate ({aggregate_bytes} bytes): the downlink sends the aggregate"
        )
    return False, (
        f"{senders} sender(s): a replay of {replay} bytes per worker is within {DOWNLINK_MARGIN:g} x one compressed "
        f"aggregate ({aggregate_bytes} bytes): the downlink replays the senders' payloads"
    )
