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
import functools
import json
import math
from collections.abc import Collection, Sequence
from typing import Literal

import torch

from gradwire.optim.lr_scales import LrScales, check_lr_scales, unknown_names

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
        lr_scales: (parameter name, factor) pairs: those parameters step at the learning rate times their
            factor, every other at the learning rate (``--embedding-lr-scale``: the token embedding's). Replayed
            rules only: every replica steps alike.
    """

    optimizer: OuterOptimizer = "signsgd"
    weight_decay: float = 0.0
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    lr_scales: LrScales = ()

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
        self._check_lr_scales()

    def _check_lr_scales(self) -> None:
        # kept as (str, float) tuples: a rule is data, equal and hashable on both sides of the wire
        object.__setattr__(self, "lr_scales", check_lr_scales(self.lr_scales, "update rule"))
        if self.lr_scales and not self.replayable:
            raise ValueError(
                f"per-parameter learning rates (--embedding-lr-scale) need a replayed outer optimizer: {self.optimizer}"
            )

    @functools.cached_property
    def _factors(self) -> dict[str, float]:
        return dict(self.lr_scales)  # built once per rule: a replay asks for every tensor's

    def lr_scale(self, name: str) -> float:
        """The factor of parameter ``name``'s learning rate: 1 unless ``lr_scales`` names it."""
        return self._factors.get(name, 1.0)

    def check_names(self, names: Collection[str]) -> None:
        """``ValueError`` unless every parameter ``lr_scales`` names is one of the model's ``names``."""
        unknown = unknown_names(self.lr_scales, names)
        if unknown:
            raise ValueError(f"update rule lr_scales names parameters the model does not have: {unknown[:4]}")

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
        if "lr_scales" in raw:
            raw["lr_scales"] = check_lr_scales(raw["lr_scales"], "update rule")
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
    scales: Sequence[float] | None = None,
) -> None:
    """One replayable outer step in place.

    ``momentum`` holds the momentum buffers of ``sgd``/``nesterov``, one per parameter, created on first
    use (``buf = g``), then ``buf <- mu * buf + g``; ``sgd`` steps along ``buf``, ``nesterov`` along
    ``g + mu * buf``: exactly ``torch.optim.SGD(momentum=mu, nesterov=...)`` with decoupled weight decay.
    ``scales``: each parameter's factor of ``lr`` (its weight decay's too; ``UpdateRule.lr_scale``), 1 if None.
    """
    if not rule.replayable:
        raise ValueError(f"{rule.optimizer} is not replayed; its updates travel as deltas")
    params = list(params)
    scales = [1.0] * len(params) if scales is None else list(scales)
    if len(scales) != len(params):
        raise ValueError(f"{len(scales)} learning-rate factors for {len(params)} parameters")
    if rule.optimizer == "signsgd":
        for batch in _batches(params, grads, scales):
            tensors, steps, factors = zip(*batch)
            _sign_step(tensors, steps, rule, lr * factors[0])
        return
    for i, (p, g) in enumerate(zip(params, grads)):
        g = g.to(p.device, torch.float32)
        p_lr = lr * scales[i]
        if rule.weight_decay:
            p.mul_(1 - p_lr * rule.weight_decay)
        if rule.has_momentum and momentum is not None:
            if len(momentum) <= i:
                momentum.append(g.clone())
            else:
                momentum[i].mul_(rule.momentum).add_(g)
            g = g.add(momentum[i], alpha=rule.momentum) if rule.optimizer == "nesterov" else momentum[i]
        p.add_(g.to(p.dtype), alpha=-p_lr)


# The elements of one batch of tensors a sign step takes at once: its signs' temporary stays at most 64 MiB.
BATCH_ELEMENTS = 1 << 24
# Device types whose sign step goes a tensor at a time (``_batches``): gpt-80m's on a 2-core CPU took 76-85 ms
# in batches against 66-74 ms a tensor at a time.
ALONE_ON = frozenset({"cpu"})


def _batches(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scales: Sequence[float]
) -> list[list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """(parameter, gradient, learning-rate factor) triples in runs of one device, dtype and factor, each of at
    most ``BATCH_ELEMENTS`` elements unless one tensor is larger; on a CPU (``ALONE_ON``) a tensor a run, where
    a launch costs nothing and the step's second pass over a tensor finds it still in the cache."""
    batches: list[list[tuple[torch.Tensor, torch.Tensor, float]]] = []
    size = 0
    for p, g, f in zip(params, grads, scales):
        last = batches[-1][-1] if batches else None
        if (
            last is None
            or (last[0].device, last[0].dtype, last[2]) != (p.device, p.dtype, f)
            or size + p.numel() > BATCH_ELEMENTS
            or p.device.type in ALONE_ON
        ):
            batches.append([])
            size = 0
        batches[-1].append((p, g, f))
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
