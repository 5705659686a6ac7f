"""12-bit index packing: two chunk-local indices (< 4096) in three bytes.

Layout: the pair (a, b) becomes the little-endian 24-bit word ``a | b << 12``; an odd count is padded
with a zero index. Pure numpy, vectorized: payload bytes live on the host anyway.
"""

from __future__ import annotations

import numpy as np

INDEX_BITS = 12
INDEX_LIMIT = 1 << INDEX_BITS


def packed_nbytes(count: int) -> int:
    return 3 * ((count + 1) // 2)


def pack12(indices: np.ndarray) -> bytes:
    """Pack a 1-D array of ints in [0, 4096) into ``packed_nbytes(len)`` bytes."""
    idx = np.asarray(indices).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= INDEX_LIMIT):
        raise ValueError("indices must be in [0, 4096) to pack in 12 bits")
    idx = idx.astype(np.uint32, copy=False)
    if idx.size % 2:
        idx = np.concatenate([idx, np.zeros(1, np.uint32)])
    pairs = idx.reshape(-1, 2)
    word = pairs[:, 0] | (pairs[:, 1] << INDEX_BITS)  # (n/2,) 24-bit words
    out = np.empty((word.size, 3), np.uint8)
    out[:, 0] = word & 0xFF
    out[:, 1] = (word >> 8) & 0xFF
    out[:, 2] = word >> 16
    return out.tobytes()


def unpack12_padded(data: bytes | np.ndarray) -> np.ndarray:
    """All indices in ``data`` including a trailing pad; length is 2 * len(data) / 3."""
    raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
    if raw.size % 3:
        raise ValueError(f"packed index bytes must be a multiple of 3, got {raw.size}")
    b = raw.reshape(-1, 3).astype(np.int32)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    out = np.empty((word.size, 2), np.int32)
    out[:, 0] = word & (INDEX_LIMIT - 1)
    out[:, 1] = word >> INDEX_BITS
    return out.reshape(-1)


def unpack12(data: bytes | np.ndarray, count: int) -> np.ndarray:
    """Inverse of ``pack12``: the first ``count`` indices as int32."""
    if len(data) != packed_nbytes(count):
        raise ValueError(f"{count} indices pack into {packed_nbytes(count)} bytes, got {len(data)}")
    return unpack12_padded(data)[:count]
