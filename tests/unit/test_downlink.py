"""The compressed downlink (``--downlink``): one re-compressed aggregate per round, whatever the number of
senders; every replica that replays it, the coordinator's included, lands on the same bits; what it leaves
out waits in the coordinator's error feedback; the decision says why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradwire.compression import CodecConfig, CompressedGradient, ErrorFeedback, GradientCodec, robust
from gradwire.compression.robust import AggregationRule
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.decisions import DOWNLINK_MARGIN, decide_downlink
from gradwire.coordinator.outer import OuterStrategy, ReplayOuter, make_outer
from gradwire.models import build_from_spec, resolve_model
from gradwire.optim.outer import UpdateRule
from gradwire.replica import Replica

CODEC = CodecConfig(topk=16)


@pytest.fixture(scope="module")
def spec() -> dict:
    return resolve_model("gpt-tiny", from_scratch=True, seed=0).spec


def gradients(codec: GradientCodec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in codec.plan.tensors}


def senders(codec: GradientCodec, n: int, seed: int) -> tuple[CompressedGradient, ...]:
    return tuple(codec.compress(gradients(codec, seed * 100 + i)) for i in range(n))


def outer_round(outer: OuterStrategy, sent: tuple[CompressedGradient, ...], rule: AggregationRule) -> None:
    weights = tuple(float(i + 1) for i in range(len(sent)))
    aggregator = robust.aggregate(outer.codec, sent, weights, rule=rule)
    outer.step(aggregator, sent, weights, 0.05, rule=rule, senders=tuple(range(len(sent))), round=0, compressed=True)


# ------------------------------------------------------------------------------------------- the codec


def test_compressing_coefficients_is_compressing_their_tensors(spec: dict) -> None:
    """``compress`` is the transform, then ``compress_coefficients``: the same bytes, the same feedback."""
    codec = GradientCodec({n: p.shape for n, p in build_from_spec(spec, seed=0).named_parameters()}, CODEC)
    a, b = ErrorFeedback(beta=0.9), ErrorFeedback(beta=0.9)
    for seed in range(2):
        grads = gradients(codec, seed)
        groups = [codec._coefficients(g, grads) for g in codec.plan.groups]
        dense = [grads[t.name] for t in codec.plan.dense]
        assert codec.compress_coefficients(groups, dense, b) == codec.compress(grads, a)
    assert a.buffers.keys() == b.buffers.keys()
    assert all(torch.equal(a.buffers[k], b.buffers[k]) for k in a.buffers)
    with pytest.raises(ValueError, match="chunk group 0"):
        codec.compress_coefficients([torch.zeros(1, 1)], [], None)


# ------------------------------------------------------------------------------------------- the outer step


@pytest.mark.parametrize("optimizer", ["sgd", "nesterov", "signsgd"])
@pytest.mark.parametrize("mode", ["mean", "median"])
def test_every_replica_replays_the_one_aggregate_to_the_same_bits(spec: dict, optimizer: str, mode: str) -> None:
    rule = UpdateRule(optimizer=optimizer, momentum=0.9 if optimizer != "signsgd" else 0.0)
    outer = make_outer(build_from_spec(spec, seed=0), rule, CODEC, spec, 0)
    assert isinstance(outer, ReplayOuter)
    worker = Replica(build_from_spec(spec, seed=0), rule)
    aggregation = AggregationRule(mode=mode)
    for r in range(4):
        outer_round(outer, senders(outer.codec, 3 + 3 * (r % 2), seed=r), aggregation)
        pending = outer.pending
        assert pending is not None and len(pending.payloads) == 1 and pending.weights == (1.0,)
        assert outer.update_for(0) is pending  # a sender too gets it whole: its own payload is not in it
        worker.apply(pending)
        outer.apply_pending()
        for name, p in outer.replica.params.items():
            assert torch.equal(worker.params[name], p), (r, name)
        assert all(torch.equal(a, b) for a, b in zip(worker.momentum, outer.replica.momentum))


def test_the_downlink_is_one_payload_whatever_the_number_of_senders(spec: dict) -> None:
    sizes = []
    for n in (2, 8, 32):
        outer = make_outer(build_from_spec(spec, seed=0), UpdateRule(optimizer="sgd"), CODEC, spec, 0)
        outer_round(outer, senders(outer.codec, n, seed=1), AggregationRule())
        assert outer.pending is not None
        sizes.append(outer.pending.nbytes)
    one = senders(outer.codec, 1, seed=2)[0].nbytes
    assert sizes == [one] * 3


def test_the_downlink_keeps_a_top_k_of_its_own(spec: dict) -> None:
    """The aggregate of many senders holds more than one sender's top-k: the downlink's codec keeps more,
    in the workers' chunks, and the replicas still land on the same bits."""
    rule = UpdateRule(optimizer="signsgd")
    down = dataclasses.replace(CODEC, topk=64)
    outer = make_outer(build_from_spec(spec, seed=0), rule, CODEC, spec, 0, down)
    worker = Replica(build_from_spec(spec, seed=0), rule)
    outer_round(outer, senders(outer.codec, 4, seed=6), AggregationRule())
    assert outer.pending is not None
    (payload,) = outer.pending.payloads
    assert payload.settings == down and payload.nbytes == outer.downlink_codec.plan.payload_bytes()
    assert payload.nbytes > outer.codec.plan.payload_bytes()
    worker.apply(outer.pending)
    outer.apply_pending()
    assert all(torch.equal(worker.params[n], p) for n, p in outer.replica.params.items())
    with pytest.raises(ValueError, match="the workers' chunks"):
        make_outer(build_from_spec(spec, seed=0), rule, CODEC, spec, 0, dataclasses.replace(CODEC, chunk=32))
    # The setting: 4 x --topk unless given, at most a whole chunk.
    config = TrainConfig(topk=32)
    assert config.downlink_codec_config() == dataclasses.replace(config.codec_config(), topk=128)
    assert TrainConfig(topk=2000).downlink_codec_config().topk == 4096
    assert TrainConfig(topk=32, downlink_topk=50).downlink_codec_config().topk == 50
    with pytest.raises(ValueError, match="--downlink-topk"):
        TrainConfig(downlink_topk=5000)


