"""Weights & Biases tracking: offline without an API key (a real wandb run, decoded from its .wandb file),
metric names, the mode decision, and that a wandb failure turns tracking off instead of stopping training."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import METRIC_KEYS
from gradwire.coordinator.tracking import METRIC_NAMES, WandbTracker, make_tracker, metric_name, wandb_mode

wandb = pytest.importorskip("wandb")


@pytest.fixture
def no_wandb_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A machine with no W&B credentials anywhere: no env key, an empty HOME, no .netrc."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # forget settings a previous test loaded under another HOME
    yield home
    wandb.teardown()  # stop the wandb-core service this test started


def read_wandb_log(path: Path) -> Iterator[object]:
    """The records of a .wandb file: a 7-byte header, then a LevelDB log of ``wandb.proto`` Records
    (32 KiB blocks; each fragment is crc32c (4) + length (2, little endian) + type (1: full, 2-4: first,
    middle, last)). wandb 0.31 has no Python reader of its own any more (wandb-core, in Go, writes it)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending = 7, 32 * 1024, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a fragment header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def record(step: int, **extra: object) -> dict[str, object]:
    r: dict[str, object] = {key: float(i) for i, key in enumerate(METRIC_KEYS)}
    r.update(step=step, loss=5.0 - step, successful_workers=2, total_tokens=1024 * step)
    r.update(extra)
    return r


def test_no_project_means_no_tracker() -> None:
    assert make_tracker(TrainConfig()) is None
    assert make_tracker(TrainConfig(wandb_project="")) is None


def test_metric_names() -> None:
    assert metric_name("loss") == "train/loss" and metric_name("grad_norm") == "train/gradient_norm"
    assert metric_name("eval_loss") == "eval/loss" and metric_name("pushes") == "train/pushes"
    assert set(METRIC_KEYS) - {"step"} <= set(METRIC_NAMES)


def test_mode_is_offline_without_a_key_and_the_users_choice_wins(
    no_wandb_key: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() is None  # wandb reads WANDB_MODE itself
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    assert wandb_mode() is None  # online; wandb.init never ran, so nothing went over the network
    monkeypatch.delenv("WANDB_API_KEY")
    (no_wandb_key / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'b' * 40}\n")
    assert wandb_mode() is None


@pytest.mark.slow
def test_offline_run_records_metrics_under_the_seed_names(
    no_wandb_key: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    config = TrainConfig(model="gpt-tiny", wandb_project="gradwire-test", wandb_run_name="unit", output_dir=str(out))
    with caplog.at_level(logging.INFO, logger="gradwire.coordinator.tracking"):
        tracker = make_tracker(config)
        assert isinstance(tracker, WandbTracker) and tracker.enabled and tracker.mode == "offline"
        for step in (1, 2, 3):
            extra = {"eval_loss": 4.5 - step} if step == 2 else {}
            tracker.log(record(step, pushes=1, note="text is skipped", **extra), step=step)
        tracker.finish()
        tracker.finish()  # idempotent
    assert "offline" in caplog.text and not tracker.enabled
    # finish() returns once wandb-core has the run's records, not once its writer has flushed them to the
    # .wandb file; teardown waits for the service to exit (as the coordinator process's exit does).
    wandb.teardown()

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (log_file,) = run_dir.glob("run-*.wandb")
    records = list(read_wandb_log(log_file))
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history.append(
                {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
            )
    kinds = sorted(r.WhichOneof("record_type") or "?" for r in records)
    assert [h["_step"] for h in history] == [1, 2, 3], f"records in {log_file.name}: {kinds}"
    assert [h["train/loss"] for h in history] == [4.0, 3.0, 2.0]
    assert [h.get("eval/loss") for h in history] == [None, 2.5, None]
    expected = {METRIC_NAMES[k] for k in METRIC_KEYS if k != "step"} | {"train/pushes"}
    assert expected <= set(history[0]) and "train/step" not in history[0] and "train/note" not in history[0]
    assert history[2]["train/total_tokens"] == 3072 and history[2]["train/gradient_norm"] == 2.0

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "gradwire-test" and run.display_name == "unit"
    logged_config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert logged_config["model"] == "gpt-tiny" and logged_config["topk"] == 36 and logged_config["target_chunk"] == 64
    assert any(r.WhichOneof("record_type") == "exit" for r in records)


class Broken:
    """A wandb run whose ``log`` fails, as when the wandb-core service dies mid-run."""

    dir = "/nonexistent/wandb/offline-run-x/files"

    def __init__(self) -> None:
        self.finished: list[int | None] = []

    def log(self, values: dict, step: int) -> None:
        raise RuntimeError("wandb-core went away")

    def finish(self, exit_code: int | None = None) -> None:
        self.finished.append(exit_code)


def test_a_wandb_error_warns_once_and_turns_tracking_off(
    no_wandb_key: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = Broken()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: broken)
    tracker = WandbTracker(TrainConfig(wandb_project="p", output_dir=str(no_wandb_key / "run")))
    assert tracker.enabled
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            tracker.log(record(step), step=step)
        tracker.finish()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "wandb-core went away" in warnings[0].getMessage()
    assert not tracker.enabled and broken.finished == [1]


def test_a_failing_wandb_init_does_not_raise(
    no_wandb_key: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fail(**kwargs: object) -> None:
        raise wandb.errors.UsageError("no API key configured")

    monkeypatch.setattr(wandb, "init", fail)
    with caplog.at_level(logging.WARNING):
        tracker = make_tracker(TrainConfig(wandb_project="p", output_dir=str(no_wandb_key / "run")))
        assert tracker is not None and not tracker.enabled
        tracker.log(record(1), step=1)
        tracker.finish()
    assert "no API key configured" in caplog.text and "tracking is off" in caplog.text
