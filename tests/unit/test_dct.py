"""The chunk DCT: orthonormal bases, agreement with scipy's reference DCT-II, exact inverse."""

import numpy as np
import pytest
import scipy.fft
import torch

from gradwire.compression.dct import dct_basis, dct_chunks, dct_flops, idct_chunks


@pytest.mark.parametrize("n", [1, 2, 7, 32, 50, 64])
def test_basis_is_orthonormal(n):
    d = dct_basis(n, torch.float64)
    torch.testing.assert_close(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)


def test_basis_cached_per_dtype_and_device():
    assert dct_basis(16) is dct_basis(16)
    assert dct_basis(16, torch.float64).dtype == torch.float64


@pytest.mark.parametrize("shape", [(5, 64), (3, 11)])
def test_1d_chunks_match_scipy(shape):
    x = torch.randn(*shape, dtype=torch.float64)
    ref = scipy.fft.dct(x.numpy(), type=2, norm="ortho", axis=1)
    np.testing.assert_allclose(dct_chunks(x).numpy(), ref, atol=1e-12)


@pytest.mark.parametrize("shape", [(4, 64, 64), (3, 32, 64), (2, 50, 64), (6, 35, 11)])
def test_2d_chunks_match_scipy(shape):
    x = torch.randn(*shape, dtype=torch.float64)
    ref = scipy.fft.dctn(x.numpy(), type=2, norm="ortho", axes=(1, 2))
    np.testing.assert_allclose(dct_chunks(x).numpy(), ref, atol=1e-12)


@pytest.mark.parametrize("shape", [(9, 64), (5, 64, 64), (3, 50, 32)])
def test_inverse_round_trip_fp32(shape):
    x = torch.randn(*shape)
    torch.testing.assert_close(idct_chunks(dct_chunks(x)), x, atol=1e-5, rtol=0)


def test_energy_preserved():
    x = torch.randn(8, 64, 64, dtype=torch.float64)
    assert torch.allclose(dct_chunks(x).norm(), x.norm())


def test_flop_count():
    assert dct_flops((64, 64), 10) == 2 * 10 * 64 * 64 * 128
    assert dct_flops((64,), 3) == 2 * 3 * 64 * 64
