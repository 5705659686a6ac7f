"""Local-SGD rounds through the service: H inner steps per worker, pseudo-gradients, outer step, resume.

Exactness first (uncompressed, plain SGD inside and out, the rounds are exactly the single-process math),
then the compressed defaults train, a resumed run is the straight run bit for bit, and a resync keeps the
inner optimizer's state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.models import build_from_spec, lm_loss, model_spec

from .conftest import assert_in_step, corrupt_replica, live_workers, steps_with_fault, train

H = 3
BATCH = 2


def _config(tmp_path, **overrides) -> TrainConfig:
    base = dict(
        model="gpt-tiny",
        steps=4,
        batch_size=BATCH,
        sequence_length=32,
        inner_steps=H,
        output_dir=str(tmp_path / "run"),
        round_timeout=60.0,
    )
    return TrainConfig(**{**base, **overrides})


def _sgd_steps(model: torch.nn.Module, rows: np.ndarray, lr: float, factors: dict[str, float] | None = None) -> None:
    """H plain SGD steps on H consecutive slices of ``rows``, in this process; ``factors``: a parameter's
    multiple of ``lr``."""
    for h in range(H):
        batch = torch.from_numpy(rows[h * BATCH : (h + 1) * BATCH].astype(np.int64))
        model.zero_grad()
        lm_loss(model, batch).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(p.grad, alpha=-lr * (factors or {}).get(name, 1.0))


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module, atol: float) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=name)


EXACT = dict(
    no_compression=True, inner_optimizer="sgd", inner_learning_rate=0.5, outer_optimizer="sgd", learning_rate=1.0
)


@pytest.mark.parametrize("embedding_scale", [1.0, 0.5])
def test_one_worker_equals_single_process_sgd_on_the_same_batches(tmp_path, embedding_scale):
    """And with --inner-embedding-lr-scale: the worker's inner steps move the token embedding at that
    multiple of the rate, every other parameter at the rate. (0.5: plain SGD at 0.5 is near the edge of
    stability for gpt-tiny's embedding; twice it diverges, and rounding differences grow past the tolerance.)"""
    config = _config(tmp_path, steps=2, inner_embedding_lr_scale=embedding_scale, **EXACT)
    with live_workers(1) as workers:
        trainer = train(config, workers)
    model = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    factors = {"tok_emb.weight": embedding_scale}
    for step in range(config.steps):
        _sgd_steps(model, trainer.round_batch(step, 0), config.inner_learning_rate, factors)
    _assert_same_params(trainer.model, model, atol=1e-5)
    assert trainer.total_tokens == config.steps * H * BATCH * config.sequence_length


def test_two_workers_average_their_models_after_local_steps(tmp_path, two_workers):
    config = _config(tmp_path, steps=2, **EXACT)
    trainer = train(config, two_workers)
    model = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    for step in range(config.steps):
        copies = []
        for slot in (0, 1):
            local = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
            local.load_state_dict(model.state_dict())
            _sgd_steps(local, trainer.round_batch(step, slot), config.inner_learning_rate)
            copies.append(local)
        with torch.no_grad():  # local SGD / model averaging: the mean of the workers' models
            for p, a, b in zip(model.parameters(), copies[0].parameters(), copies[1].parameters()):
                p.copy_((a + b) / 2)
    _assert_same_params(trainer.model, model, atol=1e-5)


def test_compressed_defaults_train_and_send_less_per_token(tmp_path, two_workers):
    config = _config(tmp_path, steps=8, inner_learning_rate=3e-3)
    assert (config.outer_optimizer, config.learning_rate, config.bins, config.feedback_beta) == ("sgd", 1.0, 4, 0.95)
    train(config, two_workers)
    records = read_metrics(tmp_path / "run")
    assert [r["inner_steps"] for r in records] == [H] * 8 and all(r["successful_workers"] == 2 for r in records)
    assert np.mean([r["inner_loss"] for r in records[-2:]]) < np.mean([r["inner_loss"] for r in records[:2]]) - 0.3
    assert records[-1]["total_tokens"] == 8 * 2 * H * BATCH * 32
    # Uplink per trained token: a 2-bit payload once every H steps, against gradient mode's 8-bit one per step
    # (a local round's payload holds ~3x the index and value bits, 143 of 4096 in Elias-Fano indices against
    # 32 in 12-bit ones: about half as much at H 3 here).
    with live_workers(2) as workers:
        train(_config(tmp_path / "g", steps=2, inner_steps=1), workers)
    gradient_mode = read_metrics(tmp_path / "g" / "run")[-1]["bytes_up_per_token"]
    assert records[-1]["bytes_up_per_token"] < gradient_mode / 1.5


def test_diloco_with_inner_muon_trains(tmp_path, two_workers):
    # Uncompressed pseudo-gradients default to DiLoCo's outer Nesterov (lr 0.7, momentum 0.9).
    config = _config(tmp_path, steps=8, inner_learning_rate=3e-3, inner_optimizer="muon", no_compression=True)
    assert (config.outer_optimizer, config.learning_rate, config.momentum, config.inner_momentum) == (
        "nesterov",
        0.7,
        0.9,
        0.95,
    )
    train(config, two_workers)
    records = read_metrics(tmp_path / "run")
    assert all(r["successful_workers"] == 2 for r in records)
    assert np.mean([r["loss"] for r in records[-2:]]) < np.mean([r["loss"] for r in records[:2]]) - 0.5
    (session,) = two_workers[0].engine.sessions.values()
    assert any(k.endswith("/momentum_buffer") for k in session.inner_state())  # Muon's own state, kept per run


def test_resume_in_local_sgd_mode_is_the_straight_run(tmp_path):
    # Everything that carries over is exercised: inner AdamW state and error feedback on the workers, outer
    # Nesterov momentum on every replica. --balance off: shares sized to each run's own timings would differ.
    settings = dict(
        outer_optimizer="nesterov", learning_rate=0.5, inner_learning_rate=3e-3, inner_steps=2, balance="off"
    )
    with live_workers(2) as workers:
        straight = train(_config(tmp_path / "a", steps=20, **settings), workers)
    with live_workers(2) as workers:
        train(_config(tmp_path / "b", steps=10, **settings), workers)
    with live_workers(2) as workers:  # fresh workers: their state comes from the checkpoint
        resumed = train(
            _config(tmp_path / "b", steps=20, resume_from=str(tmp_path / "b" / "run" / "checkpoints"), **settings),
            workers,
        )
    assert [r["loss"] for r in read_metrics(tmp_path / "b" / "run")] == [
        r["loss"] for r in read_metrics(tmp_path / "a" / "run")
    ]
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_resync_push_keeps_the_inner_optimizer_state(tmp_path, two_workers):
    trainer = Trainer(
        _config(tmp_path, steps=6, inner_learning_rate=3e-3), [w.client() for w in two_workers], progress=False
    )
    records = steps_with_fault(trainer, lambda: corrupt_replica(two_workers[1]))
    assert [r["pushes"] for r in records] == [2, 0, 0, 1, 0, 0]
    assert all(r["successful_workers"] == 2 and np.isfinite(r["loss"]) for r in records)
    (session,) = two_workers[1].engine.sessions.values()
    steps = {k: float(v) for k, v in session.inner_state().items() if k.endswith("/step")}
    # AdamW kept counting across the push: 6 rounds of H steps, not the H since the push.
    assert steps and set(steps.values()) == {6.0 * H}
    assert_in_step(trainer, two_workers[1])
