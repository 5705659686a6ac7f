"""``--config FILE.yaml`` for ``coordinator train`` and ``worker serve``: every shipped file in configs/ parses
through the code the commands use; typed flags beat file values; errors name the key and the file.
Nothing here trains or serves. Also ``coordinator report``'s dispatch."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import yaml

from gradwire.coordinator import cli as coordinator_cli
from gradwire.coordinator.cli import load_train
from gradwire.coordinator.config import AUTO_SETTINGS, TrainConfig
from gradwire.worker import cli as worker_cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))
FIELDS = dataclasses.fields(TrainConfig)
WITH_CHOICES = [f.name for f in FIELDS if "choices" in f.metadata]
# Numbers alone; --rank also takes a word (fit), and says so (test_rank_takes_a_number_or_fit).
NUMERIC = [f.name for f in FIELDS if type(TrainConfig().to_dict()[f.name]) in (int, float) and "str" not in f.type]


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def fails(capsys: pytest.CaptureFixture[str], parse, argv: list[str]) -> str:
    """Run a parse that must exit with status 2 (argparse's usage error); return its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_the_example_configs_ship() -> None:
    names = {p.name for p in SHIPPED}
    assert {"opt-125m-wikitext103.yaml", "gpt-10m-shakespeare.yaml", "local-demo.yaml", "worker.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_parses(path: Path) -> None:
    keys = set(yaml.safe_load(path.read_text()))
    if path.name.startswith("worker"):
        args = worker_cli.parse_args(["serve", "--config", str(path)])
        assert args.port is not None
    else:
        config, args = load_train(["train", "--config", str(path)])
        assert isinstance(config, TrainConfig)
        assert (args.workers is None) != (args.local is None)
    assert set(args.config_keys.values()) == keys  # every key was used; none was shadowed


def test_the_example_configs_say_what_their_names_promise() -> None:
    opt, _ = load_train(["train", "--config", str(CONFIGS / "opt-125m-wikitext103.yaml")])
    assert (opt.model, opt.data, opt.data_config, opt.outer_optimizer) == (
        "facebook/opt-125m",
        ("wikitext",),
        "wikitext-103-raw-v1",
        "signsgd",
    )
    assert (opt.topk, opt.target_chunk, opt.wandb_project) == (32, 64, "gradwire") and opt.learning_rate < 1e-3
    gpt, args = load_train(["train", "--config", str(CONFIGS / "gpt-10m-shakespeare.yaml")])
    assert (gpt.model, gpt.data, args.workers) == ("gpt-10m", (), "gpu1:50051,gpu2:50051")
    demo, args = load_train(["train", "--config", str(CONFIGS / "local-demo.yaml")])
    assert (demo.model, demo.steps, args.local, args.workers) == ("gpt-tiny", 50, 2, None)
    worker = worker_cli.parse_args(["serve", "--config", str(CONFIGS / "worker.yaml")])
    assert (worker.port, worker.host, worker.device) == (50051, "[::]", "cpu" if not _cuda() else "cuda:0")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_typed_flags_beat_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "local: 2\nsteps: 7\nlearning_rate: 0.01\ntopk: 16\nno_dct: true\ndata: [a.txt, b.txt]\nlog_level: DEBUG\n",
    )
    config, args = load_train(
        ["train", "--config", path, "--steps", "9", "--topk", "32", "--use-dct", "--workers", "h:1"]
    )
    assert (config.steps, config.topk, config.use_dct) == (9, 32, True)  # typed, even when equal to the default
    assert (config.learning_rate, config.data, args.log_level) == (0.01, ("a.txt", "b.txt"), "DEBUG")  # from the file
    assert (args.workers, args.local) == ("h:1", None)  # --workers pushes out the file's local: 2
    assert set(args.config_keys) == {"learning_rate", "data", "log_level"}


def test_yaml_spellings(tmp_path: Path) -> None:
    # Dashed keys; 3e-4 (a string to YAML 1.1) converted as the flag would; one path or a list; workers as a list.
    path = write(
        tmp_path,
        "workers: [a:1, b:2]\nlearning-rate: 3e-4\ndata: corpus.txt\nmax_failed_rounds: '5'\ntokenizer: null\n",
    )
    config, args = load_train(["train", "--config", path])
    assert (config.learning_rate, config.data, config.max_failed_rounds, config.tokenizer) == (
        3e-4,
        ("corpus.txt",),
        5,
        None,
    )
    assert args.workers == "a:1,b:2"
    config, _ = load_train(["train", "--config", write(tmp_path, "", "empty.yaml"), "--local", "1"])
    assert config == TrainConfig()


def test_unknown_key_is_named_with_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "local: 1\noptimizer: sgd\n")
    err = fails(capsys, load_train, ["train", "--config", path])
    assert "unknown key 'optimizer'" in err and "run.yaml" in err and "outer_optimizer" in err  # the suggestion
    err = fails(
        capsys, worker_cli.parse_args, ["serve", "--config", write(tmp_path, "port: 1\nthreads: 4\n", "w.yaml")]
    )
    assert "unknown key 'threads'" in err and "w.yaml" in err


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("steps: ten", "'steps'"),  # not an integer
        ("steps: 2.5", "'steps'"),
        ("steps: 0", "'steps'"),  # TrainConfig's own check, blamed on the key
        ("learning_rate: [1]", "'learning_rate'"),
        ("use_dct: 1", "'use_dct'"),  # booleans are true/false
        ("outer_optimizer: lion", "'outer_optimizer'"),
        ("momentum: 0.5", "'momentum'"),  # only with sgd: a cross-field check, still named
        ("bins: 300", "'bins'"),
        ("data: [a.txt, [b.txt]]", "'data'"),
        ("tokenizer: {name: gpt2}", "'tokenizer'"),
        ("model: null", "'model'"),
        ("log_level: LOUD", "'log_level'"),
    ],
)
def test_bad_value_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, key: str) -> None:
    err = fails(capsys, load_train, ["train", "--config", write(tmp_path, f"local: 1\n{text}\n")])
    assert key in err and "run.yaml" in err, err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("local: 0", "'local'"),
        ("local: 1\nworkers: a:1", "exclude each other"),
        ("local: 1\nuse_dct: true\nno_dct: true", "'no_dct'"),
        ("- local: 1", "a mapping"),
        ("local: [1", "not valid YAML"),
        ("steps: 3", "--listen or --local is required"),
    ],
)
def test_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    assert message in fails(capsys, load_train, ["train", "--config", write(tmp_path, text + "\n")])


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.yaml")
    err = fails(capsys, load_train, ["train", "--config", missing, "--local", "1"])
    assert f"--config {missing}: no such file" in err
    assert "no such file" in fails(capsys, worker_cli.parse_args, ["serve", "--config", missing])


