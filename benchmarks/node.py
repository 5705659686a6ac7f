"""What does a node of N ranks buy over one rank, and what do each communication hook and node mode cost?

    python -m benchmarks.node --json                                    # gpt-10m, 2 ranks on this machine
    python -m benchmarks.node --model gpt-tiny --steps 4 --json         # a quick look
    python -m benchmarks.node --device cuda --ranks 8 --json            # a GPU box: one rank per GPU
    python -m benchmarks.node --hooks "" --modes ddp,fsdp --json        # the node modes alone

Starts real ``worker serve`` processes on loopback, side by side: one rank with ``--batch-size`` rows per
step, then a node of ``--ranks`` ranks (``--nproc-per-node``) with ``ranks x batch-size`` rows - the same
rows per rank - once per ``--node-comm-hook``. For each it pushes the state once and runs ``--steps``
gradient rounds (8-bit DeMo codec, as the coordinator would send), and reports the median round time,
tokens/s, the speedup over one rank, and the bytes rank 0 put on the node's bus per step (``node_bytes``
of the round results). One JSON object. On a 2-core CPU the ranks share two cores, so the speedup says
little; the bus bytes are exact anywhere.

Then (``modes``) the same node once per ``--modes`` node mode (``--node-mode MODE``; DDP with the default
hook), on the same rows: the median round time and its ratio to the ``ddp`` row, the bus bytes per step
as the worker reports them, each rank process's peak resident memory (``VmHWM``, read from ``/proc``
before the node stops: the whole process, Python and torch included, so small models read high) in bytes
and per model parameter, and whether the first round's payload - the bytes that cross the slow link - is
the DDP node's (``payload_identical``: the serialized payloads are equal; ``payload_max_abs_diff``: the
largest difference of their decoded tensors). The ratios and comparisons need ``ddp`` among the modes.
``node_bytes`` counts what the worker counts: DDP's comm-hook traffic, local-SGD's parameter averages, and
the collectives torch issues for a split node (FSDP2's all-gathers and reduce-scatters, a pipeline's
sends, the gather of each gradient to its encoder: ``worker.bus``), on rank 0.
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
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from gradwire.compression import CodecConfig, GradientCodec
from gradwire.compression.serde import gradient_to_bytes
from gradwire.coordinator.client import WorkerClient
from gradwire.models import build_from_spec, model_names, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import ModelState, RoundResult, WorkOrder
from gradwire.replica import Replica
from gradwire.transport import free_port
from gradwire.worker.nodeconf import COMM_HOOKS, NODE_MODES

TIMEOUT = 600.0


@contextlib.contextmanager
def worker(
    ranks: int, device: str, hook: str | None, threads: int, mode: str | None = None
) -> Iterator[tuple[WorkerClient, int]]:
    """A ``worker serve`` process (``hook``, ``mode``: None for the worker's default) and its pid."""
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
        *(["--node-comm-hook", hook] if hook else []),
        *(["--node-mode", mode] if mode else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = open(os.environ.get("GRADWIRE_BENCH_LOG", os.devnull), "a")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with WorkerClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as client:
            client.wait_ready(120.0)
            yield client, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rank_peaks(launcher: int) -> list[int]:
    """The peak resident bytes (``VmHWM``) of each rank process ``worker serve --nproc-per-node`` started
    as ``launcher``'s children, in rank order (Linux)."""
    children = [int(pid) for f in Path(f"/proc/{launcher}/task").glob("*/children") for pid in f.read_text().split()]
    peaks = {}
    for pid in children:
        env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        status = Path(f"/proc/{pid}/status").read_text()
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
        peaks[int(env.get("RANK", len(peaks)))] = int(kib) * 1024
    return [peaks[r] for r in sorted(peaks)]


def measure(
    client: WorkerClient, replica: Replica, state: ModelState, rows: int, args: argparse.Namespace
) -> tuple[dict, RoundResult]:
    """Push ``state`` and run ``--steps`` timed rounds after an untimed first one; the figures and the
    first round's result."""
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
        else:
            first = result
    median = statistics.median(times)
    figures = {
        "step_time_s": median,
        "tokens_per_sec": rows * args.sequence_length / median,
        "node_bytes_per_step": statistics.median(bus),
    }
    return figures, first


def compare(result: RoundResult, base: RoundResult, codec: GradientCodec) -> dict:
    """Is ``result``'s payload ``base``'s: byte for byte, and the largest difference of the decoded tensors."""
    assert result.gradient is not None and base.gradient is not None, (result.reason, base.reason)
    identical = gradient_to_bytes(result.gradient) == gradient_to_bytes(base.gradient)
    ours, theirs = codec.decompress(result.gradient), codec.decompress(base.gradient)
    diff = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
    return {"payload_identical": identical, "payload_max_abs_diff": diff}


def measure_modes(
    replica: Replica, state: ModelState, args: argparse.Namespace, modes: list[str], threads: int
) -> dict[str, dict]:
    """The node once per mode, on the same rows; each compared with the ``ddp`` row where there is one."""
    params = sum(p.numel() for p in replica.params.values())
    rows, firsts = {}, {}
    for mode in modes:
        with worker(args.ranks, args.device, None, threads, mode) as (client, pid):
            r, firsts[mode] = measure(client, replica, state, args.batch_size * args.ranks, args)
            peaks = rank_peaks(pid)
        r["peak_rss_bytes"] = peaks
        r["peak_rss_bytes_per_param"] = [b / params for b in peaks]
        rows[mode] = r
    codec = GradientCodec({n: tuple(p.shape) for n, p in replica.params.items()}, CodecConfig())
    base = rows.get("ddp")
    for mode, r in rows.items():
        r["step_time_vs_ddp"] = r["step_time_s"] / base["step_time_s"] if base else None
        r.update(compare(firsts[mode], firsts["ddp"], codec) if base else {})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-10m", choices=model_names())
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hooks", default=",".join(COMM_HOOKS))
    parser.add_argument(
        "--modes",
        default="ddp,fsdp",
        help=f"node modes to compare, comma-separated, of {', '.join(NODE_MODES)} (ddp: the base; '' for none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(NODE_MODES)
    if unknown:
        parser.error(f"--modes: unknown node mode(s) {', '.join(sorted(unknown))}; choose from {', '.join(NODE_MODES)}")
    spec = model_spec(args.model)
    replica = Replica(build_from_spec(spec, seed=args.seed), UpdateRule(optimizer="sgd"))
    state = ModelState(
        "bench", 0, json.dumps(spec), {n: p.detach() for n, p in replica.params.items()}, replica.rule.to_json()
    )
    cores = os.cpu_count() or 1
    with worker(1, args.device, "none", cores) as (client, _):
        single, _ = measure(client, replica, state, args.batch_size, args)
    nodes = {}
    for hook in [h for h in args.hooks.split(",") if h]:
        with worker(args.ranks, args.device, hook, max(1, cores // args.ranks)) as (client, _):
            r, _ = measure(client, replica, state, args.batch_size * args.ranks, args)
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
        "modes": measure_modes(replica, state, args, modes, max(1, cores // args.ranks)),
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
