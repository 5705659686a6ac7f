"""Token ids from text: one adapter over ``tokenizers`` and ``transformers`` tokenizers, and id windows.

``Encoder`` is all the data modules know of a tokenizer: the ids of texts (in blocks cut at blank lines
where that cannot change them, encoded in batches), the end-of-text id, the vocabulary size and so the
smallest dtype holding every id (``batch_dtype``), and a fingerprint naming the ids for the token cache.
``val_windows`` cuts the held-out rows both kinds of ``TokenSource`` serve. Shared by ``corpus`` (in memory)
and ``streaming``; it imports neither.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from gradwire.assets import END_OF_TEXT

__all__ = ["BLOCK_SPLIT", "Encoder", "batch_dtype", "val_windows"]

# Split documents into blocks at blank lines for encode_batch (parallel in Rust). The split falls before the
# last whitespace character of the run, where the GPT-2 byte-level pre-tokenizer splits anyway, so the ids
# are exactly those of encoding the whole document at once (LF and CRLF line ends).
BLOCK_SPLIT = re.compile(r"(?<=\n)(?=\n\S)|(?<=\n\r)(?=\n\S)")
_ENCODE_CHARS = 1 << 20  # text per encode call: enough for encode_batch's threads, little memory


def batch_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype holding every token id: uint16 up to 65536 tokens, else int32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def _is_hf(tokenizer: Any) -> bool:
    # A transformers tokenizer (PreTrainedTokenizerBase), recognized without importing transformers.
    return callable(tokenizer) and hasattr(tokenizer, "convert_tokens_to_ids") and hasattr(tokenizer, "eos_token_id")


def _vocab_size(tokenizer: Any) -> int | None:
    get = getattr(tokenizer, "get_vocab_size", None)
    if callable(get):
        return int(get())
    return len(tokenizer) if _is_hf(tokenizer) else None  # len() counts added tokens too


def _end_of_text_id(tokenizer: Any) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return eos
    # tokenizers objects, and transformers tokenizers built without an eos_token (through their backend).
    for obj in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        token_to_id = getattr(obj, "token_to_id", None)
        if callable(token_to_id):
            return token_to_id(END_OF_TEXT)
    return None


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


def _splits_at_blank_lines(tokenizer_json: str | None) -> bool:
    # Only the GPT-2 byte-level scheme is known to split where BLOCK_SPLIT does; elsewhere a cut would change
    # ids (a SentencePiece prefix at each block, cl100k-style regexes keeping "\n\n" in one piece).
    if tokenizer_json is None:
        return False
    try:
        spec = json.loads(tokenizer_json)
    except ValueError:
        return False
    pre = spec.get("pre_tokenizer") or {}
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    )


class Encoder:
    """One tokenizer (``tokenizers`` or ``transformers``), seen through what the data needs from it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.json = _tokenizer_json(tokenizer)
        self.eot = _end_of_text_id(tokenizer)
        self.vocab = _vocab_size(tokenizer)
        self.dtype = batch_dtype(self.vocab) if self.vocab else None
        self.split_blocks = _splits_at_blank_lines(self.json)

    def fingerprint(self) -> str | None:
        """Identifies the ids this encoder produces (None: not cacheable)."""
        if self.json is None or self.vocab is None:
            return None
        return f"{type(self.tokenizer).__qualname__}\0{self.json}\0eot={self.eot}"

    def encode(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, without special tokens."""
        return [[i for ids in blocks for i in ids] for blocks in self._blocks(texts)]

    def _blocks(self, texts: list[str]) -> list[list[list[int]]]:
        # Per text, the ids of its blocks; one block per text unless splitting is safe.
        parts = [[b for b in BLOCK_SPLIT.split(t) if b] if self.split_blocks else [t] for t in texts]
        flat = iter(self._encode_flat([b for p in parts for b in p]))
        return [[next(flat) for _ in p] for p in parts]

    def _encode_flat(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        tok = self.tokenizer
        batch = getattr(tok, "encode_batch", None)
        if callable(batch):
            try:
                # No BOS/EOS templates: documents are joined with the end-of-text token explicitly.
                encodings = batch(texts, add_special_tokens=False)
            except TypeError:
                encodings = batch(texts)
            return [e.ids for e in encodings]
        if _is_hf(tok):
            # verbose=False: long documents are meant to exceed the model's length; no warning for that.
            out = tok(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
            return [list(ids) for ids in out["input_ids"]]
        return [list(getattr(e, "ids", e)) for e in (tok.encode(t) for t in texts)]

    def chunks(self, pieces: Iterable[tuple[str, bool]]) -> Iterator[np.ndarray]:
        """Token ids of ``(text, ends_document)`` pieces, in order, as one array per ~_ENCODE_CHARS of text,
        with the end-of-text token after each document that has any tokens."""
        doc_has_ids = False
        pending: list[tuple[str, bool]] = []
        size = 0
        for piece in itertools.chain(pieces, [None]):
            if piece is not None:
                pending.append(piece)
                size += len(piece[0])
                if size < _ENCODE_CHARS:
                    continue
            if not pending:
                break
            lists: list[list[int]] = []
            for (_, ends), blocks in zip(pending, self._blocks([t for t, _ in pending])):
                lists.extend(blocks)
                doc_has_ids = doc_has_ids or any(blocks)
                if ends:
                    if doc_has_ids and self.eot is not None:
                        lists.append([self.eot])
                    doc_has_ids = False
            pending, size = [], 0
            yield self._array(lists)

    def _array(self, lists: list[list[int]]) -> np.ndarray:
        n = sum(map(len, lists))
        ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=n)
        if ids.size and (ids.min() < 0 or (self.vocab is not None and ids.max() >= self.vocab)):
            raise ValueError(f"tokenizer produced ids outside [0, {self.vocab})")
        return ids.astype(self.dtype) if self.dtype is not None else ids

    def concat(self, chunks: Iterable[np.ndarray], limit: int | None = None) -> np.ndarray:
        """All ``chunks`` (the first ``limit`` tokens) as one array of the batch dtype."""
        parts, n = [], 0
        for c in chunks:
            parts.append(c)
            n += len(c)
            if limit is not None and n >= limit:
                break
        ids = np.concatenate(parts)[:limit] if parts else np.empty(0, self.dtype or np.int64)
        if self.dtype is None:  # no known vocabulary: the smallest dtype for the ids seen
            ids = ids.astype(batch_dtype(int(ids.max()) + 1 if ids.size else 1))
        return ids


def val_windows(val: np.ndarray, batch_size: int, seq_len: int, count: int) -> list[np.ndarray]:
    """``count`` batches (batch_size, seq_len + 1) of evenly spaced windows over the held-out tokens ``val``,
    first to last (they overlap when there are few)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    if seq_len + 1 > len(val):
        raise ValueError(f"seq_len {seq_len} does not fit the {len(val)}-token validation split")
    offsets = np.linspace(0, len(val) - seq_len - 1, num=count * batch_size).round().astype(np.int64)
    rows = val[offsets[:, None] + np.arange(seq_len + 1)]  # (count * B, T+1)
    return list(rows.reshape(count, batch_size, seq_len + 1))
