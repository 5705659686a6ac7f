"""The planned fingerprint (a GPU's: a few launches a slab) against the one taken a tensor at a time."""

import pytest
import torch

from gradwire.fingerprint import (
    Fingerprint,
    FingerprintPlan,
    compare_fingerprints,
    compare_gradients,
    fingerprint,
    planned,
)
from gradwire.models import build_model
from gradwire.optim.outer import UpdateRule
from gradwire.replica import Replica, sample_positions

SHAPES = [("a", (3, 5)), ("empty", (0,)), ("b", (1000,)), ("c", (300, 70)), ("d", (7,)), ("e", ())]


def tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * 2 + 0.25 for _, shape in SHAPES]


@pytest.mark.parametrize("slab", [7, 64, 1000, 21_007, 1 << 24])
def test_a_planned_fingerprint_is_the_tensor_at_a_time_one(slab: int) -> None:
    """However the tensors fall into slabs (a tensor across thousands, several in one, one a slab), the
    sums and sums of squares agree to float64 rounding and the samples bit for bit."""
    ts, positions = tensors(), sample_positions(SHAPES)
    expected = fingerprint(ts, positions)
    got = FingerprintPlan([t.numel() for t in ts], positions, torch.device("cpu"), slab)(ts)
    assert got.samples == expected.samples
    assert len(got.sums) == len(got.sumsqs) == len(SHAPES)
    for a, b in zip(got.sums + got.sumsqs, expected.sums + expected.sumsqs):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12)
    assert got.sums[1] == got.sumsqs[1] == 0.0  # the empty tensor
    assert compare_fingerprints(expected, got, [t.numel() for t in ts], 1e-9) == (True, "replicas agree")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_plan_pads_rows_in_the_tensors_own_dtype(dtype: torch.dtype) -> None:
    """Each piece starts a row and zeros of its dtype fill the row's rest: the statistics of tensors of any
    float dtype are those taken a tensor at a time, and no pad is sampled."""
    ts, positions = [t.to(dtype) for t in tensors(1)], sample_positions(SHAPES)
    expected = fingerprint(ts, positions)
    got = FingerprintPlan([t.numel() for t in ts], positions, torch.device("cpu"), slab=5000)(ts)
    assert got.samples == expected.samples
    for a, b in zip(got.sums + got.sumsqs, expected.sums + expected.sumsqs):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12)


def test_a_plan_sees_one_changed_value_and_refuses_other_tensors() -> None:
    ts, positions = tensors(), sample_positions(SHAPES)
    plan = FingerprintPlan([t.numel() for t in ts], positions, torch.device("cpu"), slab=64)
    before = plan(ts)
    ts[3][123 // 70, 123 % 70] += 1.0
    same, why = compare_fingerprints(before, plan(ts), plan.numels, 1e-6)
    assert not same and "tensor 3" in why
    with pytest.raises(ValueError, match="not those"):
        plan(ts[:-1])
    with pytest.raises(ValueError, match="sets of sample positions"):
        FingerprintPlan([1, 2], positions, torch.device("cpu"))


def test_from_stats_reads_the_layout_back() -> None:
    stats = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5, -0.25, 7.0], dtype=torch.float64)
    assert Fingerprint.from_stats(stats, 2) == Fingerprint((1.0, 2.0), (3.0, 4.0), (0.5, -0.25, 7.0))


def test_a_replica_plans_only_off_the_cpu() -> None:
    """The replica takes a CPU's fingerprint a tensor at a time and keeps no plan for it; the plan it would
    use elsewhere gives the same fingerprint."""
    assert not planned(torch.device("cpu")) and planned(torch.device("meta"))
    replica = Replica(build_model("gpt-tiny"), UpdateRule())
    fp = replica.fingerprint_of(replica.params)
    assert not replica._plans  # noqa: SLF001
    plan = FingerprintPlan(replica.numels, sample_positions(list(replica.shapes.items())), torch.device("cpu"), 999)
    got = plan(list(replica.params.values()))
    assert got.samples == fp.samples
    assert compare_fingerprints(fp, got, replica.numels, 1e-12)[0]


def _gradient_print(tensors: list[torch.Tensor]) -> Fingerprint:
    return fingerprint(tensors, sample_positions(SHAPES))


def test_two_computations_of_a_gradient_agree_though_a_tiny_tensor_moves_by_a_third() -> None:
    """A tensor holding a negligible share of the gradient (a norm's weight) may differ by tens of percent of
    its own norm between precisions: the gradient check weighs it against the whole gradient, the replica
    check does not."""
    ts = tensors()
    other = [t.clone() for t in ts]
    ts[0].mul_(1e-3)  # a tiny tensor ...
    other[0] = ts[0] * 1.34  # ... off by 34% of itself
    for t in other[1:]:
        t.mul_(1.001)  # and bf16-like noise elsewhere
    numels = [t.numel() for t in ts]
    a, b = _gradient_print(ts), _gradient_print(other)
    assert compare_gradients(a, b, numels, 0.05) == (True, "the gradients agree")
    same, why = compare_fingerprints(a, b, numels, 0.05)
    assert not same and "tensor 0" in why


def test_a_gradient_scaled_flipped_or_of_other_values_is_caught() -> None:
    ts = tensors()
    numels = [t.numel() for t in ts]
    a = _gradient_print(ts)
    scaled = compare_gradients(a, _gradient_print([t * 1.2 for t in ts]), numels, 0.05)
    assert not scaled[0] and "sums of squares differ by" in scaled[1] and "tensor 3" in scaled[1]
    flipped = compare_gradients(a, _gradient_print([-t for t in ts]), numels, 0.05)  # same norms
    assert not flipped[0] and ("sums differ" in flipped[1] or "sample" in flipped[1])
    elsewhere = compare_gradients(a, _gradient_print(tensors(seed=1)), numels, 0.05)  # another batch's, alike
    assert not elsewhere[0]
    broken = [t.clone() for t in ts]
    broken[2][0] = float("nan")
    assert compare_gradients(a, _gradient_print(broken), numels, 0.05) == (False, "tensor 2: non-finite values")
    assert compare_gradients(a, Fingerprint((), (), ()), numels, 0.05)[1] == "fingerprints describe different tensors"
