"""One-step-delayed rounds (``--overlap``) through the service.

Each worker computes round r's gradient before applying round r-1's update: with exact gradients and plain
SGD that is delayed SGD, theta[r+1] = theta[r] - lr * grad(theta[r-1]) on round r's batch, to float
precision. Computing the next gradient ahead while a result travels changes no bit of the run, and a
worker that falls out of sync is pushed the state and carries on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.models import build_from_spec, lm_loss, model_spec
from gradwire.worker import lookahead

from .conftest import assert_in_step, corrupt_replica, live_workers, steps_with_fault, train


def _config(tmp_path, **overrides) -> TrainConfig:
    base = dict(
        model="gpt-tiny",
        steps=4,
        batch_size=2,
        sequence_length=32,
        output_dir=str(tmp_path / "run"),
        round_timeout=60.0,
        overlap=True,
    )
    return TrainConfig(**{**base, **overrides})


def _gradient(model: torch.nn.Module, rows: np.ndarray) -> list[torch.Tensor]:
    model.zero_grad()
    lm_loss(model, torch.from_numpy(rows.astype(np.int64))).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_one_worker_is_delayed_sgd_on_the_same_batches(tmp_path):
    config = _config(tmp_path, no_compression=True, outer_optimizer="sgd", learning_rate=0.1)
    with live_workers(1) as workers:
        trainer = train(config, workers)
    model = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    behind = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)  # theta[r-1]; theta[-1] = theta[0]
    for step in range(config.steps):
        grads = _gradient(behind, trainer.round_batch(step, 0))
        behind.load_state_dict(model.state_dict())
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p.add_(g, alpha=-config.learning_rate)
    _assert_same_model(trainer, model)
    # ... and not the undelayed run: the delay is real.
    with live_workers(1) as workers:
        plain = train(
            _config(tmp_path / "plain", no_compression=True, outer_optimizer="sgd", learning_rate=0.1, overlap=False),
            workers,
        )
    assert any(not torch.allclose(a, b, atol=1e-5) for a, b in zip(plain.model.parameters(), model.parameters()))


def test_computing_ahead_changes_no_bit_and_serves_every_round_after_the_first(tmp_path, monkeypatch):
    # Compressed gradient mode, the defaults but --balance: shares sized to each run's own timings differ.
    config = _config(tmp_path / "ahead", steps=6, balance="off")
    with live_workers(2) as workers:
        ahead = train(config, workers)
        used = [w.engine.lookaheads for w in workers]
    # The same run with the look-ahead turned off on the workers: every round computes when it arrives.
    monkeypatch.setattr(lookahead, "preview", lambda order, version: None)
    with live_workers(2) as workers:
        plain = train(_config(tmp_path / "plain", steps=6, balance="off"), workers)
        assert all(not w.engine.lookaheads for w in workers)
    # Rounds 1..5 each find the gradient computed ahead (the last round announces no next batch).
    assert used == [{"used": config.steps - 1}] * 2
    for (name, a), (_, b) in zip(ahead.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), name
    assert [r["loss"] for r in read_metrics(tmp_path / "ahead" / "run")] == [
        r["loss"] for r in read_metrics(tmp_path / "plain" / "run")
    ]


def test_a_worker_out_of_sync_is_pushed_the_state_and_the_run_goes_on(tmp_path, two_workers):
    trainer = Trainer(_config(tmp_path, steps=8), [w.client() for w in two_workers], progress=False)
    records = steps_with_fault(trainer, lambda: corrupt_replica(two_workers[1]))
    assert all(r is not None and r["successful_workers"] == 2 for r in records)
    assert sum(r["pushes"] for r in records[3:]) == 1
    # Rounds 1-5 use the gradient computed ahead, but for the drifted worker's round 3: its replica failed the
    # check, the push replaced its session (and what it had computed ahead), and it computed round 3 anew.
    assert [w.engine.lookaheads for w in two_workers] == [{"used": 5}, {"used": 4}]
    assert_in_step(trainer, two_workers[1])


def _local_sgd(tmp_path, **overrides) -> TrainConfig:
    settings = dict(
        steps=4,
        inner_steps=2,
        no_compression=True,
        inner_optimizer="sgd",
        inner_learning_rate=0.5,
        outer_optimizer="sgd",
        learning_rate=1.0,
        balance="off",
        overlap_update="delayed",
    )
    return _config(tmp_path, **{**settings, **overrides})


def _two_workers_ahead(config: TrainConfig) -> Trainer:
    """``config``'s rounds on two workers, each taking every round after the first ahead; their replicas
    stay bit-identical, and the coordinator's."""
    with live_workers(2) as workers:
        trainer = Trainer(config, [w.client() for w in workers], progress=False)
        try:
            trainer.connect()
            records = [trainer.train_step() for _ in range(config.steps)]
            assert [w.engine.lookaheads for w in workers] == [{"used": config.steps - 1}] * 2
            replicas = [next(iter(w.engine.sessions.values())).replica for w in workers]
            for name, p in replicas[0].params.items():
                assert torch.equal(replicas[1].params[name], p), name
            assert_in_step(trainer, workers[0])
        finally:
            trainer.close()
    assert all(r["successful_workers"] == 2 for r in records)
    return trainer


