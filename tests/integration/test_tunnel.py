"""Workers behind NAT: `worker serve --join HOST:PORT --tunnel` and calls through the tunnel it holds open.

The worker's server listens on a Unix socket only its relay uses; the coordinator reaches it solely
through the tunnel, and every call still meets the worker's own checks (token, deadlines, bounds)."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.join import JoinRegistry, serve_joins
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.coordinator.tunnel import Tunnels
from gradwire.errors import Cancelled
from gradwire.protocol import PROTOCOL_VERSION
from gradwire.security import ClientSecurity, ServerSecurity
from gradwire.transport import free_port
from gradwire.tunnel import MAX_CALLS, TUNNEL_PREFIX, check_metadata, check_name
from gradwire.v1 import coordinator_pb2 as pb
from gradwire.v1 import coordinator_pb2_grpc
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import in_process_clients
from gradwire.worker.server import make_server
from gradwire.worker.servicer import WorkerServicer
from gradwire.worker.tunnel import TunnelRelay

from ..faults import FaultPlan, FaultyEngine
from ..tls import CertificateAuthority
from .conftest import run_trainer, worker_process

TOKEN = "tunnel-test-token-0123456789abcdef"
TIMEOUT = 60.0


@contextlib.contextmanager
def coordinator_side(
    token: str | None = TOKEN, security: ServerSecurity | None = None
) -> Iterator[tuple[JoinRegistry, Tunnels, str]]:
    """The coordinator's --listen server: (its registry, its tunnels, its address)."""
    registry, tunnels = JoinRegistry(), Tunnels()
    server, port = serve_joins(
        registry, host="127.0.0.1", port=0, security=security or ServerSecurity(token=token), tunnels=tunnels
    )
    try:
        yield registry, tunnels, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@contextlib.contextmanager
def tunnelled_worker(
    coordinator: str,
    name: str = "box-behind-nat",
    engine: WorkerEngine | None = None,
    token: str | None = TOKEN,
    tls_ca: str | None = None,
) -> Iterator[tuple[WorkerEngine, TunnelRelay]]:
    """A worker and its relay (the worker's server also listens on loopback TCP, as `worker serve` does;
    the tests reach it only through the tunnel)."""
    engine = engine or WorkerEngine("cpu")
    with tempfile.TemporaryDirectory(prefix="gradwire-test-relay-") as tmp:
        socket = f"{tmp}/worker.sock"
        server, _, _ = make_server(
            WorkerServicer(engine), host="127.0.0.1", port=0, security=ServerSecurity(token=token), local_socket=socket
        )
        relay = TunnelRelay(
            coordinator, name, f"unix:{socket}", security=ClientSecurity(token=token, tls_ca=tls_ca), every=0.2
        ).start()
        try:
            yield engine, relay
        finally:
            relay.stop()
            server.stop(0)


