"""Node settings a user reaches for, on real 2-rank CPU nodes (gloo) started by ``worker serve --nproc-per-node``:
micro-batches under DDP (``no_sync`` until the last one) give the whole batch's gradient and pseudo-gradient;
the fp16 communication hook trains and puts half the bytes of ``none`` on the bus; and ``--node-sync-steps 3``
averages the ranks' models every 3 inner steps, as averaging two models trained by hand does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import DENSE_CODEC
from gradwire.models import build_from_spec, lm_loss
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.protocol import LocalSteps, RoundResult, WorkOrder
from gradwire.worker.engine import WorkerEngine

from .test_node import SPEC, TIMEOUT, Node, assert_close, batch, contribution, node, nodes, state

pytestmark = pytest.mark.slow  # each starts node processes: ~10 s or more on two cores


def _sgd(steps: int, lr: float = 0.5) -> LocalSteps:
    return LocalSteps(steps, InnerOptimizerConfig(name="sgd"), (lr,) * steps)


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors.values()])))


def test_micro_batches_on_a_ddp_node_give_the_whole_batchs_gradient_and_pseudo_gradient(tmp_path):
    replica, st = state()
    gradient = WorkOrder("run", 0, 0, batch(8), DENSE_CODEC, replica.fingerprint())
    local = dataclasses.replace(gradient, batch=batch(8, seed=1), local_steps=_sgd(2))
    single = WorkerEngine("cpu")  # one worker, the whole batch at once
    single.push_state(st)
    expected = [contribution(replica, single.run_round(o)) for o in (gradient, dataclasses.replace(local, round=1))]
    with node(tmp_path, "--node-mode", "ddp") as (address, _), WorkerClient(address, timeout=TIMEOUT) as client:
        client.push_state(st)
        # A rank's 4 rows of the gradient batch in micro-batches of 3 + 1 (the first under ``no_sync``), then
        # of 1 each; its 2 rows of an inner step whole, then 1 + 1.
        for i, micro in enumerate((3, 1)):
            for j, (order, want) in enumerate(zip((gradient, local), expected)):
                result, _ = client.run_round(dataclasses.replace(order, round=2 + 2 * i + j, micro_batch_size=micro))
                assert_close(contribution(replica, result), want)
                # DDP all-reduced once per backward that ends a batch, not once per micro-batch
                assert result.node_bytes == (1 if order is gradient else 2) * 4 * sum(replica.numels), micro
    assert all(_norm(c) > 1e-2 for c in expected)  # far above the tolerance


def test_the_fp16_hook_trains_and_puts_half_the_bytes_of_none_on_the_bus(tmp_path):
    replica, st = state()
    gradient = WorkOrder("run", 0, 0, batch(4), DENSE_CODEC, replica.fingerprint())
    local = dataclasses.replace(gradient, round=1, batch=batch(16, seed=1), local_steps=_sgd(4, lr=0.2))
    results: dict[str, list[RoundResult]] = {}
    with nodes(tmp_path, Node(("--node-comm-hook", "fp16")), Node(("--node-comm-hook", "none"))) as started:
        for hook, (address, _) in zip(("fp16", "none"), started):
            with WorkerClient(address, timeout=TIMEOUT) as client:
                client.push_state(st)
                results[hook] = [client.run_round(order)[0] for order in (gradient, local)]
    for half, full in zip(results["fp16"], results["none"]):
        assert 2 * half.node_bytes == full.node_bytes > 0
    (g16, l16), (g32, l32) = ([contribution(replica, r) for r in results[h]] for h in ("fp16", "none"))
    # The gradient travelled in float16: not float32's bits, but within float16's precision of them.
    error = _norm({n: g16[n] - g32[n] for n in g32}) / _norm(g32)
    assert 0 < error < 1e-3, error
    # Four inner steps through it: about none's pseudo-gradient, and it lowers the loss on the rows trained on.
    assert _norm({n: l16[n] - l32[n] for n in l32}) / _norm(l32) < 2e-3
    start, trained = build_from_spec(SPEC, seed=0), build_from_spec(SPEC, seed=0)
    with torch.no_grad():
        for (n, p), q in zip(trained.named_parameters(), start.parameters()):
            p.copy_(q - l16[n])
        rows = torch.from_numpy(local.batch.astype(np.int64))
        assert float(lm_loss(trained, rows)) < float(lm_loss(start, rows)) - 0.05


def _node_by_hand(rows: np.ndarray, steps: LocalSteps, sync: int) -> dict[str, torch.Tensor]:
    """The model a 2-rank local-sgd node trains: each rank takes plain SGD steps on its half of each step's
    rows (``Placement.share``), and the ranks average their models every ``sync`` steps and at the end."""
    ranks = [build_from_spec(SPEC, seed=0) for _ in range(2)]
    per_step = rows.shape[0] // steps.steps
    for h, lr in enumerate(steps.learning_rates):
        step_rows = rows[h * per_step : (h + 1) * per_step]
        for r, model in enumerate(ranks):
            share = step_rows[r * per_step // 2 : (r + 1) * per_step // 2]
            model.zero_grad()
            lm_loss(model, torch.from_numpy(share.astype(np.int64))).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-lr)
        if (sync and (h + 1) % sync == 0) or h + 1 == steps.steps:
            with torch.no_grad():
                for a, b in zip(ranks[0].parameters(), ranks[1].parameters()):
                    a.copy_((a + b) / 2)
                    b.copy_(a)
    return {n: p.detach() for n, p in ranks[0].named_parameters()}


def test_node_sync_steps_3_averages_the_ranks_models_every_3_inner_steps(tmp_path):
    replica, st = state()
    steps = _sgd(6)
    order = WorkOrder("run", 0, 0, batch(4 * 6), DENSE_CODEC, replica.fingerprint(), local_steps=steps)
    with (
        node(tmp_path, "--node-mode", "local-sgd", "--node-sync-steps", "3") as (address, _),
        WorkerClient(address, timeout=TIMEOUT) as client,
    ):
        client.push_state(st)
        result, _ = client.run_round(order)
    got = contribution(replica, result)
    start = {n: p.detach() for n, p in replica.params.items()}

    def delta(sync: int) -> dict[str, torch.Tensor]:
        return {n: start[n] - p for n, p in _node_by_hand(order.batch, steps, sync).items()}

    assert_close(got, delta(3))
    # Averaged after steps 3 and 6 only: two averages of the model on the bus, and not what averaging after
    # every step (the ranks never apart) or only at the end (apart for all 6 steps) would have sent.
    assert result.node_bytes == 2 * 4 * sum(replica.numels)
    for other in (delta(1), delta(0)):
        assert _norm({n: got[n] - other[n] for n in got}) > 100 * 1e-5
