"""Spot checks (``coordinator.spotcheck``): the fingerprint a worker returns of its round's first gradient is
the one the coordinator recomputes from the rows it sent, at its own copy of the replica; a gradient of
other rows is not. Which rounds and senders are checked is a pure decision (``decisions.spot_check``)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig
from gradwire.coordinator import copies
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.decisions import (
    Standing,
    judge,
    redundancy_group,
    redundancy_verdict,
    spot_check,
    spot_check_method,
)
from gradwire.coordinator.spotcheck import SpotChecker, deterministic, first_rows
from gradwire.coordinator.trainer import Trainer
from gradwire.fingerprint import Fingerprint
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, LocalSteps, ModelState, RoundResult, WorkOrder
from gradwire.replica import Replica
from gradwire.worker.compute import gradient_step, local_steps
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import InProcessClient, in_process_clients
from gradwire.worker.placement import Placement
from gradwire.worker.session import Session

from ..faults import faulty

SPEC = model_spec("gpt-tiny")
CODEC = CodecConfig(chunk=16, topk=8)


def _replica() -> Replica:
    return Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"))


def _session() -> Session:
    replica = _replica()
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    return Session.from_state(
        ModelState("run", 0, json.dumps(SPEC), params, replica.rule.to_json()), torch.device("cpu")
    )


def _order(session: Session, seed: int = 0, **changes: object) -> WorkOrder:
    batch = np.random.default_rng(seed).integers(0, 8192, (8, 17)).astype(np.uint16)
    order = WorkOrder("run", 0, session.replica.version, batch, CODEC, session.replica.fingerprint())
    return dataclasses.replace(order, fingerprint_gradient=True, **changes)


def _tokens(order: WorkOrder) -> torch.Tensor:
    return torch.from_numpy(order.batch.astype(np.int64))


LOCAL = LocalSteps(2, InnerOptimizerConfig(name="adamw"), (1e-3, 1e-3))


@pytest.mark.parametrize(
    "mode", ["gradient", "gradient, micro-batches of 2", "gradient, clipped", "local-SGD round of 2 inner steps"]
)
def test_the_coordinator_recomputes_the_fingerprint_a_worker_returns(mode: str) -> None:
    session = _session()
    changes: dict[str, object] = {}
    if "micro" in mode:
        changes["micro_batch_size"] = 2
    if "clipped" in mode:
        changes["clip_grad_norm"] = 1e-3  # the fingerprint is taken before clipping
    if "local" in mode:
        changes["local_steps"] = LOCAL
    order = _order(session, **changes)
    compute = local_steps if "local" in mode else gradient_step
    got = compute(session, order, _tokens(order), lambda: False).fingerprint
    assert got is not None
    checker = SpotChecker(_replica())
    result = RoundResult(OK, 0, version=0, gradient_fingerprint=got)
    passed, why = checker.check(result, order.batch, order.local_steps, order.micro_batch_size)
    assert passed is True, why
    # Same device, same code: the same bits, not just within the tolerance.
    assert checker.expected(first_rows(order.batch, order.local_steps), order.micro_batch_size) == got
    # The coordinator's replica did not move, and holds no gradient.
    assert all(p.grad is None for p in checker.replica.params.values())
    assert all(torch.equal(p, q) for p, q in zip(checker.replica.params.values(), _replica().params.values()))


def test_a_gradient_of_other_rows_or_none_at_all_is_caught() -> None:
    session = _session()
    order = _order(session)
    rolled = dataclasses.replace(order, batch=np.roll(order.batch, order.batch.shape[1] // 2, axis=1))
    other = gradient_step(session, rolled, _tokens(rolled), lambda: False).fingerprint
    checker = SpotChecker(_replica())
    passed, why = checker.check(
        RoundResult(OK, 0, version=0, gradient_fingerprint=other), order.batch, None, order.micro_batch_size
    )
    assert passed is False and "differs" in why
    # Another batch altogether (not a rotation of the same rows) is caught as well.
    fresh = _order(session, seed=1)
    elsewhere = gradient_step(session, fresh, _tokens(fresh), lambda: False).fingerprint
    assert checker.check(RoundResult(OK, 0, gradient_fingerprint=elsewhere), order.batch, None, 0)[0] is False
    passed, why = checker.check(RoundResult(OK, 0, version=0), order.batch, None, 0)
    assert passed is False and "no gradient fingerprint" in why
    # A result computed at another version than the coordinator's copy holds is not judged.
    passed, why = checker.check(RoundResult(OK, 0, version=1, gradient_fingerprint=other), order.batch, None, 0)
    assert passed is None and "version 1" in why


def test_a_worker_fingerprints_only_when_asked() -> None:
    session = _session()
    order = dataclasses.replace(_order(session), fingerprint_gradient=False)
    assert gradient_step(session, order, _tokens(order), lambda: False).fingerprint is None


def test_the_request_and_the_fingerprint_cross_the_wire() -> None:
    session = _session()
    order = _order(session)
    back = protocol.order_from_proto(protocol.order_to_proto(order))
    assert back.fingerprint_gradient is True
    assert protocol.order_from_proto(protocol.order_to_proto(dataclasses.replace(order, fingerprint_gradient=False)))
    fp = gradient_step(session, order, _tokens(order), lambda: False).fingerprint
    result = RoundResult(OK, 0, gradient=None, gradient_fingerprint=fp)
    message = protocol.result_to_proto(result)
    assert message.HasField("gradient_fingerprint")
    message.gradient.CopyFrom(
        protocol.codec_serde.gradient_to_proto(
            _replica().codec(CODEC).compress({n: torch.zeros_like(p) for n, p in _replica().params.items()})
        )
    )
    assert protocol.result_from_proto(message).gradient_fingerprint == fp
    message.gradient_fingerprint.samples[0] = float("nan")
    with pytest.raises(protocol.ProtocolError, match="non-finite"):
        protocol.result_from_proto(message)


def test_which_rounds_and_senders_are_checked() -> None:
    assert spot_check(5, [0, 1, 2], 0, secret=7) == (None, "spot checks are off")
    assert spot_check(5, [], 1, secret=7)[0] is None
    # Every round with ``every`` 1, going round the senders: each of n checked once in any n rounds.
    chosen = [spot_check(step, [4, 0, 9], 1, secret=11)[0] for step in range(30)]
    for start in range(0, 30, 3):
        assert sorted(chosen[start : start + 3]) == [0, 4, 9]
    # One round in ``every`` on average, the same rounds for the same secret, others for another.
    drawn = [spot_check(step, [0, 1], 4, secret=3)[0] is not None for step in range(4000)]
    assert 0.22 < sum(drawn) / len(drawn) < 0.28
    assert drawn == [spot_check(step, [0, 1], 4, secret=3)[0] is not None for step in range(4000)]
    assert drawn != [spot_check(step, [0, 1], 4, secret=4)[0] is not None for step in range(4000)]


def test_a_model_that_draws_dropout_cannot_be_checked() -> None:
    assert deterministic(model_spec("gpt-tiny"))[0]
    ok, why = deterministic(model_spec("opt-125m"))
    assert not ok and "dropout 0.1" in why
    spec = model_spec("opt-125m")
    spec["config"]["dropout"] = 0.0
    assert deterministic(spec)[0]


def test_being_caught_benches_at_once() -> None:
    standing, why = judge(Standing(), 7, "caught", bench_after=3, bench_rounds=20)
    assert standing.benched(8) and standing.until == 28 and "spot check" in why
    standing, why = judge(Standing(), 7, "caught", bench_after=0, bench_rounds=20)  # benching off: a strike
    assert not standing.benched(8) and standing.strikes == 1


def test_honest_in_process_workers_pass_every_check_and_runs_can_turn_checks_off(tmp_path) -> None:
    common = dict(model="gpt-tiny", steps=6, batch_size=4, sequence_length=16, eval_every=0, seed=2)
    for every, name in ((1, "checked"), (0, "unchecked")):
        config = TrainConfig(output_dir=str(tmp_path / name), spot_check_every=every, **common)
        trainer = Trainer(config, in_process_clients(3), progress=False)
        try:
            records = trainer.run()
        finally:
            trainer.close()
        checks = [r["spot_check"] for r in records if "spot_check" in r]
        if every:
            assert len(checks) == 6 and all(c["passed"] is True for c in checks), checks
            assert len({c["worker"] for c in checks}) == 3  # each one checked in turn
            assert [s.checks for s in trainer.slots] == [(2, 0)] * 3  # what the status page shows
        else:
            assert checks == []
        assert all(r["rejected"] == 0 and r["benched"] == 0 for r in records)


def test_a_bf16_worker_is_recomputed_in_bf16_and_passes_every_check(tmp_path) -> None:
    """A worker whose Describe says bf16 is recomputed under bf16 autocast, and passes every check. (A float32
    recompute drifts from a bf16 gradient as the model trains: by 0.01-0.3% of the sum of squares a round in
    such a run, and once by 8.7%, past the tolerance: it would bench an honest worker.)"""
    config = TrainConfig(
        model="gpt-tiny",
        steps=8,
        batch_size=4,
        sequence_length=64,
        inner_steps=3,
        eval_every=0,
        output_dir=str(tmp_path),
        spot_check_every=1,
        spot_check_by="recompute",
    )
    factory = lambda device: WorkerEngine(device, placement=Placement(precision="bf16"))  # noqa: E731
    trainer = Trainer(config, in_process_clients(1, factory=factory), progress=False)
    recompute, asked = trainer.spot_checks.checker.expected, []

    def noted(rows: np.ndarray, micro_batch_size: int, precision: str = "fp32") -> Fingerprint:
        got = recompute(rows, micro_batch_size, precision)
        asked.append((precision, got != recompute(rows, micro_batch_size, "fp32")))
        return got

    trainer.spot_checks.checker.expected = noted  # type: ignore[method-assign]
    try:
        records = trainer.run()
    finally:
        trainer.close()
    assert trainer.slots[0].precision == "bf16"
    checks = [r["spot_check"] for r in records]
    assert len(checks) == 8 and all(c["passed"] is True for c in checks), checks
    assert asked == [("bf16", True)] * 8  # in bf16, which is not the float32 gradient


# ------------------------------------------------------------------------------------------- by redundancy


def test_how_checks_are_made() -> None:
    assert spot_check_method("auto", 30_000_000, "cpu", True)[0] == "recompute"
    assert spot_check_method("auto", 7_000_000_000, "cuda:0", True)[0] == "recompute"
    method, why = spot_check_method("auto", 125_000_000, "cpu", True)
    assert method == "redundancy" and "125M" in why
    assert spot_check_method("redundancy", 1000, "cpu", True)[0] == "redundancy"
    assert spot_check_method("recompute", 10**10, "cpu", True)[0] == "recompute"
    assert spot_check_method("redundancy", 1000, "cpu", False)[0] == "off"  # dropout: nobody can recompute


def test_which_workers_share_rows() -> None:
    same = (1, 1, "")  # inner steps, ranks, node mode
    candidates = [(0, same), (1, same), (2, same), (3, same), (5, (1, 2, "ddp"))]
    assert redundancy_group(0, candidates, 0, secret=1) == ((), "spot checks are off")
    groups = [redundancy_group(step, candidates, 1, secret=5)[0] for step in range(8)]
    assert all(len(g) == 3 and set(g) <= {0, 1, 2, 3} for g in groups)  # never the one of another shape
    assert {g[0] for g in groups} == {0, 1, 2, 3}  # whose rows they share goes round
    assert redundancy_group(0, [(0, same), (5, (1, 2, "ddp"))], 1, secret=5)[0] == ()  # no two alike
    assert redundancy_group(3, [(0, same), (1, same)], 1, secret=5)[0] in ((0, 1), (1, 0))
    drawn = [bool(redundancy_group(step, candidates, 5, secret=9)[0]) for step in range(2000)]
    assert 0.16 < sum(drawn) / len(drawn) < 0.24


def test_the_odd_one_out_is_caught_and_a_pair_that_disagrees_is_a_dispute() -> None:
    assert redundancy_verdict([1, 4, 7], {(1, 4): True, (1, 7): True, (4, 7): True}) == (
        {},
        "3 workers computed the same gradient",
    )
    caught, why = redundancy_verdict([1, 4, 7], {(1, 4): True, (1, 7): False, (4, 7): False})
    assert list(caught) == [7] and "1 of 3" in why
    assert redundancy_verdict([1, 4], {(1, 4): False})[0] == {}  # two that disagree: nobody can tell who
    assert "disputed" in redundancy_verdict([1, 4, 7], {(1, 4): False, (1, 7): False, (4, 7): False})[1]
    assert redundancy_verdict([3], {})[0] == {}


def test_workers_given_the_same_rows_are_not_taken_for_copies() -> None:
    words = np.arange(1, 301, dtype=np.uint64)
    current = [("a", copies.Digest.of(words)), ("b", copies.Digest.of(words.copy()))]
    assert list(copies.find_copies(current, [], 0)) == [1]
    assert copies.find_copies(current, [], 0, together={0, 1}) == {}


def _run(tmp_path, name: str, clients: list, **changes: object) -> tuple[Trainer, list[dict]]:
    settings = dict(model="gpt-tiny", steps=4, batch_size=4, sequence_length=16, eval_every=0, seed=2)
    config = TrainConfig(output_dir=str(tmp_path / name), spot_check_by="redundancy", spot_check_every=1)
    config = dataclasses.replace(config, **{**settings, **changes})
    trainer = Trainer(config, clients, progress=False)
    try:
        return trainer, trainer.run()
    finally:
        trainer.close()


def test_honest_workers_given_the_same_rows_agree_and_those_rows_count_once(tmp_path) -> None:
    trainer, records = _run(tmp_path, "honest", in_process_clients(3))
    checks = [r["spot_check"] for r in records]
    assert all(c["by"] == "redundancy" and c["passed"] is True and len(c["workers"]) == 3 for c in checks), checks
    assert all(r["rejected"] == 0 and r["benched"] == 0 for r in records)  # the same rows are no copies
    assert records[-1]["total_tokens"] == 4 * 4 * 16  # every round, one worker's rows: counted once
    assert all(r["pushes"] == 0 for r in records[1:])  # the shared-out weights replay alike everywhere
    assert [s.checks for s in trainer.slots] == [(4, 0)] * 3


def test_a_worker_computing_on_other_rows_is_caught_by_the_two_it_shares_rows_with(tmp_path) -> None:
    clients = in_process_clients(2) + [InProcessClient(faulty("other-rows")(), "in-process-bad")]
    trainer, records = _run(tmp_path, "bad", clients)
    first = records[0]["spot_check"]
    assert first["passed"] is False and "1 of 3" in first["reason"]
    assert records[0]["rejected"] == 1 and records[1]["benched"] == 1  # left out, benched at once
    assert [s.checks for s in trainer.slots][:2] == [(4, 0), (4, 0)]  # the honest pair, checked on
    assert trainer.slots[2].checks == (0, 1)
