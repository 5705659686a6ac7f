"""Charts of a run from its ``metrics.jsonl``: what ``coordinator report OUTPUT_DIR`` draws.

    loss.png            training loss per step (and held-out ``eval_loss`` where it was measured)
    loss_vs_bytes.png   loss against the bytes the run has moved so far, up + down, on a log axis:
                        the trade-off the codec exists for
    step_time.png       where each step's time went: worker compute, the rest of the dispatch (network,
                        serialization, update replay), and the coordinator's aggregation

Figures are drawn on matplotlib's Agg canvas through ``Figure`` directly, not pyplot: no display is
needed, and no global pyplot state is touched (safe inside a long-running process or a test).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from gradwire.coordinator.metrics import METRICS_FILE, read_metrics

__all__ = ["REPORT_FILES", "write_report"]

REPORT_FILES = ("loss.png", "loss_vs_bytes.png", "step_time.png")

_SIZE = (8.0, 4.8)  # inches; at 120 dpi a 960x576 image
_DPI = 120
_COLORS = {"loss": "#1f77b4", "eval": "#d62728", "compute": "#2ca02c", "dispatch": "#ff7f0e", "aggregate": "#9467bd"}


def write_report(output_dir: Path | str, report_dir: Path | str | None = None) -> list[Path]:
    """Draw the charts of the run in ``output_dir`` into ``report_dir`` (default: ``output_dir``).

    Returns the written PNG paths, in ``REPORT_FILES`` order. Raises ``FileNotFoundError`` when there is
    no metrics file and ``ValueError`` when it holds no records.
    """
    output_dir = Path(output_dir)
    path = output_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {output_dir}: is it the --output-dir of a coordinator train run?"
        )
    records = _by_step(read_metrics(path))
    if not records:
        raise ValueError(f"{path} holds no metrics records: the run logged no step")
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
