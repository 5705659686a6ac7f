"""topk_indices: numpy's introselect on CPU keeps the same coefficients torch.topk does."""

import numpy as np
import pytest
import torch

from gradwire.compression import select
from gradwire.compression.select import topk_indices


def _sets(idx: torch.Tensor) -> torch.Tensor:
    return idx.sort(dim=1).values


@pytest.mark.parametrize("k", [1, 16, 90, 360, 4095, 4096])
def test_same_positions_as_torch_topk(k):
    scores = torch.randn(600, 4096, generator=torch.Generator().manual_seed(k)).abs()  # distinct values: one answer
    idx = topk_indices(scores, k)
    assert idx.shape == (600, k) and idx.dtype == torch.int64
    torch.testing.assert_close(_sets(idx), _sets(scores.topk(k, dim=1).indices), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])  # numpy's blocks, torch.topk
@pytest.mark.parametrize("k", [1, 7, 64, 256])
def test_each_row_comes_in_increasing_order(dtype: torch.dtype, k: int) -> None:
    """What a receiver reads as "no position twice" (``Aggregator.norm`` skips its sort on it; Elias-Fano
    codes it): every row strictly increases, on both kernels, and holds the same set as before."""
    scores = torch.randn(700, 256, generator=torch.Generator().manual_seed(k)).to(dtype)
    scores[5] = 0  # a row of ties
    idx = topk_indices(scores, k, magnitude=True)
    assert bool((idx[:, 1:] > idx[:, :-1]).all())
    ref = scores.float().abs().topk(k, dim=1).indices.sort(dim=1).values
    rows = torch.arange(700) != 5
    torch.testing.assert_close(idx[rows], ref[rows], rtol=0, atol=0)


def test_threads_and_blocks_agree_with_one_thread(monkeypatch):
    scores = torch.rand(1000, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    monkeypatch.setattr(select, "ROWS_PER_BLOCK", 64)  # 16 blocks, the last one short
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = topk_indices(scores, 20)
        torch.set_num_threads(3)
        many = topk_indices(scores, 20)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(_sets(one), _sets(many), rtol=0, atol=0)
    torch.testing.assert_close(_sets(one), _sets(scores.topk(20, dim=1).indices), rtol=0, atol=0)


def test_ties_keep_a_valid_top_k():
    """All-zero rows (a chunk with nothing to send) and tied boundaries still give k distinct positions, none
    of them smaller than anything left out."""
    scores = torch.zeros(8, 64)
    scores[1, :10] = 1.0  # 10 tied winners for k = 4
    scores[2] = torch.arange(64.0) % 3
    idx = topk_indices(scores, 4)
    for row, kept in zip(scores, idx):
        assert len(set(kept.tolist())) == 4
        left_out = np.setdiff1d(np.arange(64), kept.numpy())
        assert row[kept].min() >= row[left_out].max()


def test_mostly_zero_blocks_keep_the_same_top_k():
    """Blocks that are mostly zeros (introselect is slow through ties) have their zeros made distinct: the
    same sets as torch's, and where a row has fewer than k non-zeros, its first zeros make up the rest."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(600, 4096, generator=g).abs() * (torch.rand(600, 4096, generator=g) < 0.1)
    scores[:300] = torch.randn(300, 4096, generator=g).abs()  # dense blocks beside sparse ones
    idx = topk_indices(scores, 32)
    torch.testing.assert_close(_sets(idx), _sets(scores.topk(32, dim=1).indices), rtol=0, atol=0)
    scores[-1] = 0
    scores[-1, [5, 4000]] = 1.0
    assert sorted(topk_indices(scores, 32)[-1].tolist()) == sorted([5, 4000, *[i for i in range(32) if i != 5][:30]])


def test_nan_and_infinity_rank_first():
    """The codec finds a non-finite gradient by looking at the kept values only: they must be among them."""
    scores = torch.rand(4, 64)
    scores[1, 7] = float("nan")
    scores[2, 9] = float("inf")
    idx = topk_indices(scores, 3)
    assert 7 in idx[1].tolist() and 9 in idx[2].tolist()


def test_other_dtypes_and_bad_arguments():
    scores = torch.randn(5, 64).abs().to(torch.bfloat16)
    assert topk_indices(scores, 8).shape == (5, 8)  # torch's kernel: numpy has no bfloat16
    for bad_k in (0, 65):
        with pytest.raises(ValueError, match="1 <= k <= n"):
            topk_indices(scores, bad_k)
    with pytest.raises(ValueError, match=r"\(B, n\)"):
        topk_indices(torch.rand(64), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_magnitude_ranks_as_the_absolute_values_do(dtype: torch.dtype):
    """``magnitude`` keeps the positions ``scores.abs()`` would, NaN and infinity of either sign first, on
    numpy's path (float32, float64) and torch's (bfloat16) alike."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(600, 256, generator=gen).to(dtype)  # 600 rows: three blocks, the last one short
    scores[4, 17], scores[5, 3] = float("-inf"), float("nan")
    scores[7, :200] = 0.0  # a row of ties at zero
    got = topk_indices(scores, 12, magnitude=True)
    want = topk_indices(scores.abs(), 12)
    for row in range(scores.shape[0]):
        kept, expected = scores[row].abs()[got[row]], scores[row].abs()[want[row]]
        assert torch.equal(kept.float().nan_to_num(9e9).sort().values, expected.float().nan_to_num(9e9).sort().values)
    assert 17 in got[4].tolist() and 3 in got[5].tolist()
