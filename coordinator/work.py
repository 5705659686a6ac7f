"""What each round asks of its workers: their batches, cut from the data, and the settings of the run.

``WorkPlanner.work`` turns a round number and the slots working it into a ``round.RoundWork``, the plain
value the dispatcher builds every work order from. First it decides each worker's share of the round's
rows (a ``Plan``): ``--balance off`` gives every worker ``--batch-size`` rows per rank; ``rows`` and
``steps`` split the same total in proportion to the workers' throughput (``balance.shares``), which
``observe`` measures from every round's outcome. A round's plan is decided once and kept, so a retried
round sends the same rows. Batches are then a pure function of (round, inner step, position among the
round's workers, shares): disjoint within a round, and with ``--streaming`` the rounds tile the stream
whatever the shares (``set_layout``): no row is trained twice or skipped. A checkpoint keeps the
estimates and the shares (``state``, ``restore``), so that a resumed run decides its next round's shares
as the run that went on would have.

In ``rows`` mode a share is rows per step (per inner step in local-SGD rounds); in ``steps`` mode
(local-SGD rounds) it is rows per round, whole inner steps of the worker's default rows: a slow worker
takes fewer inner steps. Its rows are then a contiguous run of the round's rows laid out in the default
shares, so that the default shares send exactly what ``off`` sends.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradwire.compression import CodecConfig
from gradwire.compression.fragment import of_round
from gradwire.coordinator.balance import MIN_SAMPLES, Slot, Throughput, measure, shares
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.data import TokenSource
from gradwire.coordinator.decisions import redundancy_group
from gradwire.coordinator.round import RoundOutcome, RoundWork, WorkerSlot
from gradwire.protocol import LocalSteps

log = logging.getLogger("gradwire.coordinator")

KEEP_PLANS = 1024  # rounds whose plan is kept (for retries, resumes and ``batch`` after the fact)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One round's split: its workers (by address, in slot order), their ranks, and each one's share."""

    workers: tuple[str, ...]
    ranks: tuple[int, ...]
    shares: tuple[int, ...]  # rows per step (off, rows), or per round (steps)


