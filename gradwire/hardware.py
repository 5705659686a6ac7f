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
