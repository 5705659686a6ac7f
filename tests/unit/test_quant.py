"""Value quantization: LUT bins (bounded error, per-bin unbiased, independent segments) and sign bits."""

import pytest
import torch

from gradwire.compression.quant import dequantize, quantize, quantize_sign, sign_table


def _heavy_tailed(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 1e-3


def test_error_bounded_by_one_bin_inside_window():
    v = _heavy_tailed(20000)
    q = quantize(v, torch.zeros_like(v, dtype=torch.long), 1, bins=256, range_sigmas=6.0)
    shift, scale = q.shift[0], q.scale[0]
    inside = (v - shift).abs() < 6.0 * v.std() * 0.999
    err = (q.dequantized - v)[inside].abs()
    # A value and its bin's mean share the bin: at most one bin width apart (+ float16 table rounding).
    assert err.max() <= scale * (1 + 1e-2)
    assert err.mean() < scale / 2


def test_reconstruction_is_unbiased_per_bin():
    v = _heavy_tailed(50000, seed=1)
    q = quantize(v, torch.zeros_like(v, dtype=torch.long), 1, bins=64, range_sigmas=4.0)
    for b in q.codes.unique().tolist():
        in_bin = q.codes == b
        mean_true, mean_rec = v[in_bin].mean(), q.dequantized[in_bin].mean()
        # Table entries are float16 in bin units: exact to ~1e-3 of a bin for interior bins.
        assert abs(mean_rec - mean_true) <= q.scale[0] * 2e-3 + abs(mean_true) * 1e-3, b


def test_clamped_outliers_keep_their_mean():
    v = torch.cat([torch.randn(10000) * 1e-3, torch.tensor([1.0, 1.2])])
    q = quantize(v, torch.zeros_like(v, dtype=torch.long), 1, bins=256, range_sigmas=6.0)
    top = q.codes == q.codes.max()
    assert torch.allclose(q.dequantized[top].mean(), v[top].mean(), rtol=1e-3)


def test_constant_segment_is_exact():
    v = torch.full((100,), 3.5e-4)
    q = quantize(v, torch.zeros(100, dtype=torch.long), 1, bins=256, range_sigmas=6.0)
    torch.testing.assert_close(q.dequantized, v, rtol=1e-3, atol=0)


def test_segments_are_quantized_independently():
    a, b = _heavy_tailed(3000, 2), _heavy_tailed(5000, 3) * 100
    joint = quantize(torch.cat([a, b]), torch.cat([torch.zeros(3000), torch.ones(5000)]).long(), 2, 256, 6.0)
    qa = quantize(a, torch.zeros(3000, dtype=torch.long), 1, 256, 6.0)
    qb = quantize(b, torch.zeros(5000, dtype=torch.long), 1, 256, 6.0)
    torch.testing.assert_close(joint.dequantized, torch.cat([qa.dequantized, qb.dequantized]))
    assert torch.equal(joint.codes, torch.cat([qa.codes, qb.codes]))


def test_dequantize_matches_sender_view():
    v = _heavy_tailed(4000, 4)
    seg = (torch.arange(4000) % 3).long()
    q = quantize(v, seg, 3, 256, 6.0)
    assert torch.equal(dequantize(q.codes, seg, q.lut, q.shift, q.scale), q.dequantized)
    assert q.codes.dtype == torch.uint8 and q.lut.dtype == torch.float16 and q.lut.shape == (3, 256)


@pytest.mark.parametrize("bins", [2, 3, 4, 5, 16])
def test_few_bins_codes_stay_below_bins_and_decode_to_the_sender_view(bins):
    v = _heavy_tailed(6000, 5)
    seg = (torch.arange(6000) % 2).long()
    q = quantize(v, seg, 2, bins, 3.0)
    assert int(q.codes.max()) < bins and q.lut.shape == (2, bins)
    assert torch.equal(dequantize(q.codes, seg, q.lut, q.shift, q.scale), q.dequantized)
    # Fewer bins, coarser values, but every bin still reconstructs its own mean.
    for b in q.codes[seg == 0].unique().tolist():
        in_bin = (q.codes == b) & (seg == 0)
        assert abs(q.dequantized[in_bin].mean() - v[in_bin].mean()) <= q.scale[0] * 2e-3 + v[in_bin].mean().abs() * 1e-3


# ---------------------------------------------------------------- sign


def test_sign_is_the_sign_times_mean_magnitude_per_segment():
    a, b = _heavy_tailed(3000, 6), _heavy_tailed(5000, 7) * 100
    v = torch.cat([a, b, torch.zeros(3)])  # a third segment of zeros
    seg = torch.cat([torch.zeros(3000), torch.ones(5000), torch.full((3,), 2)]).long()
    q = quantize_sign(v, seg, 3)
    assert q.codes.dtype == torch.uint8 and torch.equal(q.codes, (v < 0).to(torch.uint8))
    torch.testing.assert_close(
        q.scale, torch.stack([a.abs().mean(), b.abs().mean(), torch.tensor(0.0)]), rtol=1e-5, atol=0
    )
    assert torch.equal(q.shift, torch.zeros(3))
    want = torch.where(v < 0, -q.scale[seg], q.scale[seg])
    assert torch.equal(q.dequantized, want)  # exactly +-scale: what the receiver decodes
    assert torch.equal(dequantize(q.codes, seg, sign_table(3), torch.zeros(3), q.scale), q.dequantized)


def test_sign_keeps_each_segments_mean_magnitude():
    v = _heavy_tailed(4000, 8)
    q = quantize_sign(v, torch.zeros(4000, dtype=torch.long), 1)
    torch.testing.assert_close(q.dequantized.abs().mean(), v.abs().mean(), rtol=1e-5, atol=0)
    assert (q.dequantized.sign() == v.sign()).all()  # no zeros in a continuous sample
