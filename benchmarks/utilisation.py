"""Does the service keep a device as busy as a bare training loop does, and where does the rest of the time go?

    python -m benchmarks.utilisation --json                        # CPU: gpt-80m, 1 row x 64 tokens
    python -m benchmarks.utilisation --device cuda --json          # GPU: gpt-80m, 8 rows x 512 tokens
    python -m benchmarks.utilisation --device cuda --model llama-1b --runs bare,local-1 --json
    python -m benchmarks.utilisation --quick --json                # gpt-tiny, a few steps: a smoke test

Runs one after another, every one on ``--device``, with the same model and batch:

  bare             forward/backward + AdamW on one batch of ``--batch-size`` x ``--seq-len``, in this process
  grad-N           ``coordinator train`` with N local workers (``coordinator.local``), gradient mode, defaults
  grad-overlap-N   the same with ``--overlap``
  grad-stream-N    the same with ``--stream-buckets 4``
  local-N          local-SGD rounds of ``--inner-steps`` (30) inner steps, defaults
  local-overlap-N  the same with ``--overlap``

for N in 1 and 2 (``--runs`` picks some), then the bare loop again: where the host's speed drifts between
runs (a shared machine; on a GPU at this size a step is bound by the host), each run's ratio is given against
both (``of_bare``, ``of_bare_after``) and the bare loop's ``drift``. On a CPU the batch is small enough
(1 x 64) that compute per parameter is as small as on a GPU, so the service's own costs show where no GPU is
at hand.

For each service run, over the rounds after the ``--warmup`` ones (the first pushes the state): tokens/s (by
the wall clock) and its ratio to the bare loop's on as many devices as the workers hold (``baseline``: two
CPU workers share one CPU, two GPU workers share a GPU unless there are two), and the medians per step
(gradient mode) or per round (local SGD) of each worker's compute, replay of the last update, encode and
wait for its next order, and of the coordinator's round, aggregation, turnaround (last result in -> next
orders out) and background work. Compute, replay and encode are the slowest sender's (as the records hold
them), wait and span each worker's mean; figures a run's records do not hold are null. Forward and
backward run in ``--precision`` (auto: bf16 autocast on a GPU that supports it, else fp32) in the bare loop
and the workers alike. The coordinator runs in this process (``--coordinator-device``: its replica's), on one
thread beside CPU workers, as ``coordinator train --local`` does. One JSON object on stdout, a line per run on stderr.

On one machine the coordinator and its workers share the cores: a worker's work after its result lands in the
coordinator's turnaround, as it would not on machines of their own. ``--coordinator-cores N`` (Linux) gives
the coordinator the first N cores and the workers, and the bare loop, the rest (``benchmarks.cores``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from benchmarks import cores
from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.local import local_workers
from gradwire.coordinator.trainer import Trainer
from gradwire.hardware import AUTOCAST_PRECISIONS, resolve_precision
from gradwire.memory import keep_freed_memory
from gradwire.models import build_from_spec, lm_loss, model_names, model_spec
from gradwire.models.hf import vocab_size_of
from gradwire.models.registry import spec_elements


@dataclasses.dataclass(frozen=True)
class Mode:
    """A service run's flags, as ``TrainConfig`` fields."""

    local_sgd: bool = False
    overlap: bool = False
    stream_buckets: int = 0


MODES = {
    "grad": Mode(),
    "grad-overlap": Mode(overlap=True),
    "grad-stream": Mode(stream_buckets=4),
    "local": Mode(local_sgd=True),
    "local-overlap": Mode(local_sgd=True, overlap=True),
}
WORKER_COUNTS = (1, 2)
RUNS = ("bare", *(f"{mode}-{n}" for n in WORKER_COUNTS for mode in MODES))
# (model, batch size, sequence length, gradient steps, local-SGD rounds, inner steps): CPU, GPU, --quick
CPU_SIZE = ("gpt-80m", 1, 64, 6, 1, 30)
GPU_SIZE = ("gpt-80m", 8, 512, 8, 2, 30)
QUICK_SIZE = ("gpt-tiny", 1, 32, 2, 1, 2)
BARE_WARMUP = 3  # steps of the bare loop left out


def bare_loop(
    spec: dict, device: str, precision: str, batch_size: int, seq_len: int, steps: int, warmup: int, seed: int = 0
) -> dict[str, Any]:
    """Forward/backward + AdamW (the workers' default inner optimizer) on one batch: median step, tokens/s."""
    model = build_from_spec(spec, seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(0, vocab_size_of(spec), (batch_size, seq_len + 1))).to(device)  # (B, T+1)
    times = []
    try:
        for _ in range(warmup + steps):
            _synchronize(device)
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = lm_loss(model, tokens)
            loss.backward()
            optimizer.step()
            _synchronize(device)
            times.append(time.perf_counter() - t0)
    finally:  # the workers that follow need the device's memory
        del model, optimizer
        _free(device)
    step = statistics.median(times[warmup:])
    return {"steps": steps, "warmup": warmup, "step_s": step, "tokens_per_sec": batch_size * seq_len / step}


