"""The coordinator's training loop: rounds, metrics, evaluation, checkpoints. It reads top to bottom.

One round:
  cut every worker's batch (H inner steps' worth in local-SGD rounds) -> dispatch the work orders, each
  carrying the last round's update, never the state (``round``) -> validate every payload and sum them in
  the coefficient domain -> the outer strategy turns the sum into the next update (``outer``) -> metrics.
A worker that fails, times out or sends a bad payload spoils its own contribution to one round, not the
run; a worker that lost track of the state gets it pushed and carries on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from gradwire.compression import PayloadError, robust
from gradwire.compression.codec import DecodedGradient
from gradwire.compression.robust import AggregationRule
from gradwire.coordinator.checkpoint import keep_last, load_checkpoint, save_checkpoint
from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.data import batch_dtype, open_data
from gradwire.coordinator.decisions import HARD_CLIP, Verdict, after_failed_round, judge, replay_precision
from gradwire.coordinator.export import export_model
from gradwire.coordinator.membership import MemberSource, diff_members
from gradwire.coordinator.metrics import MetricsLog, ProgressBar
from gradwire.coordinator.outer import Aggregate, make_outer
from gradwire.coordinator.round import RoundDispatcher, RoundOutcome, SlotOutcome, WorkerSlot
from gradwire.coordinator.rundir import claim, truncate_metrics
from gradwire.coordinator.status import StatusBoard, WorkerEvent
from gradwire.coordinator.tracking import make_tracker
from gradwire.models import lm_loss, load_tokenizer_arg, resolve_model, tokenizer_vocab_size, vocab_size_of
from gradwire.protocol import LocalSteps, ModelState, RoundResult, WorkOrder
from gradwire.replica import Fingerprint, Replica, StateUpdate

log = logging.getLogger("gradwire.coordinator")


def max_sequence_length(spec: dict) -> int | None:
    """The longest sequence a model spec can take, when its config says."""
    config = spec.get("config", {})
    for key in ("max_seq_len", "max_position_embeddings", "n_positions"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def worker_key(slot: WorkerSlot) -> str:
    """A worker's name in checkpoints: its address, as a tensor-group name (``w-127.0.0.1_50051``)."""
    return "w-" + re.sub(r"[^A-Za-z0-9_.-]", "_", slot.client.address)