def test_what_the_downlink_leaves_out_waits_in_its_feedback(spec: dict) -> None:
    """Sent so far + the feedback = every aggregate so far, coefficient by coefficient (nothing is lost,
    quantization error included)."""
    outer = make_outer(build_from_spec(spec, seed=0), UpdateRule(optimizer="sgd"), CODEC, spec, 0)
    codec = outer.codec
    total = [torch.zeros(g.num_chunks, g.chunk_numel, dtype=torch.float64) for g in codec.plan.groups]
    sent = [torch.zeros_like(t) for t in total]
    for r in range(3):
        batch = senders(codec, 4, seed=10 + r)
        aggregator = robust.aggregate(codec, batch, (1.0,) * 4)
        for acc, coefficients in zip(total, aggregator.coefficient_groups()):
            acc += coefficients.double()
        outer.step(aggregator, batch, (1.0,) * 4, 1.0, compressed=True)
        assert outer.pending is not None
        decoded = codec.decode(outer.pending.payloads[0])
        for acc, idx, vals in zip(sent, decoded.indices, decoded.values):
            acc.scatter_add_(1, idx, vals.double())
        assert decoded.values[0].count_nonzero() > 0
    feedback = outer.downlink_feedback.buffers
    for gi, (want, got) in enumerate(zip(total, sent)):
        torch.testing.assert_close(got + feedback[f"group{gi}"].double(), want, rtol=0, atol=1e-5)
        assert feedback[f"group{gi}"].abs().sum() > 0  # something did wait


def test_the_downlink_feedback_is_checkpointed(spec: dict) -> None:
    rule = UpdateRule(optimizer="nesterov", momentum=0.9)
    outer = make_outer(build_from_spec(spec, seed=0), rule, CODEC, spec, 0)
    outer_round(outer, senders(outer.codec, 4, seed=3), AggregationRule())
    outer.apply_pending()
    groups = outer.checkpoint()
    assert groups["downlink-feedback"].keys() == outer.downlink_feedback.buffers.keys()
    resumed = make_outer(build_from_spec(spec, seed=1), rule, CODEC, spec, 0)
    resumed.restore(groups, outer.replica.version)
    for key, buffer in outer.downlink_feedback.buffers.items():
        assert torch.equal(resumed.downlink_feedback.buffers[key], buffer)
    # The same next round from both.
    sent = senders(outer.codec, 4, seed=4)
    for o in (outer, resumed):
        outer_round(o, sent, AggregationRule())
    assert outer.pending == resumed.pending


def test_adamw_sends_one_delta_whatever_the_setting(spec: dict) -> None:
    outer = make_outer(build_from_spec(spec, seed=0), UpdateRule(optimizer="adamw"), CODEC, spec, 0)
    outer_round(outer, senders(outer.codec, 4, seed=5), AggregationRule())
    assert outer.pending is not None and outer.pending.delta is not None and not outer.pending.payloads


# ------------------------------------------------------------------------------------------- the decision


def test_auto_compresses_once_a_replay_outgrows_the_margin() -> None:
    size = 1000
    limit = int(DOWNLINK_MARGIN) + 1  # senders whose replay (the others' payloads) is exactly at the margin
    assert decide_downlink("auto", limit, size, size)[0] is False
    compressed, why = decide_downlink("auto", limit + 1, size, size)
    assert compressed and f"{limit + 1} senders" in why and "aggregate" in why
    assert decide_downlink("auto", 1, size, size)[0] is False
    assert decide_downlink("auto", 100, size, 200 * size)[0] is False  # a dearer aggregate: still replays
    assert decide_downlink("replay", 100, size, size) == (False, "--downlink replay")
    assert decide_downlink("compressed", 1, size, size) == (True, "--downlink compressed")
    replayed, why = decide_downlink("auto", 100, size, size, fragments=3)  # a fragment's round replays
    assert replayed is False and "--fragments 3" in why


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="--downlink must be one of"):
        TrainConfig(downlink="sometimes")
    with pytest.raises(ValueError, match="--downlink replay needs"):
        TrainConfig(downlink="replay", outer_optimizer="adamw")
    assert TrainConfig(outer_optimizer="adamw").downlink == "auto"
