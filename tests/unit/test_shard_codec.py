"""A payload encoded by several ranks, each over the tensors it owns, is the payload one device encodes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradwire.compression import CodecConfig, Encoding, ErrorFeedback, GradientCodec, ModelPlan, serde
from gradwire.compression.shard import assemble, owners, subset
from gradwire.models import build_from_spec, model_spec

from .codec_helpers import ASSEMBLY_CONFIGS

SHAPES = {n: tuple(p.shape) for n, p in build_from_spec(model_spec("gpt-tiny"), seed=0).named_parameters()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("config", ASSEMBLY_CONFIGS.values(), ids=ASSEMBLY_CONFIGS.keys())
def test_ranks_encoding_their_own_tensors_send_the_single_device_payload(world: int, config: CodecConfig) -> None:
    whole = GradientCodec(SHAPES, config)
    split = owners(whole.plan, world)
    codecs = [GradientCodec(subset(SHAPES, names), config) for names in split]
    feedback, rank_feedback = ErrorFeedback(beta=0.9), [ErrorFeedback(beta=0.9) for _ in split]
    gen = torch.Generator().manual_seed(world)
    for _ in range(3):  # with error feedback carried over rounds
        grads = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
        expected = whole.compress(grads, feedback)
        parts = [c.compress({n: grads[n] for n in names}, f) for c, names, f in zip(codecs, split, rank_feedback)]
        got = assemble(whole.plan, parts)
        assert got == expected
        assert serde.gradient_to_bytes(got) == serde.gradient_to_bytes(expected)


def test_owners_split_every_tensor_once_in_payload_order_and_balance_the_elements() -> None:
    plan = ModelPlan.build(SHAPES, CodecConfig())
    assert any(t.encoding == Encoding.DENSE for t in plan.tensors)  # small tensors are owned too
    order = [t.name for t in plan.tensors]
    for world in (1, 2, 3, 5):
        split = owners(plan, world)
        assert owners(plan, world) == split and len(split) == world
        assert sorted(n for names in split for n in names) == sorted(order)
        for names in split:
            assert list(names) == [n for n in order if n in names]
        loads = [sum(t.numel for t in plan.tensors if t.name in names) for names in split]
        assert max(loads) - min(loads) <= max(t.numel for t in plan.tensors)
    assert owners(plan, 1) == (tuple(order),)
    with pytest.raises(ValueError, match="at least one rank"):
        owners(plan, 0)


def test_assemble_refuses_parts_that_do_not_make_one_payload() -> None:
    config = CodecConfig()
    whole = GradientCodec(SHAPES, config)
    split = owners(whole.plan, 2)
    grads = {n: torch.ones(s) for n, s in SHAPES.items()}
    parts = [GradientCodec(subset(SHAPES, names), config).compress({n: grads[n] for n in names}) for names in split]
    assert assemble(whole.plan, parts) == whole.compress(grads)
    with pytest.raises(ValueError, match="two ranks"):
        assemble(whole.plan, [parts[0], parts[0], parts[1]])
    with pytest.raises(ValueError, match="miss"):
        assemble(whole.plan, parts[:1])
    other = dataclasses.replace(parts[1], settings=CodecConfig(bins=4))
    with pytest.raises(ValueError, match="other codec settings"):
        assemble(whole.plan, [parts[0], other])
    with pytest.raises(ValueError, match="no rank"):
        assemble(whole.plan, [])
