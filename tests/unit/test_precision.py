"""``--precision auto|fp32|bf16``: what a worker's (and ``benchmarks.utilisation``'s bare loop's) forward and
backward run in, a pure function of the request and the device (no GPU needed: its support is passed in)."""

from __future__ import annotations

import pytest
import torch

from gradwire.hardware import AUTOCAST_PRECISIONS, choose_precision, resolve_precision
from gradwire.worker.cli import build_parser
from gradwire.worker.nodeconf import check_placement
from gradwire.worker.placement import Placement


@pytest.mark.parametrize(
    ("requested", "device_type", "bf16", "precision", "reason"),
    [
        ("auto", "cuda", True, "bf16", "bf16 autocast on a GPU"),
        ("auto", "cuda", False, "fp32", "does not compute in bfloat16"),
        ("auto", "cpu", False, "fp32", "fp32 on the cpu"),
        ("auto", "cpu", True, "fp32", "fp32 on the cpu"),  # a CPU's bfloat16 is no reason to autocast
        ("fp32", "cuda", True, "fp32", "--precision fp32"),
        ("bf16", "cpu", False, "bf16", "--precision bf16"),  # as asked
        ("bf16", "cuda", True, "bf16", "--precision bf16"),
    ],
)
def test_the_precision_and_why(requested: str, device_type: str, bf16: bool, precision: str, reason: str) -> None:
    got, why = choose_precision(requested, device_type, bf16)
    assert got == precision and reason in why


def test_an_unknown_precision_names_the_flag() -> None:
    assert AUTOCAST_PRECISIONS == ("auto", "fp32", "bf16")
    with pytest.raises(ValueError, match="--precision must be one of auto, fp32, bf16"):
        choose_precision("fp16", "cuda", True)


def test_auto_on_this_machines_cpu_is_fp32() -> None:
    assert resolve_precision("auto", "cpu")[0] == "fp32"
    assert resolve_precision("auto", torch.device("cpu"))[0] == "fp32"
    assert resolve_precision("bf16", "cpu")[0] == "bf16"  # as asked: worker_stages tests its gradient


def test_the_worker_takes_auto_and_a_placement_only_a_resolved_precision() -> None:
    args = build_parser().parse_args(["serve", "--port", "0", "--precision", "auto"])
    assert args.precision == "auto"
    check_placement("ddp", "full", 0, "none", "auto", 0, "1f1b")  # the launcher's check, before torch
    with pytest.raises(ValueError, match="resolve --precision auto"):
        Placement(precision="auto")
