"""The coordinator's outer step and the replica the workers mirror: two strategies, one interface.

Workers in sync hold the replica at ``base_version``; ``pending`` (the last round's update) moves it one
version on. Every work order carries ``pending`` plus the fingerprint of ``base_version``. The coordinator
applies ``pending`` to its own copy on a thread of its own (``advance.ReplicaAdvancer``), started when the
round's orders go out (``advance``), so the workers' compute hides it and the round's critical path never
waits for it; what needs the replica at the round's version (a push, a checkpoint, an evaluation, a spot
check, the next orders' fingerprint) waits for that apply alone (``wait_applied``), only when it needs it.
Its replica is at ``base_version`` or ``base_version + 1``, and never between while anyone reads it.

* ``ReplayOuter`` (``sgd``, ``nesterov``, ``signsgd``): the model *is* the replica. The update is the
  senders' own payloads; every replica aggregates them with the same code and takes the same outer step
  (momentum buffers included), so copies on the same kind of device stay bit-identical.
* ``DeltaOuter`` (``adamw``): the optimizer's moments stay here. The coordinator steps its model, and
  the workers follow a *shadow* replica through compressed parameter deltas (coordinator-side error
  feedback), which the coordinator applies to its own shadow as well.

The downlink (``--downlink``): a replay carries every sender's payload, so what a worker receives grows with
the number of workers. A *compressed* round's update is instead one payload: the coordinator re-compresses
the round's aggregate in the coefficient domain, with the codec's top-k and quantization and its own error
feedback (``downlink_feedback``), and every replica, its own included, replays that one payload with the
outer rule (momentum and all) as it would replay the senders'. Deltas are one payload already.
"""

from __future__ import annotations

import abc
import collections
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from gradwire import protocol
from gradwire.compression import CodecConfig, CompressedGradient, ErrorFeedback, GradientCodec
from gradwire.compression.aggregate import Aggregator
from gradwire.compression.fragment import Fragment
from gradwire.compression.robust import MEAN, AggregationRule, CoordinateAggregate
from gradwire.coordinator.advance import ReplicaAdvancer
from gradwire.models import build_from_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import ModelState
from gradwire.replica import Fingerprint, Replica, StateUpdate
from gradwire.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)

TensorGroups = dict[str, dict[str, torch.Tensor]]
Aggregate = Aggregator | CoordinateAggregate
FingerprintSoon = Fingerprint | Future[Fingerprint]  # taken, or being taken by the advancer


def _resolved(fingerprint: FingerprintSoon) -> Fingerprint:
    return fingerprint.result() if isinstance(fingerprint, Future) else fingerprint


