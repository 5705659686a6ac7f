"""``benchmarks.quality`` end to end at toy size: every method asked for trains on the shipped corpus in stream
order, is evaluated and plotted, and the compressed local-SGD methods report their codec gap."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

# benchmarks/ is not an installed package: load the module from its file, whatever the working directory.
_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
_SPEC = importlib.util.spec_from_file_location("benchmarks_quality", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
quality = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(quality)


@pytest.mark.slow
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
    result = quality.main([*args, "--methods", "dense,averaging,sparseloco,peer", "--output-dir", str(out), "--json"])
    assert set(result["methods"]) == {"dense", "averaging", "sparseloco", "peer"} and result["device"] == "cpu"
    for name, r in result["methods"].items():
        assert math.isfinite(r["eval_loss"]) and math.isfinite(r["train_loss"]), name
        assert r["bytes_up_per_token"] > 0 and r["tokens"] == 2 * 4 * 2 * 32, name
        assert r["curve"] and r["curve"][-1]["eval_loss"] == r["eval_loss"], name
    dense, averaging, sparse = (result["methods"][m] for m in ("dense", "averaging", "sparseloco"))
    assert (dense["rounds"], averaging["rounds"], sparse["rounds"]) == (4, 2, 2)
    # The codec gap: compressed less uncompressed local SGD at the same H, in points of the gap to dense.
    peer = result["methods"]["peer"]
    assert averaging["inner_steps"] == sparse["inner_steps"] == peer["inner_steps"] == 2
    for name, r in (("sparseloco", sparse), ("peer", peer)):
        gap = r["codec_gap_points"]
        assert math.isfinite(gap) and result["codec_gap_points"][name] == gap, name
        assert gap == pytest.approx(100 * (r["loss_gap_vs_dense"] - averaging["loss_gap_vs_dense"])), name
    assert "codec_gap_points" not in averaging and "codec_gap_points" not in dense
    assert peer["settings"]["use_dct"] is False and peer["settings"]["topk"] == 64
    # The shipped complete works, decompressed once into the output dir; no token trained twice.
    data = result["data"]
    assert Path(data["corpus"]) == out / "data" / "shakespeare_complete.txt" and Path(data["corpus"]).is_file()
    assert data["corpus_tokens"] > 1_500_000 and data["each_token_at_most_once"]
    assert data["tokens_read_per_method"] == result["tokens_per_method"] + 1 <= data["train_tokens"]
    # Uncompressed float32 pseudo-gradients once per H = 2 steps: H times fewer bytes than dense, less framing.
    assert 1.8 < averaging["uplink_reduction_vs_dense"] <= 2
    assert dense["loss_gap_vs_dense"] == 0 and 0.9 < dense["uplink_reduction_vs_dense"] <= 1
    assert sparse["uplink_reduction_vs_dense"] > 100
    assert (out / "loss_vs_bytes.png").stat().st_size > 0 and (out / "results.md").is_file()
    assert '"methods"' in capsys.readouterr().out  # --json: the object on stdout


def test_quality_benchmark_trains_on_a_given_text_and_says_when_tokens_repeat(tmp_path, capsys):
    text = tmp_path / "small.txt"
    text.write_text("To be, or not to be, that is the question.\n\n" * 85)  # ~1,300 tokens, 1,056 held out
    out = tmp_path / "quality"
    args = ["--model", "gpt-tiny", "--steps-total", "4", "--batch-size", "2", "--sequence-length", "32"]
    overrides = ["--set", "dense.min_lr_ratio=0.1"]  # dense's own value: recorded, for benchmarks.seeds
    result = quality.main(
        [*args, "--methods", "dense", *overrides, "--data", str(text), "--output-dir", str(out), "--json"]
    )
    assert result["methods"]["dense"]["overrides"] == {"min_lr_ratio": 0.1}
    data = result["data"]
    assert data["corpus"] == str(text) and data["train_tokens"] < data["tokens_read_per_method"]
    assert not data["each_token_at_most_once"] and data["passes"] > 1
    assert "seen more than once" in capsys.readouterr().err
    assert math.isfinite(result["methods"]["dense"]["eval_loss"])