def wait_for(predicate, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def client_through(
    tunnels: Tunnels, name: str, security: ClientSecurity | None = None, timeout: float = TIMEOUT
) -> WorkerClient:
    return WorkerClient(
        TUNNEL_PREFIX + name,
        timeout=timeout,
        security=security or ClientSecurity(token=TOKEN),
        channel=tunnels.channel(name),
    )


# ------------------------------------------------------------------------------------------- pure checks


def test_names_and_metadata_are_checked() -> None:
    assert check_name("gpu-1.example.org:50051") == "gpu-1.example.org:50051"
    for bad in ("", "a b", "x" * 129, "tab\there", "é"):
        with pytest.raises(ValueError, match="name"):
            check_name(bad)
    assert check_metadata([("authorization", "Bearer x"), ("gradwire-run-key", "ab12")])
    for bad in (
        [("grpc-timeout", "1S")],
        [("key-bin", "x")],
        [("Upper", "x")],
        [("k", "\x00")],
        [("k", "v")] * 17,
        [("k", "v" * 9000)],
    ):
        with pytest.raises(ValueError):
            check_metadata(bad)


def test_a_tunnelled_member_lives_while_its_tunnel_is_open_and_for_the_expiry_after() -> None:
    now = [0.0]
    registry = JoinRegistry(expiry=30, clock=lambda: now[0])
    assert registry.hold("tunnel:w") == (True, "")
    now[0] = 1000.0
    assert registry.live() == ["tunnel:w"]  # held: the clock does not matter
    registry.release("tunnel:w")
    now[0] = 1029.0
    assert registry.live() == ["tunnel:w"]  # dropped 29 s ago: a reconnect would keep its place
    now[0] = 1031.0
    assert registry.live() == []


# ------------------------------------------------------------------------------------------- training


def test_a_worker_behind_a_tunnel_trains_like_a_direct_one(tmp_path: Path) -> None:
    """The same run through a tunnel and over a direct connection: identical losses and parameters."""
    config = TrainConfig(
        model="gpt-tiny", steps=4, batch_size=2, sequence_length=32, output_dir=str(tmp_path / "tunnel")
    )
    with coordinator_side() as (registry, tunnels, address), tunnelled_worker(address) as (engine, relay):
        wait_for(lambda: registry.live() == [TUNNEL_PREFIX + "box-behind-nat"], what="the tunnel")
        client = client_through(tunnels, "box-behind-nat")
        client.wait_ready(10)  # health, through the tunnel
        assert client.describe().protocol_version == PROTOCOL_VERSION
        through = run_trainer(config, [client])
        last = read_metrics(tmp_path / "tunnel")[-1]
        assert last["bytes_up"] > 0 and last["bytes_down"] > 0  # the trainer's traffic, through the tunnel
        client.close()
    direct_engine = WorkerEngine("cpu")
    server, port, _ = make_server(WorkerServicer(direct_engine), host="127.0.0.1", port=0)
    try:
        direct_config = TrainConfig(
            model="gpt-tiny", steps=4, batch_size=2, sequence_length=32, output_dir=str(tmp_path / "direct")
        )
        direct = run_trainer(direct_config, [WorkerClient(f"127.0.0.1:{port}", timeout=TIMEOUT)])
    finally:
        server.stop(0)
    losses = [r["loss"] for r in read_metrics(tmp_path / "tunnel")]
    assert losses == [r["loss"] for r in read_metrics(tmp_path / "direct")] and len(losses) == 4
    for name, p in through.replica.params.items():
        assert torch.equal(p, direct.replica.params[name]), name


def test_a_tunnelled_worker_gossips_peer_to_peer_through_the_coordinator(tmp_path: Path) -> None:
    """A peer-to-peer ring of 3, one worker behind a tunnel: nobody can pull from it and it pulls from nobody,
    so it and its neighbours upload their messages and the coordinator relays them across the tunnel; the two
    direct workers pull from each other. The run is the one where every pair pulls, bit for bit."""
    settings = dict(
        model="gpt-tiny", steps=4, batch_size=2, sequence_length=32, inner_steps=2, eval_batches=1,
        topology="ring", peer_to_peer=True, round_timeout=TIMEOUT,
    )  # fmt: skip
    direct = [WorkerEngine("cpu") for _ in range(2)]
    servers = [
        make_server(WorkerServicer(e), host="127.0.0.1", port=0, security=ServerSecurity(token=None)) for e in direct
    ]
    try:
        with coordinator_side(token=None) as (registry, tunnels, address), tunnelled_worker(address, token=None):
            wait_for(lambda: registry.live() == [TUNNEL_PREFIX + "box-behind-nat"], what="the tunnel")
            clients = [client_through(tunnels, "box-behind-nat", security=ClientSecurity())]
            clients += [WorkerClient(f"127.0.0.1:{port}", timeout=TIMEOUT) for _, port, _ in servers]
            through = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "tunnel")), clients)
    finally:
        for server, _, _ in servers:
            server.stop(0)
    pulling = run_trainer(TrainConfig(**settings, output_dir=str(tmp_path / "pull")), in_process_clients(3))
    records = read_metrics(tmp_path / "tunnel")
    tunnel, a, b = (c.address for c in clients)
    assert [r["successful_workers"] for r in records] == [3, 3, 3, 3]
    assert [r["uploaded_payloads"] for r in records] == [3, 3, 3, 3]  # all three neighbour the tunnelled one
    last = records[-1]
    assert last["relayed_payloads"] == {tunnel: 2, a: 1, b: 1} and last["pulled_payloads"] == {tunnel: 0, a: 1, b: 1}
    assert [r["loss"] for r in records] == [r["loss"] for r in read_metrics(tmp_path / "pull")]
    for name, v in through.gossip.consensus().items():
        assert torch.equal(v, pulling.gossip.consensus()[name]), name


