"""Leave-one-out agreement: does a sender's payload point the way the others' do?

Each kept payload is compared with the weighted sum of the *other* kept payloads of its round, by their
cosine over the coefficients the two share: the sparse coefficients it sent that at least one other sender
sent too, and every dense value (dense tensors are sent whole by everyone). Coefficients only one side sent
are left out: top-k sets of honest workers overlap little, and a coefficient one side did not send says
nothing about direction.

Pure: ``leave_one_out`` computes from the decoded payloads and their weights alone (tokens times clip
scale, the weights they aggregate with). A slice of chunks at a time, it sorts every sender's (index,
value) pairs of a chunk together, sums each coefficient over the senders that sent it, and takes each
sender's own part back out: no loop over chunks, and the cost is the payloads', not the model's (no
(chunks, chunk_numel) buffer; on the coordinator's critical path, issue 44).
``agreements`` peels senders that point away off the others' references first (see there).

What payloads look like (gpt-tiny, gradient mode with error feedback, 3 workers of 4 rows of 32 tokens,
seeds 3 and 4; ``decisions.score`` takes its floor and weights from these):
- honest: +0.56 to +0.99 per round over the first 60 rounds (median +0.93; the sparse coefficients carry
  99.8% of the squared norm, and agree as the dense ones do). Once the loss flattens (rounds 150-200) each
  worker's median falls to +0.23 to +0.58 and single rounds reach -0.91; a score mostly stayed above -0.14, but in
  one CI run it drifted to -0.41 for a few rounds (``decisions.score`` strikes only while the round points away too).
- sign flip at the honest norm: -0.90 to -0.99 (median -0.96) early, median -0.68 late, never above +0.01.
  The honest pair beside it agrees at +0.81 to +1.0 with the flipper peeled off; without peeling, its
  reference is its peer minus another honest direction and it measured anywhere in -0.81 to +0.96.
- other rows (each row's tokens rotated by half a row): +0.84 to +0.99 (median +0.94), as honest ones.
- zeros: no cosine (a zero norm).

Which check catches what:
- a sign flip at the honest norm, and any payload pointing away from the others round after round: this
  agreement, through the score (``decisions.score``: left out from its second round, benched after
  ``--bench-after`` strikes). The norm clip cannot see it.
- a payload of zeros, with the tokens of its batch: the gather stage's empty-payload check, before this
  (a cosine with a zero vector is undefined: ``None`` here, no measurement).
- a gradient honestly computed on rows other than those sent: not by this (rows from the same distribution
  give a gradient that agrees with the others as well as an honest one does, and it is no copy either), but
  by the spot checks (``coordinator.spotcheck``), which recompute a sender's gradient from the rows it was
  sent. Until one catches it, it does the step no harm, only the data schedule.
- noise at the honest norm, or a tiny payload: its cosine is near 0, above the floor. The clip bounds what
  it can do; it dilutes the update by its share of the tokens.
- a flipper that sends honest payloads every other round: its score averages near 0 and is not struck;
  its rounds mostly cancel out.
- colluders: a majority that agrees on a wrong direction scores the honest minority down, and with two
  senders nobody can tell which one points away (both are struck). Agreement assumes most of each round's
  senders are honest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gradwire.compression.codec import DecodedGradient

SLICE_ELEMENTS = 1 << 18  # (index, value) pairs of all senders together sorted at once (2 MB of indices)
PEEL_BELOW = 0.0  # a sender agreeing less than this is taken out of the others' references (``agreements``)
# With two senders that disagree nothing says which one points away (two honest DeMo workers, error
# feedback 0.999, sat at -0.3 to -0.4 for rounds late in benchmarks.quality): agreement needs three.
MIN_SENDERS = 3


def agreements(
    decoded: Sequence[DecodedGradient], weights: Sequence[float], chunk_numels: Sequence[int]
) -> list[float | None]:
    """``leave_one_out``, with the references cleared of senders that point away: while the sender that
    agrees least is below ``PEEL_BELOW``, it is taken out of the others' references (it is still measured,
    against the rest) and everyone is measured again, peeling fewer than half of the senders in all.

    Without it, one sign flipper among two honest senders cancels each honest one's peer in its reference:
    their agreement falls to anywhere in -0.81 to +0.96, and a run of such rounds would strike them too.
    With it they agree at +0.81 or more. Fewer than ``MIN_SENDERS`` senders of weight > 0: nothing measured."""
    w = [float(x) for x in weights]
    if sum(x > 0 for x in w) < MIN_SENDERS:
        return [None] * len(decoded)
    peeled = 0
    while True:
        got = leave_one_out(decoded, w, chunk_numels)
        if 2 * (peeled + 1) >= len(decoded):
            return got
        worst = min(((a, i) for i, a in enumerate(got) if a is not None and w[i]), default=None)
        if worst is None or worst[0] >= PEEL_BELOW:
            return got
        w[worst[1]] = 0.0
        peeled += 1


def leave_one_out(
    decoded: Sequence[DecodedGradient], weights: Sequence[float], chunk_numels: Sequence[int]
) -> list[float | None]:
    """Per sender, the cosine of its payload against the ``weights``-weighted sum of the others', over the
    coefficients they share; ``None`` where there is nothing to measure: a lone sender, others of weight 0,
    or nothing (a zero norm) on the shared coefficients, on either side. A sender of weight 0 is measured
    but counts in no other's reference. ``chunk_numels``: each chunk group's chunk size
    (``codec.plan.groups``)."""
    n = len(decoded)
    if len(weights) != n:
        raise ValueError(f"{n} payloads, {len(weights)} weights")
    if n < 2:
        return [None] * n
    first = decoded[0]
    device = first.dense[0].device if first.dense else first.indices[0].device if first.indices else "cpu"
    w = [float(x) for x in weights]
    weight = torch.tensor(w, dtype=torch.float64, device=device)  # (n,)
    # (n, 3): per sender, over the coefficients it shares, <own, others>, |own|^2 and |others|^2
    sums = torch.zeros(n, 3, dtype=torch.float64, device=device)
    for gi in range(len(chunk_numels)):
        chunks = first.indices[gi].shape[0]
        rows = max(1, SLICE_ELEMENTS // max(1, sum(d.indices[gi].shape[1] for d in decoded)))
        for lo in range(0, chunks, rows):
            parts = [(d.indices[gi][lo : lo + rows], d.values[gi][lo : lo + rows].double()) for d in decoded]
            _add_group_slice(parts, weight, sums)
    for ti in range(len(first.dense)):
        values = [d.dense[ti].double() for d in decoded]  # (numel,) each
        total = sum(v * wi for v, wi in zip(values, w))
        for s, own in enumerate(values):
            others = total - own * w[s]
            sums[s] += torch.stack([torch.dot(own, others), torch.dot(own, own), torch.dot(others, others)])
    out: list[float | None] = []
    for d, o, t in sums.tolist():
        norm = math.sqrt(o * t)
        out.append(max(-1.0, min(1.0, d / norm)) if norm > 0 else None)
    return out


def _add_group_slice(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: torch.Tensor, sums: torch.Tensor
) -> None:
    """Add one slice of one chunk group to the per-sender sums (``leave_one_out``). ``parts``: per sender
    its (B, k) indices and float64 values of the slice's B chunks; ``weights``: (n,) float64.

    Every sender's pairs of a chunk are sorted by (index, sender): a run of one index is everyone who sent
    that coefficient, and within it a run of one sender is that sender's listings of it. Sums over those
    runs give per coefficient the weighted total and how often senders of weight > 0 listed it, and per
    (sender, coefficient) its summed value and how often it listed it: O(B L log L) for L pairs a chunk
    (all senders'), and no (B, chunk_numel) buffer."""
    n = len(parts)
    listed = sum(idx.shape[1] for idx, _ in parts)  # pairs a chunk, all senders together
    if parts[0][0].shape[0] == 0 or listed == 0:
        return
    sender = torch.cat([torch.full_like(idx, s) for s, (idx, _) in enumerate(parts)], dim=1)  # (B, L)
    keys, order = (torch.cat([idx for idx, _ in parts], dim=1) * n + sender).sort(dim=1)  # (B, L)
    vals = torch.cat([v for _, v in parts], dim=1).gather(1, order).view(-1)  # (B L,)
    _, coefficient = _runs(keys // n)  # (B L,): the run of its index
    first, pair = _runs(keys)  # (B L,): a pair's first listing (where it is counted); the run of its pair
    sender = keys.remainder(n).view(-1)  # (B L,)
    w = weights[sender]  # (B L,)
    counted = (w != 0).double()  # a sender of weight 0 is in no one's reference
    zeros = torch.zeros_like(vals)  # no more runs than elements: sums over runs need no count of them (no sync)
    total = zeros.index_add(0, coefficient, vals * w)[coefficient]  # (B L,): the weighted sum of all senders
    hits = zeros.index_add(0, coefficient, counted)[coefficient]  # listings by senders of weight > 0
    mine = zeros.index_add(0, pair, vals)[pair]  # the sender's summed value (a repeated index sums)
    mine_hits = zeros.index_add(0, pair, torch.ones_like(vals))[pair]  # how often the sender listed it
    others = total - mine * w
    # A coefficient counts once however often the sender lists it, and only where another sent it too.
    share = (first & (hits - mine_hits * counted > 0)).double()
    terms = torch.stack([mine * others, mine * mine, others * others], dim=1) * share.unsqueeze(1)  # (B L, 3)
    sums.index_add_(0, sender, terms)


def _runs(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of equal ``keys`` (rows sorted along dim 1; a run never spans two rows), per element flattened:
    whether it starts its run, and its run's number counted from 0 in row-major order, (rows * cols,) each."""
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[:, 1:] = keys[:, 1:] != keys[:, :-1]
    starts = starts.view(-1)
    return starts, starts.cumsum(0).sub_(1)
