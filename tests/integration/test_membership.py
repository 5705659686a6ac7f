"""Workers join and leave a running job through --workers-file: a new one gets the state and contributes
from its next round, a removed one stops getting work, and the rows of a round stay disjoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.membership import WorkersFile, diff_members, parse_addresses
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.worker.engine import WorkerEngine

from ..faults import faulty
from .conftest import live_workers, worker_process

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_parse_and_diff() -> None:
    assert parse_addresses("a:1, b:2\n# gone:3\n\nc:4  # the new one\na:1\n") == ["a:1", "b:2", "c:4"]
    with pytest.raises(ValueError, match="host:port"):
        parse_addresses("nohost\n")
    assert diff_members(["a:1", "b:2"], ["b:2", "c:3"]) == (["c:3"], ["a:1"])


def test_a_workers_file_change_adds_and_removes_workers_between_rounds(tmp_path: Path) -> None:
    listing = tmp_path / "workers.txt"
    with live_workers(3) as workers:
        a, b, c = (w.address for w in workers)
        listing.write_text(f"{a}\n{b}\n")
        members = WorkersFile(listing)
        members.poll()

        def connect(address: str) -> WorkerClient:
            return WorkerClient(address, timeout=30)

        config = TrainConfig(
            model="gpt-tiny", steps=9, batch_size=2, sequence_length=32, output_dir=str(tmp_path / "run")
        )
        trainer = Trainer(config, [connect(a), connect(b)], progress=False, members=members, connect=connect)
        rows: dict[int, list] = {}
        step_batch = trainer.planner.batch  # every batch the run cuts

        def spy(step: int, position: int, ranks: int = 1):
            batch = step_batch(step, position, ranks)
            rows.setdefault(step, []).append(batch)
            return batch

        trainer.planner.batch = spy
        try:
            trainer.connect()
            for _ in range(3):
                trainer.train_step()
            time.sleep(0.01)
            listing.write_text(f"{a}\n{b}\n{c}   # joins\n")
            trainer.train_step()  # c gets the state in the background meanwhile
            deadline = time.monotonic() + 30
            while trainer.rounds.joining and time.monotonic() < deadline:
                time.sleep(0.01)
            for _ in range(2):
                trainer.train_step()
            listing.write_text(f"{b}, {c}\n")  # a leaves
            for _ in range(3):
                trainer.train_step()
        finally:
            trainer.close()
        assert [s.client.address for s in trainer.slots] == [b, c]
        # a computed rounds 0-5 (the last at version 5) and got no work after it left; c got the state during
        # round 3 and worked from round 4.
        assert list(workers[0].engine.sessions.values())[0].replica.version == 5
        assert list(workers[2].engine.sessions.values())[0].replica.version == 8
    for step, batches in rows.items():  # disjoint rows within every round
        flat = [tuple(r) for b in batches for r in b.tolist()]
        assert len(flat) == len(set(flat)), step
    assert [len(rows[s]) for s in range(9)] == [2, 2, 2, 2, 3, 3, 2, 2, 2]  # c works from the round after its push


def test_a_joiner_whose_state_push_stalls_holds_no_round(tmp_path: Path) -> None:
    """The state travels to a new worker in the background: the rounds go on without it meanwhile, and
    once it has landed the worker catches up on what it missed by replay (no second push) and trains."""
    listing = tmp_path / "workers.txt"
    with live_workers(2, [lambda: WorkerEngine("cpu"), faulty("stall-push", factor=3.0)]) as workers:
        a, slow = (w.address for w in workers)
        listing.write_text(f"{a}\n")
        members = WorkersFile(listing)
        members.poll()

        def connect(address: str) -> WorkerClient:
            return WorkerClient(address, timeout=30)

        config = TrainConfig(
            model="gpt-tiny", steps=20, batch_size=2, sequence_length=32, output_dir=str(tmp_path / "run")
        )
        trainer = Trainer(config, [connect(a)], progress=False, members=members, connect=connect)
        try:
            trainer.connect()
            trainer.train_step()
            listing.write_text(f"{a}\n{slow}\n")
            t0 = time.monotonic()
            during = [trainer.train_step() for _ in range(3)]
            assert time.monotonic() - t0 < 2.5  # the 3 s push held none of them
            assert [r["successful_workers"] for r in during] == [1, 1, 1] and during[0]["pushes"] == 1
            deadline = time.monotonic() + 30
            while trainer.rounds.joining and time.monotonic() < deadline:  # the push lands, 3 s on
                time.sleep(0.01)
            after = [trainer.train_step() for _ in range(2)]
        finally:
            trainer.close()
    assert [r["successful_workers"] for r in after] == [2, 2]
    assert after[0]["pushes"] == 0 and after[0]["catch_ups"] == 1  # replayed what it missed, no second push
    assert workers[1].engine.pushes == 1


def test_streamed_data_follows_a_worker_that_joins_and_a_resume_keeps_the_layout(tmp_path: Path) -> None:
    """--streaming with a worker joining mid-run: every round's rows go on from where the last ended
    (no window twice, none skipped), and a run resumed after the join cuts the same rows as the one that
    went straight on."""
    from gradwire.assets import corpus_path

    data = tmp_path / "corpus.txt"
    data.write_text(corpus_path().read_text(encoding="utf-8")[:300_000], encoding="utf-8")
    listing = tmp_path / "workers.txt"

    def connect(address: str) -> WorkerClient:
        return WorkerClient(address, timeout=30)

    def trainer_for(out: str, clients: list[str], resume: str | None = None) -> tuple[Trainer, dict[int, list]]:
        members = WorkersFile(listing)
        members.poll()
        config = TrainConfig(
            model="gpt-tiny",
            steps=6,
            batch_size=2,
            sequence_length=32,
            output_dir=str(tmp_path / out),
            data=(str(data),),
            streaming=True,
            checkpoint_every=0,
            resume_from=resume,
        )
        trainer = Trainer(config, [connect(c) for c in clients], progress=False, members=members, connect=connect)
        rows: dict[int, list] = {}
        cut = trainer.planner.batch  # every batch the run cuts

        def spy(step: int, position: int, ranks: int = 1):
            rows.setdefault(step, []).append(cut(step, position, ranks))
            return rows[step][-1]

        trainer.planner.batch = spy
        return trainer, rows

    with live_workers(2) as workers:
        a, b = (w.address for w in workers)
        listing.write_text(f"{a}\n")
        straight, rows = trainer_for("straight", [a])
        try:
            straight.connect()
            for step in range(6):
                if step == 2:
                    listing.write_text(f"{a}\n{b}\n")  # b joins: it gets the state during round 2
                straight.train_step()
                if step == 2:
                    deadline = time.monotonic() + 30
                    while straight.rounds.joining and time.monotonic() < deadline:
                        time.sleep(0.01)
                    checkpoint = straight.save_checkpoint()
        finally:
            straight.close()
        assert [len(rows[s]) for s in range(6)] == [1, 1, 1, 2, 2, 2]  # b's rows from the round it works in
        ordered = np.concatenate([np.concatenate(rows[s]) for s in range(6)])
        assert len({r.tobytes() for r in ordered}) == len(ordered)  # no window twice, across workers and rounds
        assert all(
            ordered[i][-1] == ordered[i + 1][0] for i in range(len(ordered) - 1)
        )  # none skipped: they tile the stream
        resumed, rows_after = trainer_for("resumed", [a, b], resume=str(checkpoint))
        try:
            resumed.run()
        finally:
            resumed.close()
    assert sorted(rows_after) == [3, 4, 5]
    for step in (3, 4, 5):
        assert [r.tobytes() for r in rows_after[step]] == [r.tobytes() for r in rows[step]], step


@pytest.mark.slow
def test_coordinator_train_with_a_workers_file_picks_up_a_new_worker(tmp_path: Path) -> None:
    from gradwire.transport import free_port

    ports = [free_port() for _ in range(2)]
    procs = [worker_process(p) for p in ports]
    listing = tmp_path / "workers.txt"
    listing.write_text(f"127.0.0.1:{ports[0]}\n")
    out = tmp_path / "run"
    try:
        coordinator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradwire.coordinator",
                "train",
                "--workers-file",
                str(listing),
                "--model",
                "gpt-tiny",
                "--steps",
                "100",
                "--batch-size",
                "2",
                "--sequence-length",
                "32",
                "--output-dir",
                str(out),
                "--no-progress",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 5):
            assert coordinator.poll() is None and time.monotonic() < deadline, coordinator.communicate()[1][-3000:]
            time.sleep(0.1)
        listing.write_text(f"127.0.0.1:{ports[0]}\n127.0.0.1:{ports[1]}\n")
        _, stderr = coordinator.communicate(timeout=300)
        assert coordinator.returncode == 0, stderr[-3000:]
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    records = read_metrics(out)
    workers = [r["successful_workers"] for r in records]
    # the new worker got the state in the background while the first trained on, then worked to the end
    assert workers[0] == 1 and workers[-1] == 2 and "joins the run" in stderr and "in the background" in stderr