def test_calls_through_a_tunnel_meet_the_workers_own_checks() -> None:
    with coordinator_side() as (registry, tunnels, address), tunnelled_worker(address):
        wait_for(lambda: tunnels.get("box-behind-nat") is not None, what="the tunnel")
        stranger = client_through(tunnels, "box-behind-nat", security=ClientSecurity(token="not-the-token-0123456789"))
        with pytest.raises(WorkerError) as e:
            stranger.describe()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED  # the worker's RequireToken answered, relayed
        channel = tunnels.channel("box-behind-nat")
        metadata = ClientSecurity(token=TOKEN).metadata()
        with pytest.raises(grpc.RpcError) as e:  # not a Worker method: the relay refuses it
            channel.unary_unary("/gradwire.v1.Coordinator/Join")(b"", timeout=5, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as e:  # reserved metadata does not cross
            channel.unary_unary("/gradwire.v1.Worker/Describe")(b"", timeout=5, metadata=[("grpc-timeout", "1S")])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:  # garbage for a real method: the worker's RejectMalformed
            channel.unary_unary("/gradwire.v1.Worker/Describe")(b"\xff\xff\xff", timeout=5, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            client_through(tunnels, "box-behind-nat").describe().protocol_version == PROTOCOL_VERSION
        )  # still serving


class CancelRecorder(FaultyEngine):
    """Stalls round 1 and records the rounds it abandoned because the call was cancelled."""

    def __init__(self) -> None:
        super().__init__(FaultPlan("stall", factor=60.0, rounds={1}))
        self.abandoned: list[int] = []

    def run_round(self, order, cancelled=lambda: False, owner=b"", emit=None):  # noqa: ANN001, ANN201 - FaultyEngine's signature
        try:
            return super().run_round(order, cancelled, owner, emit)
        except Cancelled:
            self.abandoned.append(order.round)
            raise


def test_a_stalled_call_times_out_and_is_cancelled_at_the_worker(tmp_path: Path) -> None:
    engine = CancelRecorder()
    config = TrainConfig(
        model="gpt-tiny", steps=2, batch_size=2, sequence_length=32, output_dir=str(tmp_path / "run"), round_timeout=3.0
    )
    with coordinator_side() as (registry, tunnels, address), tunnelled_worker(address, engine=engine):
        wait_for(lambda: tunnels.get("box-behind-nat") is not None, what="the tunnel")
        trainer = Trainer(config, [client_through(tunnels, "box-behind-nat", timeout=3.0)], progress=False)
        try:
            trainer.connect()
            assert trainer.train_step() is not None  # round 0
            t0 = time.monotonic()
            assert trainer.train_step() is None  # round 1 stalls past its 3 s deadline: no usable worker
            assert time.monotonic() - t0 < 15
        finally:
            trainer.close()
        # the relay cancelled its local call: the worker gave the stalled round up long before its 60 s
        wait_for(lambda: engine.abandoned == [1], timeout=10, what="the worker to abandon round 1")


def test_a_dropped_tunnel_fails_its_calls_and_the_worker_comes_back_under_its_name() -> None:
    with coordinator_side() as (registry, tunnels, address):
        with tunnelled_worker(address, name="w1"):
            wait_for(lambda: tunnels.get("w1") is not None, what="the tunnel")
            client = client_through(tunnels, "w1")
            assert client.describe().protocol_version == PROTOCOL_VERSION
        # the worker is gone: calls fail as for an unreachable worker, and it stays a member for a while
        wait_for(lambda: tunnels.get("w1") is None, what="the tunnel to close")
        with pytest.raises(WorkerError) as e:
            client.describe(timeout=5)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert registry.live() == [TUNNEL_PREFIX + "w1"]
        with tunnelled_worker(address, name="w1"):  # a restart: the same name, the same client works again
            wait_for(lambda: tunnels.get("w1") is not None, what="the tunnel again")
            client.wait_ready(10)
            assert client.describe().protocol_version == PROTOCOL_VERSION


def test_the_tunnel_needs_the_coordinators_token() -> None:
    with coordinator_side() as (registry, tunnels, address), tunnelled_worker(address, token=None) as (_, relay):
        wait_for(lambda: relay.opened >= 2, what="two attempts")  # it tried (the hello went out), twice
        assert tunnels.get("box-behind-nat") is None and registry.live() == []  # and was refused


def test_a_tunnel_over_tls(tmp_path: Path) -> None:
    """--listen-tls-cert on the coordinator, --join-tls-ca on the worker: the token never crosses in the
    clear; a worker that speaks plaintext to a TLS listener does not get in."""
    ca = CertificateAuthority(tmp_path)
    issued = ca.issue("coordinator", server=True)
    security = ServerSecurity(token=TOKEN, tls_cert=str(issued.cert), tls_key=str(issued.key))
    with coordinator_side(security=security) as (registry, tunnels, address):
        with tunnelled_worker(address, name="plain"):
            time.sleep(1.0)
            assert tunnels.get("plain") is None
        with tunnelled_worker(address, tls_ca=str(ca.files.cert)):
            wait_for(lambda: tunnels.get("box-behind-nat") is not None, what="the TLS tunnel")
            assert client_through(tunnels, "box-behind-nat").describe().protocol_version == PROTOCOL_VERSION


def open_raw(
    address: str, frames: list[pb.TunnelFrame], token: str | None = TOKEN
) -> grpc.RpcError | list[pb.TunnelFrame]:
    """Open a tunnel by hand and send ``frames``; what came back (frames, or the error that ended it)."""
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            return list(
                stub.Tunnel(iter(frames), timeout=5, metadata=[("authorization", f"Bearer {token}")] if token else None)
            )
        except grpc.RpcError as e:
            return e


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([pb.TunnelFrame(message=b"x")], grpc.StatusCode.INVALID_ARGUMENT),
        (
            [pb.TunnelFrame(hello=pb.TunnelHello(protocol_version=PROTOCOL_VERSION + 1, name="w"))],
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            [pb.TunnelFrame(hello=pb.TunnelHello(protocol_version=PROTOCOL_VERSION, name="has space"))],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            [pb.TunnelFrame(hello=pb.TunnelHello(protocol_version=PROTOCOL_VERSION, name="x" * 5000))],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
    ids=["no-hello", "other-protocol", "bad-name", "huge-name"],
)
def test_a_bad_tunnel_is_refused_with_a_clear_status_and_the_coordinator_keeps_serving(
    frames: list[pb.TunnelFrame], code: grpc.StatusCode
) -> None:
    with coordinator_side() as (registry, tunnels, address):
        error = open_raw(address, frames)
        assert isinstance(error, grpc.RpcError) and error.code() == code, error
        assert registry.live() == []
        with tunnelled_worker(address):  # a good one still gets in
            wait_for(lambda: tunnels.get("box-behind-nat") is not None, what="the tunnel")


def test_frames_for_calls_that_do_not_exist_are_ignored() -> None:
    """A worker that sends replies nobody asked for (or statuses with made-up codes) changes nothing."""
    with coordinator_side() as (registry, tunnels, address):
        frames: queue.Queue = queue.Queue()
        frames.put(pb.TunnelFrame(hello=pb.TunnelHello(protocol_version=PROTOCOL_VERSION, name="noisy")))
        # ids the link never gives a call of this test (they count from 1): a made-up reply for id 1 could still
        # be on its way when the call below opens as id 1, and then it would be that call's answer
        for call in (0, 2**32, 2**63):
            frames.put(pb.TunnelFrame(call=call, message=b"\x00" * 1000))
            frames.put(pb.TunnelFrame(call=call, status=pb.TunnelStatus(code=999, details="x" * 5000)))
        with grpc.insecure_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            replies = stub.Tunnel(iter(frames.get, None), timeout=60, metadata=[("authorization", f"Bearer {TOKEN}")])
            wait_for(lambda: tunnels.get("noisy") is not None, what="the tunnel")
            # the link is published a moment before the registry holds its name (Tunnels.on_open)
            wait_for(lambda: registry.live() != [], what="the tunnel's member")
            assert registry.live() == [TUNNEL_PREFIX + "noisy"]
            # a call now: the worker never answers, so it ends at its deadline, not with a stale frame
            with pytest.raises(grpc.RpcError) as e:
                tunnels.channel("noisy").unary_unary("/gradwire.v1.Worker/Describe")(b"", timeout=1.0)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            frames.put(None)
            replies.cancel()
        assert MAX_CALLS >= 2


# ------------------------------------------------------------------------------------------- the commands


def train_through_a_tunnel(
    out: Path, steps: int, coordinator_flags: list[str], worker_flags: list[str]
) -> tuple[list[dict], str]:
    """`coordinator train --listen` and one `worker serve --join ... --tunnel` process, both with the token;
    the run's metrics and the coordinator's log."""
    listen, port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "GRADWIRE_TOKEN": TOKEN}
    argv = [
        sys.executable,
        "-m",
        "gradwire.coordinator",
        "train",
        "--listen",
        f"127.0.0.1:{listen}",
        *coordinator_flags,
        "--model",
        "gpt-tiny",
        "--steps",
        str(steps),
        "--batch-size",
        "2",
        "--sequence-length",
        "32",
        "--output-dir",
        str(out),
        "--no-progress",
        "--checkpoint-every",
        "0",
    ]
    coordinator = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    os.environ["GRADWIRE_TOKEN"] = TOKEN  # the worker's token, from its environment
    try:
        worker = worker_process(port, "--join", f"127.0.0.1:{listen}", "--tunnel", *worker_flags)
        _, stderr = coordinator.communicate(timeout=240)
        assert coordinator.returncode == 0, stderr[-3000:]
    finally:
        os.environ.pop("GRADWIRE_TOKEN", None)
        if coordinator.poll() is None:
            coordinator.kill()
        worker.terminate()
        worker.wait(30)
    return read_metrics(out), stderr