def service_run(
    addresses: Sequence[str], mode: Mode, args: argparse.Namespace, rounds: int, output_dir: str
) -> list[tuple[dict, float]]:
    """``rounds`` rounds of a coordinator in this process driving ``addresses``: each round's metrics record
    and its wall time."""
    config = TrainConfig(
        model=args.model,
        steps=rounds,
        batch_size=args.batch_size,
        sequence_length=args.seq_len,
        inner_steps=args.inner_steps if mode.local_sgd else 1,
        overlap=mode.overlap,
        stream_buckets=mode.stream_buckets,
        output_dir=output_dir,
        overwrite=True,
        **({"device": coordinator_device(args)} if coordinator_places_its_replica() else {}),
    )
    clients = [WorkerClient(a, timeout=config.round_timeout) for a in addresses]
    trainer = Trainer(config, clients, progress=False)
    out = []
    try:
        trainer.connect()
        for _ in range(rounds):
            t0 = time.perf_counter()
            record = trainer.train_step()
            if record is not None:
                trainer.durable.log()  # as ``Trainer.run``: the round is durable before the next orders go out
            wall = time.perf_counter() - t0
            if record is None:
                raise RuntimeError(f"round {trainer.step} had no usable contribution; see the log")
            out.append((record, wall))
        # the workers stay up for the next run: let them drop this one's replica and optimizer state
        trainer.roster.close_sessions(trainer.run_id, timeout=60.0)
    finally:
        trainer.close()
        for c in clients:
            c.close()
    return out


def coordinator_places_its_replica() -> bool:
    """Whether ``TrainConfig`` has a ``device`` (``coordinator train --device``): the coordinator's replica then
    lives on ``--device`` too; before it, on the CPU."""
    return "device" in {f.name for f in dataclasses.fields(TrainConfig)}


def coordinator_device(args: argparse.Namespace) -> str:
    """Where the coordinator's replica lives: ``--coordinator-device``, else the workers' device (the worst case
    on one GPU: its background work then shares the workers' device)."""
    return args.coordinator_device or args.device


def summarize(
    rounds: Sequence[tuple[dict, float]],
    warmup: int,
    workers: int,
    inner_steps: int,
    bare: dict | None,
    baseline: int,
) -> dict[str, Any]:
    """A run's figures from its rounds (records and wall times), the first ``warmup`` left out. Pure."""
    timed = rounds[warmup:]
    records = [r for r, _ in timed]
    before = rounds[warmup - 1][0]["total_tokens"] if warmup else 0
    tokens = records[-1]["total_tokens"] - before  # rows given to several workers (a spot check) count once
    wall = sum(w for _, w in timed)
    tokens_per_sec = tokens / wall if wall > 0 else None

    def per_worker(key: str) -> float | None:  # records sum these over the round's senders
        return _median(r[key] / max(1, r["successful_workers"]) for r in records if r.get(key) is not None)

    compute = _median(r.get("worker_compute_time") for r in records)
    out = {
        "workers": workers,
        "per": "round" if inner_steps > 1 else "step",
        "inner_steps": inner_steps,
        "rounds_timed": len(records),
        "tokens_per_sec": tokens_per_sec,
        "of_bare": tokens_per_sec / (baseline * bare["tokens_per_sec"]) if bare and tokens_per_sec else None,
        "baseline": f"{baseline} x bare",
        "wall_s": _median(w for _, w in timed),
        # each worker's, the slowest sender's where the record holds one figure for the round
        "worker_compute_s": compute,
        "worker_compute_per_step_s": compute / inner_steps if compute is not None else None,
        "worker_replay_s": _median(r.get("worker_update_time") for r in records),
        "worker_encode_s": _median(r.get("worker_compress_time") for r in records),
        "worker_wait_s": per_worker("wait_s"),
        "worker_span_s": per_worker("worker_wall_s"),
        "worker_utilisation": _median(r.get("utilisation") for r in records),
        # the coordinator's: its round (orders out -> outer step done), the part until every result was in,
        # the part after (validate, aggregate, outer step), and, where the records hold them, its turnaround
        # and the work its replica did off the critical path
        "coordinator_step_s": _median(r.get("step_time") for r in records),
        "coordinator_dispatch_s": _median(r.get("dispatch_time") for r in records),
        "coordinator_aggregate_s": _median(r.get("aggregate_time") for r in records),
        "coordinator_turnaround_s": _median(r.get("turnaround_s") for r in records),
        "coordinator_background_s": _median(r.get("background_s") for r in records),
    }
    return out


