"""A run made durable round by round: what the trainer appends to the update log, and what a resume replays.

After each round's outer step, before its update goes out with the next orders, the trainer appends the
round's record (``updatelog``): the update every replica replays, and the coordinator's own state after the
round as JSON (``RoundState``: where the data stands, the judge's memory, the balancing estimates, the RNG, the
senders of the update and the run's id). A full checkpoint at step s covers every round before s: the log
then drops those records (``compact``).

A resume (``plan_replay``, then ``replay``) loads the newest checkpoint and re-runs the outer step of each
logged round after it on what the round's senders sent: the replica takes every logged update but the last,
which stays pending with its senders, and the coordinator stands where it stood after its last committed
round, as if it had never stopped. Where the workers replay the senders' payloads those are the update
itself; where the update is made from them (a compressed downlink's one re-compressed aggregate,
``DeltaOuter``'s AdamW delta) the record holds them too, and the re-run rebuilds what the updates alone do
not hold: the downlink's error feedback, the optimizer's moments. Each re-run must give the logged update
bit for bit. The workers, if they kept their replicas (``decide_replay``), hold the version the last update
moves from, or the next, and go on from it: their own error feedback and inner state carry on untouched.
A gossip run's records move no replica: they hold its messages and bookkeeping (``gossip_log``), and its
resume takes the checkpoint's public copies on by them (``plan_gossip_replay``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from gradwire import protocol
from gradwire.compression import CompressedGradient, robust
from gradwire.coordinator import gossip_log
from gradwire.coordinator.checkpoint import META, write_durably
from gradwire.coordinator.gossip_log import GossipRecord
from gradwire.coordinator.outer import OuterStrategy, ReplayOuter
from gradwire.coordinator.updatelog import LOG_FILE, MAX_RECORD_BYTES, LogRecord, UpdateLog, read_log
from gradwire.replica import StateUpdate

log = logging.getLogger(__name__)

STATE_FORMAT = 1  # RoundState's JSON layout


@dataclasses.dataclass(frozen=True)
class RoundState:
    """The coordinator's own state after a round, besides the replica: a record's ``coordinator_state``."""

    run_id: str
    step: int  # the next round
    total_tokens: int
    meta: dict  # what a checkpoint's metadata keeps of the run's position (RunCheckpointer.position_meta)
    norms: tuple[float, ...]  # the gather stage's memory of typical norms
    rng: bytes  # torch's CPU generator, where it moved since the record before (b"": it did not, 10 KB saved)
    senders: tuple[int, ...]  # the slots whose payloads the update replays (each keeps its own)
    sent_in: int  # the round they sent them in
    versions: dict[str, int]  # by worker key: the version each worker holds once it has its last order's update

    def to_bytes(self) -> bytes:
        body = dataclasses.asdict(self) | {"format": STATE_FORMAT, "rng": self.rng.hex()}
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RoundState:
        try:
            body = json.loads(data)
            if body.pop("format") != STATE_FORMAT:
                raise ValueError("another format")
            body["rng"] = bytes.fromhex(body["rng"])
            body["norms"], body["senders"] = tuple(body["norms"]), tuple(body["senders"])
            return cls(**body)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"update log: a record's coordinator state does not read: {e}") from None


def rng_state() -> bytes:
    return torch.get_rng_state().numpy().tobytes()


def set_rng_state(data: bytes) -> None:
    torch.set_rng_state(torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()))


RUN_KEY_FILE = "run.key"  # the run's key (security.ClientSecurity.run_key), hex, readable by its owner alone


def load_run_key(checkpoint_dir: Path) -> bytes | None:
    """The run key a run kept in its checkpoint directory (None: it kept none): a coordinator restarted on the
    run is then the same owner to its workers, which kept its sessions."""
    path = checkpoint_dir / RUN_KEY_FILE
    if not path.is_file():
        return None
    try:
        key = bytes.fromhex(path.read_text(encoding="ascii").strip())
    except ValueError as e:
        raise ValueError(f"{path} holds no run key: {e}") from None
    if len(key) < 16:
        raise ValueError(f"{path} holds a run key of {len(key)} bytes, fewer than 16")
    return key


def save_run_key(checkpoint_dir: Path, key: bytes) -> None:
    """Keep ``key`` in ``checkpoint_dir`` (mode 0600, written whole or not at all)."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    write_durably(checkpoint_dir / RUN_KEY_FILE, key.hex() + "\n")


