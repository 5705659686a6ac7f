"""The in-memory corpus (``TokenStream``) and ``open_data``, which picks the ``TokenSource`` for ``--data``.

``TokenStream`` holds the whole tokenized corpus in memory (cached on disk as .npy). A training batch is a
function of ``(seed, step, slot)`` alone -- its window offsets come from ``np.random.default_rng([seed,
step, slot])`` -- so resuming needs only the step, and worker slot ``i`` at step ``t`` gets the same rows on
every run, whichever worker holds the slot. The last ``val_fraction`` of tokens (or the dataset's
validation split) is held out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gradwire.coordinator.data.sources import (
    Source,
    dataset_pieces,
    file_digest,
    load_hub,
    open_files,
    read_texts,
    resolve_source,
)
from gradwire.coordinator.data.streaming import StreamingTokenSource, text_pieces
from gradwire.coordinator.data.tokens import Encoder, batch_dtype, val_windows

__all__ = [
    "DataConfig",
    "StreamingTokenSource",
    "TokenSource",
    "TokenStream",
    "TokenizerLike",
    "batch_dtype",
    "cache_dir",
    "open_data",
    "read_texts",
    "tokenize_corpus",
]

log = logging.getLogger(__name__)

# Bump when the tokenization procedure (tokens.Encoder, tokenize_corpus) changes, so stale caches are not reused.
_CACHE_VERSION = 2
_MAX_VAL_TOKENS = 1 << 20  # a validation split is read up to here: ample for a held-out loss, bounded


class TokenizerLike(Protocol):
    """What the data needs from a tokenizer: ``encode(text)`` returning an object with ``.ids``
    (``tokenizers.Tokenizer``, ``ByteLevelBPETokenizer``) or a list of ids (``transformers`` tokenizers)."""

    def encode(self, text: str) -> Any: ...


@runtime_checkable
class TokenSource(Protocol):
    """What training draws from: ``TokenStream`` (in memory) and ``StreamingTokenSource`` (``--streaming``).

    ``batch`` is called from several threads at once, for the slots of one step, and again for a retried
    step; it returns the same rows for the same arguments every time, in every run.
    """

    @property
    def dtype(self) -> np.dtype: ...

    def batch(self, step: int, slot: int, batch_size: int, seq_len: int) -> np.ndarray: ...  # (B, T+1)

    def val_batches(self, batch_size: int, seq_len: int, count: int) -> list[np.ndarray]: ...

    # How a step's rows are laid out over the slots working it, from ``step`` on (a stream cuts them in
    # order and must know; windows drawn at random need not), what a checkpoint keeps, and restoring it.
    def set_layout(self, step: int, rows: Sequence[int]) -> None: ...

    @property
    def layouts(self) -> list[tuple[int, int, tuple[int, ...]]]: ...

    def restore_layouts(self, layouts: Sequence[Sequence[Any]]) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training text comes from and how batches are drawn.

    Attributes:
        paths: UTF-8 text files or directories (all ``*.txt`` inside, sorted); empty means the embedded
            Shakespeare corpus.
        seed: seeds every batch together with the step and the worker slot.
        val_fraction: share of tokens, taken from the end of the corpus, held out for validation (at
            least one sequence).
    """

    paths: tuple[str, ...] = ()
    seed: int = 0
    val_fraction: float = 0.005

    def __post_init__(self) -> None:
        if isinstance(self.paths, (str, bytes)) or not all(isinstance(p, str) and p for p in self.paths):
            raise ValueError(f"--data must be a list of non-empty paths, got {self.paths!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed must be an integer >= 0, got {self.seed!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction!r}")


