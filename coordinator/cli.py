"""``coordinator train``: the command a user runs on their own machine; ``coordinator report``: its charts.

Every setting is a ``TrainConfig`` field (``--learning-rate`` is ``learning_rate``); its flag, ``--help``
line, section and choices are generated from the field and its metadata (``config.setting``), so a setting,
its default, help and validation live in one place. ``--config run.yaml`` supplies values for the same flags
(keys are the flags without dashes, see ``configs/``); flags typed on the command line win.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import logging
import re
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gradwire.cliconfig import add_security_flags, parse_args_with_config, subcommand_parser
from gradwire.coordinator.checkpoint import latest_checkpoint
from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.coordinator.config import AUTO_SETTINGS, RUN, SECTIONS, TrainConfig
from gradwire.coordinator.local import LOCAL_DEVICES, local_workers
from gradwire.coordinator.membership import MemberSource, WorkersFile
from gradwire.coordinator.runlock import RunLock, RunLocked
from gradwire.coordinator.tunnel import Tunnels
from gradwire.security import ClientSecurity, ServerSecurity, resolve_token
from gradwire.tunnel import TUNNEL_PREFIX

if TYPE_CHECKING:
    from gradwire.coordinator.trainer import Trainer

log = logging.getLogger(__name__)

AUTO = "auto"


def _add_config_flags(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One flag per ``TrainConfig`` field, built from its metadata alone, in one group per section (returned,
    by section title)."""
    groups = {title: parser.add_argument_group(title, about) for title, about in SECTIONS.items()}
    for field in dataclasses.fields(TrainConfig):
        meta = field.metadata
        group = groups[meta["section"]]
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        shown = AUTO if field.name in AUTO_SETTINGS else repr(default)
        # A help that says its default in words ("default: the model's own") is not given a second one.
        text = meta["help"] if "(default:" in meta["help"] else f"{meta['help']} (default: {shown})"
        # argparse %-formats help text: a literal % is written %%.
        kwargs: dict = {"dest": field.name, "help": text.replace("%", "%%")}
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        choices = meta.get("choices")
        if isinstance(default, tuple):  # one or more values
            group.add_argument(flag, nargs="+", type=_flag_type(field), default=[], choices=choices, **kwargs)
        elif isinstance(default, bool):
            if "negative" in meta:  # --use-dct / --no-dct
                negative, negative_help = meta["negative"]
                pair = group.add_mutually_exclusive_group()
                pair.add_argument(flag, action="store_true", default=default, **kwargs)
                pair.add_argument(negative, dest=field.name, action="store_false", help=negative_help)
            else:
                group.add_argument(flag, action="store_true", default=default, **kwargs)
        elif field.name in AUTO_SETTINGS:  # "auto" (or nothing) leaves it to the mode's default
            group.add_argument(
                flag,
                type=_or_auto(_flag_type(field)),
                default=None,
                choices=[*choices, AUTO] if choices else None,
                **kwargs,
            )
        else:
            group.add_argument(
                flag, type=_flag_type(field), default=default, choices=list(choices) if choices else None, **kwargs
            )
    return groups


def _flag_type(field: dataclasses.Field) -> type:
    """The type a flag's text converts to: the field's, also for optional fields (``float | None``) and for
    each value of a tuple field (``tuple[str, ...]``)."""
    if field.default is not None and not isinstance(field.default, tuple):
        return type(field.default)
    # A string: this module and config.py use postponed annotations.
    annotation = str(field.type).removeprefix("tuple[")
    return next((t for t in (int, float) if annotation.startswith(t.__name__)), str)


