"""Gradient mode's top-k warm-up (``compression.schedule``): more coefficients in the first steps, paid for by
fewer after, the run's bits within those of its top-k; the setting's defaults and checks; every step's
payload is the codec it names, byte for byte."""

from __future__ import annotations

import pytest
import torch

from gradwire.compression import CodecConfig, GradientCodec
from gradwire.compression.payload import PayloadError
from gradwire.compression.schedule import TopkWarmup, chunk_bits
from gradwire.compression.serde import gradient_from_bytes, gradient_to_bytes
from gradwire.coordinator.config import TOPK_WARMUP_STEPS, TrainConfig

GRADIENT = CodecConfig(topk=36, bins=16, indices="elias-fano")


@pytest.mark.parametrize(
    "config",
    [GRADIENT, CodecConfig(topk=90, bins=4), CodecConfig(topk=20, values="sign", indices="elias-fano")],
)
@pytest.mark.parametrize("k", [1, 36, 216])
def test_chunk_bits_are_what_a_payload_grows_by_per_chunk(config: CodecConfig, k: int) -> None:
    """Between payloads of 64 and 128 full chunks, the bytes grow by 64 chunks' bits (to a byte of rounding
    in each of the two fields that pack bits). Seeded: a payload whose shift comes out 0.0 leaves that proto
    field out, 5 bytes less (about one gradient in 3,000 drawn at random)."""
    config = CodecConfig(**{**config.__dict__, "topk": k})
    grad = torch.randn(64 * 64, 128 * 64, generator=torch.Generator().manual_seed(0))
    sizes = []
    for cols in (64 * 64, 128 * 64):
        codec = GradientCodec({"w": (64, cols)}, config)
        sizes.append(len(gradient_to_bytes(codec.compress({"w": grad[:64, :cols].contiguous()}))))
    assert abs((sizes[1] - sizes[0]) - 64 * chunk_bits(config, k) / 8) <= 2


def test_the_warm_steps_are_paid_for_by_the_rest_of_the_run() -> None:
    for run in (300, 1200, 10_000):
        w = TopkWarmup.plan(GRADIENT, run, 20, 6.0)
        assert (w.steps, w.warm) == (20, 216) and w.rest < 36
        spent = sum(chunk_bits(GRADIENT, w.topk_at(s)) for s in range(run))
        assert spent <= run * chunk_bits(GRADIENT, 36)  # within the top-k's bits every step
        more = w.steps * chunk_bits(GRADIENT, 216) + (run - w.steps) * chunk_bits(GRADIENT, w.rest + 1)
        assert more > run * chunk_bits(GRADIENT, 36)  # and the largest top-k after the warm-up that is
        assert [w.topk_at(s) for s in (0, 19, 20, run - 1)] == [216, 216, w.rest, w.rest]
        assert "top-216 for the first 20" in w.why
    assert TopkWarmup.plan(GRADIENT, 300, 20, 6.0).rest < TopkWarmup.plan(GRADIENT, 1200, 20, 6.0).rest


def test_a_warm_up_is_at_most_a_tenth_of_the_run_and_a_chunk_at_most() -> None:
    assert TopkWarmup.plan(GRADIENT, 50, 20, 6.0).steps == 5
    assert TopkWarmup.plan(GRADIENT, 9, 20, 6.0) == TopkWarmup(0, 36, 36, "the run is too short")
    assert TopkWarmup.plan(GRADIENT, 300, 0, 6.0).why == "no top-k warm-up"
    assert TopkWarmup.plan(GRADIENT, 300, 20, 1.0).steps == 0
    assert TopkWarmup.plan(CodecConfig(topk=2048, bins=16), 300, 20, 6.0).warm == 4096
    cold = TopkWarmup.plan(GRADIENT, 300, 0, 6.0)
    assert cold.config_at(GRADIENT, 0) is GRADIENT
    assert TopkWarmup.plan(GRADIENT, 300, 20, 6.0).config_at(GRADIENT, 3) == CodecConfig(
        topk=216, bins=16, indices="elias-fano"
    )


def test_gradient_mode_warms_up_by_default_and_no_other_mode_does() -> None:
    assert TrainConfig().topk_warmup_steps == TOPK_WARMUP_STEPS
    assert TrainConfig(steps=300).topk_warmup().warm == 6 * TrainConfig().topk
    assert TrainConfig(steps=300, topk_warmup_steps=0).topk_warmup().steps == 0
    for other in ({"inner_steps": 30}, {"no_compression": True}, {"topology": "ring"}, {"rank": 4}):
        assert TrainConfig(**other).topk_warmup_steps == 0, other
        with pytest.raises(ValueError, match="--topk-warmup-steps warms up gradient mode"):
            TrainConfig(**other, topk_warmup_steps=5)
    with pytest.raises(ValueError, match="--topk-warmup-factor must be >= 1"):
        TrainConfig(topk_warmup_factor=0.5)
    with pytest.raises(ValueError, match="--topk-warmup-steps must be >= 0"):
        TrainConfig(topk_warmup_steps=-1)


def test_a_warm_step_s_payload_round_trips_and_another_step_s_codec_rejects_it() -> None:
    """A payload of the warm top-k crosses the wire byte for byte; the codec of a step after the warm-up (the
    coordinator's, that round) rejects it before decoding anything."""
    warmup = TopkWarmup.plan(GRADIENT, 300, 20, 6.0)
    warm = GradientCodec({"w": (128, 256), "b": (256,)}, warmup.config_at(GRADIENT, 0))
    rest = GradientCodec({"w": (128, 256), "b": (256,)}, warmup.config_at(GRADIENT, 20))
    payload = warm.compress({"w": torch.randn(128, 256), "b": torch.randn(256)})
    wire = gradient_to_bytes(payload)
    assert gradient_to_bytes(gradient_from_bytes(wire)) == wire
    assert len(wire) > 3 * len(gradient_to_bytes(rest.compress({"w": torch.randn(128, 256), "b": torch.randn(256)})))
    assert torch.equal(warm.decompress(gradient_from_bytes(wire))["w"], warm.decompress(payload)["w"])
    with pytest.raises(PayloadError, match="settings"):
        rest.decode(gradient_from_bytes(wire))