@pytest.mark.slow
def test_worker_serve_tunnel_trains_with_a_listening_coordinator(tmp_path: Path) -> None:
    """`worker serve --join --tunnel --advertise NAME`: NAME is no address at all, so the coordinator can
    only have reached the worker through the tunnel."""
    records, stderr = train_through_a_tunnel(tmp_path / "run", 6, [], ["--advertise", "gpu-box-behind-nat"])
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and all(r["successful_workers"] == 1 for r in records)
    assert f"{TUNNEL_PREFIX}gpu-box-behind-nat" in stderr


@pytest.mark.slow
def test_worker_serve_tunnel_over_tls_trains(tmp_path: Path) -> None:
    """The flags end to end: `coordinator train --listen --listen-tls-cert/--listen-tls-key` and
    `worker serve --join --join-tls-ca --tunnel`."""
    ca = CertificateAuthority(tmp_path / "pki")
    issued = ca.issue("coordinator", server=True)
    records, stderr = train_through_a_tunnel(
        tmp_path / "run",
        3,
        ["--listen-tls-cert", str(issued.cert), "--listen-tls-key", str(issued.key)],
        ["--join-tls-ca", str(ca.files.cert), "--advertise", "tls-box"],
    )
    assert [r["successful_workers"] for r in records] == [1, 1, 1]
    assert f"{TUNNEL_PREFIX}tls-box" in stderr


