"""GradientCodec.decode: every malformed payload raises PayloadError naming the tensor and field.

One small codec covers every case the validation distinguishes: a sparse 8-bit matrix, sparse raw
float32 vectors, odd index counts (with a zero pad) in the middle and at the end of a mixed-format chunk
group, a dense 8-bit tensor and a dense raw float32 tensor. Each test breaks one rule in a copy of a
valid payload made with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradwire.compression import serde
from gradwire.compression.codec import GradientCodec
from gradwire.compression.config import FORMAT_VERSION, CodecConfig
from gradwire.compression.packing import pack12, pack_bits, unpack12, unpack12_padded, unpack_bits
from gradwire.compression.payload import CompressedGradient, CompressedTensor, Encoding, PayloadError, ValueFormat

from .codec_helpers import check_corrupted_byte

CONFIG = CodecConfig()  # chunk 64, topk 32, bins 256, min_sparse_numel 256

# Plan order; the fixture asserts what each one plans to.
SHAPES = {
    "w": (384, 64),  # sparse, (64, 64) chunks, k=32, 192 values -> LUT
    "odd": (320,),  # sparse, (64,) chunks, k=1, 5 values -> FLOAT32, odd: pad in the middle of its group
    "vec": (11200,),  # sparse, (64,) chunks, k=1, 175 values -> LUT, odd: a second pad in the group
    "sp": (768,),  # sparse, (64,) chunks, k=1, 12 values -> FLOAT32, last of the mixed group
    "d8": (200,),  # dense (< 256 elements), 200 values -> LUT
    "d32": (10,),  # dense, 10 values -> FLOAT32
}

# The tensor name gradient-level errors carry, in the codec and in serde alike.
GRADIENT_LEVEL = serde.GRADIENT


# ---------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def codec() -> GradientCodec:
    c = GradientCodec(SHAPES, CONFIG)
    plan = {t.name: t for t in c.plan.tensors}
    assert [t.name for t in c.plan.tensors] == list(SHAPES)

    def case(name: str, encoding: Encoding, fmt: ValueFormat) -> None:
        t = plan[name]
        assert (t.encoding, t.value_format) == (encoding, fmt), t

    case("w", Encoding.SPARSE, ValueFormat.LUT)
    assert len(plan["w"].chunk_shape) == 2 and plan["w"].num_values % 2 == 0
    case("odd", Encoding.SPARSE, ValueFormat.FLOAT32)
    case("vec", Encoding.SPARSE, ValueFormat.LUT)
    case("sp", Encoding.SPARSE, ValueFormat.FLOAT32)
    assert plan["sp"].num_values == 12 and plan["sp"].chunk_numel == 64 and plan["sp"].num_values % 2 == 0
    assert plan["odd"].num_values % 2 == 1 and plan["vec"].num_values % 2 == 1
    case("d8", Encoding.DENSE, ValueFormat.LUT)
    case("d32", Encoding.DENSE, ValueFormat.FLOAT32)
    # odd, vec and sp share one chunk group with both value formats: pads sit mid-group.
    groups = {g.chunk_shape: [m.name for m in g.members] for g in c.plan.groups}
    assert groups == {(64, 64): ["w"], (64,): ["odd", "vec", "sp"]}
    return c


def _grads(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


@pytest.fixture(scope="module")
def good(codec: GradientCodec) -> CompressedGradient:
    return codec.compress(_grads(1))


@pytest.fixture(scope="module")
def good2(codec: GradientCodec) -> CompressedGradient:
    return codec.compress(_grads(2))


def tensor(p: CompressedGradient, name: str) -> CompressedTensor:
    return next(t for t in p.tensors if t.name == name)


def with_tensor(p: CompressedGradient, target: str, /, **changes: object) -> CompressedGradient:
    assert any(t.name == target for t in p.tensors)
    return dataclasses.replace(
        p, tensors=tuple(dataclasses.replace(t, **changes) if t.name == target else t for t in p.tensors)
    )


def expect_error(
    codec: GradientCodec, bad: CompressedGradient, tensor_name: str | tuple[str, ...], field: str
) -> PayloadError:
    with pytest.raises(PayloadError) as info:
        codec.decode(bad)
    err = info.value
    names = tensor_name if isinstance(tensor_name, tuple) else (tensor_name,)
    assert (err.tensor in names, err.field) == (True, field), f"got tensor={err.tensor!r} field={err.field!r}: {err}"
    assert isinstance(err, ValueError)
    return err


# Byte-level edits of one tensor field; each returns new bytes.
def set_index(i: int, value: int) -> Callable[[CompressedTensor, int], bytes]:
    def edit(ct: CompressedTensor, n: int) -> bytes:
        idx = unpack12(ct.indices, n).copy()
        idx[i] = value
        return pack12(idx)

    return edit


def set_pad(value: int) -> Callable[[CompressedTensor, int], bytes]:
    def edit(ct: CompressedTensor, n: int) -> bytes:
        padded = unpack12_padded(ct.indices).copy()
        assert padded.size == n + 1 and padded[-1] == 0
        padded[-1] = value
        return pack12(padded)  # even count: no extra pad

    return edit


def set_lut(i: int, value: float) -> Callable[[CompressedTensor, int], bytes]:
    def edit(ct: CompressedTensor, n: int) -> bytes:
        lut = np.frombuffer(ct.lut, "<f2").copy()
        lut[i] = value
        return lut.tobytes()

    return edit


def set_raw(i: int, value: float) -> Callable[[CompressedTensor, int], bytes]:
    def edit(ct: CompressedTensor, n: int) -> bytes:
        vals = np.frombuffer(ct.values, "<f4").copy()
        with np.errstate(over="ignore"):
            vals[i] = value
        return vals.tobytes()

    return edit


def num_values(codec: GradientCodec, name: str) -> int:
    return next(t for t in codec.plan.tensors if t.name == name).num_values


# ---------------------------------------------------------------- the valid payload


def test_valid_payload_decodes_and_decompresses(codec: GradientCodec, good: CompressedGradient) -> None:
    assert good.format_version == FORMAT_VERSION and good.settings == CONFIG
    assert sum(t.nbytes for t in good.tensors) == codec.plan.payload_bytes()
    d = codec.decode(good)
    assert [tuple(i.shape) for i in d.indices] == [(g.num_chunks, g.k) for g in codec.plan.groups]
    assert [tuple(v.shape) for v in d.values] == [(g.num_chunks, g.k) for g in codec.plan.groups]
    for g, idx, vals in zip(codec.plan.groups, d.indices, d.values):
        assert idx.dtype == torch.int64 and int(idx.min()) >= 0 and int(idx.max()) < g.chunk_numel
        assert vals.dtype == torch.float32 and torch.isfinite(vals).all()
    # The pads are removed: each chunk of the (64,) group keeps exactly its k=1 index, as sent.
    sent = np.concatenate([unpack12(tensor(good, n).indices, num_values(codec, n)) for n in ("odd", "vec", "sp")])
    assert np.array_equal(d.indices[1].reshape(-1).numpy(), sent)
    # Raw float32 values arrive bit-exact, at the right rows of the mixed group.
    assert np.array_equal(d.values[1][:5].reshape(-1).numpy(), np.frombuffer(tensor(good, "odd").values, "<f4"))
    assert np.array_equal(d.values[1][-12:].reshape(-1).numpy(), np.frombuffer(tensor(good, "sp").values, "<f4"))

    out = codec.decompress(good)
    assert list(out) == list(SHAPES)
    for name, shape in SHAPES.items():
        assert tuple(out[name].shape) == shape and out[name].dtype == torch.float32
        assert torch.isfinite(out[name]).all()
    assert torch.equal(out["d32"], _grads(1)["d32"])  # dense raw float32 is exact
    assert torch.allclose(out["d8"], _grads(1)["d8"], atol=0.1)  # 8-bit, 256 bins over +-6 sigma


def test_boundary_values_are_accepted(codec: GradientCodec, good: CompressedGradient) -> None:
    codec.decode(with_tensor(good, "w", shift=1e30, scale=1e30))
    codec.decode(with_tensor(good, "d8", shift=-1e30, scale=5e-45))
    vec = tensor(good, "sp")
    codec.decode(with_tensor(good, "sp", indices=set_index(0, 63)(vec, 12)))  # last position of a 64-chunk


def test_serde_round_trip_decodes_to_the_same_result(codec: GradientCodec, good: CompressedGradient) -> None:
    back = serde.gradient_from_bytes(serde.gradient_to_bytes(good))
    assert back == good
    a, b = codec.decompress(good), codec.decompress(back)
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------- one test per rule

GradientEdit = Callable[[CompressedGradient], CompressedGradient]


def _other(name: str) -> str:
    return "sp" if name != "sp" else "w"


GRADIENT_CASES: list[tuple[str, GradientEdit, tuple[str, ...] | str, str]] = [
    ("version-0", lambda p: dataclasses.replace(p, format_version=0), GRADIENT_LEVEL, "format_version"),
    (
        "version-next",
        lambda p: dataclasses.replace(p, format_version=FORMAT_VERSION + 1),
        GRADIENT_LEVEL,
        "format_version",
    ),
    (
        "settings-topk",
        lambda p: dataclasses.replace(p, settings=dataclasses.replace(CONFIG, topk=16)),
        GRADIENT_LEVEL,
        "settings",
    ),
    (
        "settings-bins",
        lambda p: dataclasses.replace(p, settings=dataclasses.replace(CONFIG, bins=128)),
        GRADIENT_LEVEL,
        "settings",
    ),
    (
        "settings-values",
        lambda p: dataclasses.replace(p, settings=dataclasses.replace(CONFIG, values="sign")),
        GRADIENT_LEVEL,
        "settings",
    ),
    (
        "settings-range",
        lambda p: dataclasses.replace(p, settings=dataclasses.replace(CONFIG, range_sigmas=5.0)),
        GRADIENT_LEVEL,
        "settings",
    ),
    (
        "settings-dct",
        lambda p: dataclasses.replace(p, settings=dataclasses.replace(CONFIG, use_dct=False)),
        GRADIENT_LEVEL,
        "settings",
    ),
    (
        "settings-min-sparse",
        lambda p: dataclasses.replace(p, settings=dataclasses.replace(CONFIG, min_sparse_numel=0)),
        GRADIENT_LEVEL,
        "settings",
    ),
    ("missing-first", lambda p: dataclasses.replace(p, tensors=p.tensors[1:]), "w", "name"),
    (
        "missing-middle",
        lambda p: dataclasses.replace(p, tensors=tuple(t for t in p.tensors if t.name != "vec")),
        "vec",
        "name",
    ),
    ("missing-last", lambda p: dataclasses.replace(p, tensors=p.tensors[:-1]), "d32", "name"),
    ("no-tensors", lambda p: dataclasses.replace(p, tensors=()), tuple(SHAPES), "name"),
    (
        "extra",
        lambda p: dataclasses.replace(p, tensors=(*p.tensors, dataclasses.replace(p.tensors[-1], name="extra.bias"))),
        "extra.bias",
        "name",
    ),
    ("renamed", lambda p: with_tensor(p, "sp", name="sp2"), ("sp2", "sp"), "name"),
    # Reordering names no single tensor today (tensor=""); see test_reordered_payload_names_a_tensor.
    (
        "reordered",
        lambda p: dataclasses.replace(p, tensors=(p.tensors[1], p.tensors[0], *p.tensors[2:])),
        ("", "w", "odd"),
        "name",
    ),
    ("reversed", lambda p: dataclasses.replace(p, tensors=p.tensors[::-1]), ("", *SHAPES), "name"),
    ("duplicated", lambda p: dataclasses.replace(p, tensors=(*p.tensors, p.tensors[0])), ("", "w"), "name"),
]


@pytest.mark.parametrize(
    ("edit", "tensor_name", "field"), [c[1:] for c in GRADIENT_CASES], ids=[c[0] for c in GRADIENT_CASES]
)
def test_gradient_level_rule(
    codec: GradientCodec, good: CompressedGradient, edit: GradientEdit, tensor_name: str | tuple[str, ...], field: str
) -> None:
    expect_error(codec, edit(good), tensor_name, field)


# (id, tensor, field, changes: dict or callable(ct, num_values) -> dict)
TensorChange = dict[str, object] | Callable[[CompressedTensor, int], dict[str, object]]

_NAN, _INF = math.nan, math.inf

TENSOR_CASES: list[tuple[str, str, str, TensorChange]] = [
    # shape / encoding / value_format / chunk_shape / k against the plan
    ("shape-transposed", "w", "shape", {"shape": (64, 384)}),
    ("shape-extra-dim", "sp", "shape", {"shape": (1, 768)}),
    ("shape-dense", "d32", "shape", {"shape": (11,)}),
    ("encoding-sparse-as-dense", "w", "encoding", {"encoding": Encoding.DENSE}),
    ("encoding-dense-as-sparse", "d32", "encoding", {"encoding": Encoding.SPARSE}),
    ("value-format-lut-as-f32", "w", "value_format", {"value_format": ValueFormat.FLOAT32}),
    ("value-format-f32-as-lut", "sp", "value_format", {"value_format": ValueFormat.LUT}),
    ("value-format-dense-lut-as-f32", "d8", "value_format", {"value_format": ValueFormat.FLOAT32}),
    ("value-format-dense-f32-as-lut", "d32", "value_format", {"value_format": ValueFormat.LUT}),
    ("chunk-shape-smaller", "w", "chunk_shape", {"chunk_shape": (32, 64)}),
    ("chunk-shape-1d", "w", "chunk_shape", {"chunk_shape": (4096,)}),
    ("chunk-shape-vector", "sp", "chunk_shape", {"chunk_shape": (128,)}),
    ("chunk-shape-on-dense", "d32", "chunk_shape", {"chunk_shape": (10,)}),
    ("k-more", "w", "k", {"k": 33}),
    ("k-fewer", "sp", "k", {"k": 0}),
    ("k-on-dense", "d8", "k", {"k": 1}),
    # byte lengths: indices = packed 12-bit length, values = n or 4n, lut = 2*bins or 0
    ("indices-truncated-1", "w", "indices", lambda ct, n: {"indices": ct.indices[:-1]}),
    ("indices-truncated-3", "odd", "indices", lambda ct, n: {"indices": ct.indices[:-3]}),
    ("indices-overlong-1", "sp", "indices", lambda ct, n: {"indices": ct.indices + b"\0"}),
    ("indices-overlong-3", "vec", "indices", lambda ct, n: {"indices": ct.indices + b"\0\0\0"}),
    ("indices-empty", "sp", "indices", {"indices": b""}),
    ("indices-on-dense", "d32", "indices", {"indices": b"\0\0\0"}),
    ("values-lut-truncated", "w", "values", lambda ct, n: {"values": ct.values[:-1]}),
    ("values-lut-overlong", "vec", "values", lambda ct, n: {"values": ct.values + b"\0"}),
    ("values-lut-as-f32-length", "w", "values", lambda ct, n: {"values": ct.values * 4}),
    ("values-f32-truncated", "sp", "values", lambda ct, n: {"values": ct.values[:-1]}),
    ("values-f32-one-less", "odd", "values", lambda ct, n: {"values": ct.values[:-4]}),
    ("values-f32-overlong", "sp", "values", lambda ct, n: {"values": ct.values + b"\0\0\0\0"}),
    ("values-f32-as-lut-length", "sp", "values", lambda ct, n: {"values": ct.values[:n]}),
    ("values-dense-lut-truncated", "d8", "values", lambda ct, n: {"values": ct.values[:-1]}),
    ("values-dense-lut-overlong", "d8", "values", lambda ct, n: {"values": ct.values + b"\0"}),
    ("values-dense-f32-truncated", "d32", "values", lambda ct, n: {"values": ct.values[:-2]}),
    ("values-dense-f32-overlong", "d32", "values", lambda ct, n: {"values": ct.values + b"\0" * 4}),
    ("values-empty", "d32", "values", {"values": b""}),
    ("lut-truncated", "w", "lut", lambda ct, n: {"lut": ct.lut[:-2]}),
    ("lut-odd-length", "vec", "lut", lambda ct, n: {"lut": ct.lut[:-1]}),
    ("lut-overlong", "w", "lut", lambda ct, n: {"lut": ct.lut + b"\0\0"}),
    ("lut-missing", "d8", "lut", {"lut": b""}),
    ("lut-dense-overlong", "d8", "lut", lambda ct, n: {"lut": ct.lut * 2}),
    ("lut-on-f32-sparse", "sp", "lut", {"lut": b"\0\0" * 256}),
    ("lut-on-f32-dense", "d32", "lut", {"lut": b"\0\0"}),
    # indices: every index < chunk numel (owner found mid-group too), zero pad after an odd count
    ("index-64-last-member", "sp", "indices", lambda ct, n: {"indices": set_index(n - 1, 64)(ct, n)}),
    ("index-64-first-of-member", "sp", "indices", lambda ct, n: {"indices": set_index(0, 64)(ct, n)}),
    ("index-4095-mid-group", "vec", "indices", lambda ct, n: {"indices": set_index(100, 4095)(ct, n)}),
    ("index-last-of-odd-member", "vec", "indices", lambda ct, n: {"indices": set_index(n - 1, 65)(ct, n)}),
    ("index-first-member", "odd", "indices", lambda ct, n: {"indices": set_index(0, 1000)(ct, n)}),
    ("pad-1-first-member", "odd", "indices", lambda ct, n: {"indices": set_pad(1)(ct, n)}),
    ("pad-63-mid-group", "vec", "indices", lambda ct, n: {"indices": set_pad(63)(ct, n)}),
    ("pad-4095", "odd", "indices", lambda ct, n: {"indices": set_pad(4095)(ct, n)}),
    # shift: finite, |shift| <= 1e30
    ("shift-nan", "w", "shift", {"shift": _NAN}),
    ("shift-inf", "w", "shift", {"shift": _INF}),
    ("shift-neg-inf", "vec", "shift", {"shift": -_INF}),
    ("shift-too-big", "w", "shift", {"shift": 1.0001e30}),
    ("shift-too-negative", "d8", "shift", {"shift": -1e31}),
    ("shift-nan-dense", "d8", "shift", {"shift": _NAN}),
    # scale: finite, > 0, <= 1e30
    ("scale-zero", "w", "scale", {"scale": 0.0}),
    ("scale-neg-zero", "vec", "scale", {"scale": -0.0}),
    ("scale-negative", "w", "scale", {"scale": -1.0}),
    ("scale-nan", "w", "scale", {"scale": _NAN}),
    ("scale-inf", "vec", "scale", {"scale": _INF}),
    ("scale-too-big", "d8", "scale", {"scale": 1e31}),
    ("scale-zero-dense", "d8", "scale", {"scale": 0.0}),
    # LUT entries finite (float16)
    ("lut-nan", "w", "lut", lambda ct, n: {"lut": set_lut(3, np.nan)(ct, n)}),
    ("lut-inf-last", "vec", "lut", lambda ct, n: {"lut": set_lut(255, np.inf)(ct, n)}),
    ("lut-neg-inf-dense", "d8", "lut", lambda ct, n: {"lut": set_lut(0, -np.inf)(ct, n)}),
    # raw float32 values finite and within 1e30
    ("raw-nan", "sp", "values", lambda ct, n: {"values": set_raw(0, np.nan)(ct, n)}),
    ("raw-inf", "sp", "values", lambda ct, n: {"values": set_raw(n - 1, np.inf)(ct, n)}),
    ("raw-neg-inf", "odd", "values", lambda ct, n: {"values": set_raw(2, -np.inf)(ct, n)}),
    ("raw-1e38", "odd", "values", lambda ct, n: {"values": set_raw(4, 1e38)(ct, n)}),
    ("raw-neg-2e30", "sp", "values", lambda ct, n: {"values": set_raw(5, -2e30)(ct, n)}),
    ("raw-nan-dense", "d32", "values", lambda ct, n: {"values": set_raw(9, np.nan)(ct, n)}),
    ("raw-inf-dense", "d32", "values", lambda ct, n: {"values": set_raw(0, np.inf)(ct, n)}),
    ("raw-1e38-dense", "d32", "values", lambda ct, n: {"values": set_raw(3, -1e38)(ct, n)}),
]


@pytest.mark.parametrize(("name", "field", "change"), [c[1:] for c in TENSOR_CASES], ids=[c[0] for c in TENSOR_CASES])
def test_tensor_rule(
    codec: GradientCodec, good: CompressedGradient, name: str, field: str, change: TensorChange
) -> None:
    ct = tensor(good, name)
    changes = change(ct, num_values(codec, name)) if callable(change) else change
    bad = with_tensor(good, name, **changes)
    assert bad != good
    expect_error(codec, bad, name, field)


def test_shift_and_scale_of_float32_tensors_are_ignored(codec: GradientCodec, good: CompressedGradient) -> None:
    """Shift and scale only mean something for LUT tensors; a FLOAT32 tensor may carry anything there."""
    codec.decode(with_tensor(good, "sp", shift=0.0, scale=0.0))


# ---------------------------------------------------------------- aggregation is untouched by a bad payload

BAD_FOR_AGG = {
    "bad-index-late-group": lambda p: with_tensor(p, "sp", indices=set_index(11, 64)(tensor(p, "sp"), 12)),
    "bad-pad": lambda p: with_tensor(p, "vec", indices=set_pad(7)(tensor(p, "vec"), 175)),
    "bad-dense-value": lambda p: with_tensor(p, "d32", values=set_raw(9, np.inf)(tensor(p, "d32"), 10)),
    "bad-last-lut": lambda p: with_tensor(p, "d8", lut=set_lut(1, np.nan)(tensor(p, "d8"), 200)),
    "missing-tensor": lambda p: dataclasses.replace(p, tensors=p.tensors[:-1]),
}


@pytest.mark.parametrize("normalize", ["mean", "per_coordinate"])
@pytest.mark.parametrize("breaker", list(BAD_FOR_AGG.values()), ids=list(BAD_FOR_AGG))
def test_bad_payload_leaves_aggregation_untouched(
    codec: GradientCodec, good: CompressedGradient, good2: CompressedGradient, breaker: GradientEdit, normalize: str
) -> None:
    bad = breaker(good2)
    agg = codec.aggregator(normalize)  # type: ignore[arg-type]
    agg.add(good, 2.0)
    with pytest.raises(PayloadError):
        agg.add(bad, 1.0)
    agg.add(good2, 1.0)
    assert agg.senders == 2 and agg.total_weight == 3.0
    got = agg.result()
    want = codec.aggregate([good, good2], weights=[2, 1], normalize=normalize)  # type: ignore[arg-type]
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


# ---------------------------------------------------------------- through serde


def test_bytes_from_another_plan_fail_in_decode(codec: GradientCodec) -> None:
    # Same names and settings, other shapes: serde accepts it, the codec names the first mismatch.
    other_shapes = dict(SHAPES, w=(320, 64))
    other = GradientCodec(other_shapes, CONFIG)
    data = serde.gradient_to_bytes(other.compress({n: torch.randn(s) for n, s in other_shapes.items()}))
    parsed = serde.gradient_from_bytes(data)
    expect_error(codec, parsed, "w", "shape")

    # Other names: a different model altogether.
    model = GradientCodec({"embed.weight": (512, 64), "ln.bias": (64,)}, CONFIG)
    parsed = serde.gradient_from_bytes(
        serde.gradient_to_bytes(model.compress({"embed.weight": torch.randn(512, 64), "ln.bias": torch.randn(64)}))
    )
    expect_error(codec, parsed, ("embed.weight", "ln.bias", *SHAPES), "name")

    # Other settings: serde accepts any valid settings, the codec rejects them.
    other_cfg = GradientCodec(SHAPES, dataclasses.replace(CONFIG, topk=8))
    parsed = serde.gradient_from_bytes(serde.gradient_to_bytes(other_cfg.compress(_grads(3))))
    expect_error(codec, parsed, GRADIENT_LEVEL, "settings")


def test_truncated_bytes_fail_with_payload_error(codec: GradientCodec, good: CompressedGradient) -> None:
    data = serde.gradient_to_bytes(good)
    for cut in (0, 1, len(data) // 3, len(data) // 2, len(data) - 1):
        with pytest.raises(PayloadError):
            codec.decode(serde.gradient_from_bytes(data[:cut]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(min_value=0, max_value=1 << 30), flip=st.integers(min_value=1, max_value=255))
def test_single_byte_corruption_raises_only_payload_error(
    codec: GradientCodec, good: CompressedGradient, position: int, flip: int
) -> None:
    check_corrupted_byte(codec, good, position, flip)


# ---------------------------------------------------------------- code range and tensor order


@pytest.mark.parametrize(
    ("bins", "bits", "code"), [(12, 4, 12), (12, 4, 15), (5, 3, 5), (5, 3, 7), (3, 2, 3), (200, 8, 255)]
)
@pytest.mark.parametrize("target", ["a", "b"])
def test_code_beyond_bins_is_rejected(bins: int, bits: int, code: int, target: str) -> None:
    """When bins is not a power of two a packed code can exceed the table: a PayloadError on ``values``.

    Unchecked, code bins+j of the first tensor in a group would read entry j of the next tensor's table.
    """
    c = GradientCodec({"a": (512, 64), "b": (512, 64)}, dataclasses.replace(CONFIG, bins=bins))
    assert all(t.value_format == ValueFormat.LUT for t in c.plan.tensors)
    gen = torch.Generator().manual_seed(0)
    p = c.compress({"a": torch.randn(512, 64, generator=gen), "b": torch.randn(512, 64, generator=gen)})
    n = num_values(c, target)
    codes = unpack_bits(tensor(p, target).values, bits, n).copy()
    assert int(codes.max()) < bins
    codes[n // 2] = code
    try:
        c.decode(with_tensor(p, target, values=pack_bits(codes, bits)))
    except PayloadError as e:
        assert (e.tensor, e.field) == (target, "values")
        assert str(code) in e.reason
    else:
        raise AssertionError(f"code {code} with bins={bins} was accepted")


@pytest.mark.parametrize("order", ["swap", "duplicate"])
def test_reordered_payload_names_a_tensor(codec: GradientCodec, good: CompressedGradient, order: str) -> None:
    t = good.tensors
    tensors = (t[1], t[0], *t[2:]) if order == "swap" else (*t, t[0])
    with pytest.raises(PayloadError) as info:
        codec.decode(dataclasses.replace(good, tensors=tensors))
    assert info.value.field == "name"
    if order == "swap":
        assert info.value.tensor in ("w", "odd")  # the first misplaced tensor, either way round
    else:
        assert info.value.tensor == "w"  # the surplus copy
