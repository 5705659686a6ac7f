"""A replica's (or a gradient's) fingerprint: per tensor its sum and sum of squares in float64, and its values at
a few fixed positions. Every round takes one on the coordinator and on every worker, so on a GPU it costs a
few passes over memory and a fixed number of kernel launches, not a few per tensor: there the launches are the
cost.

On a GPU ``FingerprintPlan`` reads the tensors as if laid end to end, in slabs of at most ``SLAB`` elements:
each slab is gathered into one buffer in which every tensor's piece starts a row of ``ROW`` elements (zeros
pad the rest of its last row), cast to float64 and summed a row at a time (a dense reduction that fills the
device), then the rows' sums per tensor with one short segmented sum (and its squares likewise); the sampled
positions in the slab are gathered with one index. A segmented sum straight over the slab would run one thread
block per tensor: a dozen blocks on a GPU of a hundred multiprocessors, at a tenth of its bandwidth. The
statistics land in one float64 vector (``Fingerprint.from_stats``'s layout), read back once. On a CPU, where a
launch costs nothing and a fresh slab-sized buffer costs more than the reads, ``fingerprint`` goes a tensor at
a time. The two agree to float64 rounding. ``compare_fingerprints`` is the pure decision, with its reason.

The sums and sums of squares (the moments) read every parameter: on a CPU a model's bytes again each round, on
each side, for what the samples mostly tell already (a missed or misapplied update moves every value, so the
samples move with it). So a replica's fingerprint carries its moments only at the versions ``takes_moments``
names (every ``--fingerprint-every``-th), and its samples alone at the others: a few values a tensor, the same
on any device, whatever the model's size. ``compare_fingerprints`` compares what the expected one holds.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence

import torch

SAMPLES_PER_TENSOR = 4
SLAB = 1 << 24  # elements gathered and cast to float64 at a time (128 MiB of float64)
ROW = 1 << 12  # elements summed together first; each tensor's piece of a slab starts a row
MOMENT_SLICE = 1 << 20  # elements cast to float64 at a time by ``moments``
MAX_FINGERPRINT_EVERY = 1_000_000  # versions between two fingerprints with moments (--fingerprint-every)


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """Per tensor: sum and sum of squares (float64); values at fixed positions (a few per tensor)."""

    sums: tuple[float, ...]
    sumsqs: tuple[float, ...]
    samples: tuple[float, ...]

    @property
    def has_moments(self) -> bool:
        """Whether it holds its tensors' sums and sums of squares, or only their samples."""
        return bool(self.sums)

    def samples_only(self) -> Fingerprint:
        """The same fingerprint without its moments (what is taken where ``takes_moments`` says no)."""
        return Fingerprint((), (), self.samples)

    @classmethod
    def from_stats(cls, stats: torch.Tensor, tensors: int) -> Fingerprint:
        """From one flat float64 tensor: ``tensors`` sums, as many sums of squares, then the samples (float32
        values, exact in float64; what a replica split over ranks sums over them in one collective). Read back
        at once."""
        n = tensors
        values = stats.tolist()
        return cls(tuple(values[:n]), tuple(values[n : 2 * n]), tuple(values[2 * n :]))


def takes_moments(version: int, every: int) -> bool:
    """Whether the fingerprint of a replica at ``version`` holds its moments: every ``every``-th version
    (``every`` <= 1: all of them), version 0 first; the samples alone at the others."""
    return every <= 1 or version % every == 0


def sample_positions(
    named_shapes: Sequence[tuple[str, Sequence[int]]], per_tensor: int = SAMPLES_PER_TENSOR
) -> list[torch.Tensor]:
    """Fixed flat positions to sample in each tensor; the same in every process (seeded by name)."""
    out = []
    for name, shape in named_shapes:
        numel = math.prod(shape)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ numel)
        out.append(torch.randint(0, max(numel, 1), (min(per_tensor, numel),), generator=gen))
    return out


