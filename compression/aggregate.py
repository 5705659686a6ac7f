"""Aggregation of many senders in the DCT-coefficient domain, with one inverse DCT per chunk group.

Senders' validated payloads are summed coefficient by coefficient (weighted, e.g. by token counts), then
normalised and transformed back once: the cost of the inverse DCT does not grow with the number of
senders. With one or two senders the sum is still sparse, and the inverse and the norm are taken straight
from the (index, value) pairs instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence

import torch

from gradwire.compression import products
from gradwire.compression.codec import CompressedGradient, DecodedGradient, GradientCodec, Normalize
from gradwire.compression.dct import dct_basis, idct_chunks
from gradwire.compression.lowrank import Factors
from gradwire.compression.plan import ChunkGroup, ModelPlan


class Aggregator:
    """Sums senders' payloads as they arrive; one inverse DCT per chunk group at the end.

    ``add`` validates the whole payload before it accumulates anything, so a malformed payload raises
    ``PayloadError`` and leaves the running sum exactly as it was. ``normalize="mean"`` divides by the
    total weight; ``"per_coordinate"`` divides each coefficient by the weight of the senders that sent it
    (dense tensors are sent whole by everyone, so both agree there): the mean over the senders that kept
    it, as templar's ``scatter_reduce(reduce="mean", include_self=False)``. Either way a clip ``scale``
    shrinks that sender's values but not the weight divided by: a clipped sender counts for less, it does
    not make the others count for more.

    With few senders the sum is sparse: k coefficients per chunk from each. Then each sender's inverse DCT
    is computed straight from its coefficients, ``X = (D_r[u] * vals)^T @ D_c[v]``: 2rck FLOPs per chunk
    and sender instead of 2rc(r + c), and no dense coefficient buffer; the senders' transforms are
    weighted and summed in order. Under ``mean`` a sender's transform does not depend on the others, so a
    holder that knows one payload early (a worker, its own) computes it ahead (``with_inverse``) and its
    replay pays for the others' alone; so does a sole sender's under ``per_coordinate``. With several senders
    ``per_coordinate`` weighs each kept coefficient by the weight of the senders that kept it, found by
    sorting the senders' indices of a chunk together (``_held_shares``): still their payloads' cost, not
    the model's. Past that, the result scatter-adds the senders into dense coefficient sums, in the order they
    came; until the result is read they are held, and the norm is taken from their pairs, as long as those
    stay under a quarter of the coefficients (then they are summed as they arrive, which keeps memory
    bounded however many there are).

    ``dtype=torch.float64`` sums and transforms in float64 and rounds once to float32 at the end: then
    devices that sum in another order (a GPU against a CPU) get the same float32 bits but in cases as rare
    as a float64 rounding error landing on a float32 rounding boundary. Replicas on mixed device kinds
    replay this way (``AggregationRule.exact``).
    """

    def __init__(
        self,
        codec: GradientCodec,
        normalize: Normalize = "mean",
        *,
        sparse: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if normalize not in ("mean", "per_coordinate"):
            raise ValueError(f"normalize must be 'mean' or 'per_coordinate', got {normalize!r}")
        self.codec = codec
        self.dtype = dtype
        self.normalize = normalize
        self.total_weight = 0.0
        self.senders = 0
        plan, device = codec.plan, codec.device
        self._sums: list[torch.Tensor] | None = None  # dense coefficient sums, once senders are spilled
        self._hits: list[torch.Tensor] | None = None
        # Decoded senders not yet spilled: (payload, weight x scale, weight). Up to ``_max_held`` the result sums
        # their inverse DCTs (sparse); beyond, the result spills them into dense sums when it is read, and until
        # then the norm is still taken from their pairs (the coordinator reads only the norm before its next
        # orders). Held pairs stay under a quarter of the coefficients; a sender past that spills them at once.
        self._held: list[tuple[DecodedGradient, float, float]] = []
        self._max_held = _max_sparse_senders(plan) if sparse and codec.config.use_dct else 0
        self._held_pairs = 0
        self._max_held_pairs = sum(g.num_chunks * g.chunk_numel for g in plan.groups) // 4 if sparse else 0
        # Dense tensors' weighted sums. Those sent whole are slices of one flat buffer, so that a round adds and
        # measures them in one call each, however many there are (opt-125m: 122 vectors). A factored matrix's
        # (LOW_RANK) stays its senders' factors, each with its weight, until someone reads the sum
        # (``_dense_sum``): a norm or a check costs the factors' bytes.
        whole = plan.whole
        numel = max((s.stop for s in whole.values()), default=0)
        self._whole = torch.zeros(numel, device=device, dtype=dtype)
        self._products: dict[int, torch.Tensor] = {}  # factored matrices' sums, once read
        self._factored: dict[int, list[tuple[products.Products, float]]] = {}  # by dense tensor: senders' tensors
        self._sole_norm: float | None = None  # a sole sender's known norm, times its scale (``add``)

    def add(
        self,
        payload: CompressedGradient | DecodedGradient,
        weight: float = 1.0,
        scale: float = 1.0,
        norm: float | None = None,
    ) -> None:
        """Add one sender with ``weight`` (its share of the mean) times ``scale`` (a clip factor in [0, 1]:
        the sender counts for less, the total weight the mean divides by stays). ``norm``: the payload's own L2
        norm where already taken (``robust.payload_norm``, as it arrived): the aggregate of a sole sender is
        its payload times its scale, so ``norm()`` is then this times that, not another pass over the payload
        (2.9 ms for opt-125m's gradient-mode payload on one core)."""
        weight, scale = float(weight), float(scale)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and non-negative, got {weight}")
        if not (math.isfinite(scale) and 0 <= scale <= 1):
            raise ValueError(f"scale must be in [0, 1], got {scale}")
        d = payload if isinstance(payload, DecodedGradient) else self.codec.decode(payload)
        effective = weight * scale if scale != 1.0 else weight
        pairs = sum(i.numel() for i in d.indices)
        if self._sums is None and (
            len(self._held) < self._max_held or self._held_pairs + pairs <= self._max_held_pairs
        ):
            self._held.append((d, effective, weight))
            self._held_pairs += pairs
        else:
            self._spill()
            self._scatter(d, effective, weight)
        # Each product rounded first, as the coefficient sums do (not fused into the add): then the sum of two
        # senders is the same bits in either order.
        plan, values = self.codec.plan, products.items(d.dense)
        if plan.whole:  # every tensor sent whole in one call
            self._whole.add_(torch.cat([values[i] for i in plan.whole]).to(self.dtype).mul_(effective))
        for i in plan.factored:
            if isinstance(values[i], Factors) and i not in self._products:
                assert isinstance(d.dense, products.Products)
                self._factored.setdefault(i, []).append((d.dense, effective))
            else:  # multiplied out already, or its sum was read before this sender came
                self._dense_sum(i).add_(d.dense[i].to(self.dtype) * effective)
        self._sole_norm = norm * scale if self.senders == 0 and norm is not None else None
        self.total_weight += weight
        self.senders += 1

    def _spill(self) -> None:
        """Switch to dense coefficient sums (allocated here), adding every held sender."""
        if self._sums is not None:
            return
        plan, device = self.codec.plan, self.codec.device
        self._sums = [torch.zeros(g.num_chunks, g.chunk_numel, device=device, dtype=self.dtype) for g in plan.groups]
        self._hits = [torch.zeros_like(s) for s in self._sums] if self.normalize == "per_coordinate" else None
        for d, effective, weight in self._held:
            self._scatter(d, effective, weight)
        self._held, self._held_pairs = [], 0

    def _spill_past_sparse(self) -> None:
        """More senders held than the sparse path sums (held for the norm): into the dense sums now, in the
        order they came, the same bits as scattering each as it arrived."""
        if self._sums is None and len(self._held) > self._max_held:
            self._spill()

    def _scatter(self, d: DecodedGradient, weight: float, hit_weight: float) -> None:
        """Add ``weight`` x the sender's values, and ``hit_weight`` (its unclipped weight) to the weight of
        every coefficient it sent (``per_coordinate``)."""
        assert self._sums is not None
        for gi, (idx, vals) in enumerate(zip(d.indices, d.values)):
            vals = vals.to(self.dtype)
            self._sums[gi].scatter_add_(1, idx, vals * weight)
            if self._hits is not None:
                self._hits[gi].scatter_add_(1, idx, torch.full_like(vals, hit_weight))

    def _coefficients(self, gi: int) -> torch.Tensor:
        """Group ``gi``'s normalised coefficient sums, (B, chunk_numel)."""
        if self._sums is None:
            group = self.codec.plan.groups[gi]
            acc = torch.zeros(group.num_chunks, group.chunk_numel, device=self.codec.device, dtype=self.dtype)
            for (d, _, _), share in zip(self._held, self._held_shares(gi, 0, group.num_chunks)):
                acc.scatter_add_(1, d.indices[gi], d.values[gi].to(self.dtype) * share)
            return acc
        if self._hits is None:
            return self._sums[gi] / self.total_weight
        # Each sum over its hit weight. Where no sender kept a coefficient both are 0 (a sender of weight 0 adds
        # its values times 0), and 0 over the clamp is that same 0: the bits of ``where(hits > 0, sums / hits,
        # sums)`` in two passes over the group instead of four.
        return self._sums[gi] / self._hits[gi].clamp_min(1e-30)

    def coefficient_groups(self) -> Iterator[torch.Tensor]:
        """The normalised aggregate in the coefficient domain, a chunk group at a time: (B, chunk_numel) each,
        in plan order (``GradientCodec.compress_coefficients`` re-compresses it)."""
        self._check_nonempty()
        self._spill_past_sparse()
        return (self._coefficients(gi) for gi in range(len(self.codec.plan.groups)))

    def dense_values(self) -> Iterator[torch.Tensor]:
        """The normalised aggregate of the dense (uncompressed) tensors, flat, in plan order."""
        self._check_nonempty()
        return (self._dense_sum(i) / self.total_weight for i in range(len(self.codec.plan.dense)))

    def _dense_sum(self, i: int) -> torch.Tensor:
        """Dense tensor ``i``'s weighted sum; a factored matrix's senders multiplied out and added in the order
        they came (the bits of adding each product as it came), once, on first read."""
        plan = self.codec.plan
        if (whole := plan.whole.get(i)) is not None:
            return self._whole[whole]
        acc = self._products.get(i)
        if acc is None:
            acc = self._products[i] = torch.zeros(plan.dense[i].numel, device=self.codec.device, dtype=self.dtype)
            for dense, effective in self._factored.pop(i, []):  # a product made ahead (a worker's own) is reused
                acc.add_(dense[i].to(self.dtype) * effective)
        return acc

    def norm(self) -> float:
        """L2 norm of ``result()``, without the inverse DCT: the transform is orthonormal.

        Held senders (the sparse path) cost their payloads, not the model (``_held_norm_sq``): the same
        coefficient sums in ``dtype``, their squares added up in float64. (The float32 norm of a dense
        buffer of them, taken before, was off by up to 2e-5 relative at gpt-80m size, 20k chunks at top-32;
        this is within 1e-13.) Spilled sums: the norm of each group in ``dtype``; the tensors sent whole: one
        norm of their flat buffer in ``dtype``; factored matrices: from their senders' k x k products. The
        parts combine in float64."""
        self._check_nonempty()
        if self.senders == 1 and self._sole_norm is not None:  # the sender's payload times its scale
            return self._sole_norm
        groups = range(len(self.codec.plan.groups))
        if self._sums is None:
            parts = [self._held_norm_sq(gi).sqrt() for gi in groups]
        else:
            parts = [torch.linalg.vector_norm(self._coefficients(gi)).double() for gi in groups]
        if self._whole.numel():  # the tensors sent whole, in one call
            parts.append((torch.linalg.vector_norm(self._whole) / self.total_weight).double())
        if self._products:  # factored matrices' sums read already
            summed = torch._foreach_norm(list(self._products.values()))
            parts.append((torch.stack(summed) / self.total_weight).double())
        senders = list(self._factored.items())
        factored = [[(dense.items[i], w) for dense, w in held] for i, held in senders]
        if factored:  # the factored matrices' senders: ||sum_s w_s A_s B_s|| from k x k products (each sender's
            known = [[dense.norms_sq()[i] for dense, _ in held] for i, held in senders]  # own, kept from its clip)
            parts.append(products.sum_norm_sq(factored, known).clamp_min(0).sqrt() / self.total_weight)
        if not parts:
            return 0.0
        return float(torch.linalg.vector_norm(torch.cat([p.to(parts[0].device).reshape(-1) for p in parts])))

    def _held_norm_sq(self, gi: int) -> torch.Tensor:
        """The squared norm of group ``gi``'s normalised sum of the held senders, from their (index, value)
        pairs: a slice of chunks at a time, every sender's pairs of a chunk sorted by index, each run of one
        index summed (in ``dtype``, senders in order, as ``_coefficients`` sums them; under ``per_coordinate``
        over the weight of the senders in the run), squared and added up in float64. Sorting k pairs a sender
        and chunk, not a (num_chunks, chunk_numel) buffer."""
        held = [(d.indices[gi], d.values[gi]) for d, _, _ in self._held]
        total = torch.zeros((), dtype=torch.float64, device=held[0][0].device)
        listed = sum(idx.shape[1] for idx, _ in held)  # pairs a chunk, all senders together
        if listed == 0:
            return total
        # A sole sender whose rows increase (the codec sends them so; Elias-Fano's were checked at decode): the sort
        # below would leave every pair in place as a run of its own, so its sums are its values (the same bits).
        sole = self._held[0][0] if len(self._held) == 1 else None
        sorted_already = sole is not None and (sole.increasing or _increasing(held[0][0]))
        # Kept-mean's runs are divided by the weight of the senders in them, found by the same sort.
        per_run = self.normalize == "per_coordinate" and not sorted_already
        rows = max(1, NORM_SLICE_PAIRS // listed)
        for lo in range(0, held[0][0].shape[0], rows):
            shares = [e for _, e, _ in self._held] if per_run else self._held_shares(gi, lo, lo + rows)
            scaled = [v[lo : lo + rows].to(self.dtype) * share for (_, v), share in zip(held, shares)]
            vals = scaled[0] if len(scaled) == 1 else torch.cat(scaled, dim=1)  # one sender: no copy to join
            if sorted_already:
                sums = vals.view(-1)
            else:
                idx = torch.cat([i[lo : lo + rows] for i, _ in held], dim=1)  # (b, listed)
                idx, order = idx.sort(dim=1, stable=True)  # stable: a run keeps the senders' order
                vals = vals.gather(1, order)
                runs = _run_ids(idx)  # (b * listed,)
                # No more runs than pairs: the spare zeros add nothing, and no count of runs is waited for.
                sums = torch.zeros(runs.shape[0], dtype=self.dtype, device=idx.device)
                sums.index_add_(0, runs, vals.view(-1))
                if per_run:
                    hits = self._run_weights(scaled, order, runs)
                    sums = torch.where(hits > 0, sums / hits.clamp_min(1e-30), 0.0)
            total += sums.double().square().sum()
        return total

    def result(self) -> dict[str, torch.Tensor]:
        """The normalised aggregate as dense float32 tensors, by name in plan order."""
        return in_plan_order(self.codec, self.parts())

    def parts(self) -> Iterator[dict[str, torch.Tensor]]:
        """``result()`` a few tensors at a time (``member_slices``: runs of a chunk group's tensors of at most
        ``SLICE_ELEMENTS`` between them, or one larger tensor; then the dense tensors): a caller that keeps
        only some of each (a rank's shard) never holds the whole aggregate, nor the inverse transform's
        working memory for more than a slice. Every holder slices alike, so replicas stay bit-identical."""
        self._check_nonempty()
        self._spill_past_sparse()
        codec = self.codec
        for gi, group in enumerate(codec.plan.groups):
            sparse = self._sums is None and self._held
            fused = self._sums is not None and self._hits is None and codec.config.use_dct
            coefficients = None if sparse or fused else self._coefficients(gi)
            for lo, hi in member_slices(group):
                if sparse:
                    stack = self._held_inverse(gi, lo, hi)
                elif fused:  # the mean's division rides on the IDCT basis instead of costing a pass
                    sums = self._sums[gi][lo:hi].view(hi - lo, *group.chunk_shape)
                    stack = idct_chunks(sums, 1.0 / self.total_weight)
                else:
                    stack = coefficients[lo:hi].view(hi - lo, *group.chunk_shape)
                    if codec.config.use_dct:
                        stack = idct_chunks(stack)
                yield unchunk_group(codec, group, stack.float(), lo, hi)  # float64 sums round once, here
        if codec.plan.dense:
            yield {
                t.name: (self._dense_sum(i) / self.total_weight).float().view(t.shape)
                for i, t in enumerate(codec.plan.dense)
            }

    def _held_inverse(self, gi: int, lo: int, hi: int) -> torch.Tensor:
        """The weighted sum of the held senders' inverse DCTs of chunks ``lo:hi`` of group ``gi``: each
        sender's transform (computed ahead, or here) times its share (``_held_shares``; a share per kept
        coefficient multiplies its values before the transform), added in sender order."""
        stack = None
        alone = len(self._held) == 1
        for (d, _, _), share in zip(self._held, self._held_shares(gi, lo, hi)):
            if isinstance(share, torch.Tensor):  # each kept coefficient's own share: weighed before the transform
                term = sender_inverse(self.codec, d, gi, lo, hi, self.dtype, share)
                stack = term if stack is None else stack.add_(term)
                continue
            ahead = d.inverse.get((gi, lo, hi)) if d.inverse is not None else None
            if ahead is not None and ahead.dtype == self.dtype:
                # A sole sender's term is the sum itself, read as it is; otherwise a new tensor, which the next
                # senders are added into: the term computed ahead stays as it was either way.
                term = ahead if alone and share == 1.0 else ahead * share
            else:
                term = sender_inverse(self.codec, d, gi, lo, hi, self.dtype)
                if share != 1.0:
                    term.mul_(share)
            stack = term if stack is None else stack.add_(term)
        assert stack is not None
        return stack

    def _held_shares(self, gi: int, lo: int, hi: int) -> list[float | torch.Tensor]:
        """Each held sender's share of the aggregate for chunks ``lo:hi`` of group ``gi``: under ``mean`` its
        weight x scale over the total weight; under ``per_coordinate`` a sole sender's scale (1.0 unclipped:
        ``x * 1.0`` is ``x``, bit for bit) where no chunk names an index twice, and otherwise a (hi - lo, k)
        share of each kept coefficient, its weight x scale over the weight of the senders that kept that
        coefficient, each time they named it (found by sorting the senders' indices of a chunk together, as
        ``_held_norm_sq`` does; 0 where that weight is)."""
        if self.normalize == "mean":
            return [effective / self.total_weight for _, effective, _ in self._held]
        if len(self._held) == 1 and (self._held[0][0].increasing or _increasing(self._held[0][0].indices[gi][lo:hi])):
            _, effective, weight = self._held[0]  # no index twice: every coefficient is this sender's alone
            return [effective / weight if weight > 0 else 0.0]
        idx = [d.indices[gi][lo:hi] for d, _, _ in self._held]
        keys, order = torch.cat(idx, dim=1).sort(dim=1, stable=True)
        runs = _run_ids(keys)
        hit = self._run_weights(idx, order, runs)
        kept = torch.empty(keys.shape, dtype=self.dtype, device=keys.device)
        kept.scatter_(1, order, hit[runs].view_as(keys))  # each pair's, in sender order
        return [
            torch.where(h > 0, effective / h.clamp_min(1e-30), 0.0)
            for h, (_, effective, _) in zip(kept.split([i.shape[1] for i in idx], dim=1), self._held)
        ]

    def _run_weights(self, pieces: Sequence[torch.Tensor], order: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
        """The weight of the senders in each run of a slice's pairs sorted by index: ``pieces`` are the held
        senders' (b, k) pairs of the slice (any tensor of their shape), ``order`` and ``runs`` the sort's."""
        weights = torch.cat(
            [torch.full(p.shape, w, dtype=self.dtype, device=p.device) for p, (*_, w) in zip(pieces, self._held)], dim=1
        )
        hits = torch.zeros(runs.shape[0], dtype=self.dtype, device=runs.device)
        return hits.index_add_(0, runs, weights.gather(1, order).view(-1))

    def _check_nonempty(self) -> None:
        if self.total_weight <= 0:
            raise ValueError("nothing to aggregate: no payload with positive weight was added")


SLICE_ELEMENTS = 1 << 22  # a slice of a chunk group that ``Aggregator.parts`` decodes at once (16 MB in fp32)
NORM_SLICE_PAIRS = 1 << 18  # (index, value) pairs ``Aggregator.norm`` sorts at once (2 MB of indices)


def _increasing(keys: torch.Tensor) -> bool:
    """Whether every row of ``keys`` strictly increases (Elias-Fano coded indices do, checked at decode)."""
    return keys.shape[1] < 2 or bool((keys[:, 1:] > keys[:, :-1]).all())


def _run_ids(keys: torch.Tensor) -> torch.Tensor:
    """Per element of ``keys`` (rows sorted along dim 1), flattened, the number of its run of equal keys
    (a run never spans two rows), counted from 0 in row-major order: (rows * cols,) int64."""
    new = torch.ones_like(keys, dtype=torch.bool)
    new[:, 1:] = keys[:, 1:] != keys[:, :-1]
    return new.view(-1).cumsum(0).sub_(1)


def member_slices(group: ChunkGroup, max_elements: int | None = None) -> Iterator[tuple[int, int]]:
    """The group's chunks ``lo:hi`` in runs of whole member tensors of at most ``max_elements`` between them
    (default ``SLICE_ELEMENTS``; a larger tensor alone); pure, so every holder of a replica cuts alike."""
    most = max(1, (max_elements or SLICE_ELEMENTS) // group.chunk_numel)
    lo = hi = 0
    for t, off in zip(group.members, group.offsets):
        if hi > lo and off + t.num_chunks - lo > most:
            yield lo, hi
            lo = off
        hi = off + t.num_chunks
    if hi > lo:
        yield lo, hi


def unchunk_group(
    codec: GradientCodec, group: ChunkGroup, stack: torch.Tensor, lo: int = 0, hi: int | None = None
) -> dict[str, torch.Tensor]:
    """A chunk group's member tensors, by name, from the (num_chunks, *chunk_shape) stack of its chunks
    ``lo:hi`` (default: all of them), which hold whole members."""
    hi = group.num_chunks if hi is None else hi
    return {
        t.name: codec._unchunk(stack[off - lo : off - lo + t.num_chunks], t)
        for t, off in zip(group.members, group.offsets)
        if lo <= off < hi
    }


def in_plan_order(codec: GradientCodec, parts: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One dict of every tensor of ``parts``, in the plan's order (the payload's)."""
    out = {name: t for part in parts for name, t in part.items()}
    return {t.name: out[t.name] for t in codec.plan.tensors}


def sender_inverse(
    codec: GradientCodec,
    d: DecodedGradient,
    gi: int,
    lo: int,
    hi: int,
    dtype: torch.dtype = torch.float32,
    shares: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inverse DCT of one sender's kept coefficients of chunks ``lo:hi`` of group ``gi``, unweighted (or
    each value times its ``shares``, (hi - lo, k)), straight from its (index, value) pairs: (hi - lo,
    *chunk_shape) in ``dtype``."""
    group = codec.plan.groups[gi]
    idx, vals = d.indices[gi][lo:hi], d.values[gi][lo:hi].to(dtype)  # (B, k)
    if shares is not None:
        vals = vals * shares
    if len(group.chunk_shape) == 1:
        (n,) = group.chunk_shape
        basis = dct_basis(n, dtype, vals.device)
        picked = torch.index_select(basis, 0, idx.reshape(-1)).view(*idx.shape, n)  # (B, k, n)
        return torch.bmm(vals.unsqueeze(1), picked).squeeze(1)  # (B, 1, k) @ (B, k, n) -> (B, n)
    r, c = group.chunk_shape
    b, k = idx.shape
    d_r, d_c = dct_basis(r, dtype, vals.device), dct_basis(c, dtype, vals.device)
    # Coefficient (u, v) with value a contributes a * outer(D_r[u, :], D_c[v, :]).
    rows = torch.index_select(d_r, 0, (idx // c).reshape(-1)).view(b, k, r).mul_(vals.unsqueeze(-1))
    cols = torch.index_select(d_c, 0, (idx % c).reshape(-1)).view(b, k, c)
    return torch.bmm(rows.transpose(1, 2), cols)  # (B, r, k) @ (B, k, c) -> (B, r, c)


def sparse_senders(codec: GradientCodec) -> int:
    """How many senders an aggregate of ``codec``'s payloads sums on its sparse path (0: never)."""
    return _max_sparse_senders(codec.plan) if codec.config.use_dct else 0


def sums_sender_inverses(codec: GradientCodec, mode: str, senders: int) -> bool:
    """Whether an aggregate of ``senders`` payloads of ``codec`` under rule ``mode`` sums each sender's own
    inverse DCT, one that can be taken ahead (``with_inverse``): the sparse path's mean, or a sole sender's
    kept-mean (with several, each kept coefficient's share depends on who else kept it)."""
    if senders > sparse_senders(codec):
        return False
    return mode == "mean" or (mode == "kept-mean" and senders == 1)


def inverse_numel(codec: GradientCodec) -> int:
    """How many elements ``with_inverse`` holds for a payload of ``codec``: every chunk of every group."""
    return sum(g.num_chunks * g.chunk_numel for g in codec.plan.groups)


def with_inverse(codec: GradientCodec, d: DecodedGradient, dtype: torch.dtype = torch.float32) -> DecodedGradient:
    """``d`` with its inverse DCT computed ahead (``DecodedGradient.inverse``), slice by slice as an
    aggregate's ``parts`` cuts it, so both give the same bits. Costs a model's worth of ``dtype``."""
    inverse = {
        (gi, lo, hi): sender_inverse(codec, d, gi, lo, hi, dtype)
        for gi, group in enumerate(codec.plan.groups)
        for lo, hi in member_slices(group)
    }
    return dataclasses.replace(d, inverse=inverse)


def _max_sparse_senders(plan: ModelPlan) -> int:
    """How many senders the sparse inverse DCT beats the dense one for, in every group (FLOP count)."""
    limits = []
    for g in plan.groups:
        dense_width = sum(g.chunk_shape) if len(g.chunk_shape) == 2 else g.chunk_shape[0]
        # Sparse: 2 * numel * k a sender; dense: 2 * numel * (r + c), or 2 * n * n for 1-D, plus zeroing and
        # scattering into the coefficient sums. Ask for a 2x margin: the gathers and small batched matmuls
        # run below the dense matmuls' rate (measured on CPU, gpt-10m's 7168 chunks of 64 x 64 at top-32,
        # one thread: 0.17 s a sender, 0.40 s dense).
        limits.append(dense_width // (2 * g.k))
    return min(limits, default=0)