def log_path(checkpoint_dir: Path) -> Path:
    return checkpoint_dir / LOG_FILE


def resume_root(resume_from: Path) -> Path:
    """The checkpoint directory ``--resume-from`` names (itself, or the one holding the step it names)."""
    return resume_from.parent if (resume_from / META).is_file() else resume_from


def plan_replay(
    records: Sequence[LogRecord], step: int, version: int, pending: bool, outer: OuterStrategy
) -> tuple[tuple[LogRecord, ...], str]:
    """The records that continue ``outer``'s checkpoint of ``step`` at replica ``version`` (``pending``: it holds
    an update in flight, which comes first), and why; none (and why not) where they would not rebuild the
    coordinator bit for bit."""
    after = [r for r in records if r.round >= step]
    if not after:
        return (), f"no round after the checkpoint's step {step} is logged"
    if after[0].round != step:
        return (), f"the log's first round after the checkpoint is {after[0].round}, not {step}: it has a gap"
    start = version + int(pending)
    if after[0].from_version != start:
        return (), f"the log's round {step} moves from version {after[0].from_version}, the checkpoint leads to {start}"
    for r in after:
        if r.update is None:
            return (), f"round {r.round} moved no replica (a gossip run's log)"
        made = not RoundState.from_bytes(r.coordinator_state).senders or r.update.delta is not None
        if made and r.contributions is None:
            return (), f"round {r.round}'s update was made from contributions the log does not hold"
    return tuple(after), f"rounds {step}..{after[-1].round} replayed from the log"


def plan_gossip_replay(records: Sequence[LogRecord], step: int) -> tuple[tuple[LogRecord, ...], str]:
    """A gossip run's records that continue its checkpoint of ``step`` (none at step 0: the log from the
    start): the round before it, which the checkpoint holds already but whose bookkeeping it continues
    (``gossip_log.ANCHOR``), and every round after it, in order; none (and why not) where they would not."""
    first = max(0, step - gossip_log.ANCHOR)
    after = [r for r in records if r.round >= first]
    if not after or after[0].round != first:
        return (), f"the log does not hold round {first}, which the checkpoint of step {step} goes on from"
    for r, previous in zip(after[1:], after, strict=False):
        if r.round != previous.round + 1:
            return (), f"the log has a gap between rounds {previous.round} and {r.round}"
    if missing := [r.round for r in after if r.gossip is None]:
        return (), f"rounds {missing} are not gossip rounds"
    return tuple(after), f"gossip rounds {after[0].round}..{after[-1].round} replayed from the log"


def decide_replay(logged: Mapping[str, int], held: Mapping[str, int | None]) -> tuple[bool, str]:
    """Whether a resume replays the update log, given the version each worker held after the last logged round
    (``logged``, by worker key) and the one each worker of the resumed run holds now (``held``; None: none of
    the run): only if every worker the log names holds its version, or the next one (it had the next order,
    and its round: ``rounds.Rounds.again`` sends that result again), or is gone from the run. A worker that
    lost its replica would get the state pushed with the error feedback of the checkpoint, older than the
    log's rounds: the run would no longer be the run it was, so it goes on from the checkpoint instead.
    Under ``--overlap`` alike: a worker one on computed its next round before that update and applied the
    update after it; it sends that result again when its round is asked for at the version it holds."""
    lost = sorted(key for key, v in logged.items() if key in held and held[key] not in (v, v + 1))
    if lost:
        what = ", ".join(f"{k} holds {held[k] if held[k] is not None else 'no replica'}, not {logged[k]}" for k in lost)
        return False, f"workers named by the last logged round did not keep their replicas ({what})"
    if not any(key in held for key in logged):
        return False, "none of the workers named by the last logged round is in this run"
    return True, "every worker named by the last logged round kept its replica"


