"""A decoded payload's dense tensors, its factored matrices multiplied out only when someone reads them.

A matrix sent as low-rank factors (``lowrank.Factors``) costs its factors' bytes, but its product costs the
matrix's. Whoever only needs what the factors already say - a norm, an aggregate's running sum of senders,
an emptiness check - reads ``items`` (a tensor, or the factors) and pays for the payload; whoever reads the
list as tensors (``dense[i]``, iteration) gets each product, computed once on first read and kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from gradwire.compression.lowrank import CODE_LIMIT, Factors
from gradwire.compression.transfer import to_device

Item = torch.Tensor | Factors


class Products(Sequence[torch.Tensor]):
    """Flat dense tensors, some given as factors: ``self[i]`` is tensor ``i`` (a product multiplied out on
    ``device`` on first read, then kept); ``items`` are as given."""

    def __init__(self, items: Sequence[Item], device: torch.device | str) -> None:
        self.items: list[Item] = list(items)
        self.device = torch.device(device)
        self._made: dict[int, torch.Tensor] = {}
        self._norms_sq: dict[int, torch.Tensor] | None = None
        self._moved: dict[int, Factors] | None = None  # the factored items on ``device`` (``_on_device``)

    def norms_sq(self) -> dict[int, torch.Tensor]:
        """Each factored matrix's squared norm ``||A B||^2`` (float64, by index), from k x k products batched
        by shape: computed once, then kept, so that a sender's clip norm and the aggregate's norm share it."""
        if self._norms_sq is None:
            indices = [i for i, x in enumerate(self.items) if isinstance(x, Factors)]
            self._norms_sq = dict(zip(indices, item_norms_sq([self.items[i] for i in indices]).unbind()))
        return self._norms_sq

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        if isinstance(i, slice):
            raise TypeError("Products are read a tensor at a time")
        item = self.items[i]
        if isinstance(item, torch.Tensor):
            return item
        i = i % len(self.items)
        if i not in self._made:
            self._made[i] = self._on_device(i).decode(self.device).view(-1)
        return self._made[i]

    def _on_device(self, i: int) -> Factors:
        """Factored item ``i`` on ``device``: on first need every factored item's codes and scales are copied
        there together (``transfer.to_device``: a copy a dtype, not four a matrix); the items stay as given
        (where their norms are taken)."""
        item = self.items[i]
        assert isinstance(item, Factors)
        if item.a.device == self.device:
            return item
        if self._moved is None:
            indices = [j for j, x in enumerate(self.items) if isinstance(x, Factors)]
            fields = [field for j in indices for field in self.items[j].fields()]
            moved = iter(to_device(fields, self.device))
            self._moved = {j: Factors(*(next(moved) for _ in range(4))) for j in indices}
        return self._moved[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self.items)))


def items(dense: Sequence[torch.Tensor]) -> list[Item]:
    """``dense`` as given: a ``Products``' items (factors left as they are), or the tensors of a plain list."""
    return dense.items if isinstance(dense, Products) else list(dense)


def tensors(items: Sequence[Item]) -> list[torch.Tensor]:
    return [x for x in items if isinstance(x, torch.Tensor)]


def factored(items: Sequence[Item]) -> list[Factors]:
    return [x for x in items if isinstance(x, Factors)]


def factor_matrices(f: Factors, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``f``'s ``A`` (rows, k) and ``B`` (k, cols) in ``dtype``: codes times their scales (a batch of
    factors of one shape: (n, rows, k) and (n, k, cols))."""
    a = f.a.to(dtype) * f.a_scale.to(dtype).unsqueeze(-2)
    b = f.b.to(dtype) * f.b_scale.to(dtype).unsqueeze(-1)
    return a, b


def is_zero(f: Factors) -> bool:
    """Whether ``f``'s product is zero for certain: every rank-one term has a zero side."""
    a_live = (f.a != 0).any(dim=-2) & (f.a_scale != 0)  # (k,): column i of A is non-zero
    b_live = (f.b != 0).any(dim=-1) & (f.b_scale != 0)  # (k,): row i of B is non-zero
    return not bool((a_live & b_live).any())


def all_zero(items: Iterable[torch.Tensor | Factors]) -> bool:
    """Whether every one of ``items`` (a payload's values, dense tensors and factored matrices) is zero, a
    factored one read from its factors (``is_zero``); stops at the first that is not."""
    return all(is_zero(x) if isinstance(x, Factors) else not bool(x.any()) for x in items)


