"""The update log: every round the coordinator commits, made durable at the cost of its update's bytes.

Every replica advances only by replaying the rounds' updates, bit for bit, so the updates after a full
checkpoint are the run since it. The coordinator appends a round's record (proto ``gradwire.v1.LogRecord``:
round, versions, the update, the resulting fingerprint, its own state as opaque bytes) before the update goes
out to any worker; a restart loads the newest checkpoint and replays the records after it. A gossip round's
record moves no replica: it holds the round's messages and the coordinator's gossip bookkeeping instead
(``gossip_log``).

On disk, one file::

    header   8 bytes magic b"GWUPLOG\\0", then the format version (uint32, little endian)
    frame    body length (uint64 LE) | CRC-32 of the body (uint32 LE, zlib's) | body (a serialized LogRecord)
    frame    ...

A round's senders' payloads may go to the file as each arrives (``UpdateLog.receive``), ahead of the rest of its
record, and its writing to the disk started meanwhile: the frame's header holds a length no record has (``UNFINISHED``)
until the round commits (``append``), which writes the rest, then the true header, and syncs once. The body
parses as one record (``log.proto``); a crash before the true header leaves a torn tail, as one mid-append does.

A crash mid-append leaves a torn tail: a frame cut short, a CRC mismatch, or a body that is not a valid
record (nor is one that does not follow the record before it: rounds increase, versions chain). ``read_log``
stops at the first such frame (nothing after it is trusted) and says where and why; ``UpdateLog`` (the
writer) cuts the file back to that point when it opens, so new records follow the last good one. A length is
checked against ``max_record_bytes`` and the file's size before anything is read, so a garbled length never
allocates. ``UpdateLog.compact`` drops the records a full checkpoint covers, atomically.

Pure file I/O: the one writer per run directory is ``coordinator/runlock.py``'s business.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import tempfile
import threading
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from gradwire import protocol
from gradwire.compression import CompressedGradient
from gradwire.compression import serde as codec_serde
from gradwire.coordinator import gossip_log
from gradwire.coordinator.checkpoint import fsync_dir
from gradwire.coordinator.gossip_log import GossipRecord
from gradwire.replica import Fingerprint, StateUpdate
from gradwire.v1 import log_pb2

log = logging.getLogger(__name__)

LOG_FILE = "updates.log"  # its name in a run directory
MAGIC = b"GWUPLOG\x00"
LOG_FORMAT = 1  # the framing's version (the records' meaning is the proto's)
_HEADER = struct.Struct("<8sI")  # magic, format version
_FRAME = struct.Struct("<QI")  # body length, CRC-32 of the body
HEADER = _HEADER.pack(MAGIC, LOG_FORMAT)
FRAME_OVERHEAD = _FRAME.size  # bytes a record costs on disk besides its body
UNFINISHED = (1 << 64) - 1  # the length in a frame's header while its payloads are written ahead (none has it)
# A record holds one round's update, which a work order also carries, so --max-message-mb bounds it in a run;
# this default only keeps a garbled length from being believed.
MAX_RECORD_BYTES = 1 << 30


class LogFormatError(ValueError):
    """The file is not an update log this code reads (wrong magic or format version): refused, never cut."""


@dataclasses.dataclass(frozen=True)
class LogRecord:
    """One committed round: ``update`` moves every replica from ``from_version`` to ``to_version``."""

    round: int
    from_version: int
    to_version: int
    update: StateUpdate | None  # None: the round moved no replica (to_version == from_version)
    fingerprint: Fingerprint | None = None  # the replica's at to_version; None where not known at append time
    coordinator_state: bytes = b""  # the coordinator's own, opaque here
    contributions: StateUpdate | None = None  # the senders' payloads, where ``update`` is made from them
    gossip: GossipRecord | None = None  # a gossip round's messages and bookkeeping (``gossip_log``)

    def __post_init__(self) -> None:
        if self.round < 0 or self.from_version < 0:
            raise ValueError(f"log record: round {self.round} and from_version {self.from_version} must be >= 0")
        steps = int(self.update is not None)
        if self.to_version != self.from_version + steps:
            raise ValueError(
                f"log record of round {self.round}: to_version {self.to_version} must be from_version "
                f"{self.from_version} + {steps} ({'an' if steps else 'no'} update)"
            )


def record_to_bytes(r: LogRecord, received: Mapping[int, int] | None = None) -> bytes:
    """``r`` serialized; with ``received`` (a payload object's id: its position among the payloads written
    ahead, ``UpdateLog.receive``), an update or contributions whose payloads were all written ahead name them by
    position instead of carrying them again: the rest of a record whose frame those payloads began."""
    msg = log_pb2.LogRecord(
        round=r.round, from_version=r.from_version, to_version=r.to_version, coordinator_state=r.coordinator_state
    )
    if r.update is not None:
        if r.update.own is not None:  # a record is what every replica replays, never one receiver's cut
            raise ValueError(f"log record of round {r.round}: the update leaves a receiver's own payload out")
        _put_update(msg.update, msg.update_received, r.update, received or {})
    if r.fingerprint is not None:
        msg.fingerprint.CopyFrom(protocol.fingerprint_to_proto(r.fingerprint))
    if r.contributions is not None:
        _put_update(msg.contributions, msg.contributions_received, r.contributions, received or {})
    if r.gossip is not None:
        msg.gossip.CopyFrom(gossip_log.record_to_proto(r.gossip))
    return msg.SerializeToString()


def _put_update(field, positions, update: StateUpdate, received: Mapping[int, int]) -> None:  # noqa: ANN001
    """``update`` into the record's ``field``; its payloads by their ``positions`` where all were received (the
    rest of the update serialized without them: one weight a sender, as the wire always carries)."""
    found = [received.get(id(p)) for p in update.payloads]
    if found and None not in found:
        weights = update.weights or (1.0,) * len(update.payloads)
        field.CopyFrom(protocol.update_to_proto(dataclasses.replace(update, payloads=(), weights=weights)))
        positions.extend(found)
    else:
        field.CopyFrom(protocol.update_to_proto(update))


def _take_received(msg: log_pb2.LogRecord) -> None:
    """Put the payloads a record names by position back into its update and contributions (before either is
    validated, as an update off the wire is); ``ValueError`` for a position past what was received."""
    for field, positions, what in (
        (msg.update, msg.update_received, "update"),
        (msg.contributions, msg.contributions_received, "contributions"),
    ):
        if not positions:
            continue
        if any(i >= len(msg.received) for i in positions) or field.WhichOneof("kind") != "replay":
            raise ValueError(f"log record: its {what} names payloads it did not receive, or is no replay")
        if field.replay.payloads:
            raise ValueError(f"log record: its {what} carries payloads and names received ones too")
        field.replay.payloads.extend(msg.received[i] for i in positions)


def record_from_bytes(data: bytes) -> LogRecord:
    """The inverse of ``record_to_bytes``, validated as an update off the wire is (a ``ValueError`` if not)."""
    msg = protocol.parse(log_pb2.LogRecord, data)
    _take_received(msg)
    return LogRecord(
        round=msg.round,
        from_version=msg.from_version,
        to_version=msg.to_version,
        update=protocol.update_from_proto(msg.update) if msg.HasField("update") else None,
        fingerprint=protocol.fingerprint_from_proto(msg.fingerprint) if msg.HasField("fingerprint") else None,
        coordinator_state=msg.coordinator_state,
        contributions=protocol.update_from_proto(msg.contributions) if msg.HasField("contributions") else None,
        gossip=gossip_log.record_from_proto(msg.gossip) if msg.HasField("gossip") else None,
    )


def follows(last: LogRecord | None, record: LogRecord) -> str | None:
    """Why ``record`` cannot come after ``last`` in a log, or None when it can (anything can open a log)."""
    if last is None:
        return None
    if record.round <= last.round:
        return f"its round {record.round} is not after the last record's {last.round}"
    if record.from_version != last.to_version:
        return f"it moves from version {record.from_version}, the last record ended at {last.to_version}"
    return None


def frame(body: bytes) -> bytes:
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _header_problem(head: bytes, path: Path) -> str | None:
    """Why the log's valid prefix ends inside its header (a crash while creating it), or None when the header
    is whole; ``LogFormatError`` when the bytes are no log header at all."""
    if len(head) < _HEADER.size and HEADER.startswith(head):
        return f"a file header cut short ({len(head)} of {_HEADER.size} bytes)"
    magic, version = _HEADER.unpack(head[: _HEADER.size]) if len(head) >= _HEADER.size else (head, None)
    if magic != MAGIC:
        raise LogFormatError(f"{path} is not an update log (it does not start with {MAGIC!r})")
    if version != LOG_FORMAT:
        raise LogFormatError(f"{path} is an update log of format {version}; this gradwire reads format {LOG_FORMAT}")
    return None


class LogReader:
    """The records of a log in order, up to its first torn or corrupt frame (each iteration reads anew).

    While and after iterating: ``records`` valid records were read, the valid prefix ends at byte ``end``,
    the file held ``size`` bytes, and ``stop`` says why the prefix ends before the file does (None: it
    does not). ``LogFormatError`` when the file is no update log; a missing file is a ``FileNotFoundError``.
    """

    def __init__(self, path: Path | str, *, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self.path = Path(path)
        self.max_record_bytes = max_record_bytes
        self.records = 0
        self.end = 0
        self.size = 0
        self.stop: str | None = None
        self.last: LogRecord | None = None

    @property
    def torn(self) -> bool:
        return self.end < self.size

    def __iter__(self) -> Iterator[LogRecord]:
        for _, record in self.frames():
            yield record

    def frames(self) -> Iterator[tuple[bytes, LogRecord]]:
        """Each valid record with its body's bytes (what compaction copies as it is)."""
        self.records, self.end, self.size, self.stop, self.last = 0, 0, 0, None, None
        with open(self.path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self.stop = _header_problem(f.read(_HEADER.size), self.path)
            if self.stop is not None:
                return
            self.end = _HEADER.size
            while self.end < self.size:
                body, self.stop = self._next_body(f)
                if body is None:
                    return
                try:
                    record = record_from_bytes(body)
                except ValueError as e:  # ProtocolError, PayloadError
                    self.stop = f"a record that does not decode ({e})"
                    return
                why = follows(self.last, record)
                if why is not None:
                    self.stop = f"a record that does not follow the one before it: {why}"
                    return
                self.end += FRAME_OVERHEAD + len(body)
                self.records += 1
                self.last = record
                yield body, record

    def _next_body(self, f: BinaryIO) -> tuple[bytes | None, str | None]:
        """The body of the frame at ``self.end``, or None and why it is not a whole, intact frame."""
        left = self.size - self.end
        if left < FRAME_OVERHEAD:
            return None, f"a frame header cut short ({left} of {FRAME_OVERHEAD} bytes)"
        length, crc = _FRAME.unpack(f.read(FRAME_OVERHEAD))
        # Both checks before reading, so a garbled length allocates nothing.
        if length == UNFINISHED:
            return None, "a record whose payloads were written ahead, but which was never committed"
        if length > self.max_record_bytes:
            return None, f"a record length of {length} bytes, over the {self.max_record_bytes}-byte limit"
        if length > left - FRAME_OVERHEAD:
            return None, f"a record cut short ({left - FRAME_OVERHEAD} of its {length} bytes)"
        body = f.read(length)
        if len(body) != length:  # the file shrank under us
            return None, f"a record cut short ({len(body)} of its {length} bytes)"
        if zlib.crc32(body) != crc:
            return None, "a record whose CRC does not match its bytes"
        return body, None

    def describe(self) -> str:
        """Where and why the valid prefix ends, for a log line."""
        if not self.torn:
            return f"{self.path}: {self.records} records, {self.end} bytes, intact"
        return (
            f"{self.path}: {self.records} valid records, then at byte {self.end} {self.stop}; "
            f"{self.size - self.end} bytes from there on are not trusted"
        )


# Start writing a range of the file to the disk without waiting for it, or for a journal commit: the round's
# one fsync then finds it written, or on its way. POSIX_FADV_DONTNEED does so on Linux (the fallback PostgreSQL
# uses where sync_file_range is missing); elsewhere the fsync writes it all.
_START_WRITEBACK = getattr(os, "POSIX_FADV_DONTNEED", None) if hasattr(os, "posix_fadvise") else None


def _start_writeback(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, _START_WRITEBACK)  # type: ignore[arg-type]
    except OSError:  # the log was closed meanwhile, or the file system will not: the fsync writes it
        pass


@dataclasses.dataclass
class _Ahead:
    """A frame being written ahead of its record: where it starts, its body's bytes and CRC so far, and the
    payloads in it (by object id: position, the payload)."""

    start: int
    length: int = 0
    crc: int = 0
    received: dict[int, tuple[int, CompressedGradient]] = dataclasses.field(default_factory=dict)


def read_log(path: Path | str, *, max_record_bytes: int = MAX_RECORD_BYTES) -> LogReader:
    """The log at ``path`` to iterate: see ``LogReader``."""
    return LogReader(path, max_record_bytes=max_record_bytes)


def _open(path: Path) -> BinaryIO:
    # Unbuffered: what append wrote is in the file when fsync runs, and nothing is left to flush after a failure.
    return open(path, "r+b", buffering=0)


class UpdateLog:
    """A log open for appending. Opening it reads it through: a missing log is created, a torn tail is cut
    off (and logged), and appends follow the last good record. One writer per log (see runlock)."""

    def __init__(self, path: Path | str, *, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self.path = Path(path)
        self.max_record_bytes = max_record_bytes
        self._lock = threading.Lock()  # ``receive`` comes from the round's call threads, the rest from one
        self._ahead: _Ahead | None = None  # the frame whose payloads are being written ahead of its record
        self._flushing: ThreadPoolExecutor | None = None  # starts the disk writing payloads written ahead
        if not self.path.exists():
            self.path.touch(mode=0o600)  # a gossip run's records hold its peer key
            fsync_dir(self.path.parent)
        reader = read_log(self.path, max_record_bytes=max_record_bytes)
        for _ in reader:
            pass
        self.records, self.last = reader.records, reader.last
        self.broken: str | None = None  # set when a failed append could not be cut back: reopen the log
        self._file = _open(self.path)
        try:
            if reader.end < _HEADER.size:  # a new file, or one a crash left before its header was whole
                self._rewrite_from(0, HEADER)
            elif reader.torn:
                log.warning(
                    "update log %s; cutting it there, new records follow record %d", reader.describe(), reader.records
                )
                self._rewrite_from(reader.end, b"")
        except BaseException:
            self._file.close()
            raise
        self.end = self._file.seek(0, os.SEEK_END)

    def _rewrite_from(self, offset: int, data: bytes) -> None:
        """Cut the file at ``offset``, write ``data`` there, and make it durable."""
        self._file.truncate(offset)
        self._file.seek(offset)
        view = memoryview(data)
        while view:  # an unbuffered write may take less than it was given
            view = view[self._file.write(view) :]
        os.fsync(self._file.fileno())

    @property
    def size(self) -> int:
        """Bytes on disk: the header and every frame."""
        return self.end

    def receive(self, payload: CompressedGradient) -> None:
        """Write a sender's ``payload`` ahead of the record it will be part of, as it arrives, and start writing it
        to the disk meanwhile: the round's ``append`` then writes only the rest (``record_to_bytes`` names
        it by position). Safe from any thread. The frame's header says no length until that ``append``, so a
        crash before it leaves a torn tail; ``discard`` cuts what a round that commits nothing received."""
        body = log_pb2.LogRecord(received=[codec_serde.gradient_to_proto(payload)]).SerializeToString()
        with self._lock:
            if self.broken is not None:
                raise RuntimeError(f"update log {self.path}: {self.broken}; open it again to go on")
            ahead = self._ahead
            if ahead is not None and ahead.length + len(body) > self.max_record_bytes:
                return  # past what one record may hold: its record carries it instead, and refuses itself
            try:
                if ahead is None:
                    self._write_at(self.end, _FRAME.pack(UNFINISHED, 0))
                    ahead = self._ahead = _Ahead(self.end)
                self._write_at(ahead.start + FRAME_OVERHEAD + ahead.length, body)
            except BaseException:
                self._cut_back()
                raise
            offset = ahead.start + FRAME_OVERHEAD + ahead.length
            ahead.received[id(payload)] = (len(ahead.received), payload)  # kept: the id stays this payload's
            ahead.length += len(body)
            ahead.crc = zlib.crc32(body, ahead.crc)
            if _START_WRITEBACK is not None:
                if self._flushing is None:
                    self._flushing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwire-log")
                self._flushing.submit(_start_writeback, self._file.fileno(), offset, len(body))

    def discard(self) -> None:
        """Cut the payloads written ahead of a record that will not come (a round that committed nothing)."""
        with self._lock:
            if self._ahead is not None:
                self._cut_back()

    def append(self, record: LogRecord) -> int:
        """Write ``record`` and make it durable (flush, fsync) before returning its frame's size in bytes: after
        the payloads ``receive`` wrote ahead of it, which it names by position where its update's (or its
        contributions') are all among them. ``ValueError`` (nothing written) when it does not follow the last
        record or is over the limit; what fails while writing is raised with the frame cut off again (``broken``
        says when even that failed)."""
        if self.broken is not None:
            raise RuntimeError(f"update log {self.path}: {self.broken}; open it again to go on")
        why = follows(self.last, record)
        if why is not None:
            raise ValueError(f"update log {self.path}: cannot append round {record.round}: {why}")
        with self._lock:
            ahead = self._ahead
            rest = record_to_bytes(record, {k: i for k, (i, _) in ahead.received.items()} if ahead else None)
            length = len(rest) + (ahead.length if ahead is not None else 0)
            if length > self.max_record_bytes:
                self._cut_back()
                raise ValueError(
                    f"update log {self.path}: round {record.round}'s record is {length} bytes, over the "
                    f"{self.max_record_bytes}-byte limit"
                )
            try:
                if ahead is None:
                    self._rewrite_from(self.end, frame(rest))
                else:  # the rest, then the frame's true header: one fsync makes the whole frame durable
                    self._write_at(ahead.start + FRAME_OVERHEAD + ahead.length, rest)
                    self._write_at(ahead.start, _FRAME.pack(length, zlib.crc32(rest, ahead.crc)))
                    os.fsync(self._file.fileno())
            except BaseException:
                # A part of the frame may be on disk: cut it, so that the next append follows the last good record.
                self._cut_back()
                raise
            self._ahead = None
            self.end += FRAME_OVERHEAD + length
        self.records += 1
        self.last = record
        return FRAME_OVERHEAD + length

    def _write_at(self, offset: int, data: bytes) -> None:
        self._file.seek(offset)
        view = memoryview(data)
        while view:  # an unbuffered write may take less than it was given
            view = view[self._file.write(view) :]

    def _cut_back(self) -> None:
        """Cut the file back to the last good record (what was written ahead of a record, or a part of one)."""
        self._ahead = None
        try:
            self._rewrite_from(self.end, b"")
        except OSError as e:
            self.broken = f"a failed append could not be cut back to byte {self.end} ({e})"
            log.error("update log %s: %s", self.path, self.broken)

    def _settle_writebacks(self) -> None:
        """Wait for the writebacks started of payloads written ahead (before the file is closed or replaced)."""
        if self._flushing is not None:
            self._flushing.shutdown(wait=True)
            self._flushing = None

    def compact(self, keep_after_round: int) -> int:
        """Keep only the records of rounds after ``keep_after_round`` (a full checkpoint's); return how many.

        Atomic: the kept frames go to a temporary file in the log's directory, fsynced, renamed over the log,
        and the directory fsynced; a crash at any point leaves the old log or the new one whole. A temporary
        file an earlier crash left behind is removed first.
        """
        self.discard()  # payloads written ahead of a record that did not come
        self._settle_writebacks()
        for stale in self.path.parent.glob(f".{self.path.name}.compact-*"):
            log.info("update log %s: removing %s, left by an interrupted compaction", self.path, stale.name)
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.compact-")
        kept, last = 0, None
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(HEADER)
                reader = read_log(self.path, max_record_bytes=self.max_record_bytes)
                for body, record in reader.frames():
                    if record.round > keep_after_round:
                        out.write(frame(body))
                        kept, last = kept + 1, record
                if reader.end != self.end:  # the file changed under its one writer
                    raise RuntimeError(f"update log {self.path} reads valid to byte {reader.end}, not {self.end}")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(self.path.parent)
        dropped = self.records - kept
        self._file.close()
        self._file = _open(self.path)
        self.end = self._file.seek(0, os.SEEK_END)
        self.records, self.last, self.broken = kept, last, None  # the new file holds the valid prefix alone
        log.info(
            "update log %s: compacted after round %d, %d records dropped, %d kept",
            self.path,
            keep_after_round,
            dropped,
            kept,
        )
        return kept

    def close(self) -> None:
        """Close the log; payloads written ahead of a record that did not come are cut first."""
        if not self._file.closed:
            self.discard()
        self._settle_writebacks()
        self._file.close()

    def __enter__(self) -> UpdateLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
