"""Regenerate docs/reference/cli.md, the command-line reference, from the commands' own parsers.

`coordinator train`'s flags are built from ``TrainConfig``'s field metadata (``coordinator/config.py``:
help, section, choices, default), so the reference reads that metadata for them; its other flags, `coordinator
report` and `worker serve` (``worker/cli.py``) are read from their argparse parsers. What ``auto`` resolves to
in each mode is read from ``TrainConfig`` itself. Nothing depends on the terminal: argparse's help formatter
is never used. tests/unit/test_cli_reference.py regenerates the page in memory and fails when the checked-in
file differs.

Usage, from anywhere:
    python scripts/gen_cli_reference.py              # rewrite docs/reference/cli.md
    python scripts/gen_cli_reference.py --out FILE   # write FILE, leave the repo alone
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from gradwire.cliconfig import subcommand_parser
from gradwire.coordinator import cli as coordinator_cli
from gradwire.coordinator.config import AUTO_SETTINGS, CODEC, TrainConfig
from gradwire.worker import cli as worker_cli

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE = REPO_ROOT / "docs" / "reference" / "cli.md"
COMMAND = "python scripts/gen_cli_reference.py"

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
AUTO = "auto"
NONE = "-"

# The modes whose `auto` settings the reference tabulates: (column title, TrainConfig arguments).
MODES: tuple[tuple[str, dict[str, object]], ...] = (
    ("gradient mode", {}),
    ("local SGD, H 30", {"inner_steps": 30}),
    ("local SGD, H 120", {"inner_steps": 120}),
    ("local SGD, H 30, `--no-compression`", {"inner_steps": 30, "no_compression": True}),
    ("gossip, H 30", {"inner_steps": 30, "topology": "ring"}),
    ("gossip, H 30, DeMuon", {"inner_steps": 30, "topology": "ring", "inner_optimizer": "demuon"}),
)
OUTER_FIELDS = ("outer_optimizer", "learning_rate", "momentum")
CODEC_FIELDS = tuple(name for name, f in FIELDS.items() if f.metadata["section"] == CODEC)

HEADER = f"""# Command-line reference

<!-- Generated from the commands' parsers and TrainConfig's field metadata: do not edit by hand.
Regenerate: {COMMAND} (tests/unit/test_cli_reference.py fails when this page and the code disagree). -->

Every flag of `coordinator train`, `coordinator report` and `worker serve`, by section, as `--help` groups
them. `--config FILE.yaml` supplies values for the same flags on both commands: a key is the flag without
its dashes (`learning_rate: 3.0e-4` or `learning-rate: 3.0e-4`); flags typed on the command line win.

