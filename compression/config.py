"""Codec settings: the one dataclass both sides of the wire agree on.

The sender compresses with these settings and writes them into every payload; the receiver derives the
same chunk plan from them and rejects a payload whose settings differ from its own.
"""

from __future__ import annotations

import dataclasses
import math

# Bump when the meaning of any payload field changes. Receivers reject versions they do not know.
FORMAT_VERSION = 1

# 12-bit indices address at most 4096 positions, so a chunk holds at most 64 x 64 elements.
MAX_CHUNK_NUMEL = 1 << 12


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How a gradient is compressed.

    Attributes:
        chunk: target chunk edge. Each dimension is cut into chunks of its largest divisor <= chunk.
        topk: coefficients kept per full ``chunk x chunk`` chunk. Smaller chunks keep proportionally fewer
            (at least one), so the density ``topk / chunk**2`` is the same for every tensor.
        use_dct: transform each chunk with an orthonormal DCT-II before top-k.
        bins: quantization bins for the kept values (2..256); 0 sends them as raw float32.
        range_sigmas: the quantizer covers ``mean +- range_sigmas * std`` of the kept values.
        min_sparse_numel: tensors with fewer elements are sent whole (dense) instead of sparsified.
    """

    chunk: int = 64
    topk: int = 32
    use_dct: bool = True
    bins: int = 256
    range_sigmas: float = 6.0
    min_sparse_numel: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.chunk or self.chunk * self.chunk > MAX_CHUNK_NUMEL:
            raise ValueError(f"chunk must be in [1, 64] so that indices fit 12 bits, got {self.chunk}")
        if not 1 <= self.topk <= self.chunk * self.chunk:
            raise ValueError(f"topk must be in [1, chunk*chunk={self.chunk * self.chunk}], got {self.topk}")
        if self.bins != 0 and not 2 <= self.bins <= 256:
            raise ValueError(f"bins must be 0 (no quantization) or in [2, 256], got {self.bins}")
        if not (math.isfinite(self.range_sigmas) and self.range_sigmas > 0):
            raise ValueError(f"range_sigmas must be a positive finite number, got {self.range_sigmas}")
        if self.min_sparse_numel < 0:
            raise ValueError(f"min_sparse_numel must be >= 0, got {self.min_sparse_numel}")

    @property
    def quantized(self) -> bool:
        return self.bins > 0

    @property
    def density(self) -> float:
        """Fraction of coefficients kept in a sparse tensor."""
        return self.topk / (self.chunk * self.chunk)
