"""Charts of a run from its ``metrics.jsonl``: what ``coordinator report OUTPUT_DIR`` draws.

    loss.png            training loss per step (and held-out ``eval_loss`` where it was measured)
    loss_vs_bytes.png   loss against the bytes the run has moved so far, up + down, on a log axis:
                        the trade-off the codec exists for
    step_time.png       where each step's time went: worker compute, the rest of the dispatch (network,
                        serialization, update replay), and the coordinator's aggregation

and, given several runs (``coordinator report RUN RUN ...``), what settles which way of syncing to use:

    compare.png         each run's last held-out loss (its training loss where it measured none) against its
                        uplink bytes per trained token, on a log axis, a point per run named by its directory

Figures are drawn on matplotlib's Agg canvas through ``Figure`` directly, not pyplot: no display is
needed, and no global pyplot state is touched (safe inside a long-running process or a test).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from gradwire.coordinator.metrics import METRICS_FILE, read_metrics

__all__ = ["COMPARE_FILE", "REPORT_FILES", "RunSummary", "summarize", "write_comparison", "write_report"]

REPORT_FILES = ("loss.png", "loss_vs_bytes.png", "step_time.png")
COMPARE_FILE = "compare.png"

_SIZE = (8.0, 4.8)  # inches; at 120 dpi a 960x576 image
_DPI = 120
_COLORS = {"loss": "#1f77b4", "eval": "#d62728", "compute": "#2ca02c", "dispatch": "#ff7f0e", "aggregate": "#9467bd"}


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """Where a run ended: its name, its last held-out loss (``held_out`` False: its last training loss, where
    it measured none), and the uplink bytes it sent per token it trained (all workers' over all tokens)."""

    name: str
    loss: float
    held_out: bool
    bytes_up_per_token: float
    steps: int


def summarize(output_dir: Path | str) -> RunSummary:
    """A run's ``RunSummary`` from its metrics (the errors of ``write_report`` where there are none)."""
    records = _records(Path(output_dir))
    eval_loss, loss = _column(records, "eval_loss"), _column(records, "loss")
    held_out = bool(np.isfinite(eval_loss).any())
    tokens = records[-1].get("total_tokens") or 0
    if tokens <= 0:
        raise ValueError(f"{output_dir}: its metrics count no trained token")
    up = float(np.nansum(_column(records, "bytes_up")))
    return RunSummary(
        Path(output_dir).resolve().name,
        _last_finite(eval_loss if held_out else loss),
        held_out,
        up / tokens,
        int(records[-1]["step"]),
    )


def write_comparison(output_dirs: Sequence[Path | str], report_dir: Path | str) -> tuple[Path, list[RunSummary]]:
    """Draw ``COMPARE_FILE`` of the runs in ``output_dirs`` into ``report_dir``; returns it and the runs'
    summaries, in the order given."""
    runs = [summarize(d) for d in output_dirs]
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=_SIZE, dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    for run in runs:
        ax.scatter(run.bytes_up_per_token, run.loss, marker="s" if run.held_out else "o", s=36)
        ax.annotate(run.name, (run.bytes_up_per_token, run.loss), textcoords="offset points", xytext=(5, 4))
    if all(r.bytes_up_per_token > 0 for r in runs):
        ax.set_xscale("log")
    ax.set_xlabel("uplink bytes per trained token (all workers)")
    ax.set_ylabel("last held-out loss (squares; circles: training loss)")
    ax.set_title(f"Loss against uplink bytes: {len(runs)} runs")
    ax.grid(alpha=0.3, which="both")
    fig.savefig(out / COMPARE_FILE)
    return out / COMPARE_FILE, runs


def _records(output_dir: Path) -> list[dict[str, Any]]:
    """The run's records, one per step; the errors ``write_report`` names."""
    path = output_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {output_dir}: is it the --output-dir of a coordinator train run?"
        )
    records = _by_step(read_metrics(path))
    if not records:
        raise ValueError(f"{path} holds no metrics records: the run logged no step")
    return records


