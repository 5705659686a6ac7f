"""Multi-GPU worker nodes, on CPU with gloo: real rank processes started by ``worker serve --nproc-per-node``.

A 2-rank node computes what one worker computes on the whole batch (ddp), local-SGD among its ranks is
DDP at S = 1 and model averaging at S = H, a coordinator trains against nodes (also one under torchrun),
and a node that loses a rank fails its round, restarts, and rejoins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import grpc
import numpy as np
import pytest
import torch

from gradwire import statestream
from gradwire.compression import CodecConfig
from gradwire.coordinator.checkpoint import load_checkpoint
from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.coordinator.config import DENSE_CODEC, TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.models import build_from_spec, lm_loss, model_spec
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, LocalSteps, ModelState, RoundResult, WorkOrder
from gradwire.replica import Replica, StateUpdate
from gradwire.transport import free_port, grpc_options
from gradwire.v1 import worker_pb2 as pb
from gradwire.v1 import worker_pb2_grpc
from gradwire.worker.engine import WorkerEngine

from .conftest import run_trainer

pytestmark = pytest.mark.slow
SPEC = model_spec("gpt-tiny")
TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class Node:
    """How to start a node: ``node``'s arguments."""

    flags: tuple[str, ...] = ()
    ranks: int = 2
    torchrun: bool = False
    timeout: float = 20.0


