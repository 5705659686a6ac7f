"""Optimizers: inner (worker-side local steps), outer (coordinator's step, replayed by workers), and
learning-rate schedules.

``inner`` wraps the torch optimizer a worker runs for its local steps between syncs (AdamW, SGD, Muon for
hidden matrices with AdamW for the rest, or DeMuon: ``demuon``), with its state as named tensors; ``outer`` is the
coordinator's step on the aggregate (``sgd``, ``nesterov``, ``signsgd`` replayed by every replica;
``adamw`` on the coordinator alone); ``schedule`` gives the learning-rate multiplier as a pure function of
the step. Nothing here touches the network.
"""

from gradwire.optim.inner import INNER_OPTIMIZERS, InnerOptimizer, InnerOptimizerConfig, muon_parameters
from gradwire.optim.outer import OUTER_OPTIMIZERS, UpdateRule, outer_step
from gradwire.optim.schedule import SCHEDULES, Schedule, lr_at

__all__ = [
    "INNER_OPTIMIZERS",
    "OUTER_OPTIMIZERS",
    "SCHEDULES",
    "InnerOptimizer",
    "InnerOptimizerConfig",
    "Schedule",
    "UpdateRule",
    "lr_at",
    "muon_parameters",
    "outer_step",
]
