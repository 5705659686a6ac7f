"""The outer optimizer: the coordinator's step on the aggregate, as data every replica agrees on.

In gradient mode the aggregate is the workers' mean gradient; in local-SGD rounds it is their mean
*pseudo-gradient* ``replica - working`` after H inner steps (DiLoCo), so an outer ``sgd`` step with
learning rate 1 lands on the average of the workers' models.

Rules that are a function of the aggregate and of state every replica can keep (``sgd`` with heavy-ball
momentum, ``nesterov``, ``signsgd``) are *replayed*: each holder of a replica runs ``outer_step`` itself on
the same aggregate, so copies on the same kind of device stay bit-identical. ``adamw`` keeps its moments on
the coordinator alone; its updates travel as compressed parameter deltas (see ``gradwire.replica``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Literal

import torch

OuterOptimizer = Literal["sgd", "nesterov", "signsgd", "adamw"]
OUTER_OPTIMIZERS: tuple[str, ...] = ("sgd", "nesterov", "signsgd", "adamw")
REPLAYABLE = ("sgd", "nesterov", "signsgd")


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateRule:
    """The outer optimizer, as data both sides agree on.

    Attributes:
        optimizer: ``sgd`` (heavy-ball ``momentum`` optional), ``nesterov`` (SGD with Nesterov momentum,
            DiLoCo's outer optimizer), ``signsgd`` (DeMo's sign step) or ``adamw``.
        weight_decay: decoupled: ``p <- p * (1 - lr * weight_decay)`` before the step.
        momentum: the momentum of ``sgd`` and ``nesterov`` (replayed by workers too; ``nesterov`` needs it > 0).
        betas, eps: ``adamw`` only; its state lives on the coordinator alone.
    """

    optimizer: OuterOptimizer = "signsgd"
    weight_decay: float = 0.0
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"--outer-optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, got {self.optimizer!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.momentum and self.optimizer not in ("sgd", "nesterov"):
            raise ValueError(f"--momentum applies to the sgd and nesterov outer optimizers, not {self.optimizer}")
        if self.optimizer == "nesterov" and not self.momentum:
            raise ValueError("--outer-optimizer nesterov needs --momentum > 0 (DiLoCo uses 0.9)")
        if not all(math.isfinite(b) and 0 <= b < 1 for b in self.betas) or not (
            math.isfinite(self.eps) and self.eps > 0
        ):
            raise ValueError(f"adamw betas must be in [0, 1) and eps > 0, got {self.betas}, {self.eps}")

    @property
    def replayable(self) -> bool:
        return self.optimizer in REPLAYABLE

    @property
    def has_momentum(self) -> bool:
        return self.optimizer in ("sgd", "nesterov") and self.momentum > 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> UpdateRule:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"update rule is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("update rule must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown update rule keys {unknown}")
        if "betas" in raw:
            if not isinstance(raw["betas"], list) or len(raw["betas"]) != 2:
                raise ValueError("update rule betas must be a list of two numbers")
            raw["betas"] = tuple(raw["betas"])
        try:
            return cls(**raw)
        except TypeError as e:  # a value of the wrong type (a string momentum, ...)
            raise ValueError(f"update rule: {e}") from None


@torch.no_grad()
def outer_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    rule: UpdateRule,
    lr: float,
    momentum: list[torch.Tensor] | None = None,
) -> None:
    """One replayable outer step in place.

    ``momentum`` holds the momentum buffers of ``sgd``/``nesterov``, one per parameter, created on first
    use (``buf = g``), then ``buf <- mu * buf + g``; ``sgd`` steps along ``buf``, ``nesterov`` along
    ``g + mu * buf``: exactly ``torch.optim.SGD(momentum=mu, nesterov=...)`` with decoupled weight decay.
    """
    if not rule.replayable:
        raise ValueError(f"{rule.optimizer} is not replayed; its updates travel as deltas")
    if rule.optimizer == "signsgd":
        for batch in _batches(params, grads):
            _sign_step(*zip(*batch), rule, lr)
        return
    for i, (p, g) in enumerate(zip(params, grads)):
        g = g.to(p.device, torch.float32)
        if rule.weight_decay:
            p.mul_(1 - lr * rule.weight_decay)
        if rule.has_momentum and momentum is not None:
            if len(momentum) <= i:
                momentum.append(g.clone())
            else:
                momentum[i].mul_(rule.momentum).add_(g)
            g = g.add(momentum[i], alpha=rule.momentum) if rule.optimizer == "nesterov" else momentum[i]
        p.add_(g.to(p.dtype), alpha=-lr)


# The elements of one batch of tensors a sign step takes at once: its signs' temporary stays at most 64 MiB.
BATCH_ELEMENTS = 1 << 24
# Device types whose sign step goes a tensor at a time (``_batches``): gpt-80m's on a 2-core CPU took 76-85 ms
# in batches against 66-74 ms a tensor at a time.
ALONE_ON = frozenset({"cpu"})


def _batches(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """(parameter, gradient) pairs in runs of one device and dtype, each of at most ``BATCH_ELEMENTS``
    elements unless one tensor is larger; on a CPU (``ALONE_ON``) a tensor a run, where a launch costs nothing
    and the step's second pass over a tensor finds it still in the cache."""
    batches: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    size = 0
    for p, g in zip(params, grads):
        last = batches[-1][-1][0] if batches else None
        if (
            last is None
            or (last.device, last.dtype) != (p.device, p.dtype)
            or size + p.numel() > BATCH_ELEMENTS
            or p.device.type in ALONE_ON
        ):
            batches.append([])
            size = 0
        batches[-1].append((p, g))
        size += p.numel()
    return batches


def _sign_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], rule: UpdateRule, lr: float) -> None:
    """``p <- p (1 - lr wd) - lr sign(g)`` for a batch of one device and dtype, a launch an operation for the
    whole batch (torch's foreach operations) instead of one a tensor: on a GPU a model's few hundred launches a
    replay cost more than their arithmetic. The same bits as a tensor at a time: ``lr`` times a sign is
    exact, so each value rounds once per operation either way."""
    params = list(params)
    signs = torch._foreach_sign([g.to(params[0].device, torch.float32) for g in grads])
    if params[0].dtype != torch.float32:
        signs = [s.to(params[0].dtype) for s in signs]
    if rule.weight_decay:
        torch._foreach_mul_(params, 1 - lr * rule.weight_decay)
    torch._foreach_add_(params, signs, alpha=-lr)
