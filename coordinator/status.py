"""``coordinator train --status-port P``: the run as it happens, for people and for Prometheus.

``StatusBoard`` is the core: the trainer hands it each round's metrics record and one ``WorkerRow`` per
worker; it keeps the curves (loss, held-out loss, tokens/s, bytes, time split) and the rows, and answers
``snapshot()`` - a JSON-able dict - and ``prometheus()`` - the same figures in Prometheus' text format,
through ``prometheus_client``. ``StatusServer`` serves them over HTTP on localhost by default:

    /              the status page (static HTML + JS shipped in the package, no build step, no CDN)
    /api/status    the snapshot as JSON; the page polls it
    /metrics       Prometheus text format

With a token (``--token``/``--token-file``/``$GRADWIRE_TOKEN``) every path needs it, as
``Authorization: Bearer TOKEN`` or ``?token=TOKEN`` (the page passes on the one in its own address).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gradwire.coordinator.metrics import utilisation, waited
from gradwire.security import bearer, token_matches

if TYPE_CHECKING:
    from gradwire.coordinator.round import RoundOutcome, WorkerSlot

log = logging.getLogger(__name__)

WORKER_STATES = ("training", "straggling", "benched", "resyncing", "failed", "waiting")
CURVE_POINTS = 5000  # the most recent rounds each curve keeps


@dataclasses.dataclass
class WorkerRow:
    """One worker as the status page shows it."""

    id: int
    address: str
    state: str = "waiting"
    device: str = ""
    ranks: int = 1
    node_mode: str = ""  # ddp, local-sgd, fsdp, pipeline (auto: the one picked at the push); "" for one device
    last_round_seconds: float = 0.0
    rounds_done: int = 0
    rounds_failed: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    last_error: str = ""
    score: float | None = None  # its agreement with the others (decisions.Score); None: not measured yet
    checks: tuple[int, int] = (0, 0)  # spot checks of its gradients (coordinator.spotcheck): passed, failed
    # its last measured round's utilisation (compute / wall, metrics.utilisation; None: not measured yet) and
    # the seconds it sat idle before that round's work began
    utilisation: float | None = None
    last_wait_seconds: float = 0.0
    bytes_pulled: int = 0  # --relay peers: the payload bytes it pulled from its peers instead of its orders


@dataclasses.dataclass(frozen=True)
class WorkerEvent:
    """What one worker did in one round (``state``: one of ``WORKER_STATES``)."""

    id: int
    address: str
    state: str
    device: str = ""
    ranks: int = 1
    node_mode: str = ""
    seconds: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    error: str = ""
    score: float | None = None
    checks: tuple[int, int] = (0, 0)
    utilisation: float | None = None
    wait: float | None = None  # None: no result this round
    bytes_pulled: int = 0


def worker_events(
    slots: Sequence[WorkerSlot],
    round_: RoundOutcome,
    kept: Collection[int],
    step: int,
    reasons: Mapping[int, str] | None = None,
) -> list[WorkerEvent]:
    """What each of the run's workers did in a round, as the status page names it. Pure.

    ``kept``: the slots whose contribution counted; ``reasons``: why the others' did not, where their
    call itself did not fail (the gather stage left them out); ``step``: the round after this one
    (benching is judged for it). A worker without an outcome sat the round out: benched, receiving the
    state in the background, or waiting (it joined after the round began). ``score``: its agreement score
    so far (``decisions.Score``), None until it is measured (again, after a bench); ``checks``: its spot
    checks so far, passed and failed; ``utilisation`` and ``wait``: from its result's timings
    (``metrics.utilisation``, ``metrics.waited``), None without one."""
    by_slot = {o.slot.index: o for o in round_.outcomes}
    events = []
    for slot in slots:
        o = by_slot.get(slot.index)
        if o is None:
            state = (
                "benched" if slot.standing.benched(step) else "resyncing" if slot.index in round_.joining else "waiting"
            )
        elif o.straggler:
            state = "straggling"
        elif slot.index in kept:
            state = "resyncing" if o.pushes or o.catch_ups else "training"
        else:
            state = "failed"
        timings = o.result.timings if o is not None and o.result is not None else None
        seconds = timings.get("total", 0.0) if timings is not None else 0.0
        events.append(
            WorkerEvent(
                slot.index,
                slot.client.address,
                state,
                slot.device,
                slot.ranks,
                slot.node_mode,
                seconds,
                o.bytes_up if o else 0,
                o.bytes_down + o.first_push_bytes if o else 0,
                (o.error or (reasons or {}).get(slot.index, "")) if o and state == "failed" else "",
                slot.standing.score.value if slot.standing.score.rounds else None,
                slot.checks,
                utilisation(timings) if timings is not None else None,
                waited(timings) if timings is not None else None,
                o.bytes_pulled if o else 0,
            )
        )
    return events


class StatusBoard:
    """The run's figures and its workers, safe to update from the training loop and read from HTTP threads."""

    def __init__(self, *, run: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self.run = dict(run)
        self.started = time.time()
        self.curves: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=CURVE_POINTS)
        )
        self.latest: dict[str, Any] = {}
        self.workers: dict[int, WorkerRow] = {}
        self.registry = CollectorRegistry()
        self._gauges = {
            key: Gauge(f"gradwire_{key}", help_text, registry=self.registry)
            for key, help_text in (
                ("step", "rounds completed"),
                ("loss", "training loss of the last round"),
                ("eval_loss", "held-out loss, when last measured"),
                ("tokens_per_sec", "tokens trained per second in the last round"),
                ("compression_ratio", "dense float32 bytes over payload bytes"),
                ("step_time_seconds", "wall time of the last round"),
                ("compute_seconds", "slowest worker's compute time in the last round"),
                ("communication_seconds", "the last round's time outside worker compute and aggregation"),
                ("aggregate_seconds", "the coordinator's aggregation and outer step in the last round"),
                ("successful_workers", "workers whose contribution counted in the last round"),
                ("utilisation", "mean utilisation (compute / wall) of the workers that counted in the last round"),
                ("wait_seconds", "seconds the workers that counted sat idle before the last round, summed"),
            )
        }
        self._bytes = Counter(
            "gradwire_bytes",
            "bytes over the network, by direction: up and down the coordinator's; pulled, worker to worker",
            ["direction"],
            registry=self.registry,
        )
        self._tokens = Counter("gradwire_tokens", "tokens trained on", registry=self.registry)
        self._total_tokens = 0
        self._worker_state = Gauge(
            "gradwire_worker_state",
            "1 for each worker's current state",
            ["worker", "address", "state"],
            registry=self.registry,
        )
        self._worker_rounds = Gauge(
            "gradwire_worker_rounds",
            "rounds per worker, by outcome",
            ["worker", "address", "outcome"],
            registry=self.registry,
        )
        self._worker_score = Gauge(
            "gradwire_worker_score",
            "each measured worker's agreement score with the others, -1 to 1 (below --agreement-floor: left out)",
            ["worker", "address"],
            registry=self.registry,
        )
        self._worker_checks = Gauge(
            "gradwire_worker_spot_checks",
            "spot checks of each worker's gradients so far (coordinator.spotcheck), by result",
            ["worker", "address", "result"],
            registry=self.registry,
        )
        self._worker_utilisation = Gauge(
            "gradwire_worker_utilisation",
            "each worker's utilisation in its last measured round: compute over wall time, 0 to 1",
            ["worker", "address"],
            registry=self.registry,
        )
        self._worker_wait = Counter(
            "gradwire_worker_wait_seconds",
            "seconds each worker sat idle with nothing to compute, before its rounds' work began",
            ["worker", "address"],
            registry=self.registry,
        )

    def update(self, record: dict[str, Any] | None, events: list[WorkerEvent]) -> None:
        """A round happened: its metrics record (``None`` if no worker was usable) and, for every worker
        of the run, what it did in it (workers not named have left the run)."""
        with self._lock:
            if record is not None:
                self._round(record)
            for e in events:
                row = self.workers.get(e.id) or WorkerRow(e.id, e.address)
                row.state, row.device = e.state, e.device or row.device
                row.ranks, row.node_mode = e.ranks, e.node_mode
                row.last_round_seconds = e.seconds or row.last_round_seconds
                row.bytes_up += e.bytes_up
                row.bytes_down += e.bytes_down
                row.bytes_pulled += e.bytes_pulled
                row.rounds_done += e.state in ("training", "resyncing")
                row.rounds_failed += e.state in ("failed", "straggling")
                row.last_error = e.error[:300] or row.last_error
                row.score, row.checks = e.score, e.checks
                if e.utilisation is not None:
                    row.utilisation = e.utilisation
                if e.wait is not None:
                    row.last_wait_seconds = e.wait
                self.workers[e.id] = row
                self._worker_wait.labels(str(row.id), row.address).inc(e.wait or 0.0)
            for wid in [w for w in self.workers if w not in {e.id for e in events}]:
                row = self.workers.pop(wid)  # left the run
                self._worker_wait.remove(str(row.id), row.address)
            self._worker_state.clear()
            self._worker_rounds.clear()
            self._worker_score.clear()
            self._worker_checks.clear()
            self._worker_utilisation.clear()
            for row in self.workers.values():
                labels = (str(row.id), row.address)
                for state in WORKER_STATES:
                    self._worker_state.labels(*labels, state).set(1.0 if row.state == state else 0.0)
                self._worker_rounds.labels(*labels, "done").set(row.rounds_done)
                self._worker_rounds.labels(*labels, "failed").set(row.rounds_failed)
                if row.score is not None:
                    self._worker_score.labels(*labels).set(row.score)
                self._worker_checks.labels(*labels, "passed").set(row.checks[0])
                self._worker_checks.labels(*labels, "failed").set(row.checks[1])
                if row.utilisation is not None:
                    self._worker_utilisation.labels(*labels).set(row.utilisation)

    def held_out(self, step: int, loss: float) -> None:
        """A held-out loss, measured after round ``step``."""
        with self._lock:
            self.curves["eval_loss"].append((step, loss))
            self.latest["eval_loss"] = loss
            self._gauges["eval_loss"].set(loss)

    def _round(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        compute = float(record.get("worker_compute_time", 0.0))
        aggregate = float(record.get("aggregate_time", 0.0))
        communication = max(0.0, float(record.get("step_time", 0.0)) - compute - aggregate)
        point = {
            "step": step,
            "loss": record.get("loss"),
            "tokens_per_sec": record.get("tokens_per_sec"),
            "bytes_up": record.get("bytes_up"),
            "bytes_down": record.get("bytes_down"),
            "compression_ratio": record.get("compression_ratio"),
            "compute": compute,
            "communication": communication,
            "aggregate": aggregate,
            "utilisation": record.get("utilisation"),
        }
        for key, value in point.items():
            if key != "step":
                self.curves[key].append((step, value))
        if record.get("eval_loss") is not None:
            self.curves["eval_loss"].append((step, record["eval_loss"]))
            self._gauges["eval_loss"].set(record["eval_loss"])
        self.latest = {**record, "communication_time": communication}
        for key, gauge_key in (
            ("step", "step"),
            ("loss", "loss"),
            ("tokens_per_sec", "tokens_per_sec"),
            ("compression_ratio", "compression_ratio"),
            ("step_time", "step_time_seconds"),
            ("successful_workers", "successful_workers"),
            ("utilisation", "utilisation"),
            ("wait_s", "wait_seconds"),
        ):
            if isinstance(record.get(key), (int, float)):
                self._gauges[gauge_key].set(record[key])
        self._gauges["compute_seconds"].set(compute)
        self._gauges["communication_seconds"].set(communication)
        self._gauges["aggregate_seconds"].set(aggregate)
        self._bytes.labels("up").inc(max(0, record.get("bytes_up", 0)))
        self._bytes.labels("down").inc(max(0, record.get("bytes_down", 0)))
        self._bytes.labels("pulled").inc(max(0, record.get("bytes_pulled", 0)))  # --relay peers: worker to worker
        total = int(record.get("total_tokens", 0))
        self._tokens.inc(max(0, total - self._total_tokens))
        self._total_tokens = max(total, self._total_tokens)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "run": {**self.run, "uptime_seconds": round(time.time() - self.started, 1)},
                "latest": dict(self.latest),
                "curves": {k: [list(p) for p in v] for k, v in self.curves.items()},
                "workers": [dataclasses.asdict(r) for r in sorted(self.workers.values(), key=lambda r: r.id)],
            }

    def prometheus(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as ``None``: JSON has no word for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def page() -> bytes:
    return resources.files("gradwire.assets").joinpath("status.html").read_bytes()


class StatusServer:
    """HTTP for ``board`` on ``host:port`` (``port`` 0: any free one; see ``port``), in a daemon thread."""

    def __init__(self, board: StatusBoard, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        handler = _handler(board, token)
        try:
            self._server = ThreadingHTTPServer((host.strip("[]"), port), handler)
        except OSError as e:
            raise OSError(f"--status-port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="gradwire-status", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(board: StatusBoard, token: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gradwire-status"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urlsplit(self.path)
            if token is not None:
                presented = (
                    bearer([("authorization", self.headers.get("Authorization", ""))])
                    or (parse_qs(url.query).get("token") or [None])[0]
                )
                if not token_matches(presented, token):
                    self._send(
                        HTTPStatus.UNAUTHORIZED,
                        b"a token is required: ?token=... or Authorization: Bearer ...\n",
                        "text/plain; charset=utf-8",
                    )
                    return
            if url.path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, page(), "text/html; charset=utf-8")
            elif url.path == "/api/status":
                self._send(
                    HTTPStatus.OK,
                    json.dumps(_finite(board.snapshot()), allow_nan=False, default=str).encode(),
                    "application/json",
                )
            elif url.path == "/metrics":
                self._send(HTTPStatus.OK, board.prometheus(), CONTENT_TYPE_LATEST)
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")

        def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            log.debug("status page: " + format, *args)

    return Handler
