"""What each round asks of its workers: their batches, cut from the data, and the settings of the run.

``WorkPlanner.work`` turns a round number and the slots working it into a ``round.RoundWork``, the plain
value the dispatcher builds every work order from. Batches are a pure function of (round, inner step,
position among the round's workers), so a retried or resumed round sends the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradwire.compression import CodecConfig
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.data import TokenSource
from gradwire.coordinator.round import RoundWork, WorkerSlot
from gradwire.protocol import LocalSteps


class WorkPlanner:
    def __init__(self, config: TrainConfig, data: TokenSource, codec: CodecConfig, batch_dtype: np.dtype) -> None:
        self.config, self.data, self.codec, self.batch_dtype = config, data, codec, batch_dtype

    def work(self, step: int, slots: Sequence[WorkerSlot]) -> RoundWork:
        """Round ``step``'s work for ``slots``: their batches (by position among them: disjoint within a
        step) and every setting their orders carry."""
        cfg = self.config
        # A stream lays each step out by the workers' rows and goes on from where it was when they change:
        # nothing skipped, nothing twice.
        self.data.set_layout(step * cfg.inner_steps, [cfg.batch_size * slot.ranks for slot in slots])
        batches = {slot.index: self.batch(step, position, slot.ranks) for position, slot in enumerate(slots)}
        # --overlap in gradient mode: announce each worker's next batch (the same workers assumed), so that
        # it can compute that gradient while this round's result travels (worker.lookahead).
        next_batches = {}
        if cfg.overlap and not cfg.local_sgd and step + 1 < cfg.steps:
            next_batches = {s.index: self.batch(step + 1, i, s.ranks) for i, s in enumerate(slots)}
        local_steps = None
        if cfg.local_sgd:
            local_steps = LocalSteps(
                cfg.inner_steps, cfg.inner_optimizer_config(), cfg.inner_lrs(step), cfg.clip_grad_norm
            )
        return RoundWork(
            step,
            self.codec,
            batches,
            next_batches,
            local_steps,
            feedback_beta=cfg.feedback_beta,
            micro_batch_size=cfg.micro_batch_size,
            sync_tolerance=cfg.sync_tolerance,
            compute_before_update=cfg.overlap,
            clip_grad_norm=0.0 if cfg.local_sgd else cfg.clip_grad_norm,  # local steps clip every inner step
        )

    def batch(self, step: int, slot: int, ranks: int = 1) -> np.ndarray:
        """A worker's rows for round ``step``: H inner steps' batches stacked, (H * ranks * batch_size, T + 1).

        Inner step h of round r draws the data's step r * H + h, so one inner step per round is exactly
        gradient mode's batch. A node of several ranks gets ``batch_size`` rows per rank (``--batch-size``
        is per GPU).
        """
        cfg, h = self.config, self.config.inner_steps
        rows = [self.data.batch(step * h + i, slot, cfg.batch_size * ranks, cfg.sequence_length) for i in range(h)]
        return np.concatenate(rows).astype(self.batch_dtype)
