"""One run per output directory, stale checkpoint leftovers removed, metrics truncated on resume, and the
back-off of failed rounds (coordinator.rundir, coordinator.decisions.after_failed_round)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradwire.coordinator.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gradwire.coordinator.decisions import after_failed_round
from gradwire.coordinator.rundir import claim, truncate_metrics


def a_run(out: Path) -> Path:
    (out / "metrics.jsonl").parent.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(1, 6)))
    save_checkpoint(out / "checkpoints", 5, {"model": {"w": torch.ones(3)}}, {})
    (out / "final").mkdir()
    return out / "checkpoints"


def test_a_new_run_refuses_a_directory_that_holds_one(tmp_path: Path) -> None:
    ckpt = a_run(tmp_path / "run")
    with pytest.raises(ValueError, match="already holds a run.*--resume-from .*checkpoints.*--overwrite"):
        claim(tmp_path / "run", ckpt, resuming=False, overwrite=False)
    claim(tmp_path / "run", ckpt, resuming=True, overwrite=False)  # resuming it is fine
    assert (tmp_path / "run" / "metrics.jsonl").exists() and latest_checkpoint(ckpt) is not None
    claim(tmp_path / "fresh", tmp_path / "fresh" / "checkpoints", resuming=False, overwrite=False)  # an empty one too


def test_overwrite_removes_the_old_run(tmp_path: Path) -> None:
    ckpt = a_run(tmp_path / "run")
    (tmp_path / "run" / "notes.txt").write_text("mine")
    claim(tmp_path / "run", ckpt, resuming=False, overwrite=True)
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        and not ckpt.exists()
        and not (tmp_path / "run" / "final").exists()
    )
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"  # not ours: kept


def test_leftovers_of_an_interrupted_checkpoint_are_removed_and_the_last_complete_one_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = a_run(tmp_path / "run")
    from gradwire.coordinator import checkpoint

    calls = []

    def crash_after_the_first_group(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) > 1:
            raise KeyboardInterrupt("killed mid-checkpoint")
        return real(tensors, path, *args, **kwargs)

    real = checkpoint.save_file
    monkeypatch.setattr(checkpoint, "save_file", crash_after_the_first_group)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ckpt, 9, {"model": {"w": torch.zeros(3)}, "optimizer": {"m": torch.zeros(3)}}, {})
    monkeypatch.undo()
    # A kill leaves the temporary directory behind (here the interrupt's cleanup removed it: make one).
    (ckpt / ".tmp-step-00000009-abc").mkdir(exist_ok=True)
    tensors, meta = load_checkpoint(ckpt)
    assert meta["step"] == 5 and torch.equal(tensors["model"]["w"], torch.ones(3))
    claim(tmp_path / "run", ckpt, resuming=True, overwrite=False)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")]


def test_truncate_metrics_keeps_each_step_once(tmp_path: Path) -> None:
    a_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 0.1}\n{"step": 7, "lo')  # killed mid-line
    assert truncate_metrics(tmp_path, 4) == 3
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert truncate_metrics(tmp_path, 4) == 0
    assert truncate_metrics(tmp_path / "nowhere", 4) == 0


def test_failed_rounds_back_off_and_give_up_only_after_rounds_and_time() -> None:
    delays = [after_failed_round(n, 0.0, max_rounds=3, max_seconds=60)[1] for n in range(1, 10)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    action, _, why = after_failed_round(3, 0.04, max_rounds=3, max_seconds=60)  # every worker down for 40 ms
    assert action == "retry" and "next round in" in why
    action, _, why = after_failed_round(2, 600, max_rounds=3, max_seconds=60)
    assert action == "retry"
    action, delay, why = after_failed_round(3, 61, max_rounds=3, max_seconds=60)
    assert (action, delay) == ("give-up", 0.0) and "--max-failed-rounds 3" in why and "--max-failed-seconds 60" in why
