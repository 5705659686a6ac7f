"""The compute stage of a round: what a worker contributes, as tensors for the codec. No networking here.

Two strategies, picked by the work order (``strategy_for``):

* ``GradientStep`` (gradient mode): the mean gradient of the batch, computed on the replica itself (only
  its ``.grad`` changes, never its parameters).
* ``LocalSteps`` (local-SGD rounds, DiLoCo / SparseLoCo): the working model is reloaded from the replica,
  takes H inner optimizer steps on H consecutive slices of the batch, and the contribution is the
  pseudo-gradient ``replica - working``: the direction an outer SGD step with learning rate 1 would move
  the replica to land on this worker's model. With streamed fragments (Streaming DiLoCo) the working model
  carries on from round to round, only what the replica's updates moved is reloaded, and the contribution
  is one fragment's ``replica - working``: each fragment's tensors have trained for F rounds since its
  last sync. In eager overlapped rounds the working model starts from the worker's guess at the update in
  flight (``eager_start``), and the contribution is ``start - working``.

Either one hands the engine a ``Contribution``; error feedback and encoding come after, the same for both.

Where the work runs is a ``Placement`` (``worker.placement``): one device, or the ranks of a node. On a node
each rank takes its share of every inner step's rows; in ``ddp`` mode the model is wrapped in
DistributedDataParallel, so every backward all-reduces the gradients over the fast bus (through the
node's communication hook) and every rank holds the node's mean gradient; in ``local-sgd`` mode the ranks
step independently and average their parameters every ``sync_steps`` inner steps and at the end of the
round. Either way every rank ends the round with the same contribution, and rank 0 encodes it. In
``fsdp`` mode each rank holds rows of every tensor (``worker.fsdp``), in ``pipeline`` mode a stage of the
model that every row passes through (``worker.pipeline``): each rank's contribution is its part, and
each encodes the tensors it owns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from gradwire.compression import robust
from gradwire.errors import Cancelled
from gradwire.models import lm_loss
from gradwire.optim.outer import outer_step
from gradwire.protocol import LocalSteps, WorkOrder
from gradwire.replica import Fingerprint
from gradwire.worker.lazy import is_instance
from gradwire.worker.nodeconf import NODE_MODES, PRECISIONS
from gradwire.worker.placement import IsCancelled, Placement, model_device
from gradwire.worker.session import Session

__all__ = ["NODE_MODES", "PRECISIONS", "Contribution", "Placement", "gradient_step", "local_steps", "model_device"]


@dataclasses.dataclass
class Contribution:
    tensors: Mapping[str, torch.Tensor]  # by parameter name: a gradient or a pseudo-gradient
    loss: float  # mean over every row trained on
    tokens: int  # tokens trained on (every inner step's)
    # the gradient's global L2 norm before clipping; local-SGD rounds: its mean over the inner steps
    grad_norm: float = 0.0
    fingerprint: Fingerprint | None = None  # the round's first gradient's, if the order asked (spot checks)


class ComputeStrategy(Protocol):
    def __call__(
        self, session: Session, order: WorkOrder, tokens: torch.Tensor, cancelled: IsCancelled, placement: Placement
    ) -> Contribution: ...


def accumulate_gradient(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    micro_batch_size: int,
    cancelled: IsCancelled,
    what: str,
    precision: str = "fp32",
    last_backward: contextlib.AbstractContextManager | None = None,
) -> torch.Tensor | float:
    """Mean loss over ``tokens`` (rows, T + 1) with its gradient in ``.grad``, by micro-batches if asked: a 0-d
    tensor on the device, which nothing waits for until a caller reads it (once a round, not once a step:
    each read makes the host wait for the device, and the device then waits for the host's next launches).

    Every parameter ends with a gradient (zeros where the loss does not reach), so the codec sees them all.
    A DDP-wrapped model all-reduces once, on the last micro-batch (``no_sync`` before it). The last
    micro-batch's backward, which leaves the final gradients, runs inside ``last_backward`` (a streamed
    round's hooks, ``worker.streaming``).
    """
    if is_instance(model, "gradwire.worker.pipeline", "PipelineRunner"):  # its own micro-batches, through its stages
        if cancelled():
            raise Cancelled(f"{what} cancelled")
        return model.loss_and_backward(tokens, precision)
    rows = tokens.shape[0]
    step = micro_batch_size or rows
    for p in model.parameters():
        p.grad = None
    total: torch.Tensor | float = 0.0
    device_type = tokens.device.type
    for start in range(0, rows, step):
        if cancelled():
            raise Cancelled(f"{what} cancelled")
        micro = tokens[start : start + step]
        last = start + step >= rows
        quiet = model.no_sync() if isinstance(model, DistributedDataParallel) and not last else contextlib.nullcontext()
        with quiet:
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = lm_loss(model, micro)
            # Weight each micro-batch by its share of rows: the sum is the full batch's mean loss.
            with last_backward if last and last_backward is not None else contextlib.nullcontext():
                (loss * (micro.shape[0] / rows)).backward()
        total = total + loss.detach() * micro.shape[0]
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return total / rows


def gradient_step(
    session: Session,
    order: WorkOrder,
    tokens: torch.Tensor,
    cancelled: IsCancelled,
    placement: Placement | None = None,
    last_backward: contextlib.AbstractContextManager | None = None,
) -> Contribution:
    """Gradient mode: the batch's mean gradient at the replica's parameters, clipped to the order's
    ``clip_grad_norm`` (on every rank of a node alike: after the all-reduce or the average). The final
    backward runs inside ``last_backward`` (``accumulate_gradient``)."""
    placement = placement or Placement()
    session.replica.model.train()
    model = placement.wrap(session, session.replica.model)
    loss = accumulate_gradient(
        model,
        placement.share(tokens),
        order.micro_batch_size,
        placement.cancellable(cancelled),
        f"round {order.round}",
        placement.precision,
        last_backward,
    )
    grads = {n: p.grad for n, p in session.replica.params.items()}
    if placement.apart:
        placement.node.average(grads.values())  # local-sgd among the ranks: one step is one gradient average
    fingerprint = session.replica.fingerprint_of(grads) if order.fingerprint_gradient else None
    # The norm before clipping; with max_norm inf it only measures.
    norm = placement.clip_grad_norm(session, session.replica.params, order.clip_grad_norm or math.inf)
    tokens_in = tokens.shape[0] * (tokens.shape[1] - 1)
    return Contribution(grads, placement.mean(float(loss)), tokens_in, float(norm), fingerprint)


def local_steps(
    session: Session, order: WorkOrder, tokens: torch.Tensor, cancelled: IsCancelled, placement: Placement | None = None
) -> Contribution:
    """A local-SGD round: H inner steps on the working copy, then ``replica - working``."""
    placement = placement or Placement()
    plan = order.local_steps
    assert plan is not None
    working = session.working_model(carry_on=plan.fragment is not None)
    start = eager_start(session, plan, order.round, placement)
    if start is not None:
        with torch.no_grad():
            for w, s in zip(working.parameters(), start.values()):
                w.copy_(s)
    trained = inner_steps(session, working, order, tokens, cancelled, placement)
    sent = set(session.replica.fragment_names(plan.fragment)) if plan.fragment is not None else None
    with torch.no_grad():
        delta = {
            n: p - w
            for (n, p), w in zip((start or session.replica.params).items(), working.parameters())
            if sent is None or n in sent
        }
    tokens_in = tokens.shape[0] * (tokens.shape[1] - 1)
    return Contribution(delta, trained.loss, tokens_in, trained.grad_norm, trained.fingerprint)


class InnerSteps(NamedTuple):
    """What a round's inner steps leave besides the trained model."""

    loss: float  # mean over the inner steps (and a node's ranks)
    grad_norm: float  # mean over the inner steps of the gradient's global L2 norm before clipping
    fingerprint: Fingerprint | None  # the first step's gradient's, if the order asked


def inner_steps(
    session: Session,
    working: torch.nn.Module,
    order: WorkOrder,
    tokens: torch.Tensor,
    cancelled: IsCancelled,
    placement: Placement,
) -> InnerSteps:
    """The order's H inner steps of the session's inner optimizer on ``working``, in place, each one's
    gradient clipped to the plan's ``clip_grad_norm`` (0: not clipped, only measured)."""
    plan = order.local_steps
    assert plan is not None
    model = placement.wrap(session, working)
    optimizer = session.inner_optimizer(plan.optimizer)
    cancelled = placement.cancellable(cancelled)
    rows = tokens.shape[0] // plan.steps  # the protocol checked that the batch splits evenly
    loss_sum: torch.Tensor | float = 0.0  # summed on the device, read once after the last step
    norm_sum: torch.Tensor | float = 0.0
    drifted = False  # local-sgd ranks step apart until they average; DDP ranks step alike
    fingerprint = None
    for h, lr in enumerate(plan.learning_rates):
        batch = placement.share(tokens[h * rows : (h + 1) * rows])  # (rows / ranks, T + 1): step h, this rank
        loss_sum = loss_sum + accumulate_gradient(
            model, batch, order.micro_batch_size, cancelled, f"round {order.round}, inner step {h}", placement.precision
        )
        if h == 0 and order.fingerprint_gradient:
            fingerprint = _first_gradient_fingerprint(session, working, placement)
        # The norm before clipping, as gradient rounds report theirs; with max_norm inf it only measures.
        norm_sum = norm_sum + placement.clip_grad_norm(
            session, dict(working.named_parameters()), plan.clip_grad_norm or math.inf
        )
        placement.step(optimizer, lr)
        optimizer.zero_grad()
        if placement.apart:
            drifted = True
            if placement.sync_steps and (h + 1) % placement.sync_steps == 0:
                placement.node.average(working.parameters())
                drifted = False
    if drifted:
        placement.node.average(working.parameters())  # the node returns one model: its ranks' average
    norm = float(norm_sum) / plan.steps
    if placement.apart:  # each rank measured its own gradients: the node's is their mean, as its loss is
        norm = placement.mean(norm)
    return InnerSteps(placement.mean(float(loss_sum) / plan.steps), norm, fingerprint)


def eager_start(
    session: Session, plan: LocalSteps, round_: int, placement: Placement
) -> dict[str, torch.Tensor] | None:
    """Eager overlapped rounds (``LocalSteps.eager_lr``): where the update in flight would move the replica
    if it were this worker's own last payload alone - the run's outer step at that learning rate, on copies
    of the replica's parameters and momentum. ``None``: start from the replica (no ``eager_lr``; no payload
    sent the round before; a node of several ranks, whose other ranks hold none; an outer rule that is not
    replayed)."""
    sent, replica = session.last_sent, session.replica
    if not plan.eager_lr or sent is None or sent[0] != round_ - 1 or placement.ranks > 1:
        return None
    if not replica.rule.replayable or plan.fragment is not None:
        return None
    # The mean of one sender: its own step. Decoded once: while the result travelled (``sent_decoded``, which
    # the next round's replay uses too), unless that is gone or failed.
    decoded = session.sent_decoded
    sender = decoded.result() if decoded is not None and decoded.exception() is None else sent[1]
    own = robust.aggregate(replica.codec(sent[1].settings), [sender], (1.0,)).result()
    params = [p.detach().clone() for p in replica.params.values()]
    momentum = [m.clone() for m in replica.momentum]
    steps, scales = [own[n] for n in replica.params], replica.lr_scales(replica.params)
    outer_step(params, steps, replica.rule, plan.eager_lr, momentum, scales)
    return dict(zip(replica.params, params))


def _first_gradient_fingerprint(session: Session, working: torch.nn.Module, placement: Placement) -> Fingerprint:
    """The fingerprint of a local-SGD round's first inner step's gradient (the working copy is the replica
    then): the node's, so ranks that step apart average a copy of theirs first (one extra all-reduce, in the
    rounds spot checks ask for it)."""
    grads = {n: w.grad for n, w in zip(session.replica.params, working.parameters())}
    if placement.apart:
        grads = {n: g.clone() for n, g in grads.items()}
        placement.node.average(grads.values())
    return session.replica.fingerprint_of(grads)


def strategy_for(order: WorkOrder) -> ComputeStrategy:
    return local_steps if order.local_steps is not None else gradient_step
