"""One rank of plain torch DDP over gloo, the baseline of ``benchmarks.wan`` (run by it, one per test host).

    python -m benchmarks.ddp_rank --rank R --world W --master HOST:PORT --steps N [--hook powersgd] ...

The same model, batches and optimizer settings as gradwire's dense baseline: AdamW on the mean gradient,
rank R drawing the rows gradwire's worker slot R would (``open_data(...).batch(step, R, ...)``). The
compute time is measured on two extra steps under ``no_sync`` (no all-reduce; their gradients are
dropped) before the timed ones, which keeps the trajectory untouched. Rank 0 prints one JSON line: median
step and compute times, the held-out loss at the end (the coordinator's held-out rows), tokens trained.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from gradwire.coordinator.data import open_data
from gradwire.models import build_model, lm_loss, tokenizer_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous")
    parser.add_argument("--model", default="gpt-10m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=7e-4)
    parser.add_argument("--hook", choices=["none", "powersgd"], default="none")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    host, port = args.master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=args.rank, world_size=args.world)
    torch.manual_seed(args.seed)
    model = build_model(args.model, seed=args.seed)
    # PowerSGD's chained all-reduces interleave differently per rank across buckets on gloo (a collective
    # mismatch that kills the group, as worker/hooks.py found for nodes): one bucket for it.
    ddp = DistributedDataParallel(model, bucket_cap_mb=100_000 if args.hook == "powersgd" else 25)
    if args.hook == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    data = open_data(
        paths=(),
        tokenizer=tokenizer_for(args.model),
        seq_len=args.seq_len,
        seed=args.seed,
        n_slots=args.world,
        val_rows=4 * args.batch_size,
    )

    def batch(step: int) -> torch.Tensor:
        return torch.from_numpy(data.batch(step, args.rank, args.batch_size, args.seq_len).astype("int64"))

    compute = []
    for i in range(2):  # compute alone: forward/backward without the all-reduce (gradients discarded)
        t0 = time.perf_counter()
        with ddp.no_sync():
            lm_loss(ddp, batch(10_000 + i)).backward()
        compute.append(time.perf_counter() - t0)
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    steps, losses = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = lm_loss(ddp, batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - t0)
        losses.append(float(loss))
    dist.barrier()
    if args.rank == 0:
        model.eval()
        with torch.no_grad():
            val = [
                float(lm_loss(model, torch.from_numpy(b.astype("int64"))))
                for b in data.val_batches(args.batch_size, args.seq_len, 4)
            ]
        print(
            json.dumps(
                {
                    "step_time": statistics.median(steps),
                    "compute_time": statistics.median(compute),
                    "eval_loss": sum(val) / len(val),
                    "train_loss": losses[-1],
                    "tokens": args.steps * args.world * args.batch_size * args.seq_len,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
