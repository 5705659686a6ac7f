"""How much faster than plain DDP, over a slow link, at what loss? (root needed)

    sudo python -m benchmarks.wan --json                               # gpt-10m, 2 workers, 100 Mbit/s, 25 ms: ~10 min
    sudo python -m benchmarks.wan --methods gradwire,gradwire-overlap --json   # with one-step-delayed rounds
    sudo python -m benchmarks.wan --methods ddp-powersgd,gradwire,gradwire-stream --json   # streamed gradients
    sudo python -m benchmarks.wan --methods gradwire-local,gradwire-local-overlap --steps 120 --inner-steps 30 --json
    sudo python -m benchmarks.wan --latency 0 --json                    # no added latency (a plain bridge)
    # the coordinator behind the slow link, 8 workers on a fast one, its orders carrying the update or not:
    sudo python -m benchmarks.wan --topology coordinator-link --workers 8 --methods gradwire,gradwire-relayed --json
    sudo python -m benchmarks.wan --model gpt-tiny --steps 6 --json     # a quick look
    sudo python -m benchmarks.wan --methods gradwire --target-chunk 32 --topk 8 --json   # another codec setting
    # local SGD at H 120 against DDP timed over 20 steps:
    sudo python -m benchmarks.wan --methods ddp,gradwire-local --steps 360 --inner-steps 120 --baseline-steps 20 --json

Makes test hosts in network namespaces (``benchmarks.netns``), every link shaped to ``--bandwidth`` with a
token bucket and every packet delayed by ``--latency`` one way (in user space, ``benchmarks.wire``: this
kernel has no ``netem``), and on the same hosts, with the same model, batch and tokens, runs:

* ``ddp``: torch DistributedDataParallel over gloo, one rank per worker host (``benchmarks.ddp_rank``);
* ``ddp-powersgd``: the same with PowerSGD (rank 4) compressing the all-reduce;
* ``gradwire``: a coordinator on host 0 and a ``worker serve`` on each worker host, gradient mode;
* ``gradwire-overlap``: the same with ``--overlap`` (one-step-delayed rounds: each worker computes its
  next gradient while its last result travels and is aggregated);
* ``gradwire-stream``: gradient mode with the gradient streamed as the backward produces it
  (``--stream-buckets``, default 4): each bucket travels while the backward goes on;
* ``gradwire-local``: the same in local-SGD rounds of ``--inner-steps`` (fewer rounds, equal tokens);
* ``gradwire-local-overlap``: those rounds with ``--overlap``: each worker takes the next round's inner steps
  as soon as its result is out, and the sync (the link, the aggregation, the outer step) runs meanwhile;
* ``gradwire-fragments``: local-SGD rounds as streamed fragments (``--fragments``, default 2): rounds of
  H / F inner steps, each syncing 1/F of the model;
* ``gradwire-relayed``: gradient mode with ``--relay peers``: the workers pull the update's payloads from
  each other instead of the coordinator's orders carrying them.

``--topology coordinator-link`` shapes the coordinator's link alone (the workers share a fast network):
the user's machine behind an ordinary uplink, where what the coordinator sends each round is the cost.

``--baseline-steps`` times the DDP rows over fewer steps than gradwire's (their per-step cost is steady
after a few): their loss is then not after equal tokens, and is not compared.

For each: step time (median), the part of it that is not compute, bytes on the wire per step (the hosts'
kernel interface counters, summed over hosts, divided by steps - not estimated), tokens/s, held-out loss
after equal tokens; for gradwire also where its non-compute time goes (replay, encode, aggregation, and the
rest: the link and the calls), and each worker's utilisation (its compute over its wall time, as it reports
them) and the share of its wall time it sat waiting with nothing to compute. Exits with a clear message,
status 0, where namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.netns import Lab, root_available
from benchmarks.wire import tun_available

# The defaults (20 steps of gpt-10m, 2 workers, 100 Mbit/s, 25 ms) finish in under 10 minutes on 2 cores;
# DDP's 240 MB per step take most of it. --overlap's row is one flag away.
METHODS = (
    "ddp",
    "ddp-powersgd",
    "gradwire",
    "gradwire-overlap",
    "gradwire-stream",
    "gradwire-local",
    "gradwire-local-overlap",
    "gradwire-fragments",
    "gradwire-relayed",
)
DEFAULT_METHODS = ("ddp", "ddp-powersgd", "gradwire", "gradwire-local")
MASTER_PORT = 29517
WORKER_PORT = 50051


def total_bytes(lab: Lab) -> int:
    return sum(c["tx"] for c in (lab.counters(i) for i in range(len(lab.hosts))))


def run_ddp(lab: Lab, args: argparse.Namespace, hook: str) -> dict:
    workers = len(lab.hosts) - 1
    master = f"{lab.hosts[1].address}:{MASTER_PORT}"
    before = total_bytes(lab)
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // workers)), "HF_HUB_OFFLINE": "1"}
    procs = [
        lab.popen(
            1 + r,
            [
                sys.executable,
                "-m",
                "benchmarks.ddp_rank",
                "--rank",
                str(r),
                "--world",
                str(workers),
                "--master",
                master,
                "--model",
                args.model,
                "--steps",
                str(args.baseline_steps),
                "--batch-size",
                str(args.batch_size),
                "--seq-len",
                str(args.seq_len),
                "--hook",
                hook,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(workers)
    ]
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"ddp rank failed: {err[-2000:]}")
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    wire = (total_bytes(lab) - before) / args.baseline_steps
    # The compute time comes from separate steps, so on a fast enough link (or with communication that
    # overlaps the backward) the difference can dip below zero: it is then 0.
    return {
        **result,
        "non_compute_time": max(0.0, result["step_time"] - result["compute_time"]),
        "non_compute_measured": "separate steps",
        "bytes_per_step": wire,
        "tokens_per_sec": result["tokens"] / args.baseline_steps / result["step_time"],
    }


class WorkerServers:
    """One ``worker serve`` on each worker host, started at the first gradwire method and kept for the rest:
    each coordinator run is a new run to them (a new session; the oldest beyond two is dropped), so the
    methods share the processes instead of each paying their start (importing torch, building the server)."""

    def __init__(self, lab: Lab) -> None:
        self.lab, self.procs = lab, []

    def addresses(self) -> str:
        """The workers' addresses (``host:port,...``), their processes started at the first call; ``RuntimeError``
        if one has exited since."""
        workers = len(self.lab.hosts) - 1
        if not self.procs:
            env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // workers)), "HF_HUB_OFFLINE": "1"}
            self.procs = [
                self.lab.popen(
                    1 + r,
                    [
                        sys.executable,
                        "-m",
                        "gradwire.worker",
                        "serve",
                        "--host",
                        self.lab.hosts[1 + r].address,
                        "--port",
                        str(WORKER_PORT),
                        "--device",
                        "cpu",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=env,
                )
                for r in range(workers)
            ]
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"a worker serve exited with status {p.returncode}")
        return ",".join(f"{self.lab.hosts[1 + r].address}:{WORKER_PORT}" for r in range(workers))

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(30)
        self.procs = []


def run_gradwire(
    lab: Lab,
    servers: WorkerServers,
    args: argparse.Namespace,
    inner_steps: int,
    overlap: bool = False,
    fragments: int = 1,
    stream_buckets: int = 0,
    relay: str = "direct",
) -> dict:
    per_round = inner_steps // fragments  # inner steps in a round (fragments: each syncs every inner_steps)
    rounds = max(1, args.steps // per_round)
    addresses = servers.addresses()
    with tempfile.TemporaryDirectory() as out:
        argv = [
            sys.executable,
            "-m",
            "benchmarks.wan_coordinator",
            "--workers",
            addresses,
            "--model",
            args.model,
            "--rounds",
            str(rounds),
            "--inner-steps",
            str(inner_steps),
            "--batch-size",
            str(args.batch_size),
            "--seq-len",
            str(args.seq_len),
            "--output-dir",
            out,
            *(["--target-chunk", str(args.target_chunk)] if args.target_chunk else []),
            *(["--topk", str(args.topk)] if args.topk else []),
            *(["--overlap"] if overlap else []),
            *(["--fragments", str(fragments)] if fragments > 1 else []),
            *(["--stream-buckets", str(stream_buckets)] if stream_buckets > 1 else []),
            "--relay",
            relay,
        ]
        before, sent_before = total_bytes(lab), lab.counters(0)["tx"]
        coordinator = lab.popen(
            0,
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        )
        line = coordinator.stdout.readline()  # the run is over, nothing else sent yet
        wire = total_bytes(lab) - before
        coordinator_sent = lab.counters(0)["tx"] - sent_before  # its uplink: the orders, and any state push
        _, err = coordinator.communicate("", timeout=args.timeout)
        if coordinator.returncode != 0 or not line:
            raise RuntimeError(f"coordinator failed: {err[-2000:]}")
        run = json.loads(line)
        records = run["records"]
        # Round 1 also ships the state to every worker: per-step figures leave it out (its bytes as the
        # coordinator counted them), and the times are those of the rounds after it.
        push = (
            records[0]["bytes_down"] - statistics.median(r["bytes_down"] for r in records[1:])
            if len(records) > 1
            else 0
        )
        timed = records[1:] or records
    step = statistics.median(r["step_time"] for r in timed) / per_round
    compute = statistics.median(r["worker_compute_time"] for r in timed) / per_round
    steps = rounds * per_round
    # Where the rest goes (medians, per step): the slowest worker's replay of the last update and its
    # encode, the coordinator's validation, aggregation and outer step; the remainder is the link and RPCs.
    replay, encode, aggregate = (
        statistics.median(r[k] for r in timed) / per_round
        for k in ("worker_update_time", "worker_compress_time", "aggregate_time")
    )
    # Each worker's own account of the rounds: compute over wall (work done ahead counts), and idle seconds.
    per_worker: dict[str, list[float]] = {}
    for r in timed:
        for address, share in r["worker_utilisation"].items():
            per_worker.setdefault(address, []).append(share)
    # Each worker's idle seconds over its own span (from its previous result to this one): idle time before
    # a round's order was sent (the coordinator's work between rounds) counts, as it does for a worker.
    waiting = [r["wait_s"] / r["worker_wall_s"] if r["worker_wall_s"] > 0 else 0.0 for r in timed]
    return {
        "step_time": step,
        "compute_time": compute,
        "non_compute_time": step - compute,
        "non_compute_measured": "same rounds",
        "replay_time": replay,
        "encode_time": encode,
        "aggregate_time": aggregate,
        "link_time": step - compute - replay - encode - aggregate,
        "bytes_per_step": (wire - push) / steps,
        # what the coordinator's host sent, per step, the state push left out (what its uplink carries)
        "coordinator_bytes_per_step": (coordinator_sent - push) / steps,
        "state_push_bytes": push,
        "bytes_per_step_with_push": wire / steps,
        # Round by round (per step), the first round's state push left out: later rounds no longer pay first-use
        # costs (the replay's buffers are first allocated in round 2), which a median over few rounds still shows.
        "rounds_non_compute_time": [(r["step_time"] - r["worker_compute_time"]) / per_round for r in timed],
        "rounds_replay_time": [r["worker_update_time"] / per_round for r in timed],
        "rounds_encode_time": [r["worker_compress_time"] / per_round for r in timed],
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
        "utilisation": statistics.median(statistics.mean(u) for u in per_worker.values()) if per_worker else None,
        "worker_utilisation": {a: statistics.mean(u) for a, u in per_worker.items()},
        "wait_fraction": statistics.median(waiting),
        "rounds_wait_fraction": waiting,
        "eval_loss": run["eval_loss"],
        "train_loss": records[-1]["loss"],
        "tokens": records[-1]["total_tokens"],
    }


def compare_with_ddp(results: dict[str, dict]) -> None:
    """Add each method's ratios to DDP's row (if DDP ran): non-compute time and bytes per step (every method
    trains the same batch per step, so per step is per trained token), and loss, only after equal tokens."""
    ddp = results.get("ddp")
    if ddp is None:
        return
    for r in results.values():
        # DDP's rows take their compute from separate steps, so a non-compute part under 1% of the step is
        # noise around 0 and a ratio to it says nothing; gradwire's rows measure it in the same rounds.
        measured = r.get("non_compute_measured") == "same rounds" or r["non_compute_time"] > 0.01 * r["step_time"]
        r["non_compute_vs_ddp"] = (
            ddp["non_compute_time"] / r["non_compute_time"] if measured and r["non_compute_time"] > 0 else None
        )
        r["bytes_vs_ddp"] = ddp["bytes_per_step"] / max(r["bytes_per_step"], 1.0)
        r["loss_vs_ddp"] = r["eval_loss"] / ddp["eval_loss"] if r["tokens"] == ddp["tokens"] else None


def parse_latency(text: str) -> float:
    """``25ms``, ``0.1s`` or a bare number of milliseconds -> seconds."""
    t = text.strip().lower()
    try:
        seconds = float(t[:-2]) / 1e3 if t.endswith("ms") else float(t[:-1]) if t.endswith("s") else float(t) / 1e3
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a latency: {text!r} (e.g. 25ms)") from None
    if not 0 <= seconds <= 10:
        raise argparse.ArgumentTypeError(f"latency must be in [0, 10 s], got {text!r}")
    return seconds


def run_methods(lab: Lab, servers: WorkerServers, args: argparse.Namespace, results: dict[str, dict]) -> None:
    """Each method of ``--methods`` in turn on ``lab``, its result put in ``results`` as it ends."""
    for method in args.methods.split(","):
        if method == "ddp":
            results[method] = run_ddp(lab, args, "none")
        elif method == "ddp-powersgd":
            results[method] = run_ddp(lab, args, "powersgd")
        elif method == "gradwire":
            results[method] = run_gradwire(lab, servers, args, 1)
        elif method == "gradwire-overlap":
            results[method] = run_gradwire(lab, servers, args, 1, overlap=True)
        elif method == "gradwire-stream":
            results[method] = run_gradwire(lab, servers, args, 1, stream_buckets=args.stream_buckets)
        elif method == "gradwire-local":
            results[method] = run_gradwire(lab, servers, args, args.inner_steps)
        elif method == "gradwire-local-overlap":
            results[method] = run_gradwire(lab, servers, args, args.inner_steps, overlap=True)
        elif method == "gradwire-fragments":
            results[method] = run_gradwire(lab, servers, args, args.inner_steps, fragments=args.fragments)
        elif method == "gradwire-relayed":
            results[method] = run_gradwire(lab, servers, args, 1, relay="peers")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument(
        "--latency",
        type=parse_latency,
        default=0.025,
        help="one-way delay between hosts (default 25ms; 0: none, a plain bridge)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--topology",
        choices=("every-link", "coordinator-link"),
        default="every-link",
        help="which links --bandwidth shapes: every host's (default), or the coordinator's alone (its host's: "
        "the workers share a fast network, the coordinator sits behind a slow uplink)",
    )
    parser.add_argument("--model", default="gpt-10m")
    parser.add_argument(
        "--steps", type=int, default=20, help="training steps per method (local SGD: in rounds of --inner-steps)"
    )
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument(
        "--baseline-steps",
        type=int,
        default=None,
        help="steps the DDP baselines run (default: --steps). Their per-step cost is steady after a few steps, so "
        "fewer let local SGD run long rounds in less time; their loss is then not at equal tokens and is not compared",
    )
    parser.add_argument(
        "--fragments",
        type=int,
        default=2,
        help="gradwire-fragments: streamed fragments, rounds of --inner-steps / F (a divisor of --inner-steps)",
    )
    parser.add_argument(
        "--stream-buckets",
        type=int,
        default=4,
        help="gradwire-stream: the pieces each worker's gradient streams in (coordinator train --stream-buckets)",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"any of {','.join(METHODS)} (default: {','.join(DEFAULT_METHODS)})",
    )
    parser.add_argument(
        "--target-chunk",
        type=int,
        default=None,
        help="gradwire's codec chunk edge (default: the mode's, as coordinator train)",
    )
    parser.add_argument(
        "--topk", type=int, default=None, help="gradwire's coefficients per chunk (default: the mode's)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.baseline_steps = args.baseline_steps or args.steps
    if min(args.steps, args.baseline_steps, args.inner_steps, args.fragments) < 1:
        parser.error("--steps, --baseline-steps, --inner-steps and --fragments must be >= 1")
    if args.inner_steps % args.fragments:
        parser.error(f"--fragments {args.fragments} must divide --inner-steps {args.inner_steps}")
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r} (choose from {', '.join(METHODS)})")
    ok, why = root_available()
    if ok and args.latency:
        ok, why = tun_available()
        why = f"{why}; --latency 0 runs without added latency" if not ok else why
    if not ok:
        print(json.dumps({"skipped": f"benchmarks.wan needs network namespaces: {why}"}))
        return 0
    # SIGTERM unwinds like Ctrl-C, so the namespaces and links are removed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    shaped = {0} if args.topology == "coordinator-link" else None  # host 0 runs the coordinator
    with Lab(args.workers + 1, bandwidth=args.bandwidth, latency=args.latency or None, shaped=shaped) as lab:
        servers = WorkerServers(lab)
        try:
            run_methods(lab, servers, args, results)
        finally:
            servers.stop()
    compare_with_ddp(results)
    out = {
        "bandwidth": args.bandwidth,
        "topology": args.topology,
        "latency_ms": args.latency * 1e3,
        "target_chunk": args.target_chunk,
        "topk": args.topk,
        "workers": args.workers,
        "model": args.model,
        "steps": args.steps,
        "baseline_steps": args.baseline_steps,
        "seconds": round(time.monotonic() - t0, 1),
        "methods": results,
    }
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