def write_report(output_dir: Path | str, report_dir: Path | str | None = None) -> list[Path]:
    """Draw the charts of the run in ``output_dir`` into ``report_dir`` (default: ``output_dir``).

    Returns the written PNG paths, in ``REPORT_FILES`` order. Raises ``FileNotFoundError`` when there is
    no metrics file and ``ValueError`` when it holds no records.
    """
    output_dir = Path(output_dir)
    records = _records(output_dir)
    out = Path(report_dir) if report_dir is not None else output_dir
    out.mkdir(parents=True, exist_ok=True)
    drawers = (_loss, _loss_vs_bytes, _step_time)
    paths = []
    for name, draw in zip(REPORT_FILES, drawers):
        fig = Figure(figsize=_SIZE, dpi=_DPI, layout="constrained")
        draw(fig.add_subplot(), records)
        fig.savefig(out / name)
        paths.append(out / name)
    return paths


def _by_step(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    # A run resumed from an earlier checkpoint appends steps it had already logged; the later record of a
    # step is the one on the trajectory that continued.
    latest = {int(r["step"]): r for r in records if "step" in r}
    return [latest[s] for s in sorted(latest)]


def _column(records: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    """The values of ``key`` as floats, NaN where a record lacks it or logged null."""
    return np.array([float(r[key]) if r.get(key) is not None else math.nan for r in records], dtype=np.float64)


# ------------------------------------------------------------------------------------------- charts


def _loss(ax: Axes, records: Sequence[dict[str, Any]]) -> None:
    steps, loss = _column(records, "step"), _column(records, "loss")
    many = len(records) >= 50
    # With many steps the raw curve is noise around a trend: draw it faint and the moving average on top.
    ax.plot(
        steps,
        loss,
        color=_COLORS["loss"],
        lw=1.0,
        alpha=0.35 if many else 1.0,
        marker=None if many else "o",
        ms=3,
        label="train loss",
    )
    if many:
        window = max(5, len(records) // 25)
        ax.plot(
            steps,
            _moving_average(loss, window),
            color=_COLORS["loss"],
            lw=2.0,
            label=f"train loss, {window}-step average",
        )
    eval_loss = _column(records, "eval_loss")
    if np.isfinite(eval_loss).any():
        seen = np.isfinite(eval_loss)
        ax.plot(steps[seen], eval_loss[seen], color=_COLORS["eval"], lw=1.5, marker="s", ms=4, label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"Loss: {_last_finite(loss):.4f} at step {int(steps[-1])}")
    ax.grid(alpha=0.3)
    ax.legend()


def _loss_vs_bytes(ax: Axes, records: Sequence[dict[str, Any]]) -> None:
    moved = np.cumsum(_column(records, "bytes_up") + _column(records, "bytes_down"))
    loss = _column(records, "loss")
    ax.plot(
        moved, loss, color=_COLORS["loss"], lw=1.5, marker="o" if len(records) < 50 else None, ms=3, label="train loss"
    )
    eval_loss = _column(records, "eval_loss")
    if np.isfinite(eval_loss).any():
        seen = np.isfinite(eval_loss)
        ax.plot(moved[seen], eval_loss[seen], color=_COLORS["eval"], lw=1.5, marker="s", ms=4, label="held-out loss")
        ax.legend()
    if moved[-1] > 0:
        ax.set_xscale("log")  # the first round pushes the whole state: only a log axis shows the rest
    # Within one decade a log axis labels only minor ticks; both get byte units.
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _bytes(x)))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: _bytes(x) if _few_ticks(ax) else ""))
    ax.set_xlabel("bytes moved so far, coordinator <-> workers (up + down)")
    ax.set_ylabel("loss")
    ax.set_title(f"Loss vs traffic: {_bytes(moved[-1])} in {len(records)} step{'s' if len(records) != 1 else ''}")
    ax.grid(alpha=0.3, which="both")


