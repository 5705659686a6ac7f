"""8-bit value quantization with a per-tensor lookup table, vectorized over many tensors at once.

Each tensor ("segment") gets a shift (the mean of its values) and a scale (bin width) so that the window
``mean +- range_sigmas * std`` spans ``bins`` bins; values outside clamp to the edge bins. The receiver
reconstructs each value as the *mean of the values that fell in its bin* (the lookup table), not the bin
centre, so the reconstruction is unbiased per bin and clamped outliers keep their average magnitude.
The table is stored in bin units as float16: ``value = shift + scale * lut[bin]``.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Quantized:
    codes: torch.Tensor  # (N,) uint8 bin ids
    lut: torch.Tensor  # (T, bins) float16, bin means in bin units
    shift: torch.Tensor  # (T,) float32
    scale: torch.Tensor  # (T,) float32
    dequantized: torch.Tensor  # (N,) float32, what the receiver will reconstruct


def quantize(values: torch.Tensor, segment: torch.Tensor, num_segments: int, bins: int, range_sigmas: float) -> Quantized:
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


def dequantize(codes: torch.Tensor, segment: torch.Tensor, lut: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Values (N,) float32 from bin ids (N,), their segments (N,) and per-segment tables (T, bins)."""
    seg = segment.long()
    bins = lut.shape[1]
    table = lut.float().reshape(-1)
    return shift[seg] + scale[seg] * table[seg * bins + codes.long()]
