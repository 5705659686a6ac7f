"""Where a round's time goes, stage by stage, on the worker and on the coordinator.

    python -m benchmarks.stages --device cuda --json                  # gpt-80m, 8 x 512, gradient and local SGD
    python -m benchmarks.stages --json                                # CPU: gpt-80m, 1 x 64
    python -m benchmarks.stages --quick --json                        # gpt-tiny: a smoke test

The coordinator's ``Trainer`` and one worker's ``WorkerEngine`` run in this process (``worker.inprocess``:
every message through the protocol's serde, no gRPC), and each stage function of a round is wrapped: its
calls are timed with the device synchronized before and after (so a stage's time is its own, not what it
queued), by the thread that called it (``compute`` is the worker's round thread, ``ahead`` its look-ahead
thread, ``replica`` the coordinator's background replica, ``dispatch`` the coordinator's calls to the worker,
``main`` the coordinator's round). After the
``--warmup`` rounds, ``--rounds`` rounds are timed in each mode (``gradient``: one step a round;
``local``: ``--inner-steps`` inner steps a round), and each stage's calls a round and median are
reported, with the round's wall time. Synchronizing serializes what would overlap: the figures say what
each stage costs, ``benchmarks.utilisation`` what a run costs.

Then each of the worker's heavy stages is called again alone on the main thread (compute, encode, the
decode of its own payload, the replica's fingerprint): the median of a few calls and the kernels (on a
GPU; on a CPU the top-level operators) one call issues: on a GPU a stage that issues thousands of kernels
costs their launches, whatever its bytes. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.gpu import launches
from gradwire.compression import robust
from gradwire.compression.aggregate import Aggregator
from gradwire.compression.codec import GradientCodec
from gradwire.coordinator import copies
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.gather import Gatherer
from gradwire.coordinator.metrics import RunRecorder, progress
from gradwire.coordinator.resume import Resumption
from gradwire.coordinator.round import RoundDispatcher
from gradwire.coordinator.spotcheck import SpotChecks
from gradwire.coordinator.trainer import Trainer
from gradwire.hardware import resolve_precision
from gradwire.replica import Replica
from gradwire.worker import compute, rounds
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import InProcessClient, in_process_clients
from gradwire.worker.placement import Placement

# (model, rows, tokens per row, inner steps): on a CPU, on a GPU, --quick
CPU_SIZE = ("gpt-80m", 1, 64, 30)
GPU_SIZE = ("gpt-80m", 8, 512, 30)
QUICK_SIZE = ("gpt-tiny", 2, 32, 2)

# (where, attribute, stage): the functions a round is made of, as their modules look them up
STAGES: tuple[tuple[Any, str, str], ...] = (
    (rounds, "advance", "replay"),
    (rounds.Rounds, "compute", "compute"),
    (compute, "accumulate_gradient", "forward/backward"),
    (Placement, "clip_grad_norm", "clip norm"),
    (Placement, "step", "inner optimizer step"),
    (compute, "eager_start", "eager start"),
    (rounds.Rounds, "encode", "encode"),
    (rounds, "decode_ahead", "decode own payload"),
    (rounds, "view", "check (waits for the fingerprint taken ahead)"),
    (Replica, "apply", "replica apply"),
    (Replica, "fingerprint", "replica fingerprint"),
    (GradientCodec, "decode", "codec decode"),
    (Trainer, "_plan", "coordinator: plan"),
    (Trainer, "_dispatch", "coordinator: orders out, results in"),
    (RoundDispatcher, "_order", "coordinator: one work order"),
    (Trainer, "_judge", "coordinator: validate, clip, judge"),
    (SpotChecks, "__call__", "coordinator: spot check"),
    (Gatherer, "__call__", "coordinator: gather"),
    (copies, "digest", "coordinator: copy digest"),
    (robust, "payload_norm", "coordinator: sender's norm"),
    (robust, "aggregate", "coordinator: aggregate"),
    (Trainer, "_outer_step", "coordinator: outer step"),
    (Aggregator, "norm", "coordinator: aggregate's norm"),
    (Resumption, "commit", "coordinator: update log record"),
    (Trainer, "_record", "coordinator: metrics record"),
    (RunRecorder, "append", "coordinator: metrics written"),
    (Resumption, "log", "coordinator: update log written (fsync)"),
)
THREADS = (
    ("gradwire-compute", "compute"),
    ("gradwire-ahead", "ahead"),
    ("gradwire-encode", "encode"),
    ("gradwire-replica", "replica"),
    ("dispatch", "dispatch"),
)


class Stages:
    """Stage timings, by (stage, thread); while ``active``, each wrapped call is synchronized and timed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = False
        self.calls: dict[tuple[str, str], list[float]] = {}
        self._undo: list[Callable[[], None]] = []

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def wrapped(self) -> Iterator[None]:
        for owner, attribute, stage in STAGES:
            self._wrap(owner, attribute, stage)
        try:
            yield
        finally:
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()

    def _wrap(self, owner: Any, attribute: str, stage: str) -> None:
        original = owner.__dict__[attribute]

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return original(*args, **kwargs)
            self.sync()
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.sync()
                key = (stage, thread_role(threading.current_thread().name))
                self.calls.setdefault(key, []).append(time.perf_counter() - t0)

        setattr(owner, attribute, timed)
        self._undo.append(lambda: setattr(owner, attribute, original))

    def report(self, rounds_: int) -> list[dict[str, Any]]:
        """Each (stage, thread): its calls a round, median and total a round (ms), the largest total first."""
        rows = [
            {
                "stage": stage,
                "thread": thread,
                "calls_per_round": len(times) / rounds_,
                "median_ms": statistics.median(times) * 1e3,
                "per_round_ms": sum(times) / rounds_ * 1e3,
            }
            for (stage, thread), times in self.calls.items()
        ]
        return sorted(rows, key=lambda r: -r["per_round_ms"])


