"""DeMuon's step: momentum, then the matrix sign of the momentum (its orthogonal polar factor).

Decentralized Muon (DeMuon) trains each node with ``m <- mu * m + (1 - mu) * g`` and
``x <- x - lr * msgn(m)``, where ``msgn(M) = U V^T`` for ``M = U S V^T``: every singular value set to 1.
``msgn`` is computed three ways (the seed's ``--msgn 1|2|0``):

* ``newton-schulz``: Muon's quintic Newton-Schulz iteration (``optim.muon.orthogonalize``), fast and
  approximate (singular values land in ~[0.5, 1.5]);
* ``svd``: the exact polar factor from a singular value decomposition, slower;
* ``none``: no orthogonalization, ``x <- x - lr * m``: momentum SGD.

Every 2-D parameter is orthogonalized, the embeddings and the output head too: DeMuon treats each matrix
of the model as a matrix (on gpt-tiny at the seed's lr 0.1, six steps lowered the loss 2.4 nats this way
and 0.9 leaving the embeddings to momentum SGD, as Muon leaves them to AdamW). Vectors (norms, biases) take
the momentum step (``none``) at the same learning rate. Unlike Muon, the step is not rescaled to match
AdamW's RMS: DeMuon's learning rate is the spectral norm of each matrix's step (0.1 in the seed). The state
is one ``momentum_buffer`` per parameter, as Muon's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradwire.optim.muon import newton_schulz_dtype, orthogonalize

MSGN = ("newton-schulz", "svd", "none")
# torch.optim.Muon's defaults: its quintic's coefficients and the epsilon of its normalization.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def matrix_sign(m: torch.Tensor, msgn: str, ns_steps: int = 5) -> torch.Tensor:
    """``msgn(m)`` of a 2-D tensor, in ``m``'s dtype: ``U V^T`` (svd), its Newton-Schulz estimate, or ``m``."""
    if msgn == "none":
        return m
    if m.ndim != 2:
        raise ValueError(f"msgn {msgn!r} needs a 2-D tensor, got shape {tuple(m.shape)}")
    if msgn == "svd":
        u, _, vh = torch.linalg.svd(m.float(), full_matrices=False)
        return (u @ vh).to(m.dtype)
    if msgn == "newton-schulz":
        return orthogonalize(m, NS_COEFFICIENTS, ns_steps, NS_EPS, newton_schulz_dtype(m.device)).to(m.dtype)
    raise ValueError(f"msgn must be one of {', '.join(MSGN)}, got {msgn!r}")


class DeMuon(torch.optim.Optimizer):
    """DeMuon's per-node step. A parameter group's ``msgn`` says how its momentum becomes a step; give the
    hidden matrices one group with ``newton-schulz`` or ``svd`` and the rest a group with ``none``."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 0.0,
        momentum: float = 0.8,
        msgn: str = "newton-schulz",
        ns_steps: int = 5,
        weight_decay: float = 0.0,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if msgn not in MSGN:
            raise ValueError(f"msgn must be one of {', '.join(MSGN)}, got {msgn!r}")
        defaults = dict(lr=lr, momentum=momentum, msgn=msgn, ns_steps=ns_steps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["msgn"] != "none" and any(p.ndim != 2 for p in group["params"]):
                raise ValueError(f"msgn {group['msgn']!r} orthogonalizes 2-D parameters only")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = matrix_sign(buf, group["msgn"], group["ns_steps"])
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr)
        return loss
