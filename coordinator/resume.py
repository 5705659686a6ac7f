"""How a run comes back: the newest full checkpoint, then the update log's rounds after it.

``Resumption`` owns a run's update log (``durable.RunLog``) from start to end:

  begin     at start-up: a fresh run starts a new log; a resumed one restores the checkpoint (``--resume-from``,
            or ``auto``: the run in ``--output-dir`` if there is one) and picks the logged rounds after it that
            would rebuild the coordinator bit for bit (``durable.plan_replay``)
  settle    once the workers have said which replicas they hold: replay those rounds if every worker that
            sent the last one still holds its version (``durable.decide_replay``), else go on from the
            checkpoint, keeping the run's sessions for the workers whose replicas it can bring forward
  commit    each round stepped, with the coordinator's state after it (``state``) ...
  log       ... made durable after its metrics line and before the next round's orders carry its update
  compact   at each full checkpoint: the log keeps only the rounds the checkpoint does not hold

The trainer hands it the collaborators it reads and writes (the outer strategy, the checkpointer, the
gatherer's norms); what a resume changes of the trainer itself (its position and run id) comes back as a
``Resumed``. A gossip run's rounds are logged and replayed by its ``GossipLog``, which its trainer hands over
(``gossip``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from gradwire.compression import CompressedGradient
from gradwire.coordinator.checkpointer import RunCheckpointer, RunPosition, worker_key
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.durable import (
    RoundState,
    RunLog,
    decide_replay,
    last_state,
    log_path,
    plan_gossip_replay,
    plan_replay,
    read_records,
    replay,
    resume_root,
    rng_state,
    set_rng_state,
)
from gradwire.coordinator.gather import Gatherer
from gradwire.coordinator.gossip_log import ANCHOR, GossipLog, GossipRecord
from gradwire.coordinator.outer import OuterStrategy
from gradwire.coordinator.round import WorkerSlot
from gradwire.coordinator.rundir import resume_source
from gradwire.coordinator.updatelog import LogRecord
from gradwire.replica import StateUpdate

log = logging.getLogger("gradwire.coordinator")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What a resume changed of the run: the run id whose sessions the workers hold, and where a replay of the
    log left the run (``None``: where the checkpoint left it)."""

    run_id: str
    position: RunPosition | None = None


