"""benchmarks.gradsim: its own selection decodes as the codec does, and a run reports every variant."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import gradsim

SHAPES = {"w": (128, 192), "u": (64, 4096), "b": (64,)}


def _grads(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * (1 + torch.rand(s, generator=gen)) for n, s in SHAPES.items()}


def _chunked(sender: gradsim.SelectSender) -> list[str]:
    return [t.name for g in sender.codec.plan.groups for t in g.members]


def test_select_per_chunk_sends_and_keeps_what_the_codec_does() -> None:
    config = gradsim.gradient_codec_config()
    ours = gradsim.SelectSender(SHAPES, config, 0.999, "chunk")
    codec = gradsim.CodecSender(SHAPES, config, 0.999)
    names = _chunked(ours)
    assert names  # the matrices are chunked; the vector is not
    for step, k in enumerate((216, 25, 25)):  # across a change of top-k, as the warm-up plan makes
        grads = _grads(step)
        mine, _ = ours.send(grads, k)
        theirs, _ = codec.send(grads, k)
        for name in names:
            scale = theirs[name].abs().max()
            assert torch.allclose(mine[name], theirs[name], atol=1e-5 * float(scale)), (step, name)
    for key, buffer in codec.feedback.buffers.items():
        if key.startswith("group"):  # what neither has sent yet
            assert torch.allclose(ours.feedback.buffers[key], buffer, atol=1e-5 * float(buffer.abs().max()))


def test_select_per_tensor_keeps_as_many_coefficients_and_at_least_their_energy() -> None:
    config = gradsim.gradient_codec_config()
    grads = _grads(7)
    sent = {}
    for per in ("chunk", "tensor"):
        sender = gradsim.SelectSender(SHAPES, config, 0.999, per)
        group = sender.codec.plan.groups[0]
        coefficients = sender.codec._coefficients(group, grads).float()
        kept = sender._kept(coefficients, 25)
        sent[per] = (int(kept.sum()), float(coefficients[kept].pow(2).sum()))
    assert sent["tensor"][0] == sent["chunk"][0]
    assert sent["tensor"][1] >= sent["chunk"][1]


def test_the_steps() -> None:
    g = torch.tensor([3.0, -1.0, 0.5, 0.0, -8.0])
    assert torch.equal(gradsim.step_of(g, "sign"), torch.sign(g))
    for step in ("rms", "clip2"):
        d = gradsim.step_of(g, step)
        assert torch.allclose(d.pow(2).mean(), torch.tensor(1.0))  # the sign's step length
        assert torch.equal(torch.sign(d), torch.sign(g))
    assert torch.allclose(gradsim.step_of(g, "rms") * g.pow(2).mean().sqrt(), g)  # g's own shape
    clipped = gradsim.step_of(g, "clip0.5")  # every entry past half the RMS clipped to the same size
    assert clipped[0].abs() == clipped[4].abs()


def test_a_vote_steps_where_the_workers_agree_and_not_where_they_split() -> None:
    a, b = torch.tensor([0.1, -5.0, 2.0, -0.3]), torch.tensor([7.0, 0.2, 1.0, -0.1])
    assert torch.equal(gradsim.step_of(gradsim.combine([a, b], "vote"), "vote"), torch.tensor([1.0, 0.0, 1.0, -1.0]))
    assert torch.equal(gradsim.step_of(gradsim.combine([a, b], "sign"), "sign"), torch.tensor([1.0, -1.0, 1.0, -1.0]))


def test_adam_preconditioning_starts_with_the_sign_of_each_gradient() -> None:
    g = {"w": torch.tensor([2.0, -0.001, 5.0])}
    first = gradsim.AdamPreconditioner()(g, 1e-3)["w"]
    assert torch.allclose(first, 1e-3 * torch.sign(g["w"]), rtol=1e-4)


def _args(**changes: object) -> argparse.Namespace:
    """The module's defaults at gpt-tiny, three steps of 2 x 16 tokens, then ``changes``."""
    args = gradsim.parser().parse_args(
        ["--variants", "dense,exact,codec,select:tensor", "--model", "gpt-tiny", "--steps", "3"]
        + ["--batch-size", "2", "--sequence-length", "16"]
    )
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def test_a_run_reports_every_variant_against_dense() -> None:
    result = gradsim.run(_args())
    variants = result["variants"]
    assert list(variants) == ["dense", "exact", "codec", "select:tensor"]
    for r in variants.values():
        assert len(r["held_out_curve"]) == 3 and r["held_out_loss"] == r["held_out_curve"][-1]
        assert r["gap_vs_dense"] == pytest.approx(r["held_out_loss"] / variants["dense"]["held_out_loss"] - 1, abs=1e-5)
    assert variants["dense"]["gap_vs_dense"] == 0
    assert variants["dense"]["x_fewer_than_fp32_gradients"] == variants["exact"]["x_fewer_than_fp32_gradients"] == 1
    assert variants["codec"]["x_fewer_than_fp32_gradients"] > 100
    assert variants["exact"]["held_out_loss"] != variants["codec"]["held_out_loss"]  # they sent different things


def test_momentum_and_preconditioning_change_the_run() -> None:
    plain = gradsim.run(_args(variants="exact"))["variants"]["exact"]["held_out_loss"]
    signum = gradsim.run(_args(variants="exact", momentum=0.9))["variants"]["exact"]["held_out_loss"]
    adam = gradsim.run(_args(variants="exact", precond="adam"))["variants"]["exact"]["held_out_loss"]
    assert len({plain, signum, adam}) == 3


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"variants": "codec,nope"}, "unknown variant 'nope'"),
        ({"step": "sine"}, "unknown step"),
        ({"step": "clip0"}, "unknown step"),
        ({"precond": "lion"}, "unknown --precond"),
    ],
)
def test_bad_settings_are_refused_before_anything_trains(changes: dict[str, object], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        gradsim.run(_args(**changes))
