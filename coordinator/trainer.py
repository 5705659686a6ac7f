"""The coordinator's training loop. It only puts the run's components in order; each lives in its own module.

One round (``train_step``), in stages:
  plan: membership (``membership.Roster``) and the round's work, every worker's batch, H inner steps' worth
  in local-SGD rounds (``round.RoundWork``) -> dispatch: orders carrying the last round's update, never the
  state (``round.RoundDispatcher``), while the coordinator's own replica applies that update on its own
  thread (``advance``) -> judge: now and then a spot check of one sender (``spotcheck``), then validate,
  clip, agree, aggregate in the coefficient domain (``gather.Gatherer``) -> the outer step (``outer``) ->
  the metrics record (``metrics.round_record``) and the status page's rows (``status.worker_events``).
From a round's last result to the next round's orders, nothing grows with the model: the replica's apply,
its fingerprint, evaluations and checkpoints happen off that path, each waiting for the version it needs.
The run (``run``) repeats rounds, backs off after failed ones (``decisions.after_failed_round``),
evaluates, logs, and checkpoints (``checkpointer.RunCheckpointer``). A worker that fails, times out or
sends a bad payload spoils its own contribution to one round, not the run.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from gradwire.compression import CompressedGradient, GradientCodec
from gradwire.compression.fragment import Fragment, of_round
from gradwire.compression.robust import AggregationRule
from gradwire.compression.stream import StreamPlan
from gradwire.coordinator.checkpointer import RunCheckpointer, RunPosition
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.decisions import FailedRounds, decide_downlink, replay_precision
from gradwire.coordinator.export import export_model
from gradwire.coordinator.gather import Gathered, Gatherer
from gradwire.coordinator.inputs import load_inputs
from gradwire.coordinator.membership import MemberSource, Roster
from gradwire.coordinator.metrics import RunRecorder, progress, round_record
from gradwire.coordinator.outer import ReplayOuter, make_outer
from gradwire.coordinator.relay import Relay, held_piece
from gradwire.coordinator.resume import Resumed, Resumption
from gradwire.coordinator.round import RoundDispatcher, RoundOutcome, RoundPlan, RoundWork, WorkerSlot
from gradwire.coordinator.rundir import checkpoint_root, claim, truncate_metrics
from gradwire.coordinator.spotcheck import SpotChecks
from gradwire.coordinator.status import StatusBoard, worker_events
from gradwire.coordinator.tracking import make_tracker
from gradwire.coordinator.work import WorkPlanner
from gradwire.hardware import resolve_device
from gradwire.link import WorkerLink
from gradwire.models import lm_loss, token_embedding_names
from gradwire.replica import Replica, StateUpdate

log = logging.getLogger("gradwire.coordinator")


@dataclasses.dataclass(frozen=True)
class PlannedRound:
    """A round's plan (``Trainer._plan``): its index and learning rate, who works on which rows, and the codec
    of what it syncs."""

    step: int
    lr: float
    plan: RoundPlan
    work: RoundWork
    fragment: Fragment | None
    codec: GradientCodec


class Trainer:
    def __new__(cls, config: TrainConfig, *args: object, **kwargs: object) -> Trainer:
        """A gossip run's trainer (``--topology`` other than star) is a ``gossip_trainer.GossipTrainer``."""
        if cls is Trainer and config.gossip:
            from gradwire.coordinator.gossip_trainer import GossipTrainer  # it builds on this module

            cls = GossipTrainer
        return super().__new__(cls)

    def __init__(
        self,
        config: TrainConfig,
        clients: Sequence[WorkerLink],
        *,
        progress: bool = True,
        members: MemberSource | None = None,
        connect: Callable[[str], WorkerLink] | None = None,
    ) -> None:
        """``members`` (with ``connect``, which makes a link for an address) re-reads the run's workers
        before every round: workers it adds join after a state push, workers it drops stop getting work."""
        self.config = config
        self.roster = Roster(clients, source=members, connect=connect, connect_timeout=config.connect_timeout)
        inputs = load_inputs(config, len(clients))
        self.model, self.spec, self.tokenizer, self.data = inputs.model, inputs.spec, inputs.tokenizer, inputs.data
        # --device: the replica, its dense work and the spot checks' recomputes on a GPU when there is one.
        self.device = torch.device(resolve_device(config.device))
        self.model.to(self.device)
        log.info("the coordinator's replica is on %s (--device %s)", self.device, config.device)
        self.codec_config = config.codec_config()
        self.outer = make_outer(
            self.model,
            config.update_rule(token_embedding_names(self.model)),
            self.codec_config,
            self.spec,
            config.seed,
            config.downlink_codec_config(),
            config.fingerprint_every,
        )
        self.spot_checks = SpotChecks(config, self.spec, self.outer.replica)
        self.planner = WorkPlanner(
            config,
            self.data,
            self.codec_config,
            inputs.batch_dtype,
            fingerprint_gradient=self.spot_checks.fingerprint_gradient,
            redundancy=self.spot_checks.redundancy,
            embedding=token_embedding_names(self.model),
        )
        if self.planner.topk.steps:
            log.info("top-k warm-up: %s", self.planner.topk.why)
        self.outer.set_replay_window(config.replay_window)
        self.run_id = uuid.uuid4().hex
        self.state_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="dispatch")  # threads start as needed
        self._stream_plans: dict[GradientCodec, StreamPlan] = {}  # by codec (the run's, each fragment's)
        self.rounds = RoundDispatcher(
            self.outer,
            self._pool,
            run_id=self.run_id,
            spec=self.spec,
            timeout=config.round_timeout,
            state_bytes=self.state_bytes,
            quorum=config.min_workers,
            grace=config.grace(),
            gossip=config.gossip,
            relay=Relay(config.relay != "direct", config.relay_fanout, learn=config.relay == "auto"),
        )
        self.gather = Gatherer(
            self.outer.codec,
            clip_factor=config.clip_factor,
            bench_after=config.bench_after,
            bench_rounds=config.bench_rounds,
            agreement_floor=config.agreement_floor if config.agreement_floor >= -1 else None,
        )
        self.output_dir = Path(config.output_dir)
        self.checkpoint_dir = checkpoint_root(config.output_dir, config.checkpoint_dir)
        self.checkpoints = RunCheckpointer(
            self.checkpoint_dir, config, self.outer, self.data, self.gather, self._pool, self.run_id, self.planner
        )
        self.position = RunPosition()
        self.progress = progress
        self.status: StatusBoard | None = None  # --status-port: what the status page shows
        self.interrupted = False  # run() stopped early on request_stop
        self.last_checkpoint: Path | None = None
        self._stop = threading.Event()
        self._exact = False  # replays in float64 (decisions.replay_precision), as last decided
        self._compressed: bool | None = None  # one aggregate down (decisions.decide_downlink), as last decided
        self._closed_at: float | None = None  # when the last round closed (its last result in)
        self._busy_seen = 0.0  # the advancer's busy seconds at the last record
        self._turnaround_s: float | None = None  # the round in flight's (``_turnaround``)
        # Claimed before the update log opens: --overwrite removes the run there, its log included.
        claim(self.output_dir, self.checkpoint_dir, resuming=bool(config.resume_from), overwrite=config.overwrite)
        self.durable = Resumption(config, self.checkpoint_dir, self.outer, self.checkpoints, self.gather)
        self.rounds.on_payload = self.durable.receive  # each payload to the update log as it arrives
        self.position = self.durable.begin(self.slots)

    def _adopt(self, resumed: Resumed | None) -> None:
        """Go on as a resume left the run: in the run id whose sessions its workers hold, where its log's
        replay (if any) left it."""
        if resumed is None:
            return
        self.run_id = self.rounds.run_id = self.checkpoints.run_id = resumed.run_id
        if resumed.position is not None:
            self.position = resumed.position

    @property
    def step(self) -> int:
        return self.position.step

    @property
    def total_tokens(self) -> int:
        return self.position.total_tokens

    @property
    def slots(self) -> list[WorkerSlot]:
        return self.roster.slots

    # The outer strategy holds the workers' replica and the update in flight; these read through to it.
    @property
    def replica(self) -> Replica:
        """The coordinator's replica, once no update is being applied to it (``OuterStrategy.settle``)."""
        self.outer.settle()
        return self.outer.replica

    @property
    def pending(self) -> StateUpdate | None:
        return self.outer.pending

    @property
    def base_version(self) -> int:
        return self.outer.base_version

    # ------------------------------------------------------------------------------------------ the run

    def connect(self) -> None:
        """Describe every worker; a protocol mismatch or an unreachable worker stops here, clearly. A resumed
        run then knows which replicas its workers kept, and whether to replay its update log."""
        self.roster.describe_all()
        self._adopt(self.durable.settle(self.slots, self.step))

    def run(self) -> list[dict]:
        """Train from ``self.step`` to ``config.steps``; returns the metrics records of this call.

        After ``request_stop`` (SIGINT/SIGTERM in the CLI) the round in flight finishes, a checkpoint is
        written, the workers' sessions are closed and ``run`` returns with ``interrupted`` set.
        """
        cfg = self.config
        self.connect()
        if self.durable.resuming and (dropped := truncate_metrics(self.output_dir, self.step)):
            log.info("resume at step %d: dropped %d metrics record(s) past it", self.step, dropped)
        shown = progress(cfg.steps, self.step, enabled=self.progress, every=cfg.log_every)
        recorder = RunRecorder(self.output_dir, shown, make_tracker(cfg))  # a tracker with --wandb-project
        records: list[dict] = []
        failures, exit_code = FailedRounds(cfg.max_failed_rounds, cfg.max_failed_seconds), 1
        try:
            while self.step < cfg.steps and not self._stop.is_set():
                record = self.train_step()
                if record is None:
                    action, delay, reason = failures.failed(time.monotonic())
                    if action == "give-up":
                        raise RuntimeError(f"{reason}; see the log for each worker's error")
                    log.warning("step %d: %s", self.step, reason)
                    self._stop.wait(delay)
                    continue
                failures.succeeded()
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    record["eval_loss"] = self.evaluate()
                recorder.append(record)
                records.append(record)
                self.durable.log()  # durable before the next round's orders carry its update
                if not self._stop.is_set():
                    self.maybe_save_checkpoint()
            self.last_checkpoint = self.save_checkpoint()
            if self._stop.is_set() and self.step < cfg.steps:
                self.roster.close_sessions(self.run_id, timeout=min(10.0, cfg.round_timeout))
                self.interrupted = True
            else:
                self.save_final()
            exit_code = 0
        finally:
            recorder.close(exit_code)
        return records

    def request_stop(self) -> None:
        """Stop after the round in flight, with a checkpoint (safe to call from a signal handler)."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    # ------------------------------------------------------------------------------------------ one round

    def train_step(self) -> dict | None:
        """One round, as its stages: plan (who works on what), dispatch (orders out, results in; the replica
        follows on its own thread), judge (spot check; validate, clip, agree, aggregate in the coefficient
        domain), step (the outer step makes the next update), record. Returns the round's metrics, or None
        when no worker produced a usable contribution."""
        step, t0 = self.step, time.perf_counter()
        planned = self._plan(step)
        round_ = self._dispatch(planned)
        t_gathered = time.perf_counter()
        gathered, spot, rule = self._judge(planned, round_)
        if gathered.aggregator is None:
            self.durable.discard()  # what the update log took of the round's payloads: no record follows
            self._report(round_, None, gathered)
            return None
        grad_norm, compressed, contributions = self._outer_step(planned, gathered, rule)
        state = self.durable.state(self.run_id, self.position, self.slots)
        self.durable.commit(planned.step, state, contributions)  # logged after its metrics line
        record = self._record(planned, round_, gathered, grad_norm, compressed, (t0, t_gathered))
        if spot:
            record["spot_check"] = spot
        self._report(round_, record, gathered)
        return record

    def _plan(self, step: int) -> PlannedRound:
        """Membership, who works this round (not those getting the state in the background), each worker's
        rows, and the codec of what the round syncs (the model's, or a fragment's)."""
        self.roster.update(step)
        plan = self.rounds.prepare(self.roster.active(step), step)
        work = self.round_work(step, plan.slots)
        fragment = of_round(step, self.config.fragments)
        codec = self.outer.codec_of(fragment, work.codec)
        return PlannedRound(step, self.config.lr_at(step), plan, work, fragment, codec)

    def _dispatch(self, planned: PlannedRound) -> RoundOutcome:
        """Orders out, results in (``round.RoundDispatcher``); the workers' measured throughput feeds the
        next rounds' shares (--balance)."""
        self.durable.discard()  # payloads a round before took ahead of a record never logged
        if self.rounds.relay.enabled:  # a payload's digest is worth taking as it comes only for a replay
            self.rounds.relay.digest_payloads = not self._compressed_downlink_of(len(planned.plan.slots))
        round_ = self.rounds.run(planned.plan, planned.work, self._stream_plan(planned.codec))
        self._turnaround_s = self._turnaround(round_)
        self.planner.observe(planned.work, round_)
        return round_

    def _judge(self, planned: PlannedRound, round_: RoundOutcome) -> tuple[Gathered, dict, AggregationRule]:
        """Now and then a spot check of one sender (it waits for the replica at the round's version); then
        validate, clip, agree and aggregate what came in (``gather.Gatherer``): payload-sized work."""
        step, work = planned.step, planned.work
        rule = self._aggregation_rule()
        caught, spot = self.spot_checks(step, round_, work, self.outer.apply_pending)
        gathered = self.gather(round_, step, work.batches, rule, caught, work.redundant, planned.codec)
        self._log_fates(step, gathered)
        return gathered, spot, rule

    def _outer_step(
        self, planned: PlannedRound, gathered: Gathered, rule: AggregationRule
    ) -> tuple[float, bool, StateUpdate | None]:
        """The outer step: the round's aggregate becomes the next update (the senders' payloads, or one
        re-compressed aggregate); returns the aggregate's norm, whether the downlink is compressed, and where
        the update is made from the senders' payloads rather than being them, those payloads as a replay (what
        the update log keeps beside it)."""
        payloads = tuple(r.gradient for r in gathered.results if r.gradient is not None)
        compressed = self._compressed_downlink(payloads)
        scales = gathered.scales if any(x < 1 for x in gathered.scales) else ()
        grad_norm = self.outer.step(
            gathered.aggregator,
            payloads,
            gathered.weights,
            planned.lr,
            scales=scales,
            rule=rule,
            senders=gathered.senders,
            round=planned.step,
            compressed=compressed,
            fragment=planned.fragment,
        )
        self._hold_for_relay(gathered, compressed)
        contributions = None
        if compressed or (self.pending is not None and self.pending.delta is not None):
            contributions = StateUpdate(
                planned.lr, payloads, gathered.weights, scales=scales, rule=rule, fragment=planned.fragment
            )
        tokens = round(sum(gathered.weights))  # rows given to several workers (a spot check) count once
        self.position = RunPosition(planned.step + 1, self.total_tokens + tokens)
        if compressed and self.pending is not None:  # sent back as a worker's own, it is a copy
            self.gather.remember_sent(self.pending.payloads[0], planned.step)
        return grad_norm, compressed, contributions

    def _hold_for_relay(self, gathered: Gathered, compressed: bool) -> None:
        """--relay peers: what the pending update's orders may name instead of carrying (``coordinator.relay``):
        the senders' payloads, which they hold; or the compressed aggregate, which workers pass on."""
        relay, pending, version = self.rounds.relay, self.pending, self.outer.base_version
        if not relay.enabled or pending is None:
            relay.hold((), version)
        elif pending.delta is not None:  # adamw: one compressed delta, spread as an aggregate is
            relay.hold_aggregate(held_piece(pending.delta, ""), version)
        elif compressed:
            relay.hold_aggregate(held_piece(pending.payloads[0], ""), version)
        else:
            relay.hold([o.held for o in gathered.outcomes], version)

    def _record(
        self,
        planned: PlannedRound,
        round_: RoundOutcome,
        gathered: Gathered,
        grad_norm: float,
        compressed: bool,
        times: tuple[float, float],
    ) -> dict:
        """The round's metrics record (``metrics.round_record``) and what this loop adds to it."""
        record = round_record(
            self.step,
            round_,
            gathered,
            grad_norm=grad_norm,
            lr=planned.lr,
            times=(*times, time.perf_counter()),
            total_tokens=self.total_tokens,
            dense_bytes=4 * planned.codec.plan.numel,  # of what the round syncs: the model, or a fragment of it
            inner_steps=self.config.round_steps,
            benched=sum(s.standing.benched(self.step) for s in self.slots),
            clip_grad_norm=self.config.clip_grad_norm,  # local SGD: workers whose steps' mean norm exceeded it
        )
        record["downlink_compressed"] = int(compressed)
        # The coordinator's own share of the critical path: from the last round's last result to this round's
        # first order (None in a run's first round); and the seconds its replica advanced off that path.
        record["turnaround_s"] = self._turnaround_s
        record["background_s"] = self._background()
        record.update(self.planner.record(planned.work))  # each worker's rows, and the throughput they were sized to
        return record

    def _turnaround(self, round_: RoundOutcome) -> float | None:
        """Seconds from the last round's close to this round's first order (None: no last round, or no
        order went out); remembers this round's close for the next."""
        last, self._closed_at = self._closed_at, round_.closed_at
        if last is None or round_.first_order_at is None:
            return None
        return max(0.0, round_.first_order_at - last)

    def _background(self) -> float:
        """The seconds the replica's advancer worked since the last record."""
        busy = self.outer.advancer.busy_s
        since, self._busy_seen = busy - self._busy_seen, busy
        return since

    def _stream_plan(self, codec: GradientCodec) -> StreamPlan:
        """The buckets a round's results stream in (``--stream-buckets``; one, the whole payload, if off),
        for decoding each result as it arrives; one per codec (a fragment's), built once."""
        if codec not in self._stream_plans:
            self._stream_plans[codec] = StreamPlan(codec, max(1, self.config.stream_buckets))
        return self._stream_plans[codec]

    def round_work(self, step: int, slots: Sequence[WorkerSlot]) -> RoundWork:
        return self.planner.work(step, slots)

    def round_batch(self, step: int, slot: int, ranks: int = 1) -> np.ndarray:
        return self.planner.batch(step, slot, ranks)

    def _aggregation_rule(self) -> AggregationRule:
        """``--aggregate``, in the precision ``decisions.replay_precision`` picks for the workers present."""
        coordinator = self.device.type
        exact, why = replay_precision(self.config.replay_precision, coordinator, [s.device for s in self.slots])
        if exact != self._exact:
            log.info("replays combine in %s: %s", "float64" if exact else "float32", why)
            self._exact = exact
        return self.config.aggregation_rule(exact)

    def _compressed_downlink(self, payloads: Sequence[CompressedGradient]) -> bool:
        """Whether this round's update goes out as one re-compressed aggregate (``decisions.decide_downlink``;
        every payload of a codec has its plan's size). adamw's workers follow one compressed delta whatever
        this says."""
        if not isinstance(self.outer, ReplayOuter):
            return False
        compressed, why = self._downlink_decision(len(payloads))
        if compressed != self._compressed:
            log.info("downlink: %s", why)
            self._compressed = compressed
        return compressed

    def _downlink_decision(self, senders: int) -> tuple[bool, str]:
        payload_bytes = self.outer.codec.plan.payload_bytes()
        aggregate_bytes = self.outer.downlink_codec.plan.payload_bytes()
        cfg = self.config
        return decide_downlink(cfg.downlink, senders, payload_bytes, aggregate_bytes, cfg.fragments)

    def _compressed_downlink_of(self, senders: int) -> bool:
        """Whether a round of ``senders`` would send one compressed update (a delta, or the aggregate)."""
        return not isinstance(self.outer, ReplayOuter) or self._downlink_decision(senders)[0]

    def _log_fates(self, step: int, gathered: Gathered) -> None:
        for fate in gathered.fates:
            if fate.kind != "kept":
                level = logging.INFO if fate.kind == "clipped" else logging.WARNING
                log.log(level, "step %d: worker %d (%s) %s: %s", step, fate.slot, fate.address, fate.kind, fate.reason)
            if fate.benched:
                log.warning("step %d: worker %d (%s): %s", step, fate.slot, fate.address, fate.benched)

    def _report(self, round_: RoundOutcome, record: dict | None, gathered: Gathered) -> None:
        """Tell the status board (``--status-port``) what the round did, worker by worker."""
        if self.status is not None:
            reasons = {f.slot: f.reason for f in gathered.fates}
            self.status.update(record, worker_events(self.slots, round_, set(gathered.senders), self.step, reasons))

    # ------------------------------------------------------------------------------------------ the model

    def flush(self) -> None:
        """Apply the pending update to the coordinator's replica now (before an evaluation or the end);
        with --overlap, keeping the replica as it was for a checkpoint (``OuterStrategy.checkpoint_behind``)."""
        self.outer.apply_pending(keep_behind=self.config.overlap)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss of the current model on the held-out batches (on the coordinator)."""
        model, cfg = self.shown_model(), self.config
        was_training = model.training
        model.eval()
        try:
            batches = self.data.val_batches(cfg.batch_size, cfg.sequence_length, cfg.eval_batches)
            rows = (torch.from_numpy(b.astype("int64")).to(self.device) for b in batches)
            losses = [float(lm_loss(model, r)) for r in rows]
        finally:
            model.train(was_training)
        loss = sum(losses) / len(losses)
        if self.status is not None:
            self.status.held_out(self.step, loss)
        return loss

    def save_checkpoint(self) -> Path:
        path = self.checkpoints.save(self.position, self.slots)
        self._compact(path)
        return path

    def maybe_save_checkpoint(self) -> None:
        """A checkpoint every ``--checkpoint-every`` rounds (``checkpointer.RunCheckpointer.maybe_save``)."""
        self._compact(self.checkpoints.maybe_save(self.position, self.slots))

    def _compact(self, checkpoint: Path | None) -> None:
        """The update log keeps only the rounds a new checkpoint does not hold."""
        self.durable.compact(checkpoint, self.step)

    def shown_model(self) -> torch.nn.Module:
        """The model the run shows (evaluation, ``final/``): the coordinator's, with its pending update."""
        self.flush()
        return self.model

    def save_final(self) -> Path:
        """The trained model and its tokenizer in <output_dir>/final (``export.load_exported`` reads it)."""
        return export_model(self.shown_model(), self.spec, self.output_dir / "final", tokenizer=self.tokenizer)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.outer.close()
        self.durable.close()
