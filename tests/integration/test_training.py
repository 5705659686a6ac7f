"""Training through the service: coordinator + real workers on loopback, gpt-tiny on the embedded corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.export import load_exported
from gradwire.coordinator.metrics import METRIC_KEYS, read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.models import build_from_spec, lm_loss, model_spec

from .conftest import assert_in_step, corrupt_replica, live_workers, rounds_in_step, steps_with_fault, train


def _config(tmp_path, **overrides) -> TrainConfig:
    base = dict(
        model="gpt-tiny",
        steps=30,
        batch_size=4,
        sequence_length=32,
        output_dir=str(tmp_path / "run"),
        round_timeout=60.0,
    )
    return TrainConfig(**{**base, **overrides})


def test_loss_falls_and_metrics_are_complete(tmp_path, two_workers):
    trainer = train(_config(tmp_path), two_workers)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        assert set(METRIC_KEYS) <= set(r)
        assert r["successful_workers"] == 2
    first, last = np.mean([r["loss"] for r in records[:3]]), np.mean([r["loss"] for r in records[-3:]])
    assert last < first - 0.5, (first, last)
    # After the first round's state push, a round carries only the update: far below the state size.
    assert records[0]["bytes_down"] > trainer.state_bytes * 2
    assert all(r["bytes_down"] < trainer.state_bytes / 20 for r in records[1:])
    # The top-k warm-up's 3 steps (a tenth of 30) send 6x the top-k, the rest fewer: the run as a whole, 100x.
    assert len(records) / sum(1 / r["compression_ratio"] for r in records) > 100
    assert all(r["compression_ratio"] > 100 for r in records[3:])
    # The workers' replicas are the coordinator's, bit for bit (same device kind, replayed updates)...
    for w in two_workers:
        (session,) = w.engine.sessions.values()
        assert session.replica.version == trainer.replica.version - 1  # ...one update behind, by design
    exported, tokenizer = load_exported(tmp_path / "run" / "final")
    for (name, p), (_, q) in zip(exported.named_parameters(), trainer.model.named_parameters()):
        assert torch.equal(p, q), name
    assert tokenizer.decode(tokenizer.encode("To be, or not to be").ids) == "To be, or not to be"


def test_dense_sgd_through_the_service_equals_single_process_training(tmp_path, two_workers):
    config = _config(tmp_path, steps=4, no_compression=True, outer_optimizer="sgd", learning_rate=0.5)
    trainer = train(config, two_workers)
    # The same 2b sequences per step, in one process.
    model = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    for step in range(config.steps):
        rows = np.concatenate(
            [trainer.data.batch(step, slot, config.batch_size, config.sequence_length) for slot in (0, 1)]
        )
        model.zero_grad()
        lm_loss(model, torch.from_numpy(rows.astype(np.int64))).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-config.learning_rate)
    for (name, ours), (_, ref) in zip(trainer.model.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0, msg=name)
    moved = build_from_spec(model_spec("gpt-tiny"), seed=config.seed)
    assert any(not torch.allclose(a, b) for a, b in zip(moved.parameters(), model.parameters()))  # it trained


def test_resume_continues_the_same_trajectory(tmp_path):
    # --balance sizes the workers' shares to each run's own timings: the same rows in both runs need it off. A
    # run of 10 steps extended to 20 is not a 20-step run where a schedule follows --steps: the top-k warm-up's
    # is off (resuming within it: test_update_log).
    same = {"balance": "off", "topk_warmup_steps": 0}
    straight_cfg = _config(tmp_path / "a", steps=20, **same)
    with live_workers(2) as workers:
        straight = train(straight_cfg, workers)
    with live_workers(2) as workers:
        train(_config(tmp_path / "b", steps=10, **same), workers)
    with live_workers(2) as workers:  # fresh worker processes: error feedback comes from the checkpoint
        resumed = train(
            _config(tmp_path / "b", steps=20, resume_from=str(tmp_path / "b" / "run" / "checkpoints"), **same),
            workers,
        )
    losses_a = [r["loss"] for r in read_metrics(tmp_path / "a" / "run")]
    losses_b = [r["loss"] for r in read_metrics(tmp_path / "b" / "run")]
    assert losses_b == losses_a
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_the_sign_step_moves_the_token_embedding_at_its_own_rate_on_every_replica(tmp_path, two_workers):
    """--embedding-lr-scale (gradient mode's default 2): a sign step moves each element of the tied embedding by
    the scaled rate and each other parameter by the rate; the workers replay it to the same bits."""
    config = _config(tmp_path, steps=2, learning_rate=0.01, embedding_lr_scale=3.0)
    start = dict(build_from_spec(model_spec("gpt-tiny"), seed=config.seed).named_parameters())
    trainer, _ = rounds_in_step(config, two_workers)  # both workers' replicas are the coordinator's, bit for bit
    assert trainer.replica.rule.lr_scales == (("tok_emb.weight", 3.0),)
    for name, p in trainer.model.named_parameters():  # two steps: each element back where it was, or 2 rates on
        rate = 0.03 if name == "tok_emb.weight" else 0.01
        moved = (p.detach() - start[name]).abs()
        stepped = moved > rate
        assert stepped.float().mean() > 0.3, name
        torch.testing.assert_close(moved[stepped], torch.full_like(moved[stepped], 2 * rate), rtol=1e-3, atol=0)
        assert (moved[~stepped] < 1e-6).all(), name


def test_float64_replays_keep_replicas_bit_identical(tmp_path, two_workers):
    """--replay-precision float64 (what auto picks across device kinds not measured to agree): the workers'
    replicas still equal the coordinator's bit for bit, with no push after the first."""
    trainer = Trainer(
        _config(tmp_path, steps=6, replay_precision="float64"), [w.client() for w in two_workers], progress=False
    )
    records = steps_with_fault(trainer, lambda: None, before=2, after=2)
    assert [r["pushes"] for r in records] == [2, 0, 0, 0]
    assert trainer.pending is not None and trainer.pending.rule.exact
    assert_in_step(trainer, two_workers[0])  # applies the pending update on both sides, compares
    (other,) = two_workers[1].engine.sessions.values()
    other.replica.apply(trainer.pending)
    for name, p in trainer.replica.params.items():
        assert torch.equal(other.replica.params[name], p), name


def test_perturbed_worker_resyncs_and_training_continues(tmp_path, two_workers):
    trainer = Trainer(_config(tmp_path, steps=6), [w.client() for w in two_workers], progress=False)
    records = steps_with_fault(trainer, lambda: corrupt_replica(two_workers[1]))
    assert [r["pushes"] for r in records] == [2, 0, 0, 1, 0, 0]
    assert all(r["successful_workers"] == 2 for r in records)
    # Both copies stand at the round's base; the last update is pending on both sides.
    assert_in_step(trainer, two_workers[1])


def test_adamw_travels_as_compressed_deltas(tmp_path, two_workers):
    trainer = train(_config(tmp_path, steps=15, outer_optimizer="adamw", learning_rate=3e-3), two_workers)
    records = read_metrics(tmp_path / "run")
    assert np.mean([r["loss"] for r in records[-3:]]) < np.mean([r["loss"] for r in records[:3]])
    assert all(r["pushes"] == 0 for r in records[1:])  # deltas keep the workers' shadow replicas in sync
    for w in two_workers:  # one pending delta behind the coordinator's shadow, then identical
        (session,) = w.engine.sessions.values()
        session.replica.apply(trainer.pending)
        for name, p in trainer.replica.params.items():
            assert torch.equal(session.replica.params[name], p), name


def test_a_dead_worker_spoils_only_its_share(tmp_path, two_workers):
    trainer = Trainer(_config(tmp_path, steps=6, round_timeout=10.0), [w.client() for w in two_workers], progress=False)
    try:
        trainer.connect()
        records = [trainer.train_step() for _ in range(2)]
        two_workers[1].server.stop(grace=None)  # the box goes away mid-run
        records += [trainer.train_step() for _ in range(3)]
    finally:
        trainer.close()
    assert [r["successful_workers"] for r in records] == [2, 2, 1, 1, 1]
    assert trainer.slots[1].version is None  # it will get the state pushed if it comes back
    assert all(np.isfinite(r["loss"]) for r in records) and trainer.step == 5


def test_eval_every_reports_held_out_loss(tmp_path, two_workers):
    train(_config(tmp_path, steps=6, eval_every=3, eval_batches=2), two_workers)
    records = read_metrics(tmp_path / "run")
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [3, 6] and all(np.isfinite(v) for v in evals.values())
    assert evals[6] < evals[3]  # early in training the held-out loss falls too


@pytest.mark.parametrize("streaming", [False, True])
def test_jsonl_data_trains_through_the_service(tmp_path, two_workers, streaming):
    from gradwire.assets import corpus_path

    text = corpus_path().read_text(encoding="utf-8")[:200_000]
    path = tmp_path / "corpus.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i in range(0, len(text), 2000):
            f.write(json.dumps({"body": text[i : i + 2000], "id": i}) + "\n")
    config = _config(
        tmp_path, steps=4, data=(str(path),), text_field="body", streaming=streaming, eval_every=2, eval_batches=1
    )
    trainer = train(config, two_workers)
    records = read_metrics(tmp_path / "run")
    assert [r["successful_workers"] for r in records] == [2, 2, 2, 2]
    assert all(np.isfinite(r["eval_loss"]) for r in records if r["step"] % 2 == 0)
    assert type(trainer.data).__name__ == ("StreamingTokenSource" if streaming else "TokenStream")


def test_keep_checkpoints_prunes_old_steps(tmp_path, two_workers):
    train(_config(tmp_path, steps=6, checkpoint_every=2, keep_checkpoints=2), two_workers)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000004", "step-00000006"]
    assert (root / "latest").read_text().strip() == "step-00000006"


def test_a_worker_is_never_sent_its_own_payload_back(tmp_path, two_workers):
    """Each worker holds the payload it sent; the replay it gets carries only the others' (two workers:
    one payload down per worker per round, as many bytes down as up). Top-32 of 64 x 64 and the mean: two
    senders' sparse inverse beats the dense one by the margin ``aggregate.sparse_senders`` asks for (the
    default top-36 does not), and each worker's own inverse, taken ahead, is a term of it (under kept-mean,
    gradient mode's default, two senders' shares depend on who kept each coefficient)."""
    trainer = train(_config(tmp_path, steps=5, topk=32, aggregate="mean"), two_workers)
    records = read_metrics(tmp_path / "run")
    for before, r in zip(records[1:], records[2:]):  # round k replays round k-1's payloads
        assert 0.9 * before["bytes_up"] < r["bytes_down"] < 1.1 * before["bytes_up"] + 4096, (
            r["step"],
            r["bytes_down"],
            before["bytes_up"],
        )
    assert all(r["pushes"] == 0 for r in records[1:])
    for w in two_workers:
        (session,) = w.engine.sessions.values()
        assert session.last_sent is not None and session.last_sent[0] == trainer.step - 1
        # Two senders replay on the sparse path: each worker took its own payload's transform ahead, and
        # its replica still matched the coordinator's every round (no pushes, above).
        assert session.sent_decoded is not None and session.sent_decoded.result().inverse is not None


def test_a_worker_that_lost_its_own_payload_gets_the_state(tmp_path, two_workers):
    def forget() -> None:
        (session,) = two_workers[1].engine.sessions.values()
        session.last_sent = None

    trainer = Trainer(_config(tmp_path, steps=6), [w.client() for w in two_workers], progress=False)
    records = steps_with_fault(trainer, forget)
    assert [r["pushes"] for r in records] == [2, 0, 0, 1, 0, 0]  # NEEDS_STATE, one push, on course
    assert all(r["successful_workers"] == 2 for r in records)
    assert_in_step(trainer, two_workers[1])


def test_a_top_k_warm_up_sends_its_codec_each_step_and_keeps_replicas_in_step(tmp_path, two_workers):
    """Gradient mode's default top-k warm-up through real servers (20 steps: 2 warm ones, a tenth): each
    round's payloads are the plan of its step's top-k, 6x the top-k for 2 steps and fewer after, and the
    replays keep every replica the coordinator's."""
    config = _config(tmp_path, steps=20)
    warmup = config.topk_warmup()
    assert (warmup.steps, warmup.warm) == (2, 6 * config.topk) and warmup.rest < config.topk
    trainer = Trainer(config, [w.client() for w in two_workers], progress=False)
    records = steps_with_fault(trainer, lambda: None, before=2, after=2)
    assert all(r is not None and r["successful_workers"] == 2 for r in records)
    plan = {
        k: trainer.replica.codec(warmup.config_at(config.codec_config(), s)).plan.payload_bytes()
        for s, k in ((0, "warm"), (2, "rest"))
    }
    framing = [r["bytes_up"] - 2 * plan["warm" if r["step"] <= 2 else "rest"] for r in records]
    assert plan["warm"] > 3 * plan["rest"] and min(framing) > 0, (plan, framing)
    assert max(framing) - min(framing) < plan["rest"] / 20  # the same framing (fields, scales) at any top-k
    assert_in_step(trainer, two_workers[0])


def test_elias_fano_indices_cross_the_wire_and_keep_replicas_in_step(tmp_path, two_workers):
    """--index-coding elias-fano in local-SGD rounds through real servers: the settings travel in every
    payload, the auto top-k is the same-bytes one, the replays keep every replica bit for bit the
    coordinator's, and the payloads are what the plan says."""
    config = _config(tmp_path, steps=4, inner_steps=3, index_coding="elias-fano")
    assert config.topk == 143
    trainer = Trainer(config, [w.client() for w in two_workers], progress=False)
    records = steps_with_fault(trainer, lambda: None, before=2, after=2)
    assert all(r is not None and r["successful_workers"] == 2 for r in records)
    assert [r["pushes"] for r in records] == [2, 0, 0, 0]
    assert trainer.outer.codec.config.indices == "elias-fano"
    assert all(r["bytes_up"] > 2 * trainer.outer.codec.plan.payload_bytes() for r in records)  # plus framing
    assert_in_step(trainer, two_workers[0])
