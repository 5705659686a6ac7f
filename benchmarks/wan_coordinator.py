"""The coordinator side of ``benchmarks.wan``'s gradwire runs (run by it on the coordinator's host).

The same ``Trainer`` as ``coordinator train``, driven round by round with no checkpoint (fetching the
workers' error feedback for one would put a model's worth of bytes on the link the benchmark measures).
Prints one JSON line - the rounds' metrics and the held-out loss - then waits for its standard input to
close, so that the caller can read the interface counters while the run is over but nothing has left.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.trainer import Trainer
from gradwire.memory import keep_freed_memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", required=True)
    parser.add_argument("--model", default="gpt-10m")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--target-chunk", type=int, default=None, help="default: the mode's (as coordinator train)")
    parser.add_argument("--topk", type=int, default=None, help="default: the mode's (as coordinator train)")
    parser.add_argument("--overlap", action="store_true", help="one-step-delayed rounds (coordinator train --overlap)")
    parser.add_argument("--fragments", type=int, default=1, help="streamed fragments (coordinator train --fragments)")
    parser.add_argument("--stream-buckets", type=int, default=0, help="coordinator train --stream-buckets")
    parser.add_argument("--relay", default="direct", help="coordinator train --relay")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as `coordinator train` does
    config = TrainConfig(
        model=args.model,
        steps=args.rounds,
        batch_size=args.batch_size,
        sequence_length=args.seq_len,
        inner_steps=args.inner_steps,
        output_dir=args.output_dir,
        overwrite=True,
        target_chunk=args.target_chunk,
        topk=args.topk,
        overlap=args.overlap,
        fragments=args.fragments,
        stream_buckets=args.stream_buckets,
        relay=args.relay,
    )
    clients = [WorkerClient(a, timeout=config.round_timeout) for a in args.workers.split(",")]
    trainer = Trainer(config, clients, progress=False)
    try:
        trainer.connect()
        records = []
        while trainer.step < args.rounds:
            record = trainer.train_step()
            if record is None:
                raise SystemExit("a round had no usable worker")
            records.append(record)
        print(json.dumps({"records": records, "eval_loss": trainer.evaluate()}), flush=True)
        sys.stdin.read()  # the caller reads the counters, then closes our input
    finally:
        trainer.close()
        for c in clients:
            c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
