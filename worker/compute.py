"""The compute stage of a round: what a worker contributes, as tensors for the codec. No networking here.

Two strategies, picked by the work order (``strategy_for``):

* ``GradientStep`` (gradient mode): the mean gradient of the batch, computed on the replica itself (only
  its ``.grad`` changes, never its parameters).
* ``LocalSteps`` (local-SGD rounds, DiLoCo / SparseLoCo): the working model is reloaded from the replica,
  takes H inner optimizer steps on H consecutive slices of the batch, and the contribution is the
  pseudo-gradient ``replica - working``: the direction an outer SGD step with learning rate 1 would move
  the replica to land on this worker's model.

Either one hands the engine a ``Contribution``; error feedback and encoding come after, the same for both.

Where the work runs is a ``Placement``: one device, or the ranks of a node (``worker.node``). On a node
each rank takes its share of every inner step's rows; in ``ddp`` mode the model is wrapped in
DistributedDataParallel, so every backward all-reduces the gradients over the fast bus (through the
node's communication hook) and every rank holds the node's mean gradient; in ``local-sgd`` mode the ranks
step independently and average their parameters every ``sync_steps`` inner steps and at the end of the
round. Either way every rank ends the round with the same contribution, and rank 0 encodes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from gradwire.errors import Cancelled
from gradwire.models import lm_loss
from gradwire.protocol import ProtocolError, WorkOrder
from gradwire.worker import hooks
from gradwire.worker.node import NodeGroup
from gradwire.worker.session import Session

NODE_MODES = ("ddp", "local-sgd", "fsdp")
PRECISIONS = ("fp32", "bf16")

IsCancelled = Callable[[], bool]


@dataclasses.dataclass
class Contribution:
    tensors: Mapping[str, torch.Tensor]  # by parameter name: a gradient or a pseudo-gradient
    loss: float  # mean over every row trained on
    tokens: int  # tokens trained on (every inner step's)
    grad_norm: float = 0.0  # gradient mode: the gradient's global L2 norm before clipping


@dataclasses.dataclass
class Placement:
    """Where a round's compute runs: one device (``node`` None) or every rank of a node."""

    node: NodeGroup | None = None
    mode: str = "ddp"  # among a node's ranks: "ddp", "local-sgd" or "fsdp" (parameters sharded: worker.fsdp)
    sync_steps: int = 0  # local-sgd: average parameters every S inner steps (0: at the end of the round only)
    comm_hook: str = "none"  # ddp: see worker.hooks
    precision: str = "fp32"  # "bf16": autocast forward/backward; weights, replica and codec stay float32
    bus: hooks.HookStats = dataclasses.field(default_factory=hooks.HookStats)

    def __post_init__(self) -> None:
        if self.mode not in NODE_MODES:
            raise ValueError(f"--node-mode must be one of {', '.join(NODE_MODES)}, got {self.mode!r}")
        if self.sync_steps < 0:
            raise ValueError(f"--node-sync-steps must be >= 0, got {self.sync_steps}")
        if self.comm_hook not in hooks.COMM_HOOKS:
            raise ValueError(f"--node-comm-hook must be one of {', '.join(hooks.COMM_HOOKS)}, got {self.comm_hook!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

    @property
    def ranks(self) -> int:
        return self.node.world_size if self.node is not None else 1

    @property
    def ddp(self) -> bool:
        return self.node is not None and self.mode == "ddp"

    @property
    def sharded(self) -> bool:
        """A node whose ranks each hold a shard of the model (FSDP2): they compute as one data-parallel
        model, and each encodes the tensors it owns (``compression.shard``)."""
        return self.node is not None and self.mode == "fsdp"

    @property
    def apart(self) -> bool:
        """A node whose ranks step apart between parameter averages (local-sgd)."""
        return self.node is not None and self.mode == "local-sgd"

    def check_rows(self, order: WorkOrder) -> None:
        """Every inner step's rows must split evenly over the ranks (the coordinator sends ranks x batch)."""
        rows = order.batch.shape[0] // order.inner_steps
        if rows % self.ranks:
            raise ProtocolError(
                f"token batch of {rows} rows per step does not split over this node's {self.ranks} ranks"
            )

    def share(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows of one step's batch: consecutive equal slices, rank 0 first."""
        if self.node is None:
            return rows
        n = rows.shape[0] // self.ranks
        return rows[self.node.rank * n : (self.node.rank + 1) * n]

    def wrap(self, session: Session, model: torch.nn.Module) -> torch.nn.Module:
        """The module to run forward/backward through: DDP over the node in ``ddp`` mode (built once per
        session and model, on every rank at the same round), else the model itself."""
        if not self.ddp:  # a sharded model is its own data-parallel wrapper
            return model
        wrapped = session.wrappers.get(id(model))
        if wrapped is None:
            device_ids = [model_device(model)] if model_device(model).type == "cuda" else None
            # Rotary tables and the like are buffers every rank computes alike: nothing to sync per forward.
            buckets = hooks.ddp_options(self.comm_hook, self.node.backend, model)
            wrapped = DistributedDataParallel(model, device_ids=device_ids, **_NO_BUFFER_SYNC, **buckets)
            hooks.register(wrapped, self.comm_hook, self.bus)
            session.wrappers[id(model)] = wrapped
        return wrapped

    def mean(self, value: float) -> float:
        return self.node.mean(value) if self.node is not None else value

    def cancellable(self, cancelled: IsCancelled) -> IsCancelled:
        # A rank cannot leave a collective alone: a node finishes the round it started.
        return cancelled if self.node is None else (lambda: False)


# DDP renamed the setting (torch 2.10+); the old name still works there, with a warning.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


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
) -> float:
    """Mean loss over ``tokens`` (rows, T + 1) with its gradient in ``.grad``, by micro-batches if asked.

    Every parameter ends with a gradient (zeros where the loss does not reach), so the codec sees them all.
    A DDP-wrapped model all-reduces once, on the last micro-batch (``no_sync`` before it).
    """
    rows = tokens.shape[0]
    step = micro_batch_size or rows
    for p in model.parameters():
        p.grad = None
    total = 0.0
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
            (loss * (micro.shape[0] / rows)).backward()
        total += loss.item() * micro.shape[0]
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return total / rows


def gradient_step(
    session: Session, order: WorkOrder, tokens: torch.Tensor, cancelled: IsCancelled, placement: Placement | None = None
) -> Contribution:
    """Gradient mode: the batch's mean gradient at the replica's parameters, clipped to the order's
    ``clip_grad_norm`` (on every rank of a node alike: after the all-reduce or the average)."""
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
    )
    grads = {n: p.grad for n, p in session.replica.params.items()}
    if placement.apart:
        placement.node.average(grads.values())  # local-sgd among the ranks: one step is one gradient average
    # clip_grad_norm_ (of the parameters' .grad) returns the norm before clipping; with max_norm inf it only measures.
    norm = torch.nn.utils.clip_grad_norm_(list(session.replica.params.values()), order.clip_grad_norm or math.inf)
    return Contribution(grads, placement.mean(loss), tokens.shape[0] * (tokens.shape[1] - 1), float(norm))


