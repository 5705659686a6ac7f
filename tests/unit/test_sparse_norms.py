"""The coordinator's per-round measurements cost payloads, not the model (issue 44): ``Aggregator.norm`` on
its sparse path and ``agreement.leave_one_out`` equal the dense computations they replaced.

The references are the old code's: a (num_chunks, chunk_numel) buffer per chunk group, scattered into.
Payloads are random ``DecodedGradient``s with repeated indices (within a sender and across senders), zero
payloads, senders of weight 0, 1-D and 2-D chunk groups and dense tensors, cut into several slices, and
real payloads of the codec.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradwire.compression import CodecConfig, GradientCodec, robust
from gradwire.compression import aggregate as aggregate_module
from gradwire.compression.aggregate import Aggregator
from gradwire.compression.codec import DecodedGradient
from gradwire.compression.robust import AggregationRule
from gradwire.coordinator import agreement
from gradwire.coordinator.agreement import leave_one_out

SHAPES = {"w": (128, 128), "e": (96, 64), "v": (4096,), "b": (64,)}  # 2-D groups, a 1-D group, a dense tensor
CONFIG = CodecConfig(topk=8)  # few kept: the aggregate holds up to 8 senders sparse


def random_decoded(
    numels: list[int], chunks: list[int], ks: list[int], dense: list[int], seed: int, zero: bool = False
) -> DecodedGradient:
    """Per group, k indices a chunk drawn from the first 2k coefficients (so many repeat, within the sender
    and across senders) with random values; random dense tensors; everything 0 where ``zero``."""
    g = torch.Generator().manual_seed(seed)
    indices = [torch.randint(0, min(n, 2 * k), (b, k), generator=g) for n, b, k in zip(numels, chunks, ks)]
    values = [torch.randn(b, k, generator=g) * (0.0 if zero else 1.0) for b, k in zip(chunks, ks)]
    return DecodedGradient(indices, values, [torch.randn(n, generator=g) * (0.0 if zero else 1.0) for n in dense])


def codec_payload(codec: GradientCodec, seed: int, zero: bool = False, extra_k: int = 3) -> DecodedGradient:
    """A random decoded payload for ``codec``'s plan, ``extra_k`` more pairs a chunk than it keeps."""
    groups = codec.plan.groups
    return random_decoded(
        [g.chunk_numel for g in groups],
        [g.num_chunks for g in groups],
        [g.k + extra_k for g in groups],
        [t.numel for t in codec.plan.dense],
        seed,
        zero,
    )


def dense_norm(agg: Aggregator, norm_dtype: torch.dtype = torch.float64) -> float:
    """The old ``Aggregator.norm`` on the sparse path: per group every held sender scattered into a dense
    (num_chunks, chunk_numel) buffer in the aggregate's dtype, whose norm is taken in ``norm_dtype``
    (float32 there before: ``norm_dtype=torch.float32`` is the old code to the bit)."""
    parts = []
    for gi, group in enumerate(agg.codec.plan.groups):
        acc = torch.zeros(group.num_chunks, group.chunk_numel, dtype=agg.dtype)
        for d, effective, _ in agg._held:
            acc.scatter_add_(1, d.indices[gi], d.values[gi].to(agg.dtype) * (effective / agg.total_weight))
        parts.append(torch.linalg.vector_norm(acc.to(norm_dtype)))
    parts += [torch.linalg.vector_norm(agg._dense_sum(i)) / agg.total_weight for i in range(len(agg.codec.plan.dense))]
    return float(torch.linalg.vector_norm(torch.stack(parts).double()))


