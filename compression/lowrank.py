"""Low-rank factors of a matrix: the rank-k approximation ``A @ B`` in int8 or int4 codes with float32 scales.

A pseudo-gradient after tens of inner steps is close to low-rank: each matrix's best rank 4 holds about 90%
of its energy where DCT top-k of the same bytes holds 61-78% (gpt-5m after 30 AdamW steps). So a matrix
can travel as its truncated SVD, ``A = U_k sqrt(S_k)`` and ``B = sqrt(S_k) V_k^T``, each factor rounded to
int8 (or int4: codes in [-7, 7], two a byte) with one float32 scale per rank-one term (A's columns, B's
rows). Large matrices take a randomized SVD instead (``factorize``): the receiver cannot tell, it decodes
whatever factors arrive.

A sender with error feedback need not factor from scratch every round: its buffer's top subspace moves
little between rounds. ``refine`` carries each matrix's right subspace (``carried_width`` directions) from
round to round and sharpens it with one power iteration, PowerSGD's way, batched over every matrix of one
shape: three thin products, three thin QRs (batched Cholesky-QR off a CPU: ``cholesky_qr``) and the SVD of
a small (width, width) matrix each (on the host: ``_small_svd``), where a fresh factorization costs an SVD or
a range finder's nine passes. The first round (no subspace yet) is factored as before and seeds it
(``seed``). The subspace lives beside the error feedback (``feedback.ErrorFeedback.subspaces``) and travels
with it.

The decoded matrix is computed in float64 from the codes and scales and rounded once to float32, so a CPU
and a GPU receiver get the same bits (but where a float64 rounding error lands on a float32 rounding
boundary): every term ``code * scale`` is exact in float64, and so is every product of two.

Pure tensor code, no payload framing: ``codec`` places the codes and scales in a ``CompressedTensor``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch

from gradwire.compression.transfer import joined

CODE_LIMIT = 127  # codes are symmetric: -128 is never sent
INT4_LIMIT = 7  # int4 codes: [-7, 7], each stored as code + 8 in a nibble (0, which would be -8, is never sent)


def code_limit(bits: int) -> int:
    """The largest code magnitude of ``bits``-bit factor codes (8 or 4)."""
    if bits not in (8, 4):
        raise ValueError(f"factor codes are 8 or 4 bits, got {bits}")
    return CODE_LIMIT if bits == 8 else INT4_LIMIT


def pack_int4(codes: np.ndarray) -> bytes:
    """Codes in [-7, 7] two a byte, the first in the low nibble; an odd count leaves the last high nibble 0."""
    nibbles = (codes.astype(np.int16) + 8).astype(np.uint8)
    if len(nibbles) % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_int4(data: bytes, n: int) -> np.ndarray:
    """The inverse of ``pack_int4``: ``n`` codes, int8 (a nibble of 0 gives -8, which the codec refuses)."""
    raw = np.frombuffer(data, np.uint8)
    out = np.empty(2 * len(raw), np.int8)
    out[0::2], out[1::2] = (raw & 0x0F).astype(np.int8), (raw >> 4).astype(np.int8)
    return out[:n] - 8


@dataclasses.dataclass(frozen=True)
class Factors:
    """A matrix's rank-k factors as codes and scales: ``A = a * a_scale`` (columnwise), ``B = b * b_scale``
    (rowwise). ``quantize`` and ``decode`` also take a batch of matrices of one shape (a leading dimension
    on every field); ``unbind`` splits it."""

    a: torch.Tensor  # (rows, k) int8
    a_scale: torch.Tensor  # (k,) float32
    b: torch.Tensor  # (k, cols) int8
    b_scale: torch.Tensor  # (k,) float32

    @staticmethod
    def to_host(batches: Sequence[Factors]) -> list[Factors]:
        """Every batch of ``batches`` on the host in two reads, all the codes and then all the scales, instead
        of one a field a batch: on a GPU each read waits for the device, so one read a batch would leave it
        idle while the host packs that batch's codes, before the next batch's work is even launched."""
        fields = [field for f in batches for field in f.fields()]
        host = iter(joined(fields, lambda flat: flat.cpu()))  # a read a dtype: the codes, then the scales
        return [Factors(*(next(host) for _ in range(4))) for _ in batches]

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a, self.a_scale, self.b, self.b_scale

    def unbind(self) -> list[Factors]:
        """A batch's factors, one ``Factors`` per matrix."""
        return [Factors(*fields) for fields in zip(self.a, self.a_scale, self.b, self.b_scale)]

    def to_bytes(self, bits: int = 8) -> tuple[bytes, bytes]:
        """(values, lut): the codes, A's then B's, row-major, a byte each (``bits`` 8) or two a byte (4,
        ``pack_int4``); the scales, A's then B's, float32. Of factors on the host (``to_host``)."""
        codes = np.concatenate([self.a.numpy().reshape(-1), self.b.numpy().reshape(-1)])
        scales = np.concatenate([self.a_scale.numpy(), self.b_scale.numpy()]).astype("<f4")
        values = codes.astype(np.int8).tobytes() if bits == 8 else pack_int4(codes)
        return values, scales.tobytes()

    @classmethod
    def from_bytes(cls, values: bytes, lut: bytes, rows: int, cols: int, rank: int, bits: int = 8) -> Factors:
        """The inverse of ``to_bytes``, for fields the codec has checked (``GradientCodec.decode``: lengths,
        codes within ``code_limit(bits)``, scales finite and >= 0)."""
        n = (rows + cols) * rank
        codes = np.frombuffer(values, np.int8) if bits == 8 else unpack_int4(values, n)
        a = torch.from_numpy(codes[: rows * rank].reshape(rows, rank).copy())
        b = torch.from_numpy(codes[rows * rank :].reshape(rank, cols).copy())
        scales = torch.from_numpy(np.frombuffer(lut, "<f4").astype(np.float32))
        return cls(a, scales[:rank].clone(), b, scales[rank:].clone())

    def decode(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The matrix ``A @ B``, (rows, cols) float32, summed in float64 (see the module); (B, rows, cols)
        for a batch."""
        device = self.a.device if device is None else device
        a = self.a.to(device, torch.float64) * self.a_scale.to(device, torch.float64)[..., None, :]
        b = self.b.to(device, torch.float64) * self.b_scale.to(device, torch.float64)[..., :, None]
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
# Directions a carried subspace keeps beyond the rank it sends (at most the rank again): one power
# iteration a round then sharpens the top ``rank`` towards the buffer's as subspace iteration with a wider
# block does, and the directions just past them, which error feedback leaves in the buffer, are at hand.
CARRIED_EXTRA = 8

# How a sender factors each matrix. ``power``: a subspace carried in the error feedback and refined once a
# round (``refine``; ``seed`` where none is carried yet, and without error feedback ``auto``). The others
# factor from scratch every round (``factorize``).
Factorization = Literal["power", "auto", "svd", "randomized"]
FACTORIZATIONS: tuple[Factorization, ...] = ("power", "auto", "svd", "randomized")
FRESH: tuple[Factorization, ...] = ("auto", "svd", "randomized")


def factorize(m: torch.Tensor, rank: int, method: Factorization = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """A rank-``rank`` approximation of the matrix ``m`` as ``A`` (rows, rank) and ``B`` (rank, cols), the
    singular values split evenly between them. ``svd``: the best one, by a truncated SVD in float32.
    ``randomized``: Halko, Martinsson and Tropp's range finder with ``POWER_ITERATIONS`` power iterations
    and a basis of ``max(rank + OVERSAMPLE, 2 rank)`` directions, from a fixed seed (the same matrix gives
    the same factors).
    ``auto``: ``svd`` up to ``EXACT_MAX_SIDE`` on the smaller side, ``randomized`` past it."""
    u, s, vh = _top_svd(m.float(), rank, method)
    return _split(u[:, :rank], s[:rank], vh[:rank])


def _top_svd(m: torch.Tensor, rank: int, method: Factorization) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top of ``m``'s SVD, at least ``rank`` terms, as ``factorize``'s ``method`` finds it."""
    if method not in FRESH:
        raise ValueError(f"factorization must be one of {', '.join(FRESH)}, got {method!r}")
    if method == "randomized" or (method == "auto" and min(m.shape) > EXACT_MAX_SIDE):
        return _randomized_svd(m, rank)
    return torch.linalg.svd(m, full_matrices=False)


def _split(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = U sqrt(S)`` and ``B = sqrt(S) V^T``, for one matrix or a batch."""
    root = s.sqrt()
    return u * root[..., None, :], root[..., :, None] * vh


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


def carried_width(rank: int, rows: int, cols: int) -> int:
    """Directions of a matrix's carried subspace: ``CARRIED_EXTRA`` beyond the rank sent, at most the smaller
    side (and at most what the range finder that seeds it keeps)."""
    return min(rank + min(CARRIED_EXTRA, rank), rows, cols)


def seed(m: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A first round's factors of the matrix ``m``, as ``factorize(m, rank)`` finds them (the same bits),
    and the subspace they start: ``m``'s top ``carried_width`` right singular vectors, (cols, width)."""
    u, s, vh = _top_svd(m.float(), rank, "auto")
    a, b = _split(u[:, :rank], s[:rank], vh[:rank])
    return a, b, vh[: carried_width(rank, *m.shape)].T.contiguous()


# ``cholesky_qr`` blends a fixed basis into each matrix at this fraction of its Frobenius norm: directions the
# matrix lacks (all of a zero one's) are completed from it, as Householder QR completes them, and the Gram
# matrix's condition stays under 1e14, which float64 Cholesky factors. Ten times float32's own rounding of the
# matrix: a relative residual of ~5e-6 where Householder's is ~3e-7, far under int4 or int8 codes' error.
CHOLESKY_FILL = 1e-6

QR = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def cholesky_qr(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A thin QR of a batch of tall matrices ``y`` (B, n, w), n >= w: ``q`` (B, n, w) with orthonormal columns
    spanning each ``y`` (completed where ``y`` is rank-deficient, see ``CHOLESKY_FILL``) and ``r = q^T y``
    (B, w, w), float32. CholeskyQR2 in float64: ``y = q1 L^T`` from the Cholesky factor of ``y^T y``, then the
    same again on ``q1``, which restores the orthogonality the first pass loses (Fukaya et al., 2014).

    Three batched calls a pass (a product, a Cholesky, a triangular solve), where ``torch.linalg.qr`` on a GPU
    runs one cuSOLVER factorization and one Q reconstruction per matrix of the batch (pytorch#143281): a
    stack of 16 matrices makes 32 calls, each allocating its workspace. On a CPU LAPACK's Householder QR is
    exact and faster (gpt-80m's largest stack, 16 x 3072 x 37: 23 ms against 33), and ``refine`` keeps it
    there (``thin_qr``)."""
    x = y.double()
    n, w = x.shape[-2:]
    size = torch.linalg.matrix_norm(x, keepdim=True)  # (B, 1, 1)
    x = x + _fill(n, w, x.device) * (CHOLESKY_FILL * size + 1e-100)  # a zero matrix: the basis itself
    for _ in range(2):
        # x^T x = L L^T; positive definite for any finite y with the fill. ``cholesky_ex``: no read of its
        # status, which on a GPU would wait for the device twice a call.
        lower, _ = torch.linalg.cholesky_ex(x.mT @ x)
        x = torch.linalg.solve_triangular(lower.mT, x, upper=True, left=False)  # x L^-T
    q = x.float()
    return q, q.mT @ y.float()


@functools.lru_cache(maxsize=32)
def _fill(n: int, w: int, device: torch.device) -> torch.Tensor:
    """``cholesky_qr``'s fixed basis for (n, w) matrices: Gaussian columns of unit expected norm, float64, from a
    seed of the shape (the same matrix gives the same basis, on any run)."""
    generator = torch.Generator().manual_seed(n * 65537 + w)
    return (torch.randn(n, w, generator=generator, dtype=torch.float64) / math.sqrt(n)).to(device)


def thin_qr(device: torch.device) -> QR:
    """``refine``'s thin QR on ``device``: Householder (``torch.linalg.qr``) on a CPU, ``cholesky_qr`` elsewhere."""
    return torch.linalg.qr if device.type == "cpu" else cholesky_qr


def refine(
    m: torch.Tensor, q: torch.Tensor, rank: int, qr: QR | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors of a batch of matrices ``m`` (B, rows, cols) from their carried subspaces ``q``
    (B, cols, width), and the subspaces refined, (B, cols, width): one power iteration turns ``q`` towards
    each matrix's top right singular vectors, and the factors are read off the refined subspace (Rayleigh-Ritz:
    ``m ~ m q q^T``, its top ``rank`` terms), the subspace's columns left in order of the singular values
    found. Float32 on ``m``'s device; a zero matrix gives zero factors and keeps an orthonormal subspace.

    Three thin products: PowerSGD sends after two (``p p^T m``, ``p = orth(m q_old)``), which in
    benchmarks.quality (gpt-5m, ``--rank fit``, 300 steps) ended at 5.6360 where a fresh SVD every round ended
    at 5.6264; the third, from the refined side, at 5.6217 (600 steps: 5.5145 against 5.5063; a subspace
    three times the rank, 5.5160; docs/benchmarks.md).

    ``qr``: the thin QR the three orthonormalizations take (default ``thin_qr(m.device)``)."""
    m = m.float()
    qr = qr or thin_qr(m.device)
    p, _ = qr(m @ q)  # (B, rows, width): an orthonormal basis of m's range seen through q
    q, _ = qr(m.mT @ p)  # (B, cols, width): the subspace, one power iteration on
    p, r = qr(m @ q)  # m q = p r: (B, rows, width), (B, width, width)
    ur, s, vrh = _small_svd(r)  # (B, width, width): small
    u, vh = p @ ur, vrh @ q.mT  # m q q^T = u diag(s) vh: (B, rows, width), (B, width, cols)
    a, b = _split(u[..., :rank], s[..., :rank], vh[..., :rank, :])
    return a, b, vh.mT.contiguous()


def _small_svd(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.linalg.svd`` of a batch of small square matrices, taken on the host off a CPU and sent back: on
    a GPU the call waits for the device anyway (its convergence check reads the device's status), and past
    32 x 32 torch runs one cuSOLVER Jacobi SVD per matrix of the batch, where LAPACK takes microseconds."""
    if r.device.type == "cpu":
        return torch.linalg.svd(r)
    u, s, vh = torch.linalg.svd(r.cpu())
    return u.to(r.device), s.to(r.device), vh.to(r.device)


def quantize(a: torch.Tensor, b: torch.Tensor, bits: int = 8) -> Factors:
    """``a`` (rows, k) and ``b`` (k, cols) rounded to ``bits``-bit codes (int8 tensors either way), one scale
    per rank-one term: the largest magnitude of A's column (B's row) maps to 127 (int4: 7). A term that is all
    zeros gets scale 0 and codes 0. A batch (B, rows, k) and (B, k, cols) gives a batch of factors."""
    limit = code_limit(bits)
    a_scale = a.abs().amax(dim=-2) / limit
    b_scale = b.abs().amax(dim=-1) / limit
    tiny = torch.finfo(torch.float32).tiny
    a_codes = (a / a_scale.clamp_min(tiny)[..., None, :]).round().clamp(-limit, limit)
    b_codes = (b / b_scale.clamp_min(tiny)[..., :, None]).round().clamp(-limit, limit)
    return Factors(a_codes.to(torch.int8), a_scale.float(), b_codes.to(torch.int8), b_scale.float())


def compress(m: torch.Tensor, rank: int, method: Factorization = "auto") -> Factors:
    """The matrix ``m``'s rank-``rank`` factors, quantized."""
    return quantize(*factorize(m, rank, method))
