"""Low-rank factors of a matrix: the rank-k approximation ``A @ B`` in int8 codes with float32 scales.

A pseudo-gradient after tens of inner steps is close to low-rank: each matrix's best rank 4 holds about 90%
of its energy where DCT top-k of the same bytes holds 61-78% (gpt-5m after 30 AdamW steps). So a matrix
can travel as its truncated SVD, ``A = U_k sqrt(S_k)`` and ``B = sqrt(S_k) V_k^T``, each factor rounded to
int8 with one float32 scale per rank-one term (A's columns, B's rows). Large matrices take a randomized
SVD instead (``factorize``): the receiver cannot tell, it decodes whatever factors arrive.

The decoded matrix is computed in float64 from the codes and scales and rounded once to float32, so a CPU
and a GPU receiver get the same bits (but where a float64 rounding error lands on a float32 rounding
boundary): every term ``code * scale`` is exact in float64, and so is every product of two.

Pure tensor code, no payload framing: ``codec`` places the codes and scales in a ``CompressedTensor``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch

CODE_LIMIT = 127  # codes are symmetric: -128 is never sent


@dataclasses.dataclass(frozen=True)
class Factors:
    """A matrix's rank-k factors as codes and scales: ``A = a * a_scale`` (columnwise), ``B = b * b_scale``
    (rowwise)."""

    a: torch.Tensor  # (rows, k) int8
    a_scale: torch.Tensor  # (k,) float32
    b: torch.Tensor  # (k, cols) int8
    b_scale: torch.Tensor  # (k,) float32

    def to_bytes(self) -> tuple[bytes, bytes]:
        """(values, lut): the codes, A's then B's, row-major; the scales, A's then B's, float32."""
        codes = np.concatenate([self.a.cpu().numpy().reshape(-1), self.b.cpu().numpy().reshape(-1)])
        scales = np.concatenate([self.a_scale.cpu().numpy(), self.b_scale.cpu().numpy()]).astype("<f4")
        return codes.astype(np.int8).tobytes(), scales.tobytes()

    @classmethod
    def from_bytes(cls, values: bytes, lut: bytes, rows: int, cols: int, rank: int) -> Factors:
        """The inverse of ``to_bytes``, for fields the codec has checked (``GradientCodec.decode``: lengths,
        codes in [-127, 127], scales finite and >= 0)."""
        codes = np.frombuffer(values, np.int8)
        a = torch.from_numpy(codes[: rows * rank].reshape(rows, rank).copy())
        b = torch.from_numpy(codes[rows * rank :].reshape(rank, cols).copy())
        scales = torch.from_numpy(np.frombuffer(lut, "<f4").astype(np.float32))
        return cls(a, scales[:rank].clone(), b, scales[rank:].clone())

    def decode(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The matrix ``A @ B``, (rows, cols) float32, summed in float64 (see the module)."""
        device = self.a.device if device is None else device
        a = self.a.to(device, torch.float64) * self.a_scale.to(device, torch.float64)
        b = self.b.to(device, torch.float64) * self.b_scale.to(device, torch.float64)[:, None]
        return (a @ b).float()


# Matrices whose smaller side is at most this are factored by an exact SVD; larger ones by a randomized
# range finder, whose cost grows with the rank instead of the smaller side (4096 x 4096 at rank 78: 0.69 s
# on one CPU thread). The SVD trained better where both were measured: in
# benchmarks.quality (gpt-5m, fit ranks 4-9) the codec gap at 300 / 600 steps was 1.30 / 2.08 points by
# SVD, 1.29 / 2.34 by the range finder with 4 power iterations, 1.44 / 2.64 with 2 (docs/benchmarks.md),
# though it costs 7-10x the time (8192 x 384 at rank 9: 164 ms against 23 ms with 2 iterations).
EXACT_MAX_SIDE = 1024
OVERSAMPLE = 8  # extra directions the range finder keeps (at least the rank again), dropped after the small SVD
POWER_ITERATIONS = 4  # passes of (M M^T) that sharpen the range towards the top singular vectors

Factorization = Literal["auto", "svd", "randomized"]
FACTORIZATIONS: tuple[Factorization, ...] = ("auto", "svd", "randomized")


def factorize(m: torch.Tensor, rank: int, method: Factorization = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """A rank-``rank`` approximation of the matrix ``m`` as ``A`` (rows, rank) and ``B`` (rank, cols), the
    singular values split evenly between them. ``svd``: the best one, by a truncated SVD in float32.
    ``randomized``: Halko, Martinsson and Tropp's range finder with ``POWER_ITERATIONS`` power iterations
    and a basis of ``max(rank + OVERSAMPLE, 2 rank)`` directions, from a fixed seed (the same matrix gives
    the same factors).
    ``auto``: ``svd`` up to ``EXACT_MAX_SIDE`` on the smaller side, ``randomized`` past it."""
    if method not in FACTORIZATIONS:
        raise ValueError(f"factorization must be one of {', '.join(FACTORIZATIONS)}, got {method!r}")
    m = m.float()
    if method == "randomized" or (method == "auto" and min(m.shape) > EXACT_MAX_SIDE):
        u, s, vh = _randomized_svd(m, rank)
    else:
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
    root = s[:rank].sqrt()
    return u[:, :rank] * root, root[:, None] * vh[:rank]


def _randomized_svd(m: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top of ``m``'s SVD through an orthonormal basis of its range (``rank + OVERSAMPLE`` columns)."""
    width = min(max(rank + OVERSAMPLE, 2 * rank), *m.shape)
    generator = torch.Generator(device=m.device).manual_seed(0)
    q, _ = torch.linalg.qr(m @ torch.randn(m.shape[1], width, device=m.device, generator=generator))
    for _ in range(POWER_ITERATIONS):  # re-orthonormalised each pass, so small singular values survive
        q, _ = torch.linalg.qr(m.T @ q)
        q, _ = torch.linalg.qr(m @ q)
    u, s, vh = torch.linalg.svd(q.T @ m, full_matrices=False)  # (width, cols): small
    return q @ u, s, vh


def quantize(a: torch.Tensor, b: torch.Tensor) -> Factors:
    """``a`` (rows, k) and ``b`` (k, cols) rounded to int8 codes, one scale per rank-one term: the largest
    magnitude of A's column (B's row) maps to 127. A term that is all zeros gets scale 0 and codes 0."""
    a_scale = a.abs().amax(dim=0) / CODE_LIMIT
    b_scale = b.abs().amax(dim=1) / CODE_LIMIT
    a_codes = (a / a_scale.clamp_min(torch.finfo(torch.float32).tiny)).round().clamp(-CODE_LIMIT, CODE_LIMIT)
    b_codes = (b / b_scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).round().clamp(-CODE_LIMIT, CODE_LIMIT)
    return Factors(a_codes.to(torch.int8), a_scale.float(), b_codes.to(torch.int8), b_scale.float())


def compress(m: torch.Tensor, rank: int, method: Factorization = "auto") -> Factors:
    """The matrix ``m``'s rank-``rank`` factors, quantized."""
    return quantize(*factorize(m, rank, method))
