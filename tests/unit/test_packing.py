"""Bit packing: 12-bit and Elias-Fano indices, 1- to 8-bit codes; exact round trips, the documented layouts,
bad input."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradwire.compression.packing import (
    _pack_stream,
    _unpack_stream,
    bits_nbytes,
    ef_chunk_bits,
    ef_joinable,
    ef_low_bits,
    ef_nbytes,
    ef_topk_in_bits_of,
    join_ef,
    pack12,
    pack_bits,
    pack_ef,
    packed_nbytes,
    pad_bits,
    unpack12,
    unpack12_padded,
    unpack_bits,
    unpack_ef,
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


@given(
    st.integers(1, 16).flatmap(
        lambda bits: st.tuples(st.just(bits), st.lists(st.integers(0, (1 << bits) - 1), max_size=67))
    )
)
def test_bit_streams_of_any_width_to_16_match_the_layout(case):
    """The stream under both codes and Elias-Fano's low bits, which take up to 12: grouped eight values at
    a time, table-decoded for widths that divide a byte."""
    bits, values = case
    packed = _pack_stream(np.array(values, dtype=np.int64), bits)
    assert packed == _reference_pack(values, bits)
    out = _unpack_stream(np.frombuffer(packed, np.uint8), bits, len(values))
    assert out.dtype == (np.uint8 if bits <= 8 else np.uint16)
    np.testing.assert_array_equal(out, values)


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


# ------------------------------------------------------------------------------------------- Elias-Fano


@st.composite
def index_sets(draw):
    """(chunks, k) increasing indices out of a universe, as a chunk group's top-k leaves them."""
    universe = draw(st.integers(1, 4096))
    k = draw(st.integers(1, min(universe, 300)))
    chunks = draw(st.integers(0, 6))
    rows = [sorted(draw(st.permutations(range(universe)))[:k]) if universe <= 300 else None for _ in range(chunks)]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    idx = np.array(
        [r if r is not None else np.sort(rng.choice(universe, k, replace=False)) for r in rows], dtype=np.int64
    ).reshape(chunks, k)
    return idx, universe


@given(index_sets())
def test_elias_fano_round_trips_any_set_in_its_documented_size(case):
    idx, universe = case
    chunks, k = idx.shape
    packed = pack_ef(idx, universe)
    assert len(packed) == ef_nbytes(chunks, k, universe) <= (chunks * ef_chunk_bits(k, universe) + 7) // 8 + 1
    np.testing.assert_array_equal(unpack_ef(packed, chunks, k, universe), idx)


@given(st.integers(1, 4096), st.data())
def test_joined_elias_fano_codes_are_the_code_of_all_their_chunks(universe, data):
    """Codes without pad bits (chunk counts a multiple of 8 always are) join into the very bytes ``pack_ef``
    writes for their chunks stacked, which one ``unpack_ef`` decodes."""
    k = data.draw(st.integers(1, min(universe, 64)))
    counts = data.draw(st.lists(st.integers(0, 3).map(lambda n: 8 * n), min_size=1, max_size=4))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    members = [
        np.sort(np.array([rng.choice(universe, k, replace=False) for _ in range(n)]).reshape(n, k)) for n in counts
    ]
    assert all(ef_joinable(n, k, universe) for n in counts)
    joined = join_ef([pack_ef(m, universe) for m in members], counts, k, universe)
    stacked = np.concatenate(members)
    assert joined == pack_ef(stacked, universe)
    np.testing.assert_array_equal(unpack_ef(joined, sum(counts), k, universe), stacked)


def test_a_code_with_pad_bits_is_not_joinable():
    assert not ef_joinable(1, 2, 8)  # 2 low bits each: 4 bits of low bits
    assert not ef_joinable(3, 36, 4096)  # 6 low bits each: 648 bits, but 300 upper bits
    assert ef_joinable(4, 36, 4096) and ef_joinable(0, 36, 4096)


def test_elias_fano_costs_about_two_bits_over_the_low_bits_an_index():
    assert (ef_low_bits(90, 4096), ef_chunk_bits(90, 4096)) == (5, 90 * 5 + 90 + 128)  # 668 bits, 12-bit: 1080
    assert ef_chunk_bits(4096, 4096) == 2 * 4096  # every position: one upper bit and one gap bit each


def test_elias_fano_known_layout():
    # 2 of 8: low = floor(log2(4)) = 2 bits; upper width 2 + (7 >> 2) + 1 = 4 bits. Indices 1 = 0b0_01 and
    # 6 = 0b1_10. Low bits, LSB first: 1 0 | 0 1 -> 0x09. Upper bits: index 0 sets bit (0 >> 2) + 0 = 0,
    # index 1 sets (6 >> 2) + 1 = 2: 1 0 1 0 -> 0x05.
    assert ef_nbytes(1, 2, 8) == 2
    assert pack_ef(np.array([[1, 6]]), 8) == bytes([0x09, 0x05])
    np.testing.assert_array_equal(unpack_ef(bytes([0x09, 0x05]), 1, 2, 8), [[1, 6]])


@pytest.mark.parametrize(
    "data, match",
    [
        (bytes([0x09, 0x05, 0]), "take 2 bytes"),  # the wrong length
        (bytes([0x09, 0b0001]), "sets 1 upper bits, not 2"),  # an upper bit missing
        (bytes([0x09, 0b0111]), "sets 3 upper bits, not 2"),  # one too many
        (bytes([0x05, 0b0011]), "must increase"),  # 1 and 1: low bits 01 01, upper bits 0 + 0 and 0 + 1
        (bytes([0x09, 0b1_0101]), "must be zero"),  # a pad bit after the upper bits
        (bytes([0b1_1001, 0x05]), "must be zero"),  # a pad bit after the low bits
    ],
)
def test_elias_fano_streams_it_would_not_write_are_refused(data, match):
    with pytest.raises(ValueError, match=match):
        unpack_ef(data, 1, 2, 8)


def test_elias_fano_refuses_an_index_past_the_universe_and_writes_none():
    # 2 of 6: low 1 bit, upper width 2 + (5 >> 1) + 1 = 5 bits. 0 and 5: low bits 0 1, upper bits 0 and 2 + 1.
    assert pack_ef(np.array([[0, 5]]), 6) == bytes([0b10, 0b0_1001])
    with pytest.raises(ValueError, match="outside a chunk of 6"):  # 0 and 7: high 3 sets bit 3 + 1
        unpack_ef(bytes([0b10, 0b1_0001]), 1, 2, 6)
    with pytest.raises(ValueError, match="must increase"):
        pack_ef(np.array([[3, 3]]), 6)
    with pytest.raises(ValueError, match=r"in \[0, 6\)"):
        pack_ef(np.array([[3, 6]]), 6)


@pytest.mark.parametrize(
    "k12, universe, value_bits, k", [(90, 4096, 2, 143), (32, 4096, 8, 38), (512, 4096, 4, 1024), (8, 256, 8, 11)]
)
def test_the_elias_fano_top_k_that_costs_a_chunk_what_12_bit_indices_did(k12, universe, value_bits, k):
    assert ef_topk_in_bits_of(k12, universe, value_bits) == k
    budget = k12 * (12 + value_bits)
    assert ef_chunk_bits(k, universe) + k * value_bits <= budget < ef_chunk_bits(k + 1, universe) + (k + 1) * value_bits
