"""DeMuon's step: the matrix sign three ways, the update written out, and its place in the inner optimizer."""

from __future__ import annotations

import copy

import pytest
import torch

from gradwire.models import build_model, lm_loss
from gradwire.optim import InnerOptimizer, InnerOptimizerConfig, muon_parameters
from gradwire.optim.demuon import DeMuon, matrix_sign
from gradwire.protocol import inner_optimizer_from_proto, inner_optimizer_to_proto


def _random(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_svd_sign_is_the_orthogonal_polar_factor(shape: tuple[int, int]) -> None:
    m = _random(*shape)
    o = matrix_sign(m, "svd")
    # Every singular value 1, and M = O P with P = O^T M symmetric positive semi-definite.
    assert torch.allclose(torch.linalg.svdvals(o), torch.ones(min(shape)), atol=1e-5)
    p = o.T @ m if shape[0] >= shape[1] else m @ o.T
    assert torch.allclose(p, p.T, atol=1e-4)
    assert float(torch.linalg.eigvalsh(p).min()) > -1e-4


def test_newton_schulz_sign_approximates_the_polar_factor() -> None:
    m = _random(64, 24, seed=1)
    exact, approx = matrix_sign(m, "svd"), matrix_sign(m, "newton-schulz")
    s = torch.linalg.svdvals(approx)
    assert float(s.min()) > 0.5 and float(s.max()) < 1.5, s  # Muon's quintic lands in ~[0.7, 1.2]
    cosine = float((exact * approx).sum() / (exact.norm() * approx.norm()))
    assert cosine > 0.95, cosine


def test_none_is_the_momentum_itself_and_vectors_need_none() -> None:
    m = _random(8, 4)
    assert matrix_sign(m, "none") is m
    with pytest.raises(ValueError, match="2-D"):
        matrix_sign(torch.ones(4), "svd")
    with pytest.raises(ValueError, match="2-D parameters only"):
        DeMuon([torch.nn.Parameter(torch.ones(4))], msgn="svd")


def test_two_steps_follow_the_formula() -> None:
    """m1 = (1 - mu) g1, x1 = x0 - lr msgn(m1); m2 = mu m1 + (1 - mu) g2, x2 = x1 - lr msgn(m2); with
    decoupled weight decay x <- x (1 - lr wd) before each step."""
    mu, lr, wd = 0.8, 0.1, 0.05
    x0, g1, g2 = _random(12, 6, 2), _random(12, 6, 3), _random(12, 6, 4)
    p = torch.nn.Parameter(x0.clone())
    opt = DeMuon([p], lr=lr, momentum=mu, msgn="svd", weight_decay=wd)
    for g in (g1, g2):
        p.grad = g.clone()
        opt.step()
    m1 = (1 - mu) * g1
    x1 = x0 * (1 - lr * wd) - lr * matrix_sign(m1, "svd")
    m2 = mu * m1 + (1 - mu) * g2
    x2 = x1 * (1 - lr * wd) - lr * matrix_sign(m2, "svd")
    assert torch.allclose(p.detach(), x2, atol=1e-6)
    assert torch.allclose(opt.state[p]["momentum_buffer"], m2, atol=1e-7)


@pytest.mark.parametrize("msgn", ["newton-schulz", "svd", "none"])
def test_inner_demuon_signs_every_matrix_and_moves_vectors_by_momentum(msgn: str) -> None:
    model = build_model("gpt-tiny", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = InnerOptimizer(model, InnerOptimizerConfig(name="demuon", momentum=0.5, msgn=msgn))
    lm_loss(model, torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(0))).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step(0.1)
    matrices = {n for n, p in model.named_parameters() if p.ndim == 2}
    assert set(muon_parameters(model)) < matrices < set(grads)  # the embedding is a matrix here too
    for n, p in model.named_parameters():
        step = (before[n] - p.detach()) / 0.1
        m = 0.5 * grads[n]
        expected = matrix_sign(m, msgn) if n in matrices else m
        assert torch.allclose(step, expected, atol=1e-4, rtol=1e-3), n


def test_demuon_state_round_trips_and_its_settings_cross_the_wire() -> None:
    model = build_model("gpt-tiny", seed=0)
    config = InnerOptimizerConfig(name="demuon", momentum=0.8, msgn="none", ns_steps=3)
    assert inner_optimizer_from_proto(inner_optimizer_to_proto(config)) == config
    wire = inner_optimizer_to_proto(InnerOptimizerConfig(name="demuon", momentum=0.8))
    wire.msgn = ""  # a sender from before msgn: Newton-Schulz, the default
    assert inner_optimizer_from_proto(wire).msgn == "newton-schulz"

    def run(m: torch.nn.Module, opt: InnerOptimizer, seeds: range) -> None:
        for s in seeds:
            lm_loss(m, torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(s))).backward()
            opt.step(0.05)
            opt.zero_grad()

    straight = copy.deepcopy(model)
    run(straight, InnerOptimizer(straight, config), range(4))
    first = copy.deepcopy(model)
    opt = InnerOptimizer(first, config)
    run(first, opt, range(2))
    state = opt.state_tensors()
    assert state and all(k.endswith("/momentum_buffer") for k in state)
    second = InnerOptimizer(first, config)
    second.load_state_tensors(state)
    run(first, second, range(2, 4))
    for (n, a), b in zip(straight.named_parameters(), first.parameters()):
        assert torch.equal(a, b), n
