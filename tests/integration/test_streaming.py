"""Gradient mode with the gradient streamed as the backward produces it (``--stream-buckets``), through the
service: the same run, bit for bit, as the gradient sent whole; a worker that dies mid-stream spoils only
its own contribution."""

from __future__ import annotations

import collections
import dataclasses

import grpc
import numpy as np
import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig, GradientCodec
from gradwire.compression.stream import StreamPlan
from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.round import SlotOutcome, _Receiver
from gradwire.coordinator.trainer import Trainer
from gradwire.link import OnPiece, WorkerError
from gradwire.protocol import OK, ProtocolError, RoundResult, WorkOrder
from gradwire.replica import Fingerprint
from gradwire.v1 import worker_pb2 as pb
from gradwire.v1 import worker_pb2_grpc
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.server import make_server

from ..faults import faulty
from .conftest import assert_in_step, live_workers, run_trainer, steps_with_fault


class PieceCounter(WorkerClient):
    """A client that counts the pieces each round brought in (``pieces[round]``), failed calls' too."""

    def __init__(self, address: str) -> None:
        super().__init__(address, timeout=60.0)
        self.pieces: collections.Counter[int] = collections.Counter()

    def run_round(self, order, timeout=None, on_piece: OnPiece | None = None):  # noqa: ANN001, ANN201 - the link's
        def counted(piece):  # noqa: ANN001, ANN202
            self.pieces[order.round] += 1
            on_piece(piece)

        return super().run_round(order, timeout, counted if on_piece is not None else None)


def _config(tmp_path, name: str, **overrides) -> TrainConfig:
    base = dict(
        model="gpt-tiny",
        steps=4,
        batch_size=4,
        sequence_length=32,
        output_dir=str(tmp_path / name),
        round_timeout=60.0,
        stream_buckets=8,  # gpt-tiny: three buckets (its embedding is most of the model)
        balance="off",  # runs compared bit for bit: shares sized to each run's own timings would differ
    )
    return TrainConfig(**{**base, **overrides})


def _run(config: TrainConfig, factories=None):  # noqa: ANN001, ANN202
    """Train ``config`` on two workers; the trainer, its clients, and each worker's session at the end."""
    with live_workers(2, factories) if factories else live_workers(2) as workers:
        clients = [PieceCounter(w.address) for w in workers]
        trainer = run_trainer(config, clients)
        return trainer, clients, [next(iter(w.engine.sessions.values())) for w in workers]


@pytest.mark.parametrize(
    "flags",
    [{}, {"micro_batch_size": 2}, {"clip_grad_norm": 0.5}, {"overlap": True}],
    ids=["whole-batch", "micro-batches", "clipped", "computed-ahead"],
)
def test_a_streamed_run_is_the_run_sent_whole_bit_for_bit(tmp_path, flags) -> None:
    streamed, clients, sessions = _run(_config(tmp_path, "streamed", **flags))
    whole, whole_clients, whole_sessions = _run(_config(tmp_path, "whole", stream_buckets=0, **flags))
    assert all(c.pieces == {r: 3 for r in range(4)} for c in clients)  # every round came in three pieces
    assert all(not c.pieces for c in whole_clients)
    for (name, a), b in zip(streamed.model.named_parameters(), whole.model.parameters()):
        assert torch.equal(a, b), name
    for ours, theirs in zip(sessions, whole_sessions):  # each worker's last payload, byte for byte
        assert ours.last_sent == theirs.last_sent
    assert [r["loss"] for r in read_metrics(streamed.output_dir)] == [r["loss"] for r in read_metrics(whole.output_dir)]


def test_a_worker_dying_mid_stream_spoils_only_its_own_contribution(tmp_path) -> None:
    """Round 2: worker 1 sends its first piece and dies. The round is worker 0's alone, exactly as if worker 1
    had dropped the call before it began; then worker 1 is back in the rounds, in step."""
    died, clients, _ = _run(_config(tmp_path, "died", steps=3), [WorkerEngine, faulty("die-mid-stream", rounds={2})])
    dropped, _, _ = _run(_config(tmp_path, "dropped", steps=3), [WorkerEngine, faulty("drop", rounds={2})])
    assert clients[1].pieces[2] >= 1  # it died mid-stream, not before
    assert [r["successful_workers"] for r in read_metrics(died.output_dir)] == [2, 2, 1]
    for (name, a), b in zip(died.model.named_parameters(), dropped.model.parameters()):
        assert torch.equal(a, b), name
    with live_workers(2, [WorkerEngine, faulty("die-mid-stream", rounds={1})]) as workers:
        trainer = Trainer(_config(tmp_path, "after"), [PieceCounter(w.address) for w in workers], progress=False)
        records = steps_with_fault(trainer, lambda: None, before=2, after=2)
        assert workers[1].engine.injected == [1]
        assert [r["successful_workers"] for r in records] == [2, 1, 2, 2]
        assert_in_step(trainer, workers[1])


