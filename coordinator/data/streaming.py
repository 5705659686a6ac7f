"""Streaming training data (``--streaming``): batches cut in stream order from a corpus too large to hold.

``StreamingTokenSource`` reads the corpus in order and tokenizes it on the fly. The rows of ``(step, slot)``
are consecutive windows at a position computed from ``(step, slot)``, so they are the same on every run and
a resume needs only the step; the first tokens of the stream (or of the validation split) are held out.
``text_pieces`` reads text files in bounded memory for it. ``corpus.open_data`` builds one from ``--data``;
this module knows nothing of file or hub resolution, only of ``(text, ends_document)`` pieces.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradwire.coordinator.data.tokens import BLOCK_SPLIT, Encoder, val_windows

__all__ = ["StreamingTokenSource", "text_pieces"]

log = logging.getLogger(__name__)

_READ_CHARS = 1 << 20  # streamed text files are read this much at a time
_MAX_PENDING_CHARS = 1 << 24  # ... and cut without a blank line rather than hold more than this


def _last_block_start(text: str) -> int:
    last = 0
    for m in BLOCK_SPLIT.finditer(text):
        last = m.start()
    return last


def text_pieces(files: Sequence[Path]) -> Iterator[tuple[str, bool]]:
    """Each file as one document, read in pieces cut at blank lines (where BLOCK_SPLIT cuts too, so the ids
    are those of the whole file), in bounded memory whatever the file's size."""
    for path in files:
        try:
            with open(path, encoding="utf-8", newline="") as f:  # newline="": CRLF kept, as read_bytes does
                pending = ""
                while chunk := f.read(_READ_CHARS):
                    pending += chunk
                    cut = _last_block_start(pending)
                    if not cut and len(pending) >= _MAX_PENDING_CHARS:
                        cut = len(pending)  # no blank line in sight: cut anyway rather than grow
                    if cut:
                        yield pending[:cut], False
                        pending = pending[cut:]
                yield pending, True
        except UnicodeDecodeError as e:
            raise ValueError(f"--data file {str(path)!r} is not UTF-8 text: {e}") from None


def _head(chunks: Iterator[np.ndarray], n: int) -> tuple[np.ndarray, Iterator[np.ndarray]]:
    """The first ``n`` tokens of ``chunks`` (fewer if it ends first), and an iterator over the rest."""
    parts, have = [], 0
    for c in chunks:
        parts.append(c)
        have += len(c)
        if have >= n:
            break
    head = np.concatenate(parts) if parts else np.empty(0, np.int64)
    return head[:n], itertools.chain([head[n:]], chunks)


class _Cursor:
    """A forward-only window on an endless token stream: ``read(start, stop)`` by absolute position, keeping
    only the tokens from the last ``start`` on."""

    def __init__(self, chunks: Iterator[np.ndarray]) -> None:
        self._chunks = chunks
        self.base = 0  # absolute position of _buf[0]
        self._buf = np.empty(0, np.int64)

    def read(self, start: int, stop: int) -> np.ndarray:
        assert self.base <= start < stop
        while self.base + len(self._buf) <= start:  # skip whole chunks before start (a resume)
            self.base += len(self._buf)
            self._buf = next(self._chunks)
        self._buf = self._buf[start - self.base :]
        self.base = start
        parts, have = [self._buf], len(self._buf)
        while have < stop - start:
            parts.append(next(self._chunks))
            have += len(parts[-1])
        if len(parts) > 1:
            self._buf = np.concatenate(parts)
        return self._buf[: stop - start]


