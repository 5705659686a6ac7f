"""What does a node of N ranks buy over one rank, and what does each communication hook put on its bus?

    python -m benchmarks.node --json                                    # gpt-10m, 2 ranks on this machine
    python -m benchmarks.node --model gpt-tiny --steps 4 --json         # a quick look
    python -m benchmarks.node --device cuda --ranks 8 --json            # a GPU box: one rank per GPU

Starts real ``worker serve`` processes on loopback, side by side: one rank with ``--batch-size`` rows per
step, then a node of ``--ranks`` ranks (``--nproc-per-node``) with ``ranks x batch-size`` rows - the same
rows per rank - once per ``--node-comm-hook``. For each it pushes the state once and runs ``--steps``
gradient rounds (8-bit DeMo codec, as the coordinator would send), and reports the median round time,
tokens/s, the speedup over one rank, and the bytes rank 0 put on the node's bus per step (``node_bytes``
of the round results). One JSON object. On a 2-core CPU the ranks share two cores, so the speedup says
little; the bus bytes are exact anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from gradwire.compression import CodecConfig
from gradwire.coordinator.client import WorkerClient
from gradwire.models import build_from_spec, model_names, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import ModelState, WorkOrder
from gradwire.replica import Replica
from gradwire.transport import free_port
from gradwire.worker.hooks import COMM_HOOKS

TIMEOUT = 600.0


@contextlib.contextmanager
def worker(ranks: int, device: str, hook: str, threads: int) -> Iterator[WorkerClient]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gradwire.worker",
        "serve",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--device",
        device,
        "--nproc-per-node",
        str(ranks),
        "--node-comm-hook",
        hook,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = open(os.environ.get("GRADWIRE_BENCH_LOG", os.devnull), "a")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with WorkerClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as client:
            client.wait_ready(120.0)
            yield client
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure(client: WorkerClient, replica: Replica, state: ModelState, rows: int, args: argparse.Namespace) -> dict:
    client.push_state(state)
    rng = np.random.default_rng(args.seed)
    times, bus = [], []
    # Orders carry no update, so every round computes at version 0. The first builds DDP and warms caches
    # (not timed); PowerSGD all-reduces plainly for its first two steps, which the median looks past.
    for step in range(args.steps + 1):
        batch = rng.integers(0, replica.model.tok_emb.num_embeddings, (rows, args.sequence_length + 1)).astype(
            np.uint16
        )
        order = WorkOrder(state.run_id, step, 0, batch, CodecConfig(), replica.fingerprint())
        t0 = time.perf_counter()
        result, _ = client.run_round(order)
        if step:
            times.append(time.perf_counter() - t0)
            bus.append(result.node_bytes)
    median = statistics.median(times)
    return {
        "step_time_s": median,
        "tokens_per_sec": rows * args.sequence_length / median,
        "node_bytes_per_step": statistics.median(bus),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-10m", choices=model_names())
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hooks", default=",".join(COMM_HOOKS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    spec = model_spec(args.model)
    replica = Replica(build_from_spec(spec, seed=args.seed), UpdateRule(optimizer="sgd"))
    state = ModelState(
        "bench", 0, json.dumps(spec), {n: p.detach() for n, p in replica.params.items()}, replica.rule.to_json()
    )
    cores = os.cpu_count() or 1
    with worker(1, args.device, "none", cores) as client:
        single = measure(client, replica, state, args.batch_size, args)
    nodes = {}
    for hook in [h for h in args.hooks.split(",") if h]:
        with worker(args.ranks, args.device, hook, max(1, cores // args.ranks)) as client:
            r = measure(client, replica, state, args.batch_size * args.ranks, args)
        r["speedup_vs_one_rank"] = r["tokens_per_sec"] / single["tokens_per_sec"]
        r["bus_bytes_vs_fp32_allreduce"] = r["node_bytes_per_step"] / (
            4 * sum(p.numel() for p in replica.params.values())
        )
        nodes[hook] = r
    result = {
        "model": args.model,
        "params": sum(p.numel() for p in replica.params.values()),
        "ranks": args.ranks,
        "device": args.device,
        "batch_per_rank": args.batch_size,
        "sequence_length": args.sequence_length,
        "steps": args.steps,
        "one_rank": single,
        "node": nodes,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
