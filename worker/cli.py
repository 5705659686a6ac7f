"""The ``worker`` command: ``worker serve --port P [--host H] [--device D] [--max-message-mb N] [--grace S]``.

Also runs as ``python -m gradwire.worker``. Bad flag values exit with status 2 and a message naming the
flag. torch and grpc are imported only once a command runs, so ``--help`` answers at once.

``--config FILE.yaml`` reads flag values from a YAML file whose keys are the flags without their dashes
(``max_message_mb: 4096``, or ``max-message-mb``); flags typed on the command line win (see
``gradwire.cliconfig``, which ``coordinator train`` shares).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from gradwire.cliconfig import parse_args_with_config, subcommand_parser
from gradwire.transport import DEFAULT_MESSAGE_MB, check_message_mb


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` if available else ``cpu``; check that ``cuda``/``cuda:i`` exist. ValueError if not."""
    import torch

    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type != "cuda":
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:INDEX, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available here (use --device cpu or auto)")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    return f"cuda:{index}"


def _device(text: str) -> str:
    try:
        return resolve_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device ")) from None


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def _message_mb(text: str) -> int:
    try:
        mb = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    try:
        return check_message_mb(mb)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 <= s < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return s


# ---------------------------------------------------------------------------------------------- worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worker",
        description="A gradwire worker: holds model replicas for coordinators and answers their work orders with compressed gradients.",
        epilog="Usage: worker serve --port PORT [--host HOST] [--device auto|cpu|cuda|cuda:INDEX] [--max-message-mb N] [--grace SECONDS]; see worker serve --help.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve the gradwire.v1.Worker gRPC service until SIGTERM/SIGINT",
        description="Serve the gradwire.v1.Worker gRPC service (with grpc.health.v1) until SIGTERM or SIGINT, then stop gracefully.",
    )
    serve.add_argument("--config", metavar="FILE.yaml", help="read flag values from a YAML file (keys: port, host, device, max_message_mb, grace); flags typed here win")
    serve.add_argument("--port", type=_port, help="TCP port to listen on (0: any free port, logged at start); required, here or in --config")
    serve.add_argument("--host", default="[::]", help="address to listen on (default: [::], every interface, IPv4 and IPv6)")
    serve.add_argument("--device", type=_device, default="auto", help="where rounds run: auto (the default: cuda if available, else cpu), cpu, cuda or cuda:INDEX")
    serve.add_argument("--max-message-mb", type=_message_mb, default=DEFAULT_MESSAGE_MB, help=f"largest message accepted, in MiB, once its parts are joined: a model state, a work order with its update (default: {DEFAULT_MESSAGE_MB})")
    serve.add_argument("--grace", type=_seconds, default=5.0, help="seconds in-flight calls get to finish after SIGTERM before they are cancelled (default: 5)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (and its --config file) as ``main`` sees it; exits with status 2 on a bad value."""
    parser, args = parse_args_with_config(build_parser, argv)
    if args.command == "serve" and args.port is None:
        subcommand_parser(parser, "serve").error("--port is required (on the command line, or port: in the --config file)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command is None:
        build_parser().print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported here: torch, the model code and grpc take a moment, and --help should not wait for them.
    from gradwire.memory import keep_freed_memory
    from gradwire.worker.engine import WorkerEngine
    from gradwire.worker.server import serve

    keep_freed_memory()  # a long-lived daemon: reuse its model-sized buffers instead of re-faulting them
    try:
        return serve(WorkerEngine(args.device), host=args.host, port=args.port, max_message_mb=args.max_message_mb, grace=args.grace)
    except OSError as e:  # the address cannot be bound
        print(f"worker serve: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
