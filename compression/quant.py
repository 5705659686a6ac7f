"""Value quantization per tensor, vectorized over many tensors ("segments") at once.

``quantize``: up to 256 bins with a per-tensor lookup table. Each tensor ("segment") gets a shift (the mean of
its values) and a scale (bin width) so that the window
``mean +- range_sigmas * std`` spans ``bins`` bins; values outside clamp to the edge bins. The receiver
reconstructs each value as the *mean of the values that fell in its bin* (the lookup table), not the bin
centre, so the reconstruction is unbiased per bin and clamped outliers keep their average magnitude.
The table is stored in bin units as float16: ``value = shift + scale * lut[bin]``.

``quantize_sign``: one bit per value, decoded as ``+-scale`` with scale the tensor's mean magnitude (as
DisTrO sends). That is the same decoder with shift 0 and the fixed two-entry table ``SIGN_TABLE``.
"""

from __future__ import annotations

import dataclasses

import torch

# Code 0 is a non-negative value, code 1 a negative one, in units of the tensor's scale.
SIGN_TABLE = (1.0, -1.0)


@dataclasses.dataclass
class Quantized:
    codes: torch.Tensor  # (N,) uint8 bin ids (sign: 1 = negative)
    lut: torch.Tensor  # (T, bins) float16, bin means in bin units (sign: SIGN_TABLE, never sent)
    shift: torch.Tensor  # (T,) float32
    scale: torch.Tensor  # (T,) float32
    dequantized: torch.Tensor  # (N,) float32, what the receiver will reconstruct


def quantize(
    values: torch.Tensor, segment: torch.Tensor, num_segments: int, bins: int, range_sigmas: float
) -> Quantized:
    """Quantize values (N,) float32, each belonging to ``segment`` (N,) in [0, T), to ``bins`` bins."""
    v = values.float()
    seg = segment.long()
    t = num_segments
    count = torch.zeros(t, device=v.device).index_add_(0, seg, torch.ones_like(v))
    shift = torch.zeros(t, device=v.device).index_add_(0, seg, v) / count.clamp_min(1)
    centered = v - shift[seg]
    var = torch.zeros(t, device=v.device).index_add_(0, seg, centered * centered) / (count - 1).clamp_min(1)
    std = var.sqrt()
    scale = 2 * range_sigmas * std / bins  # bin width
    # A constant segment has std 0: any positive scale puts it all in the middle bin, which the table
    # then reconstructs exactly.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    units = centered / scale[seg]  # position in bin units, 0 at the mean
    codes = (units + bins / 2).floor().clamp_(0, bins - 1).long()
    # Bin means, in bin units: the table that makes reconstruction unbiased per bin.
    key = seg * bins + codes
    sums = torch.zeros(t * bins, device=v.device).index_add_(0, key, units)
    hits = torch.zeros(t * bins, device=v.device).index_add_(0, key, torch.ones_like(units))
    centres = torch.arange(bins, device=v.device, dtype=torch.float32) + 0.5 - bins / 2
    lut = torch.where(hits > 0, sums / hits.clamp_min(1), centres.repeat(t))
    lut16 = lut.clamp(-65504, 65504).half().view(t, bins)
    dequantized = dequantize(codes, seg, lut16, shift, scale)
    return Quantized(codes.to(torch.uint8), lut16, shift, scale, dequantized)


def quantize_sign(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> Quantized:
    """One sign bit per value (N,), each belonging to ``segment`` (N,) in [0, T); scale = mean |v|."""
    v = values.float()
    seg = segment.long()
    t = num_segments
    count = torch.zeros(t, device=v.device).index_add_(0, seg, torch.ones_like(v))
    scale = torch.zeros(t, device=v.device).index_add_(0, seg, v.abs()) / count.clamp_min(1)  # (T,)
    codes = (v < 0).to(torch.uint8)  # zero counts as positive: it has no sign to spend a bit on
    lut = sign_table(t, v.device)
    shift = torch.zeros(t, device=v.device)
    return Quantized(codes, lut, shift, scale, dequantize(codes, seg, lut, shift, scale))


def sign_table(num_segments: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``SIGN_TABLE`` for every segment, (T, 2) float16: sign codes decode through ``dequantize`` too."""
    return torch.tensor(SIGN_TABLE, dtype=torch.float16, device=device).expand(num_segments, 2)


def dequantize(
    codes: torch.Tensor, segment: torch.Tensor, lut: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Values (N,) float32 from bin ids (N,), their segments (N,) and per-segment tables (T, bins)."""
    bins = lut.shape[1]
    return values_table(lut, shift, scale).reshape(-1)[segment.long() * bins + codes.long()]


def values_table(lut: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Every segment's decoded value of every bin, (T, bins) float32: ``shift + scale * lut``, rounded as
    computed value by value, so a lookup in it is what ``dequantize`` returns, bit for bit."""
    return shift[:, None] + scale[:, None] * lut.float()
