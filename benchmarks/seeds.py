"""Over several seeds: how far is each method from dense training, and how sure is that?

    for S in 0 1 2 3; do
        python -m benchmarks.quality --steps-total 300 --seed $S --methods dense,gradient --output-dir runs/q/s$S
        python -m benchmarks.quality --steps-total 300 --seed $S --methods gradient --set gradient.topk=39 \
            --output-dir runs/q/k39-s$S
    done
    python -m benchmarks.seeds runs/q/* --json

Reads ``benchmarks.quality`` results (each its ``--output-dir``, the ``results.json`` in it, or what ``--json``
printed), pairs every run of a method with the ``dense`` run of the same seed and setup, and reports for each
method and its ``--set`` overrides: the held-out loss and the gap to dense at each seed, the mean gap, its
standard error over the seeds, the uplink reduction, and whether the mean meets the method's target
(``benchmarks.quality.TARGETS``). One JSON object (``--json``) or a table.

Why: at 300 steps a gradient-mode setting's gap to dense moved by up to a point from seed to seed
(docs/benchmarks.md), as much as the differences two seeds were asked to settle. The standard error says
which differences a set of seeds can tell apart.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.quality import TARGETS

# What makes two runs comparable: the same model, tokens and workers.
SETUP = ("model", "steps_total", "batch_size", "sequence_length", "workers")


class SeedsError(ValueError):
    """Runs that cannot be paired or summed up (another setup, a method run twice at one seed)."""


def load(path: Path) -> dict[str, Any]:
    """One ``benchmarks.quality`` result: a folder holding ``results.json``, that file, or ``--json``'s output
    (its last line)."""
    if path.is_dir():
        path = path / "results.json"
    text = path.read_text().strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[-1])


def label(method: str, overrides: Mapping[str, Any]) -> str:
    """``gradient`` or ``gradient (topk=39)``: the method and its overrides, sorted."""
    if not overrides:
        return method
    return f"{method} ({', '.join(f'{k}={json.dumps(v)}' for k, v in sorted(overrides.items()))})"


def summarize(results: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Every method's gap to dense over the seeds it ran at (pure: from the results' objects).

    The gap at a seed is ``(loss - dense loss) / dense loss`` against the dense run of that seed; a seed with no
    dense run leaves that method's run out (``unpaired``). Raises ``SeedsError`` for runs of different setups
    or one method (with the same overrides) twice at a seed."""
    results = list(results)
    if not results:
        raise SeedsError("no runs given")
    setup = {k: results[0].get(k) for k in SETUP}
    dense: dict[int, float] = {}
    runs: dict[str, dict[str, Any]] = {}
    for r in results:
        other = {k: r.get(k) for k in SETUP}
        if other != setup:
            diff = {k: (setup[k], other[k]) for k in SETUP if setup[k] != other[k]}
            raise SeedsError(f"runs of different setups cannot be paired: {diff}")
        seed = int(r["seed"])
        for method, m in r["methods"].items():
            overrides = m.get("overrides") or {}
            if method == "dense" and not overrides:
                if seed in dense and dense[seed] != m["eval_loss"]:
                    raise SeedsError(f"two dense runs at seed {seed} end apart: {dense[seed]} and {m['eval_loss']}")
                dense[seed] = m["eval_loss"]
                continue
            name = label(method, overrides)
            entry = runs.setdefault(name, {"method": method, "overrides": dict(overrides), "seeds": {}})
            if seed in entry["seeds"]:
                raise SeedsError(f"{name} ran twice at seed {seed}")
            entry["seeds"][seed] = (m["eval_loss"], m["uplink_reduction_vs_dense"])
    methods, unpaired = {}, []
    for name, entry in sorted(runs.items()):
        paired = {s: v for s, v in sorted(entry["seeds"].items()) if s in dense}
        unpaired += [{"method": name, "seed": s} for s in sorted(entry["seeds"]) if s not in dense]
        if paired:
            methods[name] = _method(entry["method"], entry["overrides"], paired, dense)
    return {
        "setup": setup,
        "dense": {str(s): dense[s] for s in sorted(dense)},
        "methods": methods,
        "unpaired": unpaired,
    }


def _method(
    method: str, overrides: dict[str, Any], runs: dict[int, tuple[float, float]], dense: Mapping[int, float]
) -> dict[str, Any]:
    gaps = {s: (loss - dense[s]) / dense[s] for s, (loss, _) in runs.items()}
    mean = statistics.fmean(gaps.values())
    stderr = statistics.stdev(gaps.values()) / math.sqrt(len(gaps)) if len(gaps) > 1 else None
    reduction = statistics.fmean(r for _, r in runs.values())
    out: dict[str, Any] = {
        "method": method,
        "overrides": overrides,
        "seeds": sorted(runs),
        "eval_loss": {str(s): loss for s, (loss, _) in runs.items()},
        "gap": {str(s): g for s, g in gaps.items()},
        "mean_gap": mean,
        "stderr": stderr,
        "uplink_reduction_vs_dense": reduction,
    }
    if method in TARGETS:
        max_gap, min_reduction = TARGETS[method]
        out["target"] = {"max_loss_gap": max_gap, "min_uplink_reduction": min_reduction}
        out["meets_target"] = mean <= max_gap and reduction >= min_reduction
    return out


def table(summary: Mapping[str, Any]) -> str:
    seeds = sorted({int(s) for s in summary["dense"]})
    lines = [
        "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean gap vs dense | standard error | "
        "x fewer uplink bytes than dense |",
        "|---|" + "---|" * len(seeds) + "---|---|---|",
        "| dense | " + " | ".join(f"{summary['dense'][str(s)]:.4f}" for s in seeds) + " | - | - | 1x |",
    ]
    for name, m in summary["methods"].items():
        cells = [
            f"{m['eval_loss'][str(s)]:.4f} ({100 * m['gap'][str(s)]:+.2f}%)" if str(s) in m["gap"] else "-"
            for s in seeds
        ]
        stderr = f"{100 * m['stderr']:.2f} pt" if m["stderr"] is not None else "-"
        lines.append(
            f"| {name} | {' | '.join(cells)} | {100 * m['mean_gap']:+.2f}% | {stderr} | "
            f"{m['uplink_reduction_vs_dense']:,.0f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="benchmarks.quality output folders or their JSON")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout; the table to stderr")
    args = parser.parse_args(argv)
    try:
        summary = summarize(load(p) for p in args.runs)
    except (OSError, KeyError, json.JSONDecodeError, SeedsError) as e:
        parser.error(str(e))
    print(table(summary), file=sys.stderr if args.json else sys.stdout)
    if args.json:  # the object alone on stdout
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
