"""DDP communication hooks for a node's fast bus, each counting the bytes it puts on the bus.

``--node-comm-hook``:

* ``none``     - a plain all-reduce of every bucket in float32 (DDP's default, counted).
* ``fp16``     - torch's ``fp16_compress_hook``: the bucket travels as float16, half the bytes.
* ``powersgd`` - torch's PowerSGD (rank 4, with its own error feedback): two thin matrices per gradient
                 matrix instead of the matrix, after two warm-up steps of plain all-reduce.
* ``dct``      - the codec's transform on the bus: each bucket cut into 1-D chunks, DCT-II, top-k per chunk
                 with error feedback (DeMo's scheme), the ranks' (index, value) pairs all-gathered, summed
                 and transformed back. Lossy, as the slow link's codec is; its residual stays on the rank.

Bytes are what one rank sends per step (all-reduce: the bucket's bytes; all-gather: its own pairs, a
one-byte index and a float32 value each),
summed in ``HookStats.bytes``; for PowerSGD they are computed from the shapes it sends (its factors P and
Q of each matrix, the vectors whole).
"""

# No ``from __future__ import annotations`` here: DDP checks the hooks' annotations at registration, as
# objects (``bucket: dist.GradBucket``), not strings.
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from gradwire.compression.dct import dct_chunks, idct_chunks
from gradwire.compression.select import topk_indices
from gradwire.worker.nodeconf import COMM_HOOKS

POWERSGD_RANK = 4
DCT_CHUNK = 256  # 1-D chunk length of the bus codec
DCT_TOPK = 16  # coefficients kept per chunk: 1/16 of them, 5 bytes each: ~8% of the fp32 bucket's bytes


@dataclasses.dataclass
class HookStats:
    """What a node's hook has put on the bus, from this rank: bytes and bucket calls."""

    bytes: int = 0
    calls: int = 0


def register(model: DistributedDataParallel, name: str, stats: HookStats) -> None:
    """Install hook ``name`` (one of ``COMM_HOOKS``) on ``model``, counting into ``stats``."""
    if name not in COMM_HOOKS:
        raise ValueError(f"--node-comm-hook must be one of {', '.join(COMM_HOOKS)}, got {name!r}")
    group = dist.group.WORLD
    if name == "none":
        model.register_comm_hook(
            stats, _counting(default_hooks.allreduce_hook, group, lambda b: 4 * b.buffer().numel())
        )
    elif name == "fp16":
        model.register_comm_hook(
            stats, _counting(default_hooks.fp16_compress_hook, group, lambda b: 2 * b.buffer().numel())
        )
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2
        )
        model.register_comm_hook(
            stats, _counting(powerSGD_hook.powerSGD_hook, state, lambda b: _powersgd_bytes(b, state))
        )
    else:
        model.register_comm_hook(DctBus(stats), dct_hook)


def ddp_options(name: str, backend: str, model: torch.nn.Module) -> dict[str, float]:
    """What hook ``name`` needs of the DDP wrapper on ``backend``.

    PowerSGD issues a bucket's second all-reduce from its first one's callback; with several buckets that
    interleaves differently with the next bucket's on each rank, and gloo (unlike NCCL's streams) then pairs
    mismatched messages. On gloo it gets one bucket: nothing to interleave.
    """
    if name == "powersgd" and backend == "gloo":
        return {"bucket_cap_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1}
    return {}


def _counting(hook: Callable, hook_state: object, nbytes: Callable[[dist.GradBucket], int]) -> Callable:
    def counted(stats: HookStats, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        stats.bytes += nbytes(bucket)
        stats.calls += 1
        return hook(hook_state, bucket)

    return counted


def _powersgd_bytes(bucket: dist.GradBucket, state: powerSGD_hook.PowerSGDState) -> int:
    if state.iter < state.start_powerSGD_iter:  # torch's own counter: plain all-reduce while warming up
        return 4 * bucket.buffer().numel()
    total = 0
    for g in bucket.gradients():
        if g.dim() < 2:
            total += 4 * g.numel()
            continue
        n, m = g.shape[0], g.numel() // g.shape[0]
        r = min(n, m, state.matrix_approximation_rank)
        total += 4 * (n + m) * r
    return total


class DctBus:
    """The ``dct`` hook's state: error feedback per bucket, and the byte count."""

    def __init__(self, stats: HookStats) -> None:
        self.stats = stats
        self.feedback: dict[int, torch.Tensor] = {}


def dct_hook(state: DctBus, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Mean of the ranks' buckets through chunked DCT + top-k with error feedback; runs synchronously."""
    buf = bucket.buffer()  # (n,) the flattened gradients of the bucket's parameters
    n = buf.numel()
    chunks = math.ceil(n / DCT_CHUNK)
    m = state.feedback.get(bucket.index())
    padded = torch.zeros(chunks * DCT_CHUNK, dtype=torch.float32, device=buf.device)
    padded[:n] = buf.float()
    coeffs = dct_chunks(padded.view(chunks, DCT_CHUNK))  # (chunks, DCT_CHUNK)
    if m is not None and m.shape == coeffs.shape:
        coeffs += m
    idx = topk_indices(coeffs.abs(), DCT_TOPK)  # (chunks, k)
    vals = coeffs.gather(1, idx)
    coeffs.scatter_(1, idx, 0.0)
    state.feedback[bucket.index()] = coeffs  # what was not sent stays for the next step
    world = dist.get_world_size()
    small = idx.to(torch.uint8)  # chunk-local indices < 256: one byte each on the bus
    all_idx = [torch.empty_like(small) for _ in range(world)]
    all_vals = [torch.empty_like(vals) for _ in range(world)]
    dist.all_gather(all_idx, small)
    dist.all_gather(all_vals, vals.contiguous())
    state.stats.bytes += small.numel() + 4 * vals.numel()
    state.stats.calls += 1
    total = torch.zeros(chunks, DCT_CHUNK, dtype=torch.float32, device=buf.device)
    for i, v in zip(all_idx, all_vals):
        total.scatter_add_(1, i.long(), v)
    mean = idct_chunks(total, 1.0 / world).reshape(-1)[:n]
    buf.copy_(mean.to(buf.dtype))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buf)
    return future
