"""coordinator.copies: a payload that repeats another's chunk indices is found, an honest one never is."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradwire.compression import CodecConfig, GradientCodec, lowrank
from gradwire.coordinator.copies import COPY_SHARE, Seen, digest, find_copies, shared

SHAPES = {"w": (256, 192), "v": (8192,), "b": (48,)}  # w: 12 chunks of 64 x 64; v: top-1 of each 64


@pytest.fixture(scope="module")
def codec() -> GradientCodec:
    return GradientCodec(SHAPES, CodecConfig(topk=32))


def gradient(seed: int) -> dict[str, torch.Tensor]:
    """A random gradient: honest senders' sets share nothing beyond chance."""
    g = torch.Generator().manual_seed(1000 + seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def digested(codec: GradientCodec, grad: dict[str, torch.Tensor]):
    return digest(codec.decode(codec.compress(grad)), [g.chunk_numel for g in codec.plan.groups])


def test_honest_payloads_share_no_index_sets_and_a_copy_shares_all(codec: GradientCodec) -> None:
    a, b = digested(codec, gradient(0)), digested(codec, gradient(1))
    # Only the matrix's chunks count: top-1 of each 64-vector chunk of v would match by chance (1 in 64).
    assert a.size == 12 and shared(a, b) == 0.0
    assert shared(a, a.copy()) == 1.0
    # A copy with its values scaled (or its sign flipped) keeps the copied index sets.
    decoded = codec.decode(codec.compress(gradient(0)))
    flipped = dataclasses.replace(decoded, values=[-3 * v for v in decoded.values])
    assert shared(a, digest(flipped, [g.chunk_numel for g in codec.plan.groups])) == 1.0
    # Decompressed, scaled and compressed again, most sets survive, all of them where the transform runs in
    # float32 (a bfloat16 transform, where the CPU multiplies it natively, moves the k-th largest coefficient
    # in a few chunks): still a copy.
    assert COPY_SHARE <= shared(a, digested(codec, {k: -3 * v for k, v in gradient(0).items()})) <= 1.0


def test_this_rounds_later_sender_and_anyone_repeating_a_recent_payload_are_copies(codec: GradientCodec) -> None:
    honest = [digested(codec, gradient(i)) for i in range(3)]
    # This round: the third sends the first's payload; the first still counts (it came first).
    found = find_copies([("w0", honest[0]), ("w1", honest[1]), ("w2", honest[0])], [], step=5)
    assert list(found) == [2] and "100% of its sampled chunks repeat w0's this round" in found[2]
    # An earlier round's payload, another sender's or its own, is a copy; one of this step is not earlier.
    earlier = [Seen("w0", 4, honest[0]), Seen("w1", 4, honest[1])]
    found = find_copies([("w1", honest[0]), ("w0", honest[0]), ("w2", honest[2])], earlier, step=5)
    assert set(found) == {0, 1} and "repeat w0's payload of step 4" in found[0]
    assert find_copies([("w1", honest[0])], [Seen("w0", 5, honest[0])], step=5) == {}
    assert find_copies([(f"w{i}", d) for i, d in enumerate(honest)], earlier[:0], step=5) == {}


def test_chunks_with_nothing_in_them_do_not_count(codec: GradientCodec) -> None:
    # Two senders whose gradients are zero in most places: top-k of zeros picks the same indices for both,
    # which says nothing about copying.
    def sparse(seed: int) -> dict[str, torch.Tensor]:
        g = gradient(seed)
        g["w"][64:] = 0  # three quarters of the matrix's chunks hold nothing
        return g

    a, b = digested(codec, sparse(0)), digested(codec, sparse(1))
    assert (a == 0).mean() > 0.5 and shared(a, b) < COPY_SHARE
    assert find_copies([("w0", a), ("w1", b)], [], step=0) == {}


def test_only_overlapping_pairs_are_compared_and_the_answer_is_the_pairwise_one() -> None:
    """``find_copies`` sorts every digest's words once instead of comparing every pair: the same findings as
    comparing each payload with every earlier one, in the same order of precedence."""
    rng = np.random.default_rng(0)

    def honest() -> np.ndarray:
        d = rng.integers(1, 2**63, 40, dtype=np.uint64)
        d[rng.random(40) < 0.2] = 0  # chunks with nothing in them
        return d

    current = [(f"w{i}", honest()) for i in range(30)]
    earlier = [Seen(f"w{i}", 4, honest()) for i in range(30)] + [Seen("w0", 5, honest())]
    current[7] = ("w7", current[3][1].copy())  # a copy of this round's sender 3
    current[9] = ("w9", earlier[12].digest.copy())  # of a payload of step 4
    current[11] = ("w11", current[2][1].copy())
    current[11][1][:15] = honest()[:15]  # most of it still copied
    current[13] = ("w13", current[4][1].copy())
    current[13][1][:30] = honest()[:30]  # not enough of it
    current[15] = ("w15", earlier[30].digest.copy())  # step 5 is this step: not an earlier round's
    found = find_copies(current, earlier, step=5)
    assert sorted(found) == [7, 9, 11]
    assert "w3's this round" in found[7] and "w12's payload of step 4" in found[9] and "w2's" in found[11]
    # The pairwise rule, spelled out.
    for i, (_, d) in enumerate(current):
        pairwise = any(shared(d, current[j][1]) >= COPY_SHARE for j in range(i)) or any(
            shared(d, s.digest) >= COPY_SHARE for s in earlier if s.step < 5
        )
        assert pairwise == (i in found), i


def _with_factors(payload, name: str, edit) -> object:
    """``payload`` with the factored tensor ``name``'s codes and scales edited by ``edit(a, sa, b, sb)``."""
    ct = next(t for t in payload.tensors if t.name == name)
    rows, cols = ct.shape[0], int(np.prod(ct.shape[1:]))
    f = lowrank.Factors.from_bytes(ct.values, ct.lut, rows, cols, ct.k)
    values, lut = lowrank.Factors(*edit(f.a, f.a_scale, f.b, f.b_scale)).to_bytes()
    tensors = tuple(dataclasses.replace(t, values=values, lut=lut) if t.name == name else t for t in payload.tensors)
    return dataclasses.replace(payload, tensors=tensors)


def test_factored_tensors_copied_scaled_flipped_or_reordered_are_found_and_honest_ones_never() -> None:
    shapes = {"w": (256, 192), "e": (300, 64), "b": (48,)}
    codec = GradientCodec(shapes, CodecConfig(topk=32, rank=4))
    numels = [g.chunk_numel for g in codec.plan.groups]
    g = torch.Generator().manual_seed(5)
    honest = [codec.compress({n: torch.randn(s, generator=g) for n, s in shapes.items()}) for _ in range(3)]
    digests = [digest(codec.decode(p), numels) for p in honest]
    assert digests[0].size == 8 and (digests[0] != 0).all()  # 4 words for each factored tensor, no group left
    assert max(shared(a, b) for i, a in enumerate(digests) for b in digests[i + 1 :]) == 0.0
    flip = torch.tensor([1, -1, 1, -1], dtype=torch.int8)
    order = torch.tensor([2, 0, 3, 1])
    copies = {
        "verbatim": honest[0],
        "scaled": _with_factors(
            _with_factors(honest[0], "w", lambda a, sa, b, sb: (a, 3 * sa, b, sb)),
            "e",
            lambda a, sa, b, sb: (a, sa, b, sb / 2),
        ),
        "sign-flipped": _with_factors(honest[0], "w", lambda a, sa, b, sb: (a * flip, sa, b, sb)),
        "reordered": _with_factors(honest[0], "e", lambda a, sa, b, sb: (a[:, order], sa[order], b[order], sb[order])),
    }
    for how, payload in copies.items():
        assert shared(digests[0], digest(codec.decode(payload), numels)) == 1.0, how
    scaled = digest(codec.decode(copies["scaled"]), numels)
    found = find_copies([("a", digests[0]), ("b", digests[1]), ("c", scaled)], [], 1)
    assert list(found) == [2] and "a's" in found[2]
