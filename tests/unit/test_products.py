"""Factored matrices stay factors on the coordinator's critical path (``compression.products``): a norm, an
aggregate's running sum and an emptiness check read the factors; the product is multiplied out only when
read, and the aggregate's result is the bits of multiplying out each sender as it came."""

from __future__ import annotations

import pytest
import torch

from gradwire.compression import CodecConfig, ErrorFeedback, GradientCodec, products
from gradwire.compression.aggregate import Aggregator
from gradwire.compression.lowrank import Factors, quantize
from gradwire.compression.robust import payload_norm

from ..hostreads import Calls

SHAPES = {"embed": (96, 64), "qkv": (64, 192), "bias": (192,), "norm": (64,)}
CONFIG = CodecConfig(bins=4, topk=143, indices="elias-fano", rank=3)


def _factors(seed: int, rows: int = 40, cols: int = 24, rank: int = 3) -> Factors:
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(rows, rank, generator=gen), torch.randn(rank, cols, generator=gen))


def _payloads(n: int) -> tuple[GradientCodec, list]:
    codec = GradientCodec(SHAPES, CONFIG)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        grads = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
        out.append(codec.compress(grads, ErrorFeedback(beta=0.9)))
    return codec, out


def test_inner_products_and_norms_come_from_the_factors():
    f, g = _factors(1), _factors(2)
    (a_f, b_f), (a_g, b_g) = products.factor_matrices(f), products.factor_matrices(g)
    dense_f, dense_g = a_f @ b_f, a_g @ b_g
    assert torch.allclose(dense_f.float(), f.decode("cpu"), rtol=1e-5, atol=1e-6)
    cross = products.sum_norm_sq([[(f, 1.0), (g, 1.0)]]) - products.norm_sq([f, g])  # 2 <A_f B_f, A_g B_g>
    assert torch.allclose(cross / 2, (dense_f * dense_g).sum(), rtol=1e-8)
    terms = [(f, 0.25), (g, 1.5), (f, -0.5)]
    total = sum(w * d for (_, w), d in zip(terms, (dense_f, dense_g, dense_f)))
    other = [(g, 2.0), (f, 1.0), (g, 0.5)]  # a second matrix of the same shape: batched with the first
    total_other = sum(w * d for (_, w), d in zip(other, (dense_g, dense_f, dense_g)))
    small = [(_factors(4, 8, 5, 2), 1.0), (_factors(5, 8, 5, 2), 1.0), (_factors(6, 8, 5, 2), 1.0)]  # another shape
    total_small = sum(w * (lambda a, b: a @ b)(*products.factor_matrices(x)) for x, w in small)
    expected = total.square().sum() + total_other.square().sum() + total_small.square().sum()
    assert torch.allclose(products.sum_norm_sq([terms, other, small]), expected, rtol=1e-10)
    assert torch.allclose(products.norm_sq([f, g]), dense_f.square().sum() + dense_g.square().sum(), rtol=1e-10)
    # Each sender's own squared norm given (kept from its clip): only the cross terms are computed.
    known = [[products.norm_sq([x]) for x, _ in m] for m in (terms, other, small)]
    assert torch.allclose(products.sum_norm_sq([terms, other, small], known), expected, rtol=1e-10)
    assert products.sum_norm_sq([[(f, 0.5)]], [[torch.tensor(8.0, dtype=torch.float64)]]) == 2.0  # read, not computed
    zero = Factors(torch.zeros_like(f.a), f.a_scale, f.b, f.b_scale)
    assert products.is_zero(zero) and not products.is_zero(f)
    half = Factors(f.a, torch.tensor([0.0, 1.0, 0.0]), f.b, torch.tensor([1.0, 0.0, 1.0]))  # no live term
    assert products.is_zero(half)


def test_gram_matrices_of_codes_are_exact_at_any_size():
    """The k x k Gram matrices the norms are made of are the integers' own, whatever their size: the float32
    blocks never round (the largest codes everywhere, a sum past 2^24) and the float64 sum of blocks neither."""
    assert products.exact_block_rows(torch.full((2000, 1), 127), torch.full((2000, 1), -127)) == 1040
    rows = 3 * 1040 + 17  # three whole blocks of int8 codes and a part
    worst = torch.full((2, rows, 3), 127, dtype=torch.int8)
    worst[1, ::2] = -127
    exact = worst.long().mT @ worst.long()  # int64: no rounding at all
    assert int(exact.abs().max()) > 2**24  # float32 over all rows at once could not hold it
    assert torch.equal(products.code_gram(worst, worst), exact.double())
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-127, 128, (3, rows, 4), generator=gen, dtype=torch.int8)
    y = torch.randint(-127, 128, (3, rows, 2), generator=gen, dtype=torch.int8)
    assert torch.equal(products.code_gram(x, y), (x.long().mT @ y.long()).double())
    # int4 codes take blocks 330x longer, as exact: the largest codes over more rows than one block of them holds.
    rows4 = 2 * products.exact_block_rows(torch.full((2000, 1), 7), torch.full((2000, 1), -7)) + 5
    assert rows4 == 2 * 342_392 + 5
    worst4 = torch.full((1, rows4, 2), 7, dtype=torch.int8)
    worst4[0, ::3, 1] = -7
    exact4 = worst4.long().mT @ worst4.long()
    assert int(exact4.abs().max()) > 2**24
    assert torch.equal(products.code_gram(worst4, worst4), exact4.double())
    assert torch.equal(products.code_gram(worst4[:, :0], worst4[:, :0]), torch.zeros(1, 2, 2, dtype=torch.float64))
    # A norm made of them is the dense product's, and the same bits batched or alone.
    f = _factors(7, rows=rows, cols=24, rank=4)
    a, b = products.factor_matrices(f)
    assert torch.allclose(products.norm_sq([f]), (a @ b).square().sum(), rtol=1e-12)
    assert torch.equal(products.item_norms_sq([f, f])[1], products.item_norms_sq([f])[0])


