"""How much of a run's state does each rank of a sharded or pipelined node hold, and what does splitting
the model cost a round?

    python -m benchmarks.shard --json                               # gpt-80m, 2 ranks: ddp, fsdp, pipeline
    python -m benchmarks.shard --model gpt-tiny --rounds 1 --json   # a quick look
    python -m benchmarks.shard --modes ddp,fsdp --node-shard optimizer,gradients,full --json  # ZeRO-1, 2, 3

For each ``--modes`` node mode (``fsdp`` once per ``--node-shard`` stage: ``full`` reported as ``fsdp``, the
others as ``fsdp:optimizer``, ``fsdp:gradients``) it starts ``--ranks`` processes joined by gloo (NCCL with
``--device cuda``), each running the worker's engine as a node rank (rank 0 drives it, as the gRPC servicer
would), pushes a model's state once and runs ``--rounds`` local-SGD rounds of ``--inner-steps`` AdamW steps
on the same rows. Per rank it reports what the run's state holds, by part (replica and outer momentum, working copy,
inner optimizer, error feedback; local shards only), its bytes per parameter, the process's peak resident
memory above what it held before the node started (rank 0 builds the pushed state, the coordinator's
side, before that; on CUDA: the device's peak allocation), and the median round time. The ratios compare
each mode with ``ddp`` in the same run. One JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradwire.compression import CodecConfig
from gradwire.models import build_from_spec, model_names, model_spec
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, LocalSteps, ModelState, WorkOrder
from gradwire.replica import Replica
from gradwire.worker.nodeconf import NODE_MODES, NODE_SHARDS


def held(session: Any) -> dict[str, int]:
    """The bytes of a run's state on this rank, by part (local shards only)."""

    def size(tensors: Any) -> int:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in local)

    return {
        "replica": size(session.replica.params.values()) + size(session.replica.momentum),
        "working": size(session.working_model().parameters()),
        "inner": size(session.inner_state().values()),
        "feedback": size(session.feedback.state_dict().values()),
    }


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@dataclasses.dataclass(frozen=True)
class Job:
    model: str
    mode: str
    ranks: int
    rounds: int
    inner_steps: int
    rows: int  # per rank and inner step
    seq_len: int
    device: str
    store: str
    out: str
    shard: str = "full"  # fsdp: the ZeRO stage (worker serve --node-shard)


def rank_main(rank: int, job: Job) -> None:
    """One rank of a node: the engine as ``worker serve --nproc-per-node`` runs it."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    device = torch.device(f"cuda:{rank}" if job.device == "cuda" else "cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{job.store}", rank=rank, world_size=job.ranks)
    try:
        from gradwire.worker.compute import Placement
        from gradwire.worker.engine import WorkerEngine
        from gradwire.worker.node import NodeGroup
        from gradwire.worker.nodeconf import RankInfo

        spec = model_spec(job.model)
        if rank == 0:  # the coordinator's side, built before the baseline: it is not the node's memory
            replica = Replica(build_from_spec(spec, seed=0), UpdateRule(optimizer="sgd", momentum=0.9))
            params = {n: p.detach().clone() for n, p in replica.params.items()}
            state = ModelState("bench", 0, json.dumps(spec), params, replica.rule.to_json())
            fingerprint = replica.fingerprint()
        baseline = _peak_bytes(device)
        node = NodeGroup(RankInfo(rank, job.ranks, rank), device, timeout=3600)
        engine = WorkerEngine(device, placement=Placement(node, job.mode, shard=job.shard))
        seconds: list[float] = []
        if rank:
            engine.follow()
        else:
            engine.push_state(state)
            h, rows = job.inner_steps, job.rows * job.ranks
            steps = LocalSteps(h, InnerOptimizerConfig(name="adamw"), (1e-4,) * h)
            vocab = spec["config"].get("vocab_size", 8192)
            batch = np.random.default_rng(0).integers(0, vocab, (h * rows, job.seq_len + 1)).astype(np.uint16)
            order = WorkOrder("bench", 0, 0, batch, CodecConfig(), fingerprint, local_steps=steps)
            for r in range(job.rounds):  # every round from version 0: the same work each time
                t0 = time.perf_counter()
                result = engine.run_round(dataclasses.replace(order, round=r))
                assert result.status == OK, result.reason
                seconds.append(time.perf_counter() - t0)
            engine.stop_node()
        session = engine.sessions["bench"]
        elements = sum(session.replica.numels)
        parts = held(session)
        Path(f"{job.out}.{rank}").write_text(
            json.dumps(
                {
                    "parts": parts,
                    "elements": elements,
                    "peak_above_baseline": _peak_bytes(device) - baseline,
                    "seconds": seconds,
                }
            )
        )
    finally:
        dist.destroy_process_group()


def measure(job: Job) -> dict[str, Any]:
    mp.start_processes(rank_main, args=(job,), nprocs=job.ranks, start_method="spawn")
    ranks = [json.loads(Path(f"{job.out}.{r}").read_text()) for r in range(job.ranks)]
    elements = ranks[0]["elements"]
    state = [sum(r["parts"].values()) for r in ranks]
    return {
        "state_bytes_per_parameter_per_rank": [s / elements for s in state],
        "state_bytes_by_part": [r["parts"] for r in ranks],
        "peak_bytes_above_baseline": [r["peak_above_baseline"] for r in ranks],
        "round_seconds_median": statistics.median(ranks[0]["seconds"]) if ranks[0]["seconds"] else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": args.model,
        "ranks": args.ranks,
        "device": args.device,
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode, shard in _runs(args.modes, args.node_shard):
            name = mode if shard == "full" else f"{mode}:{shard}"
            job = Job(
                args.model,
                mode,
                args.ranks,
                args.rounds,
                args.inner_steps,
                args.rows,
                args.seq_len,
                args.device,
                str(Path(tmp) / f"store-{mode}-{shard}"),
                str(Path(tmp) / f"{mode}-{shard}"),
                shard,
            )
            out["modes"][name] = measure(job)
    if "ddp" in out["modes"]:
        base = out["modes"]["ddp"]
        for m in out["modes"].values():
            m["state_vs_ddp"] = max(m["state_bytes_per_parameter_per_rank"]) / max(
                base["state_bytes_per_parameter_per_rank"]
            )
            m["peak_vs_ddp"] = max(m["peak_bytes_above_baseline"]) / max(1, max(base["peak_bytes_above_baseline"]))
            if m["round_seconds_median"] and base["round_seconds_median"]:
                m["round_time_vs_ddp"] = m["round_seconds_median"] / base["round_seconds_median"]
    return out


def _runs(modes: str, shards: str) -> list[tuple[str, str]]:
    """(mode, ZeRO stage) of each node measured: an fsdp node once per stage, the other modes once."""
    return [(m, s) for m in modes.split(",") for s in (shards.split(",") if m == "fsdp" else ["full"])]


def main_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's settings from a command line (``main``'s)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-80m", choices=model_names())
    parser.add_argument(
        "--modes", default="ddp,fsdp,pipeline", help="node modes, comma-separated (ddp first: the base)"
    )
    parser.add_argument(
        "--node-shard",
        default="full",
        help="fsdp: ZeRO stages to measure, comma-separated, of optimizer (1), gradients (2), full (3)",
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2, help="rows per rank and inner step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(NODE_MODES)
    if unknown:
        parser.error(f"--modes: unknown node mode(s) {', '.join(sorted(unknown))}")
    unknown = set(args.node_shard.split(",")) - set(NODE_SHARDS)
    if unknown:
        parser.error(f"--node-shard: unknown stage(s) {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = main_args(argv)
    result = run(args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
