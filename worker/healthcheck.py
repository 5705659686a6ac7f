"""``python -m gradwire.worker.healthcheck [--address localhost:50051] [--timeout 3]``: is a worker up?

Exits 0 when the worker's standard gRPC health service (grpc.health.v1) answers SERVING for
"gradwire.v1.Worker", and 1 otherwise (down, unreachable, NOT_SERVING while it shuts down, too slow), with
the reason on stderr. Made for container HEALTHCHECKs and compose ``depends_on: service_healthy``, which run
it every few seconds: it imports grpc and the health stubs only, never torch.

Every failure exits 1, bad flags included: Docker reserves exit code 2 for health checks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gradwire.transport import SERVICE_NAME

__all__ = ["check", "main"]

DEFAULT_ADDRESS = "localhost:50051"


def check(address: str, timeout: float = 3.0, service: str = SERVICE_NAME) -> tuple[bool, str]:
    """Ask ``address`` for the health of ``service``; return (serving, what it said or why it failed)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            # wait_for_ready: a worker still binding its port gets the whole timeout, not an instant
            # UNAVAILABLE; the deadline bounds the wait either way.
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
            )
        except grpc.RpcError as e:
            code = e.code()
            name = code.name if code is not None else "UNKNOWN"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False, f"{address}: no answer within {timeout:g} s (is a worker listening there?)"
            if code == grpc.StatusCode.NOT_FOUND:
                return False, f"{address}: the server does not know the service {service!r} (not a gradwire worker?)"
            return False, f"{address}: health check failed: {name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {service} {status}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse exits 2 on bad flags; Docker reserves 2, so a health check must exit 0 or 1.
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def _timeout(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m gradwire.worker.healthcheck",
        description=f"Exit 0 if the worker at --address reports SERVING for {SERVICE_NAME} over grpc.health.v1, "
        "else 1.",
    )
    parser.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"the worker's host:port (default: {DEFAULT_ADDRESS})"
    )
    parser.add_argument("--timeout", type=_timeout, default=3.0, help="seconds to wait for the answer (default: 3)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serving, message = check(args.address, args.timeout)
    print(message, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    raise SystemExit(main())
