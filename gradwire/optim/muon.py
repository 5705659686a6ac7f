"""Muon whose Newton-Schulz iteration runs in a precision the device multiplies natively.

``torch.optim.Muon`` always orthogonalizes in bfloat16. That is the right call on GPUs and on CPUs with
AVX512-BF16 or AMX, and a large slowdown everywhere else: oneDNN emulates bfloat16 matmuls there, and one
Muon step of a 256x768 matrix took 0.57 s instead of ~0.02 s, which made a gpt-5m inner step 20x slower
than AdamW's. ``Muon`` below is torch's optimizer, state and settings unchanged (the same
``momentum_buffer``, so checkpoints move between the two), with one difference: where bfloat16 would be
emulated, its Newton-Schulz iteration runs in float32. Everywhere else it is torch's own step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gradwire import hardware


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the device multiplies it natively (as torch's Muon always does), float32 elsewhere."""
    if device.type == "cpu" and not hardware.cpu_multiplies_bf16():
        return torch.float32
    return torch.bfloat16


def orthogonalize(
    update: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Newton-Schulz's approximate ``U V^T`` of ``update = U S V^T`` (singular values land in ~[0.5, 1.5]).

    The quintic iteration of Keller Jordan's Muon, as torch runs it, in ``dtype``; returns ``dtype``.
    """
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch's scaling of Muon's learning rate for a matrix of ``shape`` (``adjust_lr_fn`` as torch names it)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with float32 Newton-Schulz where bfloat16 would be emulated (see the module)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        devices = {p.device for group in self.param_groups for p in group["params"]}
        if all(newton_schulz_dtype(d) == torch.bfloat16 for d in devices):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)  # torch's own checks and state creation
            lr, momentum = group["lr"], group["momentum"]
            for p, grad, buf in zip(params, grads, buffers, strict=True):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                ortho = orthogonalize(
                    update, group["ns_coefficients"], group["ns_steps"], group["eps"], newton_schulz_dtype(p.device)
                )
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho.to(p.dtype), alpha=-lr * lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss
