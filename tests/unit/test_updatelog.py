"""coordinator/updatelog.py: records with real compressed updates survive the log; a torn tail or a corrupt
record ends the valid prefix (and the writer cuts it off); a garbled length allocates nothing; compaction
keeps the records after a checkpoint's round, atomically."""

from __future__ import annotations

import logging
import os
import re
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from gradwire.compression import CodecConfig, CompressedGradient, GradientCodec, serde
from gradwire.compression.robust import AggregationRule
from gradwire.coordinator import updatelog
from gradwire.coordinator.updatelog import (
    FRAME_OVERHEAD,
    HEADER,
    LogFormatError,
    LogRecord,
    UpdateLog,
    frame,
    read_log,
    record_to_bytes,
)
from gradwire.replica import Fingerprint, StateUpdate

SHAPES = {"w": (32, 32), "b": (8,)}


@pytest.fixture(scope="module")
def payloads() -> tuple[CompressedGradient, ...]:
    gen = torch.Generator().manual_seed(0)
    codec = GradientCodec(SHAPES, CodecConfig(chunk=16, topk=8))
    return tuple(codec.compress({n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}) for _ in range(3))


def record(payloads: tuple[CompressedGradient, ...], i: int) -> LogRecord:
    """Round ``2 i + 1`` (rounds may skip), moving the replica from version i to i + 1; replays and deltas."""
    if i % 3 == 2:
        update = StateUpdate(0.5, delta=payloads[i % len(payloads)])
    else:
        rule = AggregationRule(mode="trimmed-mean", trim=0.25) if i % 3 else AggregationRule()
        update = StateUpdate(0.1 * (i + 1), payloads[:2], (3.0, 1.0 + i), scales=(1.0, 0.5), rule=rule)
    fingerprint = Fingerprint((float(i), -2.0), (3.0, 4.0 + i), (0.25, -0.5))
    return LogRecord(2 * i + 1, i, i + 1, update, fingerprint, coordinator_state=f"state {i}".encode())


def write(path: Path, payloads: tuple[CompressedGradient, ...], n: int) -> list[int]:
    """A log of ``n`` records; the byte offset each frame starts at."""
    starts = []
    with UpdateLog(path) as log:
        for i in range(n):
            starts.append(log.size)
            log.append(record(payloads, i))
    return starts


def read_all(path: Path, **kwargs: int) -> tuple[list[LogRecord], updatelog.LogReader]:
    reader = read_log(path, **kwargs)
    return list(reader), reader


def test_records_come_back_equal(tmp_path: Path, payloads: tuple[CompressedGradient, ...]) -> None:
    path = tmp_path / "updates.log"
    written = [record(payloads, i) for i in range(3)]
    gossip = LogRecord(7, 3, 3, None, None, b"")  # a round that moved no replica
    with UpdateLog(path) as log:
        sizes = [log.append(r) for r in (*written, gossip)]
        assert log.size == path.stat().st_size == len(HEADER) + sum(sizes)
    back, reader = read_all(path)
    assert back == [*written, gossip]
    for a, b in zip(written, back):
        mine = a.update.payloads or (a.update.delta,)
        theirs = b.update.payloads or (b.update.delta,)
        assert [serde.gradient_to_bytes(p) for p in mine] == [serde.gradient_to_bytes(p) for p in theirs]
        assert (b.from_version, b.to_version, b.fingerprint) == (a.from_version, a.to_version, a.fingerprint)
    assert (reader.records, reader.end, reader.size, reader.stop, reader.torn) == (4, log.size, log.size, None, False)
    # What a record costs on disk: its body and a fixed frame header; the body, its payloads and a little more.
    assert sizes[0] == FRAME_OVERHEAD + len(record_to_bytes(written[0]))
    assert written[0].update.nbytes < sizes[0] < 2 * written[0].update.nbytes + 200


def test_a_record_must_be_consistent() -> None:
    with pytest.raises(ValueError, match="to_version 5 must be from_version 3 \\+ 1"):
        LogRecord(1, 3, 5, StateUpdate(0.1, delta=None))
    with pytest.raises(ValueError, match="to_version 4 must be from_version 3 \\+ 0"):
        LogRecord(1, 3, 4, None)


