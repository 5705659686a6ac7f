"""Codec settings: the one dataclass both sides of the wire agree on.

The sender compresses with these settings and writes them into every payload; the receiver derives the
same chunk plan from them and rejects a payload whose settings differ from its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

# Bump when the meaning of any payload field changes. Receivers reject versions they do not know.
# 2: LUT codes bit-packed at ceil(log2(bins)) bits (was one byte each); SIGN values; settings.values.
FORMAT_VERSION = 2

# 12-bit indices address at most 4096 positions, so a chunk holds at most 64 x 64 elements.
MAX_CHUNK_NUMEL = 1 << 12

# Factors of a larger rank are no longer a compression of any matrix a model of this project has.
MAX_RANK = 4096

ValueCoding = Literal["lut", "sign"]
VALUE_CODINGS: tuple[ValueCoding, ...] = ("lut", "sign")
IndexCoding = Literal["packed12", "elias-fano"]
INDEX_CODINGS: tuple[IndexCoding, ...] = ("packed12", "elias-fano")


# The quantizer's range in standard deviations is at most this: wider, nearly every value falls in one bin, and
# near float32's largest the bin width overflows (an order with such a codec fed NaN into error feedback).
MAX_RANGE_SIGMAS = 1000.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How a gradient is compressed.

    Attributes:
        chunk: target chunk edge. Each dimension is cut into chunks of its largest divisor <= chunk.
        topk: coefficients kept per full ``chunk x chunk`` chunk. Smaller chunks keep proportionally fewer
            (at least one), so the density ``topk / chunk**2`` is the same for every tensor.
        use_dct: transform each chunk with an orthonormal DCT-II before top-k.
        values: how kept values are coded. ``"lut"``: quantized into ``bins`` bins, each code packed in
            ``ceil(log2(bins))`` bits and decoded through a per-tensor table of bin means. ``"sign"``: one
            bit per value (its sign) and one scale per tensor (the mean magnitude of its kept values), as
            DisTrO sends; ``bins`` plays no part then. Either way a tensor whose coded form would not be
            smaller than raw float32 travels raw.
        bins: quantization bins for ``values="lut"`` (2..256); 0 sends the values as raw float32.
        range_sigmas: the quantizer covers ``mean +- range_sigmas * std`` of the kept values.
        min_sparse_numel: tensors with fewer elements are sent whole (dense) instead of sparsified.
        indices: how each chunk's kept indices are coded. ``"packed12"``: 12 bits each. ``"elias-fano"``:
            the chunk's indices in increasing order, Elias-Fano coded in about ``2 + log2(chunk area / k)``
            bits each (668 bits for 90 of 4096, 38% less): more values in the same bytes.
        rank: 0, or R > 0: every matrix (the tensor's ``matrix_view``) of at least ``min_sparse_numel``
            elements whose smaller side exceeds R travels as rank-R factors ``A @ B`` in int8 with float32
            scales (``lowrank``) instead of DCT top-k, and every vector dense (its values coded as any dense
            tensor's: a few bytes against the factors); other matrices as with 0.
        rank_fits_topk: each matrix gets the largest rank whose factors fit the bytes its top-k would cost
            (``plan.fitted_rank``; at most ``rank`` if that is > 0), vectors dense as with a rank; a matrix
            whose top-k bytes buy no rank-one term, or all of its rank, keeps the top-k. The same bytes as
            the top-k at any model width, where a fixed rank's grow with the matrices' sides instead.
        factor_bits: bits of a factor's codes, 8 (int8) or 4 (int4, two a byte): a rank fitted to a top-k's
            bytes is about twice as large in int4.
    """

    chunk: int = 64
    topk: int = 32
    use_dct: bool = True
    values: ValueCoding = "lut"
    bins: int = 256
    range_sigmas: float = 6.0
    min_sparse_numel: int = 256
    indices: IndexCoding = "packed12"
    rank: int = 0
    rank_fits_topk: bool = False
    factor_bits: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.chunk or self.chunk * self.chunk > MAX_CHUNK_NUMEL:
            raise ValueError(f"chunk must be in [1, 64] so that indices fit 12 bits, got {self.chunk}")
        if not 1 <= self.topk <= self.chunk * self.chunk:
            raise ValueError(f"topk must be in [1, chunk*chunk={self.chunk * self.chunk}], got {self.topk}")
        if self.values not in VALUE_CODINGS:
            raise ValueError(f"values must be one of {', '.join(map(repr, VALUE_CODINGS))}, got {self.values!r}")
        if self.bins != 0 and not 2 <= self.bins <= 256:
            raise ValueError(f"bins must be 0 (no quantization) or in [2, 256], got {self.bins}")
        if not (math.isfinite(self.range_sigmas) and 0 < self.range_sigmas <= MAX_RANGE_SIGMAS):
            raise ValueError(f"range_sigmas must be in (0, {MAX_RANGE_SIGMAS:g}], got {self.range_sigmas}")
        if self.indices not in INDEX_CODINGS:
            raise ValueError(f"indices must be one of {', '.join(map(repr, INDEX_CODINGS))}, got {self.indices!r}")
        if not 0 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank must be in [0, {MAX_RANK}] (0: no low-rank factors), got {self.rank}")
        if self.factor_bits not in (8, 4):
            raise ValueError(f"factor_bits must be 8 or 4, got {self.factor_bits}")
        if self.min_sparse_numel < 0:
            raise ValueError(f"min_sparse_numel must be >= 0, got {self.min_sparse_numel}")

    @property
    def quantized(self) -> bool:
        """Values travel coded (sign bits or LUT codes) where that is smaller than raw float32."""
        return self.values == "sign" or self.bins > 0

    @property
    def density(self) -> float:
        """Fraction of coefficients kept in a sparse tensor."""
        return self.topk / (self.chunk * self.chunk)
