"""Robust aggregation (compression.robust), its wire form in replays, and the benching decision."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig, GradientCodec
from gradwire.compression.aggregate import Aggregator
from gradwire.compression.robust import AGGREGATIONS, MEAN, AggregationRule, aggregate, clip_scales, payload_norm
from gradwire.coordinator.decisions import Standing, judge
from gradwire.replica import StateUpdate

SHAPES = {"w": (64, 48), "b": (48,), "v": (4096,)}
KEPT = AggregationRule(mode="kept-mean")


def grads(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=g) for k, s in SHAPES.items()} for _ in range(n)]


def payloads(codec: GradientCodec, gs: list[dict[str, torch.Tensor]]):
    return [codec.compress(g) for g in gs]


def test_clip_scales_follow_the_median() -> None:
    assert clip_scales([1.0, 2.0, 3.0], 0) == (1.0, 1.0, 1.0)
    assert clip_scales([1.0, 1.2, 1000.0], 2.0) == pytest.approx((1.0, 1.0, 2.4 / 1000.0))
    assert clip_scales([2.0, 4.0], 2.0) == (1.0, 1.0)  # two senders: neither exceeds twice their median
    assert clip_scales([], 2.0) == ()


def test_payload_norm_is_the_gradients_norm() -> None:
    codec = GradientCodec(SHAPES, CodecConfig(topk=4096))  # every coefficient kept: exact
    (g,) = grads(1)
    decoded = codec.decode(codec.compress(g))
    dense = torch.cat([t.reshape(-1) for t in g.values()])
    assert payload_norm(decoded) == pytest.approx(float(torch.linalg.vector_norm(dense)), rel=1e-3)


def test_clipped_mean_scales_a_sender_and_keeps_the_others_weight() -> None:
    codec = GradientCodec(SHAPES, CodecConfig(topk=32))
    ps = payloads(codec, grads(3))
    decs = [codec.decompress(p) for p in ps]
    got = aggregate(codec, ps, [1.0, 2.0, 3.0], [1.0, 0.5, 1.0]).result()
    for k in SHAPES:
        want = (1.0 * decs[0][k] + 2.0 * 0.5 * decs[1][k] + 3.0 * decs[2][k]) / 6.0
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["median", "trimmed-mean"])
def test_coordinate_rules_without_dct_are_elementwise_over_senders(mode: str) -> None:
    codec = GradientCodec(SHAPES, CodecConfig(topk=4096, use_dct=False, bins=0))  # raw and complete: exact
    gs = grads(5, seed=3)
    gs[4] = {k: v * 1000 for k, v in gs[4].items()}  # one huge sender
    got = aggregate(codec, payloads(codec, gs), [1.0] * 5, (), AggregationRule(mode=mode, trim=0.2)).result()
    for k in SHAPES:
        stack = torch.stack([g[k] for g in gs]).sort(dim=0).values
        want = stack[2] if mode == "median" else stack[1:4].mean(dim=0)
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5)
        assert got[k].abs().max() < 10  # the huge sender moved nothing


def test_rules_do_not_depend_on_sender_order() -> None:
    codec = GradientCodec(SHAPES, CodecConfig(topk=64))
    ps = payloads(codec, grads(4, seed=5))
    for rule in (MEAN, KEPT, AggregationRule(mode="median"), AggregationRule(mode="trimmed-mean")):
        results = [
            aggregate(codec, [ps[i] for i in order], [1.0] * 4, (), rule).result()
            for order in itertools.permutations(range(4), 4)
        ][:6]
        for r in results[1:]:
            for k in SHAPES:
                torch.testing.assert_close(r[k], results[0][k], rtol=1e-6, atol=1e-7)


def test_median_of_one_sender_is_its_decompression_and_norms_agree() -> None:
    codec = GradientCodec(SHAPES, CodecConfig(topk=32))
    (p,) = payloads(codec, grads(1))
    agg = aggregate(codec, [p], [1.0], (), AggregationRule(mode="median"))
    dense = codec.decompress(p)
    for k in SHAPES:
        torch.testing.assert_close(agg.result()[k], dense[k], rtol=1e-5, atol=1e-6)
    assert agg.norm() == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in dense.values()]))), rel=1e-4
    )


def test_bad_arguments() -> None:
    codec = GradientCodec(SHAPES, CodecConfig())
    ps = payloads(codec, grads(2))
    with pytest.raises(ValueError, match="scales"):
        aggregate(codec, ps, [1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        aggregate(codec, ps, [1.0, 1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="--aggregate"):
        AggregationRule(mode="mode")


def test_a_replay_carries_its_scales_and_rule() -> None:
    codec = GradientCodec(SHAPES, CodecConfig())
    ps = tuple(payloads(codec, grads(3)))
    update = StateUpdate(
        0.5, ps, (1.0, 2.0, 3.0), scales=(1.0, 0.25, 1.0), rule=AggregationRule(mode="trimmed-mean", trim=0.3)
    )
    back = protocol.update_from_proto(protocol.update_to_proto(update))
    assert (back.scales, back.rule, back.weights) == (update.scales, update.rule, update.weights)
    plain = protocol.update_from_proto(protocol.update_to_proto(dataclasses.replace(update, scales=(), rule=MEAN)))
    assert (plain.scales, plain.rule) == ((), MEAN)
    msg = protocol.update_to_proto(update)
    msg.replay.scales[1] = 1.5
    with pytest.raises(protocol.ProtocolError, match="replay scales"):
        protocol.update_from_proto(msg)
    msg.replay.scales[1] = 0.5
    msg.replay.aggregation = "mode"
    with pytest.raises(protocol.ProtocolError, match="replay aggregation"):
        protocol.update_from_proto(msg)
    del msg.replay.scales[0]
    with pytest.raises(protocol.ProtocolError, match="clip scales"):
        protocol.update_from_proto(msg)


def test_judge_benches_after_strikes_in_a_row_and_forgives_a_good_round() -> None:
    s = Standing()
    s, why = judge(s, 10, "clipped", bench_after=3, bench_rounds=5)
    assert (s.strikes, s.benched(11)) == (1, False) and "strike 1 of 3" in why
    s, _ = judge(s, 11, "rejected", bench_after=3, bench_rounds=5)
    s, why = judge(s, 12, "rejected", bench_after=3, bench_rounds=5)
    assert s.benched(13) and s.benched(17) and not s.benched(18) and "benched until step 18" in why
    s2, why = judge(Standing(strikes=2), 5, "ok", bench_after=3, bench_rounds=5)
    assert s2 == Standing() and "cleared" in why
    s3, _ = judge(Standing(strikes=9), 5, "rejected", bench_after=0, bench_rounds=5)
    assert s3.strikes == 10 and not s3.benched(6)  # benching off


def test_exact_aggregation_gives_the_same_bits_whichever_way_it_is_summed() -> None:
    """The sparse inverse (bmm over the kept coefficients) and the dense one (scatter, then two matmuls)
    sum the same numbers in different orders, as a GPU and a CPU do. In float32 they disagree in the last
    bits, and a sign step flips where a coordinate is near zero; in float64 rounded once they agree."""
    codec = GradientCodec(SHAPES, CodecConfig(topk=4))  # few enough kept that two senders go sparse
    ps = payloads(codec, grads(2, seed=3))

    def combine(sparse: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        agg = Aggregator(codec, sparse=sparse, dtype=dtype)
        for p, w in zip(ps, (3.0, 5.0)):
            agg.add(p, w)
        return agg.result()

    fast, slow = combine(True, torch.float32), combine(False, torch.float32)
    assert not all(torch.equal(fast[k], slow[k]) for k in SHAPES)  # the control: float32 does differ
    fast, slow = combine(True, torch.float64), combine(False, torch.float64)
    for k in SHAPES:
        assert fast[k].dtype == torch.float32 and torch.equal(fast[k], slow[k]), k
        assert torch.equal(torch.sign(fast[k]), torch.sign(slow[k])), k
    # and exactly what the float32 path approximates
    for k in SHAPES:
        torch.testing.assert_close(fast[k], combine(True, torch.float32)[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["mean", "kept-mean", "median", "trimmed-mean"])
def test_an_exact_rule_travels_in_the_replay_and_combines_in_float64(mode: str) -> None:
    codec = GradientCodec(SHAPES, CodecConfig())
    ps = tuple(payloads(codec, grads(3)))
    rule = AggregationRule(mode=mode, exact=True)
    back = protocol.update_from_proto(protocol.update_to_proto(StateUpdate(0.5, ps, (1.0, 2.0, 3.0), rule=rule)))
    assert back.rule == rule and back.rule.dtype == torch.float64
    exact = aggregate(codec, ps, (1.0, 2.0, 3.0), rule=rule).result()
    plain = aggregate(codec, ps, (1.0, 2.0, 3.0), rule=AggregationRule(mode=mode)).result()
    for k in SHAPES:
        assert exact[k].dtype == torch.float32
        torch.testing.assert_close(exact[k], plain[k], rtol=1e-5, atol=1e-6)


def test_a_replay_can_leave_out_the_receivers_own_payload() -> None:
    codec = GradientCodec(SHAPES, CodecConfig())
    ps = tuple(payloads(codec, grads(3)))
    update = StateUpdate(0.5, ps, (1.0, 2.0, 3.0), scales=(1.0, 0.5, 1.0))
    for position in range(3):
        short = update.without(position, round=7)
        assert len(short.payloads) == 2 and short.own == (position, 7) and short.nbytes < update.nbytes
        back = protocol.update_from_proto(protocol.update_to_proto(short))
        assert back.own == (position, 7) and back.weights == update.weights and back.scales == update.scales
        assert back.with_own(ps[position]) == update
    with pytest.raises(ValueError, match="put it back first"):
        from gradwire.models import build_from_spec, model_spec
        from gradwire.optim.outer import UpdateRule
        from gradwire.replica import Replica  # noqa: F401 - the replica refuses a partial replay

        Replica(build_from_spec(model_spec("gpt-tiny")), UpdateRule()).apply(update.without(0, 1))
    msg = protocol.update_to_proto(update.without(2, 7))
    msg.replay.own_position = 4
    with pytest.raises(protocol.ProtocolError, match="beyond"):
        protocol.update_from_proto(msg)
    msg.replay.own_position = 0  # then the weights count one sender too many
    with pytest.raises(protocol.ProtocolError, match="weights"):
        protocol.update_from_proto(msg)
    with pytest.raises(ValueError, match="cannot leave out"):
        update.without(3, 7)


# ----------------------------------------------------------------------------------------------- kept-mean
# templar's aggregate: each coefficient the (weighted) mean over the senders that kept it.
RAW = CodecConfig(topk=256, use_dct=False, bins=0)  # raw float32 values, no transform: coefficients are values


def kept_mean_by_hand(codec: GradientCodec, ps, weights, scales) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per group the (B, chunk_numel) coefficients, and the dense tensors, one coefficient at a time from
    the decoded payloads: sum of weight x scale x value over the senders that sent it, over their weights."""
    decoded = [codec.decode(p) for p in ps]
    groups = []
    for gi, g in enumerate(codec.plan.groups):
        num = torch.zeros(g.num_chunks, g.chunk_numel, dtype=torch.float64)
        den = torch.zeros_like(num)
        for d, w, s in zip(decoded, weights, scales):
            for b in range(g.num_chunks):
                for i, v in zip(d.indices[gi][b].tolist(), d.values[gi][b].tolist()):
                    num[b, i] += w * s * v
                    den[b, i] += w
        groups.append(torch.where(den > 0, num / den.clamp_min(1e-30), 0.0))
    dense = [
        sum(w * s * d.dense[ti].double() for d, w, s in zip(decoded, weights, scales)) / sum(weights)
        for ti in range(len(codec.plan.dense))
    ]
    return groups, dense


