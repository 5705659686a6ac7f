"""``worker.bus.CollectiveBytes`` counts the full tensor of each collective issued inside it, and only those."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradwire.transport import free_port
from gradwire.worker.bus import CollectiveBytes


def test_collectives_are_counted_by_their_full_tensor_and_other_ops_not_at_all():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x = torch.ones(5)
        with CollectiveBytes() as bus:
            y = x * 2 + 1  # no collective
            dist.all_reduce(y)  # 5 float32s
            out = torch.empty(5)
            dist.all_gather_single(out, x)  # its output: 5 float32s
            dist.broadcast(torch.zeros(3, dtype=torch.float64), src=0)  # 3 float64s
        assert (bus.calls, bus.bytes) == (3, 20 + 20 + 24)
        dist.all_reduce(y)
        assert bus.calls == 3  # nothing is counted once the block is left
        assert torch.equal(y, torch.full((5,), 3.0))  # the collectives still ran
    finally:
        dist.destroy_process_group()