class Resumption:
    """A run's update log and its resume (see the module)."""

    def __init__(
        self,
        config: TrainConfig,
        checkpoint_dir: Path,
        outer: OuterStrategy,
        checkpoints: RunCheckpointer,
        gather: Gatherer,
    ) -> None:
        self.config, self.checkpoint_dir = config, checkpoint_dir
        self.outer, self.checkpoints, self.gather = outer, checkpoints, gather
        self.resuming = bool(config.resume_from)  # a path, or auto: the run here if there is one
        # Each round's update, durable before it goes out (coordinator.durable).
        self.runlog: RunLog | None = RunLog(checkpoint_dir)
        self.gossip: GossipLog | None = None  # a gossip run's rounds (set by its trainer before ``settle``)
        self._logged: tuple[LogRecord, ...] = ()  # rounds after the checkpoint resumed from (``begin``)
        # The last round stepped, not yet logged: its round, state and (where its update was made from them) the
        # contributions it was made from.
        self._committed: tuple[int, RoundState, StateUpdate | GossipRecord | None] | None = None
        self._logged_rng = b""  # the RNG state as the last record (or the checkpoint) left it

    def begin(self, slots: Sequence[WorkerSlot]) -> RunPosition:
        """Where the run starts: a fresh run at step 0 with a new log; a resumed one where its checkpoint left
        it, with the logged rounds after it set aside for ``settle``."""
        if not self.resuming:
            if self.runlog is not None:
                self.runlog.restart()  # a log no checkpoint of this run precedes belongs to no run
            return RunPosition()
        position = RunPosition()
        source = resume_source(self.config.resume_from, self.checkpoint_dir)
        if source is not None:
            position = self.checkpoints.restore(source, slots)
            self._logged_rng = rng_state()  # the checkpoint holds it
        self._plan(source or self.checkpoint_dir, position.step)  # no checkpoint yet: the log from the start
        return position

    def _plan(self, resume_from: Path, step: int) -> None:
        """The rounds the update log holds after the checkpoint just restored, where they would rebuild the
        coordinator bit for bit (``durable.plan_replay``)."""
        if self.runlog is None:
            return
        outer = self.outer
        records = read_records(log_path(resume_root(resume_from)), self.runlog.max_record_bytes)
        if self.config.gossip:
            self._logged, why = plan_gossip_replay(records, step)
        else:
            self._logged, why = plan_replay(records, step, outer.base_version, outer.pending is not None, outer)
        if records and not self._logged:
            log.warning("resuming from the checkpoint of step %d alone: %s", step, why)
        if not self._logged:
            self.runlog.restart()  # the rounds from the checkpoint on are trained anew

    def settle(self, slots: Sequence[WorkerSlot], step: int) -> Resumed | None:
        """Once the workers have said which replicas they hold: continue from the checkpoint by the logged
        rounds after it if every worker that sent the last one still holds its version. Then the run stands
        where it stood after its last logged round, its run id and its workers' sessions are the same, and
        each takes the next order by replay, its own error feedback untouched. Otherwise the run goes on from
        the checkpoint, as the run from there would (``_adopt_kept``). ``None``: nothing to resume."""
        logged, self._logged = self._logged, ()
        if not self.resuming or self.runlog is None:
            return None
        if not logged:
            return self._adopt_kept(slots, step)
        state = RoundState.from_bytes(logged[-1].coordinator_state)
        held = {worker_key(slot): slot.held.get(state.run_id) for slot in slots}
        use, why = decide_replay(state.versions, held)
        if not use:
            log.warning("resuming from the checkpoint of step %d, not the update log: %s", step, why)
            self.runlog.restart()
            return self._adopt_kept(slots, step)
        if self.config.gossip:
            assert self.gossip is not None, "a gossip run's trainer hands its GossipLog over before settle"
            gossip = [r.gossip for r in logged if r.gossip is not None]
            self.gossip.replay(gossip, self.outer.codec, anchored=logged[0].round < step)
            state = last_state(logged)
        else:
            state = replay(self.outer, logged)  # with the newest RNG the log holds
        restored = self.checkpoints.restore_position(state.meta, slots)
        self.gather.norms.clear()
        self.gather.norms.extend(state.norms)
        if state.rng:
            set_rng_state(state.rng)
        self._logged_rng = rng_state()
        for slot in slots:  # where each worker stands: at the logged version, or one on (it had the next order)
            slot.guess = slot.held.get(state.run_id) if restored[slot.index] in state.versions else None
        log.info(
            "resumed at step %d by replaying the update log (rounds %d..%d): %s",
            state.step,
            logged[0].round,
            logged[-1].round,
            why,
        )
        return Resumed(state.run_id, RunPosition(state.step, state.total_tokens))

    def _adopt_kept(self, slots: Sequence[WorkerSlot], step: int) -> Resumed | None:
        """A resume from the checkpoint alone: the workers that kept the run's replica at a version the
        coordinator can bring forward (the checkpoint's, or the one before the update it took last, which
        they catch up by) go on from it in the run's own sessions; the others get the state pushed."""
        run_id, outer = self.checkpoints.restored_run_id, self.outer
        if not run_id or not any(run_id in slot.held for slot in slots):
            return None  # nobody kept it (workers started afresh): a new run id, every worker pushed
        # One that took the pending update computed the next round (before it, under --overlap): it sends
        # that round's result again.
        usable = {outer.base_version, outer.target_version, *(v for v, _, _ in outer.history)}
        kept = 0
        for slot in slots:
            version = slot.held.get(run_id)
            slot.guess = version if version in usable else None
            kept += slot.guess is not None
        log.info("resumed at step %d from the checkpoint: %d of %d workers kept their replicas", step, kept, len(slots))
        return Resumed(run_id)

    def state(self, run_id: str, position: RunPosition, slots: Sequence[WorkerSlot]) -> RoundState:
        """The coordinator's state after the round just stepped: what its log record keeps besides the update."""
        senders, sent_in = self.outer.senders
        rng = rng_state()
        rng, self._logged_rng = (b"" if rng == self._logged_rng else rng), rng
        return RoundState(
            run_id,
            position.step,
            position.total_tokens,
            self.checkpoints.position_meta(position, slots),
            tuple(self.gather.norms),
            rng,
            senders,
            sent_in,
            {worker_key(slot): slot.version for slot in slots if slot.version is not None},
        )

    def receive(self, payload: CompressedGradient) -> None:
        """A sender's payload as it arrives, on its call's thread: written to the update log ahead of the round's
        record, which then costs only the rest (a failure is only logged: the record carries it then)."""
        if self.runlog is None or self.config.gossip:
            return
        try:
            self.runlog.receive(payload)
        except (OSError, RuntimeError) as e:
            log.warning("update log: a payload could not be written ahead of its record (%s)", e)

    def discard(self) -> None:
        """The round committed nothing: what was written ahead for it goes."""
        if self.runlog is not None:
            self.runlog.discard()

    def commit(self, round_: int, state: RoundState, contributions: StateUpdate | GossipRecord | None) -> None:
        """The round just stepped, to be logged once its metrics line is written (``log``): with the
        contributions its update was made from, or a gossip round's record."""
        self._committed = (round_, state, contributions)

    def log(self) -> None:
        """Make the round committed durable before the next round's orders carry its update: a restart
        resumes after it."""
        committed, self._committed = self._committed, None
        if committed is not None and self.runlog is not None:
            round_, state, contributions = committed
            if isinstance(contributions, GossipRecord):
                self.runlog.append_gossip(round_, self.outer.base_version, state, contributions)
            else:
                self.runlog.append(round_, self.outer, state, contributions)

    def compact(self, checkpoint: Path | None, step: int) -> None:
        """After a full checkpoint at ``step``: the log keeps only the rounds it does not hold."""
        if checkpoint is not None and self.runlog is not None:
            self.runlog.compact(step, keep=ANCHOR if self.config.gossip else 0)

    def close(self) -> None:
        if self.runlog is not None:
            self.runlog.close()
