"""Low-rank factors (``--rank``) through the service: local-SGD rounds train, every replica decodes the
same bits, a resumed run is the straight run, and the payload is what the plan says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradwire.compression import Encoding
from gradwire.compression.feedback import SUBSPACE
from gradwire.coordinator.checkpoint import load_checkpoint
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer

from .conftest import live_workers, rounds_in_step, train

H = 3


def _config(tmp_path, **overrides) -> TrainConfig:
    base = dict(
        model="gpt-tiny",
        steps=8,
        batch_size=2,
        sequence_length=32,
        inner_steps=H,
        inner_learning_rate=3e-3,
        rank=2,
        output_dir=str(tmp_path / "run"),
        round_timeout=60.0,
    )
    return TrainConfig(**{**base, **overrides})


def test_local_sgd_rounds_with_factors_train_and_keep_replicas_exact(tmp_path):
    config = _config(tmp_path)
    with live_workers(2) as workers:
        trainer, records = rounds_in_step(config, workers)
    factored = [t for t in trainer.outer.codec.plan.tensors if t.encoding == Encoding.LOW_RANK]
    assert factored and all(t.k == 2 for t in factored)  # every matrix of gpt-tiny, at rank 2
    # Replicas that replayed other bits would fail the fingerprint check and be pushed the model again.
    assert [r["pushes"] for r in records] == [2] + [0] * (config.steps - 1)
    assert all(r["successful_workers"] == 2 for r in records)
    assert np.mean([r["inner_loss"] for r in records[-2:]]) < np.mean([r["inner_loss"] for r in records[:2]]) - 0.3
    # Rank 2 of gpt-tiny's matrices costs less than the default top-k of the same run.
    with live_workers(2) as workers:
        train(_config(tmp_path / "topk", steps=2, rank=0), workers)
    topk_bytes = read_metrics(tmp_path / "topk" / "run")[-1]["bytes_up_per_token"]
    assert records[-1]["bytes_up_per_token"] < topk_bytes


def test_resume_with_factors_is_the_straight_run(tmp_path):
    # The workers' parameter-domain error feedback travels in the checkpoint, and beside it the subspace each
    # matrix's factors are refined from round to round: a resumed worker factors as the straight one.
    settings = dict(inner_steps=2, balance="off")
    with live_workers(2) as workers:
        straight = train(_config(tmp_path / "a", steps=8, **settings), workers)
    with live_workers(2) as workers:
        train(_config(tmp_path / "b", steps=4, **settings), workers)
    with live_workers(2) as workers:
        resumed = train(
            _config(tmp_path / "b", steps=8, resume_from=str(tmp_path / "b" / "run" / "checkpoints"), **settings),
            workers,
        )
    assert [r["loss"] for r in read_metrics(tmp_path / "b" / "run")] == [
        r["loss"] for r in read_metrics(tmp_path / "a" / "run")
    ]
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    # The workers' state at the end, subspaces included, bit for bit (groups are named by the workers'
    # addresses, which differ between the runs: each of one run's equals one of the other's).
    ends = [load_checkpoint(t.last_checkpoint)[0] for t in (straight, resumed)]
    straight_fb, resumed_fb = ([ts for g, ts in end.items() if g.startswith("feedback-")] for end in ends)
    assert len(straight_fb) == len(resumed_fb) == 2

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(t, b[k]) for k, t in a.items())

    for tensors in straight_fb:
        assert any(k.startswith(SUBSPACE) for k in tensors)
        assert sum(same(tensors, other) for other in resumed_fb) == 1


@pytest.mark.parametrize(
    "settings",
    [
        dict(downlink="compressed"),  # the coordinator factors the aggregate again, at 4x the rank
        dict(fragments=3),  # each fragment's codec factors its own matrices
        dict(overlap=True),  # eager: the worker's own factors until the aggregate lands
        dict(inner_steps=1),  # gradient mode, streamed in buckets
        dict(inner_steps=1, stream_buckets=3),
        dict(topology="ring"),  # gossip: each worker's model difference, factored
    ],
    ids=["downlink", "fragments", "overlap", "gradient", "streamed", "gossip"],
)
def test_factors_work_wherever_the_codec_does(tmp_path, settings):
    config = _config(tmp_path, steps=4, **settings)
    with live_workers(2) as workers:
        if config.gossip:  # every worker keeps its own model: no replica to compare
            trainer = Trainer(config, [w.client() for w in workers], progress=False)
            try:
                trainer.connect()
                records = [trainer.train_step() for _ in range(config.steps)]
            finally:
                trainer.close()
        else:
            _, records = rounds_in_step(config, workers)
    assert all(r is not None and r["successful_workers"] == 2 for r in records), records
    assert all(np.isfinite(r["loss"]) for r in records)
    if not config.gossip:
        assert sum(r["pushes"] for r in records[1:]) == 0  # every replica replayed the same bits
