"""What does the service cost over a bare single-process step, and how many bytes move each way?

    python -m benchmarks.e2e --json                      # gpt-10m, 1 local worker on loopback
    python -m benchmarks.e2e --model gpt-tiny --steps 5 --json
    python -m benchmarks.e2e --json --set stream_buckets=4    # any coordinator train setting, by field name

Runs, in one process and one machine, side by side:
  bare     the same model and batch trained in this process: forward/backward + the same outer step;
  service  ``coordinator`` + 1 ``worker serve`` subprocess on loopback, default settings (or ``--set``'s).
Reports the median step time of each and their ratio (``step_time_ratio``), bytes per step in both
directions after the first (state-pushing) round, the state size, and tokens/s. One JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from benchmarks.overrides import setting_value
from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.local import local_workers
from gradwire.coordinator.trainer import Trainer
from gradwire.memory import keep_freed_memory
from gradwire.models import build_from_spec, lm_loss, model_spec
from gradwire.optim.outer import outer_step


class BareStep:
    """The same model, batch and outer step in one process: forward/backward + the outer step."""

    def __init__(self, config: TrainConfig, data) -> None:
        self.config, self.data = config, data
        self.model = build_from_spec(model_spec(config.model), seed=config.seed)
        self.params = list(self.model.parameters())
        self.rule = config.update_rule()

    def __call__(self, step: int) -> float:
        cfg = self.config
        rows = torch.from_numpy(self.data.batch(step, 0, cfg.batch_size, cfg.sequence_length).astype(np.int64))
        t0 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        lm_loss(self.model, rows).backward()
        outer_step(self.params, [p.grad for p in self.params], self.rule, cfg.lr_at(step))
        return time.perf_counter() - t0


def _setting(item: str) -> tuple[str, object]:
    """``FIELD=VALUE`` -> (field, value): the value as JSON where it parses, else the string."""
    field, sep, value = item.partition("=")
    if not sep or field not in {f.name for f in dataclasses.fields(TrainConfig)}:
        raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with FIELD a TrainConfig field")
    return field, setting_value(value)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-10m")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", action="store_true", help="print the result on one line")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a TrainConfig field of the service's run (VALUE as JSON where it parses); repeatable",
    )
    args = parser.parse_args(argv)
    settings = dict(_setting(item) for item in args.set)
    keep_freed_memory()  # as `coordinator train` does; the bare step runs in this process and gains alike

    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(
            model=args.model,
            steps=args.steps + 1,
            batch_size=args.batch_size,
            sequence_length=args.seq_len,
            output_dir=out,
            **settings,
        )
        # The worker gets every core, as it would on its own machine; the coordinator, which mostly waits,
        # gets one (as in `coordinator train --local`). Service and bare steps alternate, so a slow spell
        # of this shared machine hits both alike.
        with local_workers(1, threads=os.cpu_count()) as addresses:
            trainer = Trainer(config, [WorkerClient(a, timeout=600) for a in addresses], progress=False)
            bare_step = BareStep(config, trainer.data)
            bare_step(0)  # warm-up: allocator and kernels
            records, bare = [], []
            try:
                trainer.connect()
                for step in range(config.steps):
                    torch.set_num_threads(1)
                    records.append(trainer.train_step())
                    trainer.durable.log()  # as ``Trainer.run``: durable before the next orders go out
                    torch.set_num_threads(os.cpu_count() or 1)
                    bare.append(bare_step(step + 1))
            finally:
                trainer.close()

    steady = records[1:]  # round 1 pushes the state
    service_step = statistics.median(r["step_time"] for r in steady)
    bare_step = statistics.median(bare[1:])
    result = {
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "bare_step_s": bare_step,
        "service_step_s": service_step,
        "step_time_ratio": service_step / bare_step,
        "bytes_up_per_step": statistics.median(r["bytes_up"] for r in steady),
        "bytes_down_per_step": statistics.median(r["bytes_down"] for r in steady),
        "first_round_bytes_down": records[0]["bytes_down"],
        "state_bytes": trainer.state_bytes,
        "state_over_bytes_down": trainer.state_bytes / statistics.median(r["bytes_down"] for r in steady),
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
        "bare_tokens_per_sec": args.batch_size * args.seq_len / bare_step,
        "worker_compute_s": statistics.median(r["worker_compute_time"] for r in steady),
        "worker_update_s": statistics.median(r["worker_update_time"] for r in steady),
        "worker_compress_s": statistics.median(r["worker_compress_time"] for r in steady),
        "dispatch_s": statistics.median(r["dispatch_time"] for r in steady),
        "aggregate_s": statistics.median(r["aggregate_time"] for r in steady),
        "settings": settings,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
