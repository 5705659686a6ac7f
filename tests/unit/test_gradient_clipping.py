"""``--clip-grad-norm``: in gradient mode each worker clips its gradient before error feedback and the codec;
in local-SGD rounds it clips every inner step's.

The clipped gradient is exactly what ``torch.nn.utils.clip_grad_norm_`` makes of the unclipped one; the
setting crosses the wire in the work order, the norm before clipping comes back in the result, a look-ahead
computed under another setting is not used, and the coordinator's orders carry it in gradient mode only.
A local-SGD round's pseudo-gradient is that of inner steps clipped by hand (so each moves the model by at
most lr x the bound), and the round reports its inner steps' mean norm before clipping.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from gradwire import protocol
from gradwire.compression import CodecConfig, ErrorFeedback
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.models import build_from_spec, lm_loss, model_spec
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import BEHIND, OK, LocalSteps, ModelState, ProtocolError, RoundResult, WorkOrder
from gradwire.replica import Replica
from gradwire.worker.compute import Contribution, gradient_step, local_steps
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import in_process_clients
from gradwire.worker.lookahead import Lookahead
from gradwire.worker.session import Session

SPEC = model_spec("gpt-tiny")
CODEC = CodecConfig(chunk=16, topk=8)


def _state() -> ModelState:
    replica = Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"))
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    return ModelState("run", 4, json.dumps(SPEC), params, replica.rule.to_json())


def _batch(rows: int = 4) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 8192, (rows, 17)).astype(np.uint16)


def _order(session: Session, **changes: object) -> WorkOrder:
    order = WorkOrder("run", 0, session.replica.version, _batch(), CODEC, session.replica.fingerprint())
    return dataclasses.replace(order, **changes)


def _gradient(clip: float) -> Contribution:
    session = Session.from_state(_state(), torch.device("cpu"))
    order = _order(session, clip_grad_norm=clip)
    out = gradient_step(session, order, torch.from_numpy(order.batch.astype(np.int64)), lambda: False)
    return dataclasses.replace(out, tensors={n: g.clone() for n, g in out.tensors.items()})


def _clipped(gradient: dict[str, torch.Tensor], clip: float) -> dict[str, torch.Tensor]:
    """``gradient`` as ``torch.nn.utils.clip_grad_norm_`` clips parameters holding it."""
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in gradient.items()}
    for name, p in params.items():
        p.grad = gradient[name].clone()
    torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
    return {n: p.grad for n, p in params.items()}


def test_the_clipped_gradient_is_what_clip_grad_norm_makes_of_it() -> None:
    full = _gradient(0.0)
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full.tensors.values()])))
    assert full.grad_norm == pytest.approx(norm, rel=1e-6)
    clip = norm / 4
    expected = _clipped(full.tensors, clip)
    clipped = _gradient(clip)
    assert clipped.grad_norm == full.grad_norm  # the norm before clipping, reported either way
    for name, g in clipped.tensors.items():
        assert torch.equal(g, expected[name]), name
    loose = _gradient(norm * 2)  # above the norm: nothing changes
    assert all(torch.equal(loose.tensors[n], full.tensors[n]) for n in full.tensors)


def _round(clip: float) -> tuple[WorkerEngine, RoundResult]:
    engine = WorkerEngine("cpu")
    engine.push_state(_state())
    (session,) = engine.sessions.values()
    return engine, engine.run_round(_order(session, clip_grad_norm=clip))


def test_the_sent_payload_is_the_codec_of_the_clipped_gradient() -> None:
    full = _gradient(0.0)
    clip = full.grad_norm / 4
    engine = WorkerEngine("cpu")
    engine.push_state(_state())
    (session,) = engine.sessions.values()
    result = engine.run_round(_order(session, clip_grad_norm=clip))
    assert result.status == OK and result.grad_norm == full.grad_norm
    # The worker's first round: empty error feedback, so the payload is the codec of the clipped gradient.
    reference = session.replica.codec(CODEC).compress(_clipped(full.tensors, clip), ErrorFeedback(beta=0.999))
    assert (
        protocol.result_to_proto(result).gradient
        == protocol.result_to_proto(dataclasses.replace(result, gradient=reference)).gradient
    )


def test_clip_grad_norm_crosses_the_wire_and_is_validated() -> None:
    session = Session.from_state(_state(), torch.device("cpu"))
    order = _order(session, clip_grad_norm=0.5)
    assert protocol.order_from_proto(protocol.order_to_proto(order)).clip_grad_norm == 0.5
    for bad, message in ((-1.0, "clip_grad_norm"), (math.nan, "clip_grad_norm"), (math.inf, "clip_grad_norm")):
        msg = protocol.order_to_proto(order)
        msg.clip_grad_norm = bad
        with pytest.raises(ProtocolError, match=message):
            protocol.order_from_proto(msg)
    local = dataclasses.replace(order, local_steps=LocalSteps(2, InnerOptimizerConfig(), (1e-3, 1e-3)))
    with pytest.raises(ProtocolError, match="inner steps"):
        protocol.order_from_proto(protocol.order_to_proto(local))
    result = RoundResult(BEHIND, 0, "at another version", grad_norm=2.5)
    msg = protocol.result_to_proto(result)
    assert protocol.result_from_proto(msg).grad_norm == 2.5
    msg.grad_norm = -1.0
    with pytest.raises(ProtocolError, match="grad_norm"):
        protocol.result_from_proto(msg)


def test_a_lookahead_computed_under_another_clip_is_not_used() -> None:
    session = Session.from_state(_state(), torch.device("cpu"))
    order = _order(session, compute_before_update=True, clip_grad_norm=1.0)
    ahead = Lookahead(dataclasses.replace(order, batch=order.batch.copy()), Contribution({}, 0.0, 0), 0.1)
    assert ahead.serves(order, order.base_version)[0]
    ok, why = ahead.serves(dataclasses.replace(order, clip_grad_norm=2.0), order.base_version)
    assert not ok and "clipping" in why


@pytest.mark.parametrize("inner_steps", [1, 2])
def test_the_coordinator_clips_in_gradient_mode_and_reports_it(tmp_path, inner_steps: int) -> None:
    config = TrainConfig(
        model="gpt-tiny",
        steps=2,
        batch_size=2,
        sequence_length=16,
        inner_steps=inner_steps,
        clip_grad_norm=1e-3,
        checkpoint_every=0,
        output_dir=str(tmp_path),
    )
    trainer = Trainer(config, in_process_clients(2), progress=False)
    try:
        work = trainer.round_work(0, trainer.slots)
        trainer.run()
    finally:
        trainer.close()
    records = read_metrics(tmp_path)
    if inner_steps == 1:  # gradient mode: the order clips the gradient, and every worker's was over the bound
        assert work.clip_grad_norm == 1e-3 and work.local_steps is None
        assert all(r["grad_clipped"] == 2 and r["worker_grad_norm"] > 1e-3 for r in records)
    else:  # local-SGD rounds clip every inner step instead, and report their norms before clipping
        assert work.clip_grad_norm == 0.0 and work.local_steps.clip_grad_norm == 1e-3
        assert all(r["grad_clipped"] == 2 and r["worker_grad_norm"] > 1e-3 for r in records)


LOCAL = LocalSteps(3, InnerOptimizerConfig(name="sgd"), (0.2, 0.1, 0.1))


def _local_round(clip: float) -> Contribution:
    session = Session.from_state(_state(), torch.device("cpu"))
    plan = dataclasses.replace(LOCAL, clip_grad_norm=clip)
    order = _order(session, batch=_batch(LOCAL.steps), local_steps=plan)
    return local_steps(session, order, torch.from_numpy(order.batch.astype(np.int64)), lambda: False)


def _local_by_hand(clip: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``LOCAL``'s inner steps (one row each) with plain SGD and ``clip_grad_norm_``: the pseudo-gradient,
    and each step's norm before clipping."""
    start, model = build_from_spec(SPEC, seed=0), build_from_spec(SPEC, seed=0)
    rows = torch.from_numpy(_batch(LOCAL.steps).astype(np.int64))
    norms = []
    for h, lr in enumerate(LOCAL.learning_rates):
        model.zero_grad()
        lm_loss(model, rows[h : h + 1]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
    return {n: p.detach() - q.detach() for (n, p), q in zip(start.named_parameters(), model.parameters())}, norms


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors.values()])))


def test_local_sgd_rounds_clip_every_inner_step_and_report_the_norm_before_clipping() -> None:
    free, (free_expected, free_norms) = _local_round(0.0), _local_by_hand(0.0)
    clip = min(free_norms) / 4
    clipped, (expected, norms) = _local_round(clip), _local_by_hand(clip)
    assert min(norms) > clip  # every inner step was clipped
    for got, want in ((free, free_expected), (clipped, expected)):
        for name, d in want.items():
            torch.testing.assert_close(got.tensors[name], d, atol=1e-6, rtol=0, msg=name)
    # Sent: each inner step moved the model by lr x the bound at most, far less than unclipped.
    bound = sum(LOCAL.learning_rates) * clip
    assert _norm(clipped.tensors) <= bound * (1 + 1e-5) < _norm(free.tensors) / 2
    # Reported: the mean of the inner steps' norms before clipping (the later steps' differ with clipping).
    assert free.grad_norm == pytest.approx(sum(free_norms) / 3, rel=1e-5)
    assert clipped.grad_norm == pytest.approx(sum(norms) / 3, rel=1e-5) and clipped.grad_norm > clip
    assert norms[1:] != pytest.approx(free_norms[1:], rel=1e-3)
