"""Bit packing of the payload: chunk-local indices (12-bit or Elias-Fano), and 1- to 8-bit value codes.

Indices, 12-bit: the pair (a, b) becomes the little-endian 24-bit word ``a | b << 12``; an odd count is
padded with a zero index.
Indices, Elias-Fano (``pack_ef``): each chunk's ``k`` indices, increasing, out of ``universe`` positions.
With ``low = floor(log2(universe / k))``, index i of a chunk splits into its ``low`` low bits and its high
part ``index >> low``. Two sections, each an LSB-first bit stream (stream bit j in byte ``j // 8`` at
position ``j % 8``) padded with zero bits to a whole byte:
  low bits   every index's ``low`` low bits, chunk by chunk, index by index, LSB first (the layout of
             ``pack_bits``, up to 12 bits); ``ceil(chunks * k * low / 8)`` bytes;
  upper bits each chunk's ``width = k + ((universe - 1) >> low) + 1`` bits, chunk after chunk, where index
             i sets bit ``(index_i >> low) + i`` of its chunk's: exactly k set; ``ceil(chunks * width / 8)``
             bytes.
About ``2 + low`` bits an index (668 bits for 90 of 4096, against 1080 in 12 bits): the information in which
k of the chunk's positions were kept is about 625 bits, and no code of such sets does better by more than
two bits an index.
Codes (``pack_bits``): an LSB-first bit stream, ``bits`` per code: bit j of code i is stream bit
``i * bits + j``, stored in byte ``(i * bits + j) // 8`` at position ``(i * bits + j) % 8``. The last
byte's unused high bits are zero. At 8 bits that is one plain byte per code.
Pure numpy, vectorized: payload bytes live on the host anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def ef_low_bits(k: int, universe: int) -> int:
    """Elias-Fano's low bits per index for ``k`` indices out of ``universe``: ``floor(log2(universe / k))``."""
    return max(0, (universe // k).bit_length() - 1)


def ef_chunk_bits(k: int, universe: int) -> int:
    """Bits of one chunk's ``k`` Elias-Fano coded indices out of ``universe``: low bits and upper bits."""
    low = ef_low_bits(k, universe)
    return k * low + _ef_width(k, universe, low)


def _ef_width(k: int, universe: int, low: int) -> int:
    return k + ((universe - 1) >> low) + 1


def ef_nbytes(chunks: int, k: int, universe: int) -> int:
    low = ef_low_bits(k, universe)
    return (chunks * k * low + 7) // 8 + (chunks * _ef_width(k, universe, low) + 7) // 8


def ef_topk_in_bits_of(k12: int, universe: int, value_bits: int) -> int:
    """The most indices out of ``universe`` that Elias-Fano codes, with a ``value_bits``-bit value each, in
    the bits that ``k12`` 12-bit indices and their values take: the top-k that costs a chunk what ``k12``
    did (90 of 4096 at 2-bit values: 143; 32 at 8 bits: 38; 512 at 4 bits: 1024)."""
    budget = k12 * (INDEX_BITS + value_bits)
    k = k12
    while k < universe and ef_chunk_bits(k + 1, universe) + (k + 1) * value_bits <= budget:
        k += 1
    return k


def pack_ef(indices: np.ndarray, universe: int) -> bytes:
    """Elias-Fano code ``indices`` (chunks, k), each row increasing within [0, ``universe``), into
    ``ef_nbytes(chunks, k, universe)`` bytes (the layout in the module's docstring)."""
    idx = np.asarray(indices)
    chunks, k = idx.shape
    if idx.size and (idx.min() < 0 or idx.max() >= universe):
        raise ValueError(f"indices must be in [0, {universe})")
    if k > 1 and not (np.diff(idx, axis=1) > 0).all():
        raise ValueError("each chunk's indices must increase")
    idx = idx.astype(np.int64, copy=False)
    low = ef_low_bits(k, universe)
    width = _ef_width(k, universe, low)
    upper = np.zeros(chunks * width, np.uint8)
    upper[((idx >> low) + np.arange(k) + np.arange(0, chunks * width, width)[:, None]).reshape(-1)] = 1
    return _pack_stream(idx & ((1 << low) - 1), low) + np.packbits(upper, bitorder="little").tobytes()


def ef_joinable(chunks: int, k: int, universe: int) -> bool:
    """Whether the Elias-Fano code of ``chunks`` chunks has no pad bits: its low bits and its upper bits each
    fill whole bytes. Then the codes of tensors that share ``k`` and ``universe`` join (``join_ef``) into the
    code of all their chunks, which one ``unpack_ef`` decodes."""
    low = ef_low_bits(k, universe)
    return chunks * k * low % 8 == 0 and chunks * _ef_width(k, universe, low) % 8 == 0


def join_ef(codes: Sequence[bytes], chunks: Sequence[int], k: int, universe: int) -> bytes:
    """One Elias-Fano code of every chunk of ``codes`` in order (each ``ef_joinable`` and of its
    ``ef_nbytes``): their low bits, then their upper bits."""
    low = ef_low_bits(k, universe)
    views = [memoryview(code) for code in codes]
    splits = [n * k * low // 8 for n in chunks]
    return b"".join([v[:s] for v, s in zip(views, splits)] + [v[s:] for v, s in zip(views, splits)])


def unpack_ef(data: bytes | np.ndarray, chunks: int, k: int, universe: int) -> np.ndarray:
    """Inverse of ``pack_ef``: (chunks, k) int32 (int64 past 2**31 bits of upper bits). ``ValueError`` for
    any bytes ``pack_ef`` would not write: the wrong length, nonzero pad bits, a chunk without exactly ``k``
    upper bits set, an index outside the universe, or indices that do not increase (a repeat)."""
    raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
    want = ef_nbytes(chunks, k, universe)
    if raw.size != want:
        raise ValueError(f"{chunks} chunks of {k} Elias-Fano indices take {want} bytes, got {raw.size}")
    low = ef_low_bits(k, universe)
    width, split = _ef_width(k, universe, low), (chunks * k * low + 7) // 8
    if pad_bits(raw[:split], low, chunks * k):
        raise ValueError("the unused high bits of the last low-bits byte must be zero")
    lows = _unpack_stream(raw[:split], low, chunks * k)
    bits = np.unpackbits(raw[split:], bitorder="little")
    if bits[chunks * width :].any():
        raise ValueError("the unused high bits of the last byte must be zero")
    upper = bits[: chunks * width].view(bool)
    # int32 where the stream's positions fit: half the bytes of int64 to move through every step after.
    dtype = np.int32 if chunks * width < 1 << 31 else np.int64
    pos = np.flatnonzero(upper).astype(dtype, copy=False)
    start = np.arange(0, chunks * width, width, dtype=dtype)
    # Every chunk sets exactly k bits when there are chunks x k in all and each chunk's k (the sorted
    # positions taken k at a time) lie within its own width: then no chunk can hold more than its k.
    if pos.size != chunks * k or (k and ((pos[::k] < start).any() or (pos[k - 1 :: k] >= start + width).any())):
        counts = np.count_nonzero(upper.reshape(chunks, width), axis=1)
        wrong = int(np.flatnonzero(counts != k)[0])
        raise ValueError(f"chunk {wrong} sets {int(counts[wrong])} upper bits, not {k}")
    # The i-th set bit of chunk c is index i's, at (index_i >> low) + i of c's width.
    high = pos.reshape(chunks, k)
    high -= start[:, None] + np.arange(k, dtype=dtype)
    idx = (high << low) | lows.reshape(chunks, k)
    if idx.size and idx.max() >= universe:
        raise ValueError(f"index {int(idx.max())} is outside a chunk of {universe} positions")
    if k > 1 and not (np.diff(idx, axis=1) > 0).all():
        raise ValueError("each chunk's indices must increase (an index repeats)")
    return idx


def bits_nbytes(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits each: ``ceil(count * bits / 8)``."""
    return (count * bits + 7) // 8


def pack_bits(codes: np.ndarray, bits: int) -> bytes:
    """Pack a 1-D array of ints in [0, 2**bits) into ``bits_nbytes(len, bits)`` bytes, LSB first."""
    _check_bits(bits)
    c = np.asarray(codes).reshape(-1)
    if c.dtype != np.uint8 or bits < 8:  # a uint8 array cannot exceed 8 bits
        if c.size and (c.min() < 0 or c.max() >= 1 << bits):
            raise ValueError(f"codes must be in [0, {1 << bits}) to pack in {bits} bits")
        c = c.astype(np.uint8)
    if bits == 8:
        return c.tobytes()
    return _pack_stream(c, bits)


def unpack_bits(data: bytes | np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of ``pack_bits``: ``count`` codes as uint8. Rejects a wrong length or nonzero pad bits."""
    _check_bits(bits)
    raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
    if raw.size != bits_nbytes(count, bits):
        raise ValueError(f"{count} codes of {bits} bits pack into {bits_nbytes(count, bits)} bytes, got {raw.size}")
    if bits == 8:
        return raw
    if pad_bits(raw, bits, count):
        raise ValueError("the unused high bits of the last byte must be zero")
    return _unpack_stream(raw, bits, count)


# For widths that divide a byte: the values in each byte value, LSB first, (256, 8 // width) uint8.
_BYTE_VALUES = {
    w: ((np.arange(256, dtype=np.uint8)[:, None] >> np.arange(0, 8, w, dtype=np.uint8)) & ((1 << w) - 1))
    for w in (1, 2, 4, 8)
}


def _group_slots(width: int) -> list[tuple[int, int, int]]:
    """Eight ``width``-bit values fill ``width`` bytes exactly: for each of the eight, its first byte in the
    group, its last, and its shift within the first."""
    return [(j * width >> 3, (j * width + width - 1) >> 3, j * width & 7) for j in range(8)]


def _pack_stream(values: np.ndarray, width: int) -> bytes:
    """``width``-bit values (0..16 bits) as one LSB-first bit stream, padded with zero bits to a byte: bit j
    of value i is stream bit ``i * width + j``. Works on groups of eight values, which fill ``width`` bytes:
    one vectorized pass per value slot and byte, not per bit."""
    if width == 0:
        return b""
    n = values.size
    nbytes = (n * width + 7) // 8
    if 8 % width == 0:  # whole values per byte: shift them into place
        per = 8 // width
        v = np.zeros(-(-n // per) * per, np.uint8)
        v[:n] = values.reshape(-1)
        v = v.reshape(-1, per)
        out = v[:, 0].copy()
        for j in range(1, per):
            out |= v[:, j] << (j * width)
        return out.tobytes()
    wide = np.uint16 if width <= 9 else np.uint32  # a value and its shift within its first byte
    v = np.zeros(-(-n // 8) * 8, wide)
    v[:n] = values.reshape(-1)
    v = v.reshape(-1, 8)
    out = np.zeros((v.shape[0], width), np.uint8)
    for j, (first, last, shift) in enumerate(_group_slots(width)):
        x = v[:, j] << shift
        for b in range(first, last + 1):
            out[:, b] |= (x >> (8 * (b - first))).astype(np.uint8)
    return out.reshape(-1)[:nbytes].tobytes()


def _unpack_stream(raw: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of ``_pack_stream``: ``count`` values, uint8 up to 8 bits, else uint16 (pad bits unchecked)."""
    if width == 0:
        return np.zeros(count, np.uint8)
    nbytes = (count * width + 7) // 8
    if 8 % width == 0:  # whole values per byte: each byte's values from a table
        return np.take(_BYTE_VALUES[width], raw[:nbytes], axis=0).reshape(-1)[:count]
    groups = -(-count // 8)
    g = np.zeros(groups * width, np.uint8)
    g[:nbytes] = raw[:nbytes]
    g = g.reshape(groups, width)
    out = np.empty((groups, 8), np.uint8 if width <= 8 else np.uint16)
    wide = np.uint16 if width <= 9 else np.uint32
    mask = (1 << width) - 1
    for j, (first, last, shift) in enumerate(_group_slots(width)):
        x = g[:, first].astype(wide)
        for b in range(first + 1, last + 1):
            x |= g[:, b].astype(wide) << (8 * (b - first))
        out[:, j] = (x >> shift) & mask
    return out.reshape(-1)[:count]


def pad_bits(data: bytes | np.ndarray, bits: int, count: int) -> int:
    """The unused high bits of the last byte of ``count`` packed codes, shifted down (0 when valid)."""
    used = count * bits % 8
    if used == 0 or len(data) == 0:
        return 0
    return int(data[-1]) >> used


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
