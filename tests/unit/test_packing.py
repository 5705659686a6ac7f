"""12-bit index packing: exact round trips for any length, the documented byte layout, bad input."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradwire.compression.packing import pack12, packed_nbytes, unpack12, unpack12_padded


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