def replay(outer: OuterStrategy, records: Sequence[LogRecord]) -> RoundState:
    """Bring ``outer`` to where it stood after the last of ``records`` (``plan_replay``'s), by re-running each
    round's outer step on its contributions, in order, as the live rounds did: the replica takes every update
    but the last, which is pending with its senders, and what the updates alone do not hold (a compressed
    downlink's error feedback, a coordinator-side optimizer's moments) is rebuilt too. Each step must give
    the logged update bit for bit (a ``ValueError`` if not). Returns the last round's state."""
    for record in records:
        assert record.update is not None
        if outer.target_version != record.from_version:
            where = f"moves from version {record.from_version}, the coordinator stands at {outer.target_version}"
            raise ValueError(f"update log: round {record.round} {where}")
        state = RoundState.from_bytes(record.coordinator_state)
        made = record.contributions
        c = made if made is not None else record.update
        settings = c.payloads[0].settings if c.payloads else None  # the round's (a top-k warm-up's step)
        aggregator = robust.aggregate(outer.codec_of(c.fragment, settings), c.payloads, c.weights, c.scales, c.rule)
        outer.step(
            aggregator,
            c.payloads,
            c.weights,
            c.learning_rate,
            scales=c.scales,
            rule=c.rule,
            senders=state.senders,
            round=record.round,
            compressed=made is not None and isinstance(outer, ReplayOuter),
            fragment=c.fragment,
        )
        assert outer.pending is not None
        if protocol.update_to_bytes(outer.pending) != protocol.update_to_bytes(record.update):
            raise ValueError(f"update log: round {record.round}'s outer step does not give its logged update")
    return last_state(records)


def last_state(records: Sequence[LogRecord]) -> RoundState:
    """The coordinator's state after the last of ``records``, with the newest RNG state they hold (b"": the
    checkpoint's)."""
    states = (RoundState.from_bytes(r.coordinator_state) for r in reversed(records))
    rng = next((s.rng for s in states if s.rng), b"")
    return dataclasses.replace(RoundState.from_bytes(records[-1].coordinator_state), rng=rng)


class RunLog:
    """The update log of a run's checkpoint directory, for the trainer: append, compact, read back."""

    def __init__(self, checkpoint_dir: Path, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_path(checkpoint_dir)
        self.max_record_bytes = max_record_bytes
        self.log = UpdateLog(self.path, max_record_bytes=max_record_bytes)
        self.bytes_written = 0

    def append(
        self, round_: int, outer: OuterStrategy, state: RoundState, contributions: StateUpdate | None = None
    ) -> int:
        """The round's record: ``outer``'s pending update, from its base version, and the ``contributions`` it was
        made from where it is not them. Durable when this returns."""
        pending = outer.pending
        assert pending is not None
        record = LogRecord(
            round_, outer.base_version, outer.base_version + 1, pending, None, state.to_bytes(), contributions
        )
        written = self.log.append(record)
        self.bytes_written += written
        return written

    def receive(self, payload: CompressedGradient) -> None:
        """A sender's payload, written ahead of the round's record as it arrives (``UpdateLog.receive``)."""
        self.log.receive(payload)

    def discard(self) -> None:
        """The round commits nothing: cut what was written ahead for it."""
        self.log.discard()

    def append_gossip(self, round_: int, version: int, state: RoundState, gossip: GossipRecord) -> int:
        """A gossip round's record: it moves no replica (it stays at ``version``). Durable when this returns."""
        record = LogRecord(round_, version, version, None, None, state.to_bytes(), gossip=gossip)
        written = self.log.append(record)
        self.bytes_written += written
        return written

    def compact(self, step: int, keep: int = 0) -> None:
        """A full checkpoint at ``step`` holds every round before it; ``keep`` of those stay (a gossip run's
        ``gossip_log.ANCHOR``)."""
        self.log.compact(step - 1 - keep)

    def restart(self) -> None:
        """Forget every record: the run goes on from a checkpoint the log does not continue."""
        if self.log.last is not None:
            self.log.compact(self.log.last.round)

    def close(self) -> None:
        self.log.close()


def read_records(path: Path, max_record_bytes: int) -> list[LogRecord]:
    """The log's valid records (none if there is no log); a torn tail is said and left out."""
    if not path.is_file():
        return []
    reader = read_log(path, max_record_bytes=max_record_bytes)
    records = list(reader)
    if reader.torn:
        log.warning("%s", reader.describe())
    return records
