"""A run's checkpoints (coordinator.checkpointer.RunCheckpointer): what a save holds comes back on restore,
into fresh components, so that a resumed run goes on as if it had not stopped. No network: the workers are
stand-ins whose ``fetch_worker_state`` answers (or fails) at once."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from gradwire.assets import corpus_path, default_tokenizer
from gradwire.compression import robust
from gradwire.coordinator.checkpoint import load_checkpoint
from gradwire.coordinator.checkpointer import RunCheckpointer, RunPosition, worker_key
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.data import TokenSource, open_data
from gradwire.coordinator.decisions import Score, Standing
from gradwire.coordinator.gather import Gatherer
from gradwire.coordinator.outer import DeltaOuter, OuterStrategy, make_outer
from gradwire.coordinator.round import WorkerSlot
from gradwire.link import Traffic, WorkerError
from gradwire.models import resolve_model
from gradwire.protocol import WorkerState

RUN_ID = "run-1"


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWIRE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as p:
        yield p


class FakeLink:
    """A worker that holds ``state`` (or whose fetch fails with ``WorkerError`` when it is None)."""

    def __init__(self, address: str, state: WorkerState | None = None) -> None:
        self.address = address
        self.state = state
        self.fetches: list[tuple[str, float | None]] = []

    def fetch_worker_state(self, run_id: str, timeout: float | None = None) -> tuple[WorkerState, Traffic]:
        self.fetches.append((run_id, timeout))
        if self.state is None:
            raise WorkerError(self.address, grpc.StatusCode.UNAVAILABLE, "connection refused")
        return self.state, Traffic(up=1000)


def worker(index: int, address: str, seed: int | None, *, inner: bool = True, version: int | None = 2) -> WorkerSlot:
    """A slot whose worker holds seeded error feedback (and inner optimizer state); ``seed`` None: unreachable."""
    state = None
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        feedback = {"wte.weight": torch.randn(4, 3, generator=g), "head.bias": torch.randn(5, generator=g)}
        inner_state = {"exp_avg.0": torch.randn(6, generator=g)} if inner else {}
        state = WorkerState(RUN_ID, 2, feedback, inner_state)
    return WorkerSlot(index, FakeLink(address, state), version=version)  # type: ignore[arg-type]


def config(tmp_path: Path, **changes: object) -> TrainConfig:
    settings: dict[str, object] = {
        "model": "gpt-tiny",
        "steps": 9,
        "batch_size": 2,
        "sequence_length": 32,
        "outer_optimizer": "sgd",
        "momentum": 0.9,
        "learning_rate": 0.1,
        "checkpoint_every": 3,
        "keep_checkpoints": 0,
        "round_timeout": 5.0,
        "output_dir": str(tmp_path / "run"),
        **changes,
    }
    return TrainConfig(**settings)  # type: ignore[arg-type]


@dataclasses.dataclass
class Run:
    outer: OuterStrategy
    gather: Gatherer
    data: TokenSource
    checkpoints: RunCheckpointer


def a_run(cfg: TrainConfig, pool: ThreadPoolExecutor, model_seed: int = 0) -> Run:
    """The components a trainer would build for ``cfg`` (the model from ``model_seed``)."""
    resolved = resolve_model(cfg.model, from_scratch=True, seed=model_seed)
    outer = make_outer(resolved.model, cfg.update_rule(), cfg.codec_config(), resolved.spec, cfg.seed)
    gather = Gatherer(outer.codec, clip_factor=cfg.clip_factor, bench_after=cfg.bench_after, bench_rounds=20)
    data = open_data(
        paths=[str(corpus_path())],
        tokenizer=default_tokenizer(),
        seq_len=cfg.sequence_length,
        streaming=True,  # a stream has layouts to keep
        n_slots=2,
        val_rows=4,
    )
    checkpoints = RunCheckpointer(Path(cfg.output_dir) / "checkpoints", cfg, outer, data, gather, pool, RUN_ID)
    return Run(outer, gather, data, checkpoints)


def outer_step(outer: OuterStrategy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    shapes = {n: p.shape for n, p in outer.replica.params.items()}
    sent = tuple(outer.codec.compress({n: torch.randn(s, generator=g) for n, s in shapes.items()}) for _ in range(2))
    weights = (64.0, 32.0)
    outer.step(robust.aggregate(outer.codec, sent, weights), sent, weights, 0.1, senders=(0, 1), round=seed)


def assert_tensors_equal(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> None:
    assert a is not None and b is not None
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_same_model(a: OuterStrategy, b: OuterStrategy) -> None:
    for (name, p), (other, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert name == other and torch.equal(p, q), name
    for name, p in a.replica.params.items():
        assert torch.equal(p, b.replica.params[name]), name


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_restore_brings_back_what_save_held(tmp_path: Path, pool: ThreadPoolExecutor, optimizer: str) -> None:
    changes = {"outer_optimizer": optimizer, "momentum": 0.9 if optimizer == "sgd" else None, "learning_rate": 1e-3}
    cfg = config(tmp_path, **changes)
    run = a_run(cfg, pool)
    outer_step(run.outer, 1)
    outer_step(run.outer, 2)  # its update still pending: the save applies it first
    run.gather.norms.extend([1.0, 2.5, 4.0])
    run.data.set_layout(0, [2, 2])
    run.data.set_layout(3, [2, 4])  # a worker joined at step 3, a node of two ranks
    slots = [worker(0, "10.0.0.1:50051", seed=10), worker(1, "10.0.0.2:50051", seed=11, inner=False)]
    rng = torch.get_rng_state()
    path = run.checkpoints.save(RunPosition(6, 12345), slots)
    assert path.name == "step-00000006"
    assert run.outer.replica.version == run.outer.target_version == 2  # the save applied the pending update
    assert [s.client.fetches for s in slots] == [[(RUN_ID, 5.0)]] * 2  # type: ignore[attr-defined]

    torch.rand(100)  # the RNG moves on after the save
    fresh = a_run(cfg, pool, model_seed=1)  # other weights, no norms, no layouts
    assert not torch.equal(next(fresh.outer.model.parameters()), next(run.outer.model.parameters()))
    back = [worker(0, "10.0.0.1:50051", None, version=5), worker(1, "10.0.0.2:50051", None, version=5)]
    assert fresh.checkpoints.restore(path, back) == RunPosition(6, 12345)

    assert_same_model(run.outer, fresh.outer)
    assert fresh.outer.replica.version == fresh.outer.base_version == 2 and fresh.outer.pending is None
    assert fresh.outer.base_fingerprint == run.outer.replica.fingerprint()
    assert torch.equal(torch.get_rng_state(), rng)
    assert list(fresh.gather.norms) == [1.0, 2.5, 4.0]
    assert fresh.data.layouts == run.data.layouts == [(0, 0, (2, 2)), (3, 384, (2, 4))]
    np.testing.assert_array_equal(fresh.data.batch(4, 1, 4, 32), run.data.batch(4, 1, 4, 32))
    for slot, saved in zip(back, slots):
        state = saved.client.state  # type: ignore[attr-defined]
        assert_tensors_equal(slot.feedback, state.feedback)
        assert slot.version is None  # its state goes to the worker with the next push
    assert_tensors_equal(back[0].inner_optimizer, slots[0].client.state.inner_optimizer)  # type: ignore[attr-defined]
    assert back[1].inner_optimizer is None  # it had none

    if isinstance(run.outer, DeltaOuter):
        assert isinstance(fresh.outer, DeltaOuter)
        assert_tensors_equal(fresh.outer.feedback.state_dict(), run.outer.feedback.state_dict())
        for p, q in zip(run.outer.model.parameters(), fresh.outer.model.parameters()):
            assert_tensors_equal(fresh.outer.optimizer.state[q], run.outer.optimizer.state[p])
    else:
        for m, n in zip(run.outer.replica.momentum, fresh.outer.replica.momentum, strict=True):
            assert torch.equal(m, n)
    # And the run goes on as if it had not stopped: the same next step lands on the same weights.
    for outer in (run.outer, fresh.outer):
        outer_step(outer, 3)
        outer.apply_pending()
    assert_same_model(run.outer, fresh.outer)


def test_worker_state_follows_the_address_then_the_position(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    cfg = config(tmp_path)
    run = a_run(cfg, pool)
    slots = [worker(0, "10.0.0.1:50051", seed=10), worker(1, "10.0.0.2:50051", seed=11)]
    path = run.checkpoints.save(RunPosition(3, 0), slots)
    states = [s.client.state for s in slots]  # type: ignore[attr-defined]

    # The same workers in another order (and one more): each takes its own, by address.
    swapped = [worker(0, "10.0.0.2:50051", None), worker(1, "10.0.0.1:50051", None), worker(2, "10.0.0.3:1", None)]
    run.checkpoints.restore(path, swapped)
    assert_tensors_equal(swapped[0].feedback, states[1].feedback)
    assert_tensors_equal(swapped[1].feedback, states[0].feedback)
    assert_tensors_equal(swapped[1].inner_optimizer, states[0].inner_optimizer)
    assert (swapped[2].feedback, swapped[2].inner_optimizer) == (None, None)  # a position the save did not have

    # Fresh workers at new addresses (restarted --local workers): each takes the state of its position.
    moved = [worker(0, "127.0.0.1:40001", None), worker(1, "127.0.0.1:40002", None)]
    run.checkpoints.restore(path, moved)
    for slot, state in zip(moved, states):
        assert_tensors_equal(slot.feedback, state.feedback)
        assert_tensors_equal(slot.inner_optimizer, state.inner_optimizer)


def test_how_each_worker_stood_is_restored_with_it(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """Strikes, benching, the agreement score and spot checks survive a resume, by address (a benched worker
    stays benched; a sign flipper keeps its low score)."""
    run = a_run(config(tmp_path), pool)
    slots = [worker(0, "10.0.0.1:50051", seed=10), worker(1, "10.0.0.2:50051", seed=11)]
    slots[0].standing = Standing(2, 0, Score(-0.45, 7))
    slots[0].checks = (3, 0)
    slots[1].standing = Standing(0, 29, Score())
    slots[1].checks = (1, 1)
    path = run.checkpoints.save(RunPosition(9, 0), slots)
    swapped = [worker(0, "10.0.0.2:50051", None), worker(1, "10.0.0.1:50051", None), worker(2, "10.0.0.3:1", None)]
    a_run(config(tmp_path), pool).checkpoints.restore(path, swapped)
    assert (swapped[0].standing, swapped[0].checks) == (Standing(0, 29, Score()), (1, 1))
    assert swapped[0].standing.benched(10)
    assert (swapped[1].standing, swapped[1].checks) == (Standing(2, 0, Score(-0.45, 7)), (3, 0))
    assert (swapped[2].standing, swapped[2].checks) == (Standing(), (0, 0))  # a worker the save did not have


def test_an_unreachable_worker_is_saved_without_its_state(
    tmp_path: Path, pool: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path)
    run = a_run(cfg, pool)
    slots = [worker(0, "10.0.0.1:50051", seed=10), worker(1, "10.0.0.2:50051", seed=None)]
    with caplog.at_level(logging.WARNING, logger="gradwire.coordinator.checkpointer"):
        path = run.checkpoints.save(RunPosition(3, 0), slots)
    assert "no error feedback or inner optimizer state from worker 1" in caplog.text
    tensors, meta = load_checkpoint(path)
    good, bad = worker_key(slots[0]), worker_key(slots[1])
    assert (good, bad) == ("w-10.0.0.1_50051", "w-10.0.0.2_50051")
    assert {f"feedback-{good}", f"inner-{good}"} <= tensors.keys()
    assert not {f"feedback-{bad}", f"inner-{bad}"} & tensors.keys()
    assert meta["worker_keys"] == [good, bad] and meta["workers"] == 2

    back = [worker(0, "10.0.0.1:50051", None), worker(1, "10.0.0.2:50051", None)]
    run.checkpoints.restore(path, back)
    assert_tensors_equal(back[0].feedback, slots[0].client.state.feedback)  # type: ignore[attr-defined]
    assert (back[1].feedback, back[1].inner_optimizer) == (None, None)


def test_a_known_worker_without_saved_state_never_takes_another_workers(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """The position rule is for workers at new addresses: a worker the checkpoint names, whose state could
    not be fetched, starts afresh rather than with the error feedback of whoever had its position."""
    cfg = config(tmp_path)
    run = a_run(cfg, pool)
    slots = [worker(0, "10.0.0.1:50051", seed=None), worker(1, "10.0.0.2:50051", seed=11)]
    path = run.checkpoints.save(RunPosition(3, 0), slots)
    swapped = [worker(0, "10.0.0.2:50051", None), worker(1, "10.0.0.1:50051", None)]
    run.checkpoints.restore(path, swapped)
    assert_tensors_equal(swapped[0].feedback, slots[1].client.state.feedback)  # type: ignore[attr-defined]
    assert (swapped[1].feedback, swapped[1].inner_optimizer) == (None, None)


def test_a_worker_not_pushed_since_a_resume_keeps_what_the_checkpoint_gave(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    run = a_run(config(tmp_path), pool)
    slot = worker(0, "10.0.0.1:50051", seed=10, version=None)
    slot.feedback = {"wte.weight": torch.full((2, 2), 7.0)}
    path = run.checkpoints.save(RunPosition(3, 0), [slot])
    assert slot.client.fetches == []  # type: ignore[attr-defined]  # its worker holds nothing of this run yet
    tensors, _ = load_checkpoint(path)
    assert_tensors_equal(tensors[f"feedback-{worker_key(slot)}"], slot.feedback)
    assert f"inner-{worker_key(slot)}" not in tensors


def test_maybe_save_every_n_steps_but_not_at_the_last(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    run = a_run(config(tmp_path, steps=9, checkpoint_every=3), pool)
    saved = [step for step in range(1, 10) if run.checkpoints.maybe_save(RunPosition(step, 0), []) is not None]
    assert saved == [3, 6]  # 9 is the run's end, which saves on its own
    root = Path(config(tmp_path).output_dir) / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000003", "step-00000006"]

    never = a_run(config(tmp_path / "never", checkpoint_every=0), pool)
    assert all(never.checkpoints.maybe_save(RunPosition(step, 0), []) is None for step in range(1, 10))


def test_restore_refuses_a_checkpoint_of_another_model(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    run = a_run(config(tmp_path), pool)
    path = run.checkpoints.save(RunPosition(3, 0), [])
    other = a_run(config(tmp_path), pool, model_seed=1)
    other.checkpoints.config = config(tmp_path, model="gpt-5m")
    before = {n: p.clone() for n, p in other.outer.model.named_parameters()}
    with pytest.raises(ValueError, match="--resume-from holds a gpt-tiny run, not --model gpt-5m"):
        other.checkpoints.restore(path, [])
    assert_tensors_equal(dict(other.outer.model.named_parameters()), before)  # nothing was loaded