def _inner_sgd(model: torch.nn.Module, rows: np.ndarray) -> None:
    """A worker's round in ``_local_sgd``'s settings: two inner SGD steps (lr 0.5) on halves of ``rows``."""
    for h in range(2):
        grads = _gradient(model, rows[h * 2 : (h + 1) * 2])
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p.add_(g, alpha=-0.5)


def _average_step(model: torch.nn.Module, behind: torch.nn.Module, deltas: list[list[torch.Tensor]]) -> None:
    """theta[r+1] = theta[r] - (d_0 + d_1) / 2 (outer SGD, lr 1), keeping theta[r] in ``behind``."""
    behind.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p, d0, d1 in zip(model.parameters(), *deltas):
            p.sub_((d0 + d1) / 2)


def _assert_same_model(trainer: Trainer, model: torch.nn.Module) -> None:
    for (name, a), b in zip(trainer.model.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_overlapped_local_sgd_is_delayed_averaging_and_never_waits_for_the_sync(tmp_path):
    """Two workers in overlapped local-SGD rounds: each takes round r's H inner steps from theta[r-1] (the
    replica before round r-1's update) as soon as round r-1's result is out, and the outer step (SGD, lr 1,
    uncompressed) averages what they send. With d_i(x) = x - SGD_H(x; worker i's rows of round r):

        theta[r+1] = theta[r] - (d_0(theta[r-1]) + d_1(theta[r-1])) / 2,    theta[-1] = theta[0]

    Every round after the first is taken ahead and used; the replicas stay bit-identical."""
    config = _local_sgd(tmp_path)
    trainer = _two_workers_ahead(config)
    model = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    behind = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    local = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    for step in range(config.steps):
        deltas = []
        for slot in (0, 1):
            local.load_state_dict(behind.state_dict())
            _inner_sgd(local, trainer.round_batch(step, slot))
            with torch.no_grad():
                deltas.append([b - w for b, w in zip(behind.parameters(), local.parameters())])
        _average_step(model, behind, deltas)
    _assert_same_model(trainer, model)


@pytest.mark.parametrize("outer", ["sgd", "nesterov"])
def test_eager_overlap_with_one_worker_is_the_run_without_overlap(tmp_path, outer):
    """One worker's own payload is the aggregate: its eager guess at the update in flight is that update, so
    each round's inner steps start where the straight run's do (outer momentum included)."""
    settings = dict(outer_optimizer=outer, learning_rate=0.7)
    with live_workers(1) as workers:
        eager = train(_local_sgd(tmp_path / "eager", overlap_update="eager", **settings), workers)
        assert workers[0].engine.lookaheads == {"used": 3}
    with live_workers(1) as workers:
        plain = train(_local_sgd(tmp_path / "plain", overlap=False, **settings), workers)
    for (name, a), b in zip(eager.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_eager_overlapped_local_sgd_starts_from_each_workers_guess(tmp_path):
    """Two workers, eager: each starts round r's inner steps from theta[r-1] moved by its own last
    contribution as if it were the round's aggregate (outer SGD, lr 1, uncompressed), and the outer step
    adds the average of what they send to theta[r], undelayed. With D_i(x) = x - SGD_H(x; worker i's rows):

        start_i[r] = theta[r-1] - d_i[r-1]  (start_i[0] = theta[0]),   d_i[r] = D_i(start_i[r])
        theta[r+1] = theta[r] - (d_0[r] + d_1[r]) / 2

    Every round after the first is taken ahead and used; the replicas stay bit-identical."""
    config = _local_sgd(tmp_path, overlap_update="eager")
    trainer = _two_workers_ahead(config)
    model = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    behind = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)  # theta[r-1]
    local = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    last: list[list[torch.Tensor] | None] = [None, None]  # d_i[r-1]
    for step in range(config.steps):
        deltas = []
        for slot in (0, 1):
            local.load_state_dict(behind.state_dict())
            with torch.no_grad():
                if last[slot] is not None:
                    for p, d in zip(local.parameters(), last[slot]):
                        p.sub_(d)
                start = [p.clone() for p in local.parameters()]
            _inner_sgd(local, trainer.round_batch(step, slot))
            with torch.no_grad():
                deltas.append([s - w for s, w in zip(start, local.parameters())])
        last = deltas
        _average_step(model, behind, deltas)
    _assert_same_model(trainer, model)


@pytest.mark.parametrize("outer", ["nesterov", "adamw"])  # a replay, and the deltas of an AdamW shadow
def test_overlapped_local_sgd_resumed_mid_run_is_the_straight_run(tmp_path, outer):
    """A checkpoint taken while the workers hold the next round's inner steps, taken ahead, saves the inner
    optimizer state of the rounds asked for; resumed on fresh workers the run ends on the same bits.
    Compressed, with inner AdamW (its moments and step count carry over) and outer Nesterov momentum, or
    outer AdamW (the workers follow its shadow replica by deltas)."""
    settings = dict(
        no_compression=False,
        inner_optimizer="adamw",
        inner_learning_rate=3e-3,
        outer_optimizer=outer,
        learning_rate=0.5 if outer == "nesterov" else 1e-3,
        steps=6,
        checkpoint_every=3,
        eval_every=3,  # the evaluation applies the update in flight to the coordinator's replica first
    )
    with live_workers(2) as workers:
        straight = train(_local_sgd(tmp_path / "a", **settings), workers)
        assert [w.engine.lookaheads for w in workers] == [{"used": 5}] * 2
    checkpoint = tmp_path / "a" / "run" / "checkpoints" / "step-00000003"
    assert checkpoint.is_dir()
    with live_workers(2) as workers:  # fresh workers: their state comes from the checkpoint
        resumed = train(_local_sgd(tmp_path / "b", resume_from=str(checkpoint), **settings), workers)
    assert [r["loss"] for r in read_metrics(tmp_path / "b" / "run")] == [
        r["loss"] for r in read_metrics(tmp_path / "a" / "run")
    ][3:]
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_an_eager_run_resumed_mid_run_is_the_straight_run(tmp_path):
    """The eager guess needs each worker's last payload, which a resumed (fresh) worker never sent: the
    checkpoint keeps who sent which payload of the update in flight, and each worker's push carries its own
    back (``ModelState.own``). The first round after the resume then starts from the same guess, and the run
    ends on the straight run's bits."""
    settings = dict(no_compression=False, outer_optimizer="nesterov", learning_rate=0.5, steps=6, checkpoint_every=3)
    settings["overlap_update"] = "auto"  # eager: a replayed outer optimizer, no fragments
    with live_workers(2) as workers:
        straight = train(_local_sgd(tmp_path / "a", **settings), workers)
    checkpoint = tmp_path / "a" / "run" / "checkpoints" / "step-00000003"
    with live_workers(2) as workers:
        resumed = train(_local_sgd(tmp_path / "b", resume_from=str(checkpoint), **settings), workers)
        assert [w.engine.lookaheads for w in workers] == [{"used": 2}] * 2
    records = read_metrics(tmp_path / "b" / "run")
    assert [r["pushes"] for r in records] == [2, 0, 0]  # one push each: its own payload came with it
    assert [r["loss"] for r in records] == [r["loss"] for r in read_metrics(tmp_path / "a" / "run")][3:]
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_streamed_data_announced_ahead_is_the_next_rounds_rows(tmp_path, caplog):
    """With --streaming, announcing round r+1's rows during round r cuts the stream once, in order: every
    look-ahead is used, and the rows are those of the same run without --overlap (no window skipped or
    read twice, no re-read of the stream)."""
    from gradwire.assets import corpus_path

    data = tmp_path / "corpus.txt"
    data.write_text(corpus_path().read_text(encoding="utf-8")[:200_000], encoding="utf-8")

    def rows_of(overlap: bool) -> tuple[list[np.ndarray], list]:
        config = _config(
            tmp_path / f"o{overlap}", steps=5, data=(str(data),), streaming=True, checkpoint_every=0, overlap=overlap
        )
        with live_workers(2) as workers:
            trainer = Trainer(config, [w.client() for w in workers], progress=False)
            cut, rows = trainer.planner.batch, {}  # every batch the run cuts, by (step, position)
            trainer.planner.batch = lambda step, position, ranks=1: rows.setdefault(
                (step, position), cut(step, position, ranks)
            )
            try:
                trainer.run()
            finally:
                trainer.close()
            used = [w.engine.lookaheads for w in workers]
        return [np.concatenate([rows[s, p] for p in (0, 1)]) for s in range(config.steps)], used

    with caplog.at_level("WARNING"):
        plain, _ = rows_of(False)
        ahead, used = rows_of(True)
    assert used == [{"used": 4}] * 2
    assert all(np.array_equal(a, b) for a, b in zip(ahead, plain))
    assert not [r for r in caplog.records if "re-reading" in r.getMessage()]