class OuterStrategy(abc.ABC):
    """The outer optimizer, the workers' replica, and the update in flight between them."""

    _replica_group = "model"  # the checkpoint group the workers' replica is saved in

    def __init__(self, model: torch.nn.Module, replica: Replica, codec_config: CodecConfig) -> None:
        self.model = model  # what is trained, evaluated and exported
        self.replica = replica  # what every worker holds a copy of
        self.codec = replica.codec(codec_config)
        self.pending: StateUpdate | None = None
        self.advancer = ReplicaAdvancer(replica)
        # The apply of ``pending`` to our replica, once submitted: its future holds the target fingerprint.
        self._applying: Future[Fingerprint] | None = None
        self._advancing = threading.Lock()
        self.base_version = replica.version
        self._base_fingerprint: FingerprintSoon = replica.fingerprint()
        # The last updates before ``pending``, for workers that missed rounds: (from version, fingerprint
        # there, update), oldest first (``catch_up``).
        self.history: collections.deque[tuple[int, FingerprintSoon, StateUpdate]] = collections.deque(maxlen=8)
        # Who sent ``pending``'s payloads (slot indices, in payload order) and in which round: each of them
        # kept its own payload and is sent the replay without it (``update_for``).
        self._senders: tuple[int, ...] = ()
        self._sent_in = -1
        # --overlap: the replica at ``base_version`` (parameters, outer momentum), kept when a flush applies
        # ``pending`` early: the next round computes there, so a checkpoint must hold it (``checkpoint_behind``).
        self._behind: tuple[dict[str, torch.Tensor], list[torch.Tensor]] | None = None

    def set_replay_window(self, n: int) -> None:
        self.history = collections.deque(self.history, maxlen=n)

    def catch_up(self, version: int) -> tuple[Fingerprint, tuple[StateUpdate, ...]] | None:
        """For a worker at ``version`` (behind ``base_version``): the fingerprint it should have there and
        the updates that bring it to ``base_version``, oldest first; ``None`` if they left the window."""
        if version == self.base_version:
            return self.base_fingerprint, ()
        start = next((i for i, (v, _, _) in enumerate(self.history) if v == version), None)
        if start is None:
            return None
        return _resolved(self.history[start][1]), tuple(u for _, _, u in list(self.history)[start:])

    # ------------------------------------------------------------------------------------------ versions

    @property
    def target_version(self) -> int:
        """The version this round's contributions are computed at."""
        return self.base_version + (1 if self.pending is not None else 0)

    @property
    def base_fingerprint(self) -> Fingerprint:
        """The replica's fingerprint at ``base_version`` (waits for the apply that reaches it, if running)."""
        return _resolved(self._base_fingerprint)

    @property
    def target_fingerprint(self) -> Fingerprint:
        """The replica's fingerprint at ``target_version`` (waits for ``pending``'s apply)."""
        if self.pending is None:
            return self.base_fingerprint
        self.advance()
        assert self._applying is not None
        return self._applying.result()

    def update_for(self, slot: int) -> StateUpdate | None:
        """``pending`` as worker ``slot`` is sent it: a sender's replay leaves out the payload it sent,
        which it holds (``StateUpdate.without``; the worker puts it back). Deltas go whole to everyone."""
        update = self.pending
        if update is None or update.delta is not None or slot not in self._senders:
            return update
        return update.without(self._senders.index(slot), self._sent_in)

    def advance(self) -> None:
        """Start applying ``pending`` to the coordinator's replica on the advancer's thread, if it has not
        started: returns at once (``wait_applied`` waits for it)."""
        with self._advancing:  # a round's dispatch threads may ask at once (the last order out, a push)
            if self.pending is not None and self._applying is None:
                self._applying = self.advancer.submit(self._apply_job(self.pending))

    def wait_applied(self) -> None:
        """Block until the coordinator's replica is at ``target_version`` (``ReplicaError`` if it cannot be)."""
        self.advance()
        if self._applying is not None:
            self._applying.result()

    def settle(self) -> None:
        """Block until nothing is writing to the replica; unlike ``wait_applied``, start nothing: a replica
        at ``base_version`` with ``pending`` not yet started stays there."""
        self.advancer.settle()

    def apply_pending(self, keep_behind: bool = False) -> None:
        """Bring the coordinator's replica to ``target_version``, if it is not there yet; ``keep_behind``:
        keep a copy of it at ``base_version`` first (``checkpoint_behind``), if it is still there."""
        if keep_behind and self.pending is not None and self._applying is None:
            self.settle()
            params = {n: p.detach().clone() for n, p in self.replica.params.items()}
            self._behind = (params, [m.clone() for m in self.replica.momentum])
        self.wait_applied()

    def close(self) -> None:
        self.advancer.close()

    def step(
        self,
        aggregator: Aggregate,
        payloads: tuple[CompressedGradient, ...],
        weights: tuple[float, ...],
        lr: float,
        *,
        scales: tuple[float, ...] = (),
        rule: AggregationRule = MEAN,
        senders: tuple[int, ...] = (),
        round: int = -1,
        compressed: bool = False,
        fragment: Fragment | None = None,
    ) -> float:
        """Turn a round's validated, combined contributions (``compression.robust.aggregate`` of
        ``payloads`` with ``weights``, clip ``scales`` and ``rule``) into the next ``pending`` update.
        ``senders`` are the slots that sent ``payloads``, in order, in round ``round`` (``update_for``).
        ``compressed``: the update is the aggregate, re-compressed (``downlink``), not the payloads;
        ``fragment``: the payloads are of that fragment's tensors, and the update moves those alone.

        The round's version (the one its contributions were computed at) becomes the new base. Returns
        the aggregate's L2 norm.
        """
        if senders and len(senders) != len(payloads):
            raise ValueError(f"{len(senders)} senders for {len(payloads)} payloads")
        self.advance()  # started when the round's orders went out; finishing meanwhile, off this path
        self._behind = None
        target = self.target_version
        target_fingerprint = self._applying if self._applying is not None else self._base_fingerprint
        norm = aggregator.norm()
        if self.pending is not None:
            self.history.append((self.base_version, self._base_fingerprint, self.pending))
        if compressed and fragment is not None:
            raise ValueError("a fragment's update is a replay of its payloads, not a compressed aggregate")
        replay = StateUpdate(lr, payloads, weights, scales=scales, rule=rule, fragment=fragment)
        self.pending = self._next_update(aggregator, replay, compressed)
        # A sender keeps its own payload and is sent the others; a compressed update goes whole to everyone.
        self._senders, self._sent_in = (() if compressed else tuple(senders)), round
        self.base_version, self._base_fingerprint, self._applying = target, target_fingerprint, None
        return norm

    @property
    def senders(self) -> tuple[tuple[int, ...], int]:
        """The slots whose payloads the pending update replays (each is sent it without its own), and the
        round they sent them in; none for a compressed update, which goes whole to everyone."""
        return self._senders, self._sent_in

    def rebase(self, pending: StateUpdate | None = None, senders: tuple[int, ...] = (), sent_in: int = -1) -> None:
        """After a resume: the replica as loaded is every worker's base, with ``pending`` (an --overlap
        checkpoint's update in flight, whose payloads ``senders`` sent in round ``sent_in``) or nothing pending."""
        self.settle()
        self.pending, self._applying = pending, None
        self._behind = None
        self._senders, self._sent_in = senders, sent_in
        self.history.clear()
        self.base_version = self.replica.version
        self._base_fingerprint = self.replica.fingerprint()

    # ------------------------------------------------------------------------------------------ state

    def model_state(
        self,
        run_id: str,
        spec: dict,
        feedback: dict[str, torch.Tensor],
        inner_optimizer: dict[str, torch.Tensor],
        slot: int | None = None,
    ) -> ModelState:
        """The replica's full state (at its current version), for a push to worker ``slot``. Pushed at the base
        version while a replay is pending (a resumed run's first round), it carries the slot's own payload of
        that replay: the worker holds it as if it had sent it, so the round goes on as it would have (its
        order leaves that payload out; an eager round starts from it)."""
        params = {n: p.detach() for n, p in self.replica.params.items()}
        momentum = {f"momentum.{i}": m for i, m in enumerate(self.replica.momentum)}
        return ModelState(
            run_id,
            self.replica.version,
            json.dumps(spec),
            params,
            self.replica.rule.to_json(),
            momentum,
            feedback,
            inner_optimizer,
            own=self._own_payload(slot),
        )

    def _own_payload(self, slot: int | None) -> tuple[int, CompressedGradient] | None:
        """``slot``'s payload in the pending replay, with its round, if a push now leaves the replay to come."""
        pending = self.pending
        if pending is None or pending.delta is not None or slot not in self._senders:
            return None
        if self.replica.version != self.base_version:  # pushed past it: no update follows
            return None
        return self._sent_in, pending.payloads[self._senders.index(slot)]

    def codec_of(self, fragment: Fragment | None, config: CodecConfig | None = None) -> GradientCodec:
        """The codec of a round's payloads: the run's, or a fragment's (``--fragments``); with ``config``, the
        round's settings where they are not the run's (a top-k warm-up's step)."""
        config = config or self.codec.config
        if fragment is None and config == self.codec.config:
            return self.codec
        return self.replica.codec(config, fragment)

    def checkpoint(self) -> TensorGroups:
        """Tensor groups for a checkpoint (after ``apply_pending``): the model and the outer optimizer's state."""
        return {
            "model": {n: p.detach() for n, p in self.model.named_parameters()},
            "optimizer": {f"momentum.{i}": m for i, m in enumerate(self.replica.momentum)},
        }

    def checkpoint_behind(self) -> TensorGroups:
        """--overlap: ``checkpoint`` with the replica at ``base_version``, where the next round computes, and
        the update in flight (group ``pending``: its StateUpdate message's bytes), which it applies after."""
        if self.pending is None:
            raise ValueError("no update in flight: take a plain checkpoint")
        self.settle()
        groups = self.checkpoint()
        if self._behind is not None:
            params, momentum = self._behind
        else:  # not flushed: the replica is there still
            params, momentum = self.replica.params, self.replica.momentum
        groups[self._replica_group] = {n: p.detach() for n, p in params.items()}
        groups["optimizer"].update({f"momentum.{i}": m for i, m in enumerate(momentum)})
        message = protocol.update_to_bytes(self.pending)
        groups["pending"] = {
            "update": torch.frombuffer(bytearray(message), dtype=torch.uint8),
            # who sent its payloads, by slot, and in which round: a resumed worker gets its own back
            "senders": torch.tensor(self._senders, dtype=torch.int64),
            "sent_in": torch.tensor([self._sent_in], dtype=torch.int64),
        }
        return groups

    def restore(self, tensors: TensorGroups, version: int) -> None:
        self.settle()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors["model"][name])
        self._restore(tensors, version)
        pending, senders, sent_in = None, (), -1
        if "pending" in tensors:  # an --overlap checkpoint: the first round computes here, then applies it
            group = tensors["pending"]
            pending = protocol.update_from_bytes(group["update"].numpy().tobytes())
            if "senders" in group and group["senders"].numel() and pending.delta is None:
                senders, sent_in = tuple(int(s) for s in group["senders"].tolist()), int(group["sent_in"].item())
                if len(senders) != len(pending.payloads):
                    raise ValueError(f"checkpoint: {len(senders)} senders for {len(pending.payloads)} payloads")
        self.rebase(pending, senders, sent_in)
        if "applied" in tensors:  # a worker still before the update the checkpoint took last catches up by it
            group = tensors["applied"]
            update = protocol.update_from_bytes(group["update"].numpy().tobytes())
            fingerprint = protocol.parse(pb.Fingerprint, group["fingerprint"].numpy().tobytes())
            self.history.append((version - 1, protocol.fingerprint_from_proto(fingerprint), update))

    def applied_group(self) -> TensorGroups:
        """Before ``apply_pending`` for a checkpoint: the update it is about to take and the fingerprint of the
        version it takes it from (group ``applied``), so that a resume can still send it to a worker that
        did not take it yet (``restore`` puts it in ``history``). Empty when nothing is pending."""
        if self.pending is None:
            return {}
        fingerprint = protocol.fingerprint_to_proto(self.base_fingerprint).SerializeToString()
        return {
            "applied": {
                "update": torch.frombuffer(bytearray(protocol.update_to_bytes(self.pending)), dtype=torch.uint8),
                "fingerprint": torch.frombuffer(bytearray(fingerprint), dtype=torch.uint8),
            }
        }

    @abc.abstractmethod
    def _next_update(self, aggregator: Aggregate, replay: StateUpdate, compressed: bool) -> StateUpdate:
        """The update that follows ``aggregator``; ``replay`` is the round's contributions as a replay;
        ``compressed``: the workers' downlink carries one payload, whatever the number of senders."""

    @abc.abstractmethod
    def _apply_job(self, update: StateUpdate) -> Callable[[], None]:
        """What the advancer runs to apply ``update`` to the replica, bound now to what it needs (the next
        round's step replaces ``pending`` and its aggregate while this runs)."""

    @abc.abstractmethod
    def _restore(self, tensors: TensorGroups, version: int) -> None: ...


