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
whole and its own model with its push, and goes on as the straight run would. Each round is logged too
(``gossip_log``): a coordinator restarted after it takes the checkpoint's copies on by the logged rounds, and
workers that kept their sessions go on without a push.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import torch

from gradwire import protocol
from gradwire.coordinator.checkpointer import RunPosition
from gradwire.coordinator.gather import Fate, Gathered
from gradwire.coordinator.gossip import (
    RELAY_ROUNDS,
    CopiesUnavailable,
    GossipRounds,
    Tensors,
    check_copy,
    route_changes,
)
from gradwire.coordinator.gossip_log import GossipLog
from gradwire.coordinator.metrics import round_record
from gradwire.coordinator.round import RoundPlan, SlotOutcome, WorkerSlot
from gradwire.coordinator.trainer import Trainer
from gradwire.link import WorkerError
from gradwire.protocol import OK, GossipLinks, GossipPieceRequest

log = logging.getLogger("gradwire.coordinator")


def member(slot: WorkerSlot) -> str:
    """A worker's name on the graph: its slot, which numbers workers in join order."""
    return str(slot.index)


class GossipTrainer(Trainer):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        cfg = self.config
        assert cfg.gossip_gamma is not None
        self.gossip = GossipRounds(cfg.topology, cfg.gossip_gamma, self.replica.params, cfg.peer_to_peer)
        self._shown: torch.nn.Module | None = None  # the consensus, loaded into a model of its own
        if self.checkpoints.restored_extra[0]:  # resumed: the public copies; each worker's own model goes back
            # with its push, unless the update log's rounds after the checkpoint bring the run on (``connect``)
            self.gossip.restore(*self.checkpoints.restored_extra)
        self.durable.gossip = GossipLog(self.gossip)

    def train_step(self) -> dict | None:
        step, t0, lr = self.step, time.perf_counter(), self.config.inner_lrs(self.step)[0]
        self.roster.update(step)
        if gone := self.gossip.leave([member(s) for s in self.slots]):
            log.info("step %d: %s left the %s graph; their neighbours are re-linked", step, gone, self.config.topology)
        plan = self.rounds.prepare(self.roster.active(step), step)
        plan, links = self._links(plan, step)
        if not plan.slots:
            return None
        work = self.round_work(step, plan.slots)
        work = dataclasses.replace(work, gossip={s.index: links[member(s)] for s in plan.slots})
        codec = self.outer.codec
        pulled_bytes = {j: sent.nbytes for j, (_, sent) in self.gossip.sent.items()}
        round_ = self.rounds.run(plan, work, self._stream_plan(codec))
        t_gathered = time.perf_counter()
        answers = {member(o.slot): o.result if _usable(o) else None for o in round_.outcomes}
        finish = self.gossip.finish(answers, codec)
        for o in round_.outcomes:
            if o.unreachable:
                log.warning(
                    "step %d: %s could not pull the messages of %s: they are relayed to it for the next %d rounds",
                    step,
                    member(o.slot),
                    list(o.unreachable),
                    RELAY_ROUNDS,
                )
                self.gossip.unreachable(member(o.slot), o.unreachable, step)
        if self.gossip.peer_to_peer and (lost := [member(o.slot) for o in round_.outcomes if _lost(o)]):
            log.info("step %d: %s lost their gossip state and join the graph anew, from the consensus", step, lost)
            self.gossip.lost(lost)
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
        state = self.durable.state(self.run_id, self.position, self.slots)
        self.durable.commit(step, state, self.durable.gossip.record())  # logged after its metrics line
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
        if self.gossip.peer_to_peer:  # what each worker pulled from its neighbours, which the coordinator never saw
            sent_bytes = sum(o.result.gossip_sent.nbytes for o in kept if o.result and o.result.gossip_sent)
            record.update(
                compression_ratio=4 * codec.plan.numel * len(kept) / max(1, sent_bytes),
                consensus_distance_estimated=True,
                pulled_payloads={o.slot.client.address: len(links[member(o.slot)].pulls) for o in round_.outcomes},
                # messages the coordinator took to relay to neighbours that cannot pull them
                uploaded_payloads=sum(1 for o in kept if o.result is not None and o.result.gradient is not None),
                peer_bytes_down={
                    o.slot.client.address: sum(pulled_bytes[j] for j in links[member(o.slot)].pulls)
                    for o in round_.outcomes
                },
            )
        self._report(round_, record, gathered)
        return record

    def _links(self, plan: RoundPlan, step: int) -> tuple[RoundPlan, dict[str, GossipLinks]]:
        """The round's links for ``plan``'s workers. Peer-to-peer, the copies the orders carry whole are
        pulled from their owners first: a worker whose copy did not come sits the round out, one that lost
        its gossip state joins anew."""
        slots, routes = list(plan.slots), self.gossip.routes
        while True:
            members = [member(s) for s in slots]
            addresses = {member(s): s.client.address for s in slots}
            denied: set[str] = set()
            try:
                links = self.gossip.links(
                    members, addresses, functools.partial(self._pull_copies, step=step, denied=denied), step
                )
                for line in route_changes(routes, self.gossip.routes):
                    log.info("step %d: %s", step, line)
                return dataclasses.replace(plan, slots=slots), links
            except CopiesUnavailable as e:
                if lost := [m for m in e.members if m in denied]:
                    log.info(
                        "step %d: %s hold no gossip state any more: they join anew, from the consensus", step, lost
                    )
                    self.gossip.lost(lost)
                if out := [m for m in e.members if m not in denied]:
                    log.warning("step %d: the public copies of %s did not come: they sit this round out", step, out)
                    slots = [s for s in slots if member(s) not in out]

    def _pull_copies(self, members: Sequence[str], step: int, denied: set[str]) -> dict[str, Tensors]:
        """Peer-to-peer: each member's exact public copy as round ``step`` starts, pulled from its worker in
        parallel; a member whose copy did not come is left out (``denied``: it holds no gossip state)."""
        slots = {member(s): s for s in self.slots}
        out: dict[str, Tensors] = {}

        def one(m: str) -> None:
            slot = slots.get(m)
            if slot is None:
                return
            request = GossipPieceRequest(self.run_id, self.gossip.peer_key, step, True, self.gossip.last(m))
            try:
                piece, _ = slot.client.pull_gossip(request, timeout=self.config.round_timeout)
                copy = protocol.copy_from_piece(piece, m, step)
                check_copy(copy, self.gossip.start)
                out[m] = copy
            except WorkerError as e:
                log.warning("step %d: the public copy of %s (%s): %s", step, m, slot.client.address, e.details)
                if e.code == grpc.StatusCode.PERMISSION_DENIED:
                    denied.add(m)
            except ValueError as e:
                log.warning("step %d: the public copy of %s (%s) is unusable: %s", step, m, slot.client.address, e)

        list(self.rounds.pool.map(one, members))
        return out

    def _refresh(self) -> None:
        """Peer-to-peer: the exact public copies, before the consensus is shown or kept. A copy that does not
        come stays as the coordinator last knew it (its owner is down: it leaves soon)."""
        if not self.gossip.peer_to_peer:
            return
        try:
            self.gossip.refresh(lambda ms: self._pull_copies(ms, self.step, set()))
        except CopiesUnavailable as e:
            log.warning("step %d: the consensus is shown with stale copies: %s", self.step, e)

    # ------------------------------------------------------------------------------------------ the model

    def shown_model(self) -> torch.nn.Module:
        """The consensus (the mean of the public copies), in a model of its own: the replica stays the start."""
        if self._shown is None:
            self._shown = copy.deepcopy(self.model)
        self._refresh()
        consensus = self.gossip.consensus()
        with torch.no_grad():
            for name, p in self._shown.named_parameters():
                p.copy_(consensus[name])
        return self._shown

    def save_checkpoint(self) -> Path:
        """The centralized checkpoint (the start as the replica, the workers' inner optimizer state and own
        models) with the public copies."""
        path = self.checkpoints.save(self.position, self.slots, self._kept)
        self._compact(path)
        return path

    def maybe_save_checkpoint(self) -> None:
        self._compact(self.checkpoints.maybe_save(self.position, self.slots, self._kept))

    def _kept(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        self._refresh()
        return self.gossip.checkpoint()


def _usable(outcome: SlotOutcome) -> bool:
    return outcome.result is not None and outcome.result.status == OK and not outcome.error


def _lost(outcome: SlotOutcome) -> bool:
    """A worker pushed the state again this round, and without a result: its session, gossip state with it, is new."""
    return outcome.pushes > 0 and not _usable(outcome)
