"""What a resume takes from the update log (``coordinator.durable``): which logged rounds continue a checkpoint
and why others do not, the coordinator's state in a record, and the run's key kept with its checkpoints."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from gradwire.compression import CodecConfig
from gradwire.coordinator.durable import RoundState, load_run_key, plan_replay, resume_root, save_run_key
from gradwire.coordinator.outer import make_outer
from gradwire.coordinator.updatelog import LogRecord
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.replica import StateUpdate

SPEC = model_spec("gpt-tiny")


def _state(senders: tuple[int, ...] = (0, 1), step: int = 5) -> RoundState:
    return RoundState("run", step, 640, {"data_step": step}, (1.5, 2.25), bytes(range(7)), senders, 4, {"w-a": 9})


def _record(round_: int, version: int, senders: tuple[int, ...] = (0, 1)) -> LogRecord:
    update = StateUpdate(0.1, (), ())
    return LogRecord(round_, version, version + 1, update, None, _state(senders, round_ + 1).to_bytes())


def _outer():
    return make_outer(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"), CodecConfig(), SPEC, 0)


def test_a_records_coordinator_state_comes_back_as_it_was() -> None:
    state = _state()
    assert RoundState.from_bytes(state.to_bytes()) == state
    with pytest.raises(ValueError, match="coordinator state does not read"):
        RoundState.from_bytes(b'{"format": 2}')


def test_the_logged_rounds_continue_a_checkpoint_only_where_they_start_at_it() -> None:
    outer = _outer()
    records = [_record(2, 7), _record(3, 8), _record(4, 9)]
    assert plan_replay(records, 3, 8, False, outer)[0] == tuple(records[1:])  # round 2 is in the checkpoint
    assert plan_replay(records, 3, 7, True, outer)[0] == tuple(records[1:])  # its update in flight comes first
    for step, version, why in [
        (5, 10, "no round after"),
        (1, 6, "has a gap"),
        (3, 9, "moves from version 8"),
    ]:
        replayed, reason = plan_replay(records, step, version, False, outer)
        assert replayed == () and why in reason, reason
    compressed = [_record(3, 8), _record(4, 9, senders=())]  # one aggregate went down, made from what?
    assert "made from contributions the log does not hold" in plan_replay(compressed, 3, 8, False, outer)[1]
    logged = dataclasses.replace(compressed[1], contributions=StateUpdate(0.1, (), ()))
    assert plan_replay([compressed[0], logged], 3, 8, False, outer)[0] == (compressed[0], logged)


def test_the_run_key_is_kept_for_its_owner_alone(tmp_path: Path) -> None:
    assert load_run_key(tmp_path) is None
    key = bytes(range(32))
    save_run_key(tmp_path / "checkpoints", key)
    path = tmp_path / "checkpoints" / "run.key"
    assert load_run_key(tmp_path / "checkpoints") == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("ab" * 8 + "\n")  # 8 bytes: too short to be a key
    with pytest.raises(ValueError, match="fewer than 16"):
        load_run_key(tmp_path / "checkpoints")
    path.write_text("not hex")
    with pytest.raises(ValueError, match="holds no run key"):
        load_run_key(tmp_path / "checkpoints")


def test_resume_from_names_a_checkpoint_directory_or_a_step_in_it(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "step-00000005").mkdir(parents=True)
    (root / "step-00000005" / "meta.json").write_text("{}")
    assert resume_root(root) == root
    assert resume_root(root / "step-00000005") == root
