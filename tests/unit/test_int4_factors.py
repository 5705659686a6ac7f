"""Factors in int4 codes (``CodecConfig.factor_bits`` 4, ``--factor-bits 4``): two codes a byte, each in
[-7, 7]. A payload round-trips byte for byte through serde and decodes as its codes say, its bytes are the
plan's, a nibble of -8 or a nonzero pad is refused naming the field, a payload of the other width is refused
by its settings, and a rank fitted to a top-k's bytes is about twice int8's in no more bytes. The mode's
defaults (``--rank fit``) take int4 and a top-k of 0.62x the mode's as the bytes the ranks fill."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradwire.compression import lowrank, serde
from gradwire.compression.codec import GradientCodec
from gradwire.compression.config import CodecConfig
from gradwire.compression.feedback import ErrorFeedback
from gradwire.compression.payload import CompressedGradient, Encoding, PayloadError, ValueFormat
from gradwire.coordinator.config import TrainConfig

INT4 = CodecConfig(bins=4, topk=143, indices="elias-fano", rank=3, factor_bits=4)
SHAPES = {"embed": (96, 33), "conv": (4, 8, 16), "bias": (512,)}  # 3 * (96 + 33) codes: an odd count


def _grads(seed: int = 0, rank: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    if rank is not None:
        out["embed"] = torch.randn(96, rank, generator=g) @ torch.randn(rank, 33, generator=g)
    return out


def _replace(payload: CompressedGradient, name: str, **fields: object) -> CompressedGradient:
    tensors = tuple(dataclasses.replace(t, **fields) if t.name == name else t for t in payload.tensors)
    return dataclasses.replace(payload, tensors=tensors)


def test_int4_codes_pack_two_a_byte_and_unpack_back() -> None:
    codes = np.array([-7, 7, 0, 3, -1], np.int8)
    data = lowrank.pack_int4(codes)
    assert data == bytes([(7 + 8) << 4 | 1, (3 + 8) << 4 | 8, 7])  # low nibble first; the odd one's high nibble 0
    assert np.array_equal(lowrank.unpack_int4(data, 5), codes)


def test_an_int4_payload_round_trips_and_costs_what_the_plan_says() -> None:
    codec = GradientCodec(SHAPES, INT4)
    plan = {t.name: t for t in codec.plan.tensors}
    assert plan["embed"].value_format == ValueFormat.INT4 and plan["embed"].k == 3
    payload = codec.compress(_grads(rank=3))
    embed = next(t for t in payload.tensors if t.name == "embed")
    assert len(embed.values) == (3 * (96 + 33) + 1) // 2 and len(embed.lut) == 8 * 3
    assert payload.nbytes == codec.plan.payload_bytes()
    again = serde.gradient_from_bytes(serde.gradient_to_bytes(payload))
    assert again == payload and again.settings.factor_bits == 4
    exact = _grads(rank=3)["embed"]
    rel = float((codec.decompress(again)["embed"] - exact).norm() / exact.norm())
    assert rel < 0.25  # 15 levels a factor entry: within int4's rounding of a rank-3 matrix


def test_error_feedback_keeps_what_int4_codes_did_not_carry() -> None:
    codec, feedback = GradientCodec(SHAPES, INT4), ErrorFeedback(beta=1.0)
    grads = _grads(seed=2)
    sent = codec.decompress(codec.compress(grads, feedback))
    assert torch.equal(feedback.buffers["embed"], (grads["embed"] - sent["embed"]).reshape(-1))


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda v: bytes([v[0] & 0xF0]) + v[1:], "got -8"),  # a low nibble of 0: code -8
        (lambda v: v[:-1] + bytes([v[-1] | 0x80]), "unused high bits"),  # the odd count's pad
        (lambda v: v[:-1], "expected"),  # a byte short
    ],
)
def test_a_malformed_int4_factor_is_refused_naming_it(change, why: str) -> None:
    codec = GradientCodec(SHAPES, INT4)
    payload = codec.compress(_grads())
    embed = next(t for t in payload.tensors if t.name == "embed")
    with pytest.raises(PayloadError, match=why) as err:
        codec.decode(_replace(payload, "embed", values=change(embed.values)))
    assert (err.value.tensor, err.value.field) == ("embed", "values")


def test_a_payload_of_the_other_code_width_is_refused_by_its_settings() -> None:
    int8 = dataclasses.replace(INT4, factor_bits=8)
    payload = GradientCodec(SHAPES, int8).compress(_grads())
    with pytest.raises(PayloadError, match="settings"):
        GradientCodec(SHAPES, INT4).decode(payload)
    msg = serde.gradient_to_proto(payload)
    msg.settings.factor_bits = 0  # a sender from before int4: its factors are int8
    assert serde.gradient_from_bytes(msg.SerializeToString()).settings.factor_bits == 8
    msg.settings.factor_bits = 2
    with pytest.raises(PayloadError, match="factor_bits"):
        serde.gradient_from_bytes(msg.SerializeToString())


def test_a_rank_fitted_in_int4_is_about_twice_int8s_in_no_more_bytes() -> None:
    shapes = {"embed": (8192, 256), "qkv": (768, 256), "proj": (256, 256)}
    top_k = CodecConfig(bins=4, topk=143, indices="elias-fano")
    budget = {
        t.name: GradientCodec({t.name: t.shape}, top_k).plan.payload_bytes()
        for t in GradientCodec(shapes, top_k).plan.tensors
    }
    ranks = {}
    for bits in (8, 4):
        fit = dataclasses.replace(top_k, rank_fits_topk=True, factor_bits=bits)
        for t in GradientCodec(shapes, fit).plan.tensors:
            assert t.encoding == Encoding.LOW_RANK
            spent = GradientCodec({t.name: t.shape}, fit).plan.payload_bytes()
            more = GradientCodec({t.name: t.shape}, dataclasses.replace(fit, rank=t.k + 1, rank_fits_topk=False))
            assert spent <= budget[t.name] + 8 < more.plan.payload_bytes(), (bits, t.name)
            ranks[bits, t.name] = t.k
    assert all(1.7 <= ranks[4, n] / ranks[8, n] <= 2.5 for n in shapes), ranks  # scales cost the same


def test_the_local_sgd_defaults_fit_int4_factors_to_a_smaller_top_k() -> None:
    fitted = TrainConfig(model="gpt-tiny", inner_steps=30)
    assert (fitted.rank, fitted.factor_bits, fitted.topk) == ("fit", 4, 82)
    assert fitted.codec_config().factor_bits == 4
    top_k = TrainConfig(model="gpt-tiny", inner_steps=30, rank=0)  # the DCT top-k itself travels: as before
    assert (top_k.factor_bits, top_k.topk) == (8, 143)
    assert TrainConfig(model="gpt-tiny", inner_steps=30, rank="fit").topk == 82
    assert TrainConfig(model="gpt-tiny", inner_steps=30, factor_bits=8).codec_config().factor_bits == 8
    assert TrainConfig(model="gpt-tiny").factor_bits == 8  # gradient mode: no factors
    with pytest.raises(ValueError, match="factor_bits"):
        TrainConfig(model="gpt-tiny", inner_steps=30, factor_bits=5)
