"""A worker node of several ranks: one process per GPU on a box, joined by torch.distributed.

Only rank 0 talks to the coordinator. Whatever reaches it - a work order; a state push, a tensor at a time
as it streams in (``gradwire.statestream``) - is broadcast to every rank as the same protobuf bytes the wire
carried (never a pickle), and every rank runs the same engine code on it: each replays updates on its own
replica and checks its own fingerprint, so all ranks stay bit-identical, and the collectives inside a round
(DDP's gradient all-reduce, local-SGD's parameter average) meet because every rank makes the same calls in
the same order.

``NodeGroup`` is that fast-bus side: the process group (gloo on CPU, NCCL on CUDA), the command channel
and the few collectives the engine needs. Rank environment follows torchrun's conventions: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

from __future__ import annotations

import datetime
import enum
import logging
import re
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from gradwire.worker.nodeconf import RankInfo

log = logging.getLogger(__name__)


class Command(enum.IntEnum):
    """What rank 0 asks of every rank; the payload is the serialized proto message."""

    # A state push (pushes may overlap; each of these payloads starts with the push's 8-byte number):
    PUSH_BEGIN = 1  # a push starts: its header (a ModelState without tensors, ``statestream``)
    RUN_ROUND = 2  # a WorkOrder
    STOP = 3  # no payload: leave the loop, the node is shutting down
    HEARTBEAT = 4  # no payload: rank 0 is alive and idle (keeps the bounded command channel busy)
    FETCH_STATE = 5  # a run id: every rank hands rank 0 its own inner optimizer state (``gather_bytes``)
    PUSH_TENSOR = 6  # the next tensor of the state being pushed (a ModelState holding only it)
    PUSH_END = 7  # the push is complete; every rank says whether it took it (``all_true``)
    PUSH_ABORT = 8  # the push failed on rank 0 (a bad tensor, a broken stream); drop it


class NodeGroup:
    """The node's process group and the collectives a round needs. Every rank calls every method alike."""

    def __init__(self, info: RankInfo, device: torch.device, *, timeout: float = 600.0) -> None:
        self.info = info
        self.device = device
        self.timeout = timeout
        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            # The timeout bounds every collective of a round: a rank that died or hangs fails the others'
            # calls instead of holding them forever.
            dist.init_process_group(
                backend, rank=info.rank, world_size=info.world_size, timeout=datetime.timedelta(seconds=timeout)
            )
        self.backend = backend
        # Small CPU collectives of a round (verdicts, losses) on gloo, with the same timeout.
        self._control = (
            dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
            if backend != "gloo"
            else dist.group.WORLD
        )
        # Commands, bounded by the same timeout: rank 0 sends a heartbeat when the node is idle.
        self._commands = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self.bytes_sent = 0  # by this rank's parameter averages (DDP's gradient traffic: worker.hooks)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    # ------------------------------------------------------------------------------------------ commands

    def send(self, command: Command, payload: bytes = b"") -> None:
        """Rank 0: hand every other rank a command (they are waiting in ``receive``)."""
        assert self.info.leader, "only rank 0 sends commands"
        header = torch.tensor([int(command), len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._commands)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self._commands)

    def receive(self) -> tuple[Command, bytes]:
        """Ranks > 0: wait for rank 0's next command."""
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._commands)
        command, size = Command(int(header[0])), int(header[1])
        if not size:
            return command, b""
        data = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self._commands)
        return command, data.numpy().tobytes()

    # ------------------------------------------------------------------------------------------ collectives

    def all_true(self, flag: bool) -> bool:
        """True only if ``flag`` is true on every rank (e.g. every replica passed its check)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control)
        return bool(t.item())

    def mean(self, value: float) -> float:
        """The mean of a number over the ranks (the node's loss)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self._control)
        return float(t.item()) / self.world_size

    @torch.no_grad()
    def average(self, tensors: Iterable[torch.Tensor]) -> None:
        """Replace each tensor by its mean over the ranks, in place (local-SGD's parameter average)."""
        for t in tensors:
            dist.all_reduce(t.data)
            t.data.div_(self.world_size)
            self.bytes_sent += t.numel() * t.element_size()

    def broadcast_bytes(self, data: bytes = b"") -> bytes:
        """Rank 0's ``data`` on every rank (the others pass nothing): bytes the engine serialized as protobuf,
        never pickles. On the command channel, inside a call every rank is making (not a command)."""
        size = torch.tensor([len(data) if self.info.leader else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._commands)
        n = int(size.item())
        if not n:
            return b""
        if self.info.leader:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self._commands)
        return data if self.info.leader else buffer.numpy().tobytes()

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on rank 0 (``[]`` elsewhere): bytes the engine serialized
        as protobuf, never pickles. On the command channel, so it needs no device memory."""
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self._commands)
        longest = max(1, *(int(n.item()) for n in sizes))  # gloo gathers no empty tensors
        padded = torch.zeros(longest, dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)] if self.info.leader else None
        dist.gather(padded, parts, dst=0, group=self._commands)
        if parts is None:
            return []
        return [part[: int(n.item())].numpy().tobytes() for part, n in zip(parts, sizes)]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# A node whose ranks step apart (local-sgd), or each keep their partition's (ZeRO-1), has an inner optimizer
# state per rank: rank 0's keeps its own names, rank r's travels (and is checkpointed) as "rank{r}.<name>".
RANK_PREFIX = "rank{}."


def merge_rank_states(states: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One named-tensor dict holding every rank's state (``states[r]`` is rank r's)."""
    merged = dict(states[0]) if states else {}
    for rank, state in enumerate(states[1:], 1):
        merged.update({RANK_PREFIX.format(rank) + name: t for name, t in state.items()})
    return merged


def rank_state(merged: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of ``merge_rank_states``' dict: its own where saved; each parameter it has none
    for, from the lowest rank that saved one (a state saved by a single worker, a DDP node or a node of
    fewer ranks: rank 0's; by a ZeRO-1 node, whose ranks each saved their own partition: the whole state)."""
    pick = RankPick(rank)
    for name, t in merged.items():
        pick.add(name, t)
    return pick.kept


class RankPick:
    """``rank_state`` a tensor at a time, as a pushed state streams in: keeps, per parameter, the entries of
    the best rank seen so far (``rank`` itself, else the lowest), dropping a worse rank's once a better
    one's arrive."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.kept: dict[str, torch.Tensor] = {}
        self._best: dict[str, int] = {}  # parameter -> the preference of the rank whose entries are kept
        self._keys: dict[str, list[str]] = {}  # parameter -> its kept entries' names

    def add(self, name: str, t: torch.Tensor) -> None:
        if _SHARD_KEY.match(name):
            return
        r = _rank_of(name)
        key = name.removeprefix(RANK_PREFIX.format(r)) if r else name
        param, preference = _parameter(key), -1 if r == self.rank else r
        best = self._best.get(param)
        if best is not None and preference > best:
            return
        if best is not None and preference < best:
            for old in self._keys.pop(param):
                del self.kept[old]
        self._best[param] = preference
        self._keys.setdefault(param, []).append(key)
        self.kept[key] = t


def _parameter(name: str) -> str:
    return name.rpartition("/")[0]  # "<parameter name>/<state key>"


_SHARD_KEY = re.compile(r"(fsdp|pipeline)\d+\.\d+\.")


def _rank_of(name: str) -> int:
    head, dot, _ = name.partition(".")
    return int(head[4:]) if dot and head.startswith("rank") and head[4:].isdigit() else 0


# A split node's ranks each keep the error feedback of their own tensors and the inner state of their own
# part (a sharded node: rows of every tensor; a pipelined one: its stage's tensors): every rank's travels
# (and is checkpointed) as "<mode><world>.<rank>.<name>", and only a node of the same mode and width takes
# it back (another cuts the model elsewhere: its ranks start afresh).
SHARD_PREFIX = "{}{}.{}."


def merge_shard_states(
    states: list[Mapping[str, torch.Tensor]], world: int, mode: str = "fsdp"
) -> dict[str, torch.Tensor]:
    return {
        SHARD_PREFIX.format(mode, world, rank) + n: t for rank, state in enumerate(states) for n, t in state.items()
    }


def shard_state(
    merged: Mapping[str, torch.Tensor], world: int, rank: int, mode: str = "fsdp"
) -> dict[str, torch.Tensor]:
    prefix = SHARD_PREFIX.format(mode, world, rank)
    return {n.removeprefix(prefix): t for n, t in merged.items() if n.startswith(prefix)}


class Restore:
    """What one rank keeps of a pushed state's error feedback and inner optimizer state, a tensor at a time
    as the state streams in (``add``; then ``feedback`` and ``inner``).

    ``rank`` is ``None`` off a node: everything is kept. A split node's rank (``split``) keeps its own part
    (``shard_state``); the ranks of other nodes keep all of the feedback and their inner state
    (``rank_state``): their own if the ranks step apart (``apart``), else rank 0's.
    """

    def __init__(
        self, rank: int | None = None, world: int = 1, mode: str = "", split: bool = False, apart: bool = False
    ):
        self._prefix = SHARD_PREFIX.format(mode, world, rank) if split else None
        self._pick = RankPick(rank if apart else 0) if rank is not None and not split else None
        self.feedback: dict[str, torch.Tensor] = {}
        self._inner: dict[str, torch.Tensor] = {}

    def add(self, kind: str, name: str, t: torch.Tensor) -> None:
        """``kind``: "feedback" or "inner_optimizer" (ModelState's field)."""
        if self._prefix is not None:
            if not name.startswith(self._prefix):
                return
            name = name.removeprefix(self._prefix)
        if kind == "feedback":
            self.feedback[name] = t
        elif self._pick is not None:
            self._pick.add(name, t)
        else:
            self._inner[name] = t

    @property
    def inner(self) -> dict[str, torch.Tensor]:
        return self._pick.kept if self._pick is not None else self._inner