def thread_role(name: str) -> str:
    """Which of the round's threads ``name`` is (``main`` for the coordinator's own)."""
    return next((role for prefix, role in THREADS if name.startswith(prefix)), "main")


class Stash:
    """The arguments of the last call of each of the worker's heavy stages, to call it again alone."""

    def __init__(self) -> None:
        self.args: dict[str, tuple[tuple, dict]] = {}

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        keep = ((rounds.Rounds, "compute"), (rounds.Rounds, "encode_whole"), (rounds, "decode_ahead"))
        saved = [(owner, name, owner.__dict__[name]) for owner, name in keep]
        for owner, name, original in saved:
            setattr(owner, name, self._keeping(name, original))
        try:
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)

    def _keeping(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def keeping(*args: Any, **kwargs: Any) -> Any:
            self.args[name] = (args, kwargs)
            return original(*args, **kwargs)

        return keeping


def alone(stash: Stash, replica: Replica, stages: Stages, repeats: int) -> dict[str, Any]:
    """Each stashed stage called again on this thread: median seconds of ``repeats`` and the work one issues."""
    calls: dict[str, Callable[[], Any]] = {"fingerprint": lambda: replica.fingerprint_of(replica.params)}
    if "compute" in stash.args:
        (me, session, order, *_), _ = stash.args["compute"]
        calls["compute"] = lambda: me.compute(session, order, None, lambda: False, None)
    for name, stage in (("encode_whole", "encode"), ("decode_ahead", "decode own payload")):
        if name in stash.args:
            function = getattr(rounds.Rounds, name, None) or getattr(rounds, name)
            args, kwargs = stash.args[name]
            calls[stage] = functools.partial(function, *args, **kwargs)
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(repeats):
            stages.sync()
            t0 = time.perf_counter()
            call()
            stages.sync()
            times.append(time.perf_counter() - t0)
        out[name] = {"median_ms": statistics.median(times) * 1e3, "launches": launches(call, str(stages.device))}
    return out


def measure(args: argparse.Namespace, local: bool) -> dict[str, Any]:
    """One mode's stages over ``args.rounds`` rounds after ``args.warmup``, and its heavy stages alone."""
    device = torch.device(args.device)
    precision, _ = resolve_precision(args.precision, args.device)
    stages, stash = Stages(device), Stash()
    with tempfile.TemporaryDirectory() as out, stages.wrapped(), stash.kept():
        config = TrainConfig(
            model=args.model,
            steps=args.warmup + args.rounds,
            batch_size=args.batch_size,
            sequence_length=args.seq_len,
            inner_steps=args.inner_steps if local else 1,
            output_dir=out,
            overwrite=True,
            device=args.device,
            eval_every=0,
        )
        engine = functools.partial(WorkerEngine, placement=Placement(precision=precision))
        clients = in_process_clients(1, args.device, engine)
        trainer = Trainer(config, clients, progress=False)
        walls: list[float] = []
        turnarounds: list[float | None] = []
        try:
            trainer.connect()
            recorder = RunRecorder(out, progress(config.steps, 0, enabled=False))
            for r in range(args.warmup + args.rounds):
                stages.active = r >= args.warmup
                t0 = time.perf_counter()
                record = trainer.train_step()  # then what ``Trainer.run`` does after each round
                if record is None:
                    raise RuntimeError(f"round {r} had no usable contribution")
                recorder.append(record)
                trainer.durable.log()
                if stages.active:
                    walls.append(time.perf_counter() - t0)
                    turnarounds.append(record.get("turnaround_s"))
            settle(clients)  # what the last timed round queued on the look-ahead thread is timed too
            stages.active = False
            recorder.close(0)
            heavy = alone(stash, trainer.replica, stages, args.repeats)
        finally:
            trainer.close()
    return {
        "inner_steps": config.inner_steps,
        "precision": precision,
        "round_ms": statistics.median(walls) * 1e3,
        # last result in to next orders out, as the records say (the round after the first timed one on)
        "turnaround_ms": _median_ms(turnarounds),
        "stages": stages.report(args.rounds),
        "alone": heavy,
    }


def settle(clients: list[InProcessClient]) -> None:
    """Wait until each in-process worker's look-ahead thread has run what was queued on it (its one thread
    runs them in order, so a no-op queued last finishes after them)."""
    for client in clients:
        client.engine.rounds.ahead.submit(lambda: None).result()


def _median_ms(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) * 1e3 if kept else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stages", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:INDEX (default: cpu)")
    parser.add_argument("--model", help="default: gpt-80m (--quick: gpt-tiny)")
    parser.add_argument("--batch-size", type=int, help="rows per step (default: 1 on a CPU, 8 on a GPU)")
    parser.add_argument("--seq-len", type=int, help="tokens per row (default: 64 on a CPU, 512 on a GPU)")
    parser.add_argument("--inner-steps", type=int, help="inner steps of a local-SGD round (default: 30)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds timed in each mode (default: 3)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds left out first (default: 2)")
    parser.add_argument("--repeats", type=int, default=5, help="calls of each stage alone (default: 5)")
    parser.add_argument("--modes", default="gradient,local", help="gradient, local or both (default: both)")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"), help="the worker's")
    parser.add_argument("--quick", action="store_true", help="gpt-tiny, 2 x 32, 2 inner steps, 1 round")
    parser.add_argument("--json", action="store_true", help="print the result on one line")
    args = parser.parse_args(argv)
    size = QUICK_SIZE if args.quick else GPU_SIZE if args.device.startswith("cuda") else CPU_SIZE
    for key, default in zip(("model", "batch_size", "seq_len", "inner_steps"), size):
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.quick:
        args.rounds, args.warmup, args.repeats = 1, 1, 2
    args.modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not args.modes or set(args.modes) - {"gradient", "local"}:
        parser.error("--modes is gradient, local or both, comma-separated")
    if args.inner_steps < 2 or min(args.rounds, args.repeats) < 1 or args.warmup < 1:
        parser.error("--inner-steps must be >= 2, --rounds and --repeats >= 1, --warmup >= 1 (the state push)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "torch": torch.__version__,
        "modes": {},
    }
    for mode in args.modes:
        result["modes"][mode] = measure(args, local=mode == "local")
        print(f"{mode}: {result['modes'][mode]['round_ms']:.1f} ms a round", file=sys.stderr, flush=True)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