def test_worker_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "port: 0\nhost: 127.0.0.1\ndevice: cpu\nmax-message-mb: 64\ngrace: 1.5\n", "worker.yaml")
    args = worker_cli.parse_args(["serve", "--config", path, "--grace", "2"])
    assert (args.port, args.host, args.device, args.max_message_mb, args.grace) == (0, "127.0.0.1", "cpu", 64, 2.0)
    err = fails(capsys, worker_cli.parse_args, ["serve", "--config", write(tmp_path, "port: 70000\n", "bad.yaml")])
    assert "key 'port'" in err and "bad.yaml" in err
    assert "--port is required" in fails(
        capsys, worker_cli.parse_args, ["serve", "--config", write(tmp_path, "grace: 1\n", "noport.yaml")]
    )
    assert worker_cli.parse_args(["serve", "--port", "5"]).config_keys == {}  # no --config: as before


def test_report_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls = []

    def write_report(output_dir: str, report_dir: str | None = None) -> list[Path]:
        calls.append((output_dir, report_dir))
        return [Path(output_dir) / "loss.png", Path(output_dir) / "step_time.png"]

    # A stand-in for gradwire.coordinator.report: the command's contract, not the charts, is under test.
    monkeypatch.setitem(sys.modules, "gradwire.coordinator.report", types.SimpleNamespace(write_report=write_report))
    assert coordinator_cli.main(["report", str(tmp_path)]) == 0
    assert calls == [(str(tmp_path), None)]
    assert capsys.readouterr().out.split() == [str(tmp_path / "loss.png"), str(tmp_path / "step_time.png")]
    assert coordinator_cli.main(["report", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_every_setting_is_a_yaml_key(tmp_path: Path) -> None:
    # A run's recorded settings (a checkpoint's to_dict()) are themselves a valid --config file.
    settings = TrainConfig().to_dict()
    path = write(tmp_path, yaml.safe_dump({"local": 1, **settings}))
    config, args = load_train(["train", "--config", path])
    assert config == TrainConfig()
    assert set(args.config_keys) == {f.name for f in FIELDS} | {"local"}
    # Dashed spellings too; "auto" (or null) for the mode-dependent ones.
    dashed = {name.replace("_", "-"): value for name, value in settings.items()}
    dashed.update({name.replace("_", "-"): "auto" for name in AUTO_SETTINGS})
    config, _ = load_train(["train", "--config", write(tmp_path, yaml.safe_dump({"local": 1, **dashed}), "d.yaml")])
    assert config == TrainConfig()


def test_the_choices_are_those_of_the_settings() -> None:
    assert set(WITH_CHOICES) == {
        "outer_optimizer",
        "inner_optimizer",
        "lr_schedule",
        "inner_lr_schedule",
        "values",
        "index_coding",
        "aggregate",
        "replay_precision",
        "balance",
        "downlink",
        "relay",
        "spot_check_by",
        "overlap_update",
        "msgn",
        "topology",
    }


@pytest.mark.parametrize("name", WITH_CHOICES)
def test_every_setting_with_choices_refuses_others_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    field = next(f for f in FIELDS if f.name == name)
    err = fails(capsys, load_train, ["train", "--config", write(tmp_path, f"local: 1\n{name}: not-a-choice\n")])
    assert f"key {name!r}: must be one of {', '.join(field.metadata['choices'])}" in err and "run.yaml" in err, err


@pytest.mark.parametrize("name", NUMERIC)
def test_every_numeric_setting_refuses_text_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    err = fails(capsys, load_train, ["train", "--config", write(tmp_path, f"local: 1\n{name}: lots\n")])
    assert f"key {name!r}: expected" in err and "run.yaml" in err, err


def test_rank_takes_a_number_or_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = load_train(["train", "--config", write(tmp_path, "local: 1\ninner_steps: 30\nrank: 6\n")])
    assert config.rank == 6 and config.codec_config().rank == 6
    config, _ = load_train(["train", "--config", write(tmp_path, "local: 1\nrank: fit\n")])
    assert config.codec_config().rank_fits_topk
    err = fails(capsys, load_train, ["train", "--config", write(tmp_path, "local: 1\nrank: lots\n")])
    assert "key 'rank': --rank must be a non-negative integer or 'fit', got 'lots'" in err, err


def test_local_device_is_a_flag_and_a_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, args = load_train(["train", "--local", "2"])
    assert args.local_device == "auto"
    _, args = load_train(["train", "--config", write(tmp_path, "local: 2\nlocal_device: cpu\n")])
    assert args.local_device == "cpu"
    err = fails(capsys, load_train, ["train", "--config", write(tmp_path, "local: 2\nlocal_device: tpu\n")])
    assert "key 'local_device': must be one of auto, cpu, cuda" in err


def test_every_worker_flag_is_a_key(tmp_path: Path) -> None:
    text = "port: 0\nnproc_per_node: auto\nnode-mode: local-sgd\njoin: coordinator:7000\ntunnel: true\n"
    args = worker_cli.parse_args(["serve", "--config", write(tmp_path, text, "worker.yaml")])
    assert (args.nproc_per_node, args.node_mode, args.join, args.tunnel) == (
        "auto",
        "local-sgd",
        "coordinator:7000",
        True,
    )
