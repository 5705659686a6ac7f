"""Low-rank factors (``CodecConfig.rank``): the plan, the round trip, error feedback, aggregation, and every
rule a receiver checks a factored tensor against."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradwire.compression import lowrank, serde
from gradwire.compression.codec import GradientCodec
from gradwire.compression.config import CodecConfig
from gradwire.compression.feedback import SUBSPACE, ErrorFeedback, ScopedFeedback
from gradwire.compression.payload import CompressedGradient, Encoding, NonFiniteInput, PayloadError, ValueFormat
from gradwire.compression.robust import AggregationRule, aggregate, payload_norm

from ..hostreads import Calls
from .codec_helpers import rounds_to_send

CONFIG = CodecConfig(bins=4, topk=143, indices="elias-fano", rank=3)
SHAPES = {
    "embed": (96, 32),  # factored: 3 < 32
    "conv": (4, 8, 16),  # factored as its matrix view (32, 16)
    "thin": (300, 3),  # smaller side 3 = rank: DCT top-k as without a rank
    "bias": (512,),  # a vector: dense under a rank (DCT top-k without)
    "norm": (16,),  # fewer than min_sparse_numel: dense
}


@pytest.fixture(scope="module")
def codec() -> GradientCodec:
    return GradientCodec(SHAPES, CONFIG)


def _grads(seed: int = 0, rank: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    if rank is not None:  # matrices of exactly this rank
        out["embed"] = torch.randn(96, rank, generator=g) @ torch.randn(rank, 32, generator=g)
        out["conv"] = (torch.randn(32, rank, generator=g) @ torch.randn(rank, 16, generator=g)).view(4, 8, 16)
    return out


def test_the_plan_factors_matrices_whose_smaller_side_exceeds_the_rank(codec: GradientCodec) -> None:
    plan = {t.name: t for t in codec.plan.tensors}
    assert {n for n, t in plan.items() if t.encoding == Encoding.LOW_RANK} == {"embed", "conv"}
    assert (plan["thin"].encoding, plan["bias"].encoding, plan["norm"].encoding) == (
        Encoding.SPARSE,
        Encoding.DENSE,
        Encoding.DENSE,
    )
    assert plan["bias"].value_format == ValueFormat.LUT  # 2-bit codes, as any dense tensor of that size
    assert plan["embed"].value_format == ValueFormat.INT8 and plan["embed"].k == 3
    assert plan["conv"].num_values == 3 * (32 + 16)
    # Parameter-domain tensors, in payload order: the factored ones and the dense one.
    assert [t.name for t in codec.plan.dense] == ["embed", "conv", "bias", "norm"]
    # Rank 0 is today's codec: nothing factored, the vector by top-k.
    without = {t.name: t.encoding for t in GradientCodec(SHAPES, CodecConfig()).plan.tensors}
    assert Encoding.LOW_RANK not in without.values() and without["bias"] == Encoding.SPARSE


def test_a_matrix_of_the_sent_rank_arrives_within_int8_rounding(codec: GradientCodec) -> None:
    grads = _grads(rank=3)
    out = codec.decompress(codec.compress(grads))
    for name in ("embed", "conv"):
        rel = float((out[name] - grads[name]).norm() / grads[name].norm())
        assert rel < 0.02, (name, rel)  # int8 codes: about 1% of each factor's largest entry
    # A full-rank matrix keeps about its best rank-3 share, no more.
    full = _grads(seed=1)
    m = full["embed"]
    best = torch.linalg.svdvals(m)[:3].square().sum() / m.square().sum()
    got = 1 - float((codec.decompress(codec.compress(full))["embed"] - m).square().sum() / m.square().sum())
    assert abs(got - float(best)) < 0.03


def test_payload_bytes_follow_the_formula_and_survive_serde(codec: GradientCodec) -> None:
    payload = codec.compress(_grads())
    embed = next(t for t in payload.tensors if t.name == "embed")
    assert (len(embed.values), len(embed.lut), embed.indices, embed.k) == (3 * (96 + 32), 8 * 3, b"", 3)
    assert payload.nbytes == codec.plan.payload_bytes()
    again = serde.gradient_from_bytes(serde.gradient_to_bytes(payload))
    assert again == payload and again.settings.rank == 3
    assert torch.equal(codec.decode(again).dense[0], codec.decode(payload).dense[0])


def test_error_feedback_keeps_exactly_what_the_receiver_did_not_decode(codec: GradientCodec) -> None:
    feedback = ErrorFeedback(beta=0.9)
    first, second = _grads(seed=2), _grads(seed=3)
    sent = codec.decompress(codec.compress(first, feedback))
    assert torch.equal(feedback.buffers["embed"], (first["embed"] - sent["embed"]).reshape(-1))
    left = feedback.buffers["embed"].clone()
    sent = codec.decompress(codec.compress(second, feedback))
    expected = 0.9 * left + second["embed"].reshape(-1) - sent["embed"].reshape(-1)
    torch.testing.assert_close(feedback.buffers["embed"], expected, rtol=0, atol=1e-6)
    # Error feedback carries the rest in later rounds: the same gradient every round, and what was sent,
    # summed, soon points its way (rank 3 of 32 carries about 1/3 of a random matrix's energy a round).
    rounds, cosine = rounds_to_send(codec, _grads(seed=4), max_rounds=40)
    assert cosine >= 0.95 and rounds <= 20, (rounds, cosine)


def test_decoding_sums_in_float64_and_rounds_once() -> None:
    g = torch.Generator().manual_seed(4)
    factors = lowrank.compress(torch.randn(40, 24, generator=g), 5)
    a = factors.a.numpy().astype(np.float64) * factors.a_scale.numpy().astype(np.float64)
    b = factors.b.numpy().astype(np.float64) * factors.b_scale.numpy().astype(np.float64)[:, None]
    reference = np.einsum("it,tj->ij", a, b).astype(np.float32)  # another summation, the same rounding
    assert np.array_equal(factors.decode().numpy(), reference)
    assert factors.decode(device="cpu").dtype == torch.float32


def test_a_zero_matrix_sends_zero_scales_and_decodes_to_zero() -> None:
    factors = lowrank.compress(torch.zeros(16, 8), 2)
    assert not factors.a_scale.any() and not factors.b_scale.any()
    assert not factors.decode().any()


def test_aggregation_is_the_mean_of_the_decoded_senders(codec: GradientCodec) -> None:
    payloads = [codec.compress(_grads(seed=s)) for s in (5, 6)]
    each = [codec.decompress(p) for p in payloads]
    mean = codec.aggregate(payloads, weights=[1.0, 3.0])
    torch.testing.assert_close(mean["embed"], (each[0]["embed"] + 3 * each[1]["embed"]) / 4, rtol=0, atol=1e-6)
    exact = codec.aggregate(payloads, dtype=torch.float64)
    torch.testing.assert_close(exact["conv"], (each[0]["conv"] + each[1]["conv"]) / 2, rtol=0, atol=1e-6)
    # Robust aggregation sees the factored tensors too: the norm it clips by counts them, and a
    # coordinate-wise rule combines them element by element (the median of two is their mean).
    whole = torch.cat([t.reshape(-1) for t in each[0].values()])
    assert payload_norm(codec.decode(payloads[0])) == pytest.approx(float(whole.norm()), rel=1e-5)
    median = aggregate(codec, payloads, [1.0, 1.0], rule=AggregationRule(mode="median")).result()
    torch.testing.assert_close(median["embed"], (each[0]["embed"] + each[1]["embed"]) / 2, rtol=0, atol=1e-6)


def test_non_finite_input_is_named(codec: GradientCodec) -> None:
    grads = _grads()
    grads["embed"][3, 4] = float("nan")
    with pytest.raises(Exception, match="embed"):
        codec.compress(grads)
    grads = _grads()
    grads["conv"][1, 2, 3] = -float("inf")
    with pytest.raises(NonFiniteInput, match="conv"):
        codec.compress(grads, ErrorFeedback())


def _replace(payload: CompressedGradient, name: str, **fields: object) -> CompressedGradient:
    tensors = tuple(dataclasses.replace(t, **fields) if t.name == name else t for t in payload.tensors)
    return dataclasses.replace(payload, tensors=tensors)


def _scales(values: list[float]) -> bytes:
    return np.array(values, "<f4").tobytes()


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"values": b"\x00" * (3 * 128 - 1)}, "values"),  # one code short
        ({"values": b"\x80" + b"\x00" * (3 * 128 - 1)}, "values"),  # -128
        ({"lut": b"\x00" * 20}, "lut"),  # a scale short
        ({"lut": _scales([1.0, float("nan"), 1, 1, 1, 1])}, "lut"),
        ({"lut": _scales([1.0, -1.0, 1, 1, 1, 1])}, "lut"),
        ({"lut": _scales([1.0, 1e31, 1, 1, 1, 1])}, "lut"),
        ({"shift": 1.0}, "shift"),
        ({"scale": 0.5}, "scale"),
        ({"k": 4}, "k"),
        ({"chunk_shape": (32, 32)}, "chunk_shape"),
        ({"indices": b"\x00"}, "indices"),
        ({"encoding": Encoding.SPARSE}, "encoding"),
        ({"value_format": ValueFormat.LUT}, "value_format"),
    ],
)
def test_a_malformed_factored_tensor_is_refused_naming_it(codec: GradientCodec, fields: dict, field: str) -> None:
    good = codec.compress(_grads())
    agg = codec.aggregator()
    agg.add(good)
    before = agg.result()
    with pytest.raises(PayloadError) as err:
        agg.add(_replace(good, "embed", **fields))
    assert (err.value.tensor, err.value.field) == ("embed", field)
    after = agg.result()  # the running sum is as it was
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_settings_with_another_rank_are_refused(codec: GradientCodec) -> None:
    payload = codec.compress(_grads())
    other = dataclasses.replace(payload, settings=dataclasses.replace(CONFIG, rank=2))
    with pytest.raises(PayloadError, match="settings"):
        codec.decode(other)
    msg = serde.gradient_to_proto(payload)
    msg.settings.rank = 5000
    with pytest.raises(PayloadError, match="rank"):
        serde.gradient_from_bytes(msg.SerializeToString())
    with pytest.raises(ValueError, match="rank"):
        CodecConfig(rank=-1)


def _decaying(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A matrix whose singular values fall as 1 / (i + 1): a pseudo-gradient's spectrum, roughly."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, cols, generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g))
    return (u / torch.arange(1, cols + 1)) @ v.T


def test_the_randomized_factorization_is_close_to_the_best_and_repeatable() -> None:
    m = _decaying(600, 200, seed=7)
    a, b = lowrank.factorize(m, 6, "svd")
    best = m - a @ b
    a, b = lowrank.factorize(m, 6, "randomized")
    residual = m - a @ b
    assert float(residual.norm()) <= 1.02 * float(best.norm())  # within 2% of the truncated SVD's error
    again = lowrank.factorize(m, 6, "randomized")
    assert torch.equal(again[0], a) and torch.equal(again[1], b)  # a fixed seed: resumes replay it
    with pytest.raises(ValueError, match="factorization"):
        lowrank.factorize(m, 6, "qr")
    with pytest.raises(ValueError, match="factorization"):
        GradientCodec(SHAPES, CONFIG, factorization="qr")  # type: ignore[arg-type]


def test_auto_factors_exactly_up_to_the_limit_and_randomly_past_it(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _decaying(120, 80, seed=8)
    exact = lowrank.factorize(m, 4, "svd")
    assert all(torch.equal(x, y) for x, y in zip(lowrank.factorize(m, 4), exact))
    monkeypatch.setattr(lowrank, "EXACT_MAX_SIDE", 79)
    randomized = lowrank.factorize(m, 4, "randomized")
    assert all(torch.equal(x, y) for x, y in zip(lowrank.factorize(m, 4), randomized))


def test_fitted_ranks_spend_at_most_each_matrixs_top_k_bytes() -> None:
    shapes = {"embed": (8192, 256), "qkv": (768, 256), "proj": (256, 256), "small": (64, 64), "norm": (256,)}
    top_k = CodecConfig(bins=4, topk=143, indices="elias-fano")
    fit = dataclasses.replace(top_k, rank_fits_topk=True)
    sparse = {t.name: t for t in GradientCodec(shapes, top_k).plan.tensors}
    plan = {t.name: t for t in GradientCodec(shapes, fit).plan.tensors}
    assert {n: (t.encoding, t.k) for n, t in plan.items() if n != "norm"} == {
        "embed": (Encoding.LOW_RANK, 9),  # gpt-5m's matrices
        "qkv": (Encoding.LOW_RANK, 7),
        "proj": (Encoding.LOW_RANK, 4),
        "small": (Encoding.LOW_RANK, 1),  # 158 bytes of top-k buy one term of 136
    }
    assert plan["norm"].encoding == Encoding.DENSE  # vectors dense, as with a fixed rank

    def nbytes(t) -> int:
        return GradientCodec({t.name: t.shape}, fit if t.encoding == Encoding.LOW_RANK else top_k).plan.payload_bytes()

    for name in ("embed", "qkv", "proj", "small"):
        factored, one_more = nbytes(plan[name]), (plan[name].k + 1) * (sum(plan[name].shape) + 8)
        assert factored <= nbytes(sparse[name]) + 8 < one_more, name  # + the top-k's shift and scale
    # A cap: rank > 0 with the fit bounds it; a matrix too thin to fit a term keeps the top-k.
    capped = {t.name: t.k for t in GradientCodec(shapes, dataclasses.replace(fit, rank=5)).plan.tensors}
    assert (capped["embed"], capped["proj"]) == (5, 4)
    thin = GradientCodec({"w": (2048, 2)}, fit).plan.tensors[0]
    assert thin.encoding == Encoding.SPARSE
    settings = serde.settings_from_proto(serde.settings_to_proto(fit))
    assert settings == fit and settings.rank_fits_topk


# ------------------------------------------------------------------ the subspace carried from round to round

FIT = CodecConfig(bins=4, topk=512, indices="elias-fano", rank_fits_topk=True, rank=3)  # --rank fit, capped at 3
LOW = {"q": (96, 48), "k": (96, 48), "v": (96, 48), "out": (48, 80)}  # three matrices of one shape: one stack


def _low_rank_rounds(rounds: int, seed: int = 0, rank: int = 3, noise: float = 1e-3) -> list[dict[str, torch.Tensor]]:
    """Pseudo-gradients whose matrices share a rank-``rank`` subspace from round to round (new weights on it
    every round), plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    bases = {n: (torch.randn(s[0], rank, generator=g), torch.randn(rank, s[1], generator=g)) for n, s in LOW.items()}
    return [
        {
            n: u @ torch.diag(torch.rand(rank, generator=g) + 0.5) @ v + noise * torch.randn(LOW[n], generator=g)
            for n, (u, v) in bases.items()
        }
        for _ in range(rounds)
    ]