class WorkPlanner:
    def __init__(
        self,
        config: TrainConfig,
        data: TokenSource,
        codec: CodecConfig,
        batch_dtype: np.dtype,
        fingerprint_gradient: bool = False,
        redundancy: tuple[int, int] = (0, 0),
        embedding: Sequence[str] = (),
    ) -> None:
        """``fingerprint_gradient``: spot checks are on, and every order asks for its gradient's fingerprint;
        ``redundancy``: (every, secret) of spot checks by redundancy (``decisions.redundancy_group``; every 0:
        none): in the rounds they draw, a few workers get the same rows. ``embedding``: the model's token
        embedding parameters, which the inner steps move at ``--inner-embedding-lr-scale`` times the rate."""
        self.config, self.data, self.codec, self.batch_dtype = config, data, codec, batch_dtype
        self.inner_optimizer = config.inner_optimizer_config(embedding)
        self.topk = config.topk_warmup()  # the top-k of each step (gradient mode's warm-up)
        self.fingerprint_gradient = fingerprint_gradient
        self.redundancy = redundancy
        self.estimates: dict[str, Throughput] = {}  # by worker address
        self.current: dict[str, int] = {}  # each worker's share in the last round planned for it
        self.imbalanced = 0  # decisions in a row that found the shares imbalanced (balance.shares)
        self.plans: dict[int, Plan] = {}  # by round
        self._cut: dict[tuple[int, Plan], list[np.ndarray]] = {}  # the last rounds' rows, by position

    def work(self, step: int, slots: Sequence[WorkerSlot]) -> RoundWork:
        """Round ``step``'s work for ``slots``: their batches (by position among them: disjoint within a
        step) and every setting their orders carry."""
        cfg = self.config
        plan = self.plan(step, slots)
        # A stream lays each step out by the workers' rows and goes on from where it was when they change:
        # nothing skipped, nothing twice.
        self.data.set_layout(step * cfg.round_steps, self._layout(plan))
        batches = {slot.index: self.batch(step, position, slot.ranks) for position, slot in enumerate(slots)}
        # --overlap: announce each worker's next batch (the same workers assumed), and in local-SGD rounds its
        # next inner steps, so that it can compute the next round's contribution while this round's result
        # travels (worker.lookahead). The next round's shares are decided now, so that it sends what was
        # announced.
        next_batches, next_steps = {}, {}
        if cfg.overlap and step + 1 < cfg.steps:
            next_plan = self.plan(step + 1, slots)
            self.data.set_layout((step + 1) * cfg.round_steps, self._layout(next_plan))
            next_batches = {s.index: self.batch(step + 1, i, s.ranks) for i, s in enumerate(slots)}
            if cfg.takes_inner_steps:
                common, own = self._local_steps(step + 1, next_plan, slots)
                next_steps = {s.index: own.get(s.index, common) for s in slots}
        redundant = self._redundant(step, slots, batches)
        local_steps, own_steps = self._local_steps(step, plan, slots) if cfg.takes_inner_steps else (None, {})
        # A share above --batch-size per rank goes through in micro-batches of it: no forward larger than
        # the one the batch size was chosen for (and one micro-batch, the whole batch, up to it).
        micro = cfg.micro_batch_size or (cfg.batch_size if cfg.balance != "off" else 0)
        return RoundWork(
            step,
            self.topk.config_at(self.codec, step),
            batches,
            next_batches,
            local_steps,
            feedback_beta=cfg.feedback_beta,
            micro_batch_size=micro,
            sync_tolerance=cfg.sync_tolerance,
            compute_before_update=cfg.overlap,
            clip_grad_norm=0.0 if cfg.takes_inner_steps else cfg.clip_grad_norm,  # local steps clip every inner step
            slot_local_steps=own_steps,
            fingerprint_gradient=self.fingerprint_gradient,
            redundant=redundant,
            next_local_steps=next_steps,
            stream_buckets=cfg.stream_buckets,
            fingerprint_every=cfg.fingerprint_every,
        )

    def _local_steps(
        self, step: int, plan: Plan, slots: Sequence[WorkerSlot]
    ) -> tuple[LocalSteps, dict[int, LocalSteps]]:
        """Round ``step``'s inner steps in local-SGD rounds, and those of the slots whose own differ
        (``--balance steps``: a share of whole inner steps)."""
        cfg = self.config
        optimizer, lrs = self.inner_optimizer, cfg.inner_lrs(step)
        fragment = of_round(step, cfg.fragments)
        eager_lr = cfg.lr_at(step - 1) if cfg.eager and step > 0 else 0.0  # the update in flight's
        own_steps = {}
        if cfg.balance == "steps":
            for position, slot in enumerate(slots):
                h = plan.shares[position] // (cfg.batch_size * plan.ranks[position])
                # h steps over the round's schedule: the learning rates of H steps, spread (or repeated)
                own = tuple(lrs[k * cfg.round_steps // h] for k in range(h))
                own_steps[slot.index] = LocalSteps(h, optimizer, own, cfg.clip_grad_norm, fragment, eager_lr)
        return LocalSteps(cfg.round_steps, optimizer, lrs, cfg.clip_grad_norm, fragment, eager_lr), own_steps

    def _redundant(self, step: int, slots: Sequence[WorkerSlot], batches: dict[int, np.ndarray]) -> tuple[int, ...]:
        """A spot check by redundancy, if round ``step`` draws one: the workers given the same rows, else ``()``.

        The group (``decisions.redundancy_group``) is of workers with as many inner steps and ranks, of one
        node mode; each is given, per inner step, the first rows of the first one's, as many as the smallest
        share among them (``batches`` is changed to say so): no one gets more than its share, so no one is
        made slower. Rows the group's shares held beyond those are not trained this round."""
        every, secret = self.redundancy
        if not every:
            return ()
        cfg = self.config
        plan = self.plans[step]
        inner = {s.index: cfg.round_steps for s in slots}
        if cfg.local_sgd and cfg.balance == "steps":  # whole inner steps of the default rows per rank
            inner = {s.index: r // (cfg.batch_size * s.ranks) for s, r in zip(slots, plan.shares)}
        candidates = [(s.index, (inner[s.index], s.ranks, s.node_mode)) for s in slots]
        group, why = redundancy_group(step, candidates, every, secret)
        if group:
            log.debug("step %d: spot check by redundancy: %s", step, why)
            h = inner[group[0]]
            rows = min(batches[s].shape[0] // h for s in group)  # each a multiple of the (same) ranks
            first = batches[group[0]]
            per_step = first.shape[0] // h
            shared = np.concatenate([first[i * per_step : i * per_step + rows] for i in range(h)])
            for slot in group:
                batches[slot] = shared
        return group

    def plan(self, step: int, slots: Sequence[WorkerSlot]) -> Plan:
        """Round ``step``'s shares for ``slots``: as decided before for these workers (a retried round, or
        the round --overlap announced), else decided now (``balance.shares``)."""
        cfg = self.config
        workers = tuple(s.client.address for s in slots)
        ranks = tuple(s.ranks for s in slots)
        known = self.plans.get(step)
        if known is not None and (known.workers, known.ranks) == (workers, ranks):
            return known
        steps = cfg.balance == "steps"
        defaults = [cfg.batch_size * r * (cfg.round_steps if steps else 1) for r in ranks]
        if cfg.balance == "off":
            plan = Plan(workers, ranks, tuple(defaults))
        else:
            split, why = shares(
                [
                    Slot(
                        # whole inner steps (steps); rows for every rank (rows), a pipeline's whole batch (its
                        # micro-batch count, not known here, divides that)
                        cfg.batch_size * s.ranks if steps or s.node_mode == "pipeline" else s.ranks,
                        default,
                        self._rate(s.client.address),
                        self.current.get(s.client.address),
                    )
                    for s, default in zip(slots, defaults)
                ],
                self.imbalanced,
            )
            self.imbalanced = split.imbalanced
            plan = Plan(workers, ranks, split.rows)
            if any(self.current.get(w, d) != r for w, d, r in zip(workers, defaults, split.rows)):
                log.info("step %d: shares %s (%s)", step, ", ".join(map(str, split.rows)), why)
        self.current.update(zip(workers, plan.shares))
        self.plans[step] = plan
        for old in [s for s in self.plans if s <= step - KEEP_PLANS]:
            del self.plans[old]
        return plan

    def batch(self, step: int, slot: int, ranks: int = 1) -> np.ndarray:
        """The rows of the worker at position ``slot`` in round ``step``: H inner steps' rows stacked,
        (H * rows, T + 1), or in ``steps`` mode its run of the round's rows.

        Inner step h of round r draws the data's step r * H + h, so one inner step per round is exactly
        gradient mode's batch. Without a plan for the round (one not worked yet), the default share:
        ``batch_size`` rows per rank (``--batch-size`` is per GPU).
        """
        cfg, h = self.config, self.config.round_steps
        plan = self.plans.get(step)
        if plan is None or slot >= len(plan.shares):
            rows = [self.data.batch(step * h + i, slot, cfg.batch_size * ranks, cfg.sequence_length) for i in range(h)]
            return np.concatenate(rows).astype(self.batch_dtype)
        cut = self._round_rows(step, plan)
        if cfg.balance == "steps":
            start = sum(plan.shares[:slot])
            return np.concatenate(cut)[start : start + plan.shares[slot]].astype(self.batch_dtype)
        return cut[slot].astype(self.batch_dtype)

    def observe(self, work: RoundWork, round_: RoundOutcome) -> None:
        """What ``round_`` showed of each worker's throughput: the tokens it was sent over the seconds the
        coordinator waited for it (``balance.measure``). A round with a state push for a worker says
        nothing of its speed; one that failed, nothing at all; a straggler cut off, a bound."""
        if self.config.balance == "off":
            return
        for o in round_.outcomes:
            batch = work.batches.get(o.slot.index)
            if batch is None or o.pushes or o.first_push_bytes or (o.result is None and not o.straggler):
                continue
            key = o.slot.client.address
            tokens = batch.shape[0] * (batch.shape[1] - 1)
            estimate = measure(self.estimates.get(key), tokens, o.seconds, finished=o.result is not None)
            if estimate is not None:
                self.estimates[key] = estimate

    def record(self, work: RoundWork) -> dict[str, Any]:
        """The round's rows for its metrics record: each worker's (by address), the least and the most,
        and the throughput estimates (tokens/s) they were decided from."""
        plan = self.plans.get(work.round)
        names = plan.workers if plan is not None else tuple(str(i) for i in work.batches)
        rows = {w: int(b.shape[0]) for w, b in zip(names, work.batches.values())}
        return {
            "rows_min": min(rows.values(), default=0),
            "rows_max": max(rows.values(), default=0),
            "worker_rows": rows,
            "worker_tokens_per_sec": {w: round(self.estimates[w].rate, 1) for w in names if w in self.estimates},
        }

    def state(self, step: int, workers: Sequence[str]) -> dict[str, Any]:
        """What a checkpoint at ``step`` keeps (JSON): the estimate and last share of each of ``workers``
        (addresses, in slot order), the imbalance count, and the plans of rounds from ``step`` on (--overlap
        decides one round ahead)."""
        return {
            "mode": self.config.balance,
            "workers": [
                [w, *((self.estimates[w].rate, self.estimates[w].samples) if w in self.estimates else (None, 0))]
                + [self.current.get(w)]
                for w in workers
            ],
            "imbalanced": self.imbalanced,
            "plans": [[s, list(p.workers), list(p.ranks), list(p.shares)] for s, p in self.plans.items() if s >= step],
        }

    def restore(self, state: Mapping[str, Any], workers: Sequence[str]) -> None:
        """What ``state`` kept, for ``workers`` (addresses, in slot order): a worker at a new address takes
        what the one that had its position had, if that one is not in the run any more (as
        ``checkpointer.RunCheckpointer.restore`` does with its state). Shares of another ``--balance``
        mode are left behind (they count other units); the estimates hold in any."""
        saved = [str(entry[0]) for entry in state.get("workers", [])]
        present = set(workers)
        renamed = {
            saved[i]: w for i, w in enumerate(workers[: len(saved)]) if w not in saved and saved[i] not in present
        }
        same_mode = state.get("mode") == self.config.balance
        for name, rate, samples, current in state.get("workers", []):
            name = renamed.get(str(name), str(name))
            if rate is not None:
                self.estimates[name] = Throughput(float(rate), int(samples))
            if current is not None and same_mode:
                self.current[name] = int(current)
        if same_mode:
            self.imbalanced = int(state.get("imbalanced", 0))
            for step, names, ranks, rows in state.get("plans", []):
                names = tuple(renamed.get(str(n), str(n)) for n in names)
                self.plans[int(step)] = Plan(names, tuple(int(r) for r in ranks), tuple(int(r) for r in rows))

    def _rate(self, worker: str) -> float | None:
        estimate = self.estimates.get(worker)
        return estimate.rate if estimate is not None and estimate.samples >= MIN_SAMPLES else None

    def _layout(self, plan: Plan) -> list[int]:
        """Rows per position of each of the round's data steps: the shares, or in ``steps`` mode (whose
        shares cut the round's rows, laid out by default) ``batch_size`` per rank."""
        if self.config.balance == "steps":
            return [self.config.batch_size * r for r in plan.ranks]
        return list(plan.shares)

    def _round_rows(self, step: int, plan: Plan) -> list[np.ndarray]:
        """Round ``step``'s rows, by position, its H data steps stacked, as laid out (``_layout``): cut once,
        step by step (a stream keeps only its last two steps: position by position, H > 2 would re-read it)."""
        key = (step, plan)
        if key not in self._cut:
            cfg, h = self.config, self.config.round_steps
            sizes = self._layout(plan)
            rows = [
                [self.data.batch(step * h + i, p, n, cfg.sequence_length) for p, n in enumerate(sizes)]
                for i in range(h)
            ]
            self._cut = {k: v for k, v in self._cut.items() if k[0] >= step - 1}  # this round, the one before
            self._cut[key] = [np.concatenate([rows[i][p] for i in range(h)]) for p in range(len(sizes))]
        return self._cut[key]
