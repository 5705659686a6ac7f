"""Bit packing: 12-bit indices and 1- to 8-bit codes; exact round trips, the documented layouts, bad input."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradwire.compression.packing import (
    bits_nbytes,
    pack12,
    pack_bits,
    packed_nbytes,
    pad_bits,
    unpack12,
    unpack12_padded,
    unpack_bits,
)


@given(st.lists(st.integers(0, 4095), max_size=301))
def test_round_trip_any_length(values):
    idx = np.array(values, dtype=np.int64)
    packed = pack12(idx)
    assert len(packed) == packed_nbytes(len(values)) == 3 * ((len(values) + 1) // 2)
    np.testing.assert_array_equal(unpack12(packed, len(values)), idx)


def test_known_layout_little_endian_a_or_b_shifted_12():
    # (0xABC, 0x123) -> word 0x123ABC -> bytes BC 3A 12
    assert pack12(np.array([0xABC, 0x123])) == bytes([0xBC, 0x3A, 0x12])
    assert pack12(np.array([1, 2])) == bytes([0x01, 0x20, 0x00])
    assert pack12(np.array([4095, 4095])) == b"\xff\xff\xff"


def test_odd_count_is_padded_with_zero():
    packed = pack12(np.array([5, 6, 7]))
    assert len(packed) == 6
    np.testing.assert_array_equal(unpack12_padded(packed), [5, 6, 7, 0])


@pytest.mark.parametrize("bad", [[4096], [-1], [0, 70000]])
def test_out_of_range_rejected(bad):
    with pytest.raises(ValueError, match="4096"):
        pack12(np.array(bad))


def test_wrong_length_rejected():
    with pytest.raises(ValueError):
        unpack12(b"\x00\x00\x00\x00", 2)
    with pytest.raises(ValueError):
        unpack12_padded(b"\x00\x00")


# ---------------------------------------------------------------- 1- to 8-bit codes


def _reference_pack(codes: list[int], bits: int) -> bytes:
    """The documented layout the slow obvious way: code i occupies stream bits [i*bits, (i+1)*bits)."""
    stream = sum(c << (i * bits) for i, c in enumerate(codes))
    return stream.to_bytes((len(codes) * bits + 7) // 8, "little")


codes_and_bits = st.integers(1, 8).flatmap(
    lambda bits: st.tuples(st.just(bits), st.lists(st.integers(0, (1 << bits) - 1), max_size=301))
)


@given(codes_and_bits)
def test_bits_round_trip_any_width_and_length(case):
    bits, codes = case
    packed = pack_bits(np.array(codes, dtype=np.int64), bits)
    assert len(packed) == bits_nbytes(len(codes), bits) == -(-len(codes) * bits // 8)
    assert packed == _reference_pack(codes, bits)
    out = unpack_bits(packed, bits, len(codes))
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, codes)


@given(codes_and_bits)
def test_bits_pad_is_zero(case):
    bits, codes = case
    packed = pack_bits(np.array(codes, dtype=np.uint8), bits)
    used = len(codes) * bits % 8
    assert pad_bits(packed, bits, len(codes)) == 0
    if used:
        assert packed[-1] >> used == 0


def test_bits_known_layout_lsb_first():
    assert pack_bits(np.array([1, 2, 3, 0]), 2) == bytes([0b00111001])
    assert pack_bits(np.array([1, 2, 3]), 2) == bytes([0b00111001])  # zero pad in the high bits
    assert pack_bits(np.array([1, 0, 0, 0, 0, 0, 0, 0, 1]), 1) == bytes([0x01, 0x01])
    assert pack_bits(np.array([0, 1, 1]), 1) == bytes([0b110])
    assert pack_bits(np.array([0xA, 0x3, 0xF]), 4) == bytes([0x3A, 0x0F])
    # 3 bits straddle bytes: 5 | 6 << 3 | 7 << 6 = 0x1F5.
    assert pack_bits(np.array([5, 6, 7]), 3) == bytes([0xF5, 0x01])
    assert pack_bits(np.array([7, 200, 255], np.uint8), 8) == bytes([7, 200, 255])
    assert pack_bits(np.array([], np.uint8), 3) == b""


@pytest.mark.parametrize(("codes", "bits"), [([4], 2), ([-1], 3), ([2], 1), ([256], 8), ([0, 128], 7)])
def test_bits_out_of_range_rejected(codes, bits):
    with pytest.raises(ValueError, match="codes must be in"):
        pack_bits(np.array(codes), bits)


@pytest.mark.parametrize("bits", [0, 9, -1])
def test_bits_width_out_of_range_rejected(bits):
    with pytest.raises(ValueError, match="bits"):
        pack_bits(np.array([0]), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack_bits(b"\0", bits, 1)


def test_bits_wrong_length_or_nonzero_pad_rejected():
    with pytest.raises(ValueError, match="bytes"):
        unpack_bits(b"\0\0", 2, 4)  # 4 two-bit codes are one byte
    with pytest.raises(ValueError, match="bytes"):
        unpack_bits(b"", 1, 1)
    with pytest.raises(ValueError, match="bytes"):
        unpack_bits(b"\0\0", 8, 3)
    assert pad_bits(b"\x39", 2, 3) == 0b00
    assert pad_bits(b"\x79", 2, 3) == 0b01
    with pytest.raises(ValueError, match="zero"):
        unpack_bits(b"\x79", 2, 3)  # bit 6 lies past the third code
    np.testing.assert_array_equal(unpack_bits(b"\x79", 2, 4), [1, 2, 3, 1])
