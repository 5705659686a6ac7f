"""Token data: corpus loading and caching, the train/validation split, and stateless batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradwire.assets import corpus_path, default_tokenizer
from gradwire.coordinator.data import DataConfig, TokenStream, batch_dtype, tokenize_corpus
from gradwire.coordinator.data import corpus as data_mod

SEQ = 32
TEXT = corpus_path().read_text(encoding="utf-8")


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWIRE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory: pytest.TempPathFactory) -> TokenStream:
    # Built once: tokenizing the whole corpus takes a few tenths of a second.
    cache = tmp_path_factory.mktemp("cache")
    return TokenStream.from_texts((), default_tokenizer(), seq_len=SEQ, seed=7, cache=cache)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_embedded_corpus_matches_plain_encoding(shakespeare: TokenStream) -> None:
    tok = default_tokenizer()
    assert shakespeare.dtype == np.uint16
    # Block-wise encode_batch gives the ids of encoding the text in one piece (only the cut end may differ).
    prefix = tok.encode(TEXT[:50_000]).ids
    n = len(prefix) - 10
    assert shakespeare.ids[:n].tolist() == prefix[:n]
    assert shakespeare.ids[-1] == tok.token_to_id("<|endoftext|>")
    assert len(shakespeare.val) == max(SEQ + 1, round(len(shakespeare.ids) * 0.005))
    assert shakespeare.n_train + len(shakespeare.val) == len(shakespeare.ids)


def test_batches_are_deterministic_across_calls_and_instances(shakespeare: TokenStream) -> None:
    b = shakespeare.batch(step=3, slot=1, batch_size=4, seq_len=SEQ)
    assert b.shape == (4, SEQ + 1) and b.dtype == np.uint16
    np.testing.assert_array_equal(b, shakespeare.batch(3, 1, 4, SEQ))
    again = TokenStream(shakespeare.ids.copy(), seq_len=SEQ, seed=7)
    np.testing.assert_array_equal(b, again.batch(3, 1, 4, SEQ))
    other_seed = TokenStream(shakespeare.ids, seq_len=SEQ, seed=8)
    assert not np.array_equal(b, other_seed.batch(3, 1, 4, SEQ))


def test_step_and_slot_change_the_batch(shakespeare: TokenStream) -> None:
    batches = {(t, s): shakespeare.batch(t, s, 4, SEQ).tobytes() for t in range(4) for s in range(3)}
    assert len(set(batches.values())) == len(batches)


def test_rows_are_windows_of_the_token_stream(shakespeare: TokenStream) -> None:
    ids = shakespeare.ids
    for row in shakespeare.batch(11, 2, 8, SEQ):
        starts = np.flatnonzero(ids[: shakespeare.n_train] == row[0])
        # row[1:] continues row[:-1]: the whole row sits contiguously somewhere in the training split.
        assert any(np.array_equal(ids[p : p + SEQ + 1], row) for p in starts)


def test_train_windows_never_touch_the_validation_split() -> None:
    # Token i has id i (mod 2**16 never wraps here), so a row's values are its positions.
    ids = np.arange(6000, dtype=np.uint16)
    stream = TokenStream(ids, seq_len=SEQ, val_fraction=0.05)
    assert stream.n_train == 6000 - 300
    rows = np.concatenate([stream.batch(t, s, 16, SEQ) for t in range(50) for s in range(4)])
    assert (np.diff(rows.astype(np.int64), axis=1) == 1).all()
    assert rows.max() < stream.n_train
    assert rows[:, 0].min() < 100  # offsets spread over the whole training split
    assert rows[:, 0].max() > stream.n_train - 200
    val = stream.val_batches(batch_size=4, seq_len=SEQ, count=3)
    assert len(val) == 3 and all(v.shape == (4, SEQ + 1) for v in val)
    flat = np.concatenate(val)
    assert flat.min() == stream.n_train and flat.max() == 6000 - 1  # evenly spread, first to last token
    for a, b in zip(val, stream.val_batches(4, SEQ, 3)):
        np.testing.assert_array_equal(a, b)


def test_sequences_longer_than_a_split_are_rejected() -> None:
    stream = TokenStream(np.arange(200, dtype=np.uint16), seq_len=8)
    with pytest.raises(ValueError, match="validation"):
        stream.val_batches(1, 64, 1)
    with pytest.raises(ValueError, match="--data"):
        TokenStream(np.arange(60, dtype=np.uint16), seq_len=32)


def test_user_files_and_directories(tmp_path: Path) -> None:
    tok = default_tokenizer()
    eot = tok.token_to_id("<|endoftext|>")
    docs = [TEXT[i * 20_000 : (i + 1) * 20_000] for i in range(3)]
    # Written out of order: a directory is read in sorted name order.
    write(tmp_path / "dir" / "b.txt", docs[1])
    write(tmp_path / "dir" / "a.txt", docs[0])
    write(tmp_path / "dir" / "notes.md", "ignored")
    single = write(tmp_path / "c.txt", docs[2])
    stream = TokenStream.from_texts([tmp_path / "dir", str(single)], tok, seq_len=SEQ)
    expected: list[int] = []
    for doc in docs:
        expected += tok.encode(doc).ids + [eot]
    assert stream.ids.tolist() == expected


def test_bad_data_paths_name_the_flag(tmp_path: Path) -> None:
    tok = default_tokenizer()
    with pytest.raises(FileNotFoundError, match="--data"):
        TokenStream.from_texts([tmp_path / "nope.txt"], tok, seq_len=SEQ)
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ValueError, match="--data"):
        TokenStream.from_texts([tmp_path / "empty-dir"], tok, seq_len=SEQ)
    with pytest.raises(ValueError, match="--data corpus is empty"):
        TokenStream.from_texts([write(tmp_path / "e.txt", "")], tok, seq_len=SEQ)
    with pytest.raises(ValueError, match="--data corpus has"):
        TokenStream.from_texts([write(tmp_path / "short.txt", "To be, or not to be.")], tok, seq_len=SEQ)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="--data file .* not UTF-8"):
        TokenStream.from_texts([tmp_path / "latin1.txt"], tok, seq_len=SEQ)


def test_cache_hit_gives_identical_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = default_tokenizer()
    src = write(tmp_path / "t.txt", TEXT[:30_000])
    first = tokenize_corpus([src], tok)
    cached = list((tmp_path / "cache" / "tokens").glob("*.npy"))
    assert len(cached) == 1

    def no_tokenizing(*args: object) -> np.ndarray:
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(data_mod, "_tokenize", no_tokenizing)
    second = tokenize_corpus([src], tok)
    assert second.dtype == first.dtype
    np.testing.assert_array_equal(first, second)
    # Other content is another key: the cache never answers for text it was not built from.
    monkeypatch.undo()
    monkeypatch.setenv("GRADWIRE_CACHE", str(tmp_path / "cache"))
    write(src, TEXT[:30_001])
    assert len(tokenize_corpus([src], tok)) >= len(first)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 2


def test_corrupt_or_unwritable_cache_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = default_tokenizer()
    src = write(tmp_path / "t.txt", TEXT[:20_000])
    good = tokenize_corpus([src], tok)
    (cached,) = (tmp_path / "cache" / "tokens").glob("*.npy")
    cached.write_bytes(b"\x93NUMPY garbage")
    with pytest.warns(UserWarning, match="token cache"):
        again = tokenize_corpus([src], tok)
    np.testing.assert_array_equal(good, again)
    np.testing.assert_array_equal(np.load(cached), good)  # rewritten
    # A cache location that cannot be created (a file in the way) only costs a warning.
    write(tmp_path / "blocked", "x")
    monkeypatch.setenv("GRADWIRE_CACHE", str(tmp_path / "blocked"))
    with pytest.warns(UserWarning, match="could not write token cache"):
        np.testing.assert_array_equal(tokenize_corpus([src], tok), good)


def test_any_object_with_encode_works_uncached(tmp_path: Path) -> None:
    class Chars:
        """A character-level tokenizer with only ``encode``: no vocab size, no end-of-text, no JSON."""

        class _Enc:
            def __init__(self, ids: list[int]) -> None:
                self.ids = ids

        def encode(self, text: str) -> Chars._Enc:
            return self._Enc([ord(c) for c in text])

    src = write(tmp_path / "t.txt", "abc\n\ndef " * 50)
    stream = TokenStream.from_texts([src], Chars(), seq_len=8)
    assert stream.ids.tolist() == [ord(c) for c in "abc\n\ndef " * 50]
    assert not (tmp_path / "cache").exists()


def test_config_validation_names_the_flag() -> None:
    assert DataConfig().paths == ()
    with pytest.raises(ValueError, match="--data"):
        DataConfig(paths="corpus.txt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--seed"):
        DataConfig(seed=-1)
    with pytest.raises(ValueError, match="--val-fraction"):
        DataConfig(val_fraction=0.0)
    with pytest.raises(TypeError):
        DataConfig((), 0)  # type: ignore[misc]  # kw_only


def test_batch_dtype() -> None:
    assert batch_dtype(8192) == np.uint16
    assert batch_dtype(65536) == np.uint16
    assert batch_dtype(65537) == np.int32
    assert batch_dtype(50257) == np.uint16
