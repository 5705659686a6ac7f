"""coordinator.copies: a payload that repeats another's chunk indices is found, an honest one never is."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradwire.compression import CodecConfig, GradientCodec, lowrank
from gradwire.coordinator.copies import COPY_SHARE, Digest, Seen, digest, find_copies, shared

SHAPES = {"w": (256, 192), "v": (8192,), "b": (48,)}  # w: 12 chunks of 64 x 64; v: top-1 of each 64


@pytest.fixture(scope="module")
def codec() -> GradientCodec:
    return GradientCodec(SHAPES, CodecConfig(topk=32))


def gradient(seed: int) -> dict[str, torch.Tensor]:
    """A random gradient: honest senders' sets share nothing beyond chance."""
    g = torch.Generator().manual_seed(1000 + seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def digested(codec: GradientCodec, grad: dict[str, torch.Tensor]) -> Digest:
    return digest(codec.decode(codec.compress(grad)), [g.chunk_numel for g in codec.plan.groups])


def test_honest_payloads_share_no_index_sets_and_a_copy_shares_all(codec: GradientCodec) -> None:
    d, b = digested(codec, gradient(0)), digested(codec, gradient(1))
    a = d.sets
    # Only the matrix's chunks count: top-1 of each 64-vector chunk of v would match by chance (1 in 64).
    assert a.size == 12 and shared(a, b.sets) == 0.0 and shared(d.replays, b.replays) == 0.0
    assert shared(a, a.copy()) == 1.0
    # A copy with its values scaled (or its sign flipped) keeps the copied index sets.
    decoded = codec.decode(codec.compress(gradient(0)))
    flipped = dataclasses.replace(decoded, values=[-3 * v for v in decoded.values])
    assert shared(a, digest(flipped, [g.chunk_numel for g in codec.plan.groups]).sets) == 1.0
    # Decompressed, scaled and compressed again, most sets survive, all of them where the transform runs in
    # float32 (a bfloat16 transform, where the CPU multiplies it natively, moves the k-th largest coefficient
    # in a few chunks): still a copy.
    assert COPY_SHARE <= shared(a, digested(codec, {k: -3 * v for k, v in gradient(0).items()}).sets) <= 1.0


def test_this_rounds_later_sender_and_anyone_repeating_a_recent_payload_are_copies(codec: GradientCodec) -> None:
    honest = [digested(codec, gradient(i)) for i in range(3)]
    # This round: the third sends the first's payload; the first still counts (it came first).
    found = find_copies([("w0", honest[0]), ("w1", honest[1]), ("w2", honest[0])], [], step=5)
    assert list(found) == [2] and "100% of its sampled chunks repeat w0's this round" in found[2]
    # An earlier round's payload, another sender's or its own, is a copy; one of this step is not earlier.
    earlier = [Seen("w0", 4, honest[0]), Seen("w1", 4, honest[1])]
    found = find_copies([("w1", honest[0]), ("w0", honest[0]), ("w2", honest[2])], earlier, step=5)
    assert set(found) == {0, 1} and "repeat w0's payload of step 4" in found[0]
    assert "w1's this round" in found[1]  # this round's first
    replay = find_copies([("w0", honest[0])], earlier, step=5)
    assert replay == {0: "a replay: 100% of its sampled chunks repeat its own payload of step 4"}
    assert find_copies([("w1", honest[0])], [Seen("w0", 5, honest[0])], step=5) == {}
    assert find_copies([(f"w{i}", d) for i, d in enumerate(honest)], earlier[:0], step=5) == {}


def test_a_sender_whose_index_sets_repeat_with_other_values_is_honest_and_its_replay_is_not(
    codec: GradientCodec,
) -> None:
    """Error feedback can pick a chunk's same top-k from one step to the next (at 4-bit values it did in half a
    tiny model's chunks): its own earlier payload counts only where the values repeat too, relative to
    each chunk's largest, as a replay's do, scaled or sign-flipped."""
    before = codec.decode(codec.compress(gradient(0)))
    numels = [g.chunk_numel for g in codec.plan.groups]
    # The same sets, other values: each kept coefficient's value moved (as a buffer's does between steps).
    g = torch.Generator().manual_seed(7)
    moved = dataclasses.replace(before, values=[v * (1 + torch.rand(v.shape, generator=g)) for v in before.values])
    earlier = [Seen("w0", 4, digest(before, numels))]
    again = digest(moved, numels)
    assert shared(again.sets, earlier[0].digest.sets) == 1.0 and shared(again.replays, earlier[0].digest.replays) == 0
    assert find_copies([("w0", again)], earlier, step=5) == {}
    # ... but the same payload from another sender is a copy.
    assert "a copy: 100%" in find_copies([("w1", again)], earlier, step=5)[0]
    for how in (1.0, 3.0, -0.5):  # a replay, as it was, scaled, or scaled and sign-flipped
        replay = digest(dataclasses.replace(before, values=[how * v for v in before.values]), numels)
        found = find_copies([("w0", replay)], earlier, step=5)
        assert found[0].startswith("a replay: 100%") and "its own payload of step 4" in found[0], how


def test_chunks_with_nothing_in_them_do_not_count(codec: GradientCodec) -> None:
    # Two senders whose gradients are zero in most places: top-k of zeros picks the same indices for both,
    # which says nothing about copying.
    def sparse(seed: int) -> dict[str, torch.Tensor]:
        g = gradient(seed)
        g["w"][64:] = 0  # three quarters of the matrix's chunks hold nothing
        return g

    a, b = digested(codec, sparse(0)), digested(codec, sparse(1))
    assert (a.sets == 0).mean() > 0.5 and shared(a.sets, b.sets) < COPY_SHARE
    assert np.array_equal(a.sets == 0, a.replays == 0)
    assert find_copies([("w0", a), ("w1", b)], [], step=0) == {}


def test_only_overlapping_pairs_are_compared_and_the_answer_is_the_pairwise_one() -> None:
    """``find_copies`` sorts every digest's words once instead of comparing every pair: the same findings as
    comparing each payload with every earlier one, in the same order of precedence."""
    rng = np.random.default_rng(0)

    def honest() -> np.ndarray:
        d = rng.integers(1, 2**63, 40, dtype=np.uint64)
        d[rng.random(40) < 0.2] = 0  # chunks with nothing in them
        return d

    words = [honest() for i in range(30)]
    earlier_words = [honest() for i in range(31)]
    words[7] = words[3].copy()  # a copy of this round's sender 3
    words[9] = earlier_words[12].copy()  # of a payload of step 4
    words[11] = words[2].copy()
    words[11][:15] = honest()[:15]  # most of it still copied
    words[13] = words[4].copy()
    words[13][:30] = honest()[:30]  # not enough of it
    words[15] = earlier_words[30].copy()  # step 5 is this step: not an earlier round's
    current = [(f"w{i}", Digest.of(d)) for i, d in enumerate(words)]
    earlier = [Seen(f"w{i}", 4, Digest.of(d)) for i, d in enumerate(earlier_words[:30])]
    earlier.append(Seen("w0", 5, Digest.of(earlier_words[30])))
    found = find_copies(current, earlier, step=5)
    assert sorted(found) == [7, 9, 11]
    assert "w3's this round" in found[7] and "w12's payload of step 4" in found[9] and "w2's" in found[11]
    # The pairwise rule, spelled out.
    for i, d in enumerate(words):
        pairwise = any(shared(d, words[j]) >= COPY_SHARE for j in range(i)) or any(
            shared(d, s.digest.sets) >= COPY_SHARE for s in earlier if s.step < 5
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
    assert all(np.array_equal(d.sets, d.replays) for d in digests)  # a factored term's words hash its codes
    digests = [d.sets for d in digests]
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
        assert shared(digests[0], digest(codec.decode(payload), numels).sets) == 1.0, how
    scaled = digest(codec.decode(copies["scaled"]), numels)
    found = find_copies([("a", Digest.of(digests[0])), ("b", Digest.of(digests[1])), ("c", scaled)], [], 1)
    assert list(found) == [2] and "a's" in found[2]
