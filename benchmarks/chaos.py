"""Does a run survive workers dying, stalling and joining, and what does it cost?

    python -m benchmarks.chaos --json                  # 3 workers, 200 rounds of gpt-tiny, 10 kills
    python -m benchmarks.chaos --rounds 60 --kills 3 --json

Real ``worker serve`` processes on loopback and a coordinator (``Trainer``) with ``--workers-file``,
``--min-workers 2`` and a straggler grace, twice with the same seed: once undisturbed, once with chaos -
``--kills`` SIGKILLs of a random worker at random rounds (each restarted on its port two rounds later),
one worker SIGSTOPped for a few seconds (then SIGCONT), and a new worker written into the workers file
halfway. One JSON object: rounds completed (each step once), degraded rounds (fewer results than
workers), state pushes, state bytes re-shipped per kill, stragglers cut off, catch-ups, wall time, and
the held-out loss of both runs with their ratio. Targets: every step once, loss within 2% of the
undisturbed run, at most one state's worth of bytes re-shipped per kill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.membership import WorkersFile
from gradwire.coordinator.trainer import Trainer
from gradwire.transport import free_port


class Fleet:
    """Worker processes on fixed loopback ports, killed, stopped and restarted on request."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, port: int) -> None:
        argv = [
            sys.executable,
            "-m",
            "gradwire.worker",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
        ]
        self.procs[port] = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait(30)

    def signal(self, port: int, sig: int) -> None:
        self.procs[port].send_signal(sig)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(30)


def run(rounds: int, chaos: bool, kills: int, seed: int, directory: Path) -> dict:
    rng = random.Random(seed)
    fleet = Fleet()
    ports = [free_port() for _ in range(4)]
    listing = directory / "workers.txt"
    listing.write_text("".join(f"127.0.0.1:{p}\n" for p in ports[:3]))
    for port in ports[:3]:
        fleet.start(port)
    config = TrainConfig(
        model="gpt-tiny",
        steps=rounds,
        batch_size=4,
        sequence_length=32,
        seed=seed,
        output_dir=str(directory / "run"),
        min_workers=2,
        straggler_grace="1.0x",
        round_timeout=60.0,
        max_failed_seconds=120.0,
        checkpoint_every=0,
    )
    connect = lambda address: WorkerClient(address, timeout=config.round_timeout)  # noqa: E731
    members = WorkersFile(listing)
    members.poll()
    trainer = Trainer(
        config, [connect(f"127.0.0.1:{p}") for p in ports[:3]], progress=False, members=members, connect=connect
    )
    kill_rounds = sorted(rng.sample(range(5, rounds - 5), kills)) if chaos else []
    restarts: dict[int, list[int]] = {}
    records, t0 = [], time.monotonic()
    try:
        trainer.connect()
        while trainer.step < rounds:
            step = trainer.step
            if chaos:
                for port in restarts.pop(step, []):
                    fleet.start(port)
                if step in kill_rounds:
                    victim = rng.choice([p for p in ports[:3] if fleet.procs[p].poll() is None])
                    fleet.kill(victim)
                    restarts.setdefault(step + 2, []).append(victim)
                if step == rounds // 3:  # one worker stops answering for a while
                    fleet.signal(ports[1], signal.SIGSTOP)
                    threading.Timer(4.0, fleet.signal, (ports[1], signal.SIGCONT)).start()
                if step == rounds // 2:  # a new box joins
                    fleet.start(ports[3])
                    listing.write_text("".join(f"127.0.0.1:{p}\n" for p in ports))
            record = trainer.train_step()
            if record is not None:
                records.append(record)
            else:
                time.sleep(0.5)
        trainer.flush()
        loss = trainer.evaluate()
        state_bytes = trainer.state_bytes
    finally:
        trainer.close()
        fleet.stop_all()
    pushes = sum(r["pushes"] for r in records)
    initial = 3 + (1 if chaos else 0)  # the first round's pushes, and the joiner's
    return {
        "rounds_completed": len(records),
        "steps_once": [r["step"] for r in records] == list(range(1, rounds + 1)),
        "degraded_rounds": sum(
            r["successful_workers"] < (3 if r["step"] <= rounds // 2 else 4 if chaos else 3) for r in records
        ),
        "pushes": pushes,
        "state_bytes_reshipped_per_kill": ((pushes - initial) * state_bytes / kills) if chaos and kills else 0.0,
        "state_bytes": state_bytes,
        "stragglers": sum(r.get("stragglers", 0) for r in records),
        "catch_ups": sum(r.get("catch_ups", 0) for r in records),
        "kills": len(kill_rounds),
        "seconds": round(time.monotonic() - t0, 1),
        "held_out_loss": round(loss, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "calm").mkdir()
        (Path(tmp) / "chaos").mkdir()
        calm = run(args.rounds, False, args.kills, args.seed, Path(tmp) / "calm")
        chaos = run(args.rounds, True, args.kills, args.seed, Path(tmp) / "chaos")
    result = {
        "rounds": args.rounds,
        "undisturbed": calm,
        "chaos": chaos,
        "loss_ratio": round(chaos["held_out_loss"] / calm["held_out_loss"], 4),
    }
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
