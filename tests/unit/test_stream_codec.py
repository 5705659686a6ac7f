"""A payload streamed bucket by bucket is, byte for byte, the payload one codec sends, and decodes alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradwire.compression import CodecConfig, ErrorFeedback, GradientCodec, PayloadError, serde
from gradwire.compression.stream import MAX_BUCKETS, Pieces, StreamPlan, buckets
from gradwire.models import build_from_spec, model_spec

from .codec_helpers import ASSEMBLY_CONFIGS

SHAPES = {n: tuple(p.shape) for n, p in build_from_spec(model_spec("gpt-tiny"), seed=0).named_parameters()}


def test_buckets_take_every_tensor_once_last_layers_first_and_about_evenly() -> None:
    plan = GradientCodec(SHAPES, CodecConfig()).plan
    order = [t.name for t in plan.tensors]
    numel = {t.name: t.numel for t in plan.tensors}
    assert buckets(plan, 1) == (tuple(order),)
    for count in (2, 3, 4, 8, MAX_BUCKETS):
        split = buckets(plan, count)
        assert buckets(plan, count) == split and 1 <= len(split) <= count
        # Read backwards, the buckets are the plan's tensors from the last to the first: a backward's order.
        assert [n for bucket in reversed(split) for n in bucket] == order
        assert split[0][-1] == order[-1]
        sizes = [sum(numel[n] for n in bucket) for bucket in split]
        assert max(sizes) <= max(sum(sizes) / count, max(numel.values())) + max(numel.values())
    for bad in (0, MAX_BUCKETS + 1):
        with pytest.raises(ValueError, match="buckets"):
            buckets(plan, bad)


@pytest.mark.parametrize("count", [2, 8])
@pytest.mark.parametrize("config", ASSEMBLY_CONFIGS.values(), ids=ASSEMBLY_CONFIGS.keys())
def test_streamed_pieces_assemble_to_the_single_codec_payload_and_its_decoding(count: int, config: CodecConfig) -> None:
    whole = GradientCodec(SHAPES, config)
    stream = StreamPlan(whole, count)
    feedback, streamed_feedback = ErrorFeedback(beta=0.9), ErrorFeedback(beta=0.9)
    gen = torch.Generator().manual_seed(count)
    for _ in range(3):  # with error feedback carried over rounds
        grads = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
        expected = whole.compress(grads, feedback)
        pieces = Pieces(stream)
        for b in reversed(range(len(stream.buckets))):  # any arrival order
            pieces.take(stream.compress(b, grads, streamed_feedback))
        got, decoded = pieces.finish(dataclasses.replace(expected, tensors=()))
        assert serde.gradient_to_bytes(got) == serde.gradient_to_bytes(expected)
        want = whole.decode(expected)
        got_tensors = (*decoded.indices, *decoded.values, *decoded.dense)
        assert all(torch.equal(a, b) for a, b in zip(got_tensors, (*want.indices, *want.values, *want.dense)))
        assert decoded.increasing == want.increasing == (config.indices == "elias-fano")  # checked piece by piece


def test_a_payload_sent_whole_is_decoded_whole() -> None:
    whole = GradientCodec(SHAPES, CodecConfig())
    payload = whole.compress({n: torch.randn(s) for n, s in SHAPES.items()})
    got, decoded = Pieces(StreamPlan(whole, 3)).finish(payload)
    assert got is payload
    assert StreamPlan(whole, 1).codecs == (whole,)  # nothing streams: no second codec of the whole model
    assert all(torch.equal(a, b) for a, b in zip(decoded.values, whole.decode(payload).values))


def test_pieces_that_do_not_make_one_payload_are_refused() -> None:
    whole = GradientCodec(SHAPES, CodecConfig())
    stream = StreamPlan(whole, 8)  # gpt-tiny's embedding is most of it: three buckets
    assert len(stream.buckets) == 3
    grads = {n: torch.randn(s) for n, s in SHAPES.items()}
    parts = [stream.compress(b, grads) for b in range(len(stream.buckets))]
    empty = dataclasses.replace(parts[0], tensors=())
    mixed = dataclasses.replace(parts[0], tensors=parts[0].tensors + parts[1].tensors)
    with pytest.raises(PayloadError, match="exactly one of the 3 buckets"):
        Pieces(stream).take(mixed)
    twice = Pieces(stream)
    twice.take(parts[1])
    with pytest.raises(PayloadError, match="came twice"):
        twice.take(parts[1])
    short = Pieces(stream)
    short.take(parts[0])
    with pytest.raises(PayloadError, match=r"buckets \[1, 2\] never came"):
        short.finish(empty)
    repeated = Pieces(stream)
    for p in parts:
        repeated.take(p)
    with pytest.raises(PayloadError, match="repeats tensors"):
        repeated.finish(parts[2])
    bad = dataclasses.replace(parts[0], tensors=(dataclasses.replace(parts[0].tensors[0], k=1), *parts[0].tensors[1:]))
    with pytest.raises(PayloadError, match="'k'"):
        Pieces(stream).take(bad)
