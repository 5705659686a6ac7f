"""The chunk plan: divisor chunking, density-preserving k, the dense rule, the value-format rule, groups."""

import pytest

from gradwire.compression import CodecConfig, Encoding, ModelPlan, ValueFormat
from gradwire.compression.plan import code_bits, largest_divisor_at_most, plan_tensor, value_format_for


@pytest.mark.parametrize(
    ("n", "limit", "want"), [(768, 64, 64), (50272, 64, 32), (2050, 64, 50), (50261, 64, 1), (7, 64, 7), (3072, 48, 48)]
)
def test_largest_divisor(n, limit, want):
    assert largest_divisor_at_most(n, limit) == want


def test_matrix_chunks_and_density_preserving_k():
    cfg = CodecConfig()
    full = plan_tensor("w", (768, 3072), cfg)
    assert (full.encoding, full.chunk_shape, full.k, full.num_chunks) == (Encoding.SPARSE, (64, 64), 32, 12 * 48)
    emb = plan_tensor("emb", (50272, 768), cfg)
    assert emb.chunk_shape == (32, 64) and emb.k == 16  # half the area, half the k: same density
    pos = plan_tensor("pos", (2050, 768), cfg)
    assert pos.chunk_shape == (50, 64) and pos.k == 25


def test_higher_rank_flattens_leading_dims():
    t = plan_tensor("conv", (8, 16, 3, 64), CodecConfig())
    assert t.chunk_shape == (64, 64) and t.grid == (6, 1)


def test_vectors_use_1d_chunks_with_at_least_one_kept():
    t = plan_tensor("norm", (768,), CodecConfig())
    assert t.chunk_shape == (64,) and t.k == 1 and t.num_values == 12
    assert plan_tensor("col", (512, 1), CodecConfig()).chunk_shape == (64,)


def test_small_tensors_are_dense_by_one_rule():
    cfg = CodecConfig(min_sparse_numel=256)
    assert plan_tensor("b", (255,), cfg).encoding == Encoding.DENSE
    assert plan_tensor("b", (256,), cfg).encoding == Encoding.SPARSE
    assert plan_tensor("scalar", (), cfg).encoding == Encoding.DENSE


def test_value_format_is_whichever_is_smaller():
    cfg = CodecConfig(bins=256)
    # 8-bit costs n + 512 (table) + 8 (shift, scale); raw costs 4n.
    assert value_format_for(173, cfg) == ValueFormat.FLOAT32
    assert value_format_for(174, cfg) == ValueFormat.LUT
    assert value_format_for(10**6, CodecConfig(bins=0)) == ValueFormat.FLOAT32
    assert plan_tensor("w", (768, 768), cfg).value_format == ValueFormat.LUT
    assert plan_tensor("norm", (768,), cfg).value_format == ValueFormat.FLOAT32


@pytest.mark.parametrize(
    ("bins", "bits"), [(2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (16, 4), (17, 5), (129, 8), (256, 8)]
)
def test_code_bits_is_ceil_log2_bins(bins, bits):
    assert code_bits(bins) == bits


def test_value_format_rule_counts_packed_bits():
    # bins=4, 2-bit codes: ceil(2n / 8) + 8 (table) + 8 (shift, scale) against 4n.
    assert value_format_for(4, CodecConfig(bins=4)) == ValueFormat.FLOAT32  # 1 + 16 = 17 > 16
    assert value_format_for(5, CodecConfig(bins=4)) == ValueFormat.LUT  # 2 + 16 = 18 < 20
    # bins=16, 4-bit codes: ceil(4n / 8) + 32 + 8 against 4n.
    assert value_format_for(11, CodecConfig(bins=16)) == ValueFormat.FLOAT32  # 6 + 40 = 46 > 44
    assert value_format_for(12, CodecConfig(bins=16)) == ValueFormat.LUT  # 6 + 40 = 46 < 48
    # Sign: ceil(n / 8) + 4 (scale) against 4n, whatever bins says.
    for bins in (0, 4, 256):
        sign = CodecConfig(values="sign", bins=bins)
        assert value_format_for(1, sign) == ValueFormat.FLOAT32  # 1 + 4 = 5 > 4
        assert value_format_for(2, sign) == ValueFormat.SIGN  # 1 + 4 = 5 < 8
        assert plan_tensor("norm", (768,), sign).value_format == ValueFormat.SIGN  # 12 values


# w: 8 chunks x k=32 = 256 values, 384 index bytes; norm: 12 values, 18 index bytes; b: 100 dense values.
PAYLOAD_SHAPES = {"w": (256, 128), "norm": (768,), "b": (100,)}


@pytest.mark.parametrize(
    ("config", "formats", "data_bytes"),
    [
        # 8-bit: w 256 + 512 (table); norm and b raw (12 + 520 > 48, 100 + 520 > 400): 48 + 400.
        (CodecConfig(bins=256), ("LUT", "FLOAT32", "FLOAT32"), 256 + 512 + 48 + 400),
        # 2-bit: w 64 + 8; norm 3 + 8; b 25 + 8.
        (CodecConfig(bins=4), ("LUT", "LUT", "LUT"), 64 + 8 + 3 + 8 + 25 + 8),
        # 3-bit: w 96 + 10; norm ceil(36 / 8) = 5 + 10; b ceil(300 / 8) = 38 + 10.
        (CodecConfig(bins=5), ("LUT", "LUT", "LUT"), 96 + 10 + 5 + 10 + 38 + 10),
        # sign bits: w 32; norm 2; b 13; no tables.
        (CodecConfig(values="sign"), ("SIGN", "SIGN", "SIGN"), 32 + 2 + 13),
        # raw: 4 bytes a value.
        (CodecConfig(bins=0), ("FLOAT32", "FLOAT32", "FLOAT32"), 4 * (256 + 12 + 100)),
    ],
)
def test_payload_bytes_is_exact_for_every_format(config, formats, data_bytes):
    plan = ModelPlan.build(PAYLOAD_SHAPES, config)
    assert tuple(t.value_format.name for t in plan.tensors) == formats
    assert plan.payload_bytes() == 384 + 18 + data_bytes


def test_groups_stack_tensors_by_chunk_shape():
    plan = ModelPlan.build({"a": (128, 64), "b": (64, 192), "c": (32, 64), "d": (100,)}, CodecConfig())
    by_shape = {g.chunk_shape: g for g in plan.groups}
    assert [m.name for m in by_shape[(64, 64)].members] == ["a", "b"]
    assert by_shape[(64, 64)].offsets == (0, 2) and by_shape[(64, 64)].num_chunks == 5
    assert [t.name for t in plan.dense] == ["d"]
    assert [t.name for t in plan.tensors] == ["a", "b", "c", "d"]


def test_duplicate_names_rejected():
    with pytest.raises(ValueError):
        ModelPlan.build([("a", (4,)), ("a", (4,))], CodecConfig())


BAD_SETTINGS = [
    {"chunk": 65},
    {"chunk": 0},
    {"topk": 0},
    {"topk": 5000},
    {"bins": 1},
    {"bins": 257},
    {"range_sigmas": 0.0},
    {"range_sigmas": float("nan")},
    {"range_sigmas": 1e308},
    {"min_sparse_numel": -1},
    {"values": "int8"},
    {"values": "LUT"},
    {"bins": 300, "values": "sign"},  # bins plays no part in sign coding, but must still be valid
]


@pytest.mark.parametrize("kwargs", BAD_SETTINGS)
def test_bad_settings_fail_early(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        CodecConfig(**kwargs)
