"""What does a round cost the coordinator at 8, 64 and 256 workers, with the replay downlink and the compressed one?

    python -m benchmarks.scale --json                        # 8, 64, 256 workers; gpt-10m; replay up to 64
    python -m benchmarks.scale --workers 8,32 --rounds 2 --json
    python -m benchmarks.scale --workers 64,256,1024 --downlinks compressed --relays direct,peers --json

Each (downlink, workers) case runs in its own process (so its peak memory is its own): the coordinator's real
``Trainer`` (dispatch, gather, outer step, metrics) with ``--workers`` simulated workers. A simulated worker
is a ``WorkerLink`` that does no training: for every round it has a payload ready in the codec's real format
for the model's plan (gpt-10m, gradient mode's codec), made from a random "signal"
of the round with half of its indices moved at random for each worker: workers agree where they overlap, as
honest ones do, and no two send the same index sets (the copy check sees no copies). What the coordinator does
with a payload does not depend on which values it carries. A call goes through the bytes a served worker's would:
the coordinator serializes the order into its parts (hashed), and parses the result from its bytes.
Preparing the payloads happens between rounds and is not counted.

Reports per case, over ``--rounds`` rounds after the first (which pushes the state):
* ``round_s``: the coordinator's wall time per round (median);
* ``peak_rss_mb``: the process's peak resident memory over the rounds (the prepared payloads included:
  ``payloads_mb``);
* ``payload_bytes``: one worker's payload, its coded bytes (``payload_wire_bytes``: as it travels);
* ``bytes_down_per_worker``: one worker's order (the update, its batch, the settings);
* ``egress_bytes``: everything the coordinator sent in the round (``egress_payloads``: in payloads of one
  worker's size), and ``bytes_pulled``: what the workers pulled from each other instead (``--relays peers``:
  a simulated worker pulls nothing, but its order names what a real one would; the coordinator still
  serializes and hashes every payload it names).
The replay downlink at 256 workers would serialize ~38 GB of orders per round (each worker gets the other
255 payloads): it runs only up to ``--replay-max`` workers (64) and is reported as not run beyond.

Targets (issue 23): with the compressed downlink, bytes down per worker at 256 workers within 1.2x of 8, and
the coordinator's time per round at 256 at most 4.5x its time at 64.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from gradwire import protocol
from gradwire.compression import CompressedGradient, Encoding, GradientCodec, ValueFormat
from gradwire.compression.packing import pack_bits
from gradwire.compression.plan import value_bits
from gradwire.coordinator.config import RELAYS, TrainConfig
from gradwire.coordinator.trainer import Trainer
from gradwire.link import Traffic
from gradwire.memory import keep_freed_memory
from gradwire.protocol import OK, ModelState, RoundResult, WorkerInfo, WorkerState, WorkOrder
from gradwire.replica import Fingerprint
from gradwire.v1 import worker_pb2 as pb

TARGETS = {"bytes_down_256_over_8": 1.2, "round_s_256_over_64": 4.5}


@dataclasses.dataclass
class Signal:
    """What a round's honest workers have in common: per sparse tensor, indices and codes (unpacked)."""

    indices: dict[str, np.ndarray]
    codes: dict[str, np.ndarray]

    @classmethod
    def random(cls, codec: GradientCodec, rng: np.random.Generator) -> Signal:
        indices, codes = {}, {}
        for plan in codec.plan.tensors:
            if plan.encoding == Encoding.SPARSE:
                chosen = rng.integers(0, plan.chunk_numel, (plan.num_chunks, plan.k), dtype=np.int16)
                indices[plan.name] = distinct_rows(chosen, plan.chunk_numel, rng)
                high = codec.config.bins if plan.value_format == ValueFormat.LUT else 2
                codes[plan.name] = rng.integers(0, high, plan.num_values, dtype=np.uint8)
        return cls(indices, codes)


def worker_payload(
    codec: GradientCodec, template: CompressedGradient, signal: Signal, rng: np.random.Generator, own: float = 0.5
) -> CompressedGradient:
    """A valid payload of ``codec``'s plan: ``signal``'s coefficients, with a fraction ``own`` of its indices
    moved to random places (a worker's own rows), so that workers agree where they overlap and no two send the
    same index sets; dense tensors as ``template``'s."""
    config, tensors = codec.config, []
    for plan, sent in zip(codec.plan.tensors, template.tensors):
        if plan.encoding != Encoding.SPARSE:
            tensors.append(sent)
            continue
        indices = signal.indices[plan.name].copy()
        moved = rng.random(indices.shape) < own
        indices[moved] = rng.integers(0, plan.chunk_numel, int(moved.sum()), dtype=np.int16)
        indices = distinct_rows(indices, plan.chunk_numel, rng)
        if plan.value_format == ValueFormat.FLOAT32:
            values = (signal.codes[plan.name].astype("<f4") - 0.5).tobytes()
        else:
            values = pack_bits(signal.codes[plan.name], value_bits(plan.value_format, config))
        tensors.append(dataclasses.replace(sent, indices=codec.pack_indices(indices, plan), values=values))
    return dataclasses.replace(template, tensors=tuple(tensors))


