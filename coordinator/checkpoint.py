"""Atomic checkpoints: tensors in safetensors files, everything else in one JSON file.

Layout under a checkpoint root::

    root/step-00000120/model.safetensors      one file per tensor group ("model", "optimizer", ...)
    root/step-00000120/meta.json              step, group names, and the caller's JSON-able metadata
    root/latest                               text: the name of the newest complete step directory

A step directory is written in full under a temporary name inside ``root``, fsynced, and renamed into
place; only then is ``latest`` switched (again temp file + rename). A crash at any point leaves ``latest``
naming a complete checkpoint. Loading never unpickles: safetensors and JSON only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = [
    "CHECKPOINT_FORMAT",
    "keep_last",
    "latest_checkpoint",
    "load_checkpoint",
    "remove_leftovers",
    "save_checkpoint",
]

# Version of the directory layout and the reserved meta.json keys below (not of the caller's metadata).
CHECKPOINT_FORMAT = 1

LATEST = "latest"
META = "meta.json"
_STEP_DIR = re.compile(r"step-(\d{8,})")
_GROUP = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_RESERVED = ("step", "checkpoint_format", "tensor_groups")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def fsync_dir(path: Path) -> None:
    # Makes a rename inside ``path`` durable. Not possible on every platform (e.g. Windows): skip there.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _storable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors with no two sharing storage, as safetensors requires.

    Tied weights (two names, one storage) are each saved in full: a loader then gets every name it asked
    for, and re-tying is the model's business. Only the second and later sharers are copied.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"checkpoint tensors must map str to torch.Tensor, got {name!r}: {type(t).__name__}")
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save_checkpoint(
    root: Path | str, step: int, tensors: Mapping[str, Mapping[str, torch.Tensor]], meta: Mapping[str, Any]
) -> Path:
    """Write ``root/step-{step:08d}/`` atomically and point ``root/latest`` at it; returns the directory.

    ``tensors`` maps a group name (a file name stem such as "model", "optimizer", "feedback-0") to that
    group's named tensors; ``meta`` must be JSON-able and must not use the keys ``checkpoint_format`` or
    ``tensor_groups`` (``step``, if given, must equal ``step``). Saving a step that already exists replaces it.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    for group in tensors:
        if not isinstance(group, str) or not _GROUP.fullmatch(group) or group + ".safetensors" == META:
            raise ValueError(f"tensor group name {group!r} is not a plain file name stem")
    extra = {k: meta[k] for k in ("checkpoint_format", "tensor_groups") if k in meta}
    if extra or meta.get("step", step) != step:
        raise ValueError(f"meta may not set reserved keys {_RESERVED} (or must give step={step}), got {extra}")
    # Serialize first: a value JSON cannot hold fails here, before anything touches the disk.
    meta_json = json.dumps(
        {**meta, "step": step, "checkpoint_format": CHECKPOINT_FORMAT, "tensor_groups": sorted(tensors)},
        indent=1,
        sort_keys=True,
    )

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{final.name}-"))
    try:
        for group, named in tensors.items():
            path = tmp / f"{group}.safetensors"
            save_file(_storable(named), str(path))
            _fsync_file(path)
        (tmp / META).write_text(meta_json + "\n", encoding="utf-8")
        _fsync_file(tmp / META)
        fsync_dir(tmp)
        _move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)
    _write_latest(root, final.name)
    return final


def _move_into_place(tmp: Path, final: Path) -> None:
    if not final.exists():
        os.replace(tmp, final)
        return
    # A directory cannot be renamed over a non-empty one: move the old one aside first, and put it back if
    # the new one cannot take its place, so the step never ends up missing.
    trash = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".old-{final.name}-"))
    os.replace(final, trash / final.name)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(trash / final.name, final)
        shutil.rmtree(trash, ignore_errors=True)
        raise
    shutil.rmtree(trash, ignore_errors=True)


def _write_latest(root: Path, name: str) -> None:
    write_durably(root / LATEST, name + "\n")


def write_durably(path: Path, text: str) -> None:
    """``path`` holds ``text`` (UTF-8), whole or not at all, even across a crash: written to a new temporary
    file beside it (mode 0600, its own), fsynced, renamed over it, the directory fsynced."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def latest_checkpoint(root: Path | str) -> Path | None:
    """The step directory ``root/latest`` names, or None when there is none (a fresh run)."""
    root = Path(root)
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not _STEP_DIR.fullmatch(name):
        raise ValueError(f"--resume-from: {root / LATEST} names {name!r}, not a step directory")
    return root / name


def _resolve(path: Path) -> Path:
    if (path / META).is_file():
        return path
    if (path / LATEST).is_file():
        found = latest_checkpoint(path)
        assert found is not None
        if not (found / META).is_file():
            raise FileNotFoundError(
                f"--resume-from: {path / LATEST} names {found.name}, which is missing or incomplete"
            )
        return found
    if not path.exists():
        raise FileNotFoundError(f"--resume-from: {str(path)!r} does not exist")
    raise FileNotFoundError(
        f"--resume-from: {str(path)!r} is neither a checkpoint (no {META}) nor a checkpoint root (no {LATEST})"
    )


def load_checkpoint(path: Path | str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Read a checkpoint: ``path`` is a step directory or a root (then ``latest`` is followed).

    Returns (tensors per group, on the CPU; meta as saved, including ``step``, ``checkpoint_format`` and
    ``tensor_groups``).
    """
    ckpt = _resolve(Path(path))
    try:
        meta = json.loads((ckpt / META).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--resume-from: {ckpt / META} is not valid JSON: {e}") from None
    version = meta.get("checkpoint_format") if isinstance(meta, dict) else None
    if version != CHECKPOINT_FORMAT:
        raise ValueError(
            f"--resume-from: {ckpt / META} has checkpoint_format {version!r}, this version reads {CHECKPOINT_FORMAT}"
        )
    groups = meta.get("tensor_groups")
    # Group names become file names: a hand-edited meta.json must not point outside the directory.
    if not isinstance(groups, list) or not all(isinstance(g, str) and _GROUP.fullmatch(g) for g in groups):
        raise ValueError(f"--resume-from: {ckpt / META} has malformed tensor_groups {groups!r}")
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for group in groups:
        file = ckpt / f"{group}.safetensors"
        if not file.is_file():
            raise FileNotFoundError(f"--resume-from: checkpoint {ckpt} is incomplete: {file.name} is missing")
        try:
            tensors[group] = load_file(str(file), device="cpu")
        except SafetensorError as e:
            raise ValueError(f"--resume-from: {file} is not a readable safetensors file: {e}") from None
    return tensors, meta


def keep_last(root: Path | str, n: int) -> list[Path]:
    """Delete all but the newest ``n`` step directories (never the one ``latest`` names); returns them.

    Also removes leftovers of interrupted saves (``.tmp-*``/``.old-*``): call it from the process that
    saves, between saves, never while another process saves into the same root.
    """
    if n < 1:
        raise ValueError(f"--keep-checkpoints must be >= 1, got {n}")
    root = Path(root)
    current = latest_checkpoint(root)
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)))
    doomed = [p for _, p in steps[:-n] if p != current]
    _remove(doomed)
    return doomed + remove_leftovers(root)


def remove_leftovers(root: Path | str) -> list[Path]:
    """Delete what interrupted saves left in ``root`` (``.tmp-*``/``.old-*``); returns it. Only from the
    process that saves, between saves."""
    leftovers = [p for p in Path(root).iterdir() if p.name.startswith((".tmp-", ".old-"))]
    _remove(leftovers)
    return leftovers


def _remove(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
