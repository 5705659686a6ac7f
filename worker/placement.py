"""Where a round's compute runs: one device, or the ranks of a node (``worker.node``), and how they share it.

``Placement`` says the node's mode (``ddp``, ``local-sgd``, ``fsdp``, ``pipeline``, or ``auto``: picked per
run by the model's size, ``worker.sizing.choose_node_mode``), what an ``fsdp`` node shards (``shard``: ZeRO
stage 1, 2 or 3), how a step's rows split over the ranks, and wraps a model for the mode (DDP with the
node's communication hook; a pipeline stage in its schedule, ``worker.pipeline``; a sharded model is its
own data-parallel wrapper).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from gradwire.protocol import ProtocolError, WorkOrder
from gradwire.worker import hooks
from gradwire.worker.node import NodeGroup
from gradwire.worker.nodeconf import check_placement

if TYPE_CHECKING:
    from gradwire.optim.inner import InnerOptimizer
    from gradwire.worker.session import Session


IsCancelled = Callable[[], bool]


@dataclasses.dataclass
class Placement:
    """Where a round's compute runs: one device (``node`` None) or every rank of a node."""

    node: NodeGroup | None = None
    # among a node's ranks: "ddp", "local-sgd" or "fsdp" (state sharded as `shard` says); "auto" picks ddp
    # or fsdp for each run by its model's size (worker.sizing.choose_node_mode); "pipeline": one stage of the
    # model per rank (worker.pipeline)
    mode: str = "ddp"
    sync_steps: int = 0  # local-sgd: average parameters every S inner steps (0: at the end of the round only)
    comm_hook: str = "none"  # ddp: see worker.hooks
    precision: str = "fp32"  # "bf16": autocast forward/backward; weights, replica and codec stay float32
    bus: hooks.HookStats = dataclasses.field(default_factory=hooks.HookStats)
    microbatches: int = 0  # pipeline: micro-batches a step's rows split into (0: one per rank)
    schedule: str = "1f1b"  # pipeline: one of PIPELINE_SCHEDULES
    # fsdp (and auto, where it picks fsdp): what the ranks shard, one of NODE_SHARDS. "full" (ZeRO-3): the
    # parameters, gradients and inner optimizer state (FSDP2, regathering a block's parameters for its
    # backward); "gradients" (ZeRO-2): the same, but a block's parameters stay gathered from its forward
    # to its backward; "optimizer" (ZeRO-1): only the inner optimizer's state, the ranks otherwise computing
    # as a ddp node does (torch's ZeroRedundancyOptimizer)
    shard: str = "full"

    def __post_init__(self) -> None:
        check_placement(
            self.mode,
            self.shard,
            self.sync_steps,
            self.comm_hook,
            self.precision,
            self.microbatches,
            self.schedule,
        )
        if self.precision == "auto":  # the CLI resolves it for its device before building a Placement
            raise ValueError("a Placement computes in fp32 or bf16: resolve --precision auto first (resolve_precision)")

    @property
    def ranks(self) -> int:
        return self.node.world_size if self.node is not None else 1

    @property
    def ddp(self) -> bool:
        """A node whose ranks each hold the whole model and compute through DDP (``ddp`` mode, and ``fsdp``
        mode's ZeRO-1, which shards only the inner optimizer's state)."""
        return self.node is not None and (self.mode == "ddp" or self.partitioned_optimizer)

    @property
    def sharded(self) -> bool:
        """A node whose ranks each hold a shard of the model (FSDP2; ZeRO-2 or 3): they compute as one
        data-parallel model, and each encodes the tensors it owns (``compression.shard``)."""
        return self.node is not None and self.mode == "fsdp" and self.shard != "optimizer"

    @property
    def reshard_after_forward(self) -> bool:
        """A sharded node: whether FSDP2 frees a block's gathered parameters after its forward and gathers
        them again for its backward (ZeRO-3), or keeps them until then (ZeRO-2)."""
        return self.shard != "gradients"

    @property
    def partitioned_optimizer(self) -> bool:
        """ZeRO-1: a node whose ranks compute as a DDP node does, but each keeps the inner optimizer state of
        its own partition of the parameters (``optim.inner.InnerOptimizer``'s ``partitioned``)."""
        return self.node is not None and self.mode == "fsdp" and self.shard == "optimizer"

    @property
    def own_inner_state(self) -> bool:
        """A node whose ranks each hold an inner optimizer state of their own, which every checkpoint keeps
        under their rank (``node.merge_rank_states``): local-sgd ranks step apart, ZeRO-1 ranks each hold
        their partition's. (A split node's ranks hold theirs too, kept by shard: ``node.merge_shard_states``.)"""
        return self.apart or self.partitioned_optimizer

    @property
    def pipelined(self) -> bool:
        """A node whose ranks each hold a stage of the model (``worker.pipeline``): every rank sees every
        row, and each encodes its stage's tensors."""
        return self.node is not None and self.mode == "pipeline"

    @property
    def torch_parallel(self) -> bool:
        """A node that computes through torch's sharding or pipelining stacks (FSDP2, ZeRO, a pipeline): its
        ranks load them (``worker.lazy``)."""
        return self.node is not None and self.mode in ("fsdp", "pipeline")

    @property
    def split(self) -> bool:
        """A node whose ranks each hold part of the model (sharded or pipelined): each encodes its own
        tensors with its own error feedback, and checkpoints its own part."""
        return self.sharded or self.pipelined

    @property
    def pipeline_microbatches(self) -> int:
        return self.microbatches or self.ranks

    @property
    def apart(self) -> bool:
        """A node whose ranks step apart between parameter averages (local-sgd)."""
        return self.node is not None and self.mode == "local-sgd"

    def check_rows(self, order: WorkOrder) -> None:
        """Every inner step's rows must split evenly over the ranks (the coordinator sends ranks x batch)."""
        rows = order.batch.shape[0] // order.inner_steps
        if self.pipelined:
            if rows % self.pipeline_microbatches:
                raise ProtocolError(
                    f"token batch of {rows} rows per step does not split into this node's "
                    f"{self.pipeline_microbatches} pipeline micro-batches"
                )
            return
        if rows % self.ranks:
            raise ProtocolError(
                f"token batch of {rows} rows per step does not split over this node's {self.ranks} ranks"
            )

    def share(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows of one step's batch: consecutive equal slices, rank 0 first (a pipeline's stages
        each see all of them)."""
        if self.node is None or self.pipelined:
            return rows
        n = rows.shape[0] // self.ranks
        return rows[self.node.rank * n : (self.node.rank + 1) * n]

    def wrap(self, session: Session, model: torch.nn.Module) -> torch.nn.Module:
        """The module to run forward/backward through: DDP over the node in ``ddp`` mode, the stage's
        ``pipeline.PipelineRunner`` in ``pipeline`` mode (each built once per session and model, on every
        rank at the same round), else the model itself."""
        if not (self.ddp or self.pipelined):  # a sharded model is its own data-parallel wrapper
            return model
        wrapped = session.wrappers.get(id(model))
        if wrapped is None and self.pipelined:
            from gradwire.worker import pipeline  # loaded as the node started (worker.lazy)

            stage = session.stage
            wrapped = pipeline.PipelineRunner(
                model, stage, self.pipeline_microbatches, self.schedule, session.tied_group
            )
            session.wrappers[id(model)] = wrapped
        elif wrapped is None:
            device_ids = [model_device(model)] if model_device(model).type == "cuda" else None
            # Rotary tables and the like are buffers every rank computes alike: nothing to sync per forward.
            buckets = hooks.ddp_options(self.comm_hook, self.node.backend, model)
            wrapped = DistributedDataParallel(model, device_ids=device_ids, **_NO_BUFFER_SYNC, **buckets)
            hooks.register(wrapped, self.comm_hook, self.bus)
            session.wrappers[id(model)] = wrapped
        return wrapped

    def clip_grad_norm(
        self, session: Session, params: Mapping[str, torch.Tensor], max_norm: float
    ) -> torch.Tensor | float:
        """Clip the gradients of ``params`` (the model's, or on a pipelined node the stage's) to a global
        norm of ``max_norm`` (``inf``: only measure); the norm before clipping, as a 0-d tensor on the device
        that nothing waits for until it is read (a pipelined node's: a number, agreed over its stages)."""
        if self.pipelined:
            from gradwire.worker import pipeline

            return pipeline.clip_grad_norm_(params, session.replica.owned, max_norm)
        return torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)

    def step(self, optimizer: InnerOptimizer, lr: float) -> None:
        """One inner optimizer step. ZeRO-1: each rank steps its partition and broadcasts it to the others
        (inside torch's ``ZeroRedundancyOptimizer``): counted as the bus bytes it issues (``worker.bus``)."""
        if not self.partitioned_optimizer:
            optimizer.step(lr)
            return
        from gradwire.worker import bus  # loaded as the node started, outside any round (worker.lazy)

        with bus.CollectiveBytes() as issued:
            optimizer.step(lr)
        self.bus.bytes += issued.bytes
        self.bus.calls += issued.calls

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