class ReplayOuter(OuterStrategy):
    """Replayed outer steps: the update is the payloads, and every replica steps alike."""

    def __init__(
        self,
        model: torch.nn.Module,
        rule: UpdateRule,
        codec_config: CodecConfig,
        downlink_config: CodecConfig | None = None,
    ) -> None:
        """``downlink_config``: the codec of a compressed downlink's one payload (default ``codec_config``):
        the workers' chunks, with a top-k of its own."""
        super().__init__(model, Replica(model, rule), codec_config)
        self._aggregator: Aggregate | None = None  # the pending payloads, already combined
        self.downlink_codec = self.replica.codec(downlink_config or codec_config)
        config = self.downlink_codec.config
        if (config.chunk, config.use_dct) != (self.codec.config.chunk, self.codec.config.use_dct):
            raise ValueError("the downlink's codec must cut the model into the workers' chunks")
        if [g.chunk_shape for g in self.downlink_codec.plan.groups] != [g.chunk_shape for g in self.codec.plan.groups]:
            # A larger budget can factor a small matrix the workers send as top-k (--rank fit: one rank-1 term
            # of a 32-row matrix fits 4x its top-k's bytes, not 1x): the aggregate's chunks would not be the
            # downlink's. Such a model's downlink keeps the workers' own codec.
            log.info("the downlink's codec would cut the model unlike the workers': it uses theirs")
            self.downlink_codec = self.codec
        # What compressed downlinks have not sent of the aggregates yet (coefficient domain).
        self.downlink_feedback = ErrorFeedback(beta=1.0)

    def _next_update(self, aggregator: Aggregate, replay: StateUpdate, compressed: bool) -> StateUpdate:
        # Our replica applies this during the next round, from this same aggregator: no second decode. A
        # compressed downlink's one payload it decodes as every worker does.
        if compressed:
            self._aggregator = None
            return self.downlink(aggregator, replay)
        self._aggregator = aggregator
        return replay

    def _apply_job(self, update: StateUpdate) -> Callable[[], None]:
        aggregator, self._aggregator = self._aggregator, None
        return lambda: self.replica.apply(update, aggregator)

    def downlink(self, aggregator: Aggregate, replay: StateUpdate) -> StateUpdate:
        """The round's aggregate as one replayed payload: re-compressed in the coefficient domain with the
        downlink's codec (its top-k, quantization) and ``downlink_feedback``, weight 1, combined in
        ``replay``'s precision."""
        payload = self.downlink_codec.compress_coefficients(
            aggregator.coefficient_groups(), aggregator.dense_values(), self.downlink_feedback
        )
        return StateUpdate(replay.learning_rate, (payload,), (1.0,), rule=AggregationRule(exact=replay.rule.exact))

    def checkpoint(self) -> TensorGroups:
        groups = super().checkpoint()
        if self.downlink_feedback.buffers:
            groups["downlink-feedback"] = self.downlink_feedback.state_dict()
        return groups

    def _restore(self, tensors: TensorGroups, version: int) -> None:
        optimizer = tensors.get("optimizer", {})
        momentum = [optimizer[f"momentum.{i}"] for i in range(sum(k.startswith("momentum.") for k in optimizer))]
        self.replica.load_state(tensors["model"], momentum, version=version)
        self._aggregator = None
        self.downlink_feedback.load_state_dict(_on(self.codec.device, tensors.get("downlink-feedback", {})))


