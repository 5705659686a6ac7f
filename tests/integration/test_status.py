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