A default of `auto` means the mode's own value: [What `auto` means](#what-auto-means) lists them. A default
of `{NONE}` means the flag is unset unless given; its help says what happens then.
"""


def _cell(text: str) -> str:
    """``text`` made safe for one Markdown table cell; backticks stay code."""
    text = " ".join(text.split())
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", r"\*")
    return "`".join(parts).replace("|", r"\|")


def _value(value: object) -> str:
    if value is None:
        return NONE
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) if value else NONE
    if isinstance(value, float):
        return f"{value:g}"  # 600.0 -> 600, 0.001 -> 0.001
    return str(value)


def _code(text: str) -> str:
    return NONE if text == NONE else f"`{text}`"


def _split_default(help_text: str) -> tuple[str, str | None]:
    """A help text that ends "(default: X)" -> (the rest, X); else (help_text, None)."""
    text = help_text.rstrip()
    if not text.endswith(")"):
        return help_text, None
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            inner = text[i + 1 : -1]
            if inner.startswith("default: "):
                return text[:i].rstrip(), inner.removeprefix("default: ")
            return help_text, None
    return help_text, None


def _flag_names(action: argparse.Action) -> str:
    """The flag in code, its value's name as text: a metavar's ``|`` (``R|fit``) cannot sit in a code span of a
    table cell that both GitHub and Python-Markdown render alike."""
    if action.nargs == 0:
        arg = ""
    else:
        name = action.metavar if action.metavar is not None else action.dest.upper()
        arg = " " + _cell(f"{name} [{name} ...]" if action.nargs == "+" else name)
    return ", ".join(f"`{option}`{arg}" for option in action.option_strings)


def _anchor(command: str, action: argparse.Action) -> str:
    return f"{command}-{action.option_strings[-1].lstrip('-')}"


def _row(command: str, action: argparse.Action, field: dataclasses.Field | None) -> str:
    if field is not None and action.option_strings[0] == "--" + field.name.replace("_", "-"):
        help_text, in_words = _split_default(field.metadata["help"])
        default = in_words or (AUTO if field.name in AUTO_SETTINGS else _value(field.default))
        choices = field.metadata.get("choices")
        if choices is not None and field.name in AUTO_SETTINGS:
            choices = (*choices, AUTO)
    else:  # not a TrainConfig field (or its --no- twin): argparse holds all there is
        help_text, in_words = _split_default((action.help or "").replace("%%", "%"))
        if in_words is not None:
            default = in_words
        elif action.nargs == 0 and field is not None:  # --no-dct: sets its field false
            default = NONE
        else:
            default = _value(action.default)
        choices = action.choices
    shown_default = in_words if in_words is not None and " " in in_words else _code(default)
    shown_choices = ", ".join(f"`{c}`" for c in choices) if choices else NONE
    flag = f'<a id="{_anchor(command, action)}"></a>{_flag_names(action)}'
    return f"| {flag} | {_cell(shown_default)} | {shown_choices} | {_cell(help_text)} |"


def _groups(parser: argparse.ArgumentParser) -> Iterator[argparse._ArgumentGroup]:
    for group in parser._action_groups:
        if any(a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help" for a in group._group_actions):
            yield group


def _command(title: str, slug: str, parser: argparse.ArgumentParser, fields: bool) -> list[str]:
    lines = [f"## `{title}`", ""]
    lines += [_cell(text) + "\n" for text in (parser.description, parser.epilog) if text]
    positionals = [a for a in parser._actions if not a.option_strings]
    if positionals:
        lines += ["| argument | help |", "|---|---|"]
        lines += [f"| `{a.metavar or a.dest}` | {_cell(a.help or '')} |" for a in positionals]
        lines.append("")
    for group in _groups(parser):
        lines += [f"### {title} · {group.title}", ""]
        if group.description:
            lines += [_cell(group.description), ""]
        lines += ["| flag | default | choices | help |", "|---|---|---|---|"]
        for action in group._group_actions:
            if not action.option_strings or action.dest == "help":
                continue
            field = FIELDS.get(action.dest) if fields else None
            lines.append(_row(slug, action, field))
        lines.append("")
    return lines


def _auto_table() -> list[str]:
    """What each `auto` setting becomes in each mode, read from TrainConfig after it fills them in."""
    configs = [(title, TrainConfig(**kwargs)) for title, kwargs in MODES]
    lines = [
        "## What `auto` means",
        "",
        "Settings whose good values depend on the mode default to `auto`; `TrainConfig` fills them in when the",
        "run starts. What it fills in, for the modes of the guide (H is `--inner-steps`; gossip is `--topology",
        "ring`, `exponential` or `complete`); anything typed wins. `not used`: the mode ignores the setting.",
        "",
        "| setting | " + " | ".join(title for title, _ in configs) + " |",
        "|---|" + "---|" * len(configs),
    ]
    for name in AUTO_SETTINGS:
        cells = []
        for _, config in configs:
            gossip = config.topology != "star"
            unused = (
                (name == "gossip_gamma" and not gossip)
                or (name in OUTER_FIELDS and gossip)
                or (name in ("inner_momentum", "inner_embedding_lr_scale") and not config.takes_inner_steps)
                or (name in CODEC_FIELDS and config.no_compression)
                or (name == "feedback_beta" and (gossip or config.no_compression))
            )
            cells.append("not used" if unused else _code(_value(getattr(config, name))))
        flag = "--" + name.replace("_", "-")
        lines.append(f"| [`{flag}`](#train-{flag[2:]}) | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def render() -> str:
    """The whole reference page, deterministically."""
    coordinator = coordinator_cli.build_parser()
    worker = worker_cli.build_parser()
    lines = [HEADER]
    lines += _command("coordinator train", "train", subcommand_parser(coordinator, "train"), fields=True)
    lines += _auto_table()
    lines += _command("coordinator report", "report", subcommand_parser(coordinator, "report"), fields=False)
    lines += _command("worker serve", "serve", subcommand_parser(worker, "serve"), fields=False)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REFERENCE,
        help="file to write (default: docs/reference/cli.md, i.e. overwrite the checked-in reference)",
    )
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(), encoding="utf-8")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