class Streamer(worker_pb2_grpc.WorkerServicer):
    """A worker that answers every round with ``pieces`` pieces of a real payload (each one bucket's)
    and then an OK result, whatever the order asked."""

    def __init__(self, pieces: int, bad_piece: bool = False) -> None:
        codec = GradientCodec({"a.weight": (64, 64), "b.weight": (64, 64)}, CodecConfig())
        self.stream = StreamPlan(codec, 2)
        grads = {n: torch.randn(64, 64) for n in ("a.weight", "b.weight")}
        self.pieces = [self.stream.compress(b % 2, grads) for b in range(pieces)]
        self.bad_piece = bad_piece

    def RunRound(self, request_iterator, context):  # noqa: ANN001, ANN201 - grpc's signature
        order = protocol.order_from_proto(protocol.parse(pb.WorkOrder, protocol.join_parts(request_iterator, 1 << 20)))
        for piece in self.pieces:
            message = protocol.piece_to_proto(order.round, piece)
            if self.bad_piece:
                message.tokens = 7  # a piece carries a round and a gradient, nothing else
            yield from protocol.to_parts(message)
        empty = dataclasses.replace(self.pieces[0], tensors=())
        yield from protocol.to_parts(protocol.result_to_proto(RoundResult(OK, order.round, "", empty, 1.0, 8)))


@pytest.mark.parametrize(
    ("pieces", "asked", "bad_piece", "why"),
    [
        (3, 2, False, "more than the 2 pieces the order asked"),
        (1, 0, False, "more than the 0 pieces"),
        (1, 2, True, "its round and a gradient, nothing else"),
    ],
    ids=["too-many", "not-asked", "piece-with-more"],
)
def test_pieces_a_round_did_not_ask_for_end_the_call_as_data_loss(pieces, asked, bad_piece, why) -> None:
    server, port, _ = make_server(Streamer(pieces, bad_piece), host="127.0.0.1", port=0)
    taken = []
    try:
        order = WorkOrder(
            "run", 0, 0, np.zeros((1, 9), np.uint16), CodecConfig(), Fingerprint((), (), ()), stream_buckets=asked
        )
        with pytest.raises(WorkerError, match=why) as caught:
            WorkerClient(f"127.0.0.1:{port}", timeout=10.0).run_round(order, on_piece=taken.append)
        assert caught.value.code == grpc.StatusCode.DATA_LOSS
        assert len(taken) <= asked
    finally:
        server.stop(grace=None)


def test_a_bad_piece_is_the_senders_strike_not_a_failed_call() -> None:
    """What a piece holds is judged by the gather stage ("sent a bad payload", a strike), as a whole payload's."""
    codec = GradientCodec({"a.weight": (64, 64), "b.weight": (64, 64)}, CodecConfig())
    stream = StreamPlan(codec, 2)
    grads = {n: torch.randn(64, 64) for n in ("a.weight", "b.weight")}
    pieces = [stream.compress(b, grads) for b in range(2)]
    empty = dataclasses.replace(pieces[0], tensors=())
    result = RoundResult(OK, 0, "", empty, 1.0, 8)

    outcome = SlotOutcome(None, None)  # type: ignore[arg-type]
    receiver = _Receiver(stream, outcome)
    for piece in pieces:
        receiver.take(piece)
    whole = receiver.finish(result)
    assert whole.gradient == codec.compress(grads) and outcome.decoded is not None and not outcome.invalid
    assert outcome.pieces == 2

    receiver = _Receiver(stream, outcome)
    receiver.take(dataclasses.replace(pieces[0], tensors=pieces[0].tensors + pieces[1].tensors))
    receiver.take(pieces[1])
    assert receiver.finish(result).gradient is empty
    assert outcome.decoded is None and outcome.invalid.startswith("sent a bad payload")
    with pytest.raises(ProtocolError, match="asked for none"):
        _Receiver(None, outcome).take(pieces[0])
