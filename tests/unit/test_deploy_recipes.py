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


def assert_worker_command(argv: list[str]) -> dict[str, str]:
    assert argv[:2] == ["worker", "serve"], argv
    flags = {
        a: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "")
        for i, a in enumerate(argv)
        if a.startswith("--")
    }
    assert set(flags) <= serve_flags(), set(flags) - serve_flags()
    return flags


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