@torch.no_grad()
def moments(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 sum and sum of squares of a flat tensor, a slice at a time: a float64 sum of a float32
    tensor casts it first, and cast whole, a model's tensors would ask for twice their bytes again. (One
    tensor's; a whole model's in few launches: ``FingerprintPlan``.)"""
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    squares = torch.zeros((), dtype=torch.float64, device=flat.device)
    for lo in range(0, flat.numel(), MOMENT_SLICE):
        x = flat[lo : lo + MOMENT_SLICE].double()
        total += x.sum()
        squares += torch.dot(x, x)
    return total, squares


@dataclasses.dataclass(frozen=True)
class _Slab:
    """A run of the tensors laid end to end: its pieces (tensor, first, end) and the zeros after each that fill
    its last row, and on the device each piece's rows and tensor, and the samples it holds (where in the
    padded slab, where in the statistics)."""

    pieces: tuple[tuple[int, int, int], ...]
    pads: tuple[int, ...]
    rows: torch.Tensor
    sums_at: torch.Tensor
    sumsqs_at: torch.Tensor
    samples_from: torch.Tensor
    samples_to: torch.Tensor


class FingerprintPlan:
    """How to fingerprint tensors of these sizes, sampled at ``positions``, on ``device``: built once (the
    index tensors live on the device), then each call costs a few launches a slab."""

    def __init__(
        self, numels: Sequence[int], positions: Sequence[torch.Tensor], device: torch.device, slab: int = SLAB
    ) -> None:
        if len(numels) != len(positions):
            raise ValueError(f"{len(numels)} tensors but {len(positions)} sets of sample positions")
        self.numels = tuple(int(n) for n in numels)
        self.device = torch.device(device)
        self.positions = tuple(p.to(self.device) for p in positions)  # for a fingerprint of samples alone
        n = len(self.numels)
        offsets = [0]
        for numel in self.numels:
            offsets.append(offsets[-1] + numel)
        # Each sample's place in the whole (tensors end to end) and in the statistics vector.
        # Each sample's place in the statistics vector (after the sums and sums of squares), by tensor.
        samples: dict[int, list[tuple[int, int]]] = {}  # tensor: (place, position in the tensor)
        for k, (i, p) in enumerate((i, int(p)) for i, pos in enumerate(positions) for p in pos.tolist()):
            samples.setdefault(i, []).append((k, p))
        self.size = 2 * n + sum(len(v) for v in samples.values())
        slabs = []
        for start in range(0, offsets[-1], slab):
            end = min(start + slab, offsets[-1])
            pieces = tuple(
                (i, max(start, offsets[i]) - offsets[i], min(end, offsets[i + 1]) - offsets[i])
                for i in range(n)
                if offsets[i] < end and offsets[i + 1] > start
            )
            rows = [-(-(hi - lo) // ROW) for _, lo, hi in pieces]
            # Each sample's place in the padded slab: its piece's start there, plus its place in the piece.
            taken, at = [], 0
            for (i, lo, hi), r in zip(pieces, rows):
                taken += [(k, at + p - lo) for k, p in samples.get(i, ()) if lo <= p < hi]
                at += r * ROW
            taken.sort()
            slabs.append(
                _Slab(
                    pieces,
                    tuple(r * ROW - (hi - lo) for (_, lo, hi), r in zip(pieces, rows)),
                    self._index(rows),
                    self._index([i for i, _, _ in pieces]),
                    self._index([n + i for i, _, _ in pieces]),
                    self._index([at for _, at in taken]),
                    self._index([2 * n + k for k, _ in taken]),
                )
            )
        self.slabs = tuple(slabs)
        self._pads: dict[torch.dtype, torch.Tensor] = {}

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device)

    @torch.no_grad()
    def stats(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One float64 vector on the device: the tensors' sums, their sums of squares, then the samples."""
        if tuple(t.numel() for t in tensors) != self.numels:
            raise ValueError("the tensors are not those the fingerprint plan was made for")
        out = torch.zeros(self.size, dtype=torch.float64, device=self.device)
        flats = [t.detach().reshape(-1) for t in tensors]
        for slab in self.slabs:
            parts = []
            for (i, lo, hi), pad in zip(slab.pieces, slab.pads):
                parts.append(flats[i][lo:hi])
                if pad:
                    parts.append(self._zeros(flats[i].dtype)[:pad])
            x = parts[0] if len(parts) == 1 else torch.cat(parts)
            if slab.samples_to.numel():  # float32 values, as a float32 tensor holds them
                out.index_copy_(0, slab.samples_to, x.index_select(0, slab.samples_from).float().double())
            wide = x.to(torch.float64, copy=True).view(-1, ROW)
            out.index_add_(0, slab.sums_at, torch.segment_reduce(wide.sum(1), "sum", lengths=slab.rows))
            out.index_add_(0, slab.sumsqs_at, torch.segment_reduce(wide.square_().sum(1), "sum", lengths=slab.rows))
        return out

    def _zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """ROW - 1 zeros of ``dtype`` on the device (the most a piece's last row lacks), made once."""
        if dtype not in self._pads:
            self._pads[dtype] = torch.zeros(ROW - 1, dtype=dtype, device=self.device)
        return self._pads[dtype]

    def __call__(self, tensors: Sequence[torch.Tensor], with_moments: bool = True) -> Fingerprint:
        """The fingerprint of ``tensors``; without its moments, their samples alone (one gather a tensor, one
        read back)."""
        if not with_moments:
            if tuple(t.numel() for t in tensors) != self.numels:
                raise ValueError("the tensors are not those the fingerprint plan was made for")
            return sampled(tensors, self.positions)
        return Fingerprint.from_stats(self.stats(tensors), len(self.numels))