def test_a_receivers_cut_update_is_refused(payloads: tuple[CompressedGradient, ...]) -> None:
    cut = StateUpdate(0.1, payloads[:2], (1.0, 1.0)).without(0, round=4)
    with pytest.raises(ValueError, match="own payload"):
        record_to_bytes(LogRecord(4, 0, 1, cut))


def test_append_refuses_a_record_that_does_not_follow(tmp_path: Path, payloads: tuple[CompressedGradient, ...]) -> None:
    path = tmp_path / "updates.log"
    write(path, payloads, 2)  # rounds 1 and 3, versions 0 -> 2
    with UpdateLog(path) as log:
        size = log.size
        with pytest.raises(ValueError, match="round 3 is not after the last record's 3"):
            log.append(LogRecord(3, 2, 2, None))
        with pytest.raises(ValueError, match="moves from version 5, the last record ended at 2"):
            log.append(LogRecord(9, 5, 5, None))
        assert path.stat().st_size == log.size == size
        log.append(LogRecord(9, 2, 2, None))
    assert [r.round for r in read_log(path)] == [1, 3, 9]


def test_the_log_refuses_a_record_over_its_limit(tmp_path: Path, payloads: tuple[CompressedGradient, ...]) -> None:
    with UpdateLog(tmp_path / "updates.log", max_record_bytes=100) as log:
        with pytest.raises(ValueError, match="over the 100-byte limit"):
            log.append(record(payloads, 0))
        assert log.size == len(HEADER)