def baseline_for(workers: int, device: str) -> tuple[int, str]:
    """How many bare loops ``workers`` local workers on ``device`` could run side by side, and why. Pure but
    for the GPU count."""
    if torch.device(device).type != "cuda":
        return 1, f"{workers} worker(s) share this machine's CPU cores, as the bare loop uses them"
    gpus = torch.cuda.device_count()
    if gpus >= workers:
        return workers, f"{workers} worker(s), one GPU each"
    return gpus, f"{workers} workers share {gpus} GPU(s)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = model_spec(args.model)
    precision, why = resolve_precision(args.precision, args.device)
    started = time.perf_counter()
    out: dict[str, Any] = {
        "model": args.model,
        "parameters": spec_elements(spec),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "coordinator_device": coordinator_device(args) if coordinator_places_its_replica() else "cpu",
        "precision": precision,
        "precision_reason": why,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "cores": {"coordinator": sorted(args.cores[0]), "workers": sorted(args.cores[1])} if args.cores else None,
        "torch": torch.__version__,
        "runs": {},
    }
    runs: dict[str, Any] = out["runs"]
    bare = None
    if "bare" in args.runs:
        # a few steps first: a GPU's first steps pick kernels and grow the allocator's pool (with one left
        # out, two runs on an H100 put gpt-80m's step at 27.5 and 20.9 ms)
        size = (args.batch_size, args.seq_len, args.steps, max(BARE_WARMUP, args.warmup))
        with _on_workers_cores(args):
            runs["bare"] = _attempt(bare_loop, spec, args.device, precision, *size)
        _report("bare", runs["bare"])
        bare = runs["bare"] if "error" not in runs["bare"] else None
    for workers in WORKER_COUNTS:
        names = [m for m in MODES if f"{m}-{workers}" in args.runs]
        if not names:
            continue
        baseline = baseline_for(workers, args.device)
        with _workers(workers, args.device, precision, args.cores) as addresses:
            for mode in names:
                name = f"{mode}-{workers}"
                runs[name] = _attempt(measure, addresses, MODES[mode], args, bare, baseline)
                _report(name, runs[name])
    if bare is not None and len(runs) > 1:
        # The bare loop again once the service has run: where the host's speed drifts (a shared machine),
        # each run is read against both ends.
        with _on_workers_cores(args):
            again = _attempt(bare_loop, spec, args.device, precision, *size)
        if "error" not in again:
            bare["after"] = {k: again[k] for k in ("step_s", "tokens_per_sec")}
            bare["drift"] = again["tokens_per_sec"] / bare["tokens_per_sec"]
            for figures in runs.values():
                if figures.get("of_bare") is not None:
                    figures["of_bare_after"] = figures["of_bare"] / bare["drift"]
            _report("bare, again", again)
    out["wall_s"] = time.perf_counter() - started
    return out


def measure(
    addresses: Sequence[str], mode: Mode, args: argparse.Namespace, bare: dict | None, baseline: tuple[int, str]
) -> dict[str, Any]:
    """One service run's figures (``summarize``), beside ``bare``'s on ``baseline`` devices."""
    rounds, inner = (args.rounds, args.inner_steps) if mode.local_sgd else (args.steps, 1)
    if args.cores:  # again: a thread a worker started while it was first pinned may have missed it
        cores.pin_descendants(args.cores[1])
    with tempfile.TemporaryDirectory() as tmp:
        records = service_run(addresses, mode, args, args.warmup + rounds, tmp)
    figures = summarize(records, args.warmup, len(addresses), inner, bare, baseline[0])
    figures["baseline_reason"] = baseline[1]
    return figures


# ------------------------------------------------------------------------------------------ internals