@pytest.fixture(params=["householder", "cholesky"])
def qr(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each thin QR ``refine`` takes: Householder (a CPU's) and, forced here, the batched Cholesky-QR a GPU's
    ``refine`` takes (``lowrank.thin_qr``)."""
    if request.param == "cholesky":
        monkeypatch.setattr(lowrank, "thin_qr", lambda device: lowrank.cholesky_qr)
    return request.param


def test_refine_takes_householder_qr_on_a_cpu_and_cholesky_qr_elsewhere() -> None:
    assert lowrank.thin_qr(torch.device("cpu")) is torch.linalg.qr
    assert lowrank.thin_qr(torch.device("cuda", 0)) is lowrank.cholesky_qr


def _spectrum(rows: int, cols: int, values: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, cols, generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g))
    return (u * values) @ v.T


@pytest.mark.parametrize(
    "case",
    ["decaying", "to 1e-9", "rank 2", "zero", "huge", "tiny", "square"],
)
def test_cholesky_qr_gives_an_orthonormal_basis_of_each_matrix_and_r(case: str) -> None:
    rows, w = (24, 24) if case == "square" else (300, 16)
    values = {
        "to 1e-9": torch.logspace(0, -9, w),
        "rank 2": torch.tensor([3.0, 1.0] + [0.0] * (w - 2)),
        "zero": torch.zeros(w),
    }.get(case, 1.0 / torch.arange(1, w + 1))
    scale = {"huge": 1e30, "tiny": 1e-30}.get(case, 1.0)
    y = torch.stack([_spectrum(rows, w, values, seed) * scale for seed in range(3)])  # a batch of 3
    q, r = lowrank.cholesky_qr(y)
    assert q.shape == y.shape and r.shape == (3, w, w) and q.dtype == r.dtype == torch.float32
    # orthonormal columns, completed where the matrix lacks directions (all of them for a zero one)
    torch.testing.assert_close(q.mT @ q, torch.eye(w).expand(3, w, w), rtol=0, atol=2e-6)
    torch.testing.assert_close(r, q.mT @ y, rtol=0, atol=0)
    # spanning each matrix: what q q^T misses of y is as little as float32 and the fill allow
    missed = torch.linalg.matrix_norm((y - q @ r).double())
    assert float((missed / torch.linalg.matrix_norm(y.double()).clamp_min(1e-300)).max()) < 2e-5, missed
    if case == "zero":
        assert not r.any() and not missed.any()
    q2, r2 = lowrank.cholesky_qr(y)  # the same matrices, the same basis
    assert torch.equal(q, q2) and torch.equal(r, r2)


def test_cholesky_qr_spans_what_householder_qr_spans() -> None:
    y = torch.stack([_decaying(500, 20, seed) for seed in range(4)])
    q, _ = lowrank.cholesky_qr(y)
    h, _ = torch.linalg.qr(y)
    for k in (1, 5, 20):  # the leading directions of each agree (up to the signs of their columns)
        top = h[..., :k]
        assert float((top - q @ (q.mT @ top)).norm() / top.norm()) < 1e-4, k
    # column by column the same basis but for signs: both orthonormalize the columns in order
    signs = torch.sign((q * h).sum(-2, keepdim=True))
    torch.testing.assert_close(q, h * signs, rtol=0, atol=1e-4)


def test_refine_by_cholesky_qr_sends_what_refine_by_householder_sends() -> None:
    m = torch.stack([_decaying(96, 48, seed) for seed in range(3)])
    q = lowrank.seed(m[0], 3)[2].expand(3, -1, -1).contiguous()  # one carried subspace for all three
    a, b, carried = lowrank.refine(m, q, 3)
    a2, b2, carried2 = lowrank.refine(m, q, 3, qr=lowrank.cholesky_qr)
    sent, sent2 = a @ b, a2 @ b2
    assert float(torch.linalg.matrix_norm(sent - sent2).max() / torch.linalg.matrix_norm(sent).min()) < 1e-5
    gram = carried2.mT @ carried2
    torch.testing.assert_close(gram, torch.eye(gram.shape[-1]).expand_as(gram), rtol=0, atol=2e-6)
    # the refined subspaces agree but for the signs of their columns
    torch.testing.assert_close(carried2.abs(), carried.abs(), rtol=0, atol=1e-4)


def test_the_carried_subspace_sends_the_payload_a_fresh_factorization_would_in_the_same_bytes(qr: str) -> None:
    power, fresh = GradientCodec(LOW, FIT), GradientCodec(LOW, FIT, factorization="svd")
    assert power.factorization == "power"  # the default
    assert {t.k for t in power.plan.dense} == {3}
    feedback, top_k_bytes = ErrorFeedback(beta=0.95), GradientCodec(LOW, dataclasses.replace(FIT, rank_fits_topk=False))
    for r, grads in enumerate(_low_rank_rounds(4)):
        # The buffer this round factors, and the best rank-3 factors of it, found from scratch.
        buffers = {n: feedback.beta * feedback.buffers[n].view(g.shape) + g if r else g for n, g in grads.items()}
        payload = power.compress(grads, feedback)
        assert payload.nbytes == power.plan.payload_bytes() <= top_k_bytes.plan.payload_bytes()
        got = power.decompress(payload)
        for name, m in buffers.items():
            best = fresh.decompress(fresh.compress({**grads, name: m}))[name]  # no feedback: from scratch
            if r == 0:  # no subspace yet: seeded by the fresh factorization itself, bit for bit
                assert torch.equal(got[name], best), name
            else:  # one power iteration from last round's subspace gets as close as int8 codes can tell
                rel = float((got[name] - best).norm() / best.norm())
                assert rel < 1e-4, (r, name, rel)  # (int8 codes alone are about 1% off)
        assert set(feedback.subspaces) == set(LOW) and feedback.subspaces["q"].shape == (48, 6)  # rank + 3 more


def test_one_power_iteration_a_round_turns_a_subspace_seeded_on_noise_to_the_best(qr: str) -> None:
    # Seeded on noise, then the same matrix every round (beta 0: the buffer is the matrix): each round's
    # iteration sharpens the carried subspace, and what is sent nears the truncated SVD's share in a few.
    m = _decaying(96, 48, seed=5)
    best = float(torch.linalg.svdvals(m)[:3].square().sum() / m.square().sum())  # rank 3 holds 84%
    codec, feedback = GradientCodec({"w": (96, 48)}, CONFIG), ErrorFeedback(beta=0.0)
    codec.compress({"w": torch.randn(96, 48, generator=torch.Generator().manual_seed(1))}, feedback)
    shares = []
    for _ in range(4):
        sent = codec.decompress(codec.compress({"w": m}, feedback))["w"]
        shares.append(1 - float((sent - m).square().sum() / m.square().sum()))
    assert shares[0] < best - 0.01 and shares == sorted(shares) and shares[-1] > best - 0.001, (shares, best)


def test_stacked_by_shape_each_matrix_gets_what_it_would_alone() -> None:
    rounds = _low_rank_rounds(3, seed=1)
    together, feedback = GradientCodec(LOW, FIT), ErrorFeedback(beta=0.95)
    alone = {n: (GradientCodec({n: s}, FIT), ErrorFeedback(beta=0.95)) for n, s in LOW.items()}
    for grads in rounds:
        payload = {t.name: t for t in together.compress(grads, feedback).tensors}
        for name, (codec, own) in alone.items():
            (single,) = codec.compress({name: grads[name]}, own).tensors
            assert single == payload[name], name  # the same codes and scales
            assert torch.equal(own.subspaces[name], feedback.subspaces[name])
            assert torch.equal(own.buffers[name], feedback.buffers[name])


def test_every_stack_is_factored_before_the_host_reads_them_in_two_reads() -> None:
    # Two shapes, so two stacks (q, k, v together; out alone): on a GPU a read waits for the device, so every
    # stack's work is launched first and all the factors come back in one read of codes and one of scales.
    codec, feedback = GradientCodec(LOW, FIT), ErrorFeedback(beta=0.95)
    for grads in _low_rank_rounds(2, seed=3):
        with Calls({"cpu", "sub_"}) as calls:
            payload = codec.compress(grads, feedback)
        assert calls.names.count("sub_") == len(LOW)  # each buffer loses what was sent
        assert calls.names.count("cpu") == 2 and calls.names[-2:] == ["cpu", "cpu"], calls.names
        for t in payload.tensors:  # and the factors read back are each matrix's own
            alone = GradientCodec({t.name: LOW[t.name]}, FIT).decompress
            assert alone(dataclasses.replace(payload, tensors=(t,)))[t.name].shape == LOW[t.name]


def test_the_subspace_travels_in_the_feedback_state_and_a_restored_sender_sends_the_same_bytes() -> None:
    rounds = _low_rank_rounds(5, seed=2)
    codec, straight = GradientCodec(LOW, FIT), ErrorFeedback(beta=0.95)
    for grads in rounds[:2]:
        codec.compress(grads, straight)
    state = straight.state_dict()
    assert {k for k in state if k.startswith(SUBSPACE)} == {SUBSPACE + n for n in LOW}
    restored = ErrorFeedback(beta=0.95)
    restored.load_state_dict({k: v.clone() for k, v in state.items()})
    assert restored.buffers.keys() == straight.buffers.keys() and restored.subspaces.keys() == set(LOW)
    lost = ErrorFeedback(beta=0.95)  # a state without its subspaces (a checkpoint from before them)
    lost.load_state_dict({k: v for k, v in state.items() if not k.startswith(SUBSPACE)})
    for grads in rounds[2:]:
        want = serde.gradient_to_bytes(codec.compress(grads, straight))
        assert serde.gradient_to_bytes(codec.compress(grads, restored)) == want
        assert serde.gradient_to_bytes(codec.compress(grads, lost)) != want  # seeded afresh: other factors
    assert all(torch.equal(straight.state_dict()[k], v) for k, v in restored.state_dict().items())
    # Scoped (a fragment's, a bucket's) subspaces sit under their prefix; a reset drops them with the buffers.
    scoped = ErrorFeedback()
    GradientCodec(LOW, FIT).compress(rounds[0], ScopedFeedback(scoped, "fragment0of2/"))
    assert set(scoped.subspaces) == {f"fragment0of2/{n}" for n in LOW}
    scoped.reset()
    assert not scoped.subspaces and not scoped.state_dict()


def test_without_feedback_or_from_scratch_nothing_is_carried() -> None:
    grads = _low_rank_rounds(1, seed=3)[0]
    power, auto = GradientCodec(LOW, FIT), GradientCodec(LOW, FIT, factorization="auto")
    assert power.compress(grads) == auto.compress(grads)  # no feedback, nowhere to keep a subspace: auto
    feedback = ErrorFeedback()
    auto.compress(grads, feedback)
    assert feedback.buffers and not feedback.subspaces


def test_a_zero_buffer_sends_zeros_and_keeps_an_orthonormal_subspace(qr: str) -> None:
    codec, feedback = GradientCodec({"w": (40, 24)}, CONFIG), ErrorFeedback(beta=0.0)
    codec.compress({"w": torch.randn(40, 24)}, feedback)  # seeds
    for _ in range(2):
        factors = codec.decode(codec.compress({"w": torch.zeros(40, 24)}, feedback)).factors["w"]
        assert not factors.a_scale.any() and not factors.b_scale.any()
        q = feedback.subspaces["w"]
        torch.testing.assert_close(q.T @ q, torch.eye(q.shape[1]), rtol=0, atol=1e-5)
