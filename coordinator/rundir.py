"""A run's output directory: one run per directory, nothing stale left in it, each step recorded once.

* ``claim`` - a new run refuses a directory that already holds one (its metrics or checkpoints), unless it
  resumes (``--resume-from``) or replaces it (``--overwrite``, which removes the old run's files); leftovers
  of checkpoints a crash interrupted are removed either way.
* ``truncate_metrics`` - a resumed run drops the records past the step it resumes from (and any torn
  last line), so that metrics.jsonl holds every step once however often the run was killed and resumed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from gradwire.coordinator.checkpoint import LATEST, latest_checkpoint, remove_leftovers, write_durably
from gradwire.coordinator.metrics import METRICS_FILE

log = logging.getLogger(__name__)

RUN_FILES = (METRICS_FILE, "final", "wandb")  # what a run writes into its output directory, besides checkpoints


def holds_a_run(output_dir: Path, checkpoint_dir: Path) -> bool:
    metrics = output_dir / METRICS_FILE
    return (metrics.is_file() and metrics.stat().st_size > 0) or (checkpoint_dir / LATEST).is_file()


def claim(output_dir: Path, checkpoint_dir: Path, *, resuming: bool, overwrite: bool) -> None:
    """Make ``output_dir`` this run's. ``ValueError`` (naming the flags) if it holds another run and the
    run neither resumes nor overwrites it."""
    if not resuming and holds_a_run(output_dir, checkpoint_dir):
        if not overwrite:
            raise ValueError(
                f"--output-dir {output_dir} already holds a run (metrics.jsonl or checkpoints): "
                f"continue it with --resume-from {checkpoint_dir}, replace it with --overwrite, or pick another "
                "--output-dir"
            )
        log.warning("--overwrite: removing the run in %s", output_dir)
        for name in RUN_FILES:
            path = output_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        if checkpoint_dir.is_dir():
            shutil.rmtree(checkpoint_dir)
    if checkpoint_dir.is_dir():
        for path in remove_leftovers(checkpoint_dir):
            log.info("removed %s, left by an interrupted checkpoint", path)


RESUME_AUTO = "auto"  # --resume-from auto: the run in --output-dir if there is one, else a new run


def checkpoint_root(output_dir: str, checkpoint_dir: str | None) -> Path:
    """Where a run's checkpoints (and its update log and key) go: --checkpoint-dir, or OUTPUT_DIR/checkpoints."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(output_dir) / "checkpoints"


def resume_source(resume_from: str | None, root: Path) -> Path | None:
    """The checkpoint ``--resume-from`` continues from: the one it names, or with ``auto`` the run's newest in
    ``root`` (None when there is none yet: the run starts, or goes on from its update log alone)."""
    if not resume_from:
        return None
    if resume_from != RESUME_AUTO:
        return Path(resume_from)
    return root if latest_checkpoint(root) is not None else None


def truncate_metrics(output_dir: Path, step: int) -> int:
    """Keep the records of steps <= ``step`` (written atomically); return how many were dropped."""
    path = output_dir / METRICS_FILE
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill mid-write
            dropped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        write_durably(path, "".join(line + "\n" for line in kept))
    return dropped
