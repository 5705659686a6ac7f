"""``coordinator train --device``: where the coordinator keeps its replica (auto: a GPU when there is one)."""

from __future__ import annotations

import pytest
import torch

from gradwire.coordinator.cli import build_parser
from gradwire.coordinator.config import TrainConfig
from gradwire.hardware import resolve_device


def test_the_device_flag_is_validated_and_documented(capsys):
    assert TrainConfig(device="cuda:1").device == "cuda:1"
    for bad in ("gpu", "cuda:x", "tpu"):
        with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:INDEX"):
            TrainConfig(device=bad)
    train_help = build_parser().parse_known_args  # the subcommand's help: `coordinator train --help`
    with pytest.raises(SystemExit):
        train_help(["train", "--help"])
    assert "--device DEVICE" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA does")
def test_auto_is_the_cpu_without_cuda_and_cuda_is_refused_clearly():
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device is available here"):
        resolve_device("cuda")