def test_tunnel_flags_are_checked(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "gradwire.worker", "serve", "--port", "0", "--tunnel"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 2 and "--tunnel needs --join" in run.stderr
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradwire.worker",
            "serve",
            "--port",
            "0",
            "--join",
            "127.0.0.1:1",
            "--join-tls-ca",
            str(tmp_path / "missing.pem"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 2 and "--join-tls-ca" in run.stderr


def test_listen_tls_flags_are_checked(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    base = [
        sys.executable,
        "-m",
        "gradwire.coordinator",
        "train",
        "--listen",
        "127.0.0.1:0",
        "--model",
        "gpt-tiny",
        "--steps",
        "1",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    run = subprocess.run(
        [*base, "--listen-tls-cert", str(tmp_path / "missing.pem")], capture_output=True, text=True, env=env, timeout=60
    )
    assert run.returncode == 2 and "--listen-tls-cert and --listen-tls-key go together" in run.stderr
    run = subprocess.run(
        [*base, "--listen-tls-cert", str(tmp_path / "missing.pem"), "--listen-tls-key", str(tmp_path / "missing.key")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 2 and "--listen-tls-" in run.stderr and "missing" in run.stderr


def test_garbage_on_the_tunnel_never_gets_internal_and_the_coordinator_keeps_serving() -> None:
    """Random bytes and random frames from a would-be worker (with the token): clear statuses, never
    INTERNAL or UNKNOWN, and a real worker's tunnel works after them."""
    import random

    rng = random.Random(0)
    hello = pb.TunnelFrame(hello=pb.TunnelHello(protocol_version=PROTOCOL_VERSION, name="fuzz")).SerializeToString()
    kinds = [
        lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))),  # not a frame at all
        lambda: pb.TunnelFrame(
            call=rng.randrange(2**64), message=rng.randbytes(rng.randrange(0, 2048))
        ).SerializeToString(),
        lambda: pb.TunnelFrame(
            call=rng.randrange(4), status=pb.TunnelStatus(code=rng.randrange(-5, 40), details="x" * rng.randrange(3000))
        ).SerializeToString(),
        lambda: pb.TunnelFrame(
            call=rng.randrange(4), open=pb.TunnelOpen(method="/x/y", timeout_seconds=rng.uniform(-1, 1e9))
        ).SerializeToString(),
        lambda: pb.TunnelFrame(
            hello=pb.TunnelHello(protocol_version=rng.randrange(10), name=rng.choice(["", "a b", "w" * 200, "ok"]))
        ).SerializeToString(),
    ]
    codes = []
    with coordinator_side() as (registry, tunnels, address), grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            "/gradwire.v1.Coordinator/Tunnel", request_serializer=None, response_deserializer=None
        )
        for _ in range(120):
            frames = ([hello] if rng.random() < 0.5 else []) + [rng.choice(kinds)() for _ in range(rng.randrange(1, 6))]
            try:
                list(call(iter(frames), timeout=2, metadata=[("authorization", f"Bearer {TOKEN}")]))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        assert grpc.StatusCode.INTERNAL not in codes and grpc.StatusCode.UNKNOWN not in codes, sorted(
            {c.name for c in codes}
        )
        assert grpc.StatusCode.INVALID_ARGUMENT in codes
        with tunnelled_worker(address):
            wait_for(lambda: tunnels.get("box-behind-nat") is not None, what="the tunnel after the garbage")
            assert client_through(tunnels, "box-behind-nat").describe().protocol_version == PROTOCOL_VERSION
