"""A model state streamed a tensor at a time: it is the message protobuf parses, it comes out piece by
piece while the parts are still arriving, and a broken stream is refused."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator

import pytest
import torch

from gradwire import protocol, statestream
from gradwire.protocol import ModelState, ProtocolError
from gradwire.v1 import worker_pb2 as pb
from gradwire.worker.node import RankPick, Restore, merge_rank_states, merge_shard_states, rank_state


def state() -> ModelState:
    g = torch.Generator().manual_seed(0)
    return ModelState(
        "run",
        3,
        '{"kind": "gpt"}',
        {
            "emb": torch.randn(300, 70, generator=g),
            "empty": torch.zeros(0),
            "half": torch.randn(5, generator=g).bfloat16(),
            "scalar": torch.tensor(2.0),
            "count": torch.arange(6, dtype=torch.int64),
        },
        '{"optimizer": "sgd"}',
        optimizer_state={"momentum.0": torch.randn(300, 70, generator=g)},
        feedback={"emb": torch.randn(7, generator=g)},
        inner_optimizer={"emb/exp_avg": torch.randn(3, generator=g)},
    )


def tensors(s: ModelState) -> dict[tuple[str, str], torch.Tensor]:
    return {(kind, n): t for kind in statestream.TENSOR_FIELDS.values() for n, t in getattr(s, kind).items()}


@pytest.mark.parametrize("part_bytes", [64, 1000, protocol.PART_BYTES])
def test_a_streamed_state_is_the_message_protobuf_parses(part_bytes: int) -> None:
    s = state()
    parts = list(statestream.state_parts(s, part_bytes))
    data = protocol.join_parts(parts, 1 << 30)
    assert all(p.total_bytes == len(data) for p in parts)  # worked out from the shapes, before serializing
    assert all(len(p.data) <= part_bytes for p in parts) and [p.last for p in parts].count(True) == 1
    parsed = protocol.state_from_proto(protocol.parse(pb.ModelState, data))
    assert (parsed.run_id, parsed.version, parsed.model_json, parsed.update_rule_json) == (
        s.run_id,
        s.version,
        s.model_json,
        s.update_rule_json,
    )
    expected, got = tensors(s), tensors(parsed)
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) and got[k].dtype == expected[k].dtype for k in expected)


@pytest.mark.parametrize("part_bytes", [64, 4096])
def test_pieces_come_out_header_first_then_a_tensor_at_a_time(part_bytes: int) -> None:
    s = state()
    header, *pieces = statestream.read_state(iter(statestream.state_parts(s, part_bytes)), 1 << 30)
    assert statestream.decode_header(header) == statestream.StateHeader.of(s)
    assert not statestream.decode_header(header).gossip
    decoded = [statestream.decode_tensor(p) for p in pieces]
    expected = tensors(s)
    assert [(kind, name) for kind, name, _ in decoded] == list(expected)
    assert all(torch.equal(t, expected[kind, name]) for kind, name, t in decoded)


def test_each_tensor_comes_out_as_soon_as_its_last_byte_is_in() -> None:
    part_bytes = 1024
    s = ModelState("run", 0, "{}", {f"t{i}": torch.full((1000,), float(i)) for i in range(8)}, "{}")
    read = 0

    def counted() -> Iterator[pb.Part]:
        nonlocal read
        for part in statestream.state_parts(s, part_bytes):
            read += 1
            yield part

    pieces = statestream.read_state(counted(), 1 << 30)
    header = next(pieces)
    ends = [len(header)]
    for piece in pieces:
        ends.append(ends[-1] + len(piece))
        # the part holding the piece's last byte has been read, and not one part more
        assert read == -(-ends[-1] // part_bytes), (read, ends[-1])
    assert len(ends) == 9


def frame(data: bytes) -> list[pb.Part]:
    return [pb.Part(data=data, last=True, total_bytes=len(data), sha256=hashlib.sha256(data).digest())]


def test_broken_streams_are_refused() -> None:
    s = state()
    good = list(statestream.state_parts(s, 4096))
    assert len(good) > 3
    bad_hash = [*good[:-1], pb.Part(data=good[-1].data, last=True, total_bytes=good[-1].total_bytes)]
    cases = [
        (bad_hash, "SHA-256"),
        (good[:-1], "ended before its last part"),
        ([good[0], pb.Part(data=good[1].data, total_bytes=good[1].total_bytes + 1), *good[2:]], "declares"),
        # protobuf's own order (the update rule after the parameters) cannot stream
        (list(protocol.to_parts(protocol.state_to_proto(s))), None),
        (frame(b"\x00"), "field number 0"),
        (frame(b"\x0b"), "wire type 3"),
        (frame(b"\x08" + b"\xff" * 11), "10 bytes"),
        (frame(b"\x2a\x05abc"), "cut short"),  # a parameter field whose length runs past the end
    ]
    for parts, message in cases:
        if message is None:
            header = next(statestream.read_state(iter(parts), 1 << 30))
            with pytest.raises(ProtocolError, match="update_rule_json before its tensors"):
                statestream.decode_header(header)
            continue
        with pytest.raises(ProtocolError, match=message):
            list(statestream.read_state(iter(parts), 1 << 30))
    with pytest.raises(ProtocolError, match="over the"):  # refused on the first part
        next(statestream.read_state(iter(good), 1000, "a test's limit"))


def test_a_header_field_after_a_tensor_is_refused() -> None:
    s = state()
    data = statestream.tensor_piece(pb.ModelState.PARAMETERS_FIELD_NUMBER, "x", torch.ones(2)) + (
        pb.ModelState(run_id="run").SerializeToString()
    )
    with pytest.raises(ProtocolError, match="field 2 follows its tensors"):
        list(statestream.read_state(iter(frame(data)), 1 << 30))
    assert s  # the fixture state is untouched


def test_a_tensor_piece_holds_one_finite_tensor() -> None:
    two = pb.ModelState(
        parameters=[protocol.tensor_to_proto("a", torch.ones(1)), protocol.tensor_to_proto("b", torch.ones(1))]
    )
    with pytest.raises(ProtocolError, match="holds 2 tensors"):
        statestream.decode_tensor(two.SerializeToString())
    nan = statestream.tensor_piece(pb.ModelState.FEEDBACK_FIELD_NUMBER, "a", torch.tensor([float("nan")]))
    with pytest.raises(ProtocolError, match="non-finite"):
        statestream.decode_tensor(nan)
    with pytest.raises(ProtocolError, match="cannot travel"):
        list(statestream.state_parts(ModelState("run", 0, "{}", {"c": torch.ones(1, dtype=torch.complex64)}, "{}")))


def test_a_rank_keeps_of_a_streamed_state_what_it_keeps_of_a_whole_one() -> None:
    per_rank = [{f"p{i}/exp_avg": torch.full((2,), 10.0 * r + i) for i in range(3)} for r in range(3)]
    per_rank[1].pop("p2/exp_avg")  # rank 1 saved no state of p2: a rank without its own takes the lowest's
    merged = merge_rank_states(per_rank)
    for rank in range(4):
        pick = RankPick(rank)
        for name, t in reversed(list(merged.items())):  # in any order
            pick.add(name, t)
        assert pick.kept.keys() == rank_state(merged, rank).keys()
        assert all(torch.equal(pick.kept[k], v) for k, v in rank_state(merged, rank).items())
    shards = merge_shard_states([{"a": torch.ones(1)}, {"a": torch.zeros(1)}], 2, "fsdp")
    restore = Restore(1, 2, "fsdp", split=True)
    for name, t in shards.items():
        restore.add("feedback", name, t)
        restore.add("inner_optimizer", name + "/m", t)
    assert list(restore.feedback) == ["a"] and torch.equal(restore.feedback["a"], torch.zeros(1))
    assert list(restore.inner) == ["a/m"]
    everything = Restore()
    everything.add("inner_optimizer", "rank1.p/m", torch.ones(1))
    assert list(everything.inner) == ["rank1.p/m"]  # off a node nothing is picked


def test_a_small_message_serialized_in_streamed_order_is_what_state_parts_sends() -> None:
    s = state()
    assert statestream.serialize(protocol.state_to_proto(s)) == protocol.join_parts(statestream.state_parts(s), 1 << 30)


def test_a_pushed_payload_of_its_own_travels_in_the_header_and_a_round_without_it_is_refused() -> None:
    """``ModelState.own`` (a resumed run's push while an update is in flight) comes out with the header,
    before any tensor, its payload's bytes as sent; an ``own_round`` with no payload is refused."""
    from gradwire.compression import CodecConfig, GradientCodec, serde

    codec = GradientCodec({"emb": (300, 70)}, CodecConfig())
    payload = codec.compress({"emb": torch.randn(300, 70, generator=torch.Generator().manual_seed(1))})
    s = dataclasses.replace(state(), own=(5, payload))
    pieces = statestream.read_state(iter(statestream.state_parts(s, 1000)), 1 << 30)
    header = statestream.decode_header(next(pieces))
    assert header.own is not None and header.own[0] == 5
    assert serde.gradient_to_bytes(header.own[1]) == serde.gradient_to_bytes(payload)
    assert len(list(pieces)) == len(tensors(s))  # the tensors follow as before
    bare = protocol.state_to_proto(dataclasses.replace(state(), parameters={}, optimizer_state={}))
    assert statestream.decode_header(bare.SerializeToString()).own is None
    bare.own_round = 4
    with pytest.raises(ProtocolError, match="own_round 4 but carries no own_payload"):
        statestream.decode_header(bare.SerializeToString())


def test_a_gossip_runs_push_says_so_in_its_header() -> None:
    """``ModelState.gossip`` comes out with the header, before any tensor: an auto node picks its mode from
    it (``worker.sizing.choose_node_mode``'s whole_model) before the first tensor is kept."""
    s = dataclasses.replace(state(), gossip=True)
    header = statestream.decode_header(next(statestream.read_state(iter(statestream.state_parts(s)), 1 << 30)))
    assert header.gossip and header == statestream.StateHeader.of(s)
    assert protocol.state_from_proto(protocol.state_to_proto(s)).gossip
