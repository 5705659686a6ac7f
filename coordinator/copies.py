"""Copied contributions: a payload that repeats another sender's chunk indices, this round or a recent one.

A payload keeps, in every chunk of every sparse tensor, the top-k coefficients of its sender's own gradient
on its own rows. Two honest workers pick different sets. For gpt-tiny's gradients on 4 rows of 64 random
tokens each, no chunk of 148 had the same set of 32 (of 4096) in any pair of four workers, and their sets
shared 1-2% of their indices. A chunk whose kept values are all the same (nothing there) is left out of
the comparison, and so is a group whose sets are few enough to match by chance.

A worker that sends another's payload keeps that payload's sets, whether it sends it as the replay brought
it or with its values scaled or sign-flipped. Decompressed, perturbed a little and compressed again, most
sets survive: a scaled copy kept 8 of 12 in the tests. So a payload is a copy when at least half of its
sampled chunks hold exactly the index set of another payload. That other payload may be:
- a sender's of this round: the later one in slot order is the copy, and the first still counts, once;
- another sender's payload of the last rounds the gather stage remembers, or the coordinator's update;
- the sender's own payload of those rounds, where its values repeat too, relative to each chunk's largest:
  a replay, as sent or scaled. Its index sets alone may honestly repeat: error feedback keeps what the
  quantizer left of each coefficient it sent, and at 4-bit values the same top-k came back in 53% of a tiny
  model's sampled chunks from one step to the next (gpt-tiny, 2 rows of 16 tokens), and so did the order
  and signs of their quantized values; their values relative to the chunk's largest did not, since each
  tensor's bins move with all of its values.

What this check cannot see: a copy with enough noise added to move most chunks' top-k, and a gradient
computed honestly on rows other than those it was sent. Those need checks that compare directions
(agreement with the others, spot checks on the same rows), not indices.

Pure: ``digest`` and ``find_copies`` compute from the decoded payloads alone, and say why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence

import numpy as np
import torch

from gradwire.compression.codec import DecodedGradient
from gradwire.compression.lowrank import Factors

ROWS_PER_GROUP = 256  # chunks sampled per chunk group (evenly spaced): enough to tell, cheap to compare
FACTOR_SAMPLES = 256  # codes sampled from each side of a factored tensor's rank-one term (evenly spaced)
COPY_SHARE = 0.5  # a payload whose sampled chunks repeat another's index sets this often is a copy
CHANCE_LOG = math.log(1e6)  # groups where a chunk's set has fewer possibilities than this are left out

# Fixed odd multipliers: a chunk's sorted index set hashes to one 64-bit word (a collision is ~2^-64).
_MULTIPLIERS = np.random.default_rng(0x6772616477697265).integers(1, 2**63, 4096, dtype=np.uint64) | np.uint64(1)
# A chunk's values, relative to its largest, as float16 bits: more words, drawn the same way.
_VALUE_MULTIPLIERS = np.random.default_rng(0x7265706C6179).integers(1, 2**63, 4096, dtype=np.uint64) | np.uint64(1)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # a rank-one term's word: its column's hash times this, plus its row's


@dataclasses.dataclass(frozen=True)
class Digest:
    """A payload's sampled chunks, one 64-bit word each, in two hashes: ``sets``, of each chunk's set of kept
    indices (what a copy keeps, scaled or perturbed); ``replays``, of that set with its values relative to
    the largest, in float16 (what a replay of the same payload keeps, even scaled or sign-flipped). 0 where
    a chunk holds nothing."""

    sets: np.ndarray
    replays: np.ndarray

    @classmethod
    def of(cls, words: np.ndarray) -> Digest:
        """A digest whose words hash the values too (a factored tensor's codes do): sets and replays alike."""
        return cls(words, words)


@dataclasses.dataclass(frozen=True)
class Seen:
    """A payload the gather stage kept: who sent it, in which step, and its sampled chunks' digest."""

    address: str
    step: int
    digest: Digest


def digest(decoded: DecodedGradient, chunk_numels: Sequence[int]) -> Digest:
    """Per sampled chunk of each chunk group, a word hashing the chunk's set of kept indices (in any order),
    and one hashing that set with its values relative to its largest (``Digest``); 0 for a chunk whose kept
    values are all the same (its sender had nothing there: top-k of nothing picks the same indices for
    everyone, and quantized zeros are all one code). ``chunk_numels``: each group's chunk size
    (``codec.plan.groups``); a group where two honest chunks could hold the same set by chance (top-1 of
    64: one in 64) is left out. Then the words of each factored tensor, one per rank-one term
    (``_factor_words``), in both. Empty if nothing is left."""
    sets, replays = [], []
    for indices, values, numel in zip(decoded.indices, decoded.values, chunk_numels):
        chunks, k = indices.shape
        if not chunks or not k or _log_sets(numel, k) < CHANCE_LOG:
            continue
        rows = torch.linspace(0, chunks - 1, min(ROWS_PER_GROUP, chunks)).long()
        ordered = torch.sort(indices[rows], dim=1)
        hashed = _hash(ordered.values.cpu().numpy(), _MULTIPLIERS[:k])
        kept = torch.gather(values[rows], 1, ordered.indices).float()  # in the order of their indices
        largest = torch.gather(kept, 1, kept.abs().argmax(dim=1, keepdim=True))
        ratios = (kept / torch.where(largest == 0, 1.0, largest)).half().view(torch.int16).int() & 0xFFFF
        replay = hashed * _MIX + _hash(ratios.cpu().numpy(), _VALUE_MULTIPLIERS)
        empty = (kept == kept[:, :1]).all(dim=1).cpu().numpy()
        replay[replay == 0] = 1
        hashed[empty] = replay[empty] = 0
        sets.append(hashed)
        replays.append(replay)
    factors = _factor_words(list(decoded.factors.values()))
    if not sets and not factors:
        return Digest.of(np.zeros(0, np.uint64))
    return Digest(np.concatenate(sets + factors), np.concatenate(replays + factors))


def _hash(rows: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """One 64-bit word per row (the last axis) of integers: a multiply-and-sum that wraps."""
    return (rows.astype(np.uint64, copy=False) * multipliers[: rows.shape[-1]]).sum(axis=-1, dtype=np.uint64)


def _factor_words(factored: Sequence[Factors]) -> list[np.ndarray]:
    """Per factored tensor, one 64-bit word per rank-one term: a hash of ``FACTOR_SAMPLES`` evenly strided
    codes of its column of A and as many of its row of B, each up to sign (a sign-flipped copy hashes alike), the
    tensor's words sorted (so does a copy with its terms reordered); 0 for a term with no non-zero code
    among either side's samples. A copy sent with other scales keeps its codes; an honest sender's term
    repeats another's only if every sampled code of a column and a row does. Tensors of one shape at once:
    the cost is the samples', not the factors'."""
    out: list[np.ndarray] = [np.zeros(0, np.uint64)] * len(factored)
    by_shape: dict[tuple, list[int]] = {}
    for i, f in enumerate(factored):
        by_shape.setdefault((*f.a.shape, *f.b.shape), []).append(i)
    for (rows, _, _, cols), positions in by_shape.items():
        every_row, every_col = max(1, rows // FACTOR_SAMPLES), max(1, cols // FACTOR_SAMPLES)
        a = torch.stack([factored[i].a[::every_row][:FACTOR_SAMPLES] for i in positions])  # (n, samples, k)
        b = torch.stack([factored[i].b[:, ::every_col][:, :FACTOR_SAMPLES] for i in positions])  # (n, k, samples)
        sides = [a.mT.cpu().numpy(), b.cpu().numpy()]  # term t of tensor j: sides[0][j, t], sides[1][j, t]
        live = sides[0].any(axis=2) & sides[1].any(axis=2)  # (n, k)
        words = []
        for x, multipliers in zip(sides, (_MULTIPLIERS[:FACTOR_SAMPLES], _MULTIPLIERS[FACTOR_SAMPLES:])):
            first = np.take_along_axis(x, (x != 0).argmax(axis=2)[..., None], axis=2)  # each term's first non-zero
            codes = (x.astype(np.int64) * np.sign(first).astype(np.int64)).astype(np.uint64)  # wraps: a hash
            words.append(_hash(codes, multipliers))
        hashed = words[0] * _MIX + words[1]
        hashed[hashed == 0] = 1
        hashed[~live] = 0
        for j, i in enumerate(positions):
            out[i] = np.sort(hashed[j])
    return out


def _log_sets(n: int, k: int) -> float:
    """log of the number of sets of k among n."""
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def shared(a: np.ndarray, b: np.ndarray) -> float:
    """The share of the sampled chunks that hold something in both digests' words (``Digest.sets`` or
    ``Digest.replays``) whose words are the same (0 if the digests do not align or have no such chunk)."""
    if a.size == 0 or a.shape != b.shape:
        return 0.0
    both = (a != 0) & (b != 0)
    return float(np.mean(a[both] == b[both])) if both.any() else 0.0


def find_copies(
    current: Sequence[tuple[str, Digest]], earlier: Sequence[Seen], step: int, together: Collection[int] = ()
) -> dict[int, str]:
    """Which of this round's payloads (``current``: sender and digest, in slot order) copy another: a later
    sender repeating an earlier one of this round, anyone repeating another sender's payload of an earlier
    round, or a sender replaying its own. Returns {position in ``current``: why}. ``together``: positions of
    senders that were given the same rows this round (a spot check by redundancy): their payloads may well
    repeat each other's.

    Only pairs that hold the same set in at least one sampled chunk are compared (``_overlapping``: one sort
    of every digest's words), so the cost grows with the payloads, not with their pairs."""
    earlier = [seen for seen in earlier if seen.step < step]
    digests = [d for _, d in current] + [seen.digest for seen in earlier]
    partners = _overlapping([d.sets for d in digests])
    found: dict[int, str] = {}
    for i, (address, d) in enumerate(current):
        for j in sorted(partners.get(i, ())):  # this round's earlier senders first, then the remembered payloads
            if j == i or (j < len(current) and (j > i or (i in together and j in together))):
                continue
            seen = earlier[j - len(current)] if j >= len(current) else None
            own = seen is not None and seen.address == address
            share = shared(d.replays, digests[j].replays) if own else shared(d.sets, digests[j].sets)
            if share < COPY_SHARE:
                continue
            if seen is None:
                found[i] = f"a copy: {share:.0%} of its sampled chunks repeat {current[j][0]}'s this round"
            elif own:
                found[i] = f"a replay: {share:.0%} of its sampled chunks repeat its own payload of step {seen.step}"
            else:
                found[i] = (
                    f"a copy: {share:.0%} of its sampled chunks repeat {seen.address}'s payload of step {seen.step}"
                )
            break
    return found


def _overlapping(digests: Sequence[np.ndarray]) -> dict[int, set[int]]:
    """For each digest (by position), the others that hold the same non-zero word at some sampled chunk.
    Digests of another length than the first's (another plan) overlap with none."""
    if not digests:
        return {}
    size = digests[0].size
    chunks, words, owners = [], [], []
    for owner, d in enumerate(digests):
        if d.size != size:
            continue
        nonzero = np.flatnonzero(d)
        chunks.append(nonzero)
        words.append(d[nonzero])
        owners.append(np.full(nonzero.size, owner))
    if not chunks:
        return {}
    # One key per (chunk, word), sorted once: a sort of one word a entry is a tenth of a lexsort of three (0.08 ms
    # against 0.93 for four digests of 1,400 words). Two pairs that share a key by chance (one in 2^64) only have
    # their digests compared (``shared``), which a copy must pass anyway.
    key = np.concatenate(words) * _MIX + np.concatenate(chunks).astype(np.uint64)
    order = np.argsort(key)  # the owners of a run in any order: a run is read as a set
    key, owner = key[order], np.concatenate(owners)[order]
    same = key[1:] == key[:-1]  # entry i + 1 repeats entry i's set
    partners: dict[int, set[int]] = {}
    if not same.any():
        return partners
    starts = np.flatnonzero(np.diff(np.concatenate(([0], same.astype(np.int8), [0]))) == 1)  # runs of repeats
    ends = np.flatnonzero(np.diff(np.concatenate(([0], same.astype(np.int8), [0]))) == -1)
    for start, end in zip(starts, ends):  # entries start..end hold one set
        run = {int(o) for o in owner[start : end + 1]}
        for o in run:
            partners.setdefault(o, set()).update(run - {o})
    return partners
