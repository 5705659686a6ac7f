"""Authentication, TLS, mutual TLS and run isolation against real worker servers on loopback.

A worker with a token answers every call without it (or with another) UNAUTHENTICATED and changes
nothing; its health service stays open. Runs belong to the run key (and client certificate) of the
coordinator that started them: another caller, token or not, can neither list, read nor replace them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradwire.compression import CodecConfig
from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, ModelState, WorkOrder
from gradwire.replica import Replica
from gradwire.security import ClientSecurity, ServerSecurity
from gradwire.transport import SERVICE_NAME
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.peers import Peers
from gradwire.worker.server import make_server
from gradwire.worker.servicer import WorkerServicer

from ..tls import CertificateAuthority
from .conftest import run_trainer

TOKEN = "s3cret-token-0123456789abcdef"
SPEC = model_spec("gpt-tiny")
RULE = UpdateRule(optimizer="sgd")
RUN = "run-a"
TIMEOUT = 30.0


@dataclasses.dataclass
class Served:
    engine: WorkerEngine
    address: str

    def client(self, **security: object) -> WorkerClient:
        return WorkerClient(self.address, timeout=TIMEOUT, security=ClientSecurity(**security))


@contextlib.contextmanager
def served(security: ServerSecurity) -> Iterator[Served]:
    engine = WorkerEngine("cpu")
    server, port, _ = make_server(WorkerServicer(engine), host="127.0.0.1", port=0, security=security)
    try:
        yield Served(engine, f"127.0.0.1:{port}")
    finally:
        server.stop(0).wait(5)


def state(run: str = RUN, version: int = 0) -> ModelState:
    model = build_from_spec(SPEC, seed=0)
    return ModelState(
        run, version, json.dumps(SPEC), {n: p.detach().clone() for n, p in model.named_parameters()}, RULE.to_json()
    )


def order(replica: Replica, run: str = RUN, round: int = 1) -> WorkOrder:
    batch = np.random.default_rng(round).integers(0, 8192, (2, 17)).astype(np.uint16)
    return WorkOrder(run, round, replica.version, batch, CodecConfig(), replica.fingerprint())


def coordinator_replica() -> Replica:
    return Replica(build_from_spec(SPEC, seed=0), RULE)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(WorkerError) as info:
        call()
    return info.value.code


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority(tmp_path_factory.mktemp("pki"))


# --------------------------------------------------------------------------------------------- tokens


def test_without_the_token_every_call_is_refused_and_nothing_changes() -> None:
    with served(ServerSecurity(token=TOKEN)) as worker:
        good = worker.client(token=TOKEN)
        good.push_state(state())
        (session,) = worker.engine.sessions.values()
        before = session.replica.fingerprint()
        replica = coordinator_replica()
        for intruder in (
            worker.client(),
            worker.client(token="wrong-token-0123456789abcdef"),
            worker.client(token=TOKEN[:-1]),
        ):
            assert code_of(intruder.describe) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda c=intruder: c.push_state(state("run-b"))) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda c=intruder: c.push_state(state(RUN, version=7))) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda c=intruder: c.run_round(order(replica))) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda c=intruder: c.fetch_worker_state(RUN)) == grpc.StatusCode.UNAUTHENTICATED
            intruder.wait_ready(5)  # health needs no token: probes and load balancers keep working
            intruder.close()
        assert list(worker.engine.sessions) == [RUN] and worker.engine.sessions[RUN] is session
        assert session.replica.fingerprint() == before and session.replica.version == 0
        result, _ = good.run_round(order(replica))
        assert result.status == OK  # the owner is still served


def test_health_answers_without_a_token() -> None:
    with served(ServerSecurity(token=TOKEN)) as worker, grpc.insecure_channel(worker.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_token_worker_trains_with_a_token_coordinator(tmp_path: Path) -> None:
    with served(ServerSecurity(token=TOKEN)) as a, served(ServerSecurity(token=TOKEN)) as b:
        shared = ClientSecurity(token=TOKEN)  # one run key for the run's every worker
        clients = [WorkerClient(w.address, timeout=TIMEOUT, security=shared) for w in (a, b)]
        config = TrainConfig(
            model="gpt-tiny", steps=3, batch_size=2, sequence_length=32, output_dir=str(tmp_path / "run")
        )
        trainer = run_trainer(config, clients)
        assert trainer.step == 3
        for w in (a, b):
            (session,) = w.engine.sessions.values()
            assert session.replica.version == trainer.base_version


# --------------------------------------------------------------------------------------------- run isolation


def test_one_run_cannot_read_or_replace_another() -> None:
    with served(ServerSecurity(token=TOKEN)) as worker:
        owner, other = worker.client(token=TOKEN), worker.client(token=TOKEN)  # same token, other run keys
        owner.push_state(state())
        session = worker.engine.sessions[RUN]
        before = session.replica.fingerprint()
        replica = coordinator_replica()
        assert owner.describe().replicas == {RUN: 0}
        assert other.describe().replicas == {}  # not even listed
        assert code_of(lambda: other.fetch_worker_state(RUN)) == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda: other.push_state(state(RUN, version=5))) == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda: other.run_round(order(replica))) == grpc.StatusCode.PERMISSION_DENIED
        assert worker.engine.sessions[RUN] is session and session.replica.fingerprint() == before
        other.push_state(state("run-b"))  # a run of its own is fine
        assert other.describe().replicas == {"run-b": 0} and owner.describe().replicas == {RUN: 0}
        result, _ = owner.run_round(order(replica))
        assert result.status == OK
        fetched, _ = owner.fetch_worker_state(RUN)
        assert fetched.run_id == RUN
        assert code_of(lambda: other.close_run(RUN)) == grpc.StatusCode.PERMISSION_DENIED
        assert owner.close_run(RUN) is True and owner.close_run(RUN) is False
        assert list(worker.engine.sessions) == ["run-b"]


def test_the_run_key_is_what_owns_a_run() -> None:
    key = bytes(range(32))
    with served(ServerSecurity()) as worker:  # no token at all: the run key still keeps runs apart
        worker.client(run_key=key).push_state(state())
        again = worker.client(run_key=key)  # a new channel, the same run (a coordinator reconnecting)
        (version, _), _ = again.push_state(state(RUN, version=0))
        assert version == 0
        assert (
            code_of(lambda: worker.client(run_key=bytes(32)).push_state(state())) == grpc.StatusCode.PERMISSION_DENIED
        )


# --------------------------------------------------------------------------------------------- TLS


def test_tls_round_trip_and_plaintext_is_refused(ca: CertificateAuthority) -> None:
    server_cert = ca.issue("worker", server=True)
    with served(ServerSecurity(token=TOKEN, tls_cert=str(server_cert.cert), tls_key=str(server_cert.key))) as worker:
        client = worker.client(token=TOKEN, tls_ca=str(ca.files.cert))
        assert client.security.tls
        client.push_state(state())
        result, _ = client.run_round(order(coordinator_replica()))
        assert result.status == OK
        plaintext = WorkerClient(worker.address, timeout=3, security=ClientSecurity(token=TOKEN))
        assert code_of(plaintext.describe) == grpc.StatusCode.UNAVAILABLE


def test_tls_with_an_untrusted_ca_is_refused(ca: CertificateAuthority, tmp_path: Path) -> None:
    server_cert = ca.issue("worker", server=True)
    stranger = CertificateAuthority(tmp_path / "other", name="another CA")
    with served(ServerSecurity(tls_cert=str(server_cert.cert), tls_key=str(server_cert.key))) as worker:
        client = WorkerClient(worker.address, timeout=3, security=ClientSecurity(tls_ca=str(stranger.files.cert)))
        assert code_of(client.describe) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_ca(ca: CertificateAuthority, tmp_path: Path) -> None:
    server_cert = ca.issue("worker", server=True)
    alice, bob = ca.issue("alice", server=False), ca.issue("bob", server=False)
    mallory = CertificateAuthority(tmp_path / "mallory", name="mallory CA").issue("mallory", server=False)
    settings = ServerSecurity(
        tls_cert=str(server_cert.cert), tls_key=str(server_cert.key), tls_client_ca=str(ca.files.cert)
    )
    with served(settings) as worker:

        def client(cert=None, key: bytes = bytes(32), timeout: float = TIMEOUT) -> WorkerClient:
            files = {"tls_cert": str(cert.cert), "tls_key": str(cert.key)} if cert else {}
            return WorkerClient(
                worker.address,
                timeout=timeout,
                security=ClientSecurity(tls_ca=str(ca.files.cert), run_key=key, **files),
            )

        assert code_of(client(timeout=3).describe) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        assert code_of(client(mallory, timeout=3).describe) == grpc.StatusCode.UNAVAILABLE  # signed by another CA
        client(alice).push_state(state())
        assert client(alice).describe().replicas == {RUN: 0}
        # The same run key from another client certificate is another owner.
        assert client(bob).describe().replicas == {}
        assert code_of(lambda: client(bob).push_state(state())) == grpc.StatusCode.PERMISSION_DENIED


# --------------------------------------------------------------------------------------------- settings


def test_server_security_needs_whole_tls_settings_and_readable_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        ServerSecurity(tls_cert="a.pem")
    with pytest.raises(ValueError, match="--tls-client-ca"):
        ServerSecurity(tls_client_ca="ca.pem")
    with pytest.raises(ValueError, match="--tls-key .*missing.key: cannot read it"):
        ServerSecurity(tls_cert=str(tmp_path / "missing.crt"), tls_key=str(tmp_path / "missing.key")).credentials()


def test_the_worker_warns_when_it_listens_beyond_loopback_without_a_token() -> None:
    assert ServerSecurity().warnings("127.0.0.1") == [] and ServerSecurity().warnings("[::1]") == []
    assert ServerSecurity().warnings("localhost") == []
    (warning,) = ServerSecurity().warnings("[::]")
    assert "WITHOUT A TOKEN" in warning and "--token-file" in warning
    (warning,) = ServerSecurity(token=TOKEN).warnings("0.0.0.0")
    assert "without TLS" in warning
    assert ServerSecurity(token=TOKEN, tls_cert="c", tls_key="k").warnings("0.0.0.0") == []


def test_secrets_never_land_in_a_repr_and_run_keys_are_fresh() -> None:
    security = ClientSecurity(token=TOKEN)
    assert security.run_key.hex() not in repr(security) and TOKEN not in repr(security)
    assert TOKEN not in repr(ServerSecurity(token=TOKEN))
    assert len(security.run_key) == 32 and ClientSecurity().run_key != security.run_key


def test_peer_to_peer_gossip_pulls_with_the_token_over_tls_and_a_peer_without_it_is_refused(
    ca: CertificateAuthority, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--peer-to-peer on TLS workers that require the token: they pull their neighbours' messages with it, over
    TLS. A worker whose pulls carry no token is refused by its neighbours (UNAUTHENTICATED) and fails the
    round that needed a pull; the others train on, and from then on the coordinator relays it their messages."""
    cert = ca.issue("worker", server=True)
    settings = ServerSecurity(token=TOKEN, tls_cert=str(cert.cert), tls_key=str(cert.key))
    trust = str(ca.files.cert)
    with served(settings) as a, served(settings) as b, served(settings) as c:
        a.engine.peers = Peers(ClientSecurity(token=TOKEN, tls_ca=trust))
        b.engine.peers = Peers(ClientSecurity(token=TOKEN, tls_ca=trust))
        c.engine.peers = Peers(ClientSecurity(tls_ca=trust))  # no token
        shared = ClientSecurity(token=TOKEN, tls_ca=trust)
        clients = [WorkerClient(w.address, timeout=TIMEOUT, security=shared) for w in (a, b, c)]
        config = TrainConfig(
            model="gpt-tiny",
            steps=4,
            batch_size=2,
            sequence_length=32,
            inner_steps=2,
            topology="complete",
            peer_to_peer=True,
            output_dir=str(tmp_path / "run"),
        )
        with caplog.at_level(logging.INFO, logger="gradwire"):
            run_trainer(config, clients)
    records = read_metrics(tmp_path / "run")
    # c's first round pulls nothing (nobody sent yet); after its failed round every copy comes to it whole, and
    # then a's and b's messages come relayed.
    assert [r["successful_workers"] for r in records] == [3, 2, 3, 3]
    assert records[-1]["relayed_payloads"][clients[2].address] == 2 and records[-1]["uploaded_payloads"] == 2
    assert any("UNAUTHENTICATED" in r.message for r in caplog.records)