def test_a_failed_append_is_cut_back(
    tmp_path: Path, payloads: tuple[CompressedGradient, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "updates.log"
    write(path, payloads, 1)
    real_fsync, failures = os.fsync, []

    def fsync(fd: int) -> None:  # fails while ``failures`` holds any left
        if failures:
            failures.pop()
            raise OSError("I/O error")
        real_fsync(fd)

    with UpdateLog(path) as log:
        size = log.size
        monkeypatch.setattr(updatelog.os, "fsync", fsync)
        failures[:] = [1]  # the append's fsync fails (the frame is written); cutting it back works
        with pytest.raises(OSError, match="I/O error"):
            log.append(record(payloads, 1))
        assert (log.size, path.stat().st_size, log.broken) == (size, size, None)
        failures[:] = [1, 2]  # the cut's fsync fails too: the log refuses to go on
        with pytest.raises(OSError, match="I/O error"):
            log.append(record(payloads, 1))
        assert "could not be cut back" in log.broken
        with pytest.raises(RuntimeError, match="open it again"):
            log.append(record(payloads, 1))
        monkeypatch.undo()
    with UpdateLog(path) as log:  # reopening reads the file through and cuts what the failed append left
        assert log.records == 1 and log.broken is None
        log.append(record(payloads, 1))
    assert list(read_log(path)) == [record(payloads, 0), record(payloads, 1)]


def _truncate_in_header(path: Path, last: int) -> None:
    os.truncate(path, last + 5)


def _truncate_in_body(path: Path, last: int) -> None:
    os.truncate(path, path.stat().st_size - 3)


def _flip_in_body(path: Path, last: int) -> None:
    data = bytearray(path.read_bytes())
    data[last + FRAME_OVERHEAD + 10] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "tear, why",
    [
        (_truncate_in_header, "frame header cut short \\(5 of 12 bytes\\)"),
        (_truncate_in_body, "record cut short"),
        (_flip_in_body, "CRC does not match"),
    ],
)
def test_a_torn_tail_is_dropped_and_the_writer_cuts_it(
    tmp_path: Path, payloads: tuple[CompressedGradient, ...], caplog: pytest.LogCaptureFixture, tear, why: str
) -> None:
    path = tmp_path / "updates.log"
    starts = write(path, payloads, 4)
    tear(path, starts[-1])
    back, reader = read_all(path)
    assert back == [record(payloads, i) for i in range(3)]
    assert (reader.records, reader.end, reader.torn) == (3, starts[-1], True)
    assert reader.stop is not None and re.search(why, reader.stop)

    with caplog.at_level(logging.WARNING, logger=updatelog.__name__), UpdateLog(path) as log:
        assert (log.records, log.size, path.stat().st_size) == (3, starts[-1], starts[-1])
        log.append(record(payloads, 3))
    assert f"at byte {starts[-1]}" in caplog.text and "cutting it there" in caplog.text
    back, reader = read_all(path)
    assert back == [record(payloads, i) for i in range(4)] and not reader.torn


def test_a_corrupt_middle_record_ends_what_is_trusted(tmp_path: Path, payloads: tuple[CompressedGradient, ...]) -> None:
    path = tmp_path / "updates.log"
    starts = write(path, payloads, 4)
    data = bytearray(path.read_bytes())
    data[starts[1] + FRAME_OVERHEAD + 3] ^= 0x01
    path.write_bytes(bytes(data))
    back, reader = read_all(path)
    assert back == [record(payloads, 0)]  # records 2 and 3 are intact but come after the break: not trusted
    assert (reader.records, reader.end, reader.size) == (1, starts[1], len(data))
    assert "CRC" in reader.stop
    assert f"at byte {starts[1]}" in reader.describe() and f"{len(data) - starts[1]} bytes" in reader.describe()


def test_an_absurd_length_is_refused_without_allocating(
    tmp_path: Path, payloads: tuple[CompressedGradient, ...]
) -> None:
    path = tmp_path / "updates.log"
    starts = write(path, payloads, 2)
    good = path.stat().st_size
    for length, why in [(2**40, "over the 1073741824-byte limit"), (2**29, "cut short")]:
        with open(path, "r+b") as f:
            f.truncate(good)
            f.seek(good)
            f.write(updatelog._FRAME.pack(length, 0) + b"x" * 100)
        tracemalloc.start()
        began = time.perf_counter()
        back, reader = read_all(path)
        took = time.perf_counter() - began
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert took < 1.0 and peak < 8 * 2**20, (took, peak)
        assert back == [record(payloads, 0), record(payloads, 1)] and reader.end == good
        assert why in reader.stop
    assert starts[0] == len(HEADER)


def test_a_body_that_is_no_record_ends_the_prefix(tmp_path: Path, payloads: tuple[CompressedGradient, ...]) -> None:
    path = tmp_path / "updates.log"
    write(path, payloads, 1)
    with open(path, "ab") as f:
        f.write(frame(b"\xff\xff not a protobuf"))  # its CRC is right: written so, not torn
    back, reader = read_all(path)
    assert len(back) == 1 and "does not decode" in reader.stop


def test_a_record_out_of_order_ends_the_prefix(tmp_path: Path, payloads: tuple[CompressedGradient, ...]) -> None:
    path = tmp_path / "updates.log"
    write(path, payloads, 2)
    with open(path, "ab") as f:
        f.write(frame(record_to_bytes(LogRecord(99, 7, 7, None))))
    back, reader = read_all(path)
    assert len(back) == 2 and "moves from version 7, the last record ended at 2" in reader.stop


def test_a_file_that_is_no_log_is_refused_untouched(tmp_path: Path) -> None:
    for name, data, why in [
        ("other", b"some other file's bytes", "is not an update log"),
        ("future", updatelog._HEADER.pack(updatelog.MAGIC, 2), "of format 2; this gradwire reads format 1"),
    ]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(LogFormatError, match=why):
            list(read_log(path))
        with pytest.raises(LogFormatError, match=why):
            UpdateLog(path)
        assert path.read_bytes() == data


def test_a_header_cut_short_is_written_again(tmp_path: Path, payloads: tuple[CompressedGradient, ...]) -> None:
    path = tmp_path / "updates.log"
    path.write_bytes(HEADER[:5])
    back, reader = read_all(path)
    assert back == [] and "file header cut short" in reader.stop
    with UpdateLog(path) as log:
        assert log.size == len(HEADER)
        log.append(record(payloads, 0))
    assert list(read_log(path)) == [record(payloads, 0)]


def test_compaction_keeps_the_records_after_the_round(tmp_path: Path, payloads: tuple[CompressedGradient, ...]) -> None:
    path = tmp_path / "updates.log"
    write(path, payloads, 5)  # rounds 1, 3, 5, 7, 9
    bodies = {r.round: record_to_bytes(r) for r in read_log(path)}
    with UpdateLog(path) as log:
        assert log.compact(keep_after_round=4) == 3
        assert (log.records, log.last.round, log.size) == (3, 9, path.stat().st_size)
        log.append(record(payloads, 5))  # follows the last kept record
    back = list(read_log(path))
    assert [r.round for r in back] == [5, 7, 9, 11]
    assert all(record_to_bytes(r) == bodies[r.round] for r in back[:3])  # copied, not re-encoded
    with UpdateLog(path) as log:
        assert log.compact(keep_after_round=11) == 0
        assert log.last is None
        log.append(LogRecord(12, 6, 6, None))  # anything may open a log
    assert [r.round for r in read_log(path)] == [12]
    assert [p.name for p in tmp_path.iterdir()] == ["updates.log"]


def test_a_compaction_cut_short_leaves_the_old_log(
    tmp_path: Path, payloads: tuple[CompressedGradient, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "updates.log"
    write(path, payloads, 3)
    before = path.read_bytes()
    # A crash between writing the temporary file and the rename leaves the temporary file behind.
    leftover = tmp_path / ".updates.log.compact-crashed"
    leftover.write_bytes(HEADER + b"half a frame")
    assert list(read_log(path)) == [record(payloads, i) for i in range(3)]
    with UpdateLog(path) as log:
        # A rename that fails: the old log stays whole, in place and writable; no temporary file stays.
        def refuse(*args: object) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(updatelog.os, "replace", refuse)
        with pytest.raises(OSError, match="disk full"):
            log.compact(keep_after_round=2)
        assert path.read_bytes() == before
        assert [p.name for p in tmp_path.iterdir()] == ["updates.log"]  # the crash's leftover went too
        log.append(record(payloads, 3))
        monkeypatch.undo()
        leftover.write_bytes(b"another crash")
        assert log.compact(keep_after_round=2) == 3
    assert [r.round for r in read_log(path)] == [3, 5, 7]
    assert [p.name for p in tmp_path.iterdir()] == ["updates.log"]


# ------------------------------------------------------------------------ payloads written ahead of a record


def extra_payload(seed: int) -> CompressedGradient:
    gen = torch.Generator().manual_seed(seed)
    codec = GradientCodec(SHAPES, CodecConfig(chunk=16, topk=8))
    return codec.compress({n: torch.randn(s, generator=gen) for n, s in SHAPES.items()})


def test_payloads_written_ahead_as_they_arrive_make_the_same_record(
    tmp_path: Path, payloads: tuple[CompressedGradient, ...]
) -> None:
    """Payloads received in another order than the update's, with one the round left out: the record reads back
    equal to the one written whole, names its payloads by position, and costs no second copy of them."""
    path = tmp_path / "updates.log"
    first, second = record(payloads, 0), record(payloads, 1)
    left_out = extra_payload(9)
    with UpdateLog(path) as log:
        whole = log.append(first)
        for p in (payloads[1], left_out, payloads[0]):  # arrival order, not the update's
            log.receive(p)
        ahead = log.append(second)
        assert log.size == path.stat().st_size == len(HEADER) + whole + ahead
    back, reader = read_all(path)
    assert back == [first, second] and not reader.torn
    assert [serde.gradient_to_bytes(p) for p in back[1].update.payloads] == [
        serde.gradient_to_bytes(p) for p in payloads[:2]
    ]
    # On disk: the payloads once each (the left-out one too), and the rest of the record naming two of them.
    body = path.read_bytes()[len(HEADER) + whole + FRAME_OVERHEAD :]
    msg = updatelog.log_pb2.LogRecord.FromString(body)
    assert list(msg.update_received) == [2, 0] and len(msg.received) == 3
    assert ahead < FRAME_OVERHEAD + len(record_to_bytes(second)) + left_out.nbytes + 100


def test_a_record_whose_payloads_were_not_all_received_carries_them(
    tmp_path: Path, payloads: tuple[CompressedGradient, ...]
) -> None:
    path = tmp_path / "updates.log"
    with UpdateLog(path) as log:
        log.receive(payloads[0])  # the update's second payload never came ahead
        log.append(record(payloads, 0))
    (back,), _ = read_all(path)
    assert back == record(payloads, 0)
    msg = updatelog.log_pb2.LogRecord.FromString(path.read_bytes()[len(HEADER) + FRAME_OVERHEAD :])
    assert not msg.update_received and len(msg.update.replay.payloads) == 2


@pytest.mark.parametrize("cut", ["before-any-payload", "mid-payload", "after-the-payloads", "before-the-header"])
def test_a_crash_before_the_record_commits_leaves_a_torn_tail_the_writer_cuts(
    tmp_path: Path, payloads: tuple[CompressedGradient, ...], cut: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed while payloads are written ahead (the frame's header still says no length), or after the rest was
    written but before the true header: the log reads up to the last committed record, and reopened, goes on
    after it."""
    path = tmp_path / "updates.log"
    log = UpdateLog(path)
    log.append(record(payloads, 0))
    committed = log.size
    log.receive(payloads[0])
    log.receive(payloads[1])
    written = path.read_bytes()
    image = {
        "before-any-payload": written[: committed + FRAME_OVERHEAD],
        "mid-payload": written[: committed + FRAME_OVERHEAD + 40],
        "after-the-payloads": written,
    }.get(cut)
    if image is None:  # the rest of the record on disk, its header not yet rewritten
        rest = record_to_bytes(record(payloads, 1), {id(payloads[0]): 0, id(payloads[1]): 1})
        image = written + rest
    log._file.close()  # the process dies: nothing more is written, nothing cut
    path.write_bytes(image)
    back, reader = read_all(path)
    assert back == [record(payloads, 0)] and reader.torn and reader.end == committed
    assert reader.stop == "a record whose payloads were written ahead, but which was never committed"
    with caplog.at_level(logging.WARNING, logger=updatelog.__name__), UpdateLog(path) as again:
        assert (again.records, again.size, path.stat().st_size) == (1, committed, committed)
        again.receive(payloads[1])
        again.receive(payloads[0])
        again.append(record(payloads, 1))
    assert "cutting it there" in caplog.text
    back, reader = read_all(path)
    assert back == [record(payloads, 0), record(payloads, 1)] and not reader.torn


def test_what_a_round_that_commits_nothing_received_is_cut(
    tmp_path: Path, payloads: tuple[CompressedGradient, ...]
) -> None:
    path = tmp_path / "updates.log"
    with UpdateLog(path) as log:
        log.append(record(payloads, 0))
        committed = log.size
        log.receive(payloads[0])
        assert path.stat().st_size > committed
        log.discard()  # the round failed
        assert path.stat().st_size == committed == log.size
        log.receive(payloads[2])  # and closed with a payload received: cut too
    assert path.stat().st_size == committed
    assert read_all(path)[1].torn is False
    with UpdateLog(path) as log:
        log.receive(payloads[0])
        assert log.compact(keep_after_round=1) == 0  # compaction cuts what was written ahead first
        assert path.stat().st_size == len(HEADER) == log.size
        log.append(record(payloads, 1))
    assert read_all(path)[0] == [record(payloads, 1)]


def test_a_record_that_names_a_payload_it_did_not_receive_ends_the_prefix(
    tmp_path: Path, payloads: tuple[CompressedGradient, ...]
) -> None:
    path = tmp_path / "updates.log"
    write(path, payloads, 1)
    good = path.stat().st_size
    rest = updatelog.log_pb2.LogRecord.FromString(record_to_bytes(record(payloads, 1)))
    del rest.update.replay.payloads[:]
    rest.update_received.extend([0, 3])  # one received payload, position 3 never was
    rest.received.append(serde.gradient_to_proto(payloads[0]))
    with open(path, "ab") as f:
        f.write(frame(rest.SerializeToString()))
    back, reader = read_all(path)
    assert len(back) == 1 and reader.end == good
    assert "names payloads it did not receive" in (reader.stop or "")
