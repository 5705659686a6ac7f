"""Micro-batch accumulation on one worker (``--micro-batch-size``, and ``--balance`` where a worker's share
exceeds ``--batch-size``): a batch run through in micro-batches gives the whole batch's gradient, and a
local-SGD round's pseudo-gradient, to float tolerance - whether the micro-batches split the rows evenly or
not. (On a node: ``tests/integration/test_node_corners.py``.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.protocol import LocalSteps
from gradwire.worker.compute import Contribution, gradient_step, local_steps
from gradwire.worker.session import Session

from .test_worker_stages import order_for
from .test_worker_stages import session as session  # noqa: F401 - the fixture

ATOL = 1e-6  # float32 sums in another order; the gradients themselves are ~1e-2


def _assert_same(micro: Contribution, whole: Contribution) -> None:
    assert set(micro.tensors) == set(whole.tensors)
    for name, g in whole.tensors.items():
        torch.testing.assert_close(micro.tensors[name], g, atol=ATOL, rtol=0, msg=name)
    assert micro.loss == pytest.approx(whole.loss, abs=1e-6) and micro.tokens == whole.tokens


def _copied(out: Contribution) -> Contribution:
    """``out`` with tensors of its own (a gradient round hands back the replica's ``.grad``, which the next
    round overwrites)."""
    return dataclasses.replace(out, tensors={n: t.detach().clone() for n, t in out.tensors.items()})


@pytest.mark.parametrize("micro", [1, 2, 4])  # of 6 rows: six micro-batches, three, and 4 + 2 rows
def test_micro_batched_gradient_is_the_whole_batchs(session: Session, micro: int) -> None:
    order = order_for(session, rows=6)
    tokens = torch.from_numpy(order.batch.astype(np.int64))
    whole = _copied(gradient_step(session, order, tokens, lambda: False))
    got = gradient_step(session, dataclasses.replace(order, micro_batch_size=micro), tokens, lambda: False)
    _assert_same(got, whole)
    assert got.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    assert any(g.abs().max() > 100 * ATOL for g in whole.tensors.values())  # gradients well above the tolerance


def test_micro_batches_do_not_change_a_local_sgd_rounds_pseudo_gradient(session: Session) -> None:
    # Plain SGD: a gradient's float noise moves the pseudo-gradient by lr times as much (AdamW's first step,
    # g / |g|, would turn noise in a near-zero gradient into a whole step).
    plan = LocalSteps(2, InnerOptimizerConfig(name="sgd"), (0.5, 0.25))
    order = order_for(session, rows=8, plan=plan)  # 4 rows an inner step
    tokens = torch.from_numpy(order.batch.astype(np.int64))
    whole = _copied(local_steps(session, order, tokens, lambda: False))
    got = local_steps(session, dataclasses.replace(order, round=1, micro_batch_size=3), tokens, lambda: False)
    _assert_same(got, whole)
    assert got.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    assert any(d.abs().max() > 100 * ATOL for d in whole.tensors.values())