class DeltaOuter(OuterStrategy):
    """AdamW on the coordinator; workers follow a shadow replica through compressed deltas."""

    _replica_group = "replica"  # the shadow; "model" is the coordinator's own, AdamW-stepped

    def __init__(
        self, model: torch.nn.Module, rule: UpdateRule, codec_config: CodecConfig, spec: dict, seed: int
    ) -> None:
        shadow = build_from_spec(spec, seed=seed).to(next(model.parameters()).device)
        shadow.load_state_dict(model.state_dict())  # the same (possibly pretrained) start
        super().__init__(model, Replica(shadow, rule), codec_config)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=1.0, betas=rule.betas, eps=rule.eps, weight_decay=rule.weight_decay
        )
        self.feedback = ErrorFeedback(beta=1.0)

    def _next_update(self, aggregator: Aggregate, replay: StateUpdate, compressed: bool) -> StateUpdate:
        # One compressed delta, whatever ``compressed`` says: the moments stay here. The delta is taken from
        # the shadow at the round's version: this rule waits for its apply (it is dense on the coordinator).
        self.wait_applied()
        aggregate, lr = aggregator.result(), replay.learning_rate
        for name, p in self.model.named_parameters():
            p.grad = aggregate[name].to(p.dtype)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        with torch.no_grad():
            delta = {n: p.detach() - self.replica.params[n] for n, p in self.model.named_parameters()}
        return StateUpdate(lr, delta=self.codec.compress(delta, self.feedback))

    def _apply_job(self, update: StateUpdate) -> Callable[[], None]:
        return lambda: self.replica.apply(update)

    def checkpoint(self) -> TensorGroups:
        groups = super().checkpoint()
        groups["replica"] = {n: p.detach() for n, p in self.replica.params.items()}
        for name, p in self.model.named_parameters():
            for key, value in self.optimizer.state.get(p, {}).items():
                groups["optimizer"][f"adamw.{name}.{key}"] = torch.as_tensor(value)
        groups["delta-feedback"] = self.feedback.state_dict()
        return groups

    def _restore(self, tensors: TensorGroups, version: int) -> None:
        self.replica.load_state(tensors["replica"], version=version)
        optimizer = tensors.get("optimizer", {})
        for name, p in self.model.named_parameters():
            prefix = f"adamw.{name}."
            state = {
                key[len(prefix) :]: v
                for key, v in optimizer.items()
                if key.startswith(prefix) and "." not in key[len(prefix) :]
            }
            if state:  # AdamW keeps its step count on the CPU, the moments beside the parameter
                self.optimizer.state[p] = {k: v if k == "step" else v.to(p.device) for k, v in state.items()}
        self.feedback.load_state_dict(_on(self.codec.device, tensors.get("delta-feedback", {})))


def _on(device: torch.device | str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (a checkpoint's, read on the CPU) on the coordinator's ``device``."""
    return {k: v.to(device) for k, v in tensors.items()}


def make_outer(
    model: torch.nn.Module,
    rule: UpdateRule,
    codec_config: CodecConfig,
    spec: dict,
    seed: int,
    downlink_config: CodecConfig | None = None,
    fingerprint_every: int = 1,
) -> OuterStrategy:
    """``downlink_config``: the codec of a compressed downlink (replayed rules; default ``codec_config``);
    ``fingerprint_every``: the replica's fingerprints hold their moments at the versions it divides, their
    samples alone at the others (``fingerprint.takes_moments``; version 0's, taken here, holds them)."""
    outer: OuterStrategy
    if rule.replayable:
        outer = ReplayOuter(model, rule, codec_config, downlink_config)
    else:
        outer = DeltaOuter(model, rule, codec_config, spec, seed)
    outer.replica.moments_every = fingerprint_every
    return outer