@contextlib.contextmanager
def node(
    tmp_path: Path, *flags: str, ranks: int = 2, torchrun: bool = False, timeout: float = 20.0
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A node of ``ranks`` CPU ranks serving on a free loopback port; yields its address and process."""
    with nodes(tmp_path, Node(flags, ranks, torchrun, timeout)) as [started]:
        yield started


@contextlib.contextmanager
def nodes(tmp_path: Path, *specs: Node) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """A node of each of ``specs`` (separate processes, as ``node``'s), started together and stopped
    together: a node's start-up is mostly one process importing torch, so on a few cores two overlap well.
    Yields each one's address and process, once all are ready."""
    started: list[tuple[int, subprocess.Popen, IO[str]]] = []
    try:
        for spec in specs:
            started.append(_launch(tmp_path, spec))
        for port, proc, _ in started:
            wait_listening(port, proc, 60.0)
            with WorkerClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as client:
                client.wait_ready(timeout=60.0)
        yield [(f"127.0.0.1:{port}", proc) for port, proc, _ in started]
    finally:
        for _, proc, _ in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, log in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.seek(0)
            output = log.read()
            log.close()
            print(output)  # shown when a test fails


def _launch(tmp_path: Path, spec: Node) -> tuple[int, subprocess.Popen, IO[str]]:
    """Start a node of ``spec`` on a free loopback port (not yet ready); its port, process and log."""
    port = free_port()
    serve = [
        "serve",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--device",
        "cpu",
        "--node-timeout",
        str(spec.timeout),
        *spec.flags,
    ]
    if spec.torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(spec.ranks),
            "--master-port",
            str(free_port()),
            "-m",
            "gradwire.worker",
            *serve,
        ]
    else:
        cmd = [sys.executable, "-m", "gradwire.worker", *serve, "--nproc-per-node", str(spec.ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / f"node-{port}.log", "w+")  # noqa: SIM115 - closed by ``nodes``, after the process
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except BaseException:
        log.close()
        raise
    return port, proc, log


def wait_listening(port: int, proc: subprocess.Popen, seconds: float) -> None:
    """Until something accepts connections on ``port`` (or ``proc`` exits, or ``seconds`` pass). A gRPC
    channel to a port not yet bound backs off between attempts (1 s, 1.6 s, 2.6 s, 4.1 s...), so a node
    that binds ~10 s after it starts was only seen ready ~5 s later; ``wait_ready`` then checks SERVING."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.05)


def state() -> tuple[Replica, ModelState]:
    replica = Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"))
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    return replica, ModelState("run", 0, json.dumps(SPEC), params, replica.rule.to_json())


def batch(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8192, (rows, 17)).astype(np.uint16)


def contribution(replica: Replica, result: RoundResult) -> dict[str, torch.Tensor]:
    assert result.status == OK, result.reason
    return replica.codec(DENSE_CODEC).decompress(result.gradient)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def node_rounds(
    tmp_path: Path,
    *flags: str,
    local: bool,
    ranks: int = 2,
    start: tuple[Replica, ModelState] | None = None,
    clip: float = 0.0,
) -> list[dict[str, torch.Tensor]]:
    """Three rounds of a node of ``flags``: two exact ones, the second replaying the first's payload (so it
    checks the replay on the node's replica and its fingerprint), then a compressed one. Returns each
    round's decoded contribution. ``start``: the coordinator's replica and the state pushed (``state()``)."""
    (rounds,) = nodes_rounds(tmp_path, flags, local=local, ranks=ranks, starts=[start or state()], clip=clip)
    return rounds


def nodes_rounds(
    tmp_path: Path,
    *flag_sets: tuple[str, ...],
    local: bool,
    ranks: int = 2,
    starts: list[tuple[Replica, ModelState]] | None = None,
    clip: float = 0.0,
) -> list[list[dict[str, torch.Tensor]]]:
    """``node_rounds`` of a node of each of ``flag_sets``, the nodes started together (``nodes``), then
    each one's rounds in turn. ``starts``: each node's ``start`` (default: a ``state()`` each)."""
    starts = starts or [state() for _ in flag_sets]
    assert len(starts) == len(flag_sets)
    with nodes(tmp_path, *(Node(tuple(flags), ranks) for flags in flag_sets)) as started:
        return [
            _rounds_on(address, replica, st, local=local, clip=clip)
            for (address, _), (replica, st) in zip(started, starts)
        ]


def _rounds_on(
    address: str, replica: Replica, st: ModelState, *, local: bool, clip: float
) -> list[dict[str, torch.Tensor]]:
    """``node_rounds``' three rounds on the node at ``address``, from ``replica`` and ``st``."""
    steps = _local(2, lr=0.05) if local else None
    rows = 8 if local else 4
    codec = DENSE_CODEC
    out = []
    with WorkerClient(address, timeout=TIMEOUT) as client:
        client.push_state(st)
        first, _ = client.run_round(
            WorkOrder("run", 0, 0, batch(rows), codec, replica.fingerprint(), local_steps=steps, clip_grad_norm=clip)
        )
        assert first.status == OK, first.reason
        out.append(contribution(replica, first))
        update = StateUpdate(1.0, (first.gradient,), (1.0,))
        before = replica.fingerprint()
        replica.apply(update)  # the coordinator's copy, stepped with the rule of ``state``
        second, _ = client.run_round(
            WorkOrder("run", 1, 0, batch(rows, seed=1), codec, before, update, local_steps=steps)
        )
        assert second.status == OK and second.version == 1, second.reason  # the node's fingerprint agreed
        out.append(contribution(replica, second))
        third, _ = client.run_round(
            WorkOrder("run", 2, 1, batch(rows, seed=2), CodecConfig(), replica.fingerprint(), local_steps=steps)
        )
        assert third.status == OK, third.reason
        out.append(replica.codec(CodecConfig()).decompress(third.gradient))
    return out


# A DDP node's ``node_rounds`` from ``state()``, by (local, ranks): the same every time, so each is computed
# once in a session (by whichever test needs it first) and shared by the tests that compare against it.
_DDP_ROUNDS: dict[tuple[bool, int], list[dict[str, torch.Tensor]]] = {}


def versus_ddp(
    tmp_path: Path, *flags: str, local: bool, ranks: int = 2
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """``node_rounds`` from ``state()`` of a node of ``flags`` and of a DDP node of as many ranks (started
    together, where this session has not computed the DDP node's yet)."""
    key = (local, ranks)
    if key in _DDP_ROUNDS:
        return node_rounds(tmp_path, *flags, local=local, ranks=ranks), _DDP_ROUNDS[key]
    got, ddp = nodes_rounds(tmp_path, flags, ("--node-mode", "ddp"), local=local, ranks=ranks)
    _DDP_ROUNDS[key] = ddp
    return got, ddp


def test_a_ddp_node_computes_what_one_worker_computes_on_the_whole_batch(tmp_path):
    replica, st = state()
    order = WorkOrder("run", 0, 0, batch(4), DENSE_CODEC, replica.fingerprint())
    single = WorkerEngine("cpu")
    single.push_state(st)
    reference = single.run_round(order)
    compressed = WorkOrder("run", 1, 0, batch(4, seed=1), CodecConfig(), replica.fingerprint())
    with node(tmp_path, "--node-mode", "ddp") as (address, _), WorkerClient(address, timeout=TIMEOUT) as client:
        info = client.describe()
        assert (info.ranks, info.node_mode, info.rank_devices) == (2, "ddp", ("cpu", "cpu"))
        client.push_state(st)
        result, _ = client.run_round(order)
        assert_close(contribution(replica, result), contribution(replica, reference))
        assert result.tokens == reference.tokens and abs(result.loss - reference.loss) < 1e-5
        assert result.node_bytes >= 4 * sum(p.numel() for p in replica.params.values())  # one fp32 all-reduce
        # Compressed: one payload for the node, the size a single worker's would be.
        single.push_state(st)
        node_result, _ = client.run_round(compressed)
        node_payload = node_result.gradient
        assert node_payload.nbytes == single.run_round(compressed).gradient.nbytes
        # A batch that does not split over the ranks is the caller's mistake; the node carries on.
        with pytest.raises(Exception, match="split over"):
            client.run_round(WorkOrder("run", 2, 0, batch(3), DENSE_CODEC, replica.fingerprint()))
        after, _ = client.run_round(WorkOrder("run", 3, 0, batch(2), DENSE_CODEC, replica.fingerprint()))
        assert after.status == OK


def test_an_idle_node_outlives_its_timeout(tmp_path):
    # Every collective, the command channel's too, is bounded by --node-timeout; rank 0's heartbeats keep
    # an idle node's ranks talking, so no coordinator for a while is not a lost rank.
    replica, st = state()
    with node(tmp_path, timeout=2.0) as (address, proc), WorkerClient(address, timeout=TIMEOUT) as client:
        time.sleep(6.0)
        client.push_state(st)
        result, _ = client.run_round(WorkOrder("run", 0, 0, batch(2), DENSE_CODEC, replica.fingerprint()))
        assert result.status == OK
        assert proc.poll() is None and client.describe().ranks == 2


def test_a_push_that_streams_in_slower_than_the_timeout_keeps_the_node_together(tmp_path):
    # Ranks wait for each tensor of a push as it streams in; rank 0 keeps them talking while one is slow to
    # arrive (here the 2 MB embedding takes ~3 s, the ranks' timeout is 2 s).
    replica, st = state()

    def slow() -> Iterator[pb.Part]:
        for part in statestream.state_parts(st, part_bytes=256 << 10):
            time.sleep(0.3)
            yield part

    with node(tmp_path, timeout=2.0) as (address, proc), WorkerClient(address, timeout=TIMEOUT) as client:
        stub = worker_pb2_grpc.WorkerStub(client.channel)
        reply = stub.PushState(slow(), timeout=TIMEOUT, metadata=client.call_metadata)
        assert reply.version == 0
        result, _ = client.run_round(WorkOrder("run", 0, 0, batch(2), DENSE_CODEC, replica.fingerprint()))
        assert result.status == OK, result.reason
        assert proc.poll() is None


def _local(steps: int, lr: float = 0.5) -> LocalSteps:
    return LocalSteps(steps, InnerOptimizerConfig(name="sgd"), (lr,) * steps)


def test_local_sgd_among_ranks_is_ddp_at_s1_and_model_averaging_at_s_h(tmp_path):
    replica, st = state()
    h = 3
    order = WorkOrder("run", 0, 0, batch(4 * h), DENSE_CODEC, replica.fingerprint(), local_steps=_local(h))
    results = {}
    modes = {
        "ddp": (),
        "s1": ("--node-mode", "local-sgd", "--node-sync-steps", "1"),
        "sh": ("--node-mode", "local-sgd"),
    }
    with nodes(tmp_path, *(Node(flags) for flags in modes.values())) as started:
        for mode, (address, _) in zip(modes, started):
            with WorkerClient(address, timeout=TIMEOUT) as client:
                client.push_state(st)
                result, _ = client.run_round(order)
                results[mode] = contribution(replica, result)
    assert_close(results["s1"], results["ddp"])
    # S = H: each rank takes H SGD steps on its own rows; the node returns the average model's delta.
    models = []
    for rank in range(2):
        m = build_from_spec(SPEC, seed=0)
        for step in range(h):
            rows = order.batch[step * 4 : (step + 1) * 4][rank * 2 : (rank + 1) * 2]
            m.zero_grad()
            lm_loss(m, torch.from_numpy(rows.astype(np.int64))).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(p.grad, alpha=-0.5)
        models.append(dict(m.named_parameters()))
    expected = {n: p - (models[0][n] + models[1][n]) / 2 for n, p in replica.params.items()}
    assert_close(results["sh"], expected)
    assert any((results["sh"][n] - results["ddp"][n]).abs().max() > 1e-4 for n in expected)  # they differ


@pytest.mark.parametrize("hook", ["powersgd", "dct"])
def test_compressing_node_hooks_train_and_send_less_on_the_bus(tmp_path, hook):
    replica, st = state()
    dense_bytes = 4 * sum(p.numel() for p in replica.params.values())
    with node(tmp_path, "--node-comm-hook", hook) as (address, _), WorkerClient(address, timeout=TIMEOUT) as client:
        client.push_state(st)
        order = WorkOrder(
            "run",
            0,
            0,
            batch(4 * 6),
            DENSE_CODEC,
            replica.fingerprint(),
            local_steps=LocalSteps(6, InnerOptimizerConfig(), (3e-3,) * 6),
        )
        result, _ = client.run_round(order)
    delta = contribution(replica, result)
    assert all(torch.isfinite(d).all() for d in delta.values()) and any(d.abs().max() > 0 for d in delta.values())
    # Six DDP steps; PowerSGD warms up with two plain all-reduces, the DCT hook sends ~8% of fp32 every step.
    assert result.node_bytes < 6 * dense_bytes * (0.5 if hook == "powersgd" else 0.15), result.node_bytes
    before = build_from_spec(SPEC, seed=0)
    rows = torch.from_numpy(order.batch.astype(np.int64))
    trained = build_from_spec(SPEC, seed=0)
    with torch.no_grad():
        for (n, p), q in zip(trained.named_parameters(), before.parameters()):
            p.copy_(q - delta[n])
        assert float(lm_loss(trained, rows)) < float(lm_loss(before, rows))  # the node's steps lowered the loss


def node_config(out: Path, steps: int, **changes: object) -> TrainConfig:
    """A short local-SGD run of gpt-tiny against nodes (H 2, 2 rows a rank, 32 tokens), into ``out``."""
    settings = dict(model="gpt-tiny", batch_size=2, sequence_length=32, inner_steps=2, inner_learning_rate=3e-3)
    return TrainConfig(**{**settings, **changes}, steps=steps, output_dir=str(out), round_timeout=TIMEOUT)


def test_a_coordinator_trains_with_two_nodes_one_under_torchrun(tmp_path):
    with nodes(tmp_path, Node(), Node(torchrun=True)) as [(a, _), (b, _)]:
        config = node_config(tmp_path / "run", 6)
        run_trainer(config, [WorkerClient(a, timeout=TIMEOUT), WorkerClient(b, timeout=TIMEOUT)])
    records = read_metrics(tmp_path / "run")
    assert all(r["ranks"] == 4 and r["successful_workers"] == 2 for r in records)
    assert records[-1]["total_tokens"] == 6 * 2 * 2 * (2 * 2) * 32  # rounds x H x nodes x (ranks x batch) x T
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["node_bus_bytes"] > 0 for r in records)


def resume_against_straight(tmp_path: Path, *flags: str) -> dict[str, dict[str, torch.Tensor]]:
    """A node of ``flags`` trains 4 local-SGD rounds straight, then 2 rounds of another run; a second node,
    fresh (new processes that have served nothing: none of that run's state is in them), resumes from that
    checkpoint to 4. Asserts that both runs end bit for bit alike; returns the checkpoint's tensor groups.
    (The runs are separate sessions on the first node; anything one left to the next could only make the
    straight run or the checkpoint differ from what the fresh node computes.)"""

    def config(name: str, steps: int, **changes: object) -> TrainConfig:
        return node_config(tmp_path / name, steps, checkpoint_every=0, **changes)

    with nodes(tmp_path, Node(flags), Node(flags)) as [(used, _), (fresh, _)]:
        straight = run_trainer(config("straight", 4), [WorkerClient(used, timeout=TIMEOUT)])
        first = run_trainer(config("resumed", 2), [WorkerClient(used, timeout=TIMEOUT)])
        assert first.last_checkpoint is not None
        resumed = run_trainer(
            config("resumed", 4, resume_from=str(first.last_checkpoint)), [WorkerClient(fresh, timeout=TIMEOUT)]
        )
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name
    return load_checkpoint(first.last_checkpoint)[0]


@pytest.mark.slow
def test_a_node_that_diverges_forgets_the_inner_state_on_every_rank(tmp_path):
    """A local-SGD round whose learning rate blows the model up fails FAILED_PRECONDITION, and every rank -
    not only rank 0, which encodes - drops the inner state that took in the NaN: the next round computes
    what a fresh node computes."""
    replica, st = state()
    sgd = InnerOptimizerConfig(name="sgd", momentum=0.9)  # its momentum buffers would keep the NaN

    def order(lr: float) -> WorkOrder:
        steps = LocalSteps(3, sgd, (lr,) * 3)
        return WorkOrder("run", 0, 0, batch(12), DENSE_CODEC, replica.fingerprint(), local_steps=steps)

    flags = ("--node-mode", "local-sgd")
    with nodes(tmp_path, Node(flags), Node(flags)) as [(diverging, _), (other, _)]:  # the second: a fresh node
        with WorkerClient(diverging, timeout=TIMEOUT) as client:
            client.push_state(st)
            with pytest.raises(WorkerError) as info:
                client.run_round(order(1e6))
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "diverged" in info.value.details
            after, _ = client.run_round(order(0.05))
        with WorkerClient(other, timeout=TIMEOUT) as client:
            client.push_state(st)
            fresh, _ = client.run_round(order(0.05))
    assert_close(contribution(replica, after), contribution(replica, fresh), atol=0)


@pytest.mark.slow
def test_a_local_sgd_node_resumes_every_ranks_inner_state(tmp_path):
    """Ranks that step apart have an inner optimizer state each: a checkpoint keeps every rank's, and a
    fresh node resumed from it trains on exactly as the node that never stopped (4 rounds = 2 + resume 2)."""
    saved = resume_against_straight(tmp_path, "--node-mode", "local-sgd")
    (inner,) = [group for name, group in saved.items() if name.startswith("inner-")]
    own = {n for n in inner if not n.startswith("rank1.")}
    assert own and {n.removeprefix("rank1.") for n in inner if n.startswith("rank1.")} == own  # both ranks'


def _rank_pid(tmp_path: Path, launcher: subprocess.Popen, rank: int) -> int:
    """The pid of ``rank`` of the node ``launcher`` runs, as the launcher's log names its ranks last."""
    port = launcher.args[launcher.args.index("--port") + 1]
    started = re.findall(r"ranks started \(pids \[([\d, ]+)\]\)", (tmp_path / f"node-{port}.log").read_text())
    assert started, "the launcher has not logged its ranks"
    return int(started[-1].split(",")[rank])


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_a_node_that_loses_a_rank_fails_its_round_restarts_and_rejoins(tmp_path, fault):
    # The node's collectives time out after 5 s: a hung rank fails the round well within its 30 s deadline.
    with nodes(tmp_path, Node(timeout=5.0), Node(ranks=1)) as [(a, launcher), (b, _)]:
        config = TrainConfig(
            model="gpt-tiny",
            steps=12,
            batch_size=2,
            sequence_length=32,
            output_dir=str(tmp_path / "run"),
            round_timeout=30.0,
            max_failed_rounds=5,
        )
        from gradwire.coordinator.trainer import Trainer

        # The restarted node is dialled again within a second of listening (the client's own reconnect
        # backoff grows to 10 s while the node restarts, which would only add to this test's wait).
        redial = grpc.insecure_channel(a, options=[*grpc_options(), ("grpc.max_reconnect_backoff_ms", 1000)])
        clients = [WorkerClient(a, timeout=30.0, channel=redial), WorkerClient(b, timeout=30.0)]
        trainer = Trainer(config, clients, progress=False)
        try:
            trainer.connect()
            records = [trainer.train_step() for _ in range(2)]
            os.kill(_rank_pid(tmp_path, launcher, 1), fault)  # one GPU process of the node dies, or hangs
            t0 = time.monotonic()
            records.append(trainer.train_step())
            assert time.monotonic() - t0 < 30.0  # within the round's deadline (a hang: the node's 5 s timeout)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:  # the launcher restarts the node; it rejoins after a push
                record = trainer.train_step()
                records.append(record)
                if record and record["successful_workers"] == 2 and record["step"] > 3:
                    break
        finally:
            trainer.close()
        assert launcher.poll() is None  # the launcher lives on
    assert [r["successful_workers"] for r in records[:2]] == [2, 2]
    assert records[2] is not None and records[2]["successful_workers"] == 1  # the other worker carried the round
    assert records[-1]["successful_workers"] == 2 and records[-1]["pushes"] >= 1


def test_ranks_do_not_outlive_a_killed_launcher(tmp_path):
    with node(tmp_path) as (_, launcher):
        ranks = [_rank_pid(tmp_path, launcher, r) for r in (0, 1)]
        launcher.kill()  # SIGKILL: no chance to stop its ranks itself
        launcher.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(map(_alive, ranks)):
            time.sleep(0.2)
        assert not any(map(_alive, ranks))


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
