"""The codec end to end: exact round trips, payload size, aggregation semantics, error feedback."""

import dataclasses
import itertools

import pytest
import torch

from gradwire.compression import CodecConfig, ErrorFeedback, GradientCodec, NonFiniteInput, aggregate
from gradwire.compression import codec as codec_module
from gradwire.compression.aggregate import Aggregator
from gradwire.compression.dct import dct_chunks, idct_chunks
from gradwire.compression.packing import ef_low_bits, ef_nbytes, unpack_ef
from gradwire.compression.payload import PayloadError

from .codec_helpers import check_corrupted_byte, rounds_to_send

# The transform's own math, to float32 rounding: whatever the CPU would pick (``dct.fast_transform_dtype``).
EXACT = torch.float32
SHAPES = {"w": (256, 192), "emb": (96, 64), "odd": (3, 5, 7, 11), "norm": (768,), "bias": (10,), "mid": (200,)}


def _grads(seed, dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g).to(dtype) for k, s in shapes.items()}


def _cat(d):
    return torch.cat([v.flatten().float() for v in d.values()])


@pytest.mark.parametrize("use_dct", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_k_without_quantization_is_exact(use_dct, dtype):
    codec = GradientCodec(SHAPES, CodecConfig(topk=64 * 64, bins=0, use_dct=use_dct), transform_dtype=EXACT)
    grads = _grads(0, dtype)
    out = codec.decompress(codec.compress(grads))
    for name, g in grads.items():
        assert out[name].shape == g.shape and out[name].dtype == torch.float32
        torch.testing.assert_close(out[name], g.float(), atol=1e-5, rtol=0)


def test_default_settings_keep_the_largest_coefficients():
    codec = GradientCodec({"w": (128, 128)}, CodecConfig(bins=0), transform_dtype=EXACT)
    g = _grads(1, shapes={"w": (128, 128)})
    out = codec.decompress(codec.compress(g))["w"]
    coeffs = dct_chunks(g["w"].reshape(2, 64, 2, 64).permute(0, 2, 1, 3).reshape(4, 64, 64)).reshape(4, -1)
    kept = torch.zeros_like(coeffs)
    top = coeffs.abs().topk(32, dim=1).indices
    kept.scatter_(1, top, coeffs.gather(1, top))
    ref = idct_chunks(kept.view(4, 64, 64)).view(2, 2, 64, 64).permute(0, 2, 1, 3).reshape(128, 128)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


CODINGS = {
    "8-bit": CodecConfig(),
    "2-bit": CodecConfig(bins=4),
    "3-bit": CodecConfig(bins=5),
    "4-bit": CodecConfig(bins=16),
    "sign": CodecConfig(values="sign"),
    "elias-fano": CodecConfig(bins=4, indices="elias-fano"),
}


@pytest.mark.parametrize("config", list(CODINGS.values()), ids=list(CODINGS))
def test_payload_size_is_what_the_plan_says_and_small(config):
    codec = GradientCodec(SHAPES, config)
    payload = codec.compress(_grads(2))
    assert payload.nbytes == codec.plan.payload_bytes()
    dense_bytes = 4 * codec.plan.numel
    assert dense_bytes / payload.nbytes > 40  # tiny tensors here; the 125M-model ratio is in the benchmark


def test_compression_is_deterministic():
    codec = GradientCodec(SHAPES, CodecConfig())
    g = _grads(3)
    a, b = codec.compress(g), codec.compress(g)
    assert a == b


def test_aggregate_equals_weighted_mean_of_decompressed():
    codec = GradientCodec(SHAPES, CodecConfig())
    payloads = [codec.compress(_grads(s)) for s in range(4)]
    weights = [100.0, 50.0, 25.0, 300.0]
    agg = codec.aggregate(payloads, weights)
    singles = [codec.decompress(p) for p in payloads]
    for name in SHAPES:
        ref = sum(w * s[name] for w, s in zip(weights, singles)) / sum(weights)
        torch.testing.assert_close(agg[name], ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_tensors_sent_whole_sum_in_one_buffer_to_the_bits_of_summing_each(dtype):
    codec = GradientCodec(SHAPES, CodecConfig())
    whole = codec.plan.whole
    assert [codec.plan.dense[i].name for i in whole] == ["bias", "mid"]  # (768,) is sparse: chunks of 256
    payloads = [codec.compress(_grads(s)) for s in range(3)]
    weights, scales = [3.0, 1.0, 2.5], [1.0, 0.3, 0.7]
    agg = codec.aggregator(dtype=dtype)
    for p, w, c in zip(payloads, weights, scales):
        agg.add(p, w, c)
    got = list(agg.dense_values())
    for i, t in enumerate(codec.plan.dense):
        expected = torch.zeros(t.numel, dtype=dtype)
        for p, w, c in zip(payloads, weights, scales):
            expected.add_(codec.decode(p).dense[i].to(dtype) * (w * c))  # as each was added before: one by one
        assert torch.equal(got[i], expected / sum(weights)), t.name
    assert agg.norm() == pytest.approx(float(_cat(agg.result()).double().norm()), rel=1e-6)


def test_aggregate_is_independent_of_sender_order():
    codec = GradientCodec(SHAPES, CodecConfig())
    payloads = [codec.compress(_grads(s)) for s in range(3)]
    weights = [1.0, 2.0, 3.0]
    ref = codec.aggregate(payloads, weights)
    for perm in itertools.permutations(range(3)):
        out = codec.aggregate([payloads[i] for i in perm], [weights[i] for i in perm])
        for name in SHAPES:
            torch.testing.assert_close(out[name], ref[name], atol=1e-6, rtol=1e-5)


def test_per_coordinate_mean_divides_by_senders_of_each_coefficient():
    shapes = {"w": (64, 64)}
    codec = GradientCodec(shapes, CodecConfig(topk=1, bins=0, use_dct=False))
    a = {"w": torch.zeros(64, 64)}
    a["w"][0, 0] = 2.0
    b = {"w": torch.zeros(64, 64)}
    b["w"][5, 5] = 4.0
    c = {"w": torch.zeros(64, 64)}
    c["w"][0, 0] = 6.0
    pa, pb, pc = (codec.compress(x) for x in (a, b, c))
    mean = codec.aggregate([pa, pb, pc])["w"]
    per = codec.aggregate([pa, pb, pc], normalize="per_coordinate")["w"]
    assert mean[0, 0] == pytest.approx(8 / 3) and mean[5, 5] == pytest.approx(4 / 3)
    assert per[0, 0] == pytest.approx(4.0) and per[5, 5] == pytest.approx(4.0)
    assert per.count_nonzero() == 2


def test_bad_weights_rejected():
    codec = GradientCodec(SHAPES, CodecConfig())
    p = codec.compress(_grads(0))
    for weights in ([1.0, 2.0], [-1.0], [float("nan")]):
        with pytest.raises(ValueError):
            codec.aggregate([p], weights)
    with pytest.raises(ValueError):
        codec.aggregate([p], [0.0])


def test_missing_gradient_named():
    codec = GradientCodec(SHAPES, CodecConfig())
    g = _grads(0)
    del g["norm"]
    with pytest.raises(KeyError, match="norm"):
        codec.compress(g)


# ---------------------------------------------------------------- error feedback


def test_error_feedback_sends_a_fixed_gradient_within_160_rounds_at_0_78_percent_density():
    shapes = {"w": (256, 256), "v": (512,), "b": (16,)}
    codec = GradientCodec(shapes, CodecConfig())  # 32 of 4096 per chunk: 0.78% density
    rounds, cos = rounds_to_send(codec, _grads(5, shapes=shapes), max_rounds=160)
    assert cos >= 0.95, f"cosine {cos:.3f} after {rounds} rounds"
    assert rounds > 100  # sanity: at this density no codec can send it all much sooner


def test_error_feedback_equals_demo_parameter_domain_formula():
    """m <- beta m + g; sent = decompress(compress(m)); m <- m - sent, with m in parameter space."""
    shapes = {"w": (128, 64), "v": (320,), "b": (10,)}
    cfg = CodecConfig(topk=64)
    codec = GradientCodec(shapes, cfg, transform_dtype=EXACT)
    feedback, beta = ErrorFeedback(beta=0.9), 0.9
    m = {k: torch.zeros(s) for k, s in shapes.items()}
    for step in range(4):
        g = _grads(10 + step, shapes=shapes)
        ours = codec.decompress(codec.compress(g, feedback))
        m = {k: beta * v + g[k] for k, v in m.items()}
        literal = codec.decompress(codec.compress(m))
        m = {k: v - literal[k] for k, v in m.items()}
        for k in m:
            torch.testing.assert_close(ours[k], literal[k], atol=1e-5, rtol=1e-4)


def test_error_feedback_reset_forgets():
    shapes = {"w": (64, 64)}
    codec = GradientCodec(shapes, CodecConfig())
    feedback = ErrorFeedback()
    g = _grads(0, shapes=shapes)
    first = codec.compress(g, feedback)
    assert codec.compress(g, feedback) != first
    feedback.reset()
    assert codec.compress(g, feedback) == first
    with pytest.raises(ValueError):
        ErrorFeedback(beta=1.5)


def test_error_feedback_widens_a_narrower_update_to_the_bits_of_a_mixed_add(monkeypatch):
    """A bfloat16 transform's coefficients go into the float32 buffer a tile at a time (``_add_widened``,
    tiles shrunk here so that the last one is short): the very bits of ``beta * m + update`` in float32."""
    from gradwire.compression import feedback as feedback_module

    monkeypatch.setattr(feedback_module, "WIDEN_TILE", 1000)
    gen = torch.Generator().manual_seed(5)
    first, second = (torch.randn(37, 129, generator=gen).to(torch.bfloat16) for _ in range(2))
    feedback = ErrorFeedback(beta=0.9)
    feedback.accumulate("g", first)
    expected = first.float().clone().mul_(0.9).add_(second)  # the mixed-dtype add, in one call
    assert torch.equal(feedback.accumulate("g", second), expected)
    assert feedback.buffers["g"].dtype == torch.float32


@pytest.mark.parametrize("config", list(CODINGS.values()), ids=list(CODINGS))
def test_error_feedback_keeps_quantization_error(config):
    """After one step the residual is exactly g minus what the receiver decodes."""
    shapes = {"w": (128, 128), "b": (300,)}
    codec = GradientCodec(
        shapes, dataclasses.replace(config, min_sparse_numel=512), transform_dtype=EXACT
    )  # b is dense, coded
    g = _grads(7, shapes=shapes)
    feedback = ErrorFeedback(beta=1.0)
    sent = codec.decompress(codec.compress(g, feedback))
    residual_b = feedback.buffers["b"]
    torch.testing.assert_close(residual_b, g["b"].flatten() - sent["b"].flatten(), atol=1e-6, rtol=0)
    assert residual_b.abs().max() > 0  # quantization error is real and was kept
    (key,) = [k for k in feedback.buffers if k.startswith("group")]
    residual_w = (
        idct_chunks(feedback.buffers[key].view(4, 64, 64)).view(2, 2, 64, 64).permute(0, 2, 1, 3).reshape(128, 128)
    )
    torch.testing.assert_close(residual_w, g["w"] - sent["w"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("senders", [1, 2, 3, 5])
def test_sparse_inverse_dct_equals_the_dense_path(senders):
    codec = GradientCodec(SHAPES, CodecConfig(topk=8))  # small k: the sparse path holds a few senders
    payloads = [codec.compress(_grads(s)) for s in range(senders)]
    weights = [float(w) for w in range(1, senders + 1)]
    sparse, dense = codec.aggregator(), Aggregator(codec, sparse=False)
    for p, w in zip(payloads, weights):
        sparse.add(p, w)
        dense.add(p, w)
    assert sparse._max_held >= 2  # the case under test: some senders held, later ones spilled
    a, b = sparse.result(), dense.result()
    for name in SHAPES:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)
    assert sparse.norm() == pytest.approx(dense.norm(), rel=1e-5)
    assert sparse.norm() == pytest.approx(float(_cat(a).norm()), rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_sender_transformed_ahead_sums_to_the_same_bits(dtype, monkeypatch):
    """A worker takes its own payload's inverse DCT while the round's result travels; its replay then sums
    the same bits as a holder that transforms every sender at once (the coordinator)."""
    codec = GradientCodec(SHAPES, CodecConfig(topk=8))
    payloads = [codec.compress(_grads(s)) for s in range(2)]
    assert aggregate.sparse_senders(codec) >= 2  # both senders go the sparse path
    decoded = [codec.decode(p) for p in payloads]
    ahead = [aggregate.with_inverse(codec, d, dtype) for d in decoded]
    transforms = []
    real = aggregate.sender_inverse
    monkeypatch.setattr(aggregate, "sender_inverse", lambda *a: transforms.append(a) or real(*a))

    def result(senders) -> dict[str, torch.Tensor]:
        transforms.clear()
        agg = Aggregator(codec, dtype=dtype)
        for d, w in zip(senders, (1.0, 3.0)):
            agg.add(d, w)
        return agg.result()

    plain = result(decoded)
    assert len(transforms) > 0
    own_ahead = result([decoded[0], ahead[1]])
    once = len(transforms)
    both_ahead = result(ahead)
    assert len(transforms) == 0 and once == len(transforms_of(codec))  # each of the other's slices, once
    for name in SHAPES:
        assert torch.equal(own_ahead[name], plain[name]) and torch.equal(both_ahead[name], plain[name]), name
    # A transform taken in another dtype than the aggregate's is not used: the same bits all the same.
    other = torch.float64 if dtype == torch.float32 else torch.float32
    wrong = result([aggregate.with_inverse(codec, d, other) for d in decoded])
    assert len(transforms) > 0 and all(torch.equal(wrong[n], plain[n]) for n in SHAPES)
    # A sole sender transformed ahead: its replay reads the transform as it is (no pass to scale it by 1),
    # the same bits, and the transform itself is left as it was.
    kept = {key: t.clone() for key, t in ahead[1].inverse.items()}
    alone, alone_ahead = Aggregator(codec, dtype=dtype), Aggregator(codec, dtype=dtype)
    alone.add(decoded[1], 3.0)
    alone_ahead.add(ahead[1], 3.0)
    a, b = alone.result(), alone_ahead.result()
    assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    assert all(torch.equal(kept[key], t) for key, t in ahead[1].inverse.items())
    # The terms are what the dense path sums, to float32 rounding.
    dense = Aggregator(codec, sparse=False, dtype=dtype)
    for p, w in zip(payloads, (1.0, 3.0)):
        dense.add(p, w)
    for name, t in dense.result().items():
        torch.testing.assert_close(plain[name], t, atol=1e-6, rtol=1e-5)


def transforms_of(codec: GradientCodec) -> list[tuple[int, int, int]]:
    """Every (group, first chunk, end chunk) slice an aggregate transforms a sender in."""
    return [(gi, lo, hi) for gi, g in enumerate(codec.plan.groups) for lo, hi in aggregate.member_slices(g)]


@pytest.mark.parametrize("sparse", [True, False])
def test_an_aggregate_decoded_a_few_tensors_at_a_time_is_the_whole_decode(sparse, monkeypatch):
    shapes = {"a": (128, 128), "b": (64, 128), "c": (256, 64), "d": (64, 64), "norm": (768,)}  # one 64x64 group
    codec = GradientCodec(shapes, CodecConfig())
    payloads = [codec.compress(_grads(s, shapes=shapes)) for s in range(2)]

    def decoded() -> tuple[list[list[str]], dict[str, torch.Tensor]]:
        agg = codec.aggregator() if sparse else Aggregator(codec, sparse=False)
        for p, w in zip(payloads, (1.0, 3.0)):
            agg.add(p, w)
        parts = list(agg.parts())
        return [list(part) for part in parts], {n: t for part in parts for n, t in part.items()}

    whole_parts, whole = decoded()
    monkeypatch.setattr(aggregate, "SLICE_ELEMENTS", 4096)  # a slice of one 64x64 chunk: each tensor alone
    sliced_parts, sliced = decoded()
    assert len(sliced_parts) > len(whole_parts) and all(len(p) == 1 for p in sliced_parts[:-1])
    assert len(codec.plan.groups[0].members) == 4 and len(whole_parts[0]) == 4
    assert sliced.keys() == whole.keys() == shapes.keys()
    for name in shapes:
        assert torch.equal(sliced[name], whole[name]), name  # the same bits: replicas may slice alike or not
    for group in codec.plan.groups:  # whole members, in order, each chunk once
        cuts = list(aggregate.member_slices(group, 1))
        assert cuts[0][0] == 0 and cuts[-1][1] == group.num_chunks
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
        assert {lo for lo, _ in cuts} <= set(group.offsets)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3e38, -3e38])  # or near float32's largest
@pytest.mark.parametrize("name", ["w", "odd", "norm", "bias", "mid"])  # chunked 2-D, n-D, 1-D; dense raw and coded
def test_a_non_finite_gradient_is_refused_naming_its_tensor(bad, name):
    """Near float32's largest the quantizer's range overflows: the error feedback would take in NaN."""
    codec = GradientCodec(SHAPES, CodecConfig())
    grads = _grads(7)
    grads[name].view(-1)[grads[name].numel() // 2] = bad
    with pytest.raises(NonFiniteInput, match="diverged") as info:
        codec.compress(grads, ErrorFeedback(0.9))
    assert info.value.tensor == name
    codec.compress(_grads(8), ErrorFeedback(0.9))  # the codec itself is unharmed


# ---------------------------------------------------------------- the sender's transform dtype


def test_bfloat16_transform_keeps_what_the_codec_keeps():
    """A bfloat16 forward DCT moves coefficients by well under 1%: full-k reconstruction is that close, the
    payload is the same format, and the error feedback still holds g minus what the receiver decodes."""
    fast = GradientCodec(SHAPES, CodecConfig(topk=64 * 64, bins=0), transform_dtype=torch.bfloat16)
    exact = GradientCodec(SHAPES, CodecConfig(topk=64 * 64, bins=0), transform_dtype=EXACT)
    g = _grads(3)
    out = fast.decompress(fast.compress(g))
    err = (_cat(out) - _cat(g)).norm() / _cat(g).norm()
    assert 1e-4 < err < 1e-2  # bfloat16 rounding happened, and stayed small
    assert fast.plan.payload_bytes() == exact.plan.payload_bytes()
    shapes = {"w": (128, 128)}
    codec = GradientCodec(shapes, CodecConfig(), transform_dtype=torch.bfloat16)
    g = _grads(7, shapes=shapes)
    feedback = ErrorFeedback(beta=1.0)
    sent = codec.decompress(codec.compress(g, feedback))
    (key,) = feedback.buffers
    assert feedback.buffers[key].dtype == torch.float32
    residual = (
        idct_chunks(feedback.buffers[key].view(4, 64, 64)).view(2, 2, 64, 64).permute(0, 2, 1, 3).reshape(128, 128)
    )
    assert ((residual - (g["w"] - sent["w"])).norm() / g["w"].norm()) < 1e-2


def test_bfloat16_transform_selects_nearly_the_same_coefficients():
    """Top-k on bfloat16-transformed coefficients keeps the same set except near-ties, and error feedback
    over several steps sends as much of the gradient as the float32 transform does."""
    shapes = {"w": (256, 256)}
    fast, exact = (GradientCodec(shapes, CodecConfig(), transform_dtype=d) for d in (torch.bfloat16, EXACT))
    fb_fast, fb_exact = ErrorFeedback(beta=0.9), ErrorFeedback(beta=0.9)
    sent_fast, sent_exact = torch.zeros(256, 256), torch.zeros(256, 256)
    for step in range(5):
        g = _grads(20 + step, shapes=shapes)
        p_fast, p_exact = fast.compress(g, fb_fast), exact.compress(g, fb_exact)
        if step == 0:
            same = [
                a == b
                for a, b in zip(
                    fast.decode(p_fast).indices[0].sort(1).values.flatten().tolist(),
                    exact.decode(p_exact).indices[0].sort(1).values.flatten().tolist(),
                )
            ]
            assert sum(same) / len(same) > 0.9
        sent_fast += fast.decompress(p_fast)["w"]
        sent_exact += exact.decompress(p_exact)["w"]
    assert abs(sent_fast.norm() / sent_exact.norm() - 1) < 0.02


def test_fast_transform_dtype_is_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch):
    from gradwire import hardware
    from gradwire.compression import dct

    monkeypatch.setattr(hardware, "cpu_multiplies_bf16", lambda: True)
    assert dct.fast_transform_dtype("cpu") == torch.bfloat16
    assert GradientCodec(SHAPES).transform_dtype == torch.bfloat16
    assert dct.fast_transform_dtype("cuda") == torch.float32  # a GPU's float32 transform is already cheap
    monkeypatch.setattr(hardware, "cpu_multiplies_bf16", lambda: False)
    assert dct.fast_transform_dtype("cpu") == torch.float32
    assert GradientCodec(SHAPES).transform_dtype == torch.float32
    assert GradientCodec(SHAPES, transform_dtype=torch.float32).transform_dtype == torch.float32


# ------------------------------------------------------------------------------- Elias-Fano indices


@pytest.mark.parametrize("values", ["lut", "sign"])
def test_elias_fano_indices_carry_the_same_coefficients_in_fewer_bytes(values):
    """The same top-k in each chunk, in increasing order, with the same values (each tensor's quantizer sees
    them in another order: equal to float32 rounding); 38% fewer index bytes at 90 of 4096."""
    packed = CodecConfig(topk=90, bins=4, values=values)
    a = GradientCodec(SHAPES, packed, transform_dtype=EXACT)
    b = GradientCodec(SHAPES, dataclasses.replace(packed, indices="elias-fano"), transform_dtype=EXACT)
    g = _grads(4)
    pa, pb = a.compress(g), b.compress(g)
    da, db = a.decode(pa), b.decode(pb)
    for ia, ib, va, vb in zip(da.indices, db.indices, da.values, db.values):
        order = ia.sort(dim=1)
        assert torch.equal(order.values, ib)
        torch.testing.assert_close(va.gather(1, order.indices), vb, atol=1e-6, rtol=1e-6)
    for k, v in a.decompress(pa).items():
        torch.testing.assert_close(b.decompress(pb)[k], v, atol=1e-5, rtol=0)
    w_a, w_b = (next(t for t in p.tensors if t.name == "w") for p in (pa, pb))  # 12 chunks of 64 x 64
    assert (len(w_a.indices), len(w_b.indices)) == (12 * 90 * 12 // 8, 12 * 668 // 8)
    assert pb.nbytes == b.plan.payload_bytes() < 0.75 * pa.nbytes


def test_elias_fano_aggregates_as_the_packed_indices_do():
    packed = CodecConfig(topk=90, bins=0)
    a = GradientCodec(SHAPES, packed, transform_dtype=EXACT)
    b = GradientCodec(SHAPES, dataclasses.replace(packed, indices="elias-fano"), transform_dtype=EXACT)
    senders = [_grads(s) for s in (5, 6, 7)]
    mean_a = a.aggregate([a.compress(g) for g in senders])
    mean_b = b.aggregate([b.compress(g) for g in senders])
    for k, v in mean_a.items():
        torch.testing.assert_close(mean_b[k], v, atol=1e-6, rtol=0)


def test_a_groups_joined_elias_fano_indices_decode_per_member_and_a_bad_member_is_named():
    """Tensors of one chunk group whose codes fill whole bytes are decoded in one call; a wrong code among
    them is refused with the tensor it belongs to, as when each is decoded alone."""
    shapes = {"a": (128, 128), "b": (64, 128)}
    codec = GradientCodec(shapes, CodecConfig(topk=36, bins=4, indices="elias-fano"), transform_dtype=EXACT)
    (layout,) = codec._layouts
    assert layout.ef_runs == [[0, 1]] and [t.name for t in codec.plan.groups[0].members] == ["a", "b"]
    grads = _grads(3, shapes=shapes)
    payload = codec.compress(grads)
    decoded = codec.decode(payload)
    for t, ct in zip(codec.plan.groups[0].members, payload.tensors):
        rows = slice(0 if t.name == "a" else 4, 4 if t.name == "a" else 6)
        expected = unpack_ef(ct.indices, t.num_chunks, t.k, t.chunk_numel)
        assert torch.equal(decoded.indices[0][rows], torch.from_numpy(expected.astype("int64")))
    b = next(ct for ct in payload.tensors if ct.name == "b")
    broken = bytearray(b.indices)
    broken[2 * 36 * ef_low_bits(36, 4096) // 8] ^= 1  # b's first upper bit: its first chunk sets 35 or 37
    wrong = dataclasses.replace(b, indices=bytes(broken))
    bad = dataclasses.replace(payload, tensors=[wrong if t.name == "b" else t for t in payload.tensors])
    with pytest.raises(PayloadError) as refused:
        codec.decode(bad)
    assert (refused.value.tensor, refused.value.field) == ("b", "indices")


def test_a_groups_codes_join_in_runs_of_whole_bytes_and_bounded_size(monkeypatch: pytest.MonkeyPatch):
    """Runs of consecutive members: a code with pad bits is decoded alone, and a run stops at the byte cap."""
    shapes = {"a": (64, 128), "b": (64, 128), "c": (192, 64), "d": (64, 128), "e": (64, 128), "f": (64, 128)}
    config = CodecConfig(topk=36, bins=4, indices="elias-fano")
    monkeypatch.setattr(codec_module, "JOINED_EF_BYTES", 1 << 20)
    (layout,) = GradientCodec(shapes, config)._layouts
    assert layout.ef_runs == [[0, 1], [2], [3, 4, 5]]  # c: 3 chunks of 100 upper bits each, 300 bits in all
    monkeypatch.setattr(codec_module, "JOINED_EF_BYTES", ef_nbytes(4, 36, 4096))  # two tensors' codes
    codec = GradientCodec(shapes, config)
    assert codec._layouts[0].ef_runs == [[0, 1], [2], [3, 4], [5]]
    monkeypatch.setattr(codec_module, "JOINED_EF_BYTES", 0)
    alone = GradientCodec(shapes, config)
    assert alone._layouts[0].ef_runs == [[i] for i in range(6)]
    payload = codec.compress(_grads(4, shapes=shapes))
    assert torch.equal(codec.decode(payload).indices[0], alone.decode(payload).indices[0])


def test_a_corrupted_elias_fano_payload_is_refused_or_decodes_finite():
    codec = GradientCodec(SHAPES, CodecConfig(topk=90, bins=4, indices="elias-fano"))
    good = codec.compress(_grads(8))
    for position in range(0, 4000, 7):
        check_corrupted_byte(codec, good, position, 1 + position % 255)