@dataclasses.dataclass
class Gathered:
    """A round's usable contributions: their outcomes and results, combined, with their clip scales."""

    outcomes: list[SlotOutcome]
    results: list[RoundResult]
    aggregator: Aggregate
    scales: tuple[float, ...]
    rejected: int  # results refused this round (a bad payload, a false token count)


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        clients: Sequence[WorkerClient],
        *,
        progress: bool = True,
        members: MemberSource | None = None,
        connect: Callable[[str], WorkerClient] | None = None,
    ) -> None:
        """``members`` (with ``connect``, which makes a client for an address) re-reads the run's workers
        before every round: workers it adds join after a state push, workers it drops stop getting work."""
        if not clients:
            raise ValueError("--workers (or --local N) must name at least one worker")
        if members is not None and connect is None:
            raise ValueError("--workers-file and --listen need a client factory")
        self.members, self._connect = members, connect
        self.config = config
        # A resumed run takes its weights from the checkpoint: no need to load (or have) pretrained ones.
        resolved = resolve_model(
            config.model, from_scratch=config.from_scratch or bool(config.resume_from), seed=config.seed
        )
        self.spec = resolved.spec
        self.codec_config = config.codec_config()
        self.model = resolved.model
        self.outer = make_outer(self.model, config.update_rule(), self.codec_config, self.spec, config.seed)
        tokenizer_name = config.tokenizer or resolved.default_tokenizer
        if tokenizer_name is None:
            raise ValueError(
                f"--model {config.model} has no tokenizer of its own: pass --tokenizer (e.g. gpt2 for GPT-2-vocabulary models)"
            )
        self.tokenizer = load_tokenizer_arg(tokenizer_name)
        if tokenizer_vocab_size(self.tokenizer) > vocab_size_of(self.spec):
            raise ValueError(
                f"--tokenizer {tokenizer_name} has {tokenizer_vocab_size(self.tokenizer)} tokens; --model {config.model} embeds only {vocab_size_of(self.spec)}"
            )
        self.data = open_data(
            paths=config.data,
            tokenizer=self.tokenizer,
            seq_len=config.sequence_length,
            seed=config.seed,
            data_config=config.data_config,
            text_field=config.text_field,
            streaming=config.streaming,
            n_slots=len(clients),
            val_rows=config.eval_batches * config.batch_size,
        )
        self.batch_dtype = batch_dtype(vocab_size_of(self.spec))
        limit = max_sequence_length(self.spec)
        if limit is not None and config.sequence_length > limit:
            raise ValueError(
                f"--sequence-length {config.sequence_length} exceeds the {limit} positions of --model {config.model}"
            )
        self.slots = [WorkerSlot(i, c) for i, c in enumerate(clients)]
        self._next_index = len(self.slots)
        self._exact = False  # replays in float64 (decisions.replay_precision), as last decided
        # (round, slot indices): who sent the pending update's payloads, in order; each is sent the replay
        # without its own payload, which it holds
        self._pending_senders: tuple[int, list[int]] = (-1, [])
        self.run_id = uuid.uuid4().hex
        self.step = 0
        self.total_tokens = 0
        self.output_dir = Path(config.output_dir)
        self.checkpoint_dir = Path(config.checkpoint_dir) if config.checkpoint_dir else self.output_dir / "checkpoints"
        self.state_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.progress = progress
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="dispatch")  # threads start as needed
        self.outer.set_replay_window(config.replay_window)
        self.rounds = RoundDispatcher(
            self.outer,
            self._pool,
            timeout=config.round_timeout,
            state_bytes=self.state_bytes,
            quorum=config.min_workers,
            grace=config.grace(),
        )
        self._stop = threading.Event()
        self._norms: collections.deque[float] = collections.deque(maxlen=64)  # kept senders' (clipped) norms
        self.status: StatusBoard | None = None  # --status-port: what the status page shows
        self.interrupted = False  # run() stopped early on request_stop
        self.last_checkpoint: Path | None = None
        claim(self.output_dir, self.checkpoint_dir, resuming=bool(config.resume_from), overwrite=config.overwrite)
        if config.resume_from:
            self.resume(config.resume_from)

    # The outer strategy holds the workers' replica and the update in flight; these read through to it.
    @property
    def replica(self) -> Replica:
        return self.outer.replica

    @property
    def pending(self) -> StateUpdate | None:
        return self.outer.pending

    @property
    def base_version(self) -> int:
        return self.outer.base_version

    # ------------------------------------------------------------------------------------------ the loop

    def connect(self) -> None:
        """Describe every worker; a protocol mismatch or an unreachable worker stops here, clearly."""
        for slot in self.slots:
            slot.client.wait_ready(self.config.connect_timeout)
            info = slot.client.describe()
            slot.ranks, slot.device = info.ranks, info.device
            node = (
                f", a node of {info.ranks} ranks ({info.node_mode}: {', '.join(info.rank_devices)})"
                if info.ranks > 1
                else ""
            )
            log.info(
                "worker %d at %s: %s (%s), torch %s%s",
                slot.index,
                slot.client.address,
                info.device,
                info.device_name,
                info.torch_version,
                node,
            )

    def run(self) -> list[dict]:
        """Train from ``self.step`` to ``config.steps``; returns the metrics records of this call.

        After ``request_stop`` (SIGINT/SIGTERM in the CLI) the round in flight finishes, a checkpoint is
        written, the workers' sessions are closed and ``run`` returns with ``interrupted`` set.
        """
        self.connect()
        records = []
        if self.config.resume_from:
            dropped = truncate_metrics(self.output_dir, self.step)
            if dropped:
                log.info("resume at step %d: dropped %d metrics record(s) past it", self.step, dropped)
        log_path = MetricsLog(self.output_dir)
        bar = ProgressBar(self.config.steps, self.step, disable=not self.progress)
        tracker = make_tracker(self.config)  # None unless --wandb-project
        failed_in_a_row, failing_since, exit_code = 0, 0.0, 1
        try:
            while self.step < self.config.steps and not self._stop.is_set():
                record = self.train_step()
                if record is None:
                    failed_in_a_row += 1
                    failing_since = failing_since if failed_in_a_row > 1 else time.monotonic()
                    action, delay, reason = after_failed_round(
                        failed_in_a_row,
                        time.monotonic() - failing_since,
                        max_rounds=self.config.max_failed_rounds,
                        max_seconds=self.config.max_failed_seconds,
                    )
                    if action == "give-up":
                        raise RuntimeError(f"{reason}; see the log for each worker's error")
                    log.warning("step %d: %s", self.step, reason)
                    self._stop.wait(delay)
                    continue
                failed_in_a_row = 0
                if self.config.eval_every and self.step % self.config.eval_every == 0:
                    record["eval_loss"] = self.evaluate()
                    if self.status is not None:
                        self.status.held_out(self.step, record["eval_loss"])
                log_path.append(record)
                if tracker:
                    tracker.log(record, step=self.step)
                bar.update(record)
                records.append(record)
                every = self.config.checkpoint_every
                if every and self.step % every == 0 and self.step < self.config.steps and not self._stop.is_set():
                    self.save_checkpoint()
            if self._stop.is_set() and self.step < self.config.steps:
                self.last_checkpoint = self.save_checkpoint()
                self.close_sessions()
                self.interrupted = True
            else:
                self.last_checkpoint = self.save_checkpoint()
                self.save_final()
            exit_code = 0
        finally:
            if tracker:
                tracker.finish(exit_code=exit_code)
            bar.close()
            log_path.close()
        return records

    def request_stop(self) -> None:
        """Stop after the round in flight, with a checkpoint (safe to call from a signal handler)."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def close_sessions(self) -> None:
        """Ask every worker to drop this run's session (best effort: a worker that is gone has none)."""
        for slot in self.slots:
            try:
                slot.client.close_run(self.run_id, timeout=min(10.0, self.config.round_timeout))
            except WorkerError as e:
                log.info("worker %d: could not close the session: %s", slot.index, e)

    def train_step(self) -> dict | None:
        """One round. Returns its metrics, or None when no worker produced a usable contribution."""
        step = self.step
        t0 = time.perf_counter()
        lr = self.config.lr_at(step)
        local_steps = self._local_steps(step)
        self._update_members(step)

        def make_order(
            slot: WorkerSlot,
            base: int,
            update: StateUpdate | None,
            fingerprint: Fingerprint,
            catch_up: tuple[StateUpdate, ...],
        ) -> WorkOrder:
            cfg = self.config
            sent_in, senders = self._pending_senders
            if update is not None and update is self.outer.pending and update.delta is None and slot.index in senders:
                update = update.without(senders.index(slot.index), sent_in)  # it holds its own payload
            return WorkOrder(
                self.run_id,
                step,
                base,
                batches[slot.index],
                self.codec_config,
                fingerprint,
                update,
                feedback_beta=cfg.feedback_beta,
                micro_batch_size=cfg.micro_batch_size,
                sync_tolerance=cfg.sync_tolerance,
                local_steps=local_steps,
                catch_up=catch_up,
                compute_before_update=cfg.overlap,
                next_batch=next_batches.get(slot.index),
            )

        slots = [s for s in self.slots if not s.standing.benched(step)]
        if not slots:
            log.warning("step %d: every worker is benched; trying them all", step)
            slots = list(self.slots)
        plan = self.rounds.prepare(slots, step, self._state_for)  # less those getting the state meanwhile
        # Rows by position among the round's workers: disjoint within a step. A stream lays each step out
        # by the workers' rows and goes on from where it was when they change: nothing skipped, nothing twice.
        self.data.set_layout(
            step * self.config.inner_steps, [self.config.batch_size * slot.ranks for slot in plan.slots]
        )
        batches = {slot.index: self.round_batch(step, position, slot.ranks) for position, slot in enumerate(plan.slots)}
        # --overlap in gradient mode: announce each worker's next batch (the same workers assumed), so that
        # it can compute that gradient while this round's result travels (worker.lookahead).
        announce = self.config.overlap and not self.config.local_sgd and step + 1 < self.config.steps
        next_batches = (
            {slot.index: self.round_batch(step + 1, position, slot.ranks) for position, slot in enumerate(plan.slots)}
            if announce
            else {}
        )
        round_ = self.rounds.run(plan, step, make_order, self._state_for)
        t_gathered = time.perf_counter()
        rule = self._aggregation_rule()
        gathered = self._gather(round_, step, batches, rule)
        if gathered is None:
            self._report(round_, None)
            return None
        aggregator, usable, scales = gathered.aggregator, gathered.results, gathered.scales
        ranks = sum(o.slot.ranks for o in gathered.outcomes)
        payloads = tuple(r.gradient for r in usable)
        weights = tuple(float(r.tokens) for r in usable)
        grad_norm = self.outer.step(
            aggregator, payloads, weights, lr, scales=scales if any(x < 1 for x in scales) else (), rule=rule
        )
        self._pending_senders = (step, [o.slot.index for o in gathered.outcomes])  # in payload order
        self.step += 1
        t_done = time.perf_counter()
        record = self._record(round_, usable, ranks, grad_norm, lr, t0, t_gathered, t_done)
        record.update(
            clipped=sum(x < 1 for x in scales),
            rejected=gathered.rejected,
            benched=sum(s.standing.benched(self.step) for s in self.slots),
            catch_ups=sum(o.catch_ups for o in round_.outcomes),
            stragglers=sum(o.straggler for o in round_.outcomes),
        )
        self._report(round_, record, {id(o) for o in gathered.outcomes})
        return record

    def _report(self, round_: RoundOutcome, record: dict | None, counted: set[int] = frozenset()) -> None:
        """Tell the status board (``--status-port``) what the round did, worker by worker."""
        if self.status is None:
            return
        by_slot = {o.slot.index: o for o in round_.outcomes}
        events = []
        for slot in self.slots:
            o = by_slot.get(slot.index)
            if o is None:
                state = (
                    "benched"
                    if slot.standing.benched(self.step)
                    else "resyncing"
                    if slot.index in round_.joining
                    else "waiting"
                )
            elif o.straggler:
                state = "straggling"
            elif id(o) in counted:
                state = "resyncing" if o.pushes or o.catch_ups else "training"
            else:
                state = "failed"
            seconds = o.result.timings.get("total", 0.0) if o is not None and o.result is not None else 0.0
            events.append(
                WorkerEvent(
                    slot.index,
                    slot.client.address,
                    state,
                    slot.device,
                    slot.ranks,
                    seconds,
                    o.bytes_up if o else 0,
                    o.bytes_down + o.first_push_bytes if o else 0,
                    (o.error if o and state == "failed" else ""),
                )
            )
        self.status.update(record, events)

    def _update_members(self, step: int) -> None:
        """Apply a change of ``--workers-file``: drop the workers it no longer names, add the new ones
        (each after a short readiness check; one that is not ready yet is tried again next round)."""
        if self.members is None:
            return
        wanted = self.members.poll()
        if wanted is None:
            return
        joining, leaving = diff_members([s.client.address for s in self.slots], wanted)
        for slot in [s for s in self.slots if s.client.address in leaving]:
            if len(self.slots) == 1:
                log.warning("step %d: --workers-file drops the last worker (%s); keeping it", step, slot.client.address)
                break
            self.slots.remove(slot)
            slot.client.close()
            log.info("step %d: worker %d (%s) left the run", step, slot.index, slot.client.address)
        for address in joining:
            assert self._connect is not None
            client = self._connect(address)
            try:
                client.wait_ready(min(5.0, self.config.connect_timeout))
                info = client.describe()
            except WorkerError as e:
                log.warning("step %d: %s is not ready to join yet (%s); trying again next round", step, address, e)
                client.close()
                self.members.forget()
                continue
            slot = WorkerSlot(self._next_index, client, ranks=info.ranks, device=info.device)
            self._next_index += 1
            self.slots.append(slot)
            log.info(
                "step %d: worker %d (%s) joins the run (%s, %d rank(s))",
                step,
                slot.index,
                address,
                info.device,
                info.ranks,
            )

    def round_batch(self, step: int, slot: int, ranks: int = 1) -> np.ndarray:
        """A worker's rows for round ``step``: H inner steps' batches stacked, (H * ranks * batch_size, T + 1).

        Inner step h of round r draws the data's step r * H + h, so batches are a pure function of
        (round, inner step, slot), and one inner step per round is exactly gradient mode's batch. A node
        of several ranks gets ``batch_size`` rows per rank (``--batch-size`` is per GPU).
        """
        cfg, h = self.config, self.config.inner_steps
        rows = [self.data.batch(step * h + i, slot, cfg.batch_size * ranks, cfg.sequence_length) for i in range(h)]
        return np.concatenate(rows).astype(self.batch_dtype)

    def _local_steps(self, step: int) -> LocalSteps | None:
        cfg = self.config
        if not cfg.local_sgd:
            return None
        return LocalSteps(cfg.inner_steps, cfg.inner_optimizer_config(), cfg.inner_lrs(step), cfg.clip_grad_norm)

    def _gather(
        self, round_: RoundOutcome, step: int, batches: dict[int, np.ndarray], rule: AggregationRule
    ) -> Gathered | None:
        """Check every result (its token count against the batch it was sent, its payload against the
        plan), clip the good ones to the round's median norm and combine them by ``--aggregate``; judge
        each worker's standing (``decisions.judge``). ``None`` when no contribution is usable."""
        cfg = self.config
        good: list[SlotOutcome] = []
        decoded: list[DecodedGradient] = []
        verdicts: dict[int, Verdict] = {}
        for o in round_.outcomes:
            if o.result is None:
                log.warning("step %d: worker %d (%s) failed: %s", step, o.slot.index, o.slot.client.address, o.error)
                # Its version is unknown now; the next round asks (it may catch up by replay, not a push).
                # A straggler most likely applied the round's update before it was cut off.
                o.slot.guess = (
                    self.outer.target_version
                    if o.straggler
                    else o.slot.version
                    if o.slot.version is not None
                    else o.slot.guess
                )
                o.slot.version = None
                continue
            o.slot.version = o.result.version
            batch = batches[o.slot.index]
            expected = batch.shape[0] * (batch.shape[1] - 1)
            if o.result.tokens != expected:
                log.warning(
                    "step %d: worker %d reports %d tokens for a batch of %d; contribution ignored",
                    step,
                    o.slot.index,
                    o.result.tokens,
                    expected,
                )
                verdicts[o.slot.index] = "rejected"
                continue
            try:
                decoded.append(self.outer.codec.decode(o.result.gradient))  # validate before anything is combined
            except PayloadError as e:
                log.warning("step %d: worker %d sent a bad payload, ignored: %s", step, o.slot.index, e)
                verdicts[o.slot.index] = "rejected"
                continue
            good.append(o)
        # Clip to --clip-factor x the median norm; a sender that would keep less than HARD_CLIP of itself
        # (8x the median at the default factor) is no honest outlier: it is left out of this round.
        norms = [robust.payload_norm(d) for d in decoded]
        typical = statistics.median(self._norms) if self._norms else None  # of the senders kept in recent rounds
        scales = robust.clip_scales(norms, cfg.clip_factor, typical)
        kept = [i for i, scale in enumerate(scales) if scale >= HARD_CLIP]
        self._norms.extend(norms[i] * scales[i] for i in kept)
        for i, (o, scale) in enumerate(zip(good, scales)):
            verdicts[o.slot.index] = "ok" if scale >= HARD_CLIP else "rejected"
            if scale < HARD_CLIP:
                log.warning(
                    "step %d: worker %d sent %.3g x the bound of --clip-factor %g x the median norm; left out",
                    step,
                    o.slot.index,
                    1 / scale,
                    cfg.clip_factor,
                )
            elif scale < 1:
                log.info(
                    "step %d: worker %d clipped to %.3g of its norm (--clip-factor %g x the median)",
                    step,
                    o.slot.index,
                    scale,
                    cfg.clip_factor,
                )
        good, decoded, scales = [good[i] for i in kept], [decoded[i] for i in kept], tuple(scales[i] for i in kept)
        for slot in self.slots:
            if slot.index in verdicts:
                before = slot.standing
                slot.standing, reason = judge(
                    before, step, verdicts[slot.index], bench_after=cfg.bench_after, bench_rounds=cfg.bench_rounds
                )
                if slot.standing.until != before.until:
                    log.warning("step %d: worker %d (%s): %s", step, slot.index, slot.client.address, reason)
        rejected = sum(v == "rejected" for v in verdicts.values())
        if not good:
            return None
        weights = [float(o.result.tokens) for o in good]
        aggregator = robust.aggregate(self.outer.codec, decoded, weights, scales, rule)
        return Gathered(good, [o.result for o in good], aggregator, scales, rejected)

    def _record(
        self,
        round_: RoundOutcome,
        usable: list[RoundResult],
        ranks: int,
        grad_norm: float,
        lr: float,
        t0: float,
        t_gathered: float,
        t_done: float,
    ) -> dict:
        tokens = sum(r.tokens for r in usable)
        self.total_tokens += tokens
        payload_bytes = sum(r.gradient.nbytes for r in usable)
        bytes_up = sum(o.bytes_up for o in round_.outcomes)
        bytes_down = sum(o.bytes_down for o in round_.outcomes) + round_.push_bytes
        loss = sum(r.loss * r.tokens for r in usable) / tokens
        step_time = t_done - t0
        slowest = {
            key: max((r.timings.get(key, 0.0) for r in usable), default=0.0)
            for key in ("compute", "update", "compress")
        }
        return {
            "step": self.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "tokens_per_sec": tokens / step_time,
            "compression_ratio": 4 * self.outer.codec.plan.numel * len(usable) / max(1, payload_bytes),
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "step_time": step_time,
            "dispatch_time": t_gathered - t0,
            "aggregate_time": t_done - t_gathered,
            "successful_workers": len(usable),
            "total_tokens": self.total_tokens,
            "lr": lr,
            "pushes": round_.pushes,
            "ranks": ranks,
            "tokens_per_sec_per_worker": tokens / step_time / len(usable),
            "node_bus_bytes": sum(r.node_bytes for r in usable),
            "inner_steps": self.config.inner_steps,
            "inner_loss": loss,
            "bytes_up_per_token": bytes_up / tokens,
            "bytes_down_per_token": bytes_down / tokens,
            "worker_compute_time": slowest["compute"],
            "worker_update_time": slowest["update"],
            "worker_compress_time": slowest["compress"],
        }

    def _aggregation_rule(self) -> AggregationRule:
        """``--aggregate``, in the precision ``decisions.replay_precision`` picks for the workers present."""
        coordinator = next(iter(self.replica.params.values())).device.type
        exact, why = replay_precision(self.config.replay_precision, coordinator, [s.device for s in self.slots])
        if exact != self._exact:
            log.info("replays combine in %s: %s", "float64" if exact else "float32", why)
            self._exact = exact
        return self.config.aggregation_rule(exact)

    def _state_for(self, slot: WorkerSlot) -> ModelState:
        """The full state for a push to ``slot``, with what a resumed run restores on that worker."""
        return self.outer.model_state(self.run_id, self.spec, slot.feedback or {}, slot.inner_optimizer or {})

    def flush(self) -> None:
        """Apply the pending update to the coordinator's replica now (before a checkpoint or the end)."""
        self.outer.apply_pending()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss of the current model on the held-out batches (on the coordinator)."""
        self.flush()
        cfg = self.config
        was_training = self.model.training
        self.model.eval()
        try:
            batches = self.data.val_batches(cfg.batch_size, cfg.sequence_length, cfg.eval_batches)
            losses = [float(lm_loss(self.model, torch.from_numpy(b.astype("int64")))) for b in batches]
        finally:
            self.model.train(was_training)
        return sum(losses) / len(losses)

    # ------------------------------------------------------------------------------------------ persistence

    def save_checkpoint(self) -> Path:
        self.flush()
        tensors = {**self.outer.checkpoint(), "rng": {"torch": torch.get_rng_state()}}
        if self._norms:  # the clip's memory of typical norms: part of the trajectory too
            tensors["robust"] = {"norms": torch.tensor(list(self._norms), dtype=torch.float64)}
        # The workers' error feedback and inner optimizer state are part of the trajectory: without them a
        # resumed run would differ.
        futures = {worker_key(slot): self._pool.submit(self._fetch_worker_state, slot) for slot in self.slots}
        for key, future in futures.items():
            feedback, inner = future.result()
            if feedback is not None:
                tensors[f"feedback-{key}"] = feedback
            if inner:
                tensors[f"inner-{key}"] = inner
        meta = {
            "config": self.config.to_dict(),
            "version": self.replica.version,
            "total_tokens": self.total_tokens,
            "data_step": self.step,
            "workers": len(self.slots),
            "worker_keys": list(futures),
            "data_layouts": [[first, start, list(rows)] for first, start, rows in self.data.layouts],
        }
        path = save_checkpoint(self.checkpoint_dir, self.step, tensors, meta)
        if self.config.keep_checkpoints:
            keep_last(self.checkpoint_dir, self.config.keep_checkpoints)
        return path

    def _fetch_worker_state(
        self, slot: WorkerSlot
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        if slot.version is None:  # not pushed since a resume: what the checkpoint gave is still current
            return slot.feedback, slot.inner_optimizer
        try:
            state = slot.client.fetch_worker_state(self.run_id, timeout=self.config.round_timeout)
        except WorkerError as e:
            log.warning("checkpoint: no error feedback or inner optimizer state from worker %d: %s", slot.index, e)
            return None, None
        return state.feedback, state.inner_optimizer

    def resume(self, path: str) -> None:
        tensors, meta = load_checkpoint(path)
        saved = meta["config"]
        if saved["model"] != self.config.model:
            raise ValueError(f"--resume-from holds a {saved['model']} run, not --model {self.config.model}")
        self.outer.restore(tensors, meta["version"])
        self.step = int(meta["step"])
        self.total_tokens = int(meta.get("total_tokens", 0))
        torch.set_rng_state(tensors["rng"]["torch"])
        self._norms.extend(tensors.get("robust", {}).get("norms", torch.zeros(0)).tolist())
        if meta.get("data_layouts"):
            self.data.restore_layouts(meta["data_layouts"])  # where the stream stood, worker by worker
        saved_keys = meta.get("worker_keys", [])
        for position, slot in enumerate(self.slots):
            # A worker's state follows its address; a worker at a new address (fresh --local workers)
            # takes the state of the one that had its position.
            key = worker_key(slot)
            if f"feedback-{key}" not in tensors and f"inner-{key}" not in tensors and position < len(saved_keys):
                key = saved_keys[position]
            slot.feedback = tensors.get(f"feedback-{key}", tensors.get(f"feedback-{slot.index}"))
            slot.inner_optimizer = tensors.get(f"inner-{key}", tensors.get(f"inner-{slot.index}"))
            slot.version = None
        if meta.get("workers") != len(self.slots):
            log.warning(
                "resuming %d-worker checkpoint with %d workers: worker state restored by slot where it exists",
                meta.get("workers"),
                len(self.slots),
            )
        log.info("resumed from %s at step %d", path, self.step)

    def save_final(self) -> Path:
        """The trained model and its tokenizer in <output_dir>/final (``export.load_exported`` reads it)."""
        self.flush()
        return export_model(self.model, self.spec, self.output_dir / "final", tokenizer=self.tokenizer)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