def distinct_rows(indices: np.ndarray, universe: int, rng: np.random.Generator) -> np.ndarray:
    """``indices`` (chunks, k) with each row sorted and its repeats drawn again from [0, ``universe``): a top-k's
    distinct positions, as Elias-Fano indices must be (and an honest top-k is)."""
    rows = np.sort(indices, axis=1)
    while True:
        repeats = np.zeros(rows.shape, bool)
        repeats[:, 1:] = rows[:, 1:] == rows[:, :-1]
        if not repeats.any():
            return rows
        rows[repeats] = rng.integers(0, universe, int(repeats.sum()), dtype=rows.dtype)
        rows.sort(axis=1)


class SimulatedWorker:
    """A ``WorkerLink`` whose every round answers with the payload ``prepare`` made for it."""

    def __init__(self, index: int) -> None:
        self.address = f"simulated-{index}"
        self._result = b""  # the serialized gradient field of the next result

    def prepare(self, payload: CompressedGradient) -> None:
        self._result = pb.RoundResult(gradient=protocol.codec_serde.gradient_to_proto(payload)).SerializeToString()

    def wait_ready(self, timeout: float | None = None) -> None:
        return None

    def describe(self, timeout: float | None = None) -> WorkerInfo:
        return WorkerInfo(protocol.PROTOCOL_VERSION, "simulated", "simulated", "cpu")

    def push_state(self, state: ModelState, timeout: float | None = None) -> tuple[tuple[int, Fingerprint], Traffic]:
        size = sum(t.numel() * t.element_size() for t in state.parameters.values())
        return (state.version, Fingerprint((), (), ())), Traffic(size, 0)

    def run_round(
        self, order: WorkOrder, timeout: float | None = None, on_piece: object = None
    ) -> tuple[RoundResult, Traffic]:
        down = sum(len(p.data) for p in protocol.to_parts(protocol.order_to_proto(order)))  # as a client sends it
        version = order.base_version + len(order.catch_up) + (order.update is not None)
        rows, columns = order.batch.shape
        envelope = pb.RoundResult(
            status=pb.RoundResult.STATUS_OK, round=order.round, loss=5.0, tokens=rows * (columns - 1), version=version
        )
        data = envelope.SerializeToString() + self._result  # protobuf merges concatenated messages
        result = protocol.result_from_proto(protocol.parse(pb.RoundResult, data))  # as a client reads it
        assert result.status == OK
        return result, Traffic(down, len(data))

    def fetch_worker_state(self, run_id: str, timeout: float | None = None) -> tuple[WorkerState, Traffic]:
        return WorkerState(run_id, 0, {}, {}), Traffic()

    def close_run(self, run_id: str, timeout: float | None = None) -> bool:
        return True

    def cancel(self) -> None:
        return None

    def close(self) -> None:
        return None


@contextlib.contextmanager
def peak_rss() -> Iterator[list[int]]:
    """Samples this process's resident set every 5 ms; the list holds the peak in bytes once the block ends."""
    peak, stop = [0], threading.Event()
    page = os.sysconf("SC_PAGE_SIZE")

    def sample() -> None:
        while not stop.wait(0.005):
            with open("/proc/self/statm") as f:
                peak[0] = max(peak[0], int(f.read().split()[1]) * page)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


