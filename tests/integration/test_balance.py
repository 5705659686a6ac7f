"""Work sized to each worker (--balance): a worker slowed on purpose gets a smaller share within a few
rounds, no round waits for it past the grace, and the global batch is what it was, every row of the
stream trained exactly once (the row ledger)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.inputs import load_inputs
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.outer import OuterStrategy
from gradwire.coordinator.round import RoundWork
from gradwire.coordinator.trainer import Trainer
from gradwire.worker.engine import WorkerEngine

from ..faults import faulty
from .conftest import live_workers

STEPS = 9


def _run(config: TrainConfig, factor: float) -> tuple[Trainer, dict[int, list[np.ndarray]], list[int]]:
    """Train ``config`` with an honest worker and one computing ``factor`` x slower (two in-process workers
    keep the machine's two cores apart); the rows each round's orders carried, by round, in slot order (a
    retried round's replace its first try's)."""
    ledger: dict[int, list[np.ndarray]] = {}

    def honest() -> WorkerEngine:
        return WorkerEngine("cpu")

    with live_workers(2, [honest, faulty("slow", factor=factor)]) as workers:
        trainer = Trainer(config, [w.client() for w in workers], progress=False)
        plan = trainer.round_work

        def spy(step: int, slots: list) -> RoundWork:
            work = plan(step, slots)
            ledger[step] = list(work.batches.values())
            return work

        trainer.round_work = spy  # type: ignore[method-assign]
        try:
            trainer.run()
        finally:
            trainer.close()
        slowed = workers[1].engine.injected  # type: ignore[attr-defined]
    return trainer, ledger, slowed


def _config(tmp_path: Path, **overrides: object) -> TrainConfig:
    from gradwire.assets import corpus_path

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "corpus.txt"
    data.write_text(corpus_path().read_text(encoding="utf-8")[:100_000], encoding="utf-8")
    base = dict(
        model="gpt-tiny",
        steps=STEPS,
        sequence_length=64,
        output_dir=str(tmp_path / "run"),
        data=(str(data),),
        streaming=True,  # rows cut in stream order: the ledger can say none was trained twice or skipped
        checkpoint_every=0,
        min_workers=1,  # once the fast worker is in, the round waits 3 x its time for the slow one, no longer
        straggler_grace="3x",
    )
    return TrainConfig(**{**base, **overrides})  # type: ignore[arg-type]


def _assert_every_row_trained_once(config: TrainConfig, ledger: dict[int, list[np.ndarray]]) -> None:
    """The rows of every round are the stream's next consecutive windows: none twice, none skipped (every
    round kept every worker's contribution: see the records). In any order within a round: ``steps`` mode
    gives each worker its inner steps' rows one after the other."""
    assert sorted(ledger) == list(range(config.steps))
    total = sum(len(b) for step in ledger for b in ledger[step])
    reference = load_inputs(config, 1).data
    reference.set_layout(0, [total])
    stream, start = reference.batch(0, 0, total, config.sequence_length), 0
    for step in range(config.steps):
        sent = np.concatenate(ledger[step])
        expected = stream[start : start + len(sent)]
        start += len(sent)
        assert sorted(r.tobytes() for r in sent) == sorted(r.tobytes() for r in expected), step
    assert len({r.tobytes() for r in stream}) == total


def test_a_slowed_worker_gets_about_a_third_the_rows_and_every_row_is_trained_once(tmp_path: Path) -> None:
    # 16 rows a worker and a 3x slowdown: a round's compute outweighs the scheduler's noise on a loaded
    # machine, and the slowed worker's time stays far past the 25% the shares wait for. The grace, 6x the
    # fast worker's time, stays as far past the slowdown: no round cuts the slowed worker off.
    rows = 16
    config = _config(tmp_path, batch_size=rows, straggler_grace="6x")
    trainer, ledger, slowed = _run(config, factor=3.0)
    records = read_metrics(tmp_path / "run")
    assert slowed and [r["step"] for r in records] == list(range(1, STEPS + 1))
    # Every round closed with both in (no straggler cut off after the grace), the global batch unchanged.
    assert all((r["successful_workers"], r["stragglers"], r["rejected"]) == (2, 0, 0) for r in records)
    assert all(sum(r["worker_rows"].values()) == 2 * rows for r in records)
    assert trainer.total_tokens == STEPS * 2 * rows * 64
    fast, slow = (s.client.address for s in trainer.slots)
    assert records[0]["worker_rows"] == {fast: rows, slow: rows}  # nothing measured yet
    # Within a few rounds the slowed worker's share is about a third of the other's (a little more: the time
    # a round takes besides the compute is not slowed; and shares move only past a 25% imbalance), and
    # stays so. On a loaded machine the measured speeds scatter: one CI run saw 5 rows against 27.
    for r in records[-3:]:
        shares = r["worker_rows"]
        assert 0.12 <= shares[slow] / shares[fast] <= 0.65, shares
        assert r["worker_tokens_per_sec"][slow] < r["worker_tokens_per_sec"][fast]
    _assert_every_row_trained_once(config, ledger)


def test_balance_steps_gives_a_slowed_worker_fewer_inner_steps(tmp_path: Path) -> None:
    """--balance steps in local-SGD rounds: shares in whole inner steps of the worker's rows, the slow one
    taking fewer; the rows of the round are the same stream windows, cut differently."""
    config = _config(tmp_path, batch_size=4, inner_steps=3, balance="steps", min_workers=0)  # every round waits
    trainer, ledger, _ = _run(config, factor=3.0)
    records = read_metrics(tmp_path / "run")
    seen = [
        (list(r["worker_rows"].values()), list(r["worker_tokens_per_sec"].values()), r["stragglers"], r["rejected"])
        for r in records
    ]
    assert all((r["successful_workers"], r["stragglers"], r["rejected"]) == (2, 0, 0) for r in records), seen
    assert all(sum(r["worker_rows"].values()) == 2 * 3 * 4 for r in records)
    assert all(n % 4 == 0 for r in records for n in r["worker_rows"].values())  # whole inner steps
    slow = trainer.slots[1].client.address
    assert records[-1]["worker_rows"][slow] < 3 * 4, seen  # fewer than its default three inner steps
    _assert_every_row_trained_once(config, ledger)


def test_a_resumed_run_sends_the_rows_the_run_that_went_on_sends_next(tmp_path: Path) -> None:
    """The balancer's estimates and shares travel in the checkpoint: the round after a resume is planned
    as it was in the run that went straight on (at fresh worker addresses, by position)."""
    config = _config(tmp_path, batch_size=4, sequence_length=32, steps=8, checkpoint_every=7, min_workers=0)
    straight, ledger, _ = _run(config, factor=3.0)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000007"
    resumed_config = _config(tmp_path / "b", batch_size=4, sequence_length=32, steps=8, resume_from=str(checkpoint))
    with live_workers(2) as workers:
        resumed = Trainer(resumed_config, [w.client() for w in workers], progress=False)
        try:
            assert resumed.step == 7
            work = resumed.round_work(7, resumed.slots)
        finally:
            resumed.close()
    assert straight.step == 8 and [b.shape[0] for b in ledger[7]] != [4, 4]  # the shares had moved
    assert [b.shape for b in work.batches.values()] == [b.shape for b in ledger[7]]
    for a, b in zip(work.batches.values(), ledger[7]):
        np.testing.assert_array_equal(a, b)


def test_a_coordinator_busy_applying_the_update_still_times_each_worker_by_its_own_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both answers come in while the round's own thread applies the pending update (slowed here past both
    workers' rounds): each is timed when it arrived, not when that thread next looked, so the balancer
    still sees the slowed worker as the slower (timed at the look, both were equally fast and no share
    ever moved: a CI run saw exactly that)."""
    applied = OuterStrategy.apply_pending

    def busy(self: OuterStrategy, *args: object, **kwargs: object) -> None:
        applied(self, *args, **kwargs)  # type: ignore[arg-type]
        time.sleep(0.8)

    monkeypatch.setattr(OuterStrategy, "apply_pending", busy)
    trainer, _, slowed = _run(_config(tmp_path, batch_size=16, steps=3), factor=3.0)
    records = read_metrics(tmp_path / "run")
    fast, slow = (s.client.address for s in trainer.slots)
    assert slowed and len(records) == 3
    for r in records[1:]:
        rates = r["worker_tokens_per_sec"]
        # Slowed 3x on 16 rows a round; a loaded machine shrinks the ratio (at 2x on 8 rows, 1.24 seen while
        # the suite ran, and 0.71 with two benchmarks beside it), timing at the look makes it ~1.
        assert rates[slow] * 1.15 < rates[fast], rates
