"""The status page in a real headless Chromium (Debian's package; .ci/run installs it): the worker rows
and a drawn loss curve appear, a screenshot is taken, a worker that dies turns its row to failed, and a
node's row shows its ranks and mode."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.status import StatusBoard, StatusServer, WorkerEvent
from gradwire.coordinator.trainer import Trainer

from .conftest import live_workers

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)"
)
TOKEN = "page-token-0123456789abcdef"


def browse(url: str, *flags: str) -> str:
    """The page's DOM after its scripts ran (a few seconds of virtual time: several polls)."""
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--virtual-time-budget=4000",
        *(flags or ("--dump-dom",)),
        url,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def rows(dom: str) -> dict[str, str]:
    """worker id -> its row's state class."""
    return dict((w, c) for c, w in re.findall(r'<tr class="(\w+)" data-worker="(\d+)">', dom))


@pytest.mark.slow
def test_the_page_shows_workers_and_the_loss_curve_and_a_dead_worker_fails(tmp_path: Path) -> None:
    with live_workers(2) as workers:
        config = TrainConfig(
            model="gpt-tiny", steps=20, batch_size=2, sequence_length=32, output_dir=str(tmp_path / "run")
        )
        trainer = Trainer(config, [w.client(timeout=5) for w in workers], progress=False)
        trainer.status = StatusBoard(run={"run_id": trainer.run_id, "model": "gpt-tiny", "steps": 20})
        server = StatusServer(trainer.status, port=0, token=TOKEN)
        url = f"http://127.0.0.1:{server.port}/?token={TOKEN}"
        try:
            trainer.connect()
            for _ in range(4):
                trainer.train_step()
            dom = browse(url)
            assert rows(dom) == {"0": "training", "1": "training"}, dom[-3000:]
            points = re.search(r'id="loss-chart"[^>]*data-points="(\d+)"', dom) or re.search(
                r'data-points="(\d+)"[^>]*id="loss-chart"', dom
            )
            assert points and int(points.group(1)) == 4, "no loss curve drawn"
            assert '<b id="step">4</b>' in dom
            shot = tmp_path / "status.png"
            browse(url, f"--screenshot={shot}", "--window-size=1100,700")
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
            workers[1].server.stop(0).wait(5)  # a worker dies
            trainer.train_step()
            assert rows(browse(url)) == {"0": "training", "1": "failed"}
        finally:
            trainer.close()
            server.close()


def test_a_nodes_row_shows_its_ranks_and_mode() -> None:
    board = StatusBoard(run={"run_id": "r", "model": "gpt-tiny"})
    board.update(None, [WorkerEvent(0, "a:1", "training", "cuda:0", 2, "fsdp"), WorkerEvent(1, "b:2", "training")])
    server = StatusServer(board, port=0)
    try:
        dom = browse(f"http://127.0.0.1:{server.port}/")
    finally:
        server.close()
    cells = {w: re.findall(r"<td>([^<]*)</td>", row) for w, row in re.findall(r'data-worker="(\d+)">(.*?)</tr>', dom)}
    assert cells["0"][4] == "2 ranks, fsdp" and cells["1"][4] == "1", dom[-3000:]


def test_a_workers_row_shows_its_utilisation_and_wait() -> None:
    board = StatusBoard(run={"run_id": "r", "model": "gpt-tiny"})
    board.update(
        {"step": 3, "loss": 4.0, "total_tokens": 30, "utilisation": 0.5, "wait_s": 1.5},
        [WorkerEvent(0, "a:1", "training", utilisation=0.755, wait=1.25), WorkerEvent(1, "b:2", "waiting")],
    )
    server = StatusServer(board, port=0)
    try:
        dom = browse(f"http://127.0.0.1:{server.port}/")
    finally:
        server.close()
    heads = re.findall(r"<th>([^<]*)</th>", dom)
    cells = {w: re.findall(r"<td>([^<]*)</td>", row) for w, row in re.findall(r'data-worker="(\d+)">(.*?)</tr>', dom)}
    column = {name: heads.index(name) for name in ("utilisation", "wait")}
    assert len(cells["0"]) == len(heads), dom[-3000:]
    assert (cells["0"][column["utilisation"]], cells["0"][column["wait"]]) == ("76%", "1.25 s"), dom[-3000:]
    assert (cells["1"][column["utilisation"]], cells["1"][column["wait"]]) == ("-", "0.00 s")  # not measured yet
    assert '<b id="busy">50% / 1.50 s</b>' in dom