class StreamingTokenSource:
    """Batches cut in order from a token stream too large to hold (``--streaming``).

    The training stream is the corpus read in order, less the held-out head, repeated for as many epochs as
    training needs. Each step takes consecutive windows of ``seq_len + 1`` tokens (stride ``seq_len``, so
    every token is a target once), as many as its *layout* says: the rows of each slot, in slot order
    (``set_layout``; by default ``n_slots`` slots of the ``batch_size`` asked for). Slot ``i`` gets the
    windows after those of slots ``0..i-1``, and the next step starts where this one ended. When the
    workers change (one joins, one leaves, a node of more ranks takes more rows) the trainer sets the new
    layout from that step on: the stream goes on from where it was, so no window is trained twice or
    skipped. The layouts so far (``layouts``) are what a checkpoint keeps and a resume restores.

    The rows are thus a pure function of ``(step, slot)`` and the layouts: the same on every run, in any
    call order, from any thread. A step is cut once, when its first slot asks, and kept with the step
    before it, so the other slots and retries get the same rows without reading again.

    Resuming at step ``t`` needs nothing but ``t`` and the layouts: the first call reads (and tokenizes,
    unbatched) the stream up to step ``t``'s position, at the cost of one pass over that much text. Asking
    for a step before the last two cut re-reads the stream from its start. Memory holds about two steps of
    rows.

    Held out for validation: the first ``val_rows * (seq_len + 1)`` tokens of the validation split when the
    dataset has one, else of the stream itself (then never trained on, in any epoch).
    """

    def __init__(
        self,
        open_train: Callable[[], Iterable[tuple[str, bool]]],
        tokenizer: Any,
        *,
        seq_len: int,
        n_slots: int,
        val_rows: int = 64,
        open_val: Callable[[], Iterable[tuple[str, bool]]] | None = None,
        what: str = "--data",
    ) -> None:
        if seq_len < 1 or n_slots < 1 or val_rows < 1:
            raise ValueError(f"seq_len, n_slots and val_rows must be >= 1, got {seq_len}, {n_slots}, {val_rows}")
        self._open_train = open_train
        self._encoder = Encoder(tokenizer)
        self.n_slots = n_slots
        self.what = what
        self._dtype = self._encoder.dtype or np.dtype(np.int32)
        window = seq_len + 1
        n_val = val_rows * window
        first_pass = self._encoder.chunks(open_train())
        if open_val is None:
            val, first_pass = _head(first_pass, n_val)
            if len(val) < n_val:
                raise ValueError(
                    f"{what} ends after {len(val)} tokens: too few to hold out {val_rows} validation rows of "
                    f"{window} tokens and still train"
                )
            self._skip = n_val
        else:
            val, _ = _head(self._encoder.chunks(open_val()), n_val)
            if len(val) < window:
                raise ValueError(f"{what} validation split has {len(val)} tokens, fewer than one sequence of {window}")
            self._skip = 0
        self.val = val.astype(self._dtype)
        self.seq_len = seq_len
        self._lock = threading.Lock()
        # (first step, first token, rows per slot): from that step on, steps are laid out so; sorted
        self._layouts: list[tuple[int, int, tuple[int, ...]]] = []
        self._recent: collections.OrderedDict[tuple[int, tuple[int, ...]], np.ndarray] = collections.OrderedDict()
        self._cursor: _Cursor | None = _Cursor(self._train_chunks(first_pass))
        self._cursor.read(0, window)  # fails now, not at step 0, when there is nothing to train on

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def _train_chunks(self, first_pass: Iterator[np.ndarray] | None = None) -> Iterator[np.ndarray]:
        for epoch in itertools.count():
            if first_pass is not None:
                chunks, first_pass = first_pass, None
            else:
                chunks = self._encoder.chunks(self._open_train())
                if self._skip:
                    _, chunks = _head(chunks, self._skip)  # the held-out head, in every epoch
            if epoch:
                log.info("%s: epoch %d of the training stream", self.what, epoch)
            empty = True
            for c in chunks:
                if len(c):
                    empty = False
                    yield c
            if empty:
                raise ValueError(f"{self.what} has no training tokens after the {self._skip} held-out ones")

    def set_layout(self, step: int, rows: Sequence[int]) -> None:
        """From ``step`` on, each step takes ``rows[i]`` rows for slot ``i`` (until the next change). Steps
        before ``step`` keep their layout; a layout set earlier for ``step`` or later is replaced (a
        retried round, a resume)."""
        rows = tuple(int(r) for r in rows)
        if step < 0 or not rows or min(rows) < 1:
            raise ValueError(f"a layout needs step >= 0 and at least one slot of >= 1 rows, got step {step} and {rows}")
        with self._lock:
            kept = [seg for seg in self._layouts if seg[0] < step]
            if kept and kept[-1][2] == rows:
                self._layouts = kept
                return
            # The first layout of a run (or of a resume that kept none) covers the steps before it too.
            start = self._start(kept, step) if kept else step * sum(rows) * self.seq_len
            self._layouts = [*kept, (step, start, rows)]

    @property
    def layouts(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(first step, first token, rows per slot) of every layout so far: for a checkpoint."""
        with self._lock:
            return list(self._layouts)

    def restore_layouts(self, layouts: Sequence[Sequence[Any]]) -> None:
        """The layouts a checkpoint kept (``layouts``), checked."""
        restored = []
        for first, start, rows in layouts:
            rows = tuple(int(r) for r in rows)
            if (
                int(first) < 0
                or int(start) < 0
                or not rows
                or min(rows) < 1
                or (restored and int(first) <= restored[-1][0])
            ):
                raise ValueError(f"bad data layout in the checkpoint: {layouts!r}")
            restored.append((int(first), int(start), rows))
        with self._lock:
            self._layouts = restored
            self._recent.clear()

    def _layout(self, step: int) -> tuple[int, int, tuple[int, ...]] | None:
        for seg in reversed(self._layouts):
            if seg[0] <= step:
                return seg
        return None

    def _start(self, layouts: list[tuple[int, int, tuple[int, ...]]], step: int) -> int:
        first, start, rows = next(seg for seg in reversed(layouts) if seg[0] <= step)
        return start + (step - first) * sum(rows) * self.seq_len

    def batch(self, step: int, slot: int, batch_size: int, seq_len: int) -> np.ndarray:
        """Training rows (batch_size, seq_len + 1) of worker ``slot`` at ``step``; see the class docstring."""
        if batch_size < 1 or seq_len != self.seq_len:
            raise ValueError(
                f"batch_size must be >= 1 and seq_len {self.seq_len} (this stream's), got {batch_size} and {seq_len}"
            )
        with self._lock:  # the other slots of this step wait here, then find it cut
            seg = self._layout(step)
            if seg is None:  # no layout set: n_slots slots of batch_size rows from the start
                seg = (0, 0, (batch_size,) * self.n_slots)
            rows_per_slot = seg[2]
            if step < 0 or not 0 <= slot < len(rows_per_slot):
                raise ValueError(
                    f"step must be >= 0 and slot in [0, {len(rows_per_slot)}) (the step's layout), got {step} and "
                    f"{slot}"
                )
            if rows_per_slot[slot] != batch_size:
                raise ValueError(
                    f"slot {slot} of step {step} takes {rows_per_slot[slot]} rows in the layout, not {batch_size}"
                )
            key = (step, rows_per_slot)
            rows = self._recent.get(key)
            if rows is None:
                start = seg[1] + (step - seg[0]) * sum(rows_per_slot) * seq_len
                rows = self._cut(start, sum(rows_per_slot), seq_len, step)
                self._recent[key] = rows
                while len(self._recent) > 2:  # this step and the one before (for a late retry)
                    self._recent.popitem(last=False)
        offset = sum(rows_per_slot[:slot])
        return rows[offset : offset + batch_size].copy()

    def _cut(self, start: int, n_rows: int, seq_len: int, step: int) -> np.ndarray:
        if self._cursor is None or start < self._cursor.base:
            if self._cursor is not None:
                log.warning("%s: step %d was already passed; re-reading the stream from its start", self.what, step)
            self._cursor = _Cursor(self._train_chunks())
        try:
            tokens = self._cursor.read(start, start + n_rows * seq_len + 1)
        except BaseException:
            self._cursor = None  # a failed read leaves the stream's iterators unusable: start over next time
            raise
        rows = tokens[np.arange(n_rows)[:, None] * seq_len + np.arange(seq_len + 1)]  # (n_rows, T+1)
        return rows.astype(self._dtype)

    def val_batches(self, batch_size: int, seq_len: int, count: int) -> list[np.ndarray]:
        """``count`` batches (batch_size, seq_len + 1) of held-out tokens, the same on every call: windows
        evenly spaced over them (exactly tiling them when ``count * batch_size == val_rows``)."""
        return val_windows(self.val, batch_size, seq_len, count)
