"""The inner optimizer: what a worker runs for H local steps between two syncs (DiLoCo / SparseLoCo style).

``InnerOptimizer`` wraps the torch optimizer(s) for one model: ``adamw`` (decoupled weight decay), ``sgd``
(optionally heavy-ball or Nesterov momentum), ``muon`` as MuLoCo runs it: ``torch.optim.Muon``
(momentum, then Newton-Schulz orthogonalization; ``optim.muon`` runs it in float32 on CPUs that would
emulate bfloat16) on the hidden 2-D weight matrices and AdamW on everything
else (embeddings, the output head, norms, biases; ``muon_parameters`` is the one rule deciding which is
which), or ``demuon`` (``optim.demuon``): every 2-D parameter steps by the matrix sign of its momentum
(Newton-Schulz, SVD or none), every vector by that momentum. On a node's ranks that compute alike it may
be partitioned (ZeRO-1, torch's ``ZeroRedundancyOptimizer``): each rank keeps and steps the state of its
own share of the parameters.

A worker keeps this state for a training run across rounds, and it must cross the network and go into
safetensors checkpoints, so it leaves and enters only as named tensors, never pickles:
``"<parameter name>/<state key>"``, with the parameter names of ``model.named_parameters()`` (the same in
every process that builds the same model), e.g. ``blocks.0.attn.qkv.weight/exp_avg``. Parameters that
have had no gradient yet have no state and no entries.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gradwire.optim.demuon import MSGN, DeMuon
from gradwire.optim.lr_scales import LrScales, check_lr_scales
from gradwire.optim.muon import Muon

INNER_OPTIMIZERS = ("adamw", "sgd", "muon", "demuon")

# The state each torch optimizer keeps per parameter (for the settings used here: no amsgrad, no
# capturable/fused). The exact key set is what load_state_tensors accepts for a parameter with state.
_ADAMW_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})
_MOMENTUM_KEYS = frozenset({"momentum_buffer"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class InnerOptimizerConfig:
    """Settings of the inner optimizer; field names match the coordinator's ``--inner-*`` flags.

    Attributes:
        name: one of ``INNER_OPTIMIZERS``.
        weight_decay: decoupled weight decay (``p <- p * (1 - lr * wd)``), for every optimizer and, under
            muon, for both of its groups.
        betas: AdamW's (beta1, beta2); under muon, those of the AdamW group.
        eps: AdamW's epsilon; under muon, that of the AdamW group (Muon's own Newton-Schulz epsilon stays
            at torch's default).
        momentum: sgd: heavy-ball momentum, 0 for plain SGD. muon: its momentum, which must be in (0, 1);
            no default is hidden here, the coordinator's default for muon is 0.95. demuon: in [0, 1) (the
            coordinator's default 0.8, the seed's). adamw: must be 0 (AdamW's momentum is beta1).
        nesterov: sgd only, and only with momentum: Nesterov momentum. Muon always uses Nesterov (torch's
            default for it).
        ns_steps: muon, and demuon with ``msgn="newton-schulz"``: Newton-Schulz iterations per step.
        msgn: demuon only: how the matrices' momentum becomes their step, one of ``demuon.MSGN``.
        lr_scales: (parameter name, factor) pairs (``optim.lr_scales``): those parameters step, and decay, at
            the learning rate times their factor, every other at the learning rate
            (``--inner-embedding-lr-scale``: the token embedding's). A name the model lacks is skipped here:
            a pipeline stage holds part of the model; the worker checks the names against the whole one.
    """

    name: str = "adamw"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.0
    nesterov: bool = False
    ns_steps: int = 5
    msgn: str = "newton-schulz"
    lr_scales: LrScales = ()

    def __post_init__(self) -> None:
        if self.name not in INNER_OPTIMIZERS:
            raise ValueError(f"--inner-optimizer must be one of {', '.join(INNER_OPTIMIZERS)}; got {self.name!r}")
        if not _is_number(self.weight_decay) or not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"--inner-weight-decay must be a finite number >= 0, got {self.weight_decay!r}")
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(_is_number(b) for b in betas):
            raise ValueError(f"--inner-betas must be two numbers (beta1, beta2), got {betas!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"--inner-betas must each be in [0, 1), got {tuple(betas)}")
        # JSON brings the pair back as a list: store the tuple the field promises (and that hashing needs).
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if not _is_number(self.eps) or not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"--inner-eps must be a positive finite number, got {self.eps!r}")
        if not _is_number(self.momentum) or not math.isfinite(self.momentum):
            raise ValueError(f"--inner-momentum must be a finite number, got {self.momentum!r}")
        if self.name == "adamw" and self.momentum != 0.0:
            raise ValueError(
                "--inner-momentum does not apply to --inner-optimizer adamw (its momentum is beta1 "
                f"of --inner-betas); got {self.momentum}"
            )
        if self.name == "sgd" and not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"--inner-momentum must be in [0, 1) for --inner-optimizer sgd, got {self.momentum}")
        if self.name == "muon" and not 0.0 < self.momentum < 1.0:
            raise ValueError(
                f"--inner-momentum must be in (0, 1) for --inner-optimizer muon (0.95 is usual), got {self.momentum}"
            )
        if self.name == "demuon" and not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"--inner-momentum must be in [0, 1) for --inner-optimizer demuon, got {self.momentum}")
        if self.msgn not in MSGN:
            raise ValueError(f"--msgn must be one of {', '.join(MSGN)}, got {self.msgn!r}")
        if self.msgn != "newton-schulz" and self.name != "demuon":
            raise ValueError(f"--msgn applies to --inner-optimizer demuon only, not {self.name}")
        if type(self.nesterov) is not bool:  # 1 or "yes" from a config file is a mistake
            raise ValueError(f"--inner-nesterov must be true or false, got {self.nesterov!r}")
        if self.nesterov and self.name != "sgd":
            raise ValueError(
                f"--inner-nesterov applies to --inner-optimizer sgd only (muon always uses Nesterov "
                f"momentum), not {self.name}"
            )
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("--inner-nesterov needs --inner-momentum > 0")
        # torch's Newton-Schulz refuses 100 or more iterations.
        if not _is_int(self.ns_steps) or not 1 <= self.ns_steps < 100:
            raise ValueError(f"--inner-ns-steps must be an integer in [1, 99], got {self.ns_steps!r}")
        # (str, float) tuples, also from JSON's lists: the config is compared and hashed
        object.__setattr__(self, "lr_scales", check_lr_scales(self.lr_scales, "inner optimizer"))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: the config travels to workers as data."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["lr_scales"] = [list(pair) for pair in self.lr_scales]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InnerOptimizerConfig:
        # An unknown key is a typo or a newer sender: refuse it rather than optimize differently than asked.
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown InnerOptimizerConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)


def _is_int(value: object) -> bool:
    # bool is an int subclass; `true` from JSON or YAML is a mistake, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def muon_parameters(model: nn.Module) -> list[str]:
    """Names of the hidden 2-D weight matrices: the parameters Muon optimizes, in ``named_parameters`` order.

    Every 2-D parameter except the weights of ``nn.Embedding`` modules (token and learned position
    embeddings) and the output head that ``model.get_output_embeddings()`` returns on Hugging Face models.
    Those two are lookups and a classifier rather than maps between hidden states, and MuLoCo/DeMuon leave
    them to AdamW. Parameters are compared by identity: a head tied to the input embedding (the built-in
    GPT, many HF models) is one tensor, listed once by ``named_parameters`` under the embedding's name.
    """
    excluded: set[int] = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    if callable(get_output_embeddings):
        head = get_output_embeddings()
        if head is not None and isinstance(getattr(head, "weight", None), torch.Tensor):
            excluded.add(id(head.weight))
    return [name for name, p in model.named_parameters() if p.ndim == 2 and id(p) not in excluded]


class InnerOptimizer:
    """Wraps the torch optimizer(s) for one model.

    The learning rate is given at every ``step`` (the worker's schedule owns it); every other setting comes
    from the config. ``state_tensors`` / ``load_state_tensors`` carry the full state as named tensors.

    ``partitioned`` (ZeRO-1; every rank of the default process group builds one alike, over the same
    parameters, and steps it alike): each torch optimizer is wrapped in torch's ``ZeroRedundancyOptimizer``,
    so a rank keeps the state of its partition of the parameters only (whole tensors, balanced by size),
    steps those and broadcasts them to the other ranks. ``state_tensors`` is then this rank's partition,
    and ``load_state_tensors`` keeps the entries of its partition of whatever it is given (one rank's, or
    the whole state).
    """

    def __init__(self, model: nn.Module, config: InnerOptimizerConfig, *, partitioned: bool = False) -> None:
        self.config = config
        self.partitioned = partitioned
        # named_parameters() lists a tied tensor once, so each parameter has exactly one name.
        self._params: dict[str, nn.Parameter] = dict(model.named_parameters())
        factors = dict(config.lr_scales)
        self._factor = {id(p): factors.get(name, 1.0) for name, p in self._params.items()}
        c = config
        # lr=0 until the first step(lr) sets it: nothing may step with a learning rate nobody chose.
        if c.name == "adamw":
            adamw = self._build(
                torch.optim.AdamW,
                list(self._params.values()),
                lr=0.0,
                betas=c.betas,
                eps=c.eps,
                weight_decay=c.weight_decay,
            )
            self._optimizers: list[torch.optim.Optimizer] = [adamw]
            self._expected = {name: _ADAMW_KEYS for name in self._params}
        elif c.name == "sgd":
            sgd = self._build(
                torch.optim.SGD,
                list(self._params.values()),
                lr=0.0,
                momentum=c.momentum,
                nesterov=c.nesterov,
                weight_decay=c.weight_decay,
            )
            self._optimizers = [sgd]
            # Plain SGD (momentum 0) keeps no state at all.
            keys = _MOMENTUM_KEYS if c.momentum > 0 else frozenset()
            self._expected = {name: keys for name in self._params}
        elif c.name == "demuon":
            groups = (
                ([p for p in self._params.values() if p.ndim == 2], c.msgn),
                ([p for p in self._params.values() if p.ndim != 2], "none"),
            )
            self._optimizers = [
                self._build(
                    DeMuon,
                    params,
                    lr=0.0,
                    momentum=c.momentum,
                    msgn=msgn,
                    ns_steps=c.ns_steps,
                    weight_decay=c.weight_decay,
                )
                for params, msgn in groups
                if params
            ]
            self._expected = {name: _MOMENTUM_KEYS for name in self._params}
        else:
            hidden = set(muon_parameters(model))
            self._optimizers = []
            if hidden:
                # "match_rms_adamw" scales each matrix's orthogonalized update to the RMS an AdamW update
                # has (0.2 * sqrt(max(A, B))), so one learning rate and one schedule suit both groups.
                self._optimizers.append(
                    self._build(
                        Muon,
                        [p for n, p in self._params.items() if n in hidden],
                        lr=0.0,
                        weight_decay=c.weight_decay,
                        momentum=c.momentum,
                        nesterov=True,
                        ns_steps=c.ns_steps,
                        adjust_lr_fn="match_rms_adamw",
                    )
                )
            rest = [p for n, p in self._params.items() if n not in hidden]
            if rest:
                self._optimizers.append(
                    self._build(torch.optim.AdamW, rest, lr=0.0, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)
                )
            self._expected = {name: _MOMENTUM_KEYS if name in hidden else _ADAMW_KEYS for name in self._params}
        # The optimizers that hold state (a ZeroRedundancyOptimizer's local one), and which holds each
        # parameter's: every parameter, or under ZeRO-1 those of this rank's partition.
        self._holders = [opt.optim if partitioned else opt for opt in self._optimizers]
        self._owner: dict[int, torch.optim.Optimizer] = {
            id(p): opt for opt in self._holders for group in opt.param_groups for p in group["params"]
        }

    def _build(
        self, kind: type[torch.optim.Optimizer], params: list[nn.Parameter], **settings: Any
    ) -> torch.optim.Optimizer:
        # One param group per learning-rate factor (``lr_scale``, which ``step`` multiplies in), in the
        # order the factors first appear: a single group when no factor applies.
        groups: dict[float, list[nn.Parameter]] = {}
        for p in params:
            groups.setdefault(self._factor[id(p)], []).append(p)
        param_groups = [{"params": members, "lr_scale": factor} for factor, members in groups.items()]
        if self.partitioned:
            # Imported here: its functional optimizers are TorchScript-compiled at import (~0.25 s), which
            # only a ZeRO-1 node needs.
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(param_groups, optimizer_class=kind, **settings)
        return kind(param_groups, **settings)

    def step(self, lr: float) -> None:
        """One update of every parameter that has a gradient, at learning rate ``lr`` (times the parameter's
        factor in ``lr_scales``)."""
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        for opt in self._optimizers:
            for group in opt.param_groups:
                group["lr"] = lr * group["lr_scale"]
            opt.step()

    def zero_grad(self) -> None:
        # set_to_none: a parameter the next backward does not reach stays without a gradient (and unstepped).
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor as a CPU copy, named ``"<parameter name>/<state key>"``.

        Copies, so the caller may serialize them while training goes on; on the CPU, because they are
        bound for the network or a safetensors file. Ordered by parameter, then key. ``partitioned``: this
        rank's partition only (read from its local optimizer: no collective).
        """
        out: dict[str, torch.Tensor] = {}
        for name, p in self._params.items():
            holder = self._owner.get(id(p))
            state = holder.state.get(p, {}) if holder is not None else {}
            for key in sorted(state):
                value = state[key]
                if not isinstance(value, torch.Tensor):
                    # Not expected from the optimizers used here; fail loudly rather than drop state.
                    raise TypeError(f"optimizer state {name}/{key} is a {type(value).__name__}, not a tensor")
                out[f"{name}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
        return out

    def load_state_tensors(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the whole state with ``state`` (as ``state_tensors`` returns it); the exact inverse.

        Everything is checked before anything changes: a ValueError naming the key for a malformed or
        unknown name, a state key this optimizer does not keep, a parameter with only some of its keys, a
        wrong shape or dtype, or a non-finite value. Parameters absent from ``state`` end up with no state,
        as if they had never had a gradient. Tensors are copied (never shared with the caller) onto the
        parameter's device and dtype, following torch's own policy for ``step`` (kept on the CPU).
        ``partitioned``: everything is checked, and the entries of this rank's partition are kept.
        """
        staged: dict[str, dict[str, torch.Tensor]] = {}
        for full_key, value in state.items():
            name, sep, key = full_key.rpartition("/") if isinstance(full_key, str) else ("", "", "")
            if not sep or not name or not key:
                raise ValueError(f"optimizer state key {full_key!r} is not '<parameter name>/<state key>'")
            if name not in self._params:
                raise ValueError(f"optimizer state {full_key!r}: the model has no parameter {name!r}")
            if key not in self._expected[name]:
                raise ValueError(
                    f"optimizer state {full_key!r}: {self.config.name} keeps no {key!r} for this "
                    f"parameter (it keeps {sorted(self._expected[name]) or 'nothing'})"
                )
            _check_tensor(full_key, key, value, self._params[name])
            staged.setdefault(name, {})[key] = value
        for name, entries in staged.items():
            missing = sorted(self._expected[name] - entries.keys())
            if missing:
                raise ValueError(f"optimizer state for {name!r} lacks {[f'{name}/{k}' for k in missing]}")

        for opt in self._holders:
            params = [p for group in opt.param_groups for p in group["params"]]
            index = {id(p): i for i, p in enumerate(params)}
            packed = {
                index[id(p)]: {key: _copy_for(p, key, value) for key, value in staged[name].items()}
                for name, p in self._params.items()
                if name in staged and self._owner.get(id(p)) is opt
            }
            # Through torch's loader (with the optimizer's own param groups) so its invariants and hooks
            # hold; it drops every parameter's old state, hence "replace".
            opt.load_state_dict({"state": packed, "param_groups": opt.state_dict()["param_groups"]})


def _check_tensor(full_key: str, key: str, value: object, param: torch.Tensor) -> None:
    if not torch.is_tensor(value):
        raise ValueError(f"optimizer state {full_key!r} must be a tensor, got {type(value).__name__}")
    # AdamW's step count is a 0-d tensor; every other state tensor has the parameter's shape.
    shape = torch.Size([]) if key == "step" else param.shape
    if value.shape != shape:
        raise ValueError(f"optimizer state {full_key!r} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    if not value.is_floating_point():
        raise ValueError(f"optimizer state {full_key!r} must be floating point, got {value.dtype}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"optimizer state {full_key!r} has non-finite values")
    if key == "step" and (value.item() < 0 or value.item() != int(value.item())):
        raise ValueError(f"optimizer state {full_key!r} must be a whole number >= 0, got {value.item()}")
    if key == "exp_avg_sq" and bool((value < 0).any()):
        # AdamW divides by its square root: a negative second moment would turn the update into NaN.
        raise ValueError(f"optimizer state {full_key!r} has negative values")


def _copy_for(param: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
    if key == "step":
        # torch keeps a non-fused, non-capturable optimizer's step count on the CPU.
        return value.detach().to("cpu", copy=True)
    return value.detach().to(device=param.device, dtype=param.dtype, copy=True)
