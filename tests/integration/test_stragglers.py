"""Stragglers: once --min-workers results are in, a round waits --straggler-grace for the rest and then
cuts them off; a cut-off worker rejoins the next round without a state push (its missed update replays)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from gradwire.coordinator import round as round_module
from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.link import WorkerError
from gradwire.transport import free_port
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import InProcessClient, in_process_clients

from ..faults import faulty
from .conftest import live_workers, train, worker_process
from .test_node import wait_listening

STALLED = {2, 3}


def test_a_stalled_worker_is_cut_off_after_the_grace_and_rejoins_without_a_push(tmp_path: Path) -> None:
    config = TrainConfig(
        model="gpt-tiny",
        steps=7,
        batch_size=2,
        sequence_length=32,
        output_dir=str(tmp_path),
        min_workers=2,
        straggler_grace="0.3",
    )

    def honest() -> WorkerEngine:
        return WorkerEngine("cpu")

    with live_workers(3, [honest, honest, faulty("stall", factor=20.0, rounds=STALLED)]) as workers:
        trainer = train(config, workers)
        trainer.flush()
        session = next(iter(workers[2].engine.sessions.values()))
        if session.replica.version < trainer.replica.version:
            session.replica.apply(trainer.outer.pending)
        for name, p in trainer.replica.params.items():
            assert torch.equal(session.replica.params[name], p), name
    records = {r["step"]: r for r in read_metrics(tmp_path)}
    for step in (3, 4):  # rounds 2 and 3: cut off after the grace, not after 20 s
        assert (records[step]["successful_workers"], records[step]["stragglers"]) == (2, 1)
        assert records[step]["step_time"] < 5.0
    assert records[5]["successful_workers"] == 3 and records[5]["stragglers"] == 0
    assert sum(r["pushes"] for r in records.values()) == 3  # the first round's, and never again


def test_a_factor_grace_and_no_quorum_wait_for_everyone(tmp_path: Path) -> None:
    config = TrainConfig(
        model="gpt-tiny", steps=3, batch_size=2, sequence_length=32, output_dir=str(tmp_path)
    )  # min_workers 0
    with live_workers(2, [lambda: WorkerEngine("cpu"), faulty("stall", factor=1.0, rounds={1})]) as workers:
        train(config, workers)
    records = {r["step"]: r for r in read_metrics(tmp_path)}
    assert records[2]["successful_workers"] == 2 and records[2]["step_time"] >= 1.0


@pytest.mark.slow
def test_a_sigstopped_worker_process_does_not_hold_rounds_and_rejoins_after_sigcont(tmp_path: Path) -> None:
    procs, clients = [], []
    try:
        for _ in range(3):
            port = free_port()
            procs.append(worker_process(port))
            clients.append(WorkerClient(f"127.0.0.1:{port}", timeout=60))
        config = TrainConfig(
            model="gpt-tiny",
            steps=10,
            batch_size=2,
            sequence_length=32,
            output_dir=str(tmp_path),
            min_workers=2,
            straggler_grace="0.5",
        )
        for proc, client in zip(procs, clients):  # listening, before the clients dial (and back off)
            wait_listening(int(client.address.rpartition(":")[2]), proc, 60.0)
        trainer = Trainer(config, clients, progress=False)
        try:
            trainer.connect()
            records = [trainer.train_step() for _ in range(2)]
            procs[2].send_signal(signal.SIGSTOP)
            records += [trainer.train_step() for _ in range(3)]
            procs[2].send_signal(signal.SIGCONT)
            records += [trainer.train_step() for _ in range(3)]
        finally:
            trainer.close()
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(30)
        for c in clients:
            c.close()
    stopped, resumed = records[2:5], records[5:]
    assert all(r["stragglers"] == 1 and r["successful_workers"] == 2 and r["step_time"] < 10 for r in stopped)
    assert resumed[-1]["successful_workers"] == 3
    assert sum(r["pushes"] for r in records) == 3  # rejoined by replaying what it missed, never pushed again


def test_a_state_push_in_flight_can_be_cancelled() -> None:
    """A straggler cut-off cancels whatever call the worker is in, a state push included."""
    import threading
    import time

    import grpc

    from gradwire.coordinator.client import WorkerError
    from gradwire.models import build_from_spec, model_spec
    from gradwire.protocol import ModelState

    spec = model_spec("gpt-tiny")
    model = build_from_spec(spec)
    state = ModelState(
        "run-1", 0, json.dumps(spec), {n: p.detach() for n, p in model.named_parameters()}, '{"optimizer": "signsgd"}'
    )
    pushed = threading.Event()  # set once the worker is done with the push, however it ended

    def stalling() -> WorkerEngine:
        engine = faulty("stall-push", factor=4.0)()
        push_parts = engine.push_parts

        def push_and_tell(*args: object, **kwargs: object) -> object:
            try:
                return push_parts(*args, **kwargs)
            finally:
                pushed.set()

        engine.push_parts = push_and_tell  # what the servicer calls
        return engine

    with live_workers(1, stalling) as (worker,):
        client = worker.client(timeout=30)
        errors: list[WorkerError] = []

        def push() -> None:
            try:
                client.push_state(state)
            except WorkerError as e:
                errors.append(e)

        thread = threading.Thread(target=push)
        t0 = time.monotonic()
        thread.start()
        time.sleep(0.5)
        client.cancel()
        thread.join(10)
        assert time.monotonic() - t0 < 3.0 and [e.code for e in errors] == [grpc.StatusCode.CANCELLED]
        # The worker itself sits out the push (4 s) and then ends it (the stream it reads was cancelled);
        # let it, before another test shares this process (building a model draws from torch's global
        # generator, which the next run's seed would meet).
        pushed.wait(30)


class _LostCall(InProcessClient):
    """A link whose round-2 call neither its deadline nor its cancel ends (gRPC lost track of it), until the
    test releases it."""

    release = threading.Event()

    def run_round(self, order, timeout=None, on_piece=None):  # noqa: ANN001, ANN201 - the link's
        if order.round == 2:
            self.release.wait(60)
            raise WorkerError(self.address, grpc.StatusCode.UNAVAILABLE, "the lost call ended at last")
        return super().run_round(order, timeout, on_piece)


def test_a_call_that_no_cancel_ends_is_given_up_on_and_the_run_goes_on(tmp_path: Path, monkeypatch) -> None:
    """Worker 1's round-2 call never returns: the round closes after the grace, cancels it, waits
    CANCEL_WAIT for it and gives up on it; the next rounds go on, worker 1 in them again."""
    monkeypatch.setattr(round_module, "CANCEL_WAIT", 0.5)
    config = TrainConfig(
        model="gpt-tiny", steps=4, batch_size=2, sequence_length=32, output_dir=str(tmp_path), min_workers=1,
        straggler_grace="0.3",
    )  # fmt: skip
    clients = in_process_clients(2)
    clients[1] = _LostCall(clients[1].engine, clients[1].address)
    try:
        started = time.monotonic()
        train_in_process = Trainer(config, clients, progress=False)
        try:
            train_in_process.run()
        finally:
            train_in_process.close()
        assert time.monotonic() - started < 30
    finally:
        _LostCall.release.set()
    records = {r["step"]: r for r in read_metrics(tmp_path)}
    assert records[3]["successful_workers"] == 1 and records[3]["stragglers"] == 1
    assert records[4]["successful_workers"] == 2  # back, by catch-up or a push