def sum_norm_sq(
    matrices: Sequence[Sequence[tuple[Factors, float]]], known: Sequence[Sequence[torch.Tensor]] | None = None
) -> torch.Tensor:
    """``sum_m || sum_s w_s A_ms B_ms ||^2``: per matrix ``m`` its senders' factors and weights, in float64
    from the k x k inner products of their codes (``code_gram``), matrices of one shape batched together; on
    the factors' device, no sync. ``known[m][s]``: ``||A_ms B_ms||^2`` where already computed
    (``Products.norms_sq``): then only the cross terms between senders are, and a matrix with one sender
    costs nothing."""
    device = next((terms[0][0].a.device for terms in matrices if terms), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    if known is not None and (
        pairs := [(w, n) for terms, norms in zip(matrices, known) for (_, w), n in zip(terms, norms)]
    ):
        squares = torch.tensor([w * w for w, _ in pairs], dtype=torch.float64, device=device)
        total += (squares * torch.stack([n.to(device) for _, n in pairs])).sum()  # one sum, not one add each
    by_shape: dict[tuple, list[Sequence[tuple[Factors, float]]]] = {}
    for terms in matrices:
        if terms and (known is None or len(terms) > 1):
            by_shape.setdefault((len(terms), *(tuple(f.a.shape) + tuple(f.b.shape) for f, _ in terms)), []).append(
                terms
            )
    for group in by_shape.values():
        senders = len(group[0])
        stacks = []
        for s in range(senders):  # sender s's factors of every matrix in the group, stacked, and its weights
            w = torch.tensor([terms[s][1] for terms in group], dtype=torch.float64, device=device)
            stacks.append((_stack([terms[s][0] for terms in group]), w))
        for s, (f_s, w_s) in enumerate(stacks):
            for t in range(s if known is None else s + 1, senders):
                f_t, w_t = stacks[t]
                term = (_inner(f_s, f_t) * (w_s * w_t)).sum()
                total += term if t == s else 2 * term
    return total


def norm_sq(factors: Sequence[Factors]) -> torch.Tensor:
    """``sum_f ||A_f B_f||^2`` in float64, factors of one shape batched together."""
    return item_norms_sq(factors).sum()


def item_norms_sq(factors: Sequence[Factors]) -> torch.Tensor:
    """``||A_f B_f||^2`` of each of ``factors`` (float64, in order), factors of one shape batched together."""
    device = factors[0].a.device if factors else torch.device("cpu")
    out = torch.zeros(len(factors), dtype=torch.float64, device=device)
    by_shape: dict[tuple, list[int]] = {}
    for i, f in enumerate(factors):
        by_shape.setdefault((*f.a.shape, *f.b.shape), []).append(i)
    for positions in by_shape.values():
        stacked = _stack([factors[i] for i in positions])
        out[positions] = _inner(stacked, stacked)
    return out


# A float32 holds every integer up to 2^24 exactly. A Gram matrix of codes whose largest product is p sums
# ``FLOAT32_EXACT // p`` rows at a time in float32 without rounding, in any order, and float64 holds the sum of
# such blocks of any matrix exactly: 1040 rows of any codes (127^2), 342,392 of int4 codes (7^2).
FLOAT32_EXACT = 2**24
ANY_CODES_ROWS = FLOAT32_EXACT // CODE_LIMIT**2


def exact_block_rows(x: torch.Tensor, y: torch.Tensor) -> int:
    """Rows of ``x`` and ``y`` (integer codes, (..., m, k)) whose products sum exactly in float32. Their
    largest codes are read (one wait for the device each) only where more rows than any codes allow are there."""
    if x.shape[-2] <= ANY_CODES_ROWS or not x.numel() or not y.numel():
        return ANY_CODES_ROWS
    peak_x = _peak(x)
    return FLOAT32_EXACT // max(peak_x * (peak_x if y is x else _peak(y)), 1)


def _peak(codes: torch.Tensor) -> int:
    """The largest code magnitude (codes are never -128: ``lowrank.CODE_LIMIT``)."""
    return int(torch.maximum(codes.amax(), codes.amin().neg()))


def code_gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x^T y`` of integer codes (n, m, p) and (n, m, q), exactly, as float64 (n, p, q): float32 products
    of blocks of ``exact_block_rows`` of the m rows (all of them, for int4 codes of any matrix here), summed
    in float64 (exact: see above; the same bits on any device and BLAS, where a product of scaled factors
    rounds by its summation order)."""
    xf = x.float()
    yf = xf if y is x else y.float()
    m, block = x.shape[-2], exact_block_rows(x, y)
    out = (xf[..., :block, :].mT @ yf[..., :block, :]).double()
    for i in range(block, m, block):
        out += (xf[..., i : i + block, :].mT @ yf[..., i : i + block, :]).double()
    return out


def _inner(f: Factors, g: Factors) -> torch.Tensor:
    """``<A_f B_f, A_g B_g>`` of each matrix of two stacked batches of one shape (n,), float64: from the k x k
    Gram matrices of their codes, ``(A_f^T A_g) * (B_f B_g^T)`` summed, each scaled by the terms' scales."""
    a = code_gram(f.a, f.a if g is f else g.a)  # (n, k, k): columns of A's codes
    b_f = f.b.mT
    b = code_gram(b_f, b_f if g is f else g.b.mT)  # rows of B's codes
    s_f = f.a_scale.double() * f.b_scale.double()  # (n, k): term i's scale, A's times B's
    s_g = g.a_scale.double() * g.b_scale.double()
    return (a * b * s_f[:, :, None] * s_g[:, None, :]).sum(dim=(1, 2))


def _stack(factors: Sequence[Factors]) -> Factors:
    return Factors(*(torch.stack(fields) for fields in zip(*(f.fields() for f in factors))))