def _or_auto(convert: type) -> Callable[[str], object]:
    def parse(text: str) -> object:
        return AUTO if text == AUTO else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in its "invalid float value" messages
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coordinator",
        description="gradwire coordinator: holds the model and the outer optimizer, drives the workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a model with remote workers",
        description="Train a model: dispatch batches to workers, aggregate their compressed gradients, step, "
        "keep their replicas in sync.",
        epilog="One of --workers, --workers-file, --listen or --local is required, on the command line or in the "
        "--config file.",
    )
    train.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read flag values from a YAML file: keys are the flags without dashes "
        "(learning_rate: 3.0e-4, data: [a.txt, b.txt]); flags typed here win",
    )
    # Not required=True: either may come from --config instead; train_config_from_args checks.
    where = train.add_mutually_exclusive_group()
    where.add_argument(
        "--workers", type=str, help="comma-separated worker addresses, host:port,host:port (in YAML also a list)"
    )
    where.add_argument(
        "--local", type=int, metavar="N", help="start N worker daemons on this machine and train with them"
    )
    where.add_argument(
        "--listen",
        metavar="[HOST:]PORT",
        help="let workers join: serve the Coordinator service on PORT (every interface unless HOST is given) "
        "for `worker serve --join`; training starts once --min-workers (at least one) have joined, and workers "
        "come and go as they announce themselves or go quiet",
    )
    where.add_argument(
        "--workers-file",
        metavar="FILE",
        help="worker addresses in FILE (one per line or comma-separated, # comments), re-read before every "
        "round: workers added join after a state push, workers removed stop getting work",
    )
    # Besides --local, not instead of it: outside the group above. Not a TrainConfig field: it says where
    # this machine's worker daemons run, not how the run trains.
    train.add_argument(
        "--local-device",
        choices=LOCAL_DEVICES,
        default="auto",
        help="where the --local workers run: auto (one GPU each when this machine has at least N GPUs, else "
        "all on the CPU), cpu, or cuda (worker i on GPU i, round-robin when there are fewer GPUs than workers) "
        "(default: auto)",
    )
    # Besides --listen, not instead of it: outside the group above.
    train.add_argument(
        "--listen-tls-cert",
        metavar="PEM",
        help="serve --listen with TLS, with this certificate (chain) and --listen-tls-key: workers then join "
        "with --join-tls-ca (a must when their token crosses an open network)",
    )
    train.add_argument("--listen-tls-key", metavar="PEM", help="the private key of --listen-tls-cert")
    sections = _add_config_flags(train)
    add_security_flags(train, side="coordinator")
    train.add_argument(
        "--status-port",
        type=int,
        metavar="PORT",
        help="serve a live status page (/), its JSON (/api/status) and Prometheus metrics (/metrics) on PORT "
        "(0: any free port, printed); with a token, every path needs it",
    )
    train.add_argument(
        "--status-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address of the status page (default: 127.0.0.1, this machine only)",
    )
    # Not TrainConfig fields (checkpoints need not record them), but about the run all the same.
    sections[RUN].add_argument("--no-progress", action="store_true", help="no progress bar")
    sections[RUN].add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: INFO)",
    )
    report = sub.add_parser(
        "report",
        help="draw the charts of a run from its metrics.jsonl",
        description="Draw loss, loss-vs-bytes and step-time charts (PNG) of a run from OUTPUT_DIR/metrics.jsonl. "
        "Given several runs, also compare.png: each run's last held-out loss against its uplink bytes per trained "
        "token, and a line per run on standard output.",
    )
    report.add_argument(
        "output_dir", metavar="OUTPUT_DIR", nargs="+", help="the --output-dir of a coordinator train run (or several)"
    )
    report.add_argument(
        "--report-dir",
        metavar="DIR",
        help="where the PNG files go (default: OUTPUT_DIR); with several runs each run's charts stay in its own "
        "OUTPUT_DIR and compare.png goes here (default: the first OUTPUT_DIR)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    values.update({name: None for name in AUTO_SETTINGS if values[name] == AUTO})
    values["data"] = tuple(values["data"] or ())
    return TrainConfig(**values)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line with its ``--config`` file merged in (typed flags win); exits 2 on a bad value."""
    return parse_args_with_config(build_parser, argv, joins={"workers": ","})


def _naming_keys(error: ValueError, args: argparse.Namespace) -> str:
    """``error`` names flags; if their values came from the --config file, name the file's keys too."""
    keys = getattr(args, "config_keys", {})
    dests = dict.fromkeys(flag[2:].replace("-", "_") for flag in re.findall(r"--[a-z][a-z0-9-]*", str(error)))
    named = [repr(keys[d]) for d in dests if d in keys]
    if not named:
        return str(error)
    return f"{args.config}: key{'s' if len(named) > 1 else ''} {', '.join(named)}: {error}"


def train_config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TrainConfig:
    """The validated ``TrainConfig`` of a parsed ``train`` command line; exits 2 naming the flag (or key)."""
    train = subcommand_parser(parser, "train")
    try:
        if args.workers is None and args.local is None and args.workers_file is None and args.listen is None:
            raise ValueError(
                "one of --workers, --workers-file, --listen or --local is required "
                "(on the command line, or workers: / local: in the --config file)"
            )
        if args.local is not None and args.local < 1:
            raise ValueError(f"--local must be >= 1, got {args.local}")
        return config_from_args(args)
    except ValueError as e:
        train.error(_naming_keys(e, args))


def load_train(argv: Sequence[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    """What ``coordinator train ARGS`` would run with - the config and the parsed arguments - without
    training. Exits with status 2 and a message naming the flag or the --config key on a bad value."""
    parser, args = parse_args(argv)
    if args.command != "train":
        parser.error(f"expected the train command, got {args.command!r}")
    return train_config_from_args(parser, args), args


def client_security(args: argparse.Namespace) -> ClientSecurity:
    """The token and TLS settings of ``coordinator train`` (never part of TrainConfig: checkpoints and
    trackers record that, and secrets stay out of both). ``ValueError`` naming the flag."""
    return ClientSecurity(
        token=resolve_token(args.token, args.token_file),
        tls=args.tls,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_server_name=args.tls_server_name,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = parse_args(argv)
    if args.command == "report":
        return report(args.output_dir, args.report_dir)
    config = train_config_from_args(parser, args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        security = client_security(args)
        if security.tls:
            security.channel("127.0.0.1:1", []).close()  # read the TLS files now: a typo fails here
    except ValueError as e:
        subcommand_parser(parser, "train").error(_naming_keys(e, args))
    try:
        listen_security = ServerSecurity(
            token=security.token, tls_cert=args.listen_tls_cert, tls_key=args.listen_tls_key
        )
        listen_security.credentials()
    except ValueError as e:  # ServerSecurity names the worker's flags
        subcommand_parser(parser, "train").error(str(e).replace("--tls-", "--listen-tls-"))
    return train(
        config,
        workers=args.workers,
        local=args.local,
        local_device=args.local_device,
        progress=not args.no_progress,
        security=security,
        workers_file=args.workers_file,
        listen=args.listen,
        status_port=args.status_port,
        status_host=args.status_host,
        listen_security=listen_security,
    )


def report(output_dirs: str | Sequence[str], report_dir: str | None = None) -> int:
    """``coordinator report OUTPUT_DIR [OUTPUT_DIR ...]``: write each run's charts and print their paths; for
    several runs, their comparison too, with a line per run."""
    dirs = [output_dirs] if isinstance(output_dirs, str) else list(output_dirs)
    for output_dir in dirs:
        if not Path(output_dir).is_dir():
            print(
                f"coordinator report: error: {output_dir} is not a directory (give the --output-dir of a train run)",
                file=sys.stderr,
            )
            return 2
    try:
        charts = importlib.import_module("gradwire.coordinator.report")  # matplotlib loads only for this command
    except ModuleNotFoundError as e:
        if e.name != "gradwire.coordinator.report":
            raise
        print(
            "coordinator report: error: this gradwire has no report module (gradwire.coordinator.report)",
            file=sys.stderr,
        )
        return 1
    try:
        paths = [p for d in dirs for p in charts.write_report(d, report_dir if len(dirs) == 1 else None)]
        if len(dirs) > 1:
            compared, runs = charts.write_comparison(dirs, report_dir or dirs[0])
            paths.append(compared)
    except (FileNotFoundError, ValueError) as e:
        print(f"coordinator report: error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    if len(dirs) > 1:
        for run in runs:
            what = "held-out" if run.held_out else "training"
            sent = f"{run.bytes_up_per_token:.2f} B up a token"
            print(f"{run.name}: {what} loss {run.loss:.4f} at step {run.steps}, {sent}")
    return 0


def train_listening(
    listen: str,
    config: TrainConfig,
    run: Callable[[list[str], MemberSource], int],
    security: ServerSecurity,
    tunnels: Tunnels,
) -> int:
    """``--listen``: serve Join and Tunnel, wait for the first workers, train with whoever has joined."""
    from gradwire.coordinator.join import JoinRegistry, serve_joins

    host, _, port_text = listen.rpartition(":")
    if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        print(f"coordinator train: error: --listen takes [HOST:]PORT, got {listen!r}", file=sys.stderr)
        return 2
    registry = JoinRegistry()
    try:
        server, bound = serve_joins(
            registry, host=host or "[::]", port=int(port_text), security=security, tunnels=tunnels
        )
    except OSError as e:
        print(f"coordinator train: error: {e}", file=sys.stderr)
        return 1
    try:
        need = max(1, config.min_workers)
        print(
            f"listening for workers on {host or '[::]'}:{bound} (worker serve --join THIS_HOST:{bound}); "
            f"waiting for {need}",
            file=sys.stderr,
            flush=True,
        )
        addresses = registry.wait_for(need, config.connect_timeout)
        if len(addresses) < need:
            print(
                f"coordinator train: {len(addresses)} of {need} worker(s) joined within "
                f"--connect-timeout {config.connect_timeout:g} s",
                file=sys.stderr,
            )
            return 1
        registry.poll()  # the trainer sees changes from here on
        return run(addresses, registry)
    finally:
        server.stop(1)


@contextlib.contextmanager
def stop_on_signals(trainer: Trainer) -> Iterator[None]:
    """SIGINT/SIGTERM: finish the round in flight, checkpoint, close the workers' sessions (``Trainer.run``
    returns with ``interrupted``). A second signal stops at once (KeyboardInterrupt)."""

    def on_signal(signum: int, _frame: object) -> None:
        if trainer.stop_requested:
            raise KeyboardInterrupt
        log.warning(
            "%s: finishing the round in flight, then a checkpoint (again to stop at once)", signal.Signals(signum).name
        )
        trainer.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def resume_command(checkpoint_dir: Path) -> str:
    """This command line with ``--resume-from checkpoint_dir`` (replacing any it had)."""
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg == "--resume-from":
            skip = True
            continue
        if arg.startswith("--resume-from="):
            continue
        argv.append(arg)
    return shlex.join(["coordinator", *argv, "--resume-from", str(checkpoint_dir)])


def train(
    config: TrainConfig,
    *,
    workers: str | None = None,
    local: int | None = None,
    local_device: str = "auto",
    progress: bool = True,
    security: ClientSecurity | None = None,
    workers_file: str | None = None,
    listen: str | None = None,
    status_port: int | None = None,
    status_host: str = "127.0.0.1",
    listen_security: ServerSecurity | None = None,
) -> int:
    from gradwire.coordinator.durable import load_run_key, resume_root  # torch loads only when training
    from gradwire.coordinator.rundir import checkpoint_root, resume_source
    from gradwire.memory import keep_freed_memory

    keep_freed_memory()
    # One coordinator per run directory (a supervisor's restart racing one not dead yet is refused), and the
    # run's key kept with its checkpoints: restarted on the run, it is the same owner to its workers, which
    # kept its sessions (coordinator.durable).
    security = security or ClientSecurity()
    try:
        root = checkpoint_root(config.output_dir, config.checkpoint_dir)
        source = resume_source(config.resume_from, root)
        if config.resume_from and (kept := load_run_key(resume_root(source) if source else root)):
            security = dataclasses.replace(security, run_key=kept)
        lock = RunLock(config.output_dir).acquire()
    except (ValueError, RunLocked) as e:
        print(f"coordinator train: error: {e}", file=sys.stderr)
        return 2
    try:
        return _train_locked(
            config,
            workers=workers,
            local=local,
            local_device=local_device,
            progress=progress,
            security=security,
            workers_file=workers_file,
            listen=listen,
            status_port=status_port,
            status_host=status_host,
            listen_security=listen_security,
        )
    finally:
        lock.release()


def _train_locked(
    config: TrainConfig,
    *,
    workers: str | None,
    local: int | None,
    local_device: str,
    progress: bool,
    security: ClientSecurity,
    workers_file: str | None,
    listen: str | None,
    status_port: int | None,
    status_host: str,
    listen_security: ServerSecurity | None,
) -> int:
    """``train`` in its run directory, which it holds."""
    from gradwire.coordinator.durable import save_run_key
    from gradwire.coordinator.trainer import Trainer

    tunnels = Tunnels() if listen is not None else None  # workers behind NAT call in (--listen)

    def connect(address: str) -> WorkerClient:
        if tunnels is not None and address.startswith(TUNNEL_PREFIX):
            channel = tunnels.channel(address.removeprefix(TUNNEL_PREFIX))
            return WorkerClient(address, timeout=config.round_timeout, security=security, channel=channel)
        return WorkerClient(address, timeout=config.round_timeout, security=security)

    def run(addresses: list[str], members: MemberSource | None = None) -> int:
        clients = [connect(a) for a in addresses]
        try:
            try:
                trainer = Trainer(config, clients, progress=progress, members=members, connect=connect)
            except (ValueError, FileNotFoundError) as e:  # a flag, a model, a file: say which, no traceback
                print(f"coordinator train: error: {e}", file=sys.stderr)
                return 2
            save_run_key(trainer.checkpoint_dir, security.run_key)
            status = None
            if status_port is not None:
                from gradwire.coordinator.status import StatusBoard, StatusServer

                trainer.status = StatusBoard(
                    run={
                        "run_id": trainer.run_id,
                        "model": config.model,
                        "steps": config.steps,
                        "output_dir": config.output_dir,
                    }
                )
                try:
                    status = StatusServer(
                        trainer.status, host=status_host, port=status_port, token=security.token if security else None
                    )
                except OSError as e:
                    print(f"coordinator train: error: {e}", file=sys.stderr)
                    return 2
                print(f"status page: http://{status_host}:{status.port}/", file=sys.stderr, flush=True)
            try:
                with stop_on_signals(trainer):
                    records = trainer.run()
            except (RuntimeError, WorkerError) as e:
                print(f"coordinator train: {e}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                latest = latest_checkpoint(trainer.checkpoint_dir)
                print(
                    f"coordinator train: stopped at once at step {trainer.step}; "
                    f"the newest checkpoint is {latest or 'none'}",
                    file=sys.stderr,
                )
                return 130
            finally:
                trainer.close()
                if status is not None:
                    status.close()
        finally:
            for c in clients:
                c.close()
        if trainer.interrupted:
            print(
                f"stopped at step {trainer.step} of {config.steps}; checkpoint in {trainer.last_checkpoint}. "
                f"Resume with: {resume_command(trainer.checkpoint_dir)}"
            )
            return 0
        if records:
            last = records[-1]
            print(
                f"step {last['step']}: loss {last['loss']:.4f}, {last['tokens_per_sec']:.0f} tokens/s, "
                f"compression {last['compression_ratio']:.0f}x; outputs in {config.output_dir}"
            )
        else:  # resumed a run that had trained every step already (--resume-from auto, restarted once more)
            print(f"the run in {config.output_dir} has trained its {config.steps} steps; outputs there")
        return 0

    if local:
        import torch

        # The local workers get the cores; the coordinator mostly waits, and its share of the work
        # (aggregating, replaying updates) would otherwise fight them for the same cores.
        torch.set_num_threads(1)
        with contextlib.ExitStack() as stack:
            try:
                addresses = stack.enter_context(
                    local_workers(local, device=local_device, token=security.token if security else None)
                )
            except ValueError as e:  # --local-device cuda without a GPU
                print(f"coordinator train: error: {e}", file=sys.stderr)
                return 2
            return run(addresses)
    if listen is not None:
        listen_security = listen_security or ServerSecurity(token=security.token if security else None)
        return train_listening(listen, config, run, listen_security, tunnels or Tunnels())
    if workers_file is not None:
        members = WorkersFile(workers_file)
        try:
            addresses = members.read()
            members.poll()  # what the trainer compares with before every round
        except ValueError as e:
            print(f"coordinator train: error: {e}", file=sys.stderr)
            return 2
        if not addresses:
            print(
                f"coordinator train: error: --workers-file {workers_file} names no worker (host:port, one per line)",
                file=sys.stderr,
            )
            return 2
        return run(addresses, members)
    addresses = [a.strip() for a in (workers or "").split(",") if a.strip()]
    if not addresses:
        print("coordinator: --workers needs at least one host:port", file=sys.stderr)
        return 2
    return run(addresses)


if __name__ == "__main__":
    sys.exit(main())
