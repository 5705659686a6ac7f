"""``benchmarks.quality`` end to end at toy size: every method asked for trains, is evaluated and plotted."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

# benchmarks/ is not an installed package: load the module from its file, whatever the working directory.
_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
_SPEC = importlib.util.spec_from_file_location("benchmarks_quality", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
quality = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(quality)


def test_quality_benchmark_reports_every_method(tmp_path, capsys):
    out = tmp_path / "quality"
    args = [
        "--model",
        "gpt-tiny",
        "--steps-total",
        "4",
        "--inner-steps",
        "2",
        "--batch-size",
        "2",
        "--sequence-length",
        "32",
    ]
    result = quality.main([*args, "--methods", "dense,averaging,sparseloco", "--output-dir", str(out), "--json"])
    assert set(result["methods"]) == {"dense", "averaging", "sparseloco"}
    for name, r in result["methods"].items():
        assert math.isfinite(r["eval_loss"]) and math.isfinite(r["train_loss"]), name
        assert r["bytes_up_per_token"] > 0 and r["tokens"] == 2 * 4 * 2 * 32, name
        assert r["curve"] and r["curve"][-1]["eval_loss"] == r["eval_loss"], name
    dense, averaging, sparse = (result["methods"][m] for m in ("dense", "averaging", "sparseloco"))
    assert (dense["rounds"], averaging["rounds"], sparse["rounds"]) == (4, 2, 2)
    # Uncompressed float32 pseudo-gradients once per H = 2 steps: H times fewer bytes than dense, less framing.
    assert 1.8 < averaging["uplink_reduction_vs_dense"] <= 2
    assert dense["loss_gap_vs_dense"] == 0 and 0.9 < dense["uplink_reduction_vs_dense"] <= 1
    assert sparse["uplink_reduction_vs_dense"] > 100
    assert (out / "loss_vs_bytes.png").stat().st_size > 0 and (out / "results.md").is_file()
    assert '"methods"' in capsys.readouterr().out  # --json: the object on stdout
