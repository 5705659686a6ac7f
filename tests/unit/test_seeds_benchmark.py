"""``benchmarks.seeds``: runs of ``benchmarks.quality`` paired with dense by seed, summed up per method and
overrides with the standard error of the mean gap, and refused where they cannot be paired."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from benchmarks import seeds

SETUP = {"model": "gpt-5m", "steps_total": 300, "batch_size": 4, "sequence_length": 128, "workers": 2}


def run(seed: int, **methods: tuple[float, float, dict]) -> dict:
    """A quality result at ``seed``: each method's (held-out loss, uplink reduction, overrides)."""
    return {
        **SETUP,
        "seed": seed,
        "methods": {
            name.replace("_", "-"): {"eval_loss": loss, "uplink_reduction_vs_dense": x, "overrides": o}
            for name, (loss, x, o) in methods.items()
        },
    }


def test_each_method_and_overrides_is_paired_with_its_seeds_dense_run():
    k39 = {"topk": 39}
    results = [
        run(0, dense=(5.0, 1.0, {}), gradient=(5.05, 274.0, {})),
        run(1, dense=(4.0, 1.0, {}), gradient=(3.98, 276.0, {})),
        run(0, gradient=(4.95, 256.0, k39)),  # another run, the same seed: its own row
        run(1, gradient=(4.0, 256.0, k39)),
        run(2, gradient=(9.0, 256.0, k39)),  # no dense run at seed 2: left out, and said
    ]
    summary = seeds.summarize(results)
    assert summary["setup"] == SETUP and summary["dense"] == {"0": 5.0, "1": 4.0}
    assert set(summary["methods"]) == {"gradient", "gradient (topk=39)"}
    default = summary["methods"]["gradient"]
    gaps = [0.05 / 5.0, -0.02 / 4.0]
    assert default["gap"] == pytest.approx({"0": gaps[0], "1": gaps[1]})
    assert default["mean_gap"] == pytest.approx(statistics.fmean(gaps))
    assert default["stderr"] == pytest.approx(statistics.stdev(gaps) / math.sqrt(2))
    assert default["uplink_reduction_vs_dense"] == pytest.approx(275.0) and default["seeds"] == [0, 1]
    # gradient mode's target: no worse than dense at 250x or more; a mean of +0.25% misses it
    assert default["target"] == {"max_loss_gap": 0.0, "min_uplink_reduction": 250.0} and not default["meets_target"]
    more = summary["methods"]["gradient (topk=39)"]
    assert more["overrides"] == k39 and more["seeds"] == [0, 1] and more["meets_target"]
    assert more["mean_gap"] == pytest.approx(statistics.fmean([-0.05 / 5.0, 0.0]))
    assert summary["unpaired"] == [{"method": "gradient (topk=39)", "seed": 2}]
    text = seeds.table(summary)
    assert "| gradient (topk=39) | 4.9500 (-1.00%) | 4.0000 (+0.00%) | -0.50% |" in text


def test_one_seed_has_no_standard_error_and_methods_without_a_target_have_none():
    summary = seeds.summarize([run(3, dense=(5.0, 1.0, {}), diloco=(5.5, 30.0, {}))])
    diloco = summary["methods"]["diloco"]
    assert diloco["stderr"] is None and diloco["mean_gap"] == pytest.approx(0.1)
    assert "target" not in diloco and "meets_target" not in diloco
    assert "| diloco | 5.5000 (+10.00%) | +10.00% | - | 30x |" in seeds.table(summary)


@pytest.mark.parametrize(
    ("results", "why"),
    [
        ([run(0, dense=(5.0, 1.0, {})), {**run(0, gradient=(5.1, 274.0, {})), "steps_total": 1200}], "setups"),
        ([run(0, dense=(5.0, 1.0, {}), gradient=(5.1, 274.0, {})), run(0, gradient=(5.2, 274.0, {}))], "twice"),
        ([run(0, dense=(5.0, 1.0, {})), run(0, dense=(5.1, 1.0, {}))], "end apart"),
        ([], "no runs"),
    ],
)
def test_runs_that_cannot_be_paired_are_refused(results, why):
    with pytest.raises(seeds.SeedsError, match=why):
        seeds.summarize(results)


def test_the_command_reads_output_folders_and_json_lines(tmp_path, capsys):
    folder = tmp_path / "s0"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(run(0, dense=(5.0, 1.0, {}))))
    printed = tmp_path / "s0-gradient.json"  # what `benchmarks.quality --json` printed: its last line
    printed.write_text("\n" + json.dumps(run(0, gradient=(5.0, 274.0, {}))) + "\n")
    summary = seeds.main([str(folder), str(printed), "--json"])
    assert summary["methods"]["gradient"]["mean_gap"] == 0.0
    assert json.loads(capsys.readouterr().out.strip()) == json.loads(json.dumps(summary))
    with pytest.raises(SystemExit):  # a run that is not there: a clear usage error, not a traceback
        seeds.main([str(tmp_path / "missing")])
    assert "missing" in capsys.readouterr().err