def _step_time(ax: Axes, records: Sequence[dict[str, Any]]) -> None:
    steps, total = _column(records, "step"), _column(records, "step_time")
    dispatch, aggregate = _column(records, "dispatch_time"), _column(records, "aggregate_time")
    compute = np.nan_to_num(_column(records, "worker_compute_time"))  # absent in logs of older runs
    # worker_compute_time is the slowest worker's forward/backward/compress and happens inside the
    # dispatch; the rest of the dispatch is network, serialization and waiting.
    rest = np.clip(np.nan_to_num(dispatch) - compute, 0.0, None)
    aggregate = np.nan_to_num(aggregate)
    scale, unit = (1e3, "ms") if np.nanmedian(total) < 1.0 else (1.0, "s")
    parts = [
        ("worker compute (slowest worker)", compute, "compute"),
        ("dispatch: network, serialization, waiting", rest, "dispatch"),
        ("aggregate + outer step", aggregate, "aggregate"),
    ]
    if len(steps) <= 60:
        bottom = np.zeros_like(total)
        width = 0.8 * (np.min(np.diff(steps)) if len(steps) > 1 else 1.0)
        for label, values, color in parts:
            ax.bar(steps, values * scale, width, bottom=bottom * scale, color=_COLORS[color], label=label, linewidth=0)
            bottom = bottom + values
    else:  # bars a pixel wide alias into stripes: stacked areas read better
        ax.stackplot(
            steps,
            *(v * scale for _, v, _ in parts),
            labels=[p[0] for p in parts],
            colors=[_COLORS[p[2]] for p in parts],
            step="mid",
            linewidth=0,
        )
    ax.plot(
        steps,
        total * scale,
        color="black",
        lw=0.8,
        label="step time",
        drawstyle="default" if len(steps) <= 60 else "steps-mid",
    )
    # The first round (and any re-sync) pushes the whole state and can dwarf the rest: cap the axis there
    # and name the steps that go past it.
    typical = float(np.nanpercentile(total, 90))
    if typical > 0 and np.nanmax(total) > 3 * typical:
        top = 1.5 * typical
        ax.set_ylim(0, top * scale)
        over = [(int(s), t) for s, t in zip(steps, total) if t > top]
        note = ", ".join(f"step {s}: {t * scale:.0f} {unit}" for s, t in over[:3]) + (" ..." if len(over) > 3 else "")
        ax.text(0.01, 0.97, f"off the chart: {note}", transform=ax.transAxes, va="top", fontsize=8)
    shares = [float(np.nansum(v)) for _, v, _ in parts]
    spent = sum(shares) or 1.0
    ax.set_title(
        "Step time: "
        + ", ".join(f"{name} {100 * s / spent:.0f}%" for name, s in zip(("compute", "dispatch", "aggregate"), shares))
    )
    ax.set_xlabel("step")
    ax.set_ylabel(f"time per step ({unit})")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper right")


# ------------------------------------------------------------------------------------------- helpers


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` values, skipping NaN (a diverged step)."""
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    start = np.arange(len(values)) - window  # index before each window
    prev_sums = np.where(start >= 0, sums[np.maximum(start, 0)], 0.0)
    prev_counts = np.where(start >= 0, counts[np.maximum(start, 0)], 0)
    n = counts - prev_counts
    return np.where(n > 0, (sums - prev_sums) / np.maximum(n, 1), np.nan)


def _few_ticks(ax: Axes) -> bool:
    """Whether the log x axis spans less than a decade (so it has no labelled major tick of its own)."""
    low, high = ax.get_xlim()
    return low > 0 and high / low < 10


def _last_finite(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if len(finite) else math.nan


def _bytes(n: float) -> str:
    """1 KB = 1000 B: network traffic is counted in decimal units."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
