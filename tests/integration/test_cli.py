"""The commands as a user runs them: `coordinator train --local 2` with worker subprocesses, and --help."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from gradwire.coordinator.cli import build_parser, config_from_args
from gradwire.coordinator.config import AUTO_SETTINGS, RUN, SECTIONS, TrainConfig
from gradwire.coordinator.metrics import METRIC_KEYS, read_metrics

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.slow
def test_coordinator_with_two_local_worker_processes_trains(tmp_path):
    out = tmp_path / "run"
    token = tmp_path / "token"
    token.write_text("local-demo-token-0123456789abcdef\n")  # the local workers require it (handed over in their env)
    proc = _run(
        "gradwire.coordinator",
        "train",
        "--local",
        "2",
        "--model",
        "gpt-tiny",
        "--steps",
        "30",
        "--batch-size",
        "4",
        "--sequence-length",
        "32",
        "--output-dir",
        str(out),
        "--no-progress",
        "--token-file",
        str(token),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    assert len(records) == 30 and all(set(METRIC_KEYS) <= set(r) for r in records)
    assert all(r["successful_workers"] == 2 for r in records)
    assert np.mean([r["loss"] for r in records[-3:]]) < np.mean([r["loss"] for r in records[:3]]) - 0.5
    state_bytes = records[0]["bytes_down"] / 2  # round 1 pushed the whole state to both workers
    assert all(r["bytes_down"] < state_bytes / 20 for r in records[1:])
    assert (out / "final" / "model.safetensors").exists() and (out / "checkpoints" / "latest").exists()
    assert "step 30: loss" in proc.stdout
    report = _run("gradwire.coordinator", "report", str(out), timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    pngs = [line for line in report.stdout.splitlines() if line.endswith(".png")]
    assert len(pngs) == 3
    for png in pngs:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "command",
    [
        ("gradwire.coordinator", "--help"),
        ("gradwire.coordinator", "train", "--help"),
        ("gradwire.worker", "serve", "--help"),
    ],
)
def test_help(command):
    proc = _run(*command, timeout=60)
    assert proc.returncode == 0 and "usage:" in proc.stdout
    if "train" in command:
        for flag in (
            "--workers",
            "--local",
            "--model",
            "--data",
            "--steps",
            "--batch-size",
            "--sequence-length",
            "--learning-rate",
            "--outer-optimizer",
            "--topk",
            "--target-chunk",
            "--use-dct",
            "--no-dct",
            "--bins",
            "--no-compression",
            "--output-dir",
            "--checkpoint-dir",
            "--checkpoint-every",
            "--resume-from",
            "--seed",
        ):
            assert flag in proc.stdout, flag


def test_flags_build_the_config():
    args = build_parser().parse_args(
        [
            "train",
            "--local",
            "2",
            "--model",
            "gpt-tiny",
            "--no-dct",
            "--topk",
            "16",
            "--data",
            "a.txt",
            "b.txt",
            "--outer-optimizer",
            "sgd",
            "--momentum",
            "0.9",
        ]
    )
    config = config_from_args(args)
    assert (config.use_dct, config.topk, config.data, config.outer_optimizer, config.momentum) == (
        False,
        16,
        ("a.txt", "b.txt"),
        "sgd",
        0.9,
    )
    assert config.codec_config().use_dct is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps"),
        (["--outer-optimizer", "signsgd", "--momentum", "0.5"], "--momentum"),
        (["--topk", "5000"], "topk"),
        (["--bins", "300"], "bins"),
    ],
)
def test_bad_flags_name_the_flag(argv, message):
    proc = _run("gradwire.coordinator", "train", "--local", "1", *argv, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def test_a_sequence_longer_than_the_model_is_a_flag_error(tmp_path):
    proc = _run(
        "gradwire.coordinator",
        "train",
        "--local",
        "1",
        "--model",
        "gpt-tiny",
        "--sequence-length",
        "512",
        "--output-dir",
        str(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 2 and "--sequence-length 512" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["gradwire.coordinator", "train", "--local", "1", "--token", "abcdefghijklmnopq", "--token-file", "t.txt"],
            "not both",
        ),
        (
            ["gradwire.coordinator", "train", "--local", "1", "--token-file", "/nonexistent/token"],
            "--token-file /nonexistent/token: cannot read it",
        ),
        (
            ["gradwire.coordinator", "train", "--local", "1", "--tls-cert", "c.pem"],
            "--tls-cert and --tls-key go together",
        ),
        (
            ["gradwire.coordinator", "train", "--local", "1", "--tls-ca", "/nonexistent/ca.pem"],
            "--tls-ca /nonexistent/ca.pem: cannot read it",
        ),
        (["gradwire.worker", "serve", "--port", "0", "--token", "has space in it"], "printable ASCII without spaces"),
        (
            [
                "gradwire.worker",
                "serve",
                "--port",
                "0",
                "--tls-cert",
                "/nonexistent/c.pem",
                "--tls-key",
                "/nonexistent/k.pem",
            ],
            "cannot read it",
        ),
        (["gradwire.worker", "serve", "--port", "0", "--tls-client-ca", "ca.pem"], "needs --tls-cert"),
    ],
)
def test_bad_security_flags_name_the_flag(argv, message):
    proc = _run(*argv, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_zero_stage_outside_fsdp_is_refused_before_any_rank_starts():
    flags = ["--nproc-per-node", "2", "--node-mode", "local-sgd", "--node-shard", "optimizer"]
    proc = _run("gradwire.worker", "serve", "--port", "0", *flags, timeout=60)
    message = "--node-shard optimizer applies to --node-mode fsdp (or auto, where it picks fsdp), not local-sgd"
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def _help(*command: str) -> str:
    """``command --help`` as a user sees it, one line per flag (a wide terminal: no wrapping)."""
    proc = subprocess.run(
        [sys.executable, "-m", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**ENV, "COLUMNS": "10000"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _groups(text: str) -> dict[str, str]:
    """The blocks of a --help text by group title (``options``, then one per argument group)."""
    blocks, title = {}, None
    for line in text.splitlines():
        if re.fullmatch(r"[a-z][\w &()-]*:", line):
            title = line[:-1]
            blocks[title] = ""
        elif title is not None:
            blocks[title] += line + "\n"
    return blocks


def test_train_help_shows_every_setting_under_its_section():
    groups = _groups(_help("gradwire.coordinator", "train"))
    assert list(SECTIONS) == [t for t in groups if t in SECTIONS]  # in order, each titled by its section
    for title, about in SECTIONS.items():
        assert about in groups[title]
    # Each flag's entry: its line and the help that follows on the next, more indented, line.
    entries = {
        title: dict(re.findall(r"^  (--[a-z0-9-]+)(.*(?:\n {4,}.*)*)", block, re.M)) for title, block in groups.items()
    }
    flags = {title: set(found) for title, found in entries.items()}
    for field in dataclasses.fields(TrainConfig):
        section, flag = field.metadata["section"], "--" + field.name.replace("_", "-")
        assert flag in flags[section], (flag, section)
        entry = " ".join(entries[section][flag].split())
        assert field.metadata["help"] in entry, flag  # the metadata's help, word for word
        if field.name in AUTO_SETTINGS:
            assert entry.endswith("(default: auto)"), entry
    # Nothing else in the sections but the --use-dct pair and the run's progress flags.
    extra = {"--no-dct", "--no-progress", "--log-level"}
    named = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)}
    assert set().union(*(flags[t] for t in SECTIONS)) == named | extra
    assert {"--no-progress", "--log-level"} <= flags[RUN]


def test_train_help_says_what_is_required():
    text = " ".join(_help("gradwire.coordinator", "train").split())
    assert (
        "One of --workers, --workers-file, --listen or --local is required, on the command line or in the "
        "--config file." in text
    )
    assert "--local-device {auto,cpu,cuda}" in text


def test_worker_help_says_every_flag_is_a_config_key():
    text = " ".join(_help("gradwire.worker", "serve").split())
    assert "every flag of worker serve, its key the flag without dashes" in text
    assert "keys: port, host, device, max_message_mb, grace" not in text


def test_local_device_cuda_without_a_gpu_is_an_error_naming_the_flag(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = _run(
        "gradwire.coordinator",
        "train",
        "--local",
        "1",
        "--local-device",
        "cuda",
        "--output-dir",
        str(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 2 and "--local-device cuda: no CUDA device" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