def test_a_payloads_factored_norms_are_computed_once_for_its_clip_and_the_aggregate():
    codec, payloads = _payloads(2)
    decoded = [codec.decode(p) for p in payloads]
    norms = decoded[0].dense.norms_sq()
    assert norms and all(isinstance(products.items(decoded[0].dense)[i], Factors) for i in norms)
    dense = {i: decoded[0].dense[i].double() for i in norms}
    assert all(torch.allclose(n, dense[i].square().sum(), rtol=1e-8) for i, n in norms.items())
    assert decoded[0].dense.norms_sq() is norms  # kept
    fresh = [codec.decode(p) for p in payloads]  # their norms not computed yet: the aggregate computes its own
    for senders in (decoded[:1], decoded, fresh[:1], fresh):
        agg = Aggregator(codec)
        for d, w in zip(senders, (1.0, 3.0)):
            agg.add(d, w)
        expected = torch.linalg.vector_norm(torch.cat([t.double().view(-1) for t in agg.result().values()]))
        assert abs(agg.norm() - float(expected)) < 1e-5 * float(expected)
    assert payload_norm(decoded[1]) == payload_norm(codec.decode(payloads[1]))


def test_products_are_multiplied_out_once_and_only_when_read():
    f, plain = _factors(3), torch.arange(5.0)
    dense = products.Products([plain, f], "cpu")
    assert products.items(dense)[1] is f and not dense._made
    product = dense[1]
    assert torch.equal(product, f.decode("cpu").view(-1)) and dense[1] is product  # kept
    assert [t.shape for t in dense] == [(5,), (40 * 24,)] and dense[0] is plain
    assert products.items([plain]) == [plain]


def test_a_factored_aggregate_is_summed_from_factors_and_multiplied_out_bit_for_bit():
    codec, payloads = _payloads(3)
    decoded = [codec.decode(p) for p in payloads]
    assert any(isinstance(x, Factors) for x in products.items(decoded[0].dense))
    weights = (2.0, 1.0, 3.0)
    agg = Aggregator(codec)
    for d, w in zip(decoded, weights):
        agg.add(d, w)
    assert codec.plan.factored and not agg._products  # nothing allocated for the factored matrices by adding
    norm = agg.norm()  # senders and taking the norm
    assert not agg._products
    # The sum: each sender multiplied out and added as it came, as a dense buffer of their products would be.
    for i, t in enumerate(codec.plan.dense):
        expected = torch.zeros(t.numel)
        for d, w in zip(decoded, weights):
            expected.add_(d.dense[i].to(torch.float32) * w)
        got = next(v for j, v in enumerate(agg.dense_values()) if j == i)
        assert torch.equal(got, expected / sum(weights)), t.name
    result = agg.result()
    flat = torch.cat([v.reshape(-1).double() for v in result.values()])
    assert abs(norm - float(flat.norm())) <= 1e-5 * norm


def test_the_clip_norm_of_a_factored_payload_is_its_dense_norm():
    codec, (payload,) = _payloads(1)
    d = codec.decode(payload)
    dense = torch.cat([*(v.double().reshape(-1) for v in d.values), *(t.double() for t in d.dense)])
    assert abs(payload_norm(codec.decode(payload)) - float(dense.norm())) <= 1e-6 * float(dense.norm())


@pytest.mark.parametrize("config", [CONFIG, CodecConfig(min_sparse_numel=128)], ids=["factored", "top-k"])
def test_a_payload_decoded_onto_another_device_is_copied_there_a_dtype_at_a_time(config: CodecConfig) -> None:
    # On a GPU each blocking copy from the host waits for the device: a copy a tensor (four a factored matrix)
    # would stall it as many times. On the meta device (another device, without values) the copies are counted.
    shapes = {f"layer{i}.{part}": shape for i in range(4) for part, shape in SHAPES.items()}
    sent = GradientCodec(shapes, config).compress({k: torch.ones(s) for k, s in shapes.items()})
    codec = GradientCodec(shapes, config, device="meta")
    with Calls({"to"}) as calls:
        decoded = codec.decode(sent)
    assert len(decoded.factors) + len(decoded.values) >= 2 and len(decoded.dense) >= 4  # tensors of each kind
    assert calls.uploads() <= 2  # the coefficients' indices (int64) and every value (float32)
    assert all(x.a.device.type == "cpu" for x in decoded.factors.values())  # norms read them where they are
    with Calls({"to"}) as calls:
        made = list(decoded.dense)
    assert calls.uploads() == (2 if decoded.factors else 0)  # every matrix's codes (int8) and scales, at once
    assert [(t.device.type, t.numel()) for t in made] == [("meta", t.numel) for t in codec.plan.dense]
