"""The coordinator's loop for gossip rounds (``coordinator train --topology ring|exponential|complete``).

``Trainer`` makes one of these when the config names a graph. The run is the same service: membership,
data, dispatch, deadlines, metrics and the status page are the centralized loop's. What differs is the
round (``train_step``):

  membership -> the graph of the workers in this round, in join order, and each one's links
  (``gossip.GossipRounds.links``: the neighbours' messages of the last round to relay, whole public copies
  where it holds none, copies to drop) -> dispatch: every order carries the worker's links and its inner
  steps, no update (the replica stays the run's start) -> each message checked and added to its sender's
  public copy (``GossipRounds.finish``) -> the metrics record, with the consensus distance and each worker's
  residual.

The model the run shows (evaluation, the status page, ``final/``) is the consensus: the mean of the public
copies. There is no outer step, so the outer optimizer's settings are unused. A checkpoint keeps the public
copies and each worker's own model and inner optimizer state; a resumed run sends every worker its copies
whole and its own model with its push, and goes on as the straight run would.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path

import torch

from gradwire.coordinator.checkpointer import RunPosition
from gradwire.coordinator.gather import Fate, Gathered
from gradwire.coordinator.gossip import GossipRounds
from gradwire.coordinator.metrics import round_record
from gradwire.coordinator.round import SlotOutcome, WorkerSlot
from gradwire.coordinator.trainer import Trainer
from gradwire.protocol import OK

log = logging.getLogger("gradwire.coordinator")


def member(slot: WorkerSlot) -> str:
    """A worker's name on the graph: its slot, which numbers workers in join order."""
    return str(slot.index)


class GossipTrainer(Trainer):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        cfg = self.config
        assert cfg.gossip_gamma is not None
        self.gossip = GossipRounds(cfg.topology, cfg.gossip_gamma, self.replica.params)
        self._shown: torch.nn.Module | None = None  # the consensus, loaded into a model of its own
        if cfg.resume_from:  # the public copies; each worker's own model goes back with its push
            self.gossip.restore(*self.checkpoints.restored_extra)

    def train_step(self) -> dict | None:
        step, t0, lr = self.step, time.perf_counter(), self.config.inner_lrs(self.step)[0]
        self.roster.update(step)
        if gone := self.gossip.leave([member(s) for s in self.slots]):
            log.info("step %d: %s left the %s graph; their neighbours are re-linked", step, gone, self.config.topology)
        plan = self.rounds.prepare(self.roster.active(step), step)
        work = self.round_work(step, plan.slots)
        links = self.gossip.links([member(s) for s in plan.slots])
        work = dataclasses.replace(work, gossip={s.index: links[member(s)] for s in plan.slots})
        codec = self.outer.codec
        round_ = self.rounds.run(plan, work, self._stream_plan(codec))
        t_gathered = time.perf_counter()
        answers = {member(o.slot): o.result if _usable(o) else None for o in round_.outcomes}
        finish = self.gossip.finish(answers, codec)
        kept = [o for o in round_.outcomes if member(o.slot) in finish.accepted]
        fates = tuple(
            Fate(o.slot.index, o.slot.client.address, "left out", finish.refused[member(o.slot)])
            for o in round_.outcomes
            if member(o.slot) in finish.refused and o.result is not None
        )
        gathered = Gathered(tuple(kept), None, (1.0,) * len(kept), fates)
        self._log_fates(step, gathered)
        if not kept:
            self._report(round_, None, gathered)
            return None
        tokens = sum(o.result.tokens for o in kept if o.result is not None)
        self.position = RunPosition(step + 1, self.total_tokens + tokens)
        record = round_record(
            self.step,
            round_,
            gathered,
            grad_norm=0.0,
            lr=lr,
            times=(t0, t_gathered, time.perf_counter()),
            total_tokens=self.total_tokens,
            dense_bytes=4 * codec.plan.numel,
            inner_steps=self.config.round_steps,
            benched=0,
        )
        residuals = [o.result.gossip_residual for o in kept if o.result is not None]
        assert self.gossip.graph is not None
        degrees = [len(self.gossip.graph.neighbours_of(member(s))) for s in plan.slots]
        record.update(
            topology=self.config.topology,
            # the mean squared distance of the present workers' public copies from their mean, after the round
            consensus_distance=finish.consensus_distance,
            # what the workers' messages have not carried yet: the mean of |x_i - x^_i|^2 they reported
            gossip_residual=sum(residuals) / len(residuals),
            degree_max=max(degrees),
            # each worker's order, by address: the relayed messages and copies it was sent, its batch
            worker_bytes_down={o.slot.client.address: o.bytes_down for o in round_.outcomes},
            relayed_payloads={o.slot.client.address: len(links[member(o.slot)].relays) for o in round_.outcomes},
        )
        self._report(round_, record, gathered)
        return record

    # ------------------------------------------------------------------------------------------ the model

    def shown_model(self) -> torch.nn.Module:
        """The consensus (the mean of the public copies), in a model of its own: the replica stays the start."""
        if self._shown is None:
            self._shown = copy.deepcopy(self.model)
        consensus = self.gossip.consensus()
        with torch.no_grad():
            for name, p in self._shown.named_parameters():
                p.copy_(consensus[name])
        return self._shown

    def save_checkpoint(self) -> Path:
        """The centralized checkpoint (the start as the replica, the workers' inner optimizer state and own
        models) with the public copies."""
        return self.checkpoints.save(self.position, self.slots, self.gossip.checkpoint)

    def maybe_save_checkpoint(self) -> None:
        self.checkpoints.maybe_save(self.position, self.slots, self.gossip.checkpoint)


def _usable(outcome: SlotOutcome) -> bool:
    return outcome.result is not None and outcome.result.status == OK and not outcome.error