@torch.no_grad()
def fingerprint(
    tensors: Sequence[torch.Tensor], positions: Sequence[torch.Tensor], with_moments: bool = True
) -> Fingerprint:
    """The fingerprint of ``tensors`` sampled at ``positions``, a tensor at a time: where launches cost nothing
    (a CPU, whose fresh 64 MiB buffers cost more than a slice's few launches). On a GPU: ``FingerprintPlan``.
    Without its moments: the samples alone (``sampled``)."""
    if not with_moments:
        return sampled(tensors, positions)
    sums, sumsqs, samples = [], [], []
    for t, pos in zip(tensors, positions):
        flat = t.detach().reshape(-1)
        total, squares = moments(flat)
        sums.append(total)
        sumsqs.append(squares)
        samples.append(flat[pos.to(flat.device)].double())
    if not sums:
        return Fingerprint((), (), ())
    return Fingerprint.from_stats(torch.cat([torch.stack(sums), torch.stack(sumsqs), *samples]), len(sums))


@torch.no_grad()
def sampled(tensors: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]) -> Fingerprint:
    """A fingerprint without moments: each tensor's values at ``positions`` (as float32 holds them, as the full
    fingerprint's samples), read back at once. Its cost is the samples', not the tensors'."""
    if not tensors:
        return Fingerprint((), (), ())
    device = tensors[0].device
    picked = [t.detach().reshape(-1)[pos.to(device)].float() for t, pos in zip(tensors, positions)]
    return Fingerprint((), (), tuple(torch.cat(picked).double().tolist()))


def planned(device: torch.device) -> bool:
    """Whether fingerprints on ``device`` go through a ``FingerprintPlan`` (a GPU) or a tensor at a time."""
    return torch.device(device).type != "cpu"


def compare_fingerprints(
    expected: Fingerprint, actual: Fingerprint, numels: Sequence[int], tolerance: float
) -> tuple[bool, str]:
    """Do two replicas agree within ``tolerance`` (relative)? Returns (same, reason).

    Float noise from a different device or kernel moves these by ~1e-7 relative; a replica that missed
    or misapplied an update moves them by orders more. What ``expected`` holds is compared: its moments and
    samples, or its samples alone (``takes_moments``); ``actual`` must hold at least as much.
    """
    if expected.has_moments and not actual.has_moments:
        return False, "the fingerprint holds samples alone, the expected one its moments too"
    if len(expected.samples) != len(actual.samples) or (expected.has_moments and _layout(expected) != _layout(actual)):
        return False, "fingerprints describe different tensors"
    for i, (s_e, s_a, q_e, q_a, n) in enumerate(
        zip(expected.sums, actual.sums, expected.sumsqs, actual.sumsqs, numels)
    ):
        if not all(map(math.isfinite, (s_a, q_a))):
            return False, f"tensor {i}: non-finite values"
        if abs(q_e - q_a) > tolerance * max(q_e, q_a) + 1e-30:
            return False, f"tensor {i}: sum of squares {q_a:.9g} != {q_e:.9g}"
        # |sum(x) - sum(y)| <= sqrt(n) * ||x - y||, so this bound tolerates the same relative drift.
        if abs(s_e - s_a) > tolerance * math.sqrt(n * max(q_e, q_a)) + 1e-30:
            return False, f"tensor {i}: sum {s_a:.9g} != {s_e:.9g}"
    return _samples_agree(expected, actual, tolerance) or (True, "replicas agree")


