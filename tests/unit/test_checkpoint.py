"""Checkpoints: bit-exact round trips, the ``latest`` pointer, crash safety, pruning."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from gradwire.coordinator import checkpoint as ckpt_mod
from gradwire.coordinator.checkpoint import keep_last, latest_checkpoint, load_checkpoint, save_checkpoint


def state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(8, 4, generator=g)
    return {
        # Tied weights (one storage, two names) and a non-contiguous view must both save.
        "model": {"wte": weight, "lm_head": weight, "proj_t": torch.randn(4, 6, generator=g).t()},
        "optimizer": {
            "m": torch.randn(8, 4, generator=g, dtype=torch.float64),
            "bf16": torch.randn(3, generator=g).to(torch.bfloat16),
            "count": torch.tensor(5, dtype=torch.int64),
        },
        "feedback-0": {"e": torch.zeros(0, 3)},
        "rng": {"torch": torch.get_rng_state()},
    }


def assert_same(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    assert a.keys() == b.keys()
    for group in a:
        assert a[group].keys() == b[group].keys()
        for name, t in a[group].items():
            u = b[group][name]
            assert u.dtype == t.dtype and u.shape == t.shape
            # Compare bits, not values: NaN != NaN, and -0.0 == 0.0.
            assert torch.equal(u.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    tensors = state(0)
    meta = {"config": {"model": "gpt-tiny", "lr": 0.7}, "data": {"step": 12, "seed": 3}, "format_version": 1}
    path = save_checkpoint(tmp_path, 12, tensors, meta)
    assert path == tmp_path / "step-00000012"
    loaded, loaded_meta = load_checkpoint(path)
    assert_same(tensors, loaded)
    assert {k: loaded_meta[k] for k in meta} == meta
    assert loaded_meta["step"] == 12
    # The root resolves through `latest` to the same checkpoint.
    loaded2, meta2 = load_checkpoint(tmp_path)
    assert_same(tensors, loaded2)
    assert meta2 == loaded_meta
    torch.set_rng_state(loaded["rng"]["torch"])  # a restorable RNG state


def test_latest_follows_the_newest_save(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, state(1), {})
    save_checkpoint(tmp_path, 2, state(2), {})
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    loaded, meta = load_checkpoint(tmp_path)
    assert meta["step"] == 2
    assert_same(state(2), loaded)
    # Saving an existing step again replaces it whole.
    save_checkpoint(tmp_path, 2, state(3), {"again": True})
    loaded, meta = load_checkpoint(tmp_path)
    assert meta["again"] is True
    assert_same(state(3), loaded)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000002"]


@pytest.mark.parametrize("existing_step", [False, True])
def test_crash_mid_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing_step: bool
) -> None:
    save_checkpoint(tmp_path, 1, state(1), {"ok": 1})
    if existing_step:
        save_checkpoint(tmp_path, 2, state(2), {"ok": 2})
    real_replace = os.replace

    def crash_on_dir_rename(src: str | Path, dst: str | Path) -> None:
        if Path(src).name.startswith(".tmp-step-"):
            raise OSError("simulated crash while renaming the checkpoint directory")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", crash_on_dir_rename)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(tmp_path, 2, state(9), {"ok": "never"})
    monkeypatch.undo()

    _, meta = load_checkpoint(tmp_path)
    assert meta["ok"] == (2 if existing_step else 1)
    want = "step-00000002" if existing_step else "step-00000001"
    assert (tmp_path / "latest").read_text().strip() == want
    # Nothing half-written is left behind under a step name (or at all).
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000001"] + (["step-00000002"] if existing_step else [])
    if existing_step:
        assert_same(state(2), load_checkpoint(tmp_path / "step-00000002")[0])


def test_bad_meta_fails_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, state(1), {"not_json": object()})
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path, 1, state(1), {"step": 2})
    with pytest.raises(ValueError, match="group name"):
        save_checkpoint(tmp_path, 1, {"../evil": {}}, {})
    assert not any(p.name.startswith("step-") for p in tmp_path.iterdir())


def test_missing_or_incomplete_checkpoints_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--resume-from"):
        load_checkpoint(tmp_path / "nothing-here")
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(FileNotFoundError, match="--resume-from"):
        load_checkpoint(tmp_path / "empty")
    path = save_checkpoint(tmp_path / "run", 4, state(4), {})
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="--resume-from.*optimizer.safetensors"):
        load_checkpoint(tmp_path / "run")
    (path / "model.safetensors").write_bytes(b"not safetensors")
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "tensor_groups": ["model"]}))
    with pytest.raises(ValueError, match="--resume-from.*safetensors"):
        load_checkpoint(path)
    (path / "meta.json").write_text(json.dumps({**meta, "tensor_groups": ["../model"]}))
    with pytest.raises(ValueError, match="--resume-from.*tensor_groups"):
        load_checkpoint(path)
    (tmp_path / "run" / "latest").write_text("step-00000099\n")
    with pytest.raises(FileNotFoundError, match="--resume-from.*step-00000099"):
        load_checkpoint(tmp_path / "run")


def test_keep_last_prunes_old_steps_but_never_latest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"model": {"w": torch.full((2,), float(step))}}, {})
    (tmp_path / ".tmp-step-00000005-leftover").mkdir()  # an interrupted save
    removed = keep_last(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000004"]
    assert len(removed) == 3
    # `latest` pointing at an older step (e.g. after a rollback) keeps that step too.
    (tmp_path / "latest").write_text("step-00000003\n")
    save_checkpoint(tmp_path, 5, {"model": {"w": torch.zeros(2)}}, {})
    (tmp_path / "latest").write_text("step-00000003\n")
    keep_last(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000005"]
    with pytest.raises(ValueError, match="--keep-checkpoints"):
        keep_last(tmp_path, 0)
