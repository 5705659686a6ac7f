"""Bit-packed values end to end: LUT codes of ceil(log2(bins)) bits and SIGN bits.

Round trips (payload sizes, exact error feedback, what sign decodes to, a fixed gradient sent in full)
and validation of every malformed layout of the packed formats, each naming the tensor and field.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradwire.compression import CodecConfig, ErrorFeedback, GradientCodec, serde
from gradwire.compression.packing import pack_bits, unpack_bits
from gradwire.compression.payload import CompressedGradient, CompressedTensor, Encoding, PayloadError, ValueFormat
from gradwire.compression.plan import TensorPlan

from .codec_helpers import check_corrupted_byte, rounds_to_send

# min_sparse_numel=64 so that "one" is a sparse tensor with a single value: raw under every coding.
BASE = CodecConfig(min_sparse_numel=64)
LUT4 = dataclasses.replace(BASE, bins=4)  # 2-bit codes, a power of two
LUT5 = dataclasses.replace(BASE, bins=5)  # 3-bit codes, 5..7 are invalid
LUT16 = dataclasses.replace(BASE, bins=16)  # 4-bit codes
SIGN = dataclasses.replace(BASE, values="sign")

SHAPES = {
    "w": (384, 64),  # (64, 64) chunks, k=32: 192 values, whole bytes at 1, 2, 3 or 4 bits
    "vec": (11200,),  # (64,) chunks, k=1: 175 values: a partly used last byte at any width
    "odd": (320,),  # (64,) chunks, k=1: 5 values: coded at 2 bits or as signs, raw where a table costs more
    "one": (64,),  # one (64,) chunk, k=1: 1 value: always raw, so the (64,) group mixes formats
    "d": (60,),  # dense, 60 values, a half-used last byte at 2 to 4 bits and as signs
    "d1": (1,),  # dense, 1 value, raw
}
F32, LUT, SGN = ValueFormat.FLOAT32, ValueFormat.LUT, ValueFormat.SIGN
FORMATS = {
    "lut4": (LUT4, {"w": LUT, "vec": LUT, "odd": LUT, "one": F32, "d": LUT, "d1": F32}),
    "lut5": (LUT5, {"w": LUT, "vec": LUT, "odd": F32, "one": F32, "d": LUT, "d1": F32}),
    "lut16": (LUT16, {"w": LUT, "vec": LUT, "odd": F32, "one": F32, "d": LUT, "d1": F32}),
    "sign": (SIGN, {"w": SGN, "vec": SGN, "odd": SGN, "one": F32, "d": SGN, "d1": F32}),
}
BITS = {"lut4": 2, "lut5": 3, "lut16": 4, "sign": 1}


def _grads(seed: int, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _cat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten().float() for v in d.values()])


def _plan(codec: GradientCodec, name: str) -> TensorPlan:
    return next(t for t in codec.plan.tensors if t.name == name)


def _tensor(p: CompressedGradient, name: str) -> CompressedTensor:
    return next(t for t in p.tensors if t.name == name)


class RecordingFeedback(ErrorFeedback):
    """Error feedback that keeps a copy of each buffer as accumulated, before the codec edits it."""

    def __init__(self) -> None:
        super().__init__(beta=1.0)
        self.accumulated: dict[str, torch.Tensor] = {}

    def accumulate(self, key: str, update: torch.Tensor) -> torch.Tensor:
        buf = super().accumulate(key, update)
        self.accumulated[key] = buf.clone()
        return buf


@pytest.fixture(scope="module", params=list(FORMATS))
def case(request: pytest.FixtureRequest) -> tuple[str, GradientCodec, CompressedGradient]:
    config, formats = FORMATS[request.param]
    codec = GradientCodec(SHAPES, config)
    assert {t.name: t.value_format for t in codec.plan.tensors} == formats
    assert {g.chunk_shape: [m.name for m in g.members] for g in codec.plan.groups} == {
        (64, 64): ["w"],
        (64,): ["vec", "odd", "one"],
    }
    return request.param, codec, codec.compress(_grads(1))


# ---------------------------------------------------------------- round trips


def test_payload_bytes_are_what_the_plan_says(case: tuple[str, GradientCodec, CompressedGradient]) -> None:
    name, codec, payload = case
    bits = BITS[name]
    assert payload.nbytes == codec.plan.payload_bytes()
    for t in codec.plan.tensors:
        ct, n = _tensor(payload, t.name), t.num_values
        want = {F32: 4 * n, LUT: math.ceil(n * bits / 8), SGN: math.ceil(n / 8)}[t.value_format]
        assert len(ct.values) == want, t.name
        assert len(ct.lut) == (2 * codec.config.bins if t.value_format == LUT else 0), t.name
        if t.value_format == SGN:
            assert ct.shift == 0.0 and ct.scale > 0


def test_decoded_values_are_exactly_what_error_feedback_subtracted(
    case: tuple[str, GradientCodec, CompressedGradient],
) -> None:
    """Per kept coefficient: residual == accumulated - decoded, bit for bit; unsent ones stay whole."""
    _, codec, _ = case
    feedback = RecordingFeedback()
    decoded = codec.decode(codec.compress(_grads(2), feedback))
    for gi, (idx, vals) in enumerate(zip(decoded.indices, decoded.values)):
        acc, residual = feedback.accumulated[f"group{gi}"], feedback.buffers[f"group{gi}"]
        assert torch.equal(residual.gather(1, idx), acc.gather(1, idx) - vals)
        assert torch.equal(residual.scatter(1, idx, 0.0), acc.scatter(1, idx, 0.0))
    for t, vals in zip(codec.plan.dense, decoded.dense):
        assert torch.equal(feedback.buffers[t.name], feedback.accumulated[t.name] - vals), t.name


def test_serde_round_trip_decodes_the_same(case: tuple[str, GradientCodec, CompressedGradient]) -> None:
    _, codec, payload = case
    back = serde.gradient_from_bytes(serde.gradient_to_bytes(payload))
    assert back == payload
    a, b = codec.decompress(payload), codec.decompress(back)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sign_decodes_to_sign_times_mean_magnitude_per_tensor() -> None:
    codec = GradientCodec(SHAPES, SIGN)
    feedback = RecordingFeedback()  # only to see the coefficients the codec selected from
    decoded = codec.decode(codec.compress(_grads(3), feedback))
    for gi, group in enumerate(codec.plan.groups):
        idx, vals = decoded.indices[gi], decoded.values[gi]
        kept = feedback.accumulated[f"group{gi}"].gather(1, idx)  # (B, k) the sender's values
        for t, off in zip(group.members, group.offsets):
            rows = slice(off, off + t.num_chunks)
            v, got = kept[rows], vals[rows]
            if t.value_format == F32:
                assert torch.equal(got, v), t.name
                continue
            scale = v.abs().mean()
            assert torch.equal(got.abs(), torch.full_like(got, float(got.abs().max()))), t.name  # one magnitude
            torch.testing.assert_close(got, torch.where(v < 0, -scale, scale), rtol=1e-6, atol=0)
    (d,) = [i for i, t in enumerate(codec.plan.dense) if t.name == "d"]
    g = _grads(3)["d"].flatten()
    torch.testing.assert_close(decoded.dense[d], torch.sign(g) * g.abs().mean(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("config", "fmt"), [(CodecConfig(topk=256, bins=4), LUT), (CodecConfig(topk=256, values="sign"), SGN)]
)
def test_error_feedback_sends_a_fixed_gradient_within_24_rounds_at_6_percent_density(
    config: CodecConfig, fmt: ValueFormat
) -> None:
    """At 2 bits (or 1) per value, error feedback gets a fixed gradient across about as fast as raw float32.

    256 of 4096 kept per chunk: raw float32 values need 16 rounds to reach cosine 0.95 here, 2-bit codes
    and signs 17 (measured); 8-bit codes at the default 0.78% density need ~140 (test_codec.py).
    """
    shapes = {"w": (256, 256), "v": (512,), "b": (16,)}
    codec = GradientCodec(shapes, config)
    assert all(t.value_format == fmt for t in codec.plan.tensors)
    rounds, cos = rounds_to_send(codec, _grads(5, shapes), max_rounds=24)
    assert cos >= 0.95, f"cosine {cos:.3f} after {rounds} rounds"
    assert rounds >= 12  # sanity: at 1/16 density no codec sends it all much sooner


def test_fewer_bits_make_smaller_payloads() -> None:
    shapes = {"w": (1024, 1024)}
    sizes = {
        name: GradientCodec(shapes, cfg).plan.payload_bytes() for name, (cfg, _) in FORMATS.items() if name != "lut5"
    }
    sizes["lut256"] = GradientCodec(shapes, BASE).plan.payload_bytes()
    assert sizes["sign"] < sizes["lut4"] < sizes["lut16"] < sizes["lut256"]
    index_bytes = 3 * 8192 // 2
    assert sizes["lut4"] - index_bytes == 8192 // 4 + 2 * 4  # four codes a byte, plus the table
    assert sizes["sign"] - index_bytes == 8192 // 8


# ---------------------------------------------------------------- validation of the packed layouts


@pytest.fixture(scope="module")
def lut5() -> tuple[GradientCodec, CompressedGradient]:
    codec = GradientCodec(SHAPES, LUT5)
    return codec, codec.compress(_grads(4))


@pytest.fixture(scope="module")
def sign() -> tuple[GradientCodec, CompressedGradient]:
    codec = GradientCodec(SHAPES, SIGN)
    return codec, codec.compress(_grads(4))


def _with(p: CompressedGradient, target: str, **changes: object) -> CompressedGradient:
    return dataclasses.replace(
        p, tensors=tuple(dataclasses.replace(t, **changes) if t.name == target else t for t in p.tensors)
    )


def _expect(codec: GradientCodec, bad: CompressedGradient, tensor: str, field: str) -> PayloadError:
    with pytest.raises(PayloadError) as info:
        codec.decode(bad)
    assert (info.value.tensor, info.value.field) == (tensor, field), str(info.value)
    return info.value


def _set_top_pad_bit(ct: CompressedTensor) -> dict[str, object]:
    return {"values": ct.values[:-1] + bytes([ct.values[-1] | 0x80])}


def _set_code(i: int, code: int, bits: int) -> object:
    def edit(ct: CompressedTensor, n: int) -> dict[str, object]:
        codes = unpack_bits(ct.values, bits, n).copy()
        codes[i % n] = code
        return {"values": pack_bits(codes, bits)}

    return edit


LUT5_CASES = [
    # values: ceil(3n / 8) bytes
    ("truncated", "w", "values", lambda ct, n: {"values": ct.values[:-1]}),
    ("overlong", "vec", "values", lambda ct, n: {"values": ct.values + b"\0"}),
    ("one-byte-per-code", "w", "values", lambda ct, n: {"values": bytes(n)}),
    ("dense-truncated", "d", "values", lambda ct, n: {"values": ct.values[:-1]}),
    ("empty", "vec", "values", {"values": b""}),
    # pad bits of the last byte are zero (vec: 525 bits, d: 180 bits)
    ("pad-top-bit", "vec", "values", lambda ct, n: _set_top_pad_bit(ct)),
    (
        "pad-lowest-bit",
        "vec",
        "values",
        lambda ct, n: {"values": ct.values[:-1] + bytes([ct.values[-1] | 1 << (n * 3 % 8)])},
    ),
    ("pad-dense", "d", "values", lambda ct, n: _set_top_pad_bit(ct)),
    # codes < bins
    ("code-5-first", "w", "values", _set_code(0, 5, 3)),
    ("code-7-last", "w", "values", _set_code(-1, 7, 3)),
    ("code-6-mid-group", "vec", "values", _set_code(100, 6, 3)),
    ("code-5-last-of-group", "vec", "values", _set_code(-1, 5, 3)),
    ("code-7-dense", "d", "values", _set_code(59, 7, 3)),
    # lut: 2 * bins bytes
    ("lut-8-bit-sized", "w", "lut", lambda ct, n: {"lut": ct.lut + bytes(2 * 251)}),
    ("lut-short", "d", "lut", lambda ct, n: {"lut": ct.lut[:-2]}),
    ("lut-missing", "vec", "lut", {"lut": b""}),
    # format against the plan
    ("sign-for-lut", "w", "value_format", {"value_format": SGN}),
    ("lut-for-raw", "odd", "value_format", {"value_format": LUT}),
]

SIGN_CASES = [
    # values: ceil(n / 8) bytes
    ("truncated", "w", "values", lambda ct, n: {"values": ct.values[:-1]}),
    ("overlong", "odd", "values", lambda ct, n: {"values": ct.values + b"\0"}),
    ("one-byte-per-value", "w", "values", lambda ct, n: {"values": bytes(n)}),
    ("dense-overlong", "d", "values", lambda ct, n: {"values": ct.values + b"\0"}),
    ("empty", "odd", "values", {"values": b""}),
    # pad bits of the last byte are zero (vec: 175 bits, odd: 5, d: 60)
    ("pad-vec", "vec", "values", lambda ct, n: _set_top_pad_bit(ct)),
    ("pad-odd-lowest", "odd", "values", lambda ct, n: {"values": bytes([ct.values[0] | 1 << 5])}),
    ("pad-dense", "d", "values", lambda ct, n: _set_top_pad_bit(ct)),
    # scale: finite, >= 0, <= 1e30
    ("scale-nan", "w", "scale", {"scale": math.nan}),
    ("scale-inf", "vec", "scale", {"scale": math.inf}),
    ("scale-negative", "odd", "scale", {"scale": -1e-3}),
    ("scale-huge", "d", "scale", {"scale": 1e31}),
    # shift: exactly 0
    ("shift-nonzero", "w", "shift", {"shift": 1e-6}),
    ("shift-nan", "d", "shift", {"shift": math.nan}),
    # lut: none for SIGN
    ("lut-sign-table", "w", "lut", {"lut": np.array([1.0, -1.0], "<f2").tobytes()}),
    ("lut-one-byte", "d", "lut", {"lut": b"\0"}),
    # format against the plan
    ("lut-for-sign", "vec", "value_format", {"value_format": LUT}),
    ("raw-for-sign", "d", "value_format", {"value_format": F32}),
    ("sign-for-raw", "one", "value_format", {"value_format": SGN}),
]


def _run_case(codec: GradientCodec, good: CompressedGradient, name: str, field: str, change: object) -> None:
    ct = _tensor(good, name)
    changes = change(ct, _plan(codec, name).num_values) if callable(change) else change
    bad = _with(good, name, **changes)
    assert bad != good
    _expect(codec, bad, name, field)


@pytest.mark.parametrize(("name", "field", "change"), [c[1:] for c in LUT5_CASES], ids=[c[0] for c in LUT5_CASES])
def test_lut_rule(lut5: tuple[GradientCodec, CompressedGradient], name: str, field: str, change: object) -> None:
    _run_case(*lut5, name, field, change)


@pytest.mark.parametrize(("name", "field", "change"), [c[1:] for c in SIGN_CASES], ids=[c[0] for c in SIGN_CASES])
def test_sign_rule(sign: tuple[GradientCodec, CompressedGradient], name: str, field: str, change: object) -> None:
    _run_case(*sign, name, field, change)


def test_valid_boundaries_are_accepted(
    lut5: tuple[GradientCodec, CompressedGradient], sign: tuple[GradientCodec, CompressedGradient]
) -> None:
    codec, good = lut5
    codec.decode(good)
    codec.decode(_with(good, "vec", values=_set_code(-1, 4, 3)(_tensor(good, "vec"), 175)["values"]))  # bins - 1
    codec, good = sign
    codec.decode(good)
    codec.decode(_with(good, "w", scale=0.0))  # an all-zero tensor has mean magnitude 0
    codec.decode(_with(good, "d", scale=1e30, shift=-0.0))


def test_settings_must_agree_on_the_coding(
    lut5: tuple[GradientCodec, CompressedGradient], sign: tuple[GradientCodec, CompressedGradient]
) -> None:
    _expect(lut5[0], sign[1], "<gradient>", "settings")
    _expect(sign[0], lut5[1], "<gradient>", "settings")
    # bins plays no part in sign coding, but settings are compared whole.
    other = GradientCodec(SHAPES, dataclasses.replace(SIGN, bins=16))
    _expect(other, sign[1], "<gradient>", "settings")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.sampled_from(["lut5", "sign"]),
    position=st.integers(min_value=0, max_value=1 << 30),
    flip=st.integers(min_value=1, max_value=255),
)
def test_single_byte_corruption_raises_only_payload_error(
    lut5: tuple[GradientCodec, CompressedGradient],
    sign: tuple[GradientCodec, CompressedGradient],
    which: str,
    position: int,
    flip: int,
) -> None:
    codec, good = lut5 if which == "lut5" else sign
    check_corrupted_byte(codec, good, position, flip)


def test_sparse_values_of_a_mixed_group_land_at_their_rows(sign: tuple[GradientCodec, CompressedGradient]) -> None:
    codec, good = sign
    d = codec.decode(good)
    group = codec.plan.groups[1]  # vec (SIGN, 175), odd (SIGN, 5), one (FLOAT32, 1)
    assert [m.name for m in group.members] == ["vec", "odd", "one"] and group.members[0].encoding == Encoding.SPARSE
    vals = d.values[1].reshape(-1)
    vec, odd = _tensor(good, "vec"), _tensor(good, "odd")
    signs = np.concatenate([unpack_bits(vec.values, 1, 175), unpack_bits(odd.values, 1, 5)])
    scales = np.repeat(np.float32([vec.scale, odd.scale]), [175, 5])
    assert np.array_equal(vals[:180].numpy(), np.where(signs == 1, -scales, scales))
    assert vals[180].numpy().tobytes() == _tensor(good, "one").values
