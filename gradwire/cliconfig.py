"""``--config FILE.yaml`` for both commands: YAML files supply values for a command's own flags.

Keys are the long flags without dashes (``learning_rate`` or ``learning-rate``); every value goes through
the flag's own type function and choices, as if typed; flags typed on the command line win over the file.
Errors name the file and the key and exit with status 2, like argparse's own.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """A --config file that cannot be used; the message names the file and the key."""


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse has no public way to reach a subcommand's parser
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise KeyError(command)


def _keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """YAML key -> action: each long flag without its dashes, spelled with ``-`` or ``_``."""
    keys = {}
    for action in parser._actions:
        if action.dest in ("help", "config"):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                keys[option[2:]] = keys[option[2:].replace("-", "_")] = action
    return keys


def _kind(action: argparse.Action) -> str:
    return {int: "an integer", float: "a number", None: "a string", str: "a string"}.get(action.type, "a value")  # type: ignore[arg-type]


def _scalar(action: argparse.Action, key: str, value: Any) -> Any:
    # The value goes through the flag's own type function, as if typed: one set of checks for both.
    if value is None:
        if action.default is None:
            return None
        raise ConfigFileError(f"key {key!r} needs a value ({_kind(action)})")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigFileError(f"key {key!r}: expected {_kind(action)}, got {value!r}")
    convert: Callable[[str], Any] = action.type or str  # type: ignore[assignment]
    try:
        result = convert(value if isinstance(value, str) else str(value))
    except argparse.ArgumentTypeError as e:
        raise ConfigFileError(f"key {key!r}: {e}") from None
    except (TypeError, ValueError):
        raise ConfigFileError(f"key {key!r}: expected {_kind(action)}, got {value!r}") from None
    if action.choices is not None and result not in action.choices:
        raise ConfigFileError(f"key {key!r}: must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return result


def _value(action: argparse.Action, key: str, value: Any, joins: Mapping[str, str]) -> Any:
    if action.nargs == 0:  # --flag / --no-flag: a YAML boolean
        if not isinstance(value, bool):
            raise ConfigFileError(f"key {key!r}: expected true or false, got {value!r}")
        return value if action.const else not value
    if action.nargs in ("+", "*"):
        return [_scalar(action, key, v) for v in (value if isinstance(value, list) else [value])]
    if isinstance(value, list) and action.dest in joins:  # workers: [a:1, b:2] is --workers a:1,b:2
        if not all(isinstance(v, str) for v in value):
            raise ConfigFileError(f"key {key!r}: expected a string or a list of strings, got {value!r}")
        value = joins[action.dest].join(value)
    return _scalar(action, key, value)


def values_from_yaml(
    parser: argparse.ArgumentParser, path: str | Path, *, joins: Mapping[str, str] | None = None
) -> dict[str, tuple[str, Any]]:
    """``{dest: (key, value)}`` from a YAML mapping of ``parser``'s flags. ConfigFileError names the key."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError(f"--config {path}: no such file") from None
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot read it: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigFileError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    keys, values = _keys(parser), {}
    for key, value in data.items():
        action = keys.get(key) if isinstance(key, str) else None
        if action is None:
            close = difflib.get_close_matches(str(key), list(keys), n=1)
            hint = (
                f"did you mean {close[0]!r}?" if close else f"the keys are the flags of `{parser.prog}` without dashes"
            )
            raise ConfigFileError(f"{path}: unknown key {key!r} ({hint})")
        if action.dest in values:
            raise ConfigFileError(
                f"{path}: keys {values[action.dest][0]!r} and {key!r} both set --{action.dest.replace('_', '-')}"
            )
        try:
            values[action.dest] = (key, _value(action, key, value, joins or {}))
        except ConfigFileError as e:
            raise ConfigFileError(f"{path}: {e}") from None
    return values


def _typed_dests(build_parser: Callable[[], argparse.ArgumentParser], command: str, argv: list[str]) -> set[str]:
    # Parse again with every default suppressed: what is left in the namespace was typed.
    parser = build_parser()
    for action in subcommand_parser(parser, command)._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def parse_args_with_config(
    build_parser: Callable[[], argparse.ArgumentParser],
    argv: Sequence[str] | None = None,
    *,
    joins: Mapping[str, str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse ``argv``; if the command has ``--config FILE``, fill in the flags not typed from the file.

    A file value is dropped when a flag of the same mutually exclusive group was typed (``--local 2``
    beats ``workers:`` in the file). ``args.config_keys`` maps each dest taken from the file to its key,
    so later validation errors can name the key. Errors exit with status 2, like argparse's own.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.config_keys = {}
    path = getattr(args, "config", None)
    if path is None:
        return parser, args
    command = subcommand_parser(parser, args.command)
    try:
        values = values_from_yaml(command, path, joins=joins)
        typed = _typed_dests(build_parser, args.command, argv)
        for group in command._mutually_exclusive_groups:
            dests = {a.dest for a in group._group_actions}
            if dests & typed:
                typed |= dests
            elif len(dests & values.keys()) > 1:
                named = " and ".join(repr(values[d][0]) for d in sorted(dests & values.keys()))
                raise ConfigFileError(f"{path}: keys {named} exclude each other")
    except ConfigFileError as e:
        command.error(str(e))
    for dest, (key, value) in values.items():
        if dest not in typed:
            setattr(args, dest, value)
            args.config_keys[dest] = key
    return parser, args


def add_security_flags(parser: argparse.ArgumentParser, *, side: str) -> None:
    """The token and TLS flags; ``side`` is "worker" (server files) or "coordinator" (client files)."""
    group = parser.add_argument_group(
        "security",
        "A shared token keeps strangers out; TLS keeps the token and the traffic private. Prefer --token-file or "
        "$GRADWIRE_TOKEN to --token: a command line is visible to every user of the machine.",
    )
    group.add_argument("--token", help="the shared secret every call must carry (default: $GRADWIRE_TOKEN)")
    group.add_argument("--token-file", metavar="FILE", help="read the token from the first line of FILE")
    if side == "worker":
        group.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (chain), with --tls-key")
        group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
        group.add_argument(
            "--tls-client-ca", metavar="PEM", help="mutual TLS: accept only clients whose certificate this CA signed"
        )
    else:
        group.add_argument(
            "--tls",
            action="store_true",
            help="talk TLS to the workers, trusting the system's CAs (implied by --tls-ca)",
        )
        group.add_argument(
            "--tls-ca", metavar="PEM", help="talk TLS to the workers, trusting the CA that signed their certificates"
        )
        group.add_argument(
            "--tls-cert", metavar="PEM", help="mutual TLS: this coordinator's certificate, with --tls-key"
        )
        group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
        group.add_argument(
            "--tls-server-name",
            metavar="NAME",
            help="the name the workers' certificates are issued to, when it is not the host in --workers",
        )
