"""What this machine's processors can do fast: choices of precision that depend on the hardware, not the run."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def cpu_multiplies_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), rather than oneDNN emulating it.

    Where it is emulated, a bfloat16 matmul runs several times slower than the same float32 one (7x for a
    256x768 Gram matrix on a CPU without either), so bfloat16 is a speed-up only where this says True.
    """
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    try:
        return any(check() for check in checks if check is not None)
    except RuntimeError:
        return False


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` if available else ``cpu``; check that ``cuda``/``cuda:i`` exist. ValueError if not."""
    if name == "cpu":
        return "cpu"
    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
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


# --precision: what a worker's forward and backward run in (weights, replica and codec stay float32).
AUTOCAST_PRECISIONS = ("auto", "fp32", "bf16")


def choose_precision(requested: str, device_type: str, bf16_supported: bool) -> tuple[str, str]:
    """``fp32`` or ``bf16`` for ``--precision requested`` on a ``device_type`` ("cpu", "cuda") device that
    does (``bf16_supported``) or does not compute in bfloat16, and why. Pure.

    auto: bf16 autocast on a GPU that supports it (its tensor cores run bfloat16 several times faster than
    float32), float32 everywhere else: on a CPU bf16 autocast is a slow-down unless the CPU multiplies
    bfloat16 natively, and even then its gain is small next to what it costs in gradient precision.
    fp32 and bf16 are taken as asked. ``ValueError`` naming --precision for an unknown request.
    """
    if requested not in AUTOCAST_PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(AUTOCAST_PRECISIONS)}, got {requested!r}")
    if requested != "auto":
        return requested, f"--precision {requested}"
    if device_type == "cuda" and bf16_supported:
        return "bf16", "--precision auto: bf16 autocast on a GPU that supports it"
    if device_type == "cuda":
        return "fp32", "--precision auto: fp32, this GPU does not compute in bfloat16"
    return "fp32", f"--precision auto: fp32 on the {device_type}"


def resolve_precision(requested: str, device: str | torch.device) -> tuple[str, str]:
    """``choose_precision`` for ``device`` on this machine (asks CUDA whether it computes in bfloat16)."""
    device_type = torch.device(device).type
    return choose_precision(requested, device_type, device_type == "cuda" and _cuda_bf16())


def _cuda_bf16() -> bool:
    """Whether the GPU computes in bfloat16 natively (Ampere and later), not by emulating it."""
    if not torch.cuda.is_available():
        return False
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.3 has no such argument and counts native support only
        return torch.cuda.is_bf16_supported()
