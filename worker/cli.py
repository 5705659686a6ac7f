"""The ``worker`` command: ``worker serve --port P [--host H] [--device D] [--nproc-per-node N] ...``.

Also runs as ``python -m gradwire.worker``. Bad flag values exit with status 2 and a message naming the
flag. torch and grpc are imported only once a command runs, so ``--help`` answers at once.

``--config FILE.yaml`` reads flag values from a YAML file whose keys are the flags without their dashes
(``max_message_mb: 4096``, or ``max-message-mb``); flags typed on the command line win (see
``gradwire.cliconfig``, which ``coordinator train`` shares).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradwire.cliconfig import add_security_flags, parse_args_with_config, subcommand_parser
from gradwire.security import ClientSecurity, ServerSecurity, resolve_token
from gradwire.transport import DEFAULT_MESSAGE_MB, check_message_mb
from gradwire.worker.nodeconf import check_placement, rank_from_env

DEFAULT_MAX_MODEL_PARAMS = 2_000_000_000  # = worker.engine's (not imported: --help must not load torch)

if TYPE_CHECKING:
    from gradwire.worker.node import NodeGroup
    from gradwire.worker.nodeconf import RankInfo
    from gradwire.worker.placement import Placement

log = logging.getLogger(__name__)


def _device(text: str) -> str:
    if text == "cpu":  # a CPU node's launcher never loads torch: its fork server loads it once for the ranks
        return text
    from gradwire.hardware import resolve_device

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
        description="A gradwire worker: holds model replicas for coordinators and answers their work orders with "
        "compressed gradients.",
        epilog="Usage: worker serve --port PORT [--host HOST] [--device auto|cpu|cuda|cuda:INDEX] "
        "[--max-message-mb N] [--grace SECONDS]; see worker serve --help.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve the gradwire.v1.Worker gRPC service until SIGTERM/SIGINT",
        description="Serve the gradwire.v1.Worker gRPC service (with grpc.health.v1) until SIGTERM or SIGINT, "
        "then stop gracefully.",
    )
    serve.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read flag values from a YAML file: every flag of worker serve, its key the flag without dashes "
        "(port: 50051, device: cuda, nproc_per_node: auto, join: coordinator:7000, token_file: /run/token); "
        "flags typed here win",
    )
    serve.add_argument(
        "--port",
        type=_port,
        help="TCP port to listen on (0: any free port, logged at start); required, here or in --config",
    )
    serve.add_argument(
        "--host", default="[::]", help="address to listen on (default: [::], every interface, IPv4 and IPv6)"
    )
    serve.add_argument(
        "--device",
        type=_device,
        default="auto",
        help="where rounds run: auto (the default: cuda if available, else cpu), cpu, cuda or cuda:INDEX",
    )
    serve.add_argument(
        "--max-message-mb",
        type=_message_mb,
        default=DEFAULT_MESSAGE_MB,
        help="largest message accepted, in MiB, once its parts are joined: a model state, a work order with its "
        f"update (default: {DEFAULT_MESSAGE_MB})",
    )
    serve.add_argument(
        "--rank-memory-gb",
        type=_gigabytes,
        default=None,
        metavar="GB",
        help="memory a run's state may use on each device (each rank's, on a node): a model whose state would "
        "take more than 80%% of it is refused with the sizes, at its state push or its first local-SGD round, "
        "instead of running out of memory (default: a CUDA device's memory; no limit on the CPU)",
    )
    serve.add_argument(
        "--push-budget-gb",
        type=_gigabytes,
        default=None,
        metavar="GB",
        help="bytes the state pushes in flight may hold together, whoever sends them: a push that would take more "
        "is refused (RESOURCE_EXHAUSTED) and keeps nothing (default: --rank-memory-gb, else this machine's memory)",
    )
    serve.add_argument(
        "--max-model-params",
        type=_positive,
        default=DEFAULT_MAX_MODEL_PARAMS,
        help="largest model a coordinator may make this worker build, in parameters and buffers, checked before "
        "anything is allocated; requests are also bounded by a multiple of their run's model size "
        f"(default: {DEFAULT_MAX_MODEL_PARAMS:,})",
    )
    serve.add_argument(
        "--grace",
        type=_seconds,
        default=5.0,
        help="seconds in-flight calls get to finish after SIGTERM before they are cancelled (default: 5)",
    )
    node = serve.add_argument_group(
        "multi-GPU nodes",
        "One worker drives all of a box's GPUs: N ranks in one torch.distributed group (NCCL on CUDA, gloo on "
        "CPU); rank 0 serves gRPC. torchrun --nproc-per-node N -m gradwire.worker serve ... works the same.",
    )
    node.add_argument(
        "--nproc-per-node",
        type=_nproc,
        default="1",
        help="ranks in this node: a number, or auto (every visible GPU; 1 on a CPU) (default: 1)",
    )
    node.add_argument(
        "--node-mode",
        choices=["auto", "ddp", "local-sgd", "fsdp", "pipeline"],
        default="auto",
        help="among the ranks: ddp (every backward all-reduces gradients), local-sgd (independent inner steps, "
        "parameters averaged every --node-sync-steps and at the end of a round), fsdp (parameters, gradients, "
        "the replica, the working copy and the inner optimizer's state sharded over the ranks with FSDP2; "
        "each rank encodes the tensors it owns), pipeline (rank r holds stage r of the model, its blocks and "
        "their state, and runs every row through the stages in --pipeline-microbatches; built-in GPTs and "
        "Llama-family HF models), or auto: for each run, ddp when the whole model's state fits "
        "80%% of a rank's memory (--rank-memory-gb), else fsdp; the choice and why are logged, and Describe "
        "reports it (default: auto)",
    )
    node.add_argument(
        "--node-shard",
        choices=["optimizer", "gradients", "full"],
        default="full",
        help="fsdp (or auto, where it picks fsdp): what the ranks shard. full (ZeRO-3): parameters, gradients "
        "and inner optimizer state, a block's parameters gathered for its forward and again for its backward; "
        "gradients (ZeRO-2): the same, but a block's parameters stay gathered from its forward to its backward "
        "(more memory, fewer all-gathers); optimizer (ZeRO-1): only the inner optimizer's state, the ranks "
        "otherwise computing as ddp does (torch's ZeroRedundancyOptimizer) (default: full)",
    )
    node.add_argument(
        "--node-sync-steps",
        type=_count,
        default=0,
        help="local-sgd: average the ranks' parameters every S inner steps (0: at the end of each round only) "
        "(default: 0)",
    )
    node.add_argument(
        "--pipeline-microbatches",
        type=_count,
        default=0,
        help="pipeline: micro-batches each step's rows split into; more keep the stages busier (0: one per rank) "
        "(default: 0)",
    )
    node.add_argument(
        "--pipeline-schedule",
        choices=["1f1b", "gpipe"],
        default="1f1b",
        help="pipeline: torch.distributed.pipelining's schedule; 1f1b holds fewer micro-batches' activations "
        "(default: 1f1b)",
    )
    node.add_argument(
        "--node-comm-hook",
        choices=["none", "fp16", "powersgd", "dct"],
        default="none",
        help="ddp: how gradients travel between ranks (default: none, a float32 all-reduce)",
    )
    node.add_argument(
        "--node-timeout",
        type=_seconds,
        default=300.0,
        help="seconds a collective among the ranks may take before the node counts a rank as lost (default: 300)",
    )
    node.add_argument(
        "--max-restarts",
        type=_count,
        default=3,
        help="times the launcher restarts a node that lost a rank (default: 3)",
    )
    serve.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="bf16: autocast forward/backward (weights, replica and codec stay float32); auto (the default): bf16 "
        "on a GPU that computes in bfloat16, else fp32",
    )
    join = serve.add_argument_group(
        "joining a run",
        "Instead of (or besides) being named in the coordinator's --workers, a worker can announce itself to a "
        "coordinator started with --listen PORT.",
    )
    join.add_argument(
        "--join",
        metavar="HOST:PORT",
        help="announce this worker to the coordinator at HOST:PORT (coordinator train --listen), every few "
        "seconds while it serves",
    )
    join.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="the address the coordinator should call this worker at (default: --host, or this machine's name, "
        "and --port); with --tunnel, the worker's name in the run",
    )
    join.add_argument(
        "--tunnel",
        action="store_true",
        help="for a worker the coordinator cannot dial (behind NAT, or a firewall that only lets connections "
        "out): with --join, hold a tunnel open to the coordinator and serve its calls through it; the coordinator "
        "never connects to this worker",
    )
    join.add_argument(
        "--join-tls",
        action="store_true",
        help="talk TLS to the --join coordinator, trusting the system's CAs (implied by --join-tls-ca)",
    )
    join.add_argument(
        "--join-tls-ca",
        metavar="PEM",
        help="talk TLS to the --join coordinator, trusting the CA that signed its certificate "
        "(coordinator train --listen-tls-cert)",
    )
    peers = serve.add_argument_group("peer-to-peer gossip (coordinator train --topology ... --peer-to-peer)")
    peers.add_argument(
        "--peer-tls",
        action="store_true",
        help="pull the neighbours' gossip messages over TLS, trusting the system's CAs (implied by --peer-tls-ca "
        "and by serving TLS: the neighbours serve as this worker does)",
    )
    peers.add_argument(
        "--peer-tls-ca",
        metavar="PEM",
        help="pull the neighbours' gossip messages over TLS, trusting the CA that signed their certificates",
    )
    add_security_flags(serve, side="worker")
    return parser


def server_security(args: argparse.Namespace) -> ServerSecurity:
    """The worker's token and TLS settings from its flags; ``ValueError`` naming the flag."""
    return ServerSecurity(
        token=resolve_token(args.token, args.token_file),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
    )


