"""The gradient codec: dense gradients -> ``CompressedGradient`` -> (aggregated) dense gradients.

Compression, per chunk group (all tensors whose chunks share a shape):
  gather every member's chunks into one (B, r, c) stack -> chunk DCT (two matmuls) -> error feedback
  -> one top-k over all B chunks -> per-tensor quantization to LUT codes or sign bits (vectorized over
  tensors) -> bit-packed bytes.
Matrices sent as low-rank factors (``lowrank``) are factored together by shape: one stack, one batched power
iteration from the subspaces their error feedback carries (``factorization="power"``).
Decoding validates a payload against the plan; ``aggregate.Aggregator`` sums decoded senders in the
coefficient domain and runs a single inverse DCT per group.
No Python loop touches individual chunks; the loops that remain run over tensors or senders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from gradwire.compression import lowrank
from gradwire.compression.config import FORMAT_VERSION, CodecConfig
from gradwire.compression.dct import dct_chunks, fast_transform_dtype
from gradwire.compression.feedback import ErrorFeedback, ScopedFeedback
from gradwire.compression.packing import (
    ef_joinable,
    ef_nbytes,
    join_ef,
    pack12,
    pack_bits,
    pack_ef,
    pad_bits,
    unpack12_padded,
    unpack_bits,
    unpack_ef,
)
from gradwire.compression.payload import (
    GRADIENT,
    CompressedGradient,
    CompressedTensor,
    Encoding,
    NonFiniteInput,
    PayloadError,
    ValueFormat,
)
from gradwire.compression.plan import (
    FACTOR_FORMATS,
    ChunkGroup,
    ModelPlan,
    TensorPlan,
    coded_format,
    indices_nbytes,
    lut_nbytes,
    matrix_view,
    value_bits,
    values_nbytes,
)
from gradwire.compression.products import Products
from gradwire.compression.quant import Quantized, quantize, quantize_sign, sign_table, values_table
from gradwire.compression.select import topk_indices
from gradwire.compression.transfer import to_device

if TYPE_CHECKING:
    from gradwire.compression.aggregate import Aggregator

# Elias-Fano codes of a chunk group's tensors are decoded together up to this many bytes: a call per tensor
# costs a gradient of a hundred tensors milliseconds of host time, and one call over megabytes runs out of
# the cache (gpt-80m at top-143: 37 ms joined whole against 31 ms tensor by tensor).
JOINED_EF_BYTES = 1 << 16

# Shift, scale and raw values beyond this magnitude are rejected as malformed: no real gradient gets there. A
# sender refuses to compress such a value as it refuses NaN (``NonFiniteInput``): near float32's largest, the
# quantizer's range overflows, and the error feedback would take in NaN.
VALUE_LIMIT = 1e30

Normalize = Literal["mean", "per_coordinate"]

# Factored matrices of one shape are stacked at most this many elements at a time (256 MB of float32): the
# stack is a copy, and a large model's matrices of one shape can hold gigabytes.
FACTOR_BATCH_NUMEL = 1 << 26


@dataclasses.dataclass
class _GroupLayout:
    """Index arithmetic of one chunk group, computed once per plan."""

    row_member: torch.Tensor  # (B,) member index of every chunk, on the codec's device
    quantized: np.ndarray  # (M,) bool: member sends coded (LUT or SIGN) values
    value_starts: np.ndarray  # (M,) first value of each member in stack order
    pads: np.ndarray | None  # positions of odd-count pads among the group's unpacked indices
    pad_members: np.ndarray | None  # member owning each pad
    # Members whose Elias-Fano codes are decoded together, in payload order: runs of those whose codes fill
    # whole bytes (``packing.ef_joinable``), each of at most JOINED_EF_BYTES unless one member is larger.
    ef_runs: list[list[int]]


@dataclasses.dataclass
class DecodedGradient:
    """A validated payload as tensors: per group (B, k) chunk-local indices and values; dense values."""

    indices: list[torch.Tensor]  # per group, (B, k) int64
    values: list[torch.Tensor]  # per group, (B, k) float32
    dense: Sequence[torch.Tensor]  # per dense tensor, (numel,) float32
    # The inverse DCT of the kept coefficients, unweighted, by (group, first chunk, end chunk) of each
    # member slice, when computed ahead (``aggregate.with_inverse``): an aggregate that takes this sender
    # on its sparse path uses it instead of transforming the sender again.
    inverse: dict[tuple[int, int, int], torch.Tensor] | None = None
    # The factored (LOW_RANK) tensors' codes and scales, by name in plan order; their products are in
    # ``dense`` (a ``products.Products``: multiplied out when read). Checks that compare what senders sent
    # (``coordinator.copies``) read the codes.
    factors: dict[str, lowrank.Factors] = dataclasses.field(default_factory=dict)
    # Every row of every group's ``indices`` strictly increases, as checked at decode (Elias-Fano's code
    # allows nothing else): a sole sender's values are then its sums, and no one sorts or checks them again.
    increasing: bool = False


def _chunk_view(x: torch.Tensor, plan: TensorPlan) -> torch.Tensor:
    """A strided view of tensor x as its stack of chunks: (chunks, r, c) or (chunks, n). No copy."""
    if len(plan.chunk_shape) == 1:
        return x.reshape(-1, plan.chunk_shape[0])
    rows, cols = matrix_view(plan.shape)
    r, c = plan.chunk_shape
    return x.reshape(rows // r, r, cols // c, c).permute(0, 2, 1, 3)  # (R/r, C/c, r, c)


class GradientCodec:
    """Compresses, validates, decompresses and aggregates the gradients of one fixed set of tensors."""

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        config: CodecConfig | None = None,
        device: torch.device | str = "cpu",
        transform_dtype: torch.dtype | None = None,
        factorization: lowrank.Factorization = "power",
    ) -> None:
        """``transform_dtype``: what the sender's chunk DCT multiplies in (``None``: the device's fastest
        accurate one, ``dct.fast_transform_dtype``). A sender-side choice: the payload format is the same and
        decoding always runs in float32. So is ``factorization``, how factored matrices are factored
        (``lowrank.Factorization``: by default from the subspace the error feedback carries, refined by one
        power iteration; ``auto``, ``svd`` and ``randomized`` factor from scratch every time)."""
        self.config = config or CodecConfig()
        self.plan = ModelPlan.build(shapes, self.config)
        self.device = torch.device(device)
        self.transform_dtype = transform_dtype or fast_transform_dtype(self.device)
        # The one coded format of this codec (tensors that do not use it send raw float32), and its width.
        self._coded = coded_format(self.config)
        self._bits = value_bits(self._coded, self.config)
        self._elias_fano = self.config.indices == "elias-fano"
        self._layouts = [self._layout(g) for g in self.plan.groups]
        if factorization not in lowrank.FACTORIZATIONS:
            raise ValueError(f"factorization must be one of {', '.join(lowrank.FACTORIZATIONS)}, got {factorization!r}")
        self.factorization = factorization

    # ---------------------------------------------------------------- compress

    def compress(self, grads: Mapping[str, torch.Tensor], feedback: ErrorFeedback | None = None) -> CompressedGradient:
        """Compress ``grads`` (every planned tensor, any float dtype, any device).

        With ``feedback``, compresses ``m = beta * m + g`` instead of ``g`` and keeps what was not sent
        (including quantization error) in ``m`` for the next call. A NaN or infinity raises
        ``NonFiniteInput`` (the feedback has taken it in by then: reset it).
        """
        missing = [t.name for t in self.plan.tensors if t.name not in grads]
        if missing:
            raise KeyError(f"gradients missing for planned tensors: {missing[:5]}")
        groups = (self._coefficients(group, grads) for group in self.plan.groups)  # one at a time: (B, r*c)
        dense = (grads[t.name].detach().reshape(-1) for t in self.plan.dense)
        return self.compress_coefficients(groups, dense, feedback)

    def compress_coefficients(
        self, groups: Iterable[torch.Tensor], dense: Iterable[torch.Tensor], feedback: ErrorFeedback | None = None
    ) -> CompressedGradient:
        """Compress what is already in the coefficient domain: per chunk group its (B, chunk_numel)
        coefficients (the transformed chunks, as ``compress`` makes them), then each dense tensor's values
        flattened, in plan order (consumed one at a time). The same selection, quantization and error
        feedback as ``compress``: a coordinator re-compresses an aggregate this way with no inverse and
        forward transform between (``aggregate.Aggregator.coefficient_parts``)."""
        out: dict[str, CompressedTensor] = {}
        groups, dense = iter(groups), iter(dense)
        for gi, group in enumerate(self.plan.groups):
            coeffs = next(groups)
            if tuple(coeffs.shape) != (group.num_chunks, group.chunk_numel):
                raise ValueError(f"chunk group {gi}: expected ({group.num_chunks}, {group.chunk_numel}) coefficients")
            coeffs = feedback.accumulate(f"group{gi}", coeffs) if feedback is not None else coeffs.float()
            out.update(self._select(group, self._layouts[gi], coeffs, feedback is not None))
        factored, whole = [], []
        for t in self.plan.dense:
            values = next(dense).reshape(-1).float()
            if feedback is not None:
                values = feedback.accumulate(t.name, values)
            # factored by shape, and the rest quantized together, once every buffer is in
            (factored if t.encoding == Encoding.LOW_RANK else whole).append((t, values))
        out.update(self._encode_dense(whole, feedback is not None))
        out.update(self._encode_factored(factored, feedback))
        return CompressedGradient(self.config, tuple(out[t.name] for t in self.plan.tensors), FORMAT_VERSION)

    def _coefficients(self, group: ChunkGroup, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """All member chunks stacked (one strided copy per tensor, cast to the transform's dtype) and
        transformed, in that dtype (error feedback adds it into its float32 buffer)."""
        first = grads[group.members[0].name]
        device = first.device
        dtype = self.transform_dtype if self.config.use_dct else torch.float32
        stack = torch.empty((group.num_chunks, *group.chunk_shape), dtype=dtype, device=device)
        for t, off in zip(group.members, group.offsets):
            dst = stack[off : off + t.num_chunks]
            if len(group.chunk_shape) == 2:
                rows, cols = t.grid
                dst = dst.view(rows, cols, *group.chunk_shape)
            dst.copy_(_chunk_view(grads[t.name].detach(), t))
        if self.config.use_dct:
            stack = dct_chunks(stack)
        return stack.reshape(group.num_chunks, group.chunk_numel)

    def _select(
        self, group: ChunkGroup, layout: _GroupLayout, coeffs: torch.Tensor, update_feedback: bool
    ) -> dict[str, CompressedTensor]:
        """Top-k per chunk, quantize per tensor, subtract what is sent from ``coeffs`` if it is feedback."""
        k = group.k
        idx = topk_indices(coeffs, k, magnitude=True)  # (B, k), each chunk's in increasing order
        vals = coeffs.gather(1, idx)  # (B, k)
        # top-k ranks NaN and infinity first, and the DCT spreads one over its chunk: checking the kept
        # values finds any in the group (and any value past ``VALUE_LIMIT``, the largest of each chunk).
        finite = (vals.abs() < VALUE_LIMIT).all(dim=1)
        if not bool(finite.all()):
            row = int((~finite).nonzero()[0, 0])
            raise NonFiniteInput(group.members[int(layout.row_member[row])].name)
        m = len(group.members)
        q = None
        sent = vals
        if layout.quantized.any():
            rows = layout.row_member.to(coeffs.device)  # there already (``_layout``) but for a sender elsewhere
            seg = rows[:, None].expand(-1, k).reshape(-1)
            q = self._quantize(vals.reshape(-1), seg, m)
            if layout.quantized.all():
                sent = q.dequantized.view_as(vals)
            else:
                row_q = torch.from_numpy(layout.quantized).to(coeffs.device)[rows]
                sent = torch.where(row_q[:, None], q.dequantized.view_as(vals), vals)
        if update_feedback:
            coeffs.scatter_(1, idx, vals - sent)  # what stays behind: the unsent part of the kept coefficients
        idx_np = idx.to(torch.int16).cpu().numpy()
        vals_np = vals.cpu().numpy() if not layout.quantized.all() else None
        if q is not None:
            codes_np, lut_np = q.codes.view(vals.shape).cpu().numpy(), q.lut.cpu().numpy()
            shift_np, scale_np = q.shift.cpu().numpy(), q.scale.cpu().numpy()
        out = {}
        for mi, (t, off) in enumerate(zip(group.members, group.offsets)):
            rows = slice(off, off + t.num_chunks)
            if layout.quantized[mi]:
                fields = self._coded_fields(codes_np[rows], lut_np[mi], shift_np[mi], scale_np[mi])
            else:
                fields = {"values": vals_np[rows].astype("<f4").tobytes()}
            out[t.name] = CompressedTensor(
                t.name,
                t.shape,
                t.encoding,
                t.value_format,
                t.chunk_shape,
                t.k,
                self.pack_indices(idx_np[rows], t),
                **fields,
            )
        return out

    def pack_indices(self, idx: np.ndarray, t: TensorPlan) -> bytes:
        """A tensor's (chunks, k) kept indices in the settings' index coding (Elias-Fano: each row increasing)."""
        if self._elias_fano:
            return pack_ef(idx, t.chunk_numel)
        return pack12(idx.reshape(-1))

    def _quantize(self, values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> Quantized:
        """This codec's coded format for values (N,) of ``num_segments`` tensors; see ``quant``."""
        if self._coded == ValueFormat.SIGN:
            return quantize_sign(values, segment, num_segments)
        return quantize(values, segment, num_segments, self.config.bins, self.config.range_sigmas)

    def _coded_fields(self, codes: np.ndarray, lut: np.ndarray, shift: float, scale: float) -> dict[str, object]:
        """One tensor's ``values``, ``shift``, ``scale`` and ``lut`` fields in the coded format."""
        sign = self._coded == ValueFormat.SIGN
        return {
            "values": pack_bits(codes.reshape(-1), self._bits),
            "shift": float(shift),
            "scale": float(scale),
            "lut": b"" if sign else lut.astype("<f2").tobytes(),  # the sign table is implied, never sent
        }

    def _encode_dense(
        self, items: Sequence[tuple[TensorPlan, torch.Tensor]], update_feedback: bool
    ) -> dict[str, CompressedTensor]:
        """The tensors sent whole, each ``(plan, values)``: checked for NaN and infinity, quantized as the
        segments of one call (per tensor, as alone), and read back to the host a field at a time for all of
        them: on a GPU each read waits for the device, so a few reads a tensor would cost their round trips."""
        if not items:
            return {}
        finite = torch.stack([(values.abs() < VALUE_LIMIT).all() for _, values in items]).tolist()
        for ok, (t, _) in zip(finite, items):
            if not ok:
                raise NonFiniteInput(t.name)
        out = {}
        exact = [(t, v) for t, v in items if t.value_format == ValueFormat.FLOAT32]
        if exact:
            host = torch.cat([v for _, v in exact]).cpu().numpy().astype("<f4")
            for (t, v), part in zip(exact, np.split(host, np.cumsum([v.numel() for _, v in exact])[:-1])):
                out[t.name] = CompressedTensor(t.name, t.shape, t.encoding, t.value_format, (), 0, b"", part.tobytes())
                if update_feedback:
                    v.zero_()  # sent exactly
        coded = [(t, v) for t, v in items if t.value_format != ValueFormat.FLOAT32]
        if coded:
            sizes = [v.numel() for _, v in coded]
            values = torch.cat([v for _, v in coded])
            segment = torch.repeat_interleave(torch.arange(len(coded)), torch.tensor(sizes)).to(values.device)
            q = self._quantize(values, segment, len(coded))
            if update_feedback:
                for (_, v), sent in zip(coded, q.dequantized.split(sizes)):
                    v.sub_(sent)
            codes, lut, shift, scale = (x.cpu().numpy() for x in (q.codes, q.lut, q.shift, q.scale))
            for i, ((t, _), part) in enumerate(zip(coded, np.split(codes, np.cumsum(sizes)[:-1]))):
                fields = self._coded_fields(part, lut[i], shift[i], scale[i])
                out[t.name] = CompressedTensor(t.name, t.shape, t.encoding, t.value_format, (), 0, b"", **fields)
        return out

    def _encode_factored(
        self, factored: Sequence[tuple[TensorPlan, torch.Tensor]], feedback: ErrorFeedback | ScopedFeedback | None
    ) -> dict[str, CompressedTensor]:
        """The LOW_RANK tensors, each ``(plan, values)`` (its error-feedback buffer where there is one),
        factored and quantized a stack of one (rows, cols, rank) at a time; with ``feedback``, what the
        receiver decodes is taken off each buffer and (``power``) each matrix's refined subspace kept."""
        if not factored:
            return {}
        # A sum meets any NaN or infinity (and a sum past float32's range, which no gradient reaches), in a
        # tenth of the time of checking every element on a CPU; read back once for every matrix.
        finite = torch.isfinite(torch.stack([values.sum() for _, values in factored])).tolist()
        by_shape: dict[tuple[int, int, int], list[tuple[TensorPlan, torch.Tensor]]] = {}
        for ok, (t, values) in zip(finite, factored):
            if not ok:
                raise NonFiniteInput(t.name)
            by_shape.setdefault((*matrix_view(t.shape), t.k), []).append((t, values))
        launched: list[tuple[list[TensorPlan], lowrank.Factors]] = []  # each stack's plans and factors
        for (rows, cols, rank), members in by_shape.items():
            step = max(1, FACTOR_BATCH_NUMEL // (rows * cols))
            for first in range(0, len(members), step):
                batch = members[first : first + step]
                views = [values.view(rows, cols) for _, values in batch]
                m = torch.stack(views) if len(views) > 1 else views[0][None]  # (B, rows, cols) float32
                a, b = self._factor(m, [t.name for t, _ in batch], rank, feedback)
                factors = lowrank.quantize(a, b, self.config.factor_bits)
                if feedback is not None:  # what stays behind: all the receiver will not decode
                    sent = factors.decode(m.device)  # (B, rows, cols)
                    for (_, values), s in zip(batch, sent):
                        values.sub_(s.view(-1))
                launched.append(([t for t, _ in batch], factors))
        out = {}
        # Read back once every stack's work is launched (``Factors.to_host``: two reads in all).
        for (plans, _), host in zip(launched, lowrank.Factors.to_host([f for _, f in launched])):
            for t, f in zip(plans, host.unbind()):
                codes, scales = f.to_bytes(self.config.factor_bits)
                out[t.name] = CompressedTensor(
                    t.name, t.shape, t.encoding, t.value_format, (), t.k, b"", codes, lut=scales
                )
        return out

    def _factor(
        self, m: torch.Tensor, names: Sequence[str], rank: int, feedback: ErrorFeedback | ScopedFeedback | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank-``rank`` factors ``A`` (B, rows, rank) and ``B`` (B, rank, cols) of the stack ``m``. ``power``
        with error feedback: one power iteration from each matrix's carried subspace, all carried ones at
        once, the others seeded (``lowrank.seed``); the refined subspaces are kept. Otherwise each matrix from
        scratch."""
        if self.factorization != "power" or feedback is None:
            method = "auto" if self.factorization == "power" else self.factorization
            a, b = zip(*(lowrank.factorize(x, rank, method) for x in m))
            return torch.stack(a), torch.stack(b)
        cols, width = m.shape[2], lowrank.carried_width(rank, *m.shape[1:])
        subspaces = [feedback.subspace(name) for name in names]
        carried = [i for i, q in enumerate(subspaces) if q is not None and tuple(q.shape) == (cols, width)]
        if len(carried) == len(m):  # every round but a run's first: one batched iteration, no copies
            a, b, q = lowrank.refine(m, torch.stack([s.to(m.device) for s in subspaces]), rank)
            for name, qi in zip(names, q):
                feedback.keep_subspace(name, qi.clone())  # its own storage: a state dict's tensors share none
            return a, b
        a = m.new_empty((len(m), m.shape[1], rank))
        b = m.new_empty((len(m), rank, cols))
        if carried:
            q = torch.stack([subspaces[i].to(m.device) for i in carried])  # (len(carried), cols, width)
            a[carried], b[carried], q = lowrank.refine(m[carried], q, rank)
            for i, qi in zip(carried, q):
                feedback.keep_subspace(names[i], qi.clone())
        for i in sorted(set(range(len(m))) - set(carried)):  # the first round: factored as before, and seeding
            a[i], b[i], qi = lowrank.seed(m[i], rank)
            feedback.keep_subspace(names[i], qi)
        return a, b

    # ---------------------------------------------------------------- validate / decode

    def decode(self, payload: CompressedGradient) -> DecodedGradient:
        """Check ``payload`` against this codec's plan and turn it into tensors; raise ``PayloadError``."""
        if payload.format_version != FORMAT_VERSION:
            raise PayloadError(
                GRADIENT,
                "format_version",
                f"unknown format version {payload.format_version} (this build speaks {FORMAT_VERSION})",
            )
        if payload.settings != self.config:
            raise PayloadError(
                GRADIENT, "settings", f"codec settings {payload.settings} differ from the receiver's {self.config}"
            )
        names = [t.name for t in payload.tensors]
        expected = [t.name for t in self.plan.tensors]
        if names != expected:
            extra, absent = sorted(set(names) - set(expected)), sorted(set(expected) - set(names))
            # Otherwise the same names, reordered or repeated: name the first position that differs.
            first_diff = next((a for a, b in zip(names, expected) if a != b), names[-1] if names else "")
            culprit = (extra or absent or [first_diff])[0]
            raise PayloadError(
                culprit,
                "name",
                f"tensor list differs from the plan (unexpected {extra[:3]}, missing {absent[:3]}, or "
                "reordered/repeated)",
            )
        by_name = dict(zip(names, payload.tensors))
        for t in self.plan.tensors:
            self._check_tensor(t, by_name[t.name])
        pairs = [self._decode_group(group, layout, by_name) for group, layout in zip(self.plan.groups, self._layouts)]
        whole = [self._decode_values(t, by_name[t.name]) for t in self.plan.dense if t.encoding != Encoding.LOW_RANK]
        # Decoded on the host, copied to the device together (``transfer``): a copy a tensor would wait for the
        # device as often.
        moved = iter(to_device([*(x for pair in pairs for x in pair), *whole], self.device))
        indices, values = [], []
        for _ in pairs:
            indices.append(next(moved))
            values.append(next(moved))
        factors = {
            t.name: self._factors(t, by_name[t.name]) for t in self.plan.dense if t.encoding == Encoding.LOW_RANK
        }
        # A factored matrix's product is multiplied out only when read (``products``): what a norm, a check or
        # an aggregate's running sum needs, its factors say.
        dense = Products([factors[t.name] if t.name in factors else next(moved) for t in self.plan.dense], self.device)
        return DecodedGradient(indices, values, dense, factors=factors, increasing=self._elias_fano)

    def _check_tensor(self, t: TensorPlan, ct: CompressedTensor) -> None:
        def fail(field: str, reason: str) -> None:
            raise PayloadError(t.name, field, reason)

        if tuple(ct.shape) != t.shape:
            fail("shape", f"expected {t.shape}, got {tuple(ct.shape)}")
        if ct.encoding != t.encoding:
            fail("encoding", f"expected {t.encoding.name}, got {ct.encoding!r}")
        if ct.value_format != t.value_format:
            fail("value_format", f"expected {t.value_format.name}, got {ct.value_format!r}")
        if tuple(ct.chunk_shape) != t.chunk_shape:
            fail("chunk_shape", f"expected {t.chunk_shape}, got {tuple(ct.chunk_shape)}")
        if ct.k != t.k:
            fail("k", f"expected {t.k} per chunk, got {ct.k}")
        n = t.num_values
        want_idx = indices_nbytes(t, self.config)
        if len(ct.indices) != want_idx:
            coded = "Elias-Fano coded" if self._elias_fano else "12-bit"
            fail("indices", f"expected {want_idx} bytes ({n} {coded} indices), got {len(ct.indices)}")
        fmt = t.value_format
        want_vals = values_nbytes(fmt, n, self.config)
        if len(ct.values) != want_vals:
            fail("values", f"expected {want_vals} bytes ({n} {fmt.name} values), got {len(ct.values)}")
        want_lut = lut_nbytes(fmt, self.config, t.k)
        if len(ct.lut) != want_lut:
            fail("lut", f"expected {want_lut} bytes, got {len(ct.lut)}")
        if fmt in FACTOR_FORMATS:
            if ct.shift != 0 or ct.scale != 0:
                fail("shift" if ct.shift != 0 else "scale", "must be 0 for factors (their scales are in lut)")
            limit = lowrank.code_limit(self.config.factor_bits)
            if fmt == ValueFormat.INT8:
                low = (np.frombuffer(ct.values, np.int8) == -limit - 1).any()
            else:
                if pad_bits(ct.values, 4, n):
                    fail("values", f"the unused high bits of the last byte ({n} codes of 4 bits) must be zero")
                low = (lowrank.unpack_int4(ct.values, n) == -limit - 1).any()
            if low:
                fail("values", f"factor codes must be in [-{limit}, {limit}], got {-limit - 1}")
            scales = np.frombuffer(ct.lut, "<f4")
            if not _finite_within(scales, VALUE_LIMIT) or (scales < 0).any():
                fail("lut", f"factor scales must be finite and in [0, {VALUE_LIMIT:g}]")
            return
        if fmt == ValueFormat.FLOAT32:
            if not _finite_within(np.frombuffer(ct.values, "<f4"), VALUE_LIMIT):
                fail("values", f"raw values must be finite and within +-{VALUE_LIMIT:g}")
            return
        if pad_bits(ct.values, self._bits, n):
            fail("values", f"the unused high bits of the last byte ({n} codes of {self._bits} bits) must be zero")
        if fmt == ValueFormat.SIGN:
            if ct.shift != 0:
                fail("shift", f"must be 0 for SIGN values, got {ct.shift}")
            if not (math.isfinite(ct.scale) and 0 <= ct.scale <= VALUE_LIMIT):
                fail("scale", f"must be finite and in [0, {VALUE_LIMIT:g}], got {ct.scale}")
            return
        if not (math.isfinite(ct.shift) and abs(ct.shift) <= VALUE_LIMIT):
            fail("shift", f"must be finite and within +-{VALUE_LIMIT:g}, got {ct.shift}")
        if not (math.isfinite(ct.scale) and 0 < ct.scale <= VALUE_LIMIT):
            fail("scale", f"must be positive, finite and <= {VALUE_LIMIT:g}, got {ct.scale}")
        if not np.isfinite(np.frombuffer(ct.lut, "<f2")).all():
            fail("lut", "entries must be finite")
        # Codes >= bins (possible unless bins is a power of two) are checked where they are unpacked.

    def _decode_group(
        self, group: ChunkGroup, layout: _GroupLayout, by_name: Mapping[str, CompressedTensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's kept indices (int64) and values (float32), (chunks, k) each, on the host."""
        members = [by_name[t.name] for t in group.members]
        idx = self._unpack_ef(group, layout, members) if self._elias_fano else self._unpack12(group, layout, members)
        k = group.k
        vals = np.empty(group.num_chunks * k, np.float32)
        q_plans = [t for t, q in zip(group.members, layout.quantized) if q]
        if q_plans:
            q_vals = self._dequantize(q_plans, [by_name[t.name] for t in q_plans])
        if layout.quantized.all():
            vals = q_vals
        else:
            # Mixed formats: place each member's values at its rows.
            qpos = 0
            for ct, q, t, off in zip(members, layout.quantized, group.members, group.offsets):
                span = slice(off * k, (off + t.num_chunks) * k)
                n = t.num_chunks * k
                if q:
                    vals[span] = q_vals[qpos : qpos + n]
                    qpos += n
                else:
                    vals[span] = np.frombuffer(ct.values, "<f4")
        b = group.num_chunks
        return torch.from_numpy(idx.astype(np.int64)).view(b, k), torch.from_numpy(vals).view(b, k)

    @staticmethod
    def _unpack_ef(group: ChunkGroup, layout: _GroupLayout, members: Sequence[CompressedTensor]) -> np.ndarray:
        """A group's Elias-Fano coded indices, (chunks * k,) in payload order; each member's checked (their
        lengths already are). A run of members whose codes join (``_GroupLayout.ef_runs``) is decoded in one
        call; should its joined code be wrong, each of its members is decoded alone, which names the one at
        fault."""
        out = []
        for run in layout.ef_runs:
            plans, codes = [group.members[i] for i in run], [members[i].indices for i in run]
            if len(run) > 1:
                chunks = [t.num_chunks for t in plans]
                joined = join_ef(codes, chunks, group.k, group.chunk_numel)
                with contextlib.suppress(ValueError):  # a member is wrong: decoded alone below, it is named
                    out.append(unpack_ef(joined, sum(chunks), group.k, group.chunk_numel).reshape(-1))
                    continue
            for t, code in zip(plans, codes):
                try:
                    out.append(unpack_ef(code, t.num_chunks, t.k, t.chunk_numel).reshape(-1))
                except ValueError as e:
                    raise PayloadError(t.name, "indices", str(e)) from None
        return np.concatenate(out)

    @staticmethod
    def _unpack12(group: ChunkGroup, layout: _GroupLayout, members: Sequence[CompressedTensor]) -> np.ndarray:
        """A group's 12-bit indices, (chunks * k,) in payload order, their pads and range checked."""
        idx = unpack12_padded(np.frombuffer(b"".join(ct.indices for ct in members), np.uint8))
        if layout.pads is not None:
            bad_pad = np.flatnonzero(idx[layout.pads])
            if bad_pad.size:
                owner = group.members[layout.pad_members[bad_pad[0]]]
                raise PayloadError(owner.name, "indices", "the padding index after an odd count must be 0")
            idx = np.delete(idx, layout.pads)
        too_big = np.flatnonzero(idx >= group.chunk_numel)
        if too_big.size:
            owner = group.members[int(np.searchsorted(layout.value_starts, too_big[0], side="right")) - 1]
            raise PayloadError(
                owner.name, "indices", f"index {int(idx[too_big[0]])} outside a chunk of {group.chunk_numel} elements"
            )
        return idx

    @staticmethod
    def _factors(t: TensorPlan, ct: CompressedTensor) -> lowrank.Factors:
        """A factored tensor's codes and scales (checked by ``_check_tensor``)."""
        rows, cols = matrix_view(t.shape)
        bits = 8 if t.value_format == ValueFormat.INT8 else 4
        return lowrank.Factors.from_bytes(ct.values, ct.lut, rows, cols, t.k, bits)

    def _decode_values(self, t: TensorPlan, ct: CompressedTensor) -> torch.Tensor:
        """A tensor sent whole, its values flat, on the host."""
        if t.value_format != ValueFormat.FLOAT32:
            vals = torch.from_numpy(self._dequantize([t], [ct]))
        else:
            vals = torch.from_numpy(np.frombuffer(ct.values, "<f4").copy())
        return vals

    def _dequantize(self, plans: Sequence[TensorPlan], cts: Sequence[CompressedTensor]) -> np.ndarray:
        """Coded values of several tensors, (N,) float32 in order.

        Unpacks each tensor's codes (each is its own bit stream, padded to a byte), checks them against
        ``bins`` and looks them up in the tensor's table of decoded values (``quant.values_table``).
        """
        bins = self.config.bins
        if self._coded == ValueFormat.SIGN:
            lut = sign_table(len(cts))
        else:
            lut = torch.from_numpy(np.frombuffer(b"".join(ct.lut for ct in cts), "<f2").reshape(len(cts), -1).copy())
        shift = torch.tensor([ct.shift for ct in cts], dtype=torch.float32)
        scale = torch.tensor([ct.scale for ct in cts], dtype=torch.float32)
        table = values_table(lut, shift, scale).numpy()  # (T, bins): each tensor's codes are looked up in its row
        out = np.empty(sum(t.num_values for t in plans), np.float32)
        start = 0
        for i, (t, ct) in enumerate(zip(plans, cts)):
            codes = unpack_bits(ct.values, self._bits, t.num_values)
            if self._coded == ValueFormat.LUT and bins & (bins - 1):  # not a power of two: codes can exceed it
                bad = np.flatnonzero(codes >= bins)
                if bad.size:
                    raise PayloadError(t.name, "values", f"code {int(codes[bad[0]])} is not below bins={bins}")
            np.take(table[i], codes, out=out[start : start + t.num_values])
            start += t.num_values
        return out

    # ---------------------------------------------------------------- aggregate

    def aggregator(self, normalize: Normalize = "mean", dtype: torch.dtype = torch.float32) -> Aggregator:
        """A running sum of senders' payloads in the coefficient domain; see ``aggregate.Aggregator``."""
        from gradwire.compression.aggregate import Aggregator  # it builds on this module

        return Aggregator(self, normalize, dtype=dtype)

    def aggregate(
        self,
        payloads: Sequence[CompressedGradient],
        weights: Sequence[float] | None = None,
        normalize: Normalize = "mean",
        dtype: torch.dtype = torch.float32,
    ) -> dict[str, torch.Tensor]:
        """Weighted mean of many senders' gradients (weights, e.g. token counts, default to equal); summed
        in ``dtype`` (float64: the same bits on every device kind, see ``aggregate.Aggregator``)."""
        if weights is not None and len(weights) != len(payloads):
            raise ValueError(f"got {len(weights)} weights for {len(payloads)} payloads")
        agg = self.aggregator(normalize, dtype)
        for i, payload in enumerate(payloads):
            agg.add(payload, 1.0 if weights is None else weights[i])
        return agg.result()

    def decompress(self, payload: CompressedGradient) -> dict[str, torch.Tensor]:
        return self.aggregate([payload])

    @staticmethod
    def _unchunk(chunks: torch.Tensor, t: TensorPlan) -> torch.Tensor:
        if len(t.chunk_shape) == 1:
            return chunks.reshape(t.shape)
        rows, cols = t.grid
        r, c = t.chunk_shape
        return chunks.reshape(rows, cols, r, c).permute(0, 2, 1, 3).reshape(t.shape)

    # ---------------------------------------------------------------- layout

    def _layout(self, group: ChunkGroup) -> _GroupLayout:
        counts = torch.tensor([t.num_chunks for t in group.members])
        # Made where the sender's chunks are, once: copied there at each encode, it would wait for the device.
        row_member = torch.repeat_interleave(torch.arange(len(group.members)), counts).to(self.device)
        quantized = np.array([t.value_format != ValueFormat.FLOAT32 for t in group.members])
        num_values = np.array([t.num_values for t in group.members])
        value_starts = np.concatenate([[0], np.cumsum(num_values)[:-1]])
        odd = num_values % 2 == 1
        pads = pad_members = None
        if odd.any():
            padded_ends = np.cumsum(num_values + odd)
            pads = (padded_ends - 1)[odd]
            pad_members = np.flatnonzero(odd)
        return _GroupLayout(row_member, quantized, value_starts, pads, pad_members, _ef_runs(group))


def _ef_runs(group: ChunkGroup) -> list[list[int]]:
    """``_GroupLayout.ef_runs``: consecutive members joined while their codes fill whole bytes and the run
    stays within ``JOINED_EF_BYTES``; any other member alone."""
    runs: list[list[int]] = []
    size, open_run = 0, False
    for i, t in enumerate(group.members):
        nbytes = ef_nbytes(t.num_chunks, t.k, t.chunk_numel)
        joinable = ef_joinable(t.num_chunks, t.k, t.chunk_numel)
        if joinable and open_run and size + nbytes <= JOINED_EF_BYTES:
            runs[-1].append(i)
            size += nbytes
        else:
            runs.append([i])
            size, open_run = nbytes, joinable
    return runs


def _finite_within(x: np.ndarray, limit: float) -> bool:
    return bool(np.isfinite(x).all() and (np.abs(x) <= limit).all())
