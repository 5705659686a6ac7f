"""The decentralized seed experiment (configs/gossip-ring.yaml) on ring, exponential and complete graphs.

    python -m benchmarks.gossip --json                      # the config's settings, 8 workers, every graph
    python -m benchmarks.gossip --steps 60 --plot docs/gossip.png
    python -m benchmarks.gossip --graphs ring --peer-to-peer --json   # the same run, messages worker to worker

Runs the config once per graph with the same seed and data, the workers in this process
(``worker.inprocess``: the service's own code, every message through the protocol's serde), and prints
per graph the loss curve (the workers' mean training loss each round, the consensus's held-out loss at
each evaluation), the consensus distance, and the bytes one worker is sent per round (its neighbours'
messages: its degree in payloads). ``--plot`` draws held-out loss against rounds, the graphs side by side.
With ``--peer-to-peer`` the workers pull their neighbours' messages from each other: the coordinator's
bytes to a worker are its order alone, and ``peer_bytes_down_per_worker_round`` is what it pulled.
The corpus is the config's (the embedded default data); rounds read it in order, never twice at this length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gradwire.coordinator.cli import load_train
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.trainer import Trainer
from gradwire.worker.inprocess import in_process_clients

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gossip-ring.yaml"
GRAPHS = ("ring", "exponential", "complete")


def run(config: TrainConfig, workers: int) -> dict[str, Any]:
    trainer = Trainer(config, in_process_clients(workers), progress=False)
    try:
        t0 = time.perf_counter()
        records = trainer.run()
        wall = time.perf_counter() - t0
    finally:
        trainer.close()
    return {
        "rounds": len(records),
        "final_eval_loss": next((r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None),
        "final_consensus_distance": records[-1]["consensus_distance"],
        "degree_max": max(r["degree_max"] for r in records),
        "bytes_down_per_worker_round": sum(r["bytes_down_per_worker"] for r in records[1:]) / max(1, len(records) - 1),
        "peer_bytes_down_per_worker_round": sum(
            sum(r.get("peer_bytes_down", {}).values()) / workers for r in records[1:]
        )
        / max(1, len(records) - 1),
        "bytes_up_per_worker_round": sum(r["bytes_up"] for r in records) / len(records) / workers,
        "wall_s": wall,
        "curve": [{k: r[k] for k in ("step", "loss", "eval_loss", "consensus_distance") if k in r} for r in records],
    }


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for graph, r in results.items():
        evals = [(p["step"], p["eval_loss"]) for p in r["curve"] if "eval_loss" in p]
        ax[0].plot(*zip(*evals), marker="o", label=graph)
        ax[1].semilogy([p["step"] for p in r["curve"]], [p["consensus_distance"] for p in r["curve"]], label=graph)
    ax[0].set(xlabel="round", ylabel="held-out loss (consensus)", title="loss vs rounds")
    ax[1].set(xlabel="round", ylabel="consensus distance", title="workers' disagreement")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--steps", type=int, default=None, help="rounds (default: the config's)")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--output-dir", default="runs/gossip-bench")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--peer-to-peer", action="store_true", help="messages from worker to worker")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {}
    for graph in args.graphs.split(","):
        flags = ["train", "--config", args.config, "--topology", graph, "--overwrite"]
        flags += ["--output-dir", str(Path(args.output_dir) / graph)]
        if args.steps is not None:
            flags += ["--steps", str(args.steps)]
        if args.eval_every is not None:
            flags += ["--eval-every", str(args.eval_every)]
        if args.peer_to_peer:
            flags += ["--peer-to-peer"]
        config, namespace = load_train(flags)
        results[graph] = run(config, namespace.local or 8)
        print(f"{graph}: held-out {results[graph]['final_eval_loss']:.4f}", file=sys.stderr)
    if args.plot is not None:
        plot(results, args.plot)
    out = {"config": args.config, "steps": args.steps, "peer_to_peer": args.peer_to_peer, "results": results}
    print(json.dumps(out, indent=2) if args.json else json.dumps({g: r["final_eval_loss"] for g, r in results.items()}))
    return out


if __name__ == "__main__":
    main()
