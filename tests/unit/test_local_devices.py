"""``--local-device``: where ``--local`` worker daemons run, a pure function of the worker count, the request
and the GPUs the machine has (no GPU needed here: the count is passed in)."""

from __future__ import annotations

import pytest

from gradwire.coordinator.local import LOCAL_DEVICES, local_devices, local_workers


@pytest.mark.parametrize(
    ("n", "requested", "gpus", "devices", "reason"),
    [
        (2, "auto", 2, ["cuda:0", "cuda:1"], "one GPU per local worker"),
        (2, "auto", 8, ["cuda:0", "cuda:1"], "one GPU per local worker"),
        (4, "auto", 2, ["cpu"] * 4, "2 GPU(s) for 4 local workers"),  # no sharing unless asked for
        (3, "auto", 0, ["cpu"] * 3, "no CUDA device"),
        (3, "cuda", 3, ["cuda:0", "cuda:1", "cuda:2"], "one GPU per local worker"),
        (5, "cuda", 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"], "share 2 GPU(s), round-robin"),
        (2, "cpu", 4, ["cpu", "cpu"], "on the CPU"),
        (2, "cpu", 0, ["cpu", "cpu"], "on the CPU"),
    ],
)
def test_each_worker_gets_a_device_and_the_decision_says_why(
    n: int, requested: str, gpus: int, devices: list[str], reason: str
) -> None:
    got, why = local_devices(n, requested, gpus)
    assert got == devices
    assert reason in why


def test_cuda_without_a_gpu_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--local-device cuda: no CUDA device"):
        local_devices(2, "cuda", 0)


def test_an_unknown_request_names_the_flag() -> None:
    assert LOCAL_DEVICES == ("auto", "cpu", "cuda")
    with pytest.raises(ValueError, match="--local-device must be one of auto, cpu, cuda"):
        local_devices(1, "tpu", 4)


def test_local_workers_refuses_before_starting_anything() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ValueError, match="--local-device"):
        with local_workers(2, device="cuda"):
            pytest.fail("no worker should start")