def run_case(model: str, downlink: str, workers: int, rounds: int, seed: int, relay: str = "direct") -> dict:
    """One (downlink, relay, workers) case in this process."""
    keep_freed_memory()  # as the coordinator process does
    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(
            model=model,
            steps=rounds + 1,
            batch_size=1,
            sequence_length=128,
            downlink=downlink,
            relay=relay,
            balance="off",  # simulated workers answer at once: the order they are served in is no speed
            spot_check_every=0,  # simulated workers compute no gradient to check
            eval_every=0,
            checkpoint_every=0,
            output_dir=out,
            seed=seed,
        )
        sims = [SimulatedWorker(i) for i in range(workers)]
        trainer = Trainer(config, sims, progress=False)
        codec = trainer.outer.codec
        rng = np.random.default_rng(seed)
        template = codec.compress({t.name: torch.full(t.shape, 1e-3) for t in codec.plan.tensors})  # the dense ones
        records, times = [], []
        try:
            trainer.connect()
            for r in range(rounds + 1):
                signal = Signal.random(codec, rng)
                for sim in sims:
                    sim.prepare(worker_payload(codec, template, signal, rng))
                payloads_mb = workers * template.nbytes / 2**20
                with peak_rss() as peak:
                    t0 = time.perf_counter()
                    record = trainer.train_step()
                    elapsed = time.perf_counter() - t0
                assert record is not None and record["successful_workers"] == workers, record
                if r:  # the first round pushes the state and sends no update
                    records.append(record)
                    times.append((elapsed, peak[0]))
        finally:
            trainer.close()
    return {
        "downlink": downlink,
        "relay": relay,
        "workers": workers,
        "rounds": rounds,
        "round_s": statistics.median(t for t, _ in times),
        "peak_rss_mb": max(p for _, p in times) / 2**20,
        "payloads_mb": payloads_mb,
        "payload_bytes": template.nbytes,
        # one payload as it travels (its proto: each tensor's name, shape and fields around the bytes)
        "payload_wire_bytes": protocol.codec_serde.gradient_to_proto(template).ByteSize(),
        "bytes_down_per_worker": statistics.median(r["bytes_down_per_worker"] for r in records),
        "egress_bytes": statistics.median(r["bytes_down"] for r in records),
        # the coordinator's egress in payloads (one worker's), and what the workers pulled from each other
        "egress_payloads": statistics.median(r["bytes_down"] for r in records) / template.nbytes,
        "bytes_pulled": statistics.median(r["bytes_pulled"] for r in records),
        "aggregate_s": statistics.median(r["aggregate_time"] for r in records),
        "compressed": [r["downlink_compressed"] for r in records],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-10m")
    parser.add_argument("--workers", default="8,64,256", help="comma-separated worker counts")
    parser.add_argument("--downlinks", default="replay,compressed")
    parser.add_argument("--relays", default="direct", help=f"{', '.join(RELAYS)} (--relay): comma-separated")
    parser.add_argument("--replay-max", type=int, default=64, help="run the replay downlink up to this many workers")
    parser.add_argument("--rounds", type=int, default=3, help="rounds measured per case, after the first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # DOWNLINK[+peers]:WORKERS, run in this process
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.case:
        how, workers = args.case.split(":")
        downlink, _, relay = how.partition("+")
        result = run_case(args.model, downlink, int(workers), args.rounds, args.seed, relay or "direct")
        print(json.dumps(result))
        return result
    counts = [int(n) for n in args.workers.split(",") if n]
    downlinks = [d for d in args.downlinks.split(",") if d]
    relays = [r for r in args.relays.split(",") if r]
    if not counts or min(counts) < 1 or args.rounds < 1 or not set(downlinks) <= {"replay", "compressed"}:
        parser.error("--workers needs counts >= 1, --rounds >= 1, --downlinks replay and/or compressed")
    if not relays or not set(relays) <= set(RELAYS):
        parser.error(f"--relays is a comma-separated subset of {','.join(RELAYS)}")
    cases: dict[str, dict] = {}
    for downlink, relay in ((d, r) for d in downlinks for r in relays):
        for n in counts:
            key = f"{downlink}:{n}" if relay == "direct" else f"{downlink}+{relay}:{n}"
            if downlink == "replay" and n > args.replay_max:
                cases[key] = {
                    "downlink": downlink,
                    "relay": relay,
                    "workers": n,
                    "run": False,
                    "why": f"over --replay-max {args.replay_max}",
                }
                continue
            cmd = [sys.executable, "-m", "benchmarks.scale", "--case", key, "--model", args.model]
            cmd += ["--rounds", str(args.rounds), "--seed", str(args.seed)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"case {key} failed:\n{done.stderr[-4000:]}")
            cases[key] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{key}: {cases[key]['round_s']:.2f} s per round", file=sys.stderr, flush=True)
    ratios = {}
    compressed = {
        c["workers"]: c
        for c in cases.values()
        if c["downlink"] == "compressed" and c.get("relay", "direct") == "direct" and c.get("run", True)
    }
    if 8 in compressed and 256 in compressed:
        ratios["bytes_down_256_over_8"] = (
            compressed[256]["bytes_down_per_worker"] / compressed[8]["bytes_down_per_worker"]
        )
    if 64 in compressed and 256 in compressed:
        ratios["round_s_256_over_64"] = compressed[256]["round_s"] / compressed[64]["round_s"]
    result = {
        "model": args.model,
        "cases": cases,
        "ratios": ratios,
        "targets": TARGETS,
        "meets_targets": {k: ratios[k] <= TARGETS[k] for k in ratios},
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
