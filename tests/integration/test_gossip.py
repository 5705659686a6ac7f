"""Gossip rounds through the service (``--topology``): real workers, the coordinator as relay.

Exactness first: uncompressed gossip on the complete graph with gamma 1 is model averaging, so with plain
SGD inside it is today's centralized local-SGD round (outer SGD at lr 1) to float noise. Then a ring: a
worker's downlink is its two neighbours' messages, every holder's public copies stay the coordinator's bit
for bit, compressed gossip trains and agrees, and workers that leave and join are re-linked.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from gradwire.compression import serde as codec_serde
from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.gossip_trainer import GossipTrainer
from gradwire.coordinator.membership import WorkersFile
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.link import WorkerError
from gradwire.protocol import GossipPieceRequest
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import InProcessClient, InProcessPeers

from ..faults import faulty
from .conftest import live_workers, run_trainer, train

pytestmark = pytest.mark.slow  # these tests train for seconds each

EXACT = dict(no_compression=True, inner_optimizer="sgd", inner_learning_rate=0.1)


def _config(tmp_path, name: str, **overrides) -> TrainConfig:
    base = dict(
        model="gpt-tiny",
        steps=4,
        batch_size=2,
        sequence_length=32,
        inner_steps=3,
        eval_batches=2,
        output_dir=str(tmp_path / name),
        round_timeout=60.0,
    )
    return TrainConfig(**{**base, **overrides})


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def _holders_agree(trainer: GossipTrainer, workers) -> None:
    """Every worker's public copies (its own and its neighbours') are the coordinator's, bit for bit, once each
    holder adds the last round's accepted messages, as the next order would have it do."""
    copies, accepted, codec = trainer.gossip.copies, trainer.gossip.accepted, trainer.outer.codec

    def caught_up(m: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if m not in accepted:
            return tensors
        q = codec.decompress(accepted[m])
        return {k: v + q[k] for k, v in tensors.items()}

    for w in workers:
        (session,) = w.engine.sessions.values()
        node = session.gossip.node
        for m, tensors in [(node.member, node.own), *node.copies.items()]:
            for k, v in caught_up(m, tensors).items():
                assert torch.equal(v, copies.copy_of(m)[k]), (node.member, m, k)


def test_exact_gossip_on_the_complete_graph_is_centralized_local_sgd(tmp_path):
    with live_workers(3) as workers:
        gossip = train(_config(tmp_path, "complete", topology="complete", gossip_gamma=1.0, **EXACT), workers)
    with live_workers(3) as workers:
        central = train(_config(tmp_path, "star", outer_optimizer="sgd", learning_rate=1.0, **EXACT), workers)
    assert isinstance(gossip, GossipTrainer)
    # Its pushes say it gossips: a --node-mode auto node then keeps the whole model on every rank.
    assert gossip.rounds.state_for(gossip.roster.slots[0]).gossip
    assert not central.rounds.state_for(central.roster.slots[0]).gossip
    consensus = gossip.gossip.consensus()
    _assert_close(consensus, {k: v.detach() for k, v in central.replica.params.items()}, atol=1e-5)
    assert gossip.evaluate() == pytest.approx(central.evaluate(), abs=1e-4)  # the run shows the consensus
    ours, theirs = read_metrics(tmp_path / "complete"), read_metrics(tmp_path / "star")
    assert [r["loss"] for r in ours] == [pytest.approx(r["loss"], abs=1e-4) for r in theirs]
    # Exact gossip: after every round the public copies are the models; with gamma 1 they agree after the mix.
    assert all(r["gossip_residual"] < 1e-8 for r in ours)


def test_a_ring_relays_each_worker_its_two_neighbours_messages_and_keeps_copies_in_step(tmp_path):
    config = _config(tmp_path, "ring", topology="ring", steps=14, inner_optimizer="demuon", inner_learning_rate=0.02)
    assert (config.topk, config.bins, config.gossip_gamma, config.index_coding) == (2048, 16, 0.7, "elias-fano")
    with live_workers(4) as workers:
        trainer = train(config, workers)
        _holders_agree(trainer, workers)
    records = read_metrics(tmp_path / "ring")
    assert all(r["degree_max"] == 2 for r in records)
    payload = trainer.outer.codec.plan.payload_bytes()  # a message's bytes; on the wire, with its framing:
    wire = max(codec_serde.gradient_to_proto(q).ByteSize() for q in trainer.gossip.accepted.values())
    assert payload < wire < 1.1 * payload
    first, later = records[0], records[1:]  # the first round's orders relay nothing: no message was sent yet
    for r in later:
        assert set(r["relayed_payloads"].values()) == {2}
        for address, down in r["worker_bytes_down"].items():
            extra = down - first["worker_bytes_down"][address]  # the same order but for the relays
            assert 2 * payload < extra <= 2 * wire + 64, (address, extra, payload)
    # Compressed gossip trains, and the workers' disagreement levels off (it was 7.9 at round 8, 7.5 at 14).
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    distances = [r["consensus_distance"] for r in records]
    assert max(distances[10:]) <= 1.1 * distances[7], distances


@pytest.mark.parametrize("peer_to_peer", [False, True], ids=["relayed", "peer-to-peer"])
def test_a_resumed_gossip_run_is_the_straight_run(tmp_path, peer_to_peer):
    """A checkpoint keeps every public copy and each worker's own model and DeMuon momentum; resumed on fresh
    workers (each sent its copies whole and its own model with its push) the compressed ring goes on on the
    straight run's bits: the same losses, public copies and consensus. Peer-to-peer, the copies the
    checkpoint keeps are pulled from the workers as it is taken."""
    settings = dict(
        topology="ring",
        steps=6,
        checkpoint_every=3,
        inner_optimizer="demuon",
        inner_learning_rate=0.02,
        peer_to_peer=peer_to_peer,
    )
    with live_workers(4) as workers:
        straight = train(_config(tmp_path, "a", **settings), workers)
    checkpoint = tmp_path / "a" / "checkpoints" / "step-00000003"
    assert checkpoint.is_dir()
    with live_workers(4) as workers:
        resumed = train(_config(tmp_path, "b", resume_from=str(checkpoint), **settings), workers)
        if peer_to_peer:
            _copies_agree_with_owners(workers)
        else:
            _holders_agree(resumed, workers)
    records = read_metrics(tmp_path / "b")
    assert [r["step"] for r in records] == [4, 5, 6]
    assert records[0]["relayed_payloads"] == dict.fromkeys(records[0]["relayed_payloads"], 0)  # all sent whole
    assert [r["loss"] for r in records] == [r["loss"] for r in read_metrics(tmp_path / "a")][3:]
    assert [r["consensus_distance"] for r in records] == [
        r["consensus_distance"] for r in read_metrics(tmp_path / "a")
    ][3:]
    for m in straight.gossip.copies.members:
        for k, v in straight.gossip.copies.copy_of(m).items():
            assert torch.equal(resumed.gossip.copies.copy_of(m)[k], v), (m, k)


def test_a_worker_leaving_a_ring_relinks_its_neighbours_and_a_joiner_starts_from_the_consensus(tmp_path):
    """A ring of four through a workers file: one leaves (its neighbours are linked to each other, each sent
    the other's copy whole, and the rounds go on), then a new one joins and starts from the consensus of the
    copies as they were when it joined. Nothing waits past its round."""
    listing = tmp_path / "workers.txt"
    with live_workers(5) as workers:
        a, b, c, d, e = (w.address for w in workers)
        listing.write_text(f"{a}\n{b}\n{c}\n{d}\n")
        members = WorkersFile(listing)
        members.poll()

        def connect(address: str) -> WorkerClient:
            return WorkerClient(address, timeout=30)

        config = _config(tmp_path, "ring", topology="ring", steps=8, **EXACT)
        trainer = Trainer(config, [connect(x) for x in (a, b, c, d)], progress=False, members=members, connect=connect)
        assert isinstance(trainer, GossipTrainer)
        sent: list[dict] = []
        before: list[dict] = []  # the consensus as each round's links were planned
        fresh: list[dict] = []  # the whole copies each round's links carried, by worker
        plan = trainer.gossip.links

        def spy(present, *rest):
            before.append({k: v.clone() for k, v in trainer.gossip.consensus().items()})
            links = plan(present, *rest)
            sent.append(links)
            fresh.append(  # as sent: the coordinator's copies move on in place
                {
                    m: {j: {k: v.clone() for k, v in c.items()} for j, c in ls.fresh.items() if c}
                    for m, ls in links.items()
                }
            )
            return links

        trainer.gossip.links = spy  # type: ignore[method-assign]
        try:
            trainer.connect()
            records = [trainer.train_step() for _ in range(3)]
            listing.write_text(f"{a}\n{c}\n{d}\n")  # b leaves: a and c become neighbours
            records += [trainer.train_step() for _ in range(2)]
            listing.write_text(f"{a}\n{c}\n{d}\n{e}\n")  # e joins, last on the ring: between d and a
            records.append(trainer.train_step())  # e gets the state in the background meanwhile
            deadline = time.monotonic() + 30
            while trainer.rounds.joining and time.monotonic() < deadline:
                time.sleep(0.01)
            records += [trainer.train_step() for _ in range(2)]
        finally:
            trainer.close()
    assert all(r is not None for r in records)
    member = {s.client.address: str(s.index) for s in trainer.slots}
    ma, mc, md, me = (member[x] for x in (a, c, d, e))
    mb = "1"  # slots number workers in join order: b was the second
    left = sent[3]  # the first round without b
    assert set(left) == {ma, mc, md} and mb not in trainer.gossip.copies
    assert set(left[ma].fresh) == {mc} and mb in left[ma].drop and set(left[ma].relays) == {md}
    assert set(left[mc].fresh) == {ma} and mb in left[mc].drop
    first = next(i for i, links in enumerate(sent) if me in links)  # e's first round: every copy whole
    joined, consensus = sent[first], before[first]  # its own copy: the consensus as it joined
    assert first == 6 and set(joined[me].fresh) == {me, md, ma}
    for k, v in consensus.items():
        torch.testing.assert_close(fresh[first][me][me][k], v, atol=0, rtol=0)
    assert [r["successful_workers"] for r in records] == [4, 4, 4, 3, 3, 3, 4, 4]  # none lost, none waited for
    assert all(r["degree_max"] == 2 for r in records)


def _copies_agree_with_owners(workers) -> None:
    """Peer-to-peer: every holder's copy of a neighbour is the neighbour's own, bit for bit, once each adds the
    messages the next order would have it add (the owner its pending one, the holder the one it would pull)."""
    nodes = {}
    for w in workers:
        (session,) = w.engine.sessions.values()
        state = session.gossip
        own = {k: v + state.pending[k] for k, v in state.node.own.items()} if state.pending else state.node.own
        nodes[state.node.member] = (state, own)
    for state, _ in nodes.values():
        for j, copy in state.node.copies.items():
            owner_state, owner_own = nodes[j]
            q = owner_state.pending
            for k, v in copy.items():
                assert torch.equal(v + q[k] if q else v, owner_own[k]), (state.node.member, j, k)


def test_peer_to_peer_gossip_is_the_relayed_run_and_the_coordinator_sees_no_message(tmp_path):
    """--peer-to-peer: the workers pull their neighbours' messages from each other and the coordinator sees
    their digests. The run is the relayed run bit for bit (losses, public copies, consensus); the coordinator
    sends no message, each worker pulls two a round on the ring, and the consensus distance the sketches give
    is close to the exact one."""
    settings = dict(topology="ring", steps=6, inner_optimizer="demuon", inner_learning_rate=0.02)
    with live_workers(4) as workers:
        relayed = train(_config(tmp_path, "relayed", **settings), workers)
    with live_workers(4) as workers:
        p2p = train(_config(tmp_path, "p2p", peer_to_peer=True, **settings), workers)
        _copies_agree_with_owners(workers)
    ours, theirs = read_metrics(tmp_path / "p2p"), read_metrics(tmp_path / "relayed")
    assert [r["loss"] for r in ours] == [r["loss"] for r in theirs]
    p2p_consensus, relayed_consensus = p2p.gossip.consensus(), relayed.gossip.consensus()  # p2p's pulled at the end
    for k, v in relayed_consensus.items():
        assert torch.equal(p2p_consensus[k], v), k
    assert p2p.evaluate() == relayed.evaluate()
    payload = relayed.outer.codec.plan.payload_bytes()
    for mine, theirs_ in zip(ours[1:], theirs[1:]):
        assert set(mine["relayed_payloads"].values()) == {0} and set(mine["pulled_payloads"].values()) == {2}
        assert all(2 * payload < b < 2.2 * payload for b in mine["peer_bytes_down"].values())
        for address, down in mine["worker_bytes_down"].items():  # the order alone: no message in it
            assert down < min(theirs_["worker_bytes_down"].values()) - 2 * payload, address
        assert mine["consensus_distance_estimated"] is True
        assert mine["consensus_distance"] == pytest.approx(theirs_["consensus_distance"], rel=0.25)


def test_a_peer_that_serves_another_message_than_it_reported_fails_only_its_neighbours_round(tmp_path):
    """Peer-to-peer: worker 1 serves its round-2 message with a byte flipped. Its neighbours find the digest
    wrong, fail round 3 naming it (an unreachable answer), and get their copies whole in round 4; from then on
    worker 1 uploads its messages, the coordinator checks them against the digests it reported and relays
    them to those two. The run goes on, and every holder's copies stay its owners'."""
    liar = faulty("other-message", rounds={2})
    factories = [lambda: WorkerEngine("cpu"), liar, lambda: WorkerEngine("cpu"), lambda: WorkerEngine("cpu")]
    with live_workers(4, factories) as workers:
        config = _config(tmp_path, "liar", topology="ring", steps=6, peer_to_peer=True)
        train(config, workers)
        _copies_agree_with_owners(workers)
        assert workers[1].engine.injected == [2, 2]  # each of its two neighbours pulled it once
        # What a pull is refused for, over gRPC: another key, no key, a round it no longer keeps. It serves on.
        client = workers[0].client()
        (run_id,) = workers[0].engine.sessions
        key = workers[0].engine.sessions[run_id].gossip.peer_key
        for request, code in [
            (GossipPieceRequest(run_id, b"x" * 32, 5), grpc.StatusCode.PERMISSION_DENIED),
            (GossipPieceRequest(run_id, key, 1), grpc.StatusCode.FAILED_PRECONDITION),
        ]:
            with pytest.raises(WorkerError) as e:
                client.pull_gossip(request)
            assert e.value.code == code, e.value
        with pytest.raises(WorkerError) as e:
            client.pull_gossip(GossipPieceRequest(run_id, b"", 5))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "peer key" in e.value.details
        piece, _ = client.pull_gossip(GossipPieceRequest(run_id, key, 5))
        assert piece.member == "0" and piece.round == 5
    records = read_metrics(tmp_path / "liar")
    assert [r["successful_workers"] for r in records] == [4, 4, 4, 2, 4, 4]
    addresses = [w.address for w in workers]
    relayed = [[r["relayed_payloads"][a] for a in addresses] for r in records]
    assert relayed[5] == [1, 0, 1, 0]  # worker 1's round-4 message, relayed to 0 and 2
    assert [r["uploaded_payloads"] for r in records] == [0, 0, 0, 0, 1, 1]
    assert [r["pulled_payloads"][addresses[0]] for r in records] == [0, 2, 2, 2, 0, 1]


def test_a_peer_whose_messages_do_not_decode_is_caught_by_the_coordinator_once_its_neighbours_name_it(tmp_path):
    """Peer-to-peer, in process: from round 2 on worker 1's messages carry a NaN scale under honest digests.
    Its neighbours cannot add the one they pull in round 3 and name it; from then on it must upload, and the
    coordinator refuses each of its messages: nobody adds them, the others train on, every copy in step."""
    engines = [WorkerEngine("cpu"), faulty("bad-message", rounds=range(2, 100))()]
    engines += [WorkerEngine("cpu"), WorkerEngine("cpu")]
    clients = [InProcessClient(e, f"in-process-{i}") for i, e in enumerate(engines)]
    peers = InProcessPeers({c.address: c.engine for c in clients})
    for e in engines:
        e.peers = peers
    run_trainer(_config(tmp_path, "bad", topology="ring", steps=6, peer_to_peer=True), clients)
    records = read_metrics(tmp_path / "bad")
    assert [r["successful_workers"] for r in records] == [4, 4, 4, 2, 3, 3]
    assert engines[1].injected == [2, 3, 4, 5]
    assert [r["uploaded_payloads"] for r in records] == [0] * 6  # worker 1 uploads, and is refused
    assert [r["relayed_payloads"]["in-process-0"] for r in records] == [0] * 6
    _copies_agree_with_owners(clients)