def _median(values: Any) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _workers(
    n: int, device: str, precision: str, placed: tuple[frozenset[int], frozenset[int]] | None = None
) -> Iterator[list[str]]:
    """``n`` local workers on ``device``, and this process's coordinator on one thread while they run on the CPU
    (as ``coordinator train --local`` does: the workers get the cores); beside GPU workers it keeps them.
    ``placed``: the coordinator's cores and the workers' (``--coordinator-cores``)."""
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    try:
        kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
        per_worker = max(1, len(placed[1]) // n) if placed else None
        every = frozenset(os.sched_getaffinity(0)) if placed else None
        try:
            with local_workers(n, threads=per_worker, device=kind, precision=precision) as addresses:
                if placed:
                    cores.pin_descendants(placed[1])
                with cores.pinned(placed[0] if placed else None):
                    yield addresses
        finally:
            if every is not None:  # the fork server stays for later workers (and a test's): back on every core
                cores.pin_descendants(every)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _on_workers_cores(args: argparse.Namespace) -> Iterator[None]:
    """The bare loop where the workers run (``--coordinator-cores``: on their cores, with a thread each)."""
    if not args.cores:
        yield
        return
    threads = torch.get_num_threads()
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(len(args.cores[1]))
    try:
        with cores.pinned(args.cores[1]):
            yield
    finally:
        torch.set_num_threads(threads)


def _attempt(measure: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """A run's figures, or the error that stopped it: one failed run is a finding, reported with the rest."""
    try:
        return measure(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def _report(name: str, figures: dict[str, Any]) -> None:
    if "error" in figures:
        line = figures["error"]
    elif name.startswith("bare"):
        line = f"{figures['tokens_per_sec']:,.0f} tokens/s, {figures['step_s'] * 1e3:.1f} ms a step"
    else:
        of_bare = f"{figures['of_bare']:.3f}" if figures["of_bare"] is not None else "?"
        line = f"{figures['tokens_per_sec']:,.0f} tokens/s ({of_bare} of {figures['baseline']}) a {figures['per']}: "
        line += ", ".join(
            f"{who} {what} {figures[f'{who}_{what}_s'] * 1e3:.0f} ms"
            for who, whats in (("worker", ("compute", "replay", "encode", "wait")), ("coordinator", TIMES))
            for what in whats
            if figures[f"{who}_{what}_s"] is not None
        )
    print(f"{name}: {line}", file=sys.stderr, flush=True)


TIMES = ("aggregate", "turnaround", "background")  # the coordinator's, in the line each run prints


def _runs(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown run(s) {unknown or [text]}; the runs are {','.join(RUNS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.utilisation", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:INDEX: the bare loop's and the workers'")
    parser.add_argument(
        "--coordinator-device",
        help="the coordinator's (coordinator train --device): cpu on a GPU machine is a coordinator on a user's "
        "own machine (default: --device)",
    )
    parser.add_argument("--model", choices=model_names(), help="default: gpt-80m (--quick: gpt-tiny)")
    parser.add_argument("--batch-size", type=int, help="rows per step and worker (default: 1 on a CPU, 8 on a GPU)")
    parser.add_argument("--seq-len", type=int, help="tokens per row (default: 64 on a CPU, 512 on a GPU)")
    parser.add_argument("--steps", type=int, help="timed steps of the bare loop and of gradient mode (default: 6/8)")
    parser.add_argument("--rounds", type=int, help="timed local-SGD rounds (default: 1 on a CPU, 2 on a GPU)")
    parser.add_argument("--inner-steps", type=int, help="inner steps of a local-SGD round (default: 30)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds left out first: the state push (default: 1)")
    parser.add_argument(
        "--precision",
        choices=AUTOCAST_PRECISIONS,
        default="auto",
        help="forward/backward of the bare loop and the workers (worker serve --precision); auto: bf16 autocast "
        "on a GPU that supports it, else fp32 (default: auto)",
    )
    parser.add_argument("--runs", type=_runs, default=RUNS, help=f"a comma-separated subset of {','.join(RUNS)}")
    parser.add_argument(
        "--coordinator-cores",
        type=int,
        default=0,
        help="the coordinator on this many of the cores (the first), the workers and the bare loop on the rest, "
        "as on machines of their own (Linux; default 0: every process on every core)",
    )
    parser.add_argument("--quick", action="store_true", help="gpt-tiny, 1 x 32, 2 steps, 1 round of 2 inner steps")
    parser.add_argument("--json", action="store_true", help="print the result on one line")
    args = parser.parse_args(argv)
    size = QUICK_SIZE if args.quick else GPU_SIZE if args.device.startswith("cuda") else CPU_SIZE
    for key, default in zip(("model", "batch_size", "seq_len", "steps", "rounds", "inner_steps"), size):
        if getattr(args, key) is None:
            setattr(args, key, default)
    for key in ("batch_size", "seq_len", "steps", "rounds", "inner_steps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.inner_steps < 2 and any(r.startswith("local") for r in args.runs):
        parser.error("--inner-steps must be >= 2 for the local-SGD runs (1 is gradient mode)")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    args.cores = None
    if args.coordinator_cores:
        if not cores.available():
            parser.error("--coordinator-cores: this platform cannot pin threads to cores (Linux can)")
        try:
            args.cores = cores.split(args.coordinator_cores)
        except ValueError as e:
            parser.error(f"--coordinator-cores: {e}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keep_freed_memory()  # as `coordinator train` and the workers do
    result = run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