def shared_and_alone(codec: GradientCodec, ps) -> tuple[int, int]:
    """How many coefficients both of two senders kept, and how many only one of them did."""
    a, b = (codec.decode(p) for p in ps)
    both = sum(len(set(x.tolist()) & set(y.tolist())) for ia, ib in zip(a.indices, b.indices) for x, y in zip(ia, ib))
    total = sum(i.numel() for i in (*a.indices, *b.indices))
    return both, total - 2 * both


@pytest.mark.parametrize(
    "config",
    [RAW, CodecConfig(topk=256, bins=4), CodecConfig(topk=4, bins=4)],
    ids=["raw", "dct-2bit", "dct-2bit-few"],  # few: so few kept that two senders are summed sparse
)
@pytest.mark.parametrize("overlap", ["disjoint", "overlapping"])
def test_kept_mean_is_the_mean_over_the_senders_that_kept_each_coefficient(config, overlap: str) -> None:
    codec = GradientCodec(SHAPES, config)
    a, b = grads(2, seed=7)
    if overlap == "disjoint":  # raw: b is 0 where a sent, so keeps none of a's; DCT: independent, few shared
        if not config.use_dct:
            sent_a = codec.decompress(codec.compress(a))
            b = {k: torch.where(sent_a[k] != 0, 0.0, v) if k != "b" else v for k, v in b.items()}
    else:  # b is a plus noise: much the same coefficients, not all
        b = {k: a[k] + 0.5 * v for k, v in b.items()}
    ps = payloads(codec, [a, b])
    both, alone = shared_and_alone(codec, ps)
    assert alone > 0
    if overlap == "disjoint" and not config.use_dct:
        assert both == 0
    if overlap == "overlapping":
        assert both > 0
    weights, scales = (1.0, 3.0), (1.0, 0.5)
    agg = aggregate(codec, ps, weights, scales, KEPT)
    assert agg._sums is None and len(agg._held) == 2  # held as they came: the norm is taken from their pairs
    want_groups, want_dense = kept_mean_by_hand(codec, ps, weights, scales)
    norm = float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in (*want_groups, *want_dense)])))
    assert agg.norm() == pytest.approx(norm, rel=1e-5)
    assert agg._sums is None
    for got, want in zip(agg.coefficient_groups(), want_groups):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    if config.topk == 4:  # held sparse, as mean holds them: each kept coefficient's share from who kept it
        assert agg._sums is None and len(agg._held) == 2
        assert aggregate(codec, ps, weights, scales, MEAN)._held
    else:  # so many kept that the dense sums and their weights cost less, once the result is read
        assert agg._sums is not None and not agg._held
    for got, want in zip(agg.dense_values(), want_dense):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert agg.norm() == pytest.approx(norm, rel=1e-5)
    result = agg.result()
    assert list(result) == list(SHAPES)
    assert float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in result.values()]))) == pytest.approx(
        norm, rel=1e-4
    )  # the transform is orthonormal: the same norm in the parameter domain
    if not config.use_dct:  # and there, by hand in the parameter domain too: sent values are never 0
        dec = [codec.decompress(p) for p in ps]
        for k in SHAPES:
            num = sum(w * s * d[k].double() for d, w, s in zip(dec, weights, scales))
            den = sum(w * (d[k] != 0).double() for d, w in zip(dec, weights)) if k != "b" else sum(weights)
            want = torch.where(torch.as_tensor(den) > 0, num / torch.as_tensor(den).clamp_min(1e-30), 0.0)
            torch.testing.assert_close(result[k].double(), want, rtol=1e-5, atol=1e-6)