def cache_dir() -> Path:
    """Where tokenized corpora are cached: ``$GRADWIRE_CACHE/tokens`` or ``~/.cache/gradwire/tokens``."""
    root = os.environ.get("GRADWIRE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "gradwire") / "tokens"


# --------------------------------------------------------------------------------------- the token cache


def _cache_key(fingerprint: str, parts: Iterable[bytes]) -> str:
    h = hashlib.sha256(f"gradwire-tokens-v{_CACHE_VERSION}\0".encode())
    h.update(hashlib.sha256(fingerprint.encode()).digest())
    for part in parts:
        # Length-prefixed, so moving bytes across a part boundary changes the key.
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _cache_load(path: Path, vocab: int) -> np.ndarray | None:
    try:
        ids = np.load(path, allow_pickle=False)
    except (FileNotFoundError, NotADirectoryError):  # a miss
        return None
    except Exception as e:  # noqa: BLE001 - a bad cache file must never stop training
        warnings.warn(f"ignoring unreadable token cache {path}: {e}", stacklevel=3)
        return None
    if ids.ndim != 1 or ids.dtype != batch_dtype(vocab) or (ids.size and int(ids.max()) >= vocab):
        warnings.warn(f"ignoring malformed token cache {path}", stacklevel=3)
        return None
    return ids


def _cache_store(path: Path, ids: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npy")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, ids, allow_pickle=False)
            # Readers only ever see a complete file: the temp file appears under its name atomically.
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except Exception as e:  # noqa: BLE001 - e.g. a read-only home: train uncached rather than fail
        warnings.warn(f"could not write token cache {path}: {e}", stacklevel=3)


def _through_cache(
    encoder: Encoder,
    cache: Path | None | bool,
    parts: Callable[[], Iterable[bytes]] | None,
    tokenize: Callable[[], np.ndarray],
) -> np.ndarray:
    """``tokenize()``, or its result stored under the key of the tokenizer and ``parts()`` (the source's
    identity; None: uncacheable). ``cache`` is True for ``cache_dir()``, a directory, or False/None."""
    fingerprint = encoder.fingerprint() if cache not in (False, None) and parts is not None else None
    if fingerprint is None or encoder.vocab is None or parts is None:
        return tokenize()
    path = (cache_dir() if cache is True else Path(cache)) / f"{_cache_key(fingerprint, parts())}.npy"
    ids = _cache_load(path, encoder.vocab)
    if ids is None:
        ids = tokenize()
        _cache_store(path, ids)
    return ids


# ------------------------------------------------------------------------------------------- text files


def _decode(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--data file {str(path)!r} is not UTF-8 text: {e}") from None


def _tokenize(tokenizer: Any, docs: list[tuple[Path, bytes]]) -> np.ndarray:
    encoder = Encoder(tokenizer)
    return encoder.concat(encoder.chunks((_decode(path, raw), True) for path, raw in docs))


def tokenize_corpus(
    paths: Sequence[str | Path], tokenizer: TokenizerLike, *, cache: Path | None | bool = True
) -> np.ndarray:
    """All documents of ``paths`` as one id array (uint16 or int32), through the on-disk cache.

    ``cache`` is True for ``cache_dir()``, a directory to use instead, or False/None to skip caching.
    """
    docs = read_texts(paths)
    return _through_cache(
        Encoder(tokenizer), cache, lambda: [b"text", *(raw for _, raw in docs)], lambda: _tokenize(tokenizer, docs)
    )


# -------------------------------------------------------------------------------------------- in memory


class TokenStream:
    """A tokenized corpus split into train and validation tokens, and the batches drawn from it.

    Build with ``open_data``, ``from_texts`` or ``from_config``; ``seq_len`` is the longest sequence that
    will be asked for: both splits must hold at least one such window. ``ids`` is the whole corpus, or only
    the training tokens when ``val_ids`` (a separate validation split) is given.
    """

    def __init__(
        self,
        ids: np.ndarray,
        *,
        seq_len: int,
        seed: int = 0,
        val_fraction: float = 0.005,
        val_ids: np.ndarray | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        DataConfig(seed=seed, val_fraction=val_fraction)  # same checks, same messages
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
        window = seq_len + 1
        if val_ids is not None:
            for name, split in (("training", ids), ("validation", val_ids)):
                if len(split) < window:
                    raise ValueError(
                        f"--data {name} split has {len(split)} tokens, fewer than one sequence of {window}; "
                        "give more text or a shorter sequence length"
                    )
            self.ids, self.n_train = ids, len(ids)
            self.train, self.val = ids, val_ids.astype(ids.dtype)
        else:
            n_val = max(window, int(round(len(ids) * val_fraction)))
            if len(ids) < n_val + window:
                raise ValueError(
                    f"--data corpus has {len(ids)} tokens, too few for one training and one validation sequence "
                    f"of {window} tokens; give more text or a shorter sequence length"
                )
            self.ids = ids
            self.n_train = len(ids) - n_val
            self.train = ids[: self.n_train]  # views, no copies
            self.val = ids[self.n_train :]
        self.seed = seed
        self.seq_len = seq_len

    @classmethod
    def from_texts(
        cls,
        paths: Sequence[str | Path],
        tokenizer: TokenizerLike,
        *,
        seq_len: int,
        seed: int = 0,
        val_fraction: float = 0.005,
        cache: Path | None | bool = True,
    ) -> TokenStream:
        """Tokenize ``paths`` (empty: the embedded corpus) with ``tokenizer``; see ``tokenize_corpus``."""
        ids = _non_empty(tokenize_corpus(paths, tokenizer, cache=cache))
        return cls(ids, seq_len=seq_len, seed=seed, val_fraction=val_fraction)

    @classmethod
    def from_config(
        cls, config: DataConfig, tokenizer: TokenizerLike, *, seq_len: int, cache: Path | None | bool = True
    ) -> TokenStream:
        return cls.from_texts(
            config.paths,
            tokenizer,
            seq_len=seq_len,
            seed=config.seed,
            val_fraction=config.val_fraction,
            cache=cache,
        )

    @property
    def dtype(self) -> np.dtype:
        return self.ids.dtype

    def batch(self, step: int, slot: int, batch_size: int, seq_len: int) -> np.ndarray:
        """Training rows (batch_size, seq_len + 1) for worker ``slot`` at ``step``: a pure function of
        (seed, step, slot), with window starts uniform over the training split."""
        if step < 0 or slot < 0:
            raise ValueError(f"step and slot must be >= 0, got {step} and {slot}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if seq_len + 1 > len(self.train):
            raise ValueError(f"seq_len {seq_len} does not fit the {len(self.train)}-token training split")
        rng = np.random.default_rng([self.seed, step, slot])
        # Windows end inside the training split, so no training row touches a validation token.
        offsets = rng.integers(0, self.n_train - seq_len, size=batch_size)  # (B,), high exclusive
        return self.train[offsets[:, None] + np.arange(seq_len + 1)]  # (B, T+1)

    def val_batches(self, batch_size: int, seq_len: int, count: int) -> list[np.ndarray]:
        """``count`` validation batches (batch_size, seq_len + 1), the same on every call: windows evenly
        spaced over the validation split (they overlap when the split is small)."""
        return val_windows(self.val, batch_size, seq_len, count)

    # Windows are drawn at random per (step, slot): no layout to follow or keep.
    def set_layout(self, step: int, rows: Sequence[int]) -> None:
        pass

    @property
    def layouts(self) -> list[tuple[int, int, tuple[int, ...]]]:
        return []

    def restore_layouts(self, layouts: Sequence[Sequence[Any]]) -> None:
        pass


def _non_empty(ids: np.ndarray) -> np.ndarray:
    if ids.size == 0:
        raise ValueError("--data corpus is empty: it tokenizes to no tokens")
    return ids


# ------------------------------------------------------------------------------------------- entry point


def open_data(
    *,
    paths: Sequence[str],
    tokenizer: Any,
    seq_len: int,
    seed: int = 0,
    data_config: str | None = None,
    text_field: str = "text",
    streaming: bool = False,
    val_fraction: float = 0.005,
    cache: Path | None | bool = True,
    n_slots: int = 1,
    val_rows: int = 64,
) -> TokenSource:
    """The training data named by ``--data`` and its flags, ready to draw batches from.

    ``paths``: empty for the embedded corpus; text files (or directories of ``*.txt``); jsonl/json/csv/parquet
    files (``.gz``/``.bz2``/``.xz``/``.zst`` too for json and csv) or directories of them, each row's
    ``text_field`` one document; or a single hub dataset name with its ``data_config`` (offline: from the
    local datasets cache only). In memory (a ``TokenStream``, batches drawn at random by ``seed``) unless
    ``streaming`` (a ``StreamingTokenSource``, batches in stream order; ``seed`` is not used).

    ``n_slots`` (the number of worker slots) and ``val_rows`` (held-out rows of ``seq_len + 1`` tokens) only
    matter for streams: the layout of a step in the stream depends on the one, the held-out head is the other.
    ``val_fraction`` only matters in memory, for sources without a validation split. ``cache`` is True for
    ``cache_dir()``, a directory, or False/None (in-memory token cache).
    """
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"--text-field must name a column, got {text_field!r}")
    names = paths if isinstance(paths, (str, bytes)) else tuple(os.fspath(p) for p in paths)
    DataConfig(paths=names, seed=seed, val_fraction=val_fraction)  # type: ignore[arg-type]  # same checks
    if seq_len < 1 or n_slots < 1 or val_rows < 1:
        raise ValueError(f"seq_len, n_slots and val_rows must be >= 1, got {seq_len}, {n_slots}, {val_rows}")
    source = resolve_source(names)
    if data_config is not None and source.kind != "hub":
        raise ValueError(f"--data-config {data_config!r} picks a hub dataset's configuration; --data is local files")
    if streaming:
        return _open_stream(
            source, tokenizer, data_config, text_field, seq_len=seq_len, n_slots=n_slots, val_rows=val_rows
        )
    if source.kind == "text":
        return TokenStream.from_texts(
            source.files, tokenizer, seq_len=seq_len, seed=seed, val_fraction=val_fraction, cache=cache
        )
    encoder = Encoder(tokenizer)
    if source.kind == "hub":
        train, val = load_hub(source.name, data_config, streaming=False)
        ident = [source.name, data_config or "", text_field]
        ids = _hub_split_ids(encoder, cache, train, ident, "train", None)
        val_ids = _hub_split_ids(encoder, cache, val, ident, "validation", _MAX_VAL_TOKENS) if val is not None else None
        return TokenStream(ids, seq_len=seq_len, seed=seed, val_fraction=val_fraction, val_ids=val_ids)
    ids = _through_cache(
        encoder,
        cache,
        lambda: [source.kind.encode(), text_field.encode(), *(file_digest(f) for f in source.files)],
        lambda: encoder.concat(encoder.chunks(dataset_pieces(open_files(source), text_field, source.describe()))),
    )
    return TokenStream(_non_empty(ids), seq_len=seq_len, seed=seed, val_fraction=val_fraction)


def _hub_split_ids(
    encoder: Encoder, cache: Path | None | bool, ds: Any, ident: list[str], split: str, limit: int | None
) -> np.ndarray:
    """The tokens of one split of a hub dataset (its first ``limit``), cached under datasets' fingerprint of
    the split's content."""
    what = f"--data {ident[0]!r} ({split})"
    fingerprint = getattr(ds, "_fingerprint", None)
    parts = None
    if isinstance(fingerprint, str):

        def parts() -> list[bytes]:
            return [s.encode() for s in ("hub", *ident, split, fingerprint, str(limit))]

    def tokenize() -> np.ndarray:
        return encoder.concat(encoder.chunks(dataset_pieces(ds, ident[2], what)), limit)

    return _non_empty(_through_cache(encoder, cache, parts, tokenize))


def _open_stream(
    source: Source,
    tokenizer: Any,
    data_config: str | None,
    text_field: str,
    *,
    seq_len: int,
    n_slots: int,
    val_rows: int,
) -> StreamingTokenSource:
    what = source.describe()
    open_val: Callable[[], Iterable[tuple[str, bool]]] | None = None
    if source.kind == "text":

        def open_train() -> Iterable[tuple[str, bool]]:
            return text_pieces(source.files)
    else:
        val = None
        if source.kind == "hub":
            train, val = load_hub(source.name, data_config, streaming=True)
        else:
            train = open_files(source)

        def open_train() -> Iterable[tuple[str, bool]]:
            return dataset_pieces(train, text_field, what)  # an IterableDataset starts over on each iteration

        if val is not None:

            def open_val() -> Iterable[tuple[str, bool]]:
                return dataset_pieces(val, text_field, f"{what} (validation)")

    return StreamingTokenSource(
        open_train, tokenizer, seq_len=seq_len, n_slots=n_slots, val_rows=val_rows, open_val=open_val, what=what
    )