def join_security(args: argparse.Namespace, token: str | None) -> ClientSecurity:
    """How ``--join`` reaches the coordinator: the worker's token, TLS if asked for."""
    return ClientSecurity(token=token, tls=args.join_tls, tls_ca=args.join_tls_ca)


def peer_security(args: argparse.Namespace, security: ServerSecurity) -> ClientSecurity:
    """How this worker pulls its neighbours' gossip messages: the swarm's token, TLS when this worker serves
    TLS or the flags ask for it (its client certificate too, when it presents one: mutual TLS)."""
    return ClientSecurity(
        token=security.token,
        tls=args.peer_tls or security.tls,
        tls_ca=args.peer_tls_ca,
        tls_cert=args.tls_cert if security.tls_client_ca else None,
        tls_key=args.tls_key if security.tls_client_ca else None,
    )


def _gigabytes(text: str) -> float:
    try:
        gb = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of GB, got {text!r}") from None
    if not (math.isfinite(gb) and gb > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of GB, got {text!r}")
    return gb


def _positive(text: str) -> int:
    try:
        n = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _nproc(text: str) -> str:
    if text != "auto" and (not text.isdigit() or int(text) < 1):
        raise argparse.ArgumentTypeError(f"must be a number >= 1 or auto, got {text!r}")
    return text


def ranks_for(nproc: str, device: str) -> int:
    """``--nproc-per-node`` as a number: ``auto`` is every visible GPU on a CUDA worker, one on a CPU."""
    if nproc != "auto":
        return int(nproc)
    import torch

    return max(1, torch.cuda.device_count()) if device.startswith("cuda") else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (and its --config file) as ``main`` sees it; exits with status 2 on a bad value."""
    parser, args = parse_args_with_config(build_parser, argv)
    if args.command == "serve" and args.port is None:
        subcommand_parser(parser, "serve").error(
            "--port is required (on the command line, or port: in the --config file)"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command is None:
        build_parser().print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        security = server_security(args)
        security.credentials()  # read the TLS files now: a typo fails here, not on the first call
        if args.tunnel and not args.join:
            raise ValueError("--tunnel needs --join HOST:PORT: the coordinator to open the tunnel to")
        if args.join:
            try:
                join_security(args, security.token).channel("127.0.0.1:1", []).close()  # the --join-tls-ca file, now
            except ValueError as e:  # ClientSecurity names the coordinator's flag
                raise ValueError(str(e).replace("--tls-ca", "--join-tls-ca")) from None
        try:
            peer_security(args, security).channel("127.0.0.1:1", []).close()  # the --peer-tls-ca file, now
        except ValueError as e:
            raise ValueError(str(e).replace("--tls-ca", "--peer-tls-ca")) from None
    except ValueError as e:
        print(f"worker serve: error: {e}", file=sys.stderr)
        return 2
    try:
        rank = rank_from_env()
        # Settings that clash (--node-shard without fsdp) fail before any rank starts; without torch, which
        # the launcher never loads (its fork server loads it once for the ranks: gradwire.processes).
        check_placement(
            args.node_mode,
            args.node_shard,
            args.node_sync_steps,
            args.node_comm_hook,
            args.precision,
            args.pipeline_microbatches,
            args.pipeline_schedule,
        )
    except ValueError as e:
        print(f"worker serve: error: {e}", file=sys.stderr)
        return 2
    nproc = ranks_for(args.nproc_per_node, args.device)
    if rank is None and nproc > 1:  # the launcher: this process supervises the node's ranks
        from gradwire.worker.launch import launch

        return launch(
            sys.argv[1:] if argv is None else list(argv), nproc, max_restarts=args.max_restarts, grace=args.grace
        )
    return run_rank(args, rank)


def placement_of(args: argparse.Namespace, node: NodeGroup | None) -> Placement:
    """How this worker's ranks share a round, from the flags (a ValueError naming the flag if they clash)."""
    from gradwire.worker.placement import Placement

    return Placement(
        node,
        args.node_mode,
        args.node_sync_steps,
        args.node_comm_hook,
        args.precision,
        microbatches=args.pipeline_microbatches,
        schedule=args.pipeline_schedule,
        shard=args.node_shard,
    )


def run_rank(args: argparse.Namespace, rank: RankInfo | None) -> int:
    """One worker process: a single-device worker, or one rank of a node (rank 0 serves gRPC)."""
    import torch

    from gradwire.hardware import resolve_precision
    from gradwire.memory import keep_freed_memory
    from gradwire.worker.engine import WorkerEngine
    from gradwire.worker.node import NodeGroup
    from gradwire.worker.rounds import NodeFailure
    from gradwire.worker.server import serve
    from gradwire.worker.sizing import GB

    keep_freed_memory()  # a long-lived daemon: reuse its model-sized buffers instead of re-faulting them
    device = args.device
    if rank is not None and device.startswith("cuda"):
        device = f"cuda:{rank.local_rank}"  # one GPU per rank
        torch.cuda.set_device(device)
    node = NodeGroup(rank, torch.device(device), timeout=args.node_timeout) if rank is not None else None
    args.precision, why = resolve_precision(args.precision, device)
    log.info("forward/backward in %s (%s)", args.precision, why)
    placement = placement_of(args, node)
    memory = round(args.rank_memory_gb * GB) if args.rank_memory_gb is not None else None
    budget = round(args.push_budget_gb * GB) if args.push_budget_gb is not None else None
    engine = WorkerEngine(
        device, placement=placement, max_model_params=args.max_model_params, rank_memory=memory, push_budget=budget
    )
    try:
        if node is not None and not node.info.leader:
            log.info("rank %d of %d on %s: following rank 0", rank.rank, rank.world_size, device)
            try:
                engine.follow()
            except (NodeFailure, RuntimeError) as e:
                print(
                    f"worker serve: rank {rank.rank}: the node failed ({e}); exiting so that it restarts",
                    file=sys.stderr,
                )
                return 1
            return 0
        try:
            security = server_security(args)
            return serve(
                engine,
                host=args.host,
                port=args.port,
                max_message_mb=args.max_message_mb,
                grace=args.grace,
                security=security,
                join=args.join,
                advertise=args.advertise,
                tunnel=args.tunnel,
                join_security=join_security(args, security.token),
                peer_security=peer_security(args, security),
            )
        except OSError as e:  # the address cannot be bound
            print(f"worker serve: error: {e}", file=sys.stderr)
            return 1
    finally:
        if node is not None:
            node.close()


if __name__ == "__main__":
    raise SystemExit(main())
