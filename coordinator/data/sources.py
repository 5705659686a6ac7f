"""What ``--data`` names: a list of paths or a hub dataset name resolved to a ``Source``, and its documents.

``resolve_source`` turns ``--data`` into a ``Source``: the embedded corpus (no paths), text files (or
directories of ``*.txt``), jsonl/json/csv/parquet files (``.gz``/``.bz2``/``.xz``/``.zst`` too for json and
csv) or directories of them, or a single hub dataset name. ``open_files`` and ``load_hub`` open the rows of
structured sources through ``datasets``; ``dataset_pieces`` yields each row's ``--text-field`` as one
``(text, ends_document)`` document and checks that the field exists and holds text. ``read_texts`` reads
text files whole. This module knows nothing of tokenizers, caches or batches: ``corpus.open_data`` turns a
source into a ``TokenSource``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gradwire.assets import corpus_path

__all__ = ["Source", "dataset_pieces", "file_digest", "load_hub", "open_files", "read_texts", "resolve_source"]

# What --data files hold, by suffix; a file named explicitly with another suffix is read as text.
_KINDS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # datasets decompresses json/csv files with these suffixes
_VALIDATION_SPLITS = ("validation", "valid")


# ------------------------------------------------------------------------------------------- text files


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


# --------------------------------------------------------------------------- datasets: files and the hub


@dataclasses.dataclass(frozen=True)
class Source:
    """What ``--data`` resolved to; ``describe`` names it in error messages."""

    kind: str  # "text", a datasets builder ("json", "csv", "parquet"), or "hub"
    files: tuple[Path, ...] = ()
    name: str = ""  # the hub dataset

    def describe(self) -> str:
        if self.kind == "hub":
            return f"--data {self.name!r}"
        shown = ", ".join(repr(str(f)) for f in self.files[:3]) + (", ..." if len(self.files) > 3 else "")
        return f"--data {shown}"


def _kind(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if len(suffixes) == 2 and suffixes[1] in _COMPRESSED and _KINDS.get(suffixes[0]) in ("json", "csv"):
        return _KINDS[suffixes[0]]
    return _KINDS.get(suffixes[-1]) if suffixes else None


def _looks_like_hub_name(raw: str) -> bool:
    return _kind(Path(raw)) is None and re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", raw) is not None


def resolve_source(paths: Sequence[str]) -> Source:
    if not paths:
        return Source("text", (corpus_path(),))
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and _kind(p))
            if not found:
                raise ValueError(f"--data directory {str(path)!r} holds no {'/'.join(sorted(_KINDS))} files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif len(paths) == 1 and _looks_like_hub_name(raw):
            return Source("hub", name=raw)
        else:
            raise FileNotFoundError(f"--data path {str(path)!r} does not exist")
    kinds = {_kind(f) or "text" for f in files}
    if len(kinds) > 1:
        raise ValueError(f"--data mixes {' and '.join(sorted(kinds))} files; give files of one kind")
    return Source(kinds.pop(), tuple(files))


def file_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.digest()


def open_files(source: Source) -> Any:
    """The rows of local jsonl/json/csv/parquet files, streamed (no Arrow copy in the datasets cache: the
    token cache keeps what is needed)."""
    import datasets  # seconds to import; only these sources need it

    return datasets.load_dataset(source.kind, data_files=[str(f) for f in source.files], split="train", streaming=True)


def load_hub(name: str, data_config: str | None, *, streaming: bool) -> tuple[Any, Any | None]:
    """The train split of a hub dataset and its validation split (None when it has none)."""
    import datasets

    try:
        splits = dict(datasets.load_dataset(name, data_config, streaming=streaming))
    except (ConnectionError, FileNotFoundError) as e:  # DatasetNotFoundError is a FileNotFoundError
        offline = datasets.config.HF_HUB_OFFLINE
        raise ValueError(
            f"--data {name!r} is not a local file or directory, and loading it as a hub dataset failed: it needs "
            f"the Hugging Face Hub or a copy in the local datasets cache ({datasets.config.HF_DATASETS_CACHE})"
            + (", and HF_HUB_OFFLINE/HF_DATASETS_OFFLINE allow only the cache" if offline else "")
            + ("; --streaming always reads from the hub, so drop it to use the cache" if streaming else "")
            + f" [{type(e).__name__}: {e}]"
        ) from None
    except ValueError as e:  # e.g. an unknown configuration, with the list of known ones
        raise ValueError(f"--data {name!r} with --data-config {data_config!r}: {e}") from None
    if "train" not in splits:
        raise ValueError(f"--data {name!r} has no 'train' split (it has {', '.join(sorted(splits))})")
    return splits["train"], next((splits[s] for s in _VALIDATION_SPLITS if s in splits), None)


def dataset_pieces(ds: Any, text_field: str, what: str) -> Iterator[tuple[str, bool]]:
    """Each row's ``text_field`` of a ``datasets`` Dataset or IterableDataset as one document (rows without
    a value are skipped)."""
    columns = ds.column_names
    if columns is not None:
        if text_field not in columns:
            raise _missing_field(text_field, columns, what)
        feature = (ds.features or {}).get(text_field)
        if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ValueError(f"--text-field {text_field!r} of {what} holds {feature}, not text")
        ds = ds.select_columns([text_field])  # parquet then reads only that column
    for rows in ds.iter(batch_size=1024):
        if text_field not in rows:
            raise _missing_field(text_field, list(rows), what)
        for text in rows[text_field]:
            if isinstance(text, str):
                yield text, True
            elif text is not None:
                raise ValueError(f"--text-field {text_field!r} of {what} holds {type(text).__name__} values, not text")


def _missing_field(text_field: str, columns: Iterable[str], what: str) -> ValueError:
    return ValueError(f"--text-field {text_field!r} is not a column of {what}; its columns are: {', '.join(columns)}")
