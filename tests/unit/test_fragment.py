"""Streamed fragments (``compression.fragment``): the split, the fragment's codec and error feedback, and a
replica update that moves one fragment's tensors alone."""

from __future__ import annotations

import math

import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig, ErrorFeedback
from gradwire.compression.fragment import Fragment, ScopedFeedback, of_round, scoped, split
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.replica import Replica, StateUpdate

SHAPES = {"emb": (64, 16), "a": (16, 16), "b": (16, 16), "c": (16,), "head": (16, 64), "d": (8, 8)}


def test_split_gives_every_tensor_to_one_fragment_in_model_order_and_about_equal_sizes():
    for count in (1, 2, 3):
        parts = split(SHAPES, count)
        assert sorted(n for p in parts for n in p) == sorted(SHAPES)  # each once
        for p in parts:
            assert list(p) == [n for n in SHAPES if n in p]  # model order
        sizes = [sum(math.prod(SHAPES[n]) for n in p) for p in parts]
        assert max(sizes) - min(sizes) <= max(math.prod(s) for s in SHAPES.values())
    assert split(SHAPES, 2) == split(dict(SHAPES), 2)  # pure
    assert split(SHAPES, 2) == (("emb", "a", "d"), ("b", "c", "head"))  # 1024 + 256 + 64 vs 256 + 16 + 1024
    with pytest.raises(ValueError, match="--fragments must be in"):
        split(SHAPES, 7)


def test_a_real_models_fragments_hold_about_equal_shares():
    with torch.device("meta"):
        model = build_from_spec(model_spec("gpt-10m"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    total = sum(math.prod(s) for s in shapes.values())
    for count in (2, 3, 4):
        shares = [sum(math.prod(shapes[n]) for n in p) / total for p in split(shapes, count)]
        assert max(shares) < 1.03 / count, (count, shares)


def test_rounds_take_the_fragments_in_turn():
    assert [of_round(r, 3) for r in range(4)] == [Fragment(0, 3), Fragment(1, 3), Fragment(2, 3), Fragment(0, 3)]
    assert of_round(5, 1) is None
    for index, count in ((3, 3), (-1, 2), (0, 0)):
        with pytest.raises(ValueError):
            Fragment(index, count)


def test_each_fragment_keeps_its_own_error_feedback():
    feedback = ErrorFeedback(beta=0.5)
    a, b = scoped(feedback, Fragment(0, 2)), scoped(feedback, Fragment(1, 2))
    assert isinstance(a, ScopedFeedback) and scoped(feedback, None) is feedback and a.beta == 0.5
    a.accumulate("group0", torch.ones(3))
    b.accumulate("group0", torch.full((2,), 2.0))
    a.accumulate("group0", torch.ones(3))
    assert set(feedback.buffers) == {"fragment0of2/group0", "fragment1of2/group0"}
    assert torch.equal(feedback.buffers["fragment0of2/group0"], torch.full((3,), 1.5))


def _replica(optimizer: str = "nesterov") -> Replica:
    rule = UpdateRule(optimizer=optimizer, momentum=0.9) if optimizer == "nesterov" else UpdateRule(optimizer=optimizer)
    return Replica(build_from_spec(model_spec("gpt-tiny"), seed=0), rule)


@pytest.mark.parametrize("optimizer", ["sgd", "nesterov"])
def test_a_fragment_update_moves_its_tensors_alone_as_the_whole_models_step_would(optimizer):
    """A fragment's replay steps its tensors exactly as the whole model's replay of the same values would,
    momentum included, and leaves every other tensor (and its momentum) alone."""
    config = CodecConfig(chunk=16, topk=8)
    part, whole = _replica(optimizer), _replica(optimizer)
    fragment = Fragment(1, 3)
    names = set(part.fragment_names(fragment))
    assert names and names < set(part.params)
    gen = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in whole.params.items()}
    masked = {n: g if n in names else torch.zeros_like(g) for n, g in grads.items()}
    before = {n: p.detach().clone() for n, p in part.params.items()}
    for _ in range(2):  # twice: the second step reads the momentum the first left
        payload = part.codec(config, fragment).compress({n: grads[n] for n in part.fragment_names(fragment)})
        part.apply(StateUpdate(0.5, (payload,), (1.0,), fragment=fragment))
        whole.apply(StateUpdate(0.5, (whole.codec(config).compress(masked),), (1.0,)))
    for name, p in part.params.items():
        if name in names:
            assert not torch.equal(p, before[name]), name
            torch.testing.assert_close(p, whole.params[name], rtol=0, atol=1e-6, msg=name)
        else:
            assert torch.equal(p, before[name]), name
    if optimizer == "nesterov":
        for name, m in zip(part.params, part.momentum):
            assert (m.abs().sum() > 0) == (name in names), name


def test_fragments_cross_the_wire_and_are_validated():
    replica = _replica("sgd")
    fragment = Fragment(2, 3)
    config = CodecConfig(chunk=16, topk=8)
    payload = replica.codec(config, fragment).compress(
        {n: torch.ones(replica.shapes[n]) for n in replica.fragment_names(fragment)}
    )
    update = StateUpdate(0.5, (payload,), (1.0,), fragment=fragment)
    assert protocol.update_from_proto(protocol.update_to_proto(update)) == update
    whole = StateUpdate(0.5, (payload,), (1.0,))
    assert protocol.update_from_proto(protocol.update_to_proto(whole)).fragment is None
    m = protocol.update_to_proto(update)
    m.replay.fragment = 3
    with pytest.raises(protocol.ProtocolError, match="fragment 3 is not one of 3"):
        protocol.update_from_proto(m)
    m.replay.fragments, m.replay.fragment = 0, 1
    with pytest.raises(protocol.ProtocolError, match="of a whole model"):
        protocol.update_from_proto(m)
    steps = protocol.LocalSteps(2, protocol.InnerOptimizerConfig(), (1e-3, 1e-3), fragment=fragment)
    assert protocol.local_steps_from_proto(protocol.local_steps_to_proto(steps)) == steps
