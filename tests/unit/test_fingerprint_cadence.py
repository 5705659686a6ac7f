"""Fingerprints with their moments every ``--fingerprint-every``-th version, their samples alone between: the
rule, the samples-only fingerprint on both paths, what a comparison reads of each kind, a replica's cache, and
the order field on the wire."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig
from gradwire.fingerprint import (
    MAX_FINGERPRINT_EVERY,
    Fingerprint,
    FingerprintPlan,
    compare_fingerprints,
    fingerprint,
    sample_positions,
    sampled,
    takes_moments,
)
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import ProtocolError
from gradwire.replica import Replica

SHAPES = [("a", (3, 5)), ("b", (1000,)), ("c", (300, 70)), ("d", (7,)), ("e", ())]


def tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * 2 + 0.25 for _, shape in SHAPES]


def test_moments_are_taken_at_every_nth_version_from_version_0() -> None:
    assert [v for v in range(25) if takes_moments(v, 10)] == [0, 10, 20]
    assert [v for v in range(5) if takes_moments(v, 3)] == [0, 3]
    assert all(takes_moments(v, 1) for v in range(5)) and all(takes_moments(v, 0) for v in range(5))


@pytest.mark.parametrize("planned", [False, True])
def test_a_samples_only_fingerprint_is_the_full_ones_samples_bit_for_bit(planned: bool) -> None:
    ts, positions = tensors(), sample_positions(SHAPES)
    full = fingerprint(ts, positions)
    if planned:  # a GPU's path, run here on the CPU
        plan = FingerprintPlan([t.numel() for t in ts], positions, torch.device("cpu"), slab=64)
        assert plan(ts).samples == full.samples
        light = plan(ts, with_moments=False)
    else:
        light = fingerprint(ts, positions, with_moments=False)
    assert light == sampled(ts, positions) == full.samples_only() == Fingerprint((), (), full.samples)
    assert full.has_moments and not light.has_moments and len(light.samples) == len(full.samples) > 0


def test_a_samples_only_expected_fingerprint_compares_samples_and_a_full_one_everything() -> None:
    ts, positions = tensors(), sample_positions(SHAPES)
    numels = [t.numel() for t in ts]
    full, light = fingerprint(ts, positions), sampled(ts, positions)
    assert compare_fingerprints(light, full, numels, 1e-6) == (True, "replicas agree")
    assert compare_fingerprints(light, light, numels, 1e-6) == (True, "replicas agree")
    # A check that expects the moments cannot pass on samples alone.
    same, why = compare_fingerprints(full, light, numels, 1e-6)
    assert not same and "samples alone" in why
    # Another model's fingerprint (other sample counts) is not compared value by value.
    other = sampled(ts[:3], positions[:3])
    assert compare_fingerprints(light, other, numels, 1e-6) == (False, "fingerprints describe different tensors")

    # A value moved at a sampled position is caught by the samples; one moved elsewhere, only by the moments.
    c = 2
    flat = ts[c].reshape(-1)
    at_sample = int(positions[c][0])
    elsewhere = next(i for i in range(flat.numel()) if i not in set(positions[c].tolist()))
    moved = [t.clone() for t in ts]
    moved[c].reshape(-1)[at_sample] += 1.0
    same, why = compare_fingerprints(light, sampled(moved, positions), numels, 1e-6)
    assert not same and why.startswith("sample ")
    moved = [t.clone() for t in ts]
    moved[c].reshape(-1)[elsewhere] += 1.0
    assert compare_fingerprints(light, sampled(moved, positions), numels, 1e-6)[0]
    same, why = compare_fingerprints(full, fingerprint(moved, positions), numels, 1e-6)
    assert not same and f"tensor {c}" in why


def replica() -> Replica:
    return Replica(build_from_spec(model_spec("gpt-tiny"), seed=0), UpdateRule(optimizer="sgd"))


def test_a_replica_takes_its_moments_at_the_versions_moments_every_names() -> None:
    r = replica()
    r.moments_every = 3
    kinds = []
    for version in range(7):
        r.version = version
        with torch.no_grad():
            next(iter(r.params.values())).add_(0.01)  # a write: nothing cached carries over
        kinds.append(r.fingerprint().has_moments)
    assert kinds == [True, False, False, True, False, False, True]
    assert r.fingerprint(with_moments=True).has_moments and not r.fingerprint(with_moments=False).has_moments


def test_a_kept_fingerprint_with_moments_serves_its_samples_and_a_samples_only_one_is_taken_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = replica()
    taken: list[bool] = []
    original = Replica.fingerprint_of

    def counted(self: Replica, tensors, with_moments: bool = True) -> Fingerprint:
        taken.append(with_moments)
        return original(self, tensors, with_moments)

    monkeypatch.setattr(Replica, "fingerprint_of", counted)
    full = r.fingerprint(with_moments=True)
    assert r.fingerprint(with_moments=False) == full.samples_only() and r.fingerprint() == full
    assert taken == [True]  # both served from the one kept
    with torch.no_grad():
        next(iter(r.params.values())).add_(0.01)
    light = r.fingerprint(with_moments=False)
    assert r.fingerprint(with_moments=False) == light and taken == [True, False]
    assert r.fingerprint(with_moments=True).samples == light.samples and taken == [True, False, True]
    assert r.fingerprint(with_moments=False) == light and taken == [True, False, True]  # the full one serves


def test_an_order_carries_its_fingerprint_cadence_and_a_cadence_out_of_bounds_is_refused() -> None:
    light = Fingerprint((), (), (0.5, -1.25))
    order = protocol.WorkOrder("run", 1, 4, np.zeros((1, 9), np.uint16), CodecConfig(), light, fingerprint_every=10)
    back = protocol.order_from_proto(protocol.order_to_proto(order))
    assert back.fingerprint_every == 10 and back.fingerprint == light and not back.fingerprint.has_moments
    unset = protocol.order_to_proto(dataclasses.replace(order, fingerprint_every=1))
    unset.ClearField("fingerprint_every")  # 0 on the wire: every version's
    assert protocol.order_from_proto(unset).fingerprint_every == 1
    with pytest.raises(ProtocolError, match=f"fingerprint_every is at most {MAX_FINGERPRINT_EVERY}"):
        protocol.order_from_proto(
            protocol.order_to_proto(dataclasses.replace(order, fingerprint_every=MAX_FINGERPRINT_EVERY + 1))
        )