def local_steps(
    session: Session, order: WorkOrder, tokens: torch.Tensor, cancelled: IsCancelled, placement: Placement | None = None
) -> Contribution:
    """A local-SGD round: H inner steps on the working copy, then ``replica - working``."""
    placement = placement or Placement()
    plan = order.local_steps
    assert plan is not None
    working = session.working_model()
    model = placement.wrap(session, working)
    optimizer = session.inner_optimizer(plan.optimizer)
    cancelled = placement.cancellable(cancelled)
    rows = tokens.shape[0] // plan.steps  # the protocol checked that the batch splits evenly
    loss_sum = 0.0
    drifted = False  # local-sgd ranks step apart until they average; DDP ranks step alike
    for h, lr in enumerate(plan.learning_rates):
        batch = placement.share(tokens[h * rows : (h + 1) * rows])  # (rows / ranks, T + 1): step h, this rank
        loss_sum += accumulate_gradient(
            model, batch, order.micro_batch_size, cancelled, f"round {order.round}, inner step {h}", placement.precision
        )
        if plan.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(working.parameters(), plan.clip_grad_norm)
        optimizer.step(lr)
        optimizer.zero_grad()
        if placement.apart:
            drifted = True
            if placement.sync_steps and (h + 1) % placement.sync_steps == 0:
                placement.node.average(working.parameters())
                drifted = False
    if drifted:
        placement.node.average(working.parameters())  # the node returns one model: its ranks' average
    with torch.no_grad():
        delta = {n: p - w for (n, p), w in zip(session.replica.params.items(), working.parameters())}
    return Contribution(delta, placement.mean(loss_sum / plan.steps), tokens.shape[0] * (tokens.shape[1] - 1))


def strategy_for(order: WorkOrder) -> ComputeStrategy:
    return local_steps if order.local_steps is not None else gradient_step