def test_kept_mean_keeps_a_lone_senders_value_and_shrinks_it_by_its_clip_scale_only() -> None:
    """Two senders that kept disjoint coefficients: kept-mean applies each one's values whole (mean halves
    them); a clip scale shrinks its sender's values, the weight does not matter where it is alone."""
    codec = GradientCodec(SHAPES, RAW)
    a, b = grads(2, seed=11)
    sent_a = codec.decompress(codec.compress(a))
    b = {k: torch.where(sent_a[k] != 0, 0.0, v) if k != "b" else v for k, v in b.items()}
    pa, pb = payloads(codec, [a, b])
    da, db = codec.decompress(pa), codec.decompress(pb)
    assert shared_and_alone(codec, [pa, pb])[0] == 0
    kept = aggregate(codec, [pa, pb], (1.0, 3.0), (1.0, 0.5), KEPT).result()
    mean = aggregate(codec, [pa, pb], (1.0, 3.0), (1.0, 0.5), MEAN).result()
    for k in ("w", "v"):  # sparse: each coefficient from one sender
        torch.testing.assert_close(kept[k], da[k] + 0.5 * db[k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mean[k], (da[k] + 3.0 * 0.5 * db[k]) / 4.0, rtol=1e-6, atol=1e-7)
    # dense tensors are sent whole by both: the weighted mean of the clipped values, as mean
    torch.testing.assert_close(kept["b"], (da["b"] + 3.0 * 0.5 * db["b"]) / 4.0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(kept["b"], mean["b"])
    # one sender alone: its decompression, clipped
    alone = aggregate(codec, [pb], (3.0,), (0.5,), KEPT).result()
    for k in SHAPES:
        torch.testing.assert_close(alone[k], 0.5 * db[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("exact", [False, True])
def test_kept_mean_replays_to_the_same_bits_in_either_order_of_two_senders(exact: bool) -> None:
    codec = GradientCodec(SHAPES, CodecConfig(topk=64, bins=4))
    ps = payloads(codec, grads(3, seed=13))
    rule = AggregationRule(mode="kept-mean", exact=exact)

    def combine(order, weights=(2.0, 5.0, 3.0), scales=(1.0, 0.75, 1.0)):
        return aggregate(codec, [ps[i] for i in order], [weights[i] for i in order], [scales[i] for i in order], rule)

    once, again = combine([0, 1]).result(), combine([0, 1]).result()
    swapped = combine([1, 0]).result()
    for k in SHAPES:  # two senders: every sum has two terms, and a + b == b + a in floating point
        assert torch.equal(once[k], again[k]) and torch.equal(once[k], swapped[k]), k
    three = [combine(order).result() for order in itertools.permutations(range(3))]
    for r in three[1:]:  # three or more: equal up to rounding; replicas replay in the coordinator's order
        for k in SHAPES:
            torch.testing.assert_close(r[k], three[0][k], rtol=1e-5, atol=1e-7)
    for k in SHAPES:
        assert torch.equal(combine([2, 0, 1]).result()[k], combine([2, 0, 1]).result()[k])


def test_replicas_replaying_a_kept_mean_update_stay_identical() -> None:
    """The coordinator's aggregate and every worker's replay of the update off the wire: the same bits."""
    from gradwire.models import build_from_spec, model_spec
    from gradwire.optim.outer import UpdateRule
    from gradwire.replica import Replica

    spec = model_spec("gpt-tiny")
    replicas = [Replica(build_from_spec(spec, seed=0), UpdateRule(optimizer="sgd")) for _ in range(3)]
    codec = replicas[0].codec(CodecConfig(topk=64, bins=4))
    g = torch.Generator().manual_seed(3)
    senders = [{n: torch.randn(p.shape, generator=g) for n, p in replicas[0].params.items()} for _ in range(2)]
    ps = tuple(codec.compress(s) for s in senders)
    update = StateUpdate(0.5, ps, (2.0, 1.0), scales=(1.0, 0.5), rule=KEPT)
    before = {n: p.detach().clone() for n, p in replicas[0].params.items()}
    replicas[0].apply(update, aggregator=aggregate(codec, ps, (2.0, 1.0), (1.0, 0.5), KEPT))  # the coordinator
    replicas[1].apply(protocol.update_from_proto(protocol.update_to_proto(update)))  # a worker, off the wire
    replicas[2].apply(update.without(1, round=4).with_own(ps[1]))  # a worker that sent the second payload
    for n in before:
        assert not torch.equal(replicas[0].params[n], before[n]), n
        assert torch.equal(replicas[0].params[n], replicas[1].params[n]), n
        assert torch.equal(replicas[0].params[n], replicas[2].params[n]), n
    mean = Replica(build_from_spec(spec, seed=0), UpdateRule(optimizer="sgd"))
    mean.apply(dataclasses.replace(update, rule=MEAN))
    assert any(not torch.equal(mean.params[n], replicas[0].params[n]) for n in before)


def test_kept_mean_is_a_choice_of_the_aggregate_setting() -> None:
    from gradwire.coordinator.config import TrainConfig

    assert "kept-mean" in AGGREGATIONS
    assert TrainConfig(aggregate="kept-mean").aggregation_rule(exact=True) == AggregationRule(
        mode="kept-mean", exact=True
    )
