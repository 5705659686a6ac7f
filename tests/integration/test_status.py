"""The status page's data: /api/status and /metrics from a real training run, checked against
metrics.jsonl; the token rule; worker rows that turn to failed when a worker dies."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.status import StatusBoard, StatusServer
from gradwire.coordinator.trainer import Trainer

from .conftest import live_workers

TOKEN = "status-token-0123456789abcdef"


def get(url: str, token: str | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


@pytest.fixture
def run(tmp_path: Path):
    """A 6-round run with a status board and server (token set), and its metrics."""
    with live_workers(2) as workers:
        config = TrainConfig(
            model="gpt-tiny", steps=6, batch_size=2, sequence_length=32, output_dir=str(tmp_path), eval_every=3
        )
        trainer = Trainer(config, [w.client() for w in workers], progress=False)
        trainer.status = StatusBoard(run={"run_id": trainer.run_id, "model": "gpt-tiny", "steps": 6})
        server = StatusServer(trainer.status, port=0, token=TOKEN)
        try:
            trainer.run()
            yield f"http://127.0.0.1:{server.port}", read_metrics(tmp_path), trainer, workers
        finally:
            trainer.close()
            server.close()


def test_api_status_matches_metrics_jsonl(run) -> None:
    base, records, trainer, _ = run
    status, content_type, body = get(base + "/api/status", TOKEN)
    assert status == 200 and content_type == "application/json"
    snap = json.loads(body)
    assert snap["latest"]["step"] == records[-1]["step"] == 6 and snap["latest"]["loss"] == records[-1]["loss"]
    assert [p[1] for p in snap["curves"]["loss"]] == [r["loss"] for r in records]
    assert [p[0] for p in snap["curves"]["eval_loss"]] == [3, 6]
    assert snap["curves"]["eval_loss"][-1][1] == records[-1]["eval_loss"]
    rows = snap["workers"]
    assert [r["id"] for r in rows] == [0, 1] and all(r["state"] in ("training", "resyncing") for r in rows)
    assert all(r["rounds_done"] == 6 and r["rounds_failed"] == 0 and r["device"] == "cpu" for r in rows)
    assert all((r["ranks"], r["node_mode"]) == (1, "") for r in rows)  # single-device workers: no node mode
    # each worker's last round's utilisation (compute over its round's span) and wait, and the round's mean
    assert all(0 < r["utilisation"] <= 1 and r["last_wait_seconds"] >= 0 for r in rows), rows
    assert snap["latest"]["utilisation"] == records[-1]["utilisation"] and 0 < records[-1]["utilisation"] <= 1
    assert set(records[-1]["worker_utilisation"]) == {r["address"] for r in rows}
    assert all(rec["wait_s"] >= 0 for rec in records)
    assert sum(r["bytes_down"] for r in rows) == sum(rec["bytes_down"] for rec in records)  # state pushes included
    assert sum(r["bytes_up"] for r in rows) == sum(rec["bytes_up"] for rec in records)
    assert snap["run"]["run_id"] == trainer.run_id


def test_metrics_endpoint_is_prometheus_text_with_the_same_figures(run) -> None:
    base, records, _, _ = run
    status, content_type, body = get(base + "/metrics", TOKEN)
    assert status == 200 and content_type.startswith("text/plain")
    samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]

    def value(name: str, **labels: str) -> float:
        return next(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("gradwire_step") == 6 and value("gradwire_loss") == pytest.approx(records[-1]["loss"])
    assert value("gradwire_tokens_total") == records[-1]["total_tokens"]
    assert value("gradwire_bytes_total", direction="up") == sum(r["bytes_up"] for r in records)
    assert (
        value("gradwire_worker_state", worker="0", state="training")
        + value("gradwire_worker_state", worker="0", state="resyncing")
        == 1
    )
    assert value("gradwire_utilisation") == pytest.approx(records[-1]["utilisation"])
    assert value("gradwire_wait_seconds") == pytest.approx(records[-1]["wait_s"])
    assert all(0 < value("gradwire_worker_utilisation", worker=w) <= 1 for w in ("0", "1"))
    assert all(value("gradwire_worker_wait_seconds_total", worker=w) >= 0 for w in ("0", "1"))


def test_every_path_needs_the_token_and_the_page_is_served(run) -> None:
    base, _, _, _ = run
    for path in ("/", "/api/status", "/metrics"):
        assert get(base + path)[0] == 401 and get(base + path, "wrong")[0] == 401
    status, content_type, body = get(base + "/?token=" + TOKEN)
    assert (
        status == 200 and content_type.startswith("text/html") and b'id="loss-chart"' in body and b"api/status" in body
    )
    assert get(base + "/nope", TOKEN)[0] == 404


def test_a_dead_worker_turns_failed() -> None:
    board = StatusBoard(run={})
    from gradwire.coordinator.status import WorkerEvent

    board.update(
        {"step": 1, "loss": 5.0, "total_tokens": 10},
        [WorkerEvent(0, "a:1", "training"), WorkerEvent(1, "b:2", "training")],
    )
    board.update(
        {"step": 2, "loss": float("nan"), "total_tokens": 20},
        [WorkerEvent(0, "a:1", "training"), WorkerEvent(1, "b:2", "failed", error="UNAVAILABLE")],
    )
    rows = {r["id"]: r for r in board.snapshot()["workers"]}
    assert rows[1]["state"] == "failed" and rows[1]["rounds_failed"] == 1 and rows[1]["last_error"] == "UNAVAILABLE"
    board.update(None, [WorkerEvent(0, "a:1", "failed")])  # b left the run
    assert [r["id"] for r in board.snapshot()["workers"]] == [0]


def test_a_nodes_ranks_and_mode_reach_the_snapshot() -> None:
    from gradwire.coordinator.status import WorkerEvent

    board = StatusBoard(run={})
    board.update(None, [WorkerEvent(0, "a:1", "training", "cuda:0", 2, "fsdp"), WorkerEvent(1, "b:2", "training")])
    assert [(r["ranks"], r["node_mode"]) for r in board.snapshot()["workers"]] == [(2, "fsdp"), (1, "")]


def test_a_workers_utilisation_and_wait_reach_the_snapshot_and_metrics() -> None:
    from gradwire.coordinator.status import WorkerEvent

    board = StatusBoard(run={})
    board.update(
        {"step": 1, "loss": 5.0, "total_tokens": 10, "utilisation": 0.6, "wait_s": 1.5},
        [WorkerEvent(0, "a:1", "training", utilisation=0.75, wait=0.0), WorkerEvent(1, "b:2", "training")],
    )
    board.update(
        {"step": 2, "loss": 4.0, "total_tokens": 20, "utilisation": 0.5, "wait_s": 2.0},
        [WorkerEvent(0, "a:1", "training", utilisation=0.5, wait=2.0), WorkerEvent(1, "b:2", "benched")],
    )
    snap = board.snapshot()
    rows = {r["id"]: r for r in snap["workers"]}
    assert (rows[0]["utilisation"], rows[0]["last_wait_seconds"]) == (0.5, 2.0)
    assert (rows[1]["utilisation"], rows[1]["last_wait_seconds"]) == (None, 0.0)  # never measured
    assert snap["latest"]["utilisation"] == 0.5 and snap["curves"]["utilisation"] == [[1, 0.6], [2, 0.5]]
    samples = {
        (s.name, s.labels.get("worker")): s.value
        for f in text_string_to_metric_families(board.prometheus().decode())
        for s in f.samples
    }
    assert samples[("gradwire_worker_utilisation", "0")] == 0.5 and ("gradwire_worker_utilisation", "1") not in samples
    assert samples[("gradwire_worker_wait_seconds_total", "0")] == 2.0  # over the rounds
    assert samples[("gradwire_worker_wait_seconds_total", "1")] == 0.0
    assert (samples[("gradwire_utilisation", None)], samples[("gradwire_wait_seconds", None)]) == (0.5, 2.0)
    board.update(None, [WorkerEvent(1, "b:2", "training", utilisation=1.0)])  # a:1 left the run
    samples = {
        (s.name, s.labels.get("worker"))
        for f in text_string_to_metric_families(board.prometheus().decode())
        for s in f.samples
    }
    assert ("gradwire_worker_wait_seconds_total", "0") not in samples
    assert ("gradwire_worker_utilisation", "1") in samples


def test_worker_events_carry_utilisation_and_wait_from_the_timings() -> None:
    import dataclasses

    from gradwire.coordinator.round import RoundOutcome, SlotOutcome, WorkerSlot
    from gradwire.coordinator.status import worker_events
    from gradwire.protocol import OK, RoundResult

    @dataclasses.dataclass
    class Link:
        address: str

    slots = [WorkerSlot(i, Link(f"w{i}:1")) for i in range(3)]  # type: ignore[arg-type]
    timings = {"compute": 1.0, "total": 1.5, "wall": 4.0, "wait": 2.5}
    outcomes = [
        SlotOutcome(slots[0], RoundResult(OK, 3, loss=2.0, tokens=64, version=3, timings=timings)),
        SlotOutcome(slots[1], RoundResult(OK, 3, loss=2.0, tokens=64, version=3, timings={"compute": 1.0})),
    ]
    events = worker_events(slots, RoundOutcome(outcomes, 0, 0), {0, 1}, 4)
    assert [(e.utilisation, e.wait) for e in events] == [(0.25, 2.5), (None, 0.0), (None, None)]
