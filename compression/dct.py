"""Orthonormal DCT-II over stacks of chunks, by matrix multiply.

A stack of B chunks of shape (r, c) is transformed as ``D_r @ X @ D_c^T``: two large matmuls (one over
all B*r rows, one batched with the basis broadcast), so a whole model's chunks of one shape cost two
BLAS calls. Bases are cached per (size, dtype, device). The transform is orthonormal, so the inverse is
the transpose and Euclidean norms (and top-k energy) are preserved.
"""

from __future__ import annotations

import functools
import math

import torch

from gradwire import hardware


@functools.lru_cache(maxsize=64)
def dct_basis(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The (n, n) orthonormal DCT-II matrix D with ``y = D @ x``: D[u, i] = a_u cos(pi (2i + 1) u / 2n)."""
    i = torch.arange(n, dtype=torch.float64)
    u = torch.arange(n, dtype=torch.float64)[:, None]
    basis = torch.cos(math.pi * (2 * i + 1) * u / (2 * n)) * math.sqrt(2.0 / n)
    basis[0] /= math.sqrt(2.0)
    return basis.to(dtype=dtype, device=device)


def _bases(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(dct_basis(n, x.dtype, x.device) for n in x.shape[1:])


def dct_chunks(x: torch.Tensor) -> torch.Tensor:
    """DCT-II of every chunk: x is (B, n) for 1-D chunks or (B, r, c) for 2-D chunks, in x's dtype."""
    if x.dim() == 2:
        (d,) = _bases(x)
        return x @ d.T  # (B, n)
    d_r, d_c = _bases(x)
    b, r, c = x.shape
    y = (x.reshape(b * r, c) @ d_c.T).view(b, r, c)  # transform along columns of every row at once
    return torch.bmm(d_r.expand(b, r, r), y)  # transform along rows (bmm reads the broadcast basis in place)


def idct_chunks(y: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Inverse of ``dct_chunks`` (the transpose, since the bases are orthonormal), times ``scale``.

    The scale rides on a (c, c) basis instead of costing a pass over the whole stack.
    """
    if y.dim() == 2:
        (d,) = _bases(y)
        return y @ (d * scale if scale != 1.0 else d)
    d_r, d_c = _bases(y)
    b, r, c = y.shape
    x = (y.reshape(b * r, c) @ (d_c * scale if scale != 1.0 else d_c)).view(b, r, c)
    return torch.bmm(d_r.T.expand(b, r, r), x)


def fast_transform_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype a sender's forward transform runs fastest in without losing what the codec keeps.

    bfloat16 on CPUs that multiply it natively (AVX512-BF16 or AMX: 3-6x the float32 matmul rate, measured
    on gpt-10m's chunk stacks); float32 elsewhere, GPUs included (their float32 transform is already a small
    part of a step). A bfloat16 transform moves each coefficient by ~0.4% of its size (8-bit mantissas,
    float32 accumulation): far under the 8-bit quantizer's step, and only the sender's choice - receivers
    decode the same payload bytes either way, so replicas stay bit-identical. A gradient-mode run's sign steps
    still carry such differences into another trajectory (in ``benchmarks.quality``, which pins float32 with
    ``WorkerEngine(transform_dtype=...)``, six seeds ended 0.30 points higher on average in bfloat16, within
    their scatter: docs/benchmarks.md).
    """
    device = torch.device(device)
    if device.type == "cpu" and hardware.cpu_multiplies_bf16():
        return torch.bfloat16
    return torch.float32


def dct_flops(chunk_shape: tuple[int, ...], num_chunks: int) -> int:
    """Multiply-add FLOPs of ``dct_chunks`` on a stack (2 per multiply-add)."""
    if len(chunk_shape) == 1:
        (n,) = chunk_shape
        return 2 * num_chunks * n * n
    r, c = chunk_shape
    return 2 * num_chunks * r * c * (r + c)
