"""Training data as one stream of token ids, and deterministic, stateless batches drawn from it.

The corpus (the embedded Shakespeare by default, or the user's UTF-8 text files) is tokenized once, cached
on disk as .npy, and split: the last ``val_fraction`` of tokens is held out for validation. A training
batch is a function of ``(seed, step, slot)`` alone -- its window offsets come from
``np.random.default_rng([seed, step, slot])`` -- so resuming needs only the step, and worker slot ``i`` at
step ``t`` gets the same rows on every run, whichever worker holds the slot.

Rows are ``seq_len + 1`` tokens long: inputs are ``row[:-1]``, targets ``row[1:]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gradwire.assets import END_OF_TEXT, corpus_path

__all__ = ["DataConfig", "TokenStream", "TokenizerLike", "batch_dtype", "cache_dir", "read_texts", "tokenize_corpus"]

# Bump when the tokenization procedure below changes, so stale caches are not reused.
_CACHE_VERSION = 1

# Split documents into blocks at blank lines for encode_batch (parallel in Rust). The split falls before the
# last whitespace character of the run, where the byte-level pre-tokenizer splits anyway, so the ids are
# exactly those of encoding the whole document at once (LF and CRLF line ends).
_BLOCK_SPLIT = re.compile(r"(?<=\n)(?=\n\S)|(?<=\n\r)(?=\n\S)")


class _Encoding(Protocol):
    ids: list[int]


class TokenizerLike(Protocol):
    """What the data needs from a tokenizer: ``tokenizers.Tokenizer`` and ``ByteLevelBPETokenizer`` fit."""

    def encode(self, text: str) -> _Encoding: ...


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


def batch_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype holding every token id: uint16 up to 65536 tokens, else int32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def cache_dir() -> Path:
    """Where tokenized corpora are cached: ``$GRADWIRE_CACHE/tokens`` or ``~/.cache/gradwire/tokens``."""
    root = os.environ.get("GRADWIRE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "gradwire") / "tokens"


def _resolve_files(paths: Sequence[str | Path]) -> list[Path]:
    if not paths:
        return [corpus_path()]
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.glob("*.txt") if p.is_file())
            if not found:
                raise ValueError(f"--data directory {str(path)!r} holds no *.txt files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"--data path {str(path)!r} does not exist")
    return files


def read_texts(paths: Sequence[str | Path] = ()) -> list[tuple[Path, bytes]]:
    """The raw bytes of every document named by ``paths`` (see ``DataConfig.paths``), in order."""
    return [(f, f.read_bytes()) for f in _resolve_files(paths)]


def _decode(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--data file {str(path)!r} is not UTF-8 text: {e}") from None


def _vocab_size(tokenizer: Any) -> int | None:
    get = getattr(tokenizer, "get_vocab_size", None)
    return int(get()) if callable(get) else None


def _end_of_text_id(tokenizer: Any) -> int | None:
    token_to_id = getattr(tokenizer, "token_to_id", None)
    return token_to_id(END_OF_TEXT) if callable(token_to_id) else None


def _tokenizer_json(tokenizer: Any) -> str | None:
    # The full serialized tokenizer (vocab, merges, normalizer, ...) identifies its ids; an object without
    # one cannot be fingerprinted, so its corpora are never cached.
    for obj in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        to_str = getattr(obj, "to_str", None)
        if callable(to_str):
            try:
                return str(to_str())
            except Exception:  # noqa: BLE001 - a tokenizer that cannot serialize just is not cached
                return None
    return None


def _encode_document(tokenizer: Any, text: str) -> list[int]:
    blocks = [b for b in _BLOCK_SPLIT.split(text) if b]
    batch = getattr(tokenizer, "encode_batch", None)
    if callable(batch):
        try:
            # No BOS/EOS templates: documents are joined with the end-of-text token explicitly.
            encodings = batch(blocks, add_special_tokens=False)
        except TypeError:
            encodings = batch(blocks)
    else:
        encodings = [tokenizer.encode(b) for b in blocks]
    return [i for e in encodings for i in e.ids]


def _tokenize(tokenizer: Any, docs: list[tuple[Path, bytes]]) -> np.ndarray:
    eot = _end_of_text_id(tokenizer)
    pieces: list[list[int]] = []
    for path, raw in docs:
        ids = _encode_document(tokenizer, _decode(path, raw))
        if ids:
            # After each document: a window spanning two files then shows the model where one text ended.
            pieces.append(ids + ([eot] if eot is not None else []))
    flat = [i for p in pieces for i in p]
    vocab = _vocab_size(tokenizer) or (max(flat) + 1 if flat else 1)
    ids = np.asarray(flat, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"tokenizer produced ids outside [0, {vocab})")
    return ids.astype(batch_dtype(vocab))


def _cache_key(tokenizer_json: str, docs: list[tuple[Path, bytes]]) -> str:
    h = hashlib.sha256(f"gradwire-tokens-v{_CACHE_VERSION}\0".encode())
    h.update(hashlib.sha256(tokenizer_json.encode()).digest())
    for _, raw in docs:
        # Length-prefixed, so moving bytes across a document boundary changes the key.
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
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


def tokenize_corpus(
    paths: Sequence[str | Path], tokenizer: TokenizerLike, *, cache: Path | None | bool = True
) -> np.ndarray:
    """All documents of ``paths`` as one id array (uint16 or int32), through the on-disk cache.

    ``cache`` is True for ``cache_dir()``, a directory to use instead, or False/None to skip caching.
    """
    docs = read_texts(paths)
    tok_json = _tokenizer_json(tokenizer) if cache not in (False, None) else None
    vocab = _vocab_size(tokenizer)
    if tok_json is None or vocab is None:
        return _tokenize(tokenizer, docs)
    path = (cache_dir() if cache is True else Path(cache)) / f"{_cache_key(tok_json, docs)}.npy"
    ids = _cache_load(path, vocab)
    if ids is None:
        ids = _tokenize(tokenizer, docs)
        _cache_store(path, ids)
    return ids


class TokenStream:
    """A tokenized corpus split into train and validation tokens, and the batches drawn from it.

    Build with ``from_texts`` or ``from_config``; ``seq_len`` is the longest sequence that will be asked
    for: both splits must hold at least one such window.
    """

    def __init__(self, ids: np.ndarray, *, seq_len: int, seed: int = 0, val_fraction: float = 0.005) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        DataConfig(seed=seed, val_fraction=val_fraction)  # same checks, same messages
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
        window = seq_len + 1
        n_val = max(window, int(round(len(ids) * val_fraction)))
        if len(ids) < n_val + window:
            raise ValueError(
                f"--data corpus has {len(ids)} tokens, too few for one training and one validation sequence "
                f"of {window} tokens; give more text or a shorter sequence length"
            )
        self.ids = ids
        self.seed = seed
        self.seq_len = seq_len
        self.n_train = len(ids) - n_val
        self.train = ids[: self.n_train]  # views, no copies
        self.val = ids[self.n_train :]

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
        ids = tokenize_corpus(paths, tokenizer, cache=cache)
        if ids.size == 0:
            raise ValueError("--data corpus is empty: it tokenizes to no tokens")
        return cls(ids, seq_len=seq_len, seed=seed, val_fraction=val_fraction)

    @classmethod
    def from_config(
        cls, config: DataConfig, tokenizer: TokenizerLike, *, seq_len: int, cache: Path | None | bool = True
    ) -> TokenStream:
        return cls.from_texts(
            config.paths, tokenizer, seq_len=seq_len, seed=config.seed, val_fraction=config.val_fraction,
            cache=cache,
        )

    @property
    def dtype(self) -> np.dtype:
        return self.ids.dtype

    def _windows(self, split: np.ndarray, offsets: np.ndarray, seq_len: int) -> np.ndarray:
        return split[offsets[:, None] + np.arange(seq_len + 1)]  # (B, T+1)

    def _check(self, split: np.ndarray, name: str, batch_size: int, seq_len: int) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if seq_len + 1 > len(split):
            raise ValueError(f"seq_len {seq_len} does not fit the {len(split)}-token {name} split")

    def batch(self, step: int, slot: int, batch_size: int, seq_len: int) -> np.ndarray:
        """Training rows (batch_size, seq_len + 1) for worker ``slot`` at ``step``: a pure function of
        (seed, step, slot), with window starts uniform over the training split."""
        if step < 0 or slot < 0:
            raise ValueError(f"step and slot must be >= 0, got {step} and {slot}")
        self._check(self.train, "training", batch_size, seq_len)
        rng = np.random.default_rng([self.seed, step, slot])
        # Windows end inside the training split, so no training row touches a validation token.
        offsets = rng.integers(0, self.n_train - seq_len, size=batch_size)  # (B,), high exclusive
        return self._windows(self.train, offsets, seq_len)

    def val_batches(self, batch_size: int, seq_len: int, count: int) -> list[np.ndarray]:
        """``count`` validation batches (batch_size, seq_len + 1), the same on every call: windows evenly
        spaced over the validation split (they overlap when the split is small)."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._check(self.val, "validation", batch_size, seq_len)
        last = len(self.val) - seq_len - 1
        offsets = np.linspace(0, last, num=count * batch_size).round().astype(np.int64)
        rows = self._windows(self.val, offsets, seq_len)  # (count * B, T+1)
        return list(rows.reshape(count, batch_size, seq_len + 1))
