"""How does a worker hold up against hostile callers, and a run against a bad worker?

    python -m benchmarks.hostile --json                      # 3000 fuzzed calls, bad-worker runs of 40 steps
    python -m benchmarks.hostile --calls 500 --steps 12 --json

One JSON object:

* ``fuzz``: a real ``worker serve`` process on loopback gets ``--calls`` calls from ``benchmarks.fuzz``
  (mutated valid messages of every RPC, and garbage) with the run key of a run it holds, as a coordinator
  gone bad would send them: answers by RPC and status code, how many were INTERNAL (the target: none),
  the worker's resident memory before and at its peak, and whether it served a normal round afterwards.
* ``bad_workers``: gpt-tiny trained by two honest workers, then by the same two plus one bad worker
  (``tests/faults.py``: x1000, -x1000, x4, NaN, wrong shape, a lie about tokens, a sign flip at the honest
  norm, a gradient of other rows, zeros) with the default defences (clip to 2x the median norm, the
  agreement score, benching), and once more without them for both sign flippers: held-out loss, its ratio
  to the honest pair's (the target: within 1.02), the rounds in which the bad worker was clipped, left out
  or benched, the first round it was benched in, the lowest agreement score of the run, and the spot checks
  (``--spot-check-every``, default 10 as in training, and ``--spot-check-by``): how many ran and the rounds
  whose check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from benchmarks.fuzz import fuzz
from gradwire import protocol
from gradwire.compression import CodecConfig
from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, ModelState, WorkOrder
from gradwire.replica import Replica, StateUpdate
from gradwire.transport import free_port
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.server import make_server
from gradwire.worker.servicer import WorkerServicer
from tests.faults import faulty

SPEC = model_spec("gpt-tiny")
RULE = UpdateRule(optimizer="sgd")


def rss_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_fuzz(calls: int, seconds: float) -> dict:
    port = free_port()
    proc = subprocess.Popen(
        [
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
            "--max-model-params",
            "5000000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        with WorkerClient(f"127.0.0.1:{port}", timeout=60) as client:
            client.wait_ready(60)
            replica = Replica(build_from_spec(SPEC, seed=0), RULE)
            state = ModelState(
                "fuzzed",
                0,
                json.dumps(SPEC),
                {n: p.detach().clone() for n, p in replica.model.named_parameters()},
                RULE.to_json(),
            )
            client.push_state(state)
            batch = np.random.default_rng(0).integers(0, 8192, (2, 17)).astype(np.uint16)
            first, _ = client.run_round(WorkOrder("fuzzed", 0, 0, batch, CodecConfig(), replica.fingerprint()))
            order = WorkOrder(
                "fuzzed",
                1,
                0,
                batch,
                CodecConfig(),
                replica.fingerprint(),
                StateUpdate(0.1, (first.gradient,), (float(first.tokens),)),
            )
            start = rss_mb(proc.pid, "VmRSS")
            t0 = time.monotonic()
            answers = fuzz(
                client.channel,
                protocol.state_to_proto(state),
                protocol.order_to_proto(order),
                calls=calls,
                seconds=seconds,
                seed=0,
                metadata=client.call_metadata,
                deadline=10.0,
            )
            elapsed = time.monotonic() - t0
            alive = proc.poll() is None
            client.push_state(state)
            after, _ = client.run_round(WorkOrder("fuzzed", 9, 0, batch, CodecConfig(), replica.fingerprint()))
            served = after.status == OK
            return {
                "calls": sum(sum(a.values()) for a in answers.values()),
                "seconds": round(elapsed, 1),
                "answers": answers,
                "internal": sum(a.get("INTERNAL", 0) + a.get("UNKNOWN", 0) for a in answers.values()),
                "alive": alive,
                "served_a_round_after": served,
                "rss_mb_before": round(start, 1),
                "rss_mb_peak": round(rss_mb(proc.pid, "VmHWM"), 1),
            }
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def servers(factories: list[Callable[[], WorkerEngine]]) -> Iterator[list[str]]:
    started = []
    try:
        for factory in factories:
            server, port, _ = make_server(WorkerServicer(factory()), host="127.0.0.1", port=0)
            started.append((server, f"127.0.0.1:{port}"))
        yield [address for _, address in started]
    finally:
        for server, _ in started:
            server.stop(0)


def train_with(
    factories: list[Callable[[], WorkerEngine]], steps: int, directory: str, agreement: bool = True, **changes: object
) -> dict:
    config = TrainConfig(
        model="gpt-tiny",
        steps=steps,
        batch_size=4,
        sequence_length=32,
        eval_batches=8,
        output_dir=directory,
        seed=3,
        **changes,
    )
    with servers(factories) as addresses:
        clients = [WorkerClient(a, timeout=60) for a in addresses]
        trainer = Trainer(config, clients, progress=False)
        if not agreement:
            trainer.gather.agreement_floor = None  # measure no agreement: no score, no strike for it
        try:
            trainer.run()
            trainer.flush()
            loss = trainer.evaluate()
        finally:
            trainer.close()
            for c in clients:
                c.close()
    records = read_metrics(directory)
    return {
        "held_out_loss": round(loss, 4),
        "clipped_rounds": sum(r["clipped"] > 0 for r in records),
        "left_out_rounds": sum(r["rejected"] > 0 for r in records),
        "benched_rounds": sum(r["benched"] > 0 for r in records),
        "first_benched": next((i for i, r in enumerate(records) if r["benched"] > 0), None),
        "lowest_score": min((r["agreement_min"] for r in records if r["agreement_min"] is not None), default=None),
        "spot_checks": sum("spot_check" in r for r in records),
        "caught": [i for i, r in enumerate(records) if r.get("spot_check", {}).get("passed") is False],
    }


def run_bad_workers(steps: int, spot_check_every: int = 10, spot_check_by: str = "auto") -> dict:
    def honest() -> WorkerEngine:
        return WorkerEngine("cpu")

    cases = {
        "x1000": faulty("scale", factor=1000.0),
        "minus_x1000": faulty("scale", factor=-1000.0),
        "x4": faulty("scale", factor=4.0),
        "nan": faulty("nan"),
        "wrong_shape": faulty("wrong-shape"),
        "lie_about_tokens": faulty("lie-tokens", factor=100.0),
        "sign_flip": faulty("sign-flip"),
        "other_rows": faulty("other-rows"),
        "zeros": faulty("zeros"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        checks = {"spot_check_every": spot_check_every, "spot_check_by": spot_check_by}
        out = {"steps": steps, "honest_pair": train_with([honest, honest], steps, f"{tmp}/honest", **checks)}
        out.update(checks)
        base = out["honest_pair"]["held_out_loss"]
        for name, fault in cases.items():
            out[name] = train_with([honest, honest, fault], steps, f"{tmp}/{name}", **checks)
        for name in ("minus_x1000", "sign_flip"):
            out[f"{name}_undefended"] = train_with(
                [honest, honest, cases[name]], steps, f"{tmp}/open-{name}", False, clip_factor=0.0, bench_after=0
            )
        for name, result in out.items():
            if isinstance(result, dict) and name != "honest_pair":
                result["loss_ratio"] = round(result["held_out_loss"] / base, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=300.0, help="stop fuzzing after this long")
    parser.add_argument("--steps", type=int, default=40, help="rounds of each bad-worker run")
    parser.add_argument(
        "--spot-check-every", type=int, default=10, help="the bad-worker runs' --spot-check-every (the default)"
    )
    parser.add_argument("--spot-check-by", default="auto", help="the bad-worker runs' --spot-check-by")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    result = {
        "fuzz": run_fuzz(args.calls, args.seconds),
        "bad_workers": run_bad_workers(args.steps, args.spot_check_every, args.spot_check_by),
    }
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
