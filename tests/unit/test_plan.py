"""The chunk plan: divisor chunking, density-preserving k, the dense rule, the value-format rule, groups."""

import pytest

from gradwire.compression import CodecConfig, Encoding, ModelPlan, ValueFormat
from gradwire.compression.plan import largest_divisor_at_most, plan_tensor, value_format_for


@pytest.mark.parametrize(("n", "limit", "want"), [(768, 64, 64), (50272, 64, 32), (2050, 64, 50), (50261, 64, 1), (7, 64, 7), (3072, 48, 48)])
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
    assert value_format_for(174, cfg) == ValueFormat.UINT8_LUT
    assert value_format_for(10**6, CodecConfig(bins=0)) == ValueFormat.FLOAT32
    assert plan_tensor("w", (768, 768), cfg).value_format == ValueFormat.UINT8_LUT
    assert plan_tensor("norm", (768,), cfg).value_format == ValueFormat.FLOAT32


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


@pytest.mark.parametrize("kwargs", [dict(chunk=65), dict(chunk=0), dict(topk=0), dict(topk=5000), dict(bins=1), dict(bins=257), dict(range_sigmas=0.0), dict(range_sigmas=float("nan")), dict(min_sparse_numel=-1)])
def test_bad_settings_fail_early(kwargs):
    with pytest.raises(ValueError):
        CodecConfig(**kwargs)
