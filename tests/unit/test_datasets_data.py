"""open_data: jsonl/json/csv/parquet files through ``datasets``, hub datasets, streaming, HF tokenizers.

Never touches the network: the hub is offline and the datasets cache is a fresh temporary directory, so a
hub name can only fail (fast), and hub behaviour is checked through a stand-in ``load_dataset``.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import huggingface_hub.constants
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradwire.assets import corpus_path, default_tokenizer, gpt2_tokenizer
from gradwire.coordinator.data import StreamingTokenSource, TokenSource, TokenStream, open_data
from gradwire.coordinator.data import corpus as data_mod
from gradwire.coordinator.data import streaming as streaming_mod
from gradwire.coordinator.data import tokens as tokens_mod

SEQ = 16
TEXT = corpus_path().read_text(encoding="utf-8")
# Eight documents with blank lines inside (where encoding is split into blocks), one with CRLF line ends.
DOCS = [TEXT[i * 2500 : (i + 1) * 2500] for i in range(8)]
DOCS[3] = DOCS[3].replace("\n", "\r\n")


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # datasets and huggingface_hub read these at import; the module constants are what they consult.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def expected_ids(tok, docs: list[str] = DOCS) -> list[int]:
    eot = tok.token_to_id("<|endoftext|>")
    return [i for d in docs for i in tok.encode(d).ids + [eot]]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return path


def write_txt_dir(path: Path, docs: list[str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (path / f"{i:02d}.txt").write_bytes(d.encode("utf-8"))
    return path


def open_stream(paths: list[Path], tok, **kw) -> StreamingTokenSource:
    kw = {"seq_len": SEQ, "n_slots": 3, "val_rows": 4, **kw}
    source = open_data(paths=[str(p) for p in paths], tokenizer=tok, streaming=True, **kw)
    assert isinstance(source, StreamingTokenSource) and isinstance(source, TokenSource)
    return source


# ------------------------------------------------------------------------------------------- in memory


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_structured_files_give_the_tokens_of_the_same_texts(tmp_path: Path, fmt: str) -> None:
    tok = default_tokenizer()
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    elif fmt == "json":
        path = tmp_path / "docs.json"
        path.write_text(json.dumps([{"text": d, "id": i} for i, d in enumerate(DOCS)]), encoding="utf-8")
    else:
        path = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"id": list(range(len(DOCS))), "text": DOCS}), path)
    data = open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ)
    text = open_data(paths=[str(write_txt_dir(tmp_path / "txt", DOCS))], tokenizer=tok, seq_len=SEQ)
    assert isinstance(data, TokenStream) and isinstance(data, TokenSource)
    # A row is a document exactly as a text file is: its tokens, then <|endoftext|>.
    assert data.ids.tolist() == text.ids.tolist() == expected_ids(tok)
    assert data.dtype == np.uint16
    assert data.batch(2, 1, 4, SEQ).shape == (4, SEQ + 1)


def test_csv_with_a_custom_text_field(tmp_path: Path) -> None:
    tok = default_tokenizer()
    bodies = DOCS[:4] + [None] + DOCS[4:]  # a row without text is skipped
    path = tmp_path / "docs.csv"
    pd.DataFrame({"id": range(len(bodies)), "body": bodies}).to_csv(path, index=False)
    data = open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ, text_field="body")
    assert data.ids.tolist() == expected_ids(tok)


def test_a_directory_of_jsonl_is_read_in_name_order(tmp_path: Path) -> None:
    tok = default_tokenizer()
    write_jsonl(tmp_path / "dir" / "b.jsonl", DOCS[4:])
    write_jsonl(tmp_path / "dir" / "a.jsonl", DOCS[:4])
    (tmp_path / "dir" / "README.md").write_text("not data")
    data = open_data(paths=[str(tmp_path / "dir")], tokenizer=tok, seq_len=SEQ)
    assert data.ids.tolist() == expected_ids(tok)


def test_missing_or_non_text_field_names_the_flag(tmp_path: Path) -> None:
    tok = default_tokenizer()
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS, field="content")
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"--text-field 'text' is not a column .*: id, content"):
            open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ, streaming=streaming)
        with pytest.raises(ValueError, match=r"--text-field 'id' .* not text"):
            open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ, streaming=streaming, text_field="id")
    with pytest.raises(ValueError, match="--text-field"):
        open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ, text_field="")


def test_bad_data_flags(tmp_path: Path) -> None:
    tok = default_tokenizer()
    jsonl = write_jsonl(tmp_path / "mixed" / "a.jsonl", DOCS)
    (tmp_path / "mixed" / "b.txt").write_text(DOCS[0])
    with pytest.raises(ValueError, match="--data mixes json and text"):
        open_data(paths=[str(tmp_path / "mixed")], tokenizer=tok, seq_len=SEQ)
    with pytest.raises(ValueError, match="--data-config"):
        open_data(paths=[str(jsonl)], tokenizer=tok, seq_len=SEQ, data_config="wikitext-103-raw-v1")
    with pytest.raises(FileNotFoundError, match="--data"):
        open_data(paths=[str(tmp_path / "missing.jsonl")], tokenizer=tok, seq_len=SEQ)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--data directory"):
        open_data(paths=[str(tmp_path / "empty")], tokenizer=tok, seq_len=SEQ)
    with pytest.raises(ValueError, match="--data corpus is empty"):
        open_data(paths=[str(write_jsonl(tmp_path / "blank.jsonl", ["", ""]))], tokenizer=tok, seq_len=SEQ)


def test_structured_files_are_cached_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = default_tokenizer()
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    first = open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ)

    def no_reading(*args: object) -> None:
        raise AssertionError("the token cache should have answered")

    monkeypatch.setattr(data_mod, "open_files", no_reading)
    np.testing.assert_array_equal(open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ).ids, first.ids)
    # Another text field, or other content, is another key.
    with pytest.raises(AssertionError, match="token cache"):
        open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ, text_field="other")
    write_jsonl(path, DOCS[:-1])
    with pytest.raises(AssertionError, match="token cache"):
        open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ)


# --------------------------------------------------------------------------------------------- streaming


@pytest.fixture(params=["jsonl", "txt"])
def stream_files(request: pytest.FixtureRequest, tmp_path: Path) -> list[Path]:
    if request.param == "jsonl":
        return [write_jsonl(tmp_path / "docs.jsonl", DOCS)]
    return [write_txt_dir(tmp_path / "txt", DOCS)]


def test_streaming_rows_are_the_stream_laid_out_by_step_and_slot(
    stream_files: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small reads and encode calls, so texts are cut into many pieces: the ids must not change.
    monkeypatch.setattr(streaming_mod, "_READ_CHARS", 700)
    monkeypatch.setattr(tokens_mod, "_ENCODE_CHARS", 1500)
    tok = default_tokenizer()
    ids = np.array(expected_ids(tok))
    n_slots, b, n_val = 3, 2, 4 * (SEQ + 1)
    source = open_stream(stream_files, tok, n_slots=n_slots)
    assert source.dtype == np.uint16
    # Held out: the head of the stream. Training: what follows, step-major, slot-minor, stride SEQ.
    np.testing.assert_array_equal(source.val, ids[:n_val])
    for step, slot in [(0, 0), (0, 2), (5, 1), (9, 0)]:
        rows = source.batch(step, slot, b, SEQ)
        assert rows.shape == (b, SEQ + 1) and rows.dtype == np.uint16
        for r, row in enumerate(rows):
            start = n_val + ((step * n_slots + slot) * b + r) * SEQ
            np.testing.assert_array_equal(row, ids[start : start + SEQ + 1])
    val = source.val_batches(b, SEQ, count=2)  # count * b == val_rows: the held-out head, tiled
    np.testing.assert_array_equal(np.concatenate(val), ids[:n_val].reshape(4, SEQ + 1))
    trained = {row.tobytes() for t in range(10) for s in range(n_slots) for row in source.batch(t, s, b, SEQ)}
    assert not trained & {row.tobytes() for v in val for row in v}


def test_a_streams_layout_follows_the_workers_and_no_window_is_trained_twice_or_skipped(tmp_path: Path) -> None:
    """Workers come and go (2 slots, then 3 with one of twice the rows, then 1): every step goes on from
    where the last ended, so the windows tile the stream; a fresh source with the saved layouts (a
    resume) cuts the same rows."""
    tok = default_tokenizer()
    files = [write_jsonl(tmp_path / "docs.jsonl", DOCS)]
    source = open_stream(files, tok, n_slots=2)
    plan = {0: [2, 2], 3: [2, 4, 2], 5: [2]}  # step -> rows per slot, from that step on
    starts, layout = [], plan[0]
    for step in range(7):
        layout = plan.get(step, layout)
        source.set_layout(step, layout)
        rows = np.concatenate([source.batch(step, slot, n, SEQ) for slot, n in enumerate(layout)])
        starts.append(rows)
    stream = np.concatenate(starts)
    ids = np.tile(np.array(expected_ids(tok))[4 * (SEQ + 1) :], 20)  # after the held-out head, epoch after epoch
    for r, row in enumerate(stream):
        np.testing.assert_array_equal(
            row, ids[r * SEQ : r * SEQ + SEQ + 1]
        )  # contiguous: nothing twice, nothing skipped
    assert [first for first, _, _ in source.layouts] == [0, 3, 5]
    resumed = open_stream(files, tok, n_slots=2)
    resumed.restore_layouts([[f, s, list(r)] for f, s, r in source.layouts])
    np.testing.assert_array_equal(resumed.batch(4, 1, 4, SEQ), source.batch(4, 1, 4, SEQ))
    np.testing.assert_array_equal(resumed.batch(6, 0, 2, SEQ), starts[6])
    source.set_layout(6, [2])  # a retried round sets the layout it already has: nothing moves
    np.testing.assert_array_equal(source.batch(6, 0, 2, SEQ), starts[6])
    assert [first for first, _, _ in source.layouts] == [0, 3, 5]


def test_streaming_batches_are_deterministic(stream_files: list[Path]) -> None:
    tok = default_tokenizer()
    a, b = open_stream(stream_files, tok), open_stream(stream_files, tok)
    first = a.batch(3, 1, 4, SEQ)
    np.testing.assert_array_equal(first, a.batch(3, 1, 4, SEQ))  # a retry
    np.testing.assert_array_equal(first, b.batch(3, 1, 4, SEQ))  # a fresh source (a resume at step 3)
    keys = [(t, s) for t in range(6) for s in range(3)]
    seen = {k: a.batch(*k, 4, SEQ).tobytes() for k in keys}
    assert len(set(seen.values())) == len(keys)
    # Worker threads ask for the slots of a step in any order, at once: the rows do not depend on it.
    c = open_stream(stream_files, tok)
    shuffled = keys * 2
    random.Random(0).shuffle(shuffled)
    shuffled.sort(key=lambda k: k[0])  # steps in order, slots (and retries) racing within a step
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: c.batch(*k, 4, SEQ).tobytes(), shuffled))
    assert got == [seen[k] for k in shuffled]
    # A step already passed is re-read from the start of the stream, and is still the same.
    assert c.batch(1, 2, 4, SEQ).tobytes() == seen[(1, 2)]


def test_streaming_wraps_into_further_epochs_without_the_held_out_head(tmp_path: Path) -> None:
    tok = default_tokenizer()
    docs = DOCS[:2]
    ids = np.array(expected_ids(tok, docs))
    n_val = 4 * (SEQ + 1)
    train = ids[n_val:]
    source = open_stream([write_jsonl(tmp_path / "small.jsonl", docs)], tok, n_slots=1)
    per_step = 8 * SEQ
    step = 3 * len(train) // per_step  # well into the fourth epoch
    looped = np.tile(train, 5)
    rows = source.batch(step, 0, 8, SEQ)
    for r, row in enumerate(rows):
        start = step * per_step + r * SEQ
        np.testing.assert_array_equal(row, looped[start : start + SEQ + 1])


def test_streaming_checks(tmp_path: Path) -> None:
    tok = default_tokenizer()
    source = open_stream([write_jsonl(tmp_path / "docs.jsonl", DOCS)], tok, n_slots=2)
    with pytest.raises(ValueError, match="slot in"):
        source.batch(0, 2, 4, SEQ)
    source.set_layout(0, [4, 8])
    with pytest.raises(ValueError, match="takes 8 rows"):
        source.batch(0, 1, 4, SEQ)
    with pytest.raises(ValueError, match="seq_len"):
        source.batch(0, 0, 4, SEQ + 1)
    for bad in ([], [0, 4]):
        with pytest.raises(ValueError, match="layout"):
            source.set_layout(1, bad)
    with pytest.raises(ValueError, match="bad data layout"):
        source.restore_layouts([[3, 0, [4]], [2, 10, [4]]])
    with pytest.raises(ValueError, match="too few to hold out"):
        open_stream([write_jsonl(tmp_path / "tiny.jsonl", ["To be, or not to be."])], tok)


# ------------------------------------------------------------------------------------------------ the hub


def test_an_uncached_hub_dataset_offline_fails_fast_naming_the_flag() -> None:
    tok = default_tokenizer()
    for streaming in (False, True):
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=r"--data 'wikitext' .*local datasets cache"):
            open_data(
                paths=["wikitext"], data_config="wikitext-103-raw-v1", tokenizer=tok, seq_len=SEQ, streaming=streaming
            )
        assert time.perf_counter() - t0 < 5.0  # no retries against an unreachable hub


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """``load_dataset`` answering for one hub dataset with train/validation/test splits."""
    splits = {"train": DOCS[:6], "validation": DOCS[6:], "test": ["unused"]}

    def load_dataset(name: str, config: str | None = None, *, streaming: bool = False) -> object:
        assert (name, config) == ("someone/corpus", "small")
        dd = datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()})
        return datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in dd.items()}) if streaming else dd

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return splits


def test_a_hub_dataset_holds_out_its_validation_split(fake_hub: dict[str, list[str]]) -> None:
    tok = default_tokenizer()
    train, val = np.array(expected_ids(tok, fake_hub["train"])), np.array(expected_ids(tok, fake_hub["validation"]))
    kw = {"paths": ["someone/corpus"], "data_config": "small", "tokenizer": tok, "seq_len": SEQ}
    memory = open_data(**kw)
    assert isinstance(memory, TokenStream)
    np.testing.assert_array_equal(memory.train, train)
    np.testing.assert_array_equal(memory.val, val)
    np.testing.assert_array_equal(open_data(**kw).ids, train)  # again, from the token cache
    stream = open_data(**kw, streaming=True, n_slots=2, val_rows=4)
    np.testing.assert_array_equal(stream.val, val[: 4 * (SEQ + 1)])
    np.testing.assert_array_equal(stream.batch(0, 0, 2, SEQ)[0], train[: SEQ + 1])  # nothing skipped


# ----------------------------------------------------------------------------------------------- tokenizers


def test_hf_and_tokenizers_gpt2_give_identical_ids(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    raw = gpt2_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer()._tokenizer, eos_token="<|endoftext|>")
    hf_no_eos = PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer()._tokenizer)
    for tok in (raw, hf, hf_no_eos):
        encoder = tokens_mod.Encoder(tok)
        assert encoder.encode(["Hello world"]) == [[15496, 995]]
        assert (encoder.eot, encoder.vocab, encoder.split_blocks) == (50256, 50257, True)
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    ids = [open_data(paths=[str(path)], tokenizer=tok, seq_len=SEQ, cache=False).ids for tok in (raw, hf, hf_no_eos)]
    assert ids[0].dtype == np.uint16
    assert ids[0].tolist() == ids[1].tolist() == ids[2].tolist() == expected_ids(raw)
    streamed = [open_stream([path], tok).batch(2, 1, 4, SEQ) for tok in (raw, hf)]
    np.testing.assert_array_equal(*streamed)


def test_only_the_gpt2_byte_level_scheme_is_encoded_in_blocks() -> None:
    assert tokens_mod.Encoder(default_tokenizer()).split_blocks
    spec = json.loads(default_tokenizer().to_str())
    spec["pre_tokenizer"]["add_prefix_space"] = True  # each block would get a leading space
    assert not tokens_mod._splits_at_blank_lines(json.dumps(spec))
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
    assert not tokens_mod._splits_at_blank_lines(json.dumps(spec))
    assert not tokens_mod._splits_at_blank_lines(None)
