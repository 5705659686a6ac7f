"""Replicas: replayed updates keep copies bit-identical; fingerprints catch drift."""

import pytest
import torch

from gradwire.compression import CodecConfig, GradientCodec, PayloadError, robust
from gradwire.fingerprint import MOMENT_SLICE, compare_fingerprints, moments
from gradwire.models import build_model
from gradwire.optim.outer import UpdateRule
from gradwire.replica import Replica, StateUpdate

from ..hostreads import HOST_READS, Calls

CFG = CodecConfig()


def _payloads(model, n=2, seed=0):
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    codec = GradientCodec(shapes, CFG)
    g = torch.Generator().manual_seed(seed)
    return tuple(codec.compress({k: torch.randn(s, generator=g) for k, s in shapes.items()}) for _ in range(n))


@pytest.mark.parametrize(
    "rule",
    [
        UpdateRule(optimizer="signsgd", weight_decay=0.1),
        UpdateRule(optimizer="sgd", momentum=0.9),
        UpdateRule(optimizer="nesterov", momentum=0.9),
    ],
)
def test_replay_keeps_two_replicas_bit_identical(rule):
    a, b = Replica(build_model("gpt-tiny"), rule), Replica(build_model("gpt-tiny"), rule)
    for step in range(3):
        update = StateUpdate(0.01, _payloads(a.model, seed=step), (3.0, 1.0))
        a.apply(update)
        b.apply(update)
    assert a.version == b.version == 3
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
    assert a.fingerprint() == b.fingerprint()
    assert compare_fingerprints(a.fingerprint(), b.fingerprint(), a.numels, 0.0) == (True, "replicas agree")


def test_fingerprint_detects_perturbation_and_tolerates_noise():
    r = Replica(build_model("gpt-tiny"), UpdateRule())
    before = r.fingerprint()
    with torch.no_grad():
        for p in r.params.values():
            p.add_(torch.randn_like(p) * p.abs().mean() * 1e-7)
    ok, _ = compare_fingerprints(before, r.fingerprint(), r.numels, 1e-4)
    assert ok
    with torch.no_grad():
        next(iter(r.params.values())).add_(1e-2)
    ok, why = compare_fingerprints(before, r.fingerprint(), r.numels, 1e-4)
    assert not ok and "tensor 0" in why


def test_delta_update_adds_decompressed_delta():
    r = Replica(build_model("gpt-tiny"), UpdateRule(optimizer="adamw"))
    shapes = {k: tuple(p.shape) for k, p in r.params.items()}
    exact = CodecConfig(min_sparse_numel=2**62, bins=0)
    delta = {k: torch.full(s, 0.25) for k, s in shapes.items()}
    before = {k: p.clone() for k, p in r.params.items()}
    r.apply(StateUpdate(1.0, delta=GradientCodec(shapes, exact).compress(delta)))
    for k in shapes:
        torch.testing.assert_close(r.params[k], before[k] + 0.25)


def test_bad_payload_leaves_replica_untouched():
    r = Replica(build_model("gpt-tiny"), UpdateRule())
    good, other = _payloads(r.model, n=2)
    bad = type(other)(other.settings, other.tensors[:-1])
    before = r.fingerprint()
    with pytest.raises(PayloadError):
        r.apply(StateUpdate(0.1, (good, bad), (1.0, 1.0)))
    assert r.fingerprint() == before and r.version == 0


def test_the_fingerprint_is_kept_until_a_parameter_is_written() -> None:
    import torch

    from gradwire.models import build_from_spec, model_spec
    from gradwire.optim.outer import UpdateRule
    from gradwire.replica import Replica

    replica = Replica(build_from_spec(model_spec("gpt-tiny"), seed=0), UpdateRule())
    first = replica.fingerprint()
    assert replica.fingerprint() is first  # kept: nothing wrote
    p = next(iter(replica.params.values()))
    with torch.no_grad():
        p[0, 0] += 1.0  # any in-place write, not only apply's
    second = replica.fingerprint()
    assert second is not first and second.sums[0] != first.sums[0]
    with torch.no_grad():
        p[0, 0] -= 1.0
    assert replica.fingerprint().sums[0] == pytest.approx(first.sums[0])


def test_moments_a_slice_at_a_time_are_the_whole_tensors_float64_sums() -> None:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(2 * MOMENT_SLICE + 12345, generator=g) * 3 + 0.5  # two whole slices and a piece
    total, squares = moments(flat)
    exact = flat.double()
    assert total.dtype == squares.dtype == torch.float64
    assert torch.allclose(total, exact.sum(), rtol=1e-12, atol=1e-9)
    assert torch.allclose(squares, (exact * exact).sum(), rtol=1e-12)
    empty = moments(torch.empty(0))
    assert empty[0].item() == 0.0 and empty[1].item() == 0.0


def test_an_update_is_checked_with_one_host_read_whatever_its_parts() -> None:
    # On a GPU each read waits for the device: checked a part at a time, a replay would stall once a part
    # (27 times a replay at gpt-80m); its bounds stay on the device and come back together.
    r = Replica(build_model("gpt-tiny"), UpdateRule(optimizer="signsgd"))
    payloads = _payloads(r.model)
    codec = r.codec(payloads[0].settings)
    summed = robust.aggregate(codec, payloads, (1.0, 1.0), (), robust.MEAN)
    assert len(list(summed.parts())) >= 2  # so that one read a part would read more than once
    with Calls(HOST_READS) as calls:
        r.apply(StateUpdate(0.01, payloads, (1.0, 1.0)), aggregator=summed)
    assert calls.names == ["cpu"]


def test_a_non_finite_update_in_its_last_part_is_refused_and_moves_nothing() -> None:
    r = Replica(build_model("gpt-tiny"), UpdateRule(optimizer="sgd"))
    payloads = _payloads(r.model)
    summed = robust.aggregate(r.codec(payloads[0].settings), payloads, (1.0, 1.0), (), robust.MEAN)
    *parts, last = summed.parts()
    last[next(iter(last))].view(-1)[0] = float("nan")
    before = {n: p.clone() for n, p in r.params.items()}
    poisoned = type("Poisoned", (), {"parts": lambda self: iter([*parts, last])})()
    with pytest.raises(ValueError, match=f"update would move {next(iter(last))!r}"):
        r.apply(StateUpdate(0.01, payloads, (1.0, 1.0)), aggregator=poisoned)
    assert r.version == 0 and all(torch.equal(p, before[n]) for n, p in r.params.items())
