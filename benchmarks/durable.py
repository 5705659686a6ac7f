"""What does making every round durable cost: bytes and fsyncs a round, and a resume's replay?

    python -m benchmarks.durable --json                            # gpt-10m: a run's log, and 1,000 rounds replayed
    python -m benchmarks.durable --model gpt-tiny --rounds 4 --replay-rounds 20 --json    # a smoke test

Two measurements, one JSON object:
  log     a real run (``--workers`` in-process workers, gradient mode and local-SGD rounds of H ``--inner-steps``;
          and gossip rounds of H on a ring of ``--gossip-workers``) with its update log: per round, the
          record's bytes on disk against the round's update (what its workers replay: every sender's payload;
          a gossip round's: the messages it accepted), and the seconds its append took, fsync included; then
          one full checkpoint (every worker's state fetched, the model written): its seconds and bytes;
  replay  ``--replay-rounds`` records of such updates in a log, then what a resume does with them: read the
          log back (CRC-checked, every update validated) and apply each update to a fresh replica.
Rounds lost per kill are the fault test's business (tests/integration/test_update_log.py: 0 completed rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.durable import RoundState, log_path, read_records
from gradwire.coordinator.trainer import Trainer
from gradwire.coordinator.updatelog import FRAME_OVERHEAD, LogRecord, UpdateLog, read_log
from gradwire.models import build_from_spec, model_spec
from gradwire.replica import Replica
from gradwire.worker.inprocess import in_process_clients


def logged_run(args: argparse.Namespace, inner_steps: int, out: Path, topology: str = "star") -> dict[str, Any]:
    """A short run with its log: each round's record against its update's bytes (a gossip round's: the
    messages it accepted, which its record must hold), and the append's time."""
    gossip = topology != "star"
    config = TrainConfig(
        model=args.model,
        steps=args.rounds,
        batch_size=args.batch_size,
        sequence_length=args.seq_len,
        inner_steps=inner_steps,
        checkpoint_every=0,
        balance="off",
        output_dir=str(out),
        topology=topology,
    )
    trainer = Trainer(config, in_process_clients(args.gossip_workers if gossip else args.workers), progress=False)
    appends: list[float] = []
    try:
        trainer.connect()
        for _ in range(args.rounds):
            if trainer.train_step() is None:
                raise RuntimeError("a round had no usable worker")
            t0 = time.perf_counter()
            trainer.durable.log()  # what ``run`` does after each round's metrics line
            appends.append(time.perf_counter() - t0)
        records = read_records(log_path(trainer.checkpoint_dir), 1 << 31)  # before the checkpoint compacts them
        frames = _frame_sizes(log_path(trainer.checkpoint_dir), len(records))
        shutil.copyfile(log_path(trainer.checkpoint_dir), kept_log(out))  # what ``replayed`` reads
        t0 = time.perf_counter()
        checkpoint = trainer.save_checkpoint()  # every worker's state fetched, the whole model written
        checkpoint_s = time.perf_counter() - t0
        checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    finally:
        trainer.close()
    if gossip:
        updates = [sum(q.nbytes for q in r.gossip.accepted.values()) for r in records if r.gossip is not None]
    else:
        updates = [r.update.nbytes for r in records if r.update is not None]
    states = [len(r.coordinator_state) for r in records]
    return {
        "topology": topology,
        "inner_steps": inner_steps,
        "rounds": len(records),
        "record_bytes": statistics.median(frames),
        "update_bytes": statistics.median(updates),
        "state_bytes": statistics.median(states),
        "record_over_update": statistics.median(f / u for f, u in zip(frames, updates)),
        "append_s": statistics.median(appends),
        # a full checkpoint after those rounds: its seconds (the workers' states fetched) and bytes on disk
        "checkpoint_s": checkpoint_s,
        "checkpoint_bytes": checkpoint_bytes,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
    }


def kept_log(out: Path) -> Path:
    """Where ``logged_run`` keeps a copy of its log from before its checkpoint compacted it."""
    return out / "updates.kept.log"


def _frame_sizes(path: Path, n: int) -> list[int]:
    """Each record's bytes on disk (frame header + body), in order."""
    sizes = [FRAME_OVERHEAD + len(body) for body, _ in read_log(path, max_record_bytes=1 << 31).frames()]
    assert len(sizes) == n
    return sizes


def replayed(args: argparse.Namespace, source: Path, out: Path) -> dict[str, Any]:
    """``--replay-rounds`` records of the logged run's updates, written, then read back and applied."""
    records = read_records(source, 1 << 31)
    spec = model_spec(args.model)
    replica = Replica(build_from_spec(spec, seed=0), TrainConfig(model=args.model).update_rule())
    path = out / "replay.log"
    log = UpdateLog(path, max_record_bytes=1 << 31)
    t0 = time.perf_counter()
    version = replica.version
    for i in range(args.replay_rounds):
        record = records[i % len(records)]
        log.append(LogRecord(i, version + i, version + i + 1, record.update, None, record.coordinator_state))
    write_s = time.perf_counter() - t0
    log.close()
    t0 = time.perf_counter()
    back = read_records(path, 1 << 31)
    read_s = time.perf_counter() - t0
    RoundState.from_bytes(back[-1].coordinator_state)
    t0 = time.perf_counter()
    for record in back:
        assert record.update is not None
        replica.apply(record.update)
    apply_s = time.perf_counter() - t0
    return {
        "rounds": len(back),
        "log_bytes": path.stat().st_size,
        "write_s": write_s,
        "read_s": read_s,
        "apply_s": apply_s,
        "resume_s": read_s + apply_s,
        "per_round_s": (read_s + apply_s) / len(back),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-10m")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2, help="rows per worker and (inner) step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each logged run")
    parser.add_argument("--inner-steps", type=int, default=30, help="H of the local-SGD run")
    parser.add_argument("--gossip-workers", type=int, default=4, help="workers of the gossip run (a ring)")
    parser.add_argument("--replay-rounds", type=int, default=1000)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default prints it too)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gradient = logged_run(args, 1, root / "gradient")
        local = logged_run(args, args.inner_steps, root / "local")
        gossip = logged_run(args, args.inner_steps, root / "gossip", topology="ring")
        replay = replayed(args, kept_log(root / "gradient"), root)
    result = {
        "model": args.model,
        "workers": args.workers,
        "torch_threads": torch.get_num_threads(),
        "log": {"gradient": gradient, "local_sgd": local, "gossip_ring": gossip},
        "replay": replay,
    }
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