def compare_gradients(
    expected: Fingerprint, actual: Fingerprint, numels: Sequence[int], tolerance: float
) -> tuple[bool, str]:
    """Do two fingerprints of one gradient, computed apart (a spot check's recompute, or workers given the same
    rows), agree within ``tolerance`` (relative)? Returns (same, reason).

    Unlike two replicas, two computations of a gradient may run in other precisions (a bf16 worker against a
    float32 recompute): each value then moves by about 1e-2 relative, and a tensor whose gradient nearly
    cancels (a norm's weight, a bias) can move by tens of percent of its own tiny norm. So each tensor's
    statistics are weighed against the whole gradient's: the sums of squares must agree to ``tolerance`` of
    the gradient's, the sums (each over its tensor's size) likewise, and each sample to ``tolerance`` of its
    own size plus the largest sample's. Another batch's gradient moves most samples by their whole size.
    """
    if _layout(expected) != _layout(actual):
        return False, "fingerprints describe different tensors"
    for i, values in enumerate(zip(actual.sums, actual.sumsqs)):
        if not all(map(math.isfinite, values)):
            return False, f"tensor {i}: non-finite values"
    squares = [abs(q_e - q_a) for q_e, q_a in zip(expected.sumsqs, actual.sumsqs)]
    whole = sum(max(q_e, q_a) for q_e, q_a in zip(expected.sumsqs, actual.sumsqs))
    if sum(squares) > tolerance * whole + 1e-30:
        i = max(range(len(squares)), key=squares.__getitem__)
        return False, (
            f"sums of squares differ by {sum(squares) / whole:.3g} of the gradient's (most in tensor {i}: "
            f"{actual.sumsqs[i]:.9g} != {expected.sumsqs[i]:.9g})"
        )
    # |sum(x) - sum(y)| <= sqrt(n) * ||x - y||: each sum's drift over sqrt(n), against the tensors' norms.
    drifts = [abs(s_e - s_a) / math.sqrt(max(n, 1)) for s_e, s_a, n in zip(expected.sums, actual.sums, numels)]
    norms = sum(math.sqrt(max(q_e, q_a)) for q_e, q_a in zip(expected.sumsqs, actual.sumsqs))
    if sum(drifts) > tolerance * norms + 1e-30:
        i = max(range(len(drifts)), key=drifts.__getitem__)
        return False, f"sums differ (most in tensor {i}: {actual.sums[i]:.9g} != {expected.sums[i]:.9g})"
    return _samples_agree(expected, actual, tolerance) or (True, "the gradients agree")


def _layout(f: Fingerprint) -> tuple[int, int, int]:
    return len(f.sums), len(f.sumsqs), len(f.samples)


def _samples_agree(expected: Fingerprint, actual: Fingerprint, tolerance: float) -> tuple[bool, str] | None:
    """The first sample that differs by more than ``tolerance`` of its own size plus the largest sample's (as
    a failed comparison), or None."""
    scale = max((abs(x) for x in expected.samples), default=0.0)
    for j, (a, b) in enumerate(zip(expected.samples, actual.samples)):
        if not math.isfinite(b) or abs(a - b) > tolerance * (abs(a) + scale) + 1e-30:
            return False, f"sample {j}: {b:.9g} != {a:.9g}"
    return None
