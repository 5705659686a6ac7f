"""deploy/k8s and deploy/gcp, checked without kubectl or gcloud: the manifests hang together, the worker
command uses only flags `worker serve` has, readiness is the gRPC health service, the token comes from a
Secret, and the GCP firewall opens the port to the coordinator alone."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import yaml

from gradwire.cliconfig import subcommand_parser
from gradwire.transport import SERVICE_NAME
from gradwire.worker.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def serve_flags() -> set[str]:
    serve = subcommand_parser(build_parser(), "serve")
    return {opt for action in serve._actions for opt in action.option_strings}  # noqa: SLF001 - argparse keeps them there


def command_flags(argv: list[str], command: list[str], known: set[str]) -> dict[str, str]:
    """``argv``'s flags and their values, once it is shown to be ``command`` with only ``known`` flags."""
    assert argv[:2] == command, argv
    flags = {
        a: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "")
        for i, a in enumerate(argv)
        if a.startswith("--")
    }
    assert set(flags) <= known, set(flags) - known
    return flags


def assert_worker_command(argv: list[str]) -> dict[str, str]:
    return command_flags(argv, ["worker", "serve"], serve_flags())


def test_the_kubernetes_manifests_hang_together() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "workers.yaml").read_text())}
    service, sts = docs["Service"], docs["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == service["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"] == labels and service["spec"]["selector"].items() <= labels.items()
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    flags = assert_worker_command(container["args"])
    (port,) = container["ports"]
    assert int(flags["--port"]) == port["containerPort"] == container["readinessProbe"]["grpc"]["port"]
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    (token,) = [e for e in container["env"] if e["name"] == "GRADWIRE_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"]["name"] == "gradwire-token"
    mount = container["volumeMounts"][0]["mountPath"]
    assert flags["--tls-cert"].startswith(mount) and flags["--tls-key"].startswith(mount)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_gcp_recipe_is_valid_bash_and_opens_the_port_to_the_coordinator_only() -> None:
    script = ROOT / "deploy" / "gcp" / "create-workers.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert re.search(r'--source-ranges "\$COORDINATOR_IP/32"', text) and '--allow "tcp:$PORT"' in text
    run = re.search(r"^\s+worker serve (.*?)\nSCRIPT", text, re.MULTILINE | re.DOTALL).group(1)  # the VM's docker run
    argv = ["worker", "serve", *shlex.split(run.replace("\\\n", " ").replace("$PORT", "50051"))]
    flags = assert_worker_command(argv)
    assert {"--token-file", "--tls-cert", "--tls-key"} <= set(flags)


def train_flags() -> set[str]:
    from gradwire.coordinator.cli import build_parser as coordinator_parser

    train = subcommand_parser(coordinator_parser(), "train")
    return {opt for action in train._actions for opt in action.option_strings}  # noqa: SLF001


def assert_coordinator_command(argv: list[str]) -> dict[str, str]:
    """A `coordinator train` command a supervisor re-runs as it is: only flags the command has, and
    --resume-from auto, so that every start continues the run in --output-dir (or starts it)."""
    flags = command_flags(argv, ["coordinator", "train"], train_flags())
    assert flags["--resume-from"] == "auto" and flags["--output-dir"]
    return flags


def test_the_kubernetes_coordinator_restarts_on_its_run_directory() -> None:
    (sts,) = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "coordinator.yaml").read_text())
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Always"
    (container,) = pod["containers"]
    flags = assert_coordinator_command(container["args"])
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert flags["--output-dir"].startswith(mounts[claim["metadata"]["name"]] + "/")  # the run outlives the pod
    (token,) = [e for e in container["env"] if e["name"] == "GRADWIRE_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"]["name"] == "gradwire-token"
    assert flags["--tls-ca"].startswith(mounts["ca"])
    workers = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "workers.yaml").read_text())
    service = next(d for d in workers if d["kind"] == "Service")["metadata"]["name"]
    assert all(f".{service}:" in address for address in flags["--workers"].split(","))


def test_the_systemd_unit_restarts_the_same_command() -> None:
    import configparser

    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string((ROOT / "deploy" / "systemd" / "gradwire-coordinator.service").read_text())
    service = unit["Service"]
    assert service["Restart"] in ("on-failure", "always") and int(service["RestartSec"]) > 0
    argv = shlex.split(service["ExecStart"].replace("\\\n", " "))
    assert argv[0].endswith("/coordinator")
    assert_coordinator_command(["coordinator", *argv[1:]])
    assert unit["Install"]["WantedBy"] == "multi-user.target"
