"""Streamed fragments (``coordinator train --fragments F``, Streaming DiLoCo) through the service.

A round is H / F inner steps and syncs one fragment of the model's tensors, in turn; each worker's working
model carries on from round to round, and takes back from the replica only what the updates moved. With
exact pseudo-gradients, inner SGD and outer SGD at lr 1, the run is this formula (``_streaming``), and every
tensor moves exactly once every H inner steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradwire.compression.fragment import Fragment, split
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.models import build_from_spec, lm_loss, model_spec

from .conftest import assert_in_step, live_workers, rounds_in_step, train


def _config(tmp_path, **overrides) -> TrainConfig:
    base = dict(
        model="gpt-tiny",
        steps=6,
        batch_size=2,
        sequence_length=32,
        inner_steps=2,
        fragments=2,
        output_dir=str(tmp_path / "run"),
        round_timeout=60.0,
        balance="off",
    )
    return TrainConfig(**{**base, **overrides})


def _streaming(trainer: Trainer, config: TrainConfig, workers: int, lr: float) -> torch.nn.Module:
    """Streaming DiLoCo, written down: global model g, each worker's local model w_i (both start at g).
    Round r: every worker takes H / F inner SGD steps on its rows; fragment p = r mod F of g moves by the
    mean of (g_p - w_i,p) (outer SGD, lr 1); every worker then takes g_p back into w_i,p."""
    g = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    local = [build_from_spec(model_spec("gpt-tiny"), seed=config.seed) for _ in range(workers)]
    shapes = {n: tuple(p.shape) for n, p in g.named_parameters()}
    parts = split(shapes, config.fragments)
    steps, rows = config.round_steps, config.batch_size
    for r in range(config.steps):
        for i, w in enumerate(local):
            batch = trainer.round_batch(r, i)
            for h in range(steps):
                w.zero_grad()
                lm_loss(w, torch.from_numpy(batch[h * rows : (h + 1) * rows].astype(np.int64))).backward()
                with torch.no_grad():
                    for p in w.parameters():
                        p.add_(p.grad, alpha=-lr)
        fragment = set(parts[r % config.fragments])
        with torch.no_grad():
            named = [dict(w.named_parameters()) for w in local]
            for name, p in g.named_parameters():
                if name in fragment:
                    p.sub_(sum(p - n[name] for n in named) / workers)
                    for n in named:
                        n[name].copy_(p)
    return g


def test_fragments_are_streaming_diloco_and_replicas_stay_bit_identical(tmp_path):
    config = _config(
        tmp_path,
        no_compression=True,
        inner_optimizer="sgd",
        inner_learning_rate=0.5,
        outer_optimizer="sgd",
        learning_rate=1.0,
    )
    with live_workers(2) as workers:
        trainer, records = rounds_in_step(config, workers)
    assert all(r["successful_workers"] == 2 and r["inner_steps"] == 1 for r in records)
    expected = _streaming(trainer, config, 2, 0.5)
    for (name, a), b in zip(trainer.model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_every_tensor_syncs_once_every_h_inner_steps_at_a_fraction_of_the_bytes(tmp_path):
    """H 6 in 3 fragments: rounds of 2 inner steps; round r moves fragment r mod 3's tensors and no others,
    so each tensor moves once every 3 rounds (6 inner steps); a round's payload is its fragment's share of
    the whole model's payload in rounds of H (compressed, the defaults), as its plan counts it. gpt-tiny's
    embedding is 86% of it, and a tensor is never split, so its fragments are uneven; gpt-10m's hold a third
    each, to 1% (tests/unit/test_fragment.py)."""
    config = _config(tmp_path / "f3", inner_steps=6, fragments=3, steps=6)
    moved, per_round = [], []
    with live_workers(2) as workers:
        trainer = Trainer(config, [w.client() for w in workers], progress=False)
        try:
            trainer.connect()
            for _ in range(config.steps):
                before = {n: p.detach().clone() for n, p in trainer.replica.params.items()}
                per_round.append(trainer.train_step()["bytes_up"])
                trainer.flush()
                moved.append({n for n, p in trainer.replica.params.items() if not torch.equal(p, before[n])})
        finally:
            trainer.close()
    parts = split(trainer.replica.shapes, 3)
    for r in range(config.steps):  # the flush applies round r's update at once
        assert moved[r] == set(parts[r % 3]), r
    with live_workers(2) as workers:
        train(_config(tmp_path / "f1", inner_steps=6, fragments=1, steps=2), workers)
    whole = [r["bytes_up"] for r in read_metrics(tmp_path / "f1" / "run")]
    codec = config.codec_config()
    whole_bytes = trainer.replica.codec(codec).plan.payload_bytes()
    share = [trainer.replica.codec(codec, Fragment(f, 3)).plan.payload_bytes() / whole_bytes for f in range(3)]
    for r, b in enumerate(per_round):
        # each result's own fields (loss, timings, ...) cost a few hundred bytes whatever the payload
        assert abs(b - share[r % 3] * whole[0]) < 0.1 * share[r % 3] * whole[0] + 2 * 600, (per_round, whole, share)
    assert sum(per_round[:3]) == pytest.approx(whole[0], rel=0.15)  # the whole model, once, in three parts


def test_one_fragment_is_todays_rounds(tmp_path):
    """--fragments 1 sends orders and updates of the whole model (no fragment named), H inner steps each."""
    config = _config(tmp_path, fragments=1, inner_steps=2, steps=2)
    assert config.round_steps == 2
    with live_workers(1) as workers:
        trainer = train(config, workers)
        orders = [
            trainer.round_work(s, trainer.slots).order("run", 0, 0, None, trainer.replica.fingerprint()) for s in (0, 1)
        ]
    assert all(o.local_steps.fragment is None and o.local_steps.steps == 2 for o in orders)
    assert trainer.pending is None or trainer.pending.fragment is None


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(inner_steps=4, fragments=3), "multiple of it"),
        (dict(inner_steps=1, fragments=2), "multiple of it"),
        (dict(outer_optimizer="adamw"), "replays each fragment"),
        (dict(downlink="compressed"), "replays each fragment"),
    ],
)
def test_fragments_refuse_what_they_cannot_do(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **settings)


def test_fragments_with_overlap_train_in_step_without_looking_ahead(tmp_path):
    """Delayed rounds of fragments: each round computes before the last fragment's update and applies it
    after; nothing is computed ahead (the working model carries on), and the replicas stay in step."""
    config = _config(tmp_path, overlap=True, steps=5)
    with live_workers(2) as workers:
        trainer = Trainer(config, [w.client() for w in workers], progress=False)
        try:
            trainer.connect()
            records = [trainer.train_step() for _ in range(config.steps)]
            assert all(not w.engine.lookaheads for w in workers)
            assert_in_step(trainer, workers[1])
        finally:
            trainer.close()
    assert all(r["successful_workers"] == 2 and np.isfinite(r["loss"]) for r in records)


@pytest.mark.slow
def test_nodes_of_every_split_send_their_fragments(tmp_path):
    """An fsdp and a pipeline node of 2 ranks each (real processes, gloo): every rank encodes its own
    tensors of the round's fragment (a rank may hold none of it), rank 0 assembles the fragment's payload,
    and the nodes stay in step with the coordinator: every round counts both, and no state is pushed again."""
    from gradwire.coordinator.client import WorkerClient

    from .conftest import run_trainer
    from .test_node import TIMEOUT, Node, node_config, nodes

    with nodes(tmp_path, Node(("--node-mode", "fsdp")), Node(("--node-mode", "pipeline"))) as started:
        clients = [WorkerClient(address, timeout=TIMEOUT) for address, _ in started]
        config = node_config(tmp_path / "run", 6, inner_steps=4, fragments=2, checkpoint_every=0, balance="off")
        run_trainer(config, clients)
    records = read_metrics(tmp_path / "run")
    assert all(r["successful_workers"] == 2 and r["inner_steps"] == 2 for r in records)
    assert sum(r["pushes"] for r in records) == 2  # each node's first push, none after
    assert records[-1]["loss"] < records[0]["loss"]