def no_dense_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Aggregator, gi: int) -> torch.Tensor:
        raise AssertionError("the sparse norm built a dense coefficient buffer")

    monkeypatch.setattr(Aggregator, "_coefficients", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "senders",
    [
        [(1, 1.0, 1.0)],
        [(1, 2.0, 1.0), (2, 3.0, 0.5)],
        [(1, 1.0, 1.0), (2, 0.0, 1.0), (3, 4.0, 0.25)],  # a sender of weight 0
        [(1, 1.0, 1.0), ("zero", 2.0, 1.0), (3, 1.0, 1.0), (4, 5.0, 0.0)],  # a zero payload, a scale of 0
    ],
    ids=["one", "two", "weight-0", "zero"],
)
def test_the_sparse_norm_equals_the_dense_buffers(senders, dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    codec = GradientCodec(SHAPES, CONFIG)
    assert {len(g.chunk_shape) for g in codec.plan.groups} == {1, 2} and codec.plan.dense
    agg = Aggregator(codec, dtype=dtype)
    for seed, weight, scale in senders:
        d = codec_payload(codec, 0, zero=True) if seed == "zero" else codec_payload(codec, seed)
        agg.add(d, weight, scale)
    assert agg._sums is None and len(agg._held) == len(senders)  # the sparse path, every sender held
    want, old = dense_norm(agg), dense_norm(agg, torch.float32)
    no_dense_buffer(monkeypatch)
    got = agg.norm()
    assert got == pytest.approx(want, rel=1e-12)  # the same sums, squared in float64
    assert got == pytest.approx(old, rel=1e-5)  # the old code's float32 norm
    monkeypatch.setattr(aggregate_module, "NORM_SLICE_PAIRS", 7)  # under a chunk of pairs: a chunk a slice
    assert agg.norm() == pytest.approx(want, rel=1e-12)
    monkeypatch.setattr(aggregate_module, "NORM_SLICE_PAIRS", 200)  # a few chunks a slice, a short last one
    assert agg.norm() == pytest.approx(want, rel=1e-12)


def test_the_sparse_norm_of_real_payloads_is_the_norm_of_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = GradientCodec(SHAPES, CONFIG)
    g = torch.Generator().manual_seed(5)
    grads = [{n: torch.randn(*s, generator=g) for n, s in SHAPES.items()} for _ in range(3)]
    sparse, dense = Aggregator(codec), Aggregator(codec, sparse=False)
    for i, grad in enumerate(grads):
        p = codec.compress(grad)
        sparse.add(p, 1.0 + i)
        dense.add(p, 1.0 + i)
    assert sparse._sums is None and dense._sums is not None
    want, spilled = dense_norm(sparse), dense.norm()  # the dense-sums path, as it was
    result = torch.cat([t.reshape(-1) for t in sparse.result().values()])
    no_dense_buffer(monkeypatch)
    assert sparse.norm() == pytest.approx(want, rel=1e-12)
    assert sparse.norm() == pytest.approx(spilled, rel=1e-5)
    assert sparse.norm() == pytest.approx(float(torch.linalg.vector_norm(result)), rel=1e-4)


@pytest.mark.parametrize("rule", ["mean", "kept-mean"])
def test_a_sole_senders_known_norm_is_the_aggregates_times_its_scale(rule: str, monkeypatch) -> None:
    """The norm a sender's payload was measured at as it arrived (``payload_norm``) stands for the aggregate
    of that sender alone, times its clip scale, with no pass over the payload; two senders' is computed."""
    codec = GradientCodec(SHAPES, CONFIG)
    g = torch.Generator().manual_seed(7)
    payloads = [
        codec.decode(codec.compress({n: torch.randn(*s, generator=g) for n, s in SHAPES.items()})) for _ in "ab"
    ]
    norms = [robust.payload_norm(d) for d in payloads]
    computed = robust.aggregate(codec, payloads[:1], [3.0], [0.4], AggregationRule(mode=rule)).norm()
    with monkeypatch.context() as m:
        m.setattr(Aggregator, "_held_norm_sq", lambda self, gi: pytest.fail("the sole sender's payload measured again"))
        m.setattr(Aggregator, "_coefficients", lambda self, gi: pytest.fail("the sole sender's payload measured again"))
        known = robust.aggregate(codec, payloads[:1], [3.0], [0.4], AggregationRule(mode=rule), norms[:1])
        assert known.norm() == norms[0] * 0.4
    assert known.norm() == pytest.approx(computed, rel=1e-6)
    both = robust.aggregate(codec, payloads, [3.0, 1.0], [0.4, 1.0], AggregationRule(mode=rule), norms)
    assert both.norm() == robust.aggregate(codec, payloads, [3.0, 1.0], [0.4, 1.0], AggregationRule(mode=rule)).norm()
    assert both.norm() != pytest.approx(norms[0] * 0.4, rel=1e-3)
    with pytest.raises(ValueError, match="2 senders, 2 weights, 2 scales, 1 norms"):  # none left out unsaid
        robust.aggregate(codec, payloads, [3.0, 1.0], [0.4, 1.0], AggregationRule(mode=rule), norms[:1])


@pytest.mark.parametrize("indices", ["packed12", "elias-fano"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("slice_pairs", [None, 7, 200])
def test_a_sole_senders_increasing_indices_skip_the_sort_for_the_same_bits(
    indices: str, dtype: torch.dtype, slice_pairs: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sender whose rows increase (the codec sends every chunk's indices in increasing order; Elias-Fano
    payloads are checked so at decode): its norm is taken from its values as they are, bit for bit what sorting
    them into runs gave; a row with an index twice is still summed by runs."""
    codec = GradientCodec(SHAPES, CodecConfig(topk=8, indices=indices))
    g = torch.Generator().manual_seed(11)
    payload = codec.decode(codec.compress({n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}))
    assert all(bool((i[:, 1:] > i[:, :-1]).all()) for i in payload.indices)
    if slice_pairs is not None:
        monkeypatch.setattr(aggregate_module, "NORM_SLICE_PAIRS", slice_pairs)
    agg = Aggregator(codec, dtype=dtype)
    agg.add(payload, 3.0, 0.5)
    assert payload.increasing == (indices == "elias-fano")  # checked at decode: no one checks again
    with monkeypatch.context() as m:
        m.setattr(aggregate_module, "_increasing", lambda keys: False)  # the sort, as every sender took it before
        unchecked = dataclasses.replace(payload, increasing=False)
        sorted_agg = Aggregator(codec, dtype=dtype)
        sorted_agg.add(unchecked, 3.0, 0.5)
        sorted_norm = sorted_agg.norm()
    with monkeypatch.context() as m:

        def no_runs(keys: torch.Tensor) -> torch.Tensor:
            raise AssertionError("a sole sender's increasing rows were sorted into runs")

        m.setattr(aggregate_module, "_run_ids", no_runs)
        if payload.increasing:
            m.setattr(aggregate_module, "_increasing", lambda keys: pytest.fail("rows checked at decode, again"))
        assert agg.norm() == sorted_norm  # to the bit
    assert sorted_norm == pytest.approx(dense_norm(agg), rel=1e-12)

    repeated = DecodedGradient([i.clone() for i in payload.indices], payload.values, payload.dense)
    repeated.indices[0][0, 1] = repeated.indices[0][0, 0]  # an index twice in one chunk: its values add up
    twice = Aggregator(codec, dtype=dtype)
    twice.add(repeated, 3.0, 0.5)
    assert twice.norm() == pytest.approx(dense_norm(twice), rel=1e-12)
    assert twice.norm() != pytest.approx(sorted_norm, rel=1e-12)


def dense_leave_one_out(decoded: list[DecodedGradient], weights: list[float], numels: list[int]) -> list[float | None]:
    """The old ``leave_one_out``: per group, the senders scattered into dense (chunks, numel) float64
    buffers of the weighted total and of how often senders of weight > 0 listed each coefficient; per
    sender, its own values gathered at its indices and taken back out."""
    n = len(decoded)
    dot, own_sq, others_sq = [0.0] * n, [0.0] * n, [0.0] * n
    for gi, numel in enumerate(numels):
        b = decoded[0].indices[gi].shape[0]
        total = torch.zeros(b, numel, dtype=torch.float64)
        hits = torch.zeros_like(total)
        for d, w in zip(decoded, weights):
            if w:
                total.scatter_add_(1, d.indices[gi], d.values[gi].double() * w)
                hits.scatter_add_(1, d.indices[gi], torch.ones_like(d.values[gi], dtype=torch.float64))
        for s, (d, w) in enumerate(zip(decoded, weights)):
            idx, vals = d.indices[gi], d.values[gi].double()
            own = torch.zeros_like(total).scatter_add_(1, idx, vals)
            own_hits = torch.zeros_like(total).scatter_add_(1, idx, torch.ones_like(vals))
            mine, mine_hits = own.gather(1, idx), own_hits.gather(1, idx)
            others = total.gather(1, idx) - mine * w
            share = ((hits.gather(1, idx) - (mine_hits if w else 0)) > 0) / mine_hits
            dot[s] += float((share * mine * others).sum())
            own_sq[s] += float((share * mine * mine).sum())
            others_sq[s] += float((share * others * others).sum())
    for ti in range(len(decoded[0].dense)):
        values = [d.dense[ti].double() for d in decoded]
        total = sum(v * w for v, w in zip(values, weights))
        for s, own in enumerate(values):
            others = total - own * weights[s]
            dot[s] += float(own @ others)
            own_sq[s] += float(own @ own)
            others_sq[s] += float(others @ others)
    out: list[float | None] = []
    for d, o, t in zip(dot, own_sq, others_sq):
        norm = (o * t) ** 0.5
        out.append(max(-1.0, min(1.0, d / norm)) if norm > 0 else None)
    return out


def assert_same(got: list[float | None], want: list[float | None]) -> None:
    assert [x is None for x in got] == [x is None for x in want], (got, want)
    assert [x for x in got if x is not None] == pytest.approx([x for x in want if x is not None], abs=1e-9)


NUMELS = [4096, 64, 5, 1]  # a 64 x 64 chunk, a 1-D one, a tiny one, one of a single coefficient
CHUNKS = [9, 13, 4, 3]


def agreement_payload(seed: int, extra_k: int = 0, zero: bool = False, sign: float = 1.0) -> DecodedGradient:
    """A shared direction's pairs, a third of them swapped for pairs of the sender's own (indices drawn from
    the first 2k coefficients of a chunk, so many repeat), plus noise; ``extra_k`` more pairs a chunk."""
    ks = [8 + extra_k, 4 + extra_k, 3, 2]
    own = random_decoded(NUMELS, CHUNKS, ks, [6, 3], seed)
    shared = random_decoded(NUMELS, CHUNKS, ks, [6, 3], 1000 + extra_k)
    g = torch.Generator().manual_seed(seed)
    swapped = [torch.rand(idx.shape, generator=g) < 1 / 3 for idx in own.indices]
    indices = [torch.where(m, o, s) for m, o, s in zip(swapped, own.indices, shared.indices)]
    values = [torch.where(m, o, s + 0.5 * o) for m, o, s in zip(swapped, own.values, shared.values)]
    dense = [s + 0.5 * o for s, o in zip(shared.dense, own.dense)]
    scale = 0.0 if zero else sign
    return DecodedGradient(indices, [v * scale for v in values], [v * scale for v in dense])


CASES = {
    "three": ([agreement_payload(1), agreement_payload(2), agreement_payload(3, sign=-1.0)], [2.0, 2.0, 1.0]),
    "weight-0": ([agreement_payload(1), agreement_payload(2), agreement_payload(4)], [4.0, 0.0, 1.0]),
    "lone-weighted": ([agreement_payload(1), agreement_payload(2)], [4.0, 0.0]),
    "zero": ([agreement_payload(1), agreement_payload(2, zero=True), agreement_payload(3)], [1.0, 1.0, 1.0]),
    "two-zero": ([agreement_payload(1), agreement_payload(2, zero=True)], [1.0, 1.0]),
    "unequal-k": ([agreement_payload(1), agreement_payload(2, extra_k=5), agreement_payload(5)], [2.0, 1.0, 1.0]),
    "five": ([agreement_payload(s, sign=(-1.0) ** s) for s in range(5)], [1.0, 0.5, 0.0, 3.0, 2.0]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("slice_pairs", [None, 1, 17, 100])
def test_leave_one_out_equals_the_dense_buffers(case: str, slice_pairs: int | None, monkeypatch) -> None:
    decoded, weights = CASES[case]
    assert any((d.indices[0][:, None, :] == d.indices[0][:, :, None]).sum() > d.indices[0].numel() for d in decoded)
    if slice_pairs is not None:  # 1: a chunk a slice; 17 and 100: a few chunks a slice, a short last one
        monkeypatch.setattr(agreement, "SLICE_ELEMENTS", slice_pairs)
    got = leave_one_out(decoded, weights, NUMELS)
    want = dense_leave_one_out(decoded, weights, NUMELS)
    assert_same(got, want)
    if case == "three":
        assert got[0] > 0.3 and got[1] > 0.3 and got[2] < -0.3  # two agreeing, one pointing away
    if case == "lone-weighted":
        assert got[0] is None and got[1] is not None  # measured, but its weight 0 leaves the other nothing
    if case == "two-zero":
        assert got == [None, None]


def test_leave_one_out_of_real_payloads_equals_the_dense_buffers() -> None:
    codec = GradientCodec(SHAPES, CONFIG)
    g = torch.Generator().manual_seed(9)
    base = {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}
    grads = [{n: t + 0.7 * torch.randn(t.shape, generator=g) for n, t in base.items()} for _ in range(3)]
    grads.append({n: -t for n, t in grads[0].items()})
    decoded = [codec.decode(codec.compress(grad)) for grad in grads]
    numels = [group.chunk_numel for group in codec.plan.groups]
    weights = [1.0, 2.0, 1.5, 1.0]
    got = leave_one_out(decoded, weights, numels)
    assert_same(got, dense_leave_one_out(decoded, weights, numels))
    assert all(x is not None for x in got) and got[3] < 0 < got[1]


KEPT_SENDERS = {
    "one": [(1, 3.0, 1.0)],
    "one-clipped": [(1, 3.0, 0.4)],
    "two": [(1, 2.0, 1.0), (2, 3.0, 0.5)],
    "weight-0": [(1, 1.0, 1.0), (2, 0.0, 1.0), (3, 4.0, 0.25)],
    "zero": [(1, 1.0, 1.0), ("zero", 2.0, 1.0), (3, 5.0, 0.0)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("senders", list(KEPT_SENDERS.values()), ids=list(KEPT_SENDERS))
def test_kept_mean_on_the_sparse_path_is_the_dense_sums_over_their_weights(
    senders, dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Few kept coefficients: kept-mean holds its senders and weighs each kept coefficient by the senders
    that kept it, from their indices sorted together; its result, norm and coefficients are those of the
    dense coefficient sums divided by their hit weights (repeated indices within and across senders), and
    neither the result nor the norm builds a dense coefficient buffer."""
    codec = GradientCodec(SHAPES, CONFIG)
    sparse = Aggregator(codec, "per_coordinate", dtype=dtype)
    dense = Aggregator(codec, "per_coordinate", sparse=False, dtype=dtype)
    for seed, weight, scale in senders:
        d = codec_payload(codec, 0, zero=True) if seed == "zero" else codec_payload(codec, seed)
        for agg in (sparse, dense):
            agg.add(d, weight, scale)
    assert sparse._sums is None and len(sparse._held) == len(senders) and dense._sums is not None
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for got, want in zip(sparse.coefficient_groups(), dense.coefficient_groups()):
        torch.testing.assert_close(got, want, **tol)
    want_result, want_norm = dense.result(), dense.norm()
    no_dense_buffer(monkeypatch)
    got_result = sparse.result()
    assert list(got_result) == list(want_result)
    for name, got in got_result.items():
        torch.testing.assert_close(got, want_result[name], rtol=1e-5, atol=1e-6)
    assert sparse.norm() == pytest.approx(want_norm, rel=1e-6 if dtype == torch.float32 else 1e-12)
    monkeypatch.setattr(aggregate_module, "NORM_SLICE_PAIRS", 7)  # the shares found a slice of chunks at a time
    assert sparse.norm() == pytest.approx(want_norm, rel=1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("senders", list(KEPT_SENDERS.values()), ids=list(KEPT_SENDERS))
def test_kept_mean_in_dense_sums_divides_only_where_a_sender_kept_a_coefficient(senders, dtype) -> None:
    """Spilled into dense sums, kept-mean's coefficients are each sum over the weight of the senders that kept
    it, and the sum itself where none did (weight-0 and zero senders included): the same bits as selecting
    the two apart."""
    codec = GradientCodec(SHAPES, CONFIG)
    dense = Aggregator(codec, "per_coordinate", sparse=False, dtype=dtype)
    for seed, weight, scale in senders:
        dense.add(codec_payload(codec, 0, zero=True) if seed == "zero" else codec_payload(codec, seed), weight, scale)
    assert dense._sums is not None and dense._hits is not None
    for gi, got in enumerate(dense.coefficient_groups()):
        sums, hits = dense._sums[gi], dense._hits[gi]
        want = torch.where(hits > 0, sums / hits.clamp_min(1e-30), sums)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
        assert bool((hits == 0).any()) and not got[hits == 0].any()  # coefficients no sender kept stay 0


def test_kept_mean_of_two_real_senders_weighs_shared_and_lone_coefficients_apart() -> None:
    """Two senders of the codec's real payloads, one clipped: a coefficient both kept is their weighted mean,
    one only a sender kept is its value times its clip scale (the by-hand rule), on the sparse path."""
    codec = GradientCodec(SHAPES, CONFIG)
    g = torch.Generator().manual_seed(3)
    a = {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}
    b = {n: a[n] + 0.5 * torch.randn(*s, generator=g) for n, s in SHAPES.items()}  # much the same coefficients
    da, db = (codec.decode(codec.compress(x)) for x in (a, b))
    agg = Aggregator(codec, "per_coordinate", dtype=torch.float64)
    agg.add(da, 2.0, 1.0)
    agg.add(db, 6.0, 0.5)
    assert agg._sums is None
    shared = 0
    for gi, got in enumerate(agg.coefficient_groups()):
        want = torch.zeros_like(got)
        hits = torch.zeros_like(got)
        for d, w, s in ((da, 2.0, 1.0), (db, 6.0, 0.5)):
            want.scatter_add_(1, d.indices[gi], d.values[gi].double() * w * s)
            hits.scatter_add_(1, d.indices[gi], torch.full_like(d.values[gi], w, dtype=torch.float64))
        shared += int((hits == 8.0).sum())
        torch.testing.assert_close(got, torch.where(hits > 0, want / hits.clamp_min(1e-30), 0.0), rtol=1e-12, atol=0)
    assert shared > 0


@pytest.mark.parametrize("scale", [1.0, 0.4])
def test_a_sole_kept_mean_sender_sums_its_inverse_taken_ahead_to_the_same_bits(scale: float) -> None:
    """A worker takes its own payload's inverse ahead when the replay will sum it alone, under kept-mean as
    under mean (``sums_sender_inverses``); the replay with it is the replay without it, bit for bit. With
    two senders kept-mean weighs coefficients by who kept them, so nothing is taken ahead."""
    codec = GradientCodec(SHAPES, CONFIG)
    g = torch.Generator().manual_seed(9)
    d = codec.decode(codec.compress({n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}))
    assert aggregate_module.sums_sender_inverses(codec, "kept-mean", 1)
    assert aggregate_module.sums_sender_inverses(codec, "mean", 2)
    assert not aggregate_module.sums_sender_inverses(codec, "kept-mean", 2)
    assert not aggregate_module.sums_sender_inverses(codec, "median", 1)
    results = []
    for payload in (d, aggregate_module.with_inverse(codec, d)):
        agg = Aggregator(codec, "per_coordinate")
        agg.add(payload, 3.0, scale)
        assert agg._sums is None
        results.append(agg.result())
    for name in SHAPES:
        assert torch.equal(results[0][name], results[1][name]), name
    plain = codec.decompress(codec.compress({n: torch.zeros(*s) for n, s in SHAPES.items()}))  # control: not all 0
    assert any(not torch.equal(results[0][n], plain[n]) for n in SHAPES)


def test_gradient_modes_default_rule_replays_a_sole_sender_without_a_dense_buffer(monkeypatch) -> None:
    """Gradient mode's defaults (kept-mean, its top-k) with one worker: the coordinator's aggregate and a
    replay sum on the sparse path, so neither the round's norm nor its result costs a model-sized buffer of
    coefficients (it cost a gpt-80m round 0.12 s of the coordinator's turnaround while kept-mean summed dense)."""
    from gradwire.coordinator.config import TrainConfig

    config = TrainConfig(output_dir="unused")
    assert config.aggregate == "kept-mean" and config.inner_steps == 1
    shapes = {"w": (256, 256), "e": (512, 128), "b": (64,)}
    codec = GradientCodec(shapes, config.codec_config())
    g = torch.Generator().manual_seed(1)
    payload = codec.compress({n: torch.randn(*s, generator=g) for n, s in shapes.items()})
    assert aggregate_module.sums_sender_inverses(codec, config.aggregation_rule().mode, 1)
    no_dense_buffer(monkeypatch)
    agg = robust.aggregate(codec, [payload], [4.0], rule=config.aggregation_rule())
    assert agg._sums is None and agg.norm() > 0
    reference = codec.decompress(payload)
    for name, got in agg.result().items():
        torch.testing.assert_close(got, reference[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalize", ["mean", "per_coordinate"])
def test_more_senders_than_the_sparse_path_sums_are_held_for_the_norm_and_spilled_for_the_result(
    normalize, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the senders whose inverses the sparse path sums, an aggregate still holds its senders until its
    result is read: the norm (what the coordinator reads before its next orders) is taken from their pairs,
    and the result is the bits of senders scattered into dense sums as they came."""
    codec = GradientCodec(SHAPES, CONFIG)
    senders = [(seed, 1.0 + seed, 1.0 if seed % 2 else 0.5) for seed in range(1, 13)]
    assert len(senders) > aggregate_module.sparse_senders(codec)
    held, scattered = Aggregator(codec, normalize), Aggregator(codec, normalize, sparse=False)
    for seed, weight, scale in senders:
        d = codec.decode(
            codec.compress(
                {n: torch.randn(*s, generator=torch.Generator().manual_seed(seed)) for n, s in SHAPES.items()}
            )
        )
        held.add(d, weight, scale)
        scattered.add(d, weight, scale)
    assert held._sums is None and len(held._held) == len(senders) and scattered._sums is not None
    want = scattered.norm()
    with monkeypatch.context() as m:
        no_dense_buffer(m)
        assert held.norm() == pytest.approx(want, rel=1e-5)
    assert held._sums is None
    got, ref = held.result(), scattered.result()
    assert held._sums is not None and not held._held
    for name in SHAPES:
        assert torch.equal(got[name], ref[name]), name


def test_a_sender_of_many_pairs_is_spilled_as_it_comes() -> None:
    """Held pairs stay under a quarter of the coefficients: a top-k past that is summed dense at once."""
    codec = GradientCodec(SHAPES, CodecConfig(topk=2048))
    agg = Aggregator(codec, "per_coordinate")
    agg.add(codec_payload(codec, 1, extra_k=0), 1.0)
    assert agg._sums is not None and not agg._held
