"""What a worker keeps for one coordinator run: the replica, error feedback, and the local-SGD working copy.

* ``replica`` - the coordinator's model, moved only by the updates every holder applies alike. It is never
  trained on: gradient rounds only read its gradients, local-SGD rounds train a separate working copy.
* ``feedback`` - what this worker has not sent yet (error feedback, in the codec's coefficient domain), and
  for matrices sent as factors the subspace their next factors start from; both travel as its state.
* the *working* model and the *inner optimizer* of local-SGD rounds, built on first use. The working model
  is reloaded from the replica at the start of every local round; the inner optimizer's state is kept
  across rounds, as DiLoCo does.

State that arrives from elsewhere (a checkpoint on resume, the previous session of a run on a resync push)
is held as named tensors and loaded into the inner optimizer when it is built; a state that does not fit
the optimizer the round asks for is dropped with a warning, and the optimizer starts fresh.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from gradwire.compression import (
    CodecConfig,
    CompressedGradient,
    DecodedGradient,
    ErrorFeedback,
    GradientCodec,
    aggregate,
    shard,
)
from gradwire.compression.robust import AggregationRule
from gradwire.compression.stream import StreamPlan
from gradwire.errors import TooLarge
from gradwire.models import build_from_spec, spec_elements
from gradwire.optim.inner import InnerOptimizer, InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import ModelState, ProtocolError
from gradwire.relay import Held
from gradwire.replica import Fingerprint, Replica, StateUpdate
from gradwire.statestream import TENSOR_FIELDS, StateHeader
from gradwire.worker.lazy import is_dtensor, is_instance
from gradwire.worker.meta import buffers_to, parameters_on_meta
from gradwire.worker.node import Restore
from gradwire.worker.placement import Placement
from gradwire.worker.sizing import fits, free_device_memory

if TYPE_CHECKING:
    from gradwire.worker import pipeline
    from gradwire.worker.gossip import GossipState
    from gradwire.worker.lookahead import Lookahead
    from gradwire.worker.rounds import Done

log = logging.getLogger(__name__)


class Session:
    """One coordinator run's replica, error feedback and local-SGD state on this worker."""

    def __init__(
        self,
        header: StateHeader,
        device: torch.device,
        owner: bytes = b"",
        max_elements: int | None = None,
        memory: int | None = None,
        placement: Placement | None = None,
        transform_dtype: torch.dtype | None = None,
    ) -> None:
        """Build the run's replica for the state ``header`` announces; its tensors come next (``load``, a
        tensor at a time as a push streams in; then ``loaded``: ``from_state`` does all three). The spec is
        sized first (on the meta device): a model of more than ``max_elements`` parameters and buffers, or
        whose state would not fit ``memory`` bytes (``worker.sizing``), is refused before anything is
        allocated. ``placement``: how the run computes here; on a sharded node (``worker.fsdp``) this rank
        holds its share of the replica, working copy and inner state, on a pipelined one
        (``worker.pipeline``) its stage's. ``transform_dtype``: what this sender's chunk DCT multiplies in
        (``GradientCodec``; None: the device's fastest accurate one)."""
        self.placement = placement or Placement()
        shards = self.placement.ranks if self.placement.split else 1
        self.stage: pipeline.Stage | None = None  # a pipelined node: this rank's stage
        try:
            spec = json.loads(header.model_json)
            if not isinstance(spec, dict):
                raise ValueError(f"model_json must be a JSON object, got {type(spec).__name__}")
            rule = UpdateRule.from_json(header.update_rule_json)
            elements = spec_elements(spec) if max_elements is not None or memory is not None else 0
            if max_elements is not None:
                if elements > max_elements:
                    raise ValueError(
                        f"the model has {elements:,} parameters and buffers, "
                        f"more than this worker's --max-model-params {max_elements:,}"
                    )
            # (this rank's share of the parameters, its memory, outer momentum, ranks the inner state is split over)
            inner_shards = self.placement.ranks if self.placement.partitioned_optimizer else 1
            self._memory = (-(-elements // shards), memory, bool(rule.momentum), inner_shards)
            self._check_memory(local_sgd=False)
            self.spec, self.device = spec, device
            if self.placement.pipelined:  # planned on the whole model, on the meta device
                from gradwire.worker import pipeline

                with torch.device("meta"):
                    whole = build_from_spec(spec)
                self.stage = pipeline.plan_stage(whole, self.placement.node.rank, self.placement.ranks)
            model = self._build(meta=True)
            # the whole model's, a stage's too: what per-parameter learning rates may name
            self.parameter_names = frozenset(
                n for n, _ in (whole if self.stage is not None else model).named_parameters()
            )
            rule.check_names(self.parameter_names)
        except TooLarge:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise ProtocolError(f"model state: {e}") from None
        self.run_id = header.run_id
        self.owner = owner  # who may use this run: gradwire.security.run_owner of its first push
        if self.stage is not None:
            from gradwire.worker import pipeline

            shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
            self.replica: Replica = pipeline.StageReplica(model, rule, shapes, pipeline.owned_names(model, self.stage))
        elif self.placement.sharded:
            from gradwire.worker import fsdp

            self.replica = fsdp.ShardedReplica(model, rule)
        else:  # its parameters are allocated as the push brings them
            self.replica = Replica(model, rule, device=self.device)
        self.replica.transform_dtype = transform_dtype
        self.replica.begin_load()
        node = self.placement.node
        self._restore: Restore | None = Restore(
            node.rank if node is not None else None,
            self.placement.ranks,
            self.placement.mode,
            split=self.placement.split,
            apart=self.placement.apart,
        )
        self._version = header.version
        self.vocab_size = _vocab_size(whole if self.stage is not None else model)  # a stage may lack the embedding
        self.feedback = ErrorFeedback()
        # (round, payload) of the last result; a push may bring it (a resumed --overlap run: ModelState.own)
        self.last_sent: tuple[int, CompressedGradient] | None = header.own
        # --relay peers: the run's peer key (the last order's) and the payloads held for the peers (gradwire.relay)
        self.peer_key = b""
        self.held = Held()
        self.fingerprint_ahead: Future[Fingerprint] | None = None  # the replica's, being taken after a round
        self.sent_decoded: Future[DecodedGradient] | None = None  # last_sent's payload, decoded after the round
        self.last_replay: tuple[int, AggregationRule] | None = None  # senders and rule of the last replay applied
        self.lookahead: Lookahead | None = None  # --overlap: the next round's contribution, computed ahead
        self.last_done: Done | None = None  # the last round computed, sent again if asked again (worker.rounds)
        self.done_at: float | None = None  # perf_counter at the end of this run's last result here
        self.ahead_seconds = 0.0  # compute done ahead since then (a look-ahead, used or not)
        self.stale = False  # found out of sync: every round answers NEEDS_STATE until the next push
        self.gossip: GossipState | None = None  # gossip rounds: the public copies (worker.gossip)
        self._working: torch.nn.Module | None = None
        self._loaded: dict[str, int] = {}  # the write count of each replica tensor when the working copy took it
        self._inner: InnerOptimizer | None = None
        self._inner_config: InnerOptimizerConfig | None = None
        self._inner_restore: dict[str, torch.Tensor] = {}
        self.restored = (False, False)  # whether the push brought this rank error feedback, inner state
        self._gossip_model: dict[str, torch.Tensor] = {}  # a resumed gossip run's own model, as the push brings it
        self.own_model_restored = False  # gossip: the push restored the own model (its first links keep it)
        self.wrappers: dict[int, torch.nn.Module] = {}  # a node's DDP wrappers of this session's models
        # a split node: the codecs of this rank's own tensors (a fragment's round: those of the fragment)
        self._shard_codecs: dict[tuple[CodecConfig, tuple[str, ...]], GradientCodec] = {}
        self._stream_plans: dict[tuple[CodecConfig, int], StreamPlan] = {}
        # a pipelined node: the group of the ranks that hold a tied embedding (every rank creates it alike)
        self.tied_group = None
        if self.stage is not None:
            from gradwire.worker import pipeline

            self.tied_group = pipeline.tied_group(self.stage.count)

    @classmethod
    def from_state(cls, state: ModelState, device: torch.device, **kwargs: object) -> Session:
        """A session of a whole ``state`` at once (a checkpoint, a test): ``Session`` with every tensor loaded."""
        session = cls(StateHeader.of(state), device, **kwargs)  # type: ignore[arg-type]
        for kind in TENSOR_FIELDS.values():
            for name, t in getattr(state, kind).items():
                session.load(kind, name, t)
        session.loaded()
        return session

    def load(self, kind: str, name: str, t: torch.Tensor) -> None:
        """One tensor of the pushed state, whole, as it arrives: ``kind`` is its ModelState field. This rank
        keeps its share (``Replica.load_tensor``; ``node.Restore``). ``ProtocolError`` if it does not fit."""
        if self._restore is None:
            raise RuntimeError("the session's state is complete already")
        try:
            if kind == "parameters":
                self.replica.load_tensor(name, t)
            elif kind == "optimizer_state":
                self.replica.load_momentum(_numeric_suffix(name), t)
            elif kind == "gossip_model":  # checked as it arrives: a single device's, a parameter's shape
                if self.placement.ranks > 1 or tuple(t.shape) != self.replica.shapes.get(name):
                    raise ValueError(f"gossip_model {name!r} is no parameter of this model on a single device")
                self._gossip_model[name] = t
            else:
                self._restore.add(kind, name, t)
        except ValueError as e:
            raise ProtocolError(f"model state: {e}") from None

    def loaded(self) -> None:
        """Every tensor is in: ``ProtocolError`` if the state is incomplete (then throw the session away)."""
        restore, self._restore = self._restore, None
        try:
            self.replica.end_load(self._version)
        except ValueError as e:
            raise ProtocolError(f"model state: {e}") from None
        if restore.feedback:
            self.feedback.load_state_dict({k: v.to(self.device) for k, v in restore.feedback.items()})
        self._inner_restore = dict(restore.inner)
        self.restored = (bool(restore.feedback), bool(restore.inner))
        gossip_model, self._gossip_model = self._gossip_model, {}
        if gossip_model:
            self._restore_own_model(gossip_model)

    def _restore_own_model(self, tensors: dict[str, torch.Tensor]) -> None:
        """A resumed gossip run: the worker's own model ``x`` as it was (``ModelState.gossip_model``), every
        parameter of the replica's shape; its first gossip order then leaves it as it is."""
        params = self.replica.params
        if set(tensors) != set(params):
            raise ProtocolError("model state: gossip_model must carry every parameter of the model, and no other")
        model = self.own_model()
        with torch.no_grad():
            for (name, _), w in zip(params.items(), model.parameters()):
                w.copy_(tensors[name])
        self.own_model_restored = True

    def _build(self, meta: bool = False) -> torch.nn.Module:
        """This rank's part of the run's model on its device, values undefined where only a part is allocated:
        its pipeline stage, its FSDP2 shards (built a parameter at a time), or the whole model (with ``meta``,
        its parameters on the meta device, for the replica to allocate as a push brings them)."""
        if self.stage is not None:
            from gradwire.worker import pipeline

            with torch.device("meta"):
                whole = build_from_spec(self.spec)
            return pipeline.materialize(pipeline.stage_model(whole, self.stage), self.stage, self.device)
        if not (self.placement.sharded or meta):
            return build_from_spec(self.spec).to(self.device)
        with parameters_on_meta():
            model = build_from_spec(self.spec)
        if self.placement.sharded:
            from gradwire.worker import fsdp

            return fsdp.shard(model, device=self.device, reshard_after_forward=self.placement.reshard_after_forward)
        return buffers_to(model, self.device)

    def owned(self, config: CodecConfig) -> tuple[str, ...]:
        """A split node: the tensors this rank encodes, in payload order (a sharded node: its share of the
        whole model's, ``compression.shard.owners``; a pipelined node: its stage's)."""
        if is_instance(self.replica, "gradwire.worker.pipeline", "StageReplica"):
            return self.replica.owned
        return shard.owners(self.replica.codec(config).plan, self.placement.ranks)[self.placement.node.rank]

    def shard_codec(self, config: CodecConfig, names: Collection[str]) -> GradientCodec:
        """A split node: the codec of the tensors this rank encodes (``compression.shard``; a fragment's
        round: those of the fragment), cached."""
        key = (config, tuple(names))
        if key not in self._shard_codecs:
            shapes = {t.name: tuple(t.shape) for t in self.replica.codec(config).plan.tensors}  # whole tensors
            owned = [n for n in shapes if n in names]
            self._shard_codecs[key] = GradientCodec(
                shard.subset(shapes, owned), config, device=self.device, transform_dtype=self.replica.transform_dtype
            )
        return self._shard_codecs[key]

    def stream_plan(self, config: CodecConfig, count: int) -> StreamPlan:
        """A streamed gradient's buckets and their codecs (``compression.stream``), cached."""
        key = (config, count)
        if key not in self._stream_plans:
            self._stream_plans[key] = StreamPlan(self.replica.codec(config), count)
        return self._stream_plans[key]

    def note_replay(self, applied: Sequence[StateUpdate]) -> None:
        """Remember the senders and rule of the last replay among ``applied`` (``inverse_ahead``'s guess)."""
        replays = [u for u in applied if u.delta is None]
        if replays:
            self.last_replay = (len(replays[-1].payloads), replays[-1].rule)

    def inverse_ahead(self, codec: GradientCodec) -> torch.dtype | None:
        """The dtype to take this worker's payload's inverse DCT in while the round's result travels, so the
        replay that sums it (as many senders as the last one, the guess) transforms the others' alone; None
        where that replay will not sum on the sparse path, this rank never holds the whole update, or a GPU
        has not twice the transform's bytes free (it is held until the replay, beside the replay's own)."""
        if self.last_replay is None or self.placement.split:
            return None
        senders, rule = self.last_replay
        if not aggregate.sums_sender_inverses(codec, rule.mode, senders):
            return None
        free = free_device_memory(self.device)
        need = aggregate.inverse_numel(codec) * rule.dtype.itemsize
        if free is not None and 2 * need > free:
            return None
        return rule.dtype

    def carry_over(self, previous: Session) -> None:
        """A resync push of a run this worker already serves keeps what the push did not bring this rank."""
        feedback, inner = self.restored
        if not feedback:
            self.feedback = previous.feedback
        if not inner:
            self._inner_restore = previous.committed_inner_state()
        if previous.gossip is not None:  # gossip rounds: the worker's own model and copies are not the replica's
            self.gossip, self._working = previous.gossip, previous._working

    def diverged(self) -> None:
        """Training produced a NaN or infinity: forget the error feedback and the inner optimizer state that
        took it in (the replica itself only moves by validated updates, so it stays sound)."""
        log.warning(
            "run %r: training diverged on this worker; its error feedback and inner optimizer state are reset",
            self.run_id,
        )
        self.feedback.reset()
        self._inner = self._inner_config = None
        self._inner_restore = {}

    def _check_memory(self, *, local_sgd: bool) -> None:
        elements, memory, momentum, inner_shards = self._memory
        ok, why = fits(elements, memory, momentum=momentum, local_sgd=local_sgd, inner_shards=inner_shards)
        if not ok:
            raise TooLarge(f"{why} (worker serve --rank-memory-gb): a smaller model, or more memory per rank")

    def working_model(self, carry_on: bool = False) -> torch.nn.Module:
        """The model local steps train: a copy of the replica at its current version; with ``carry_on``
        (streamed fragments), the working model as the last round left it, but for the tensors the replica's
        updates have written since, reloaded from it. Refused (``TooLarge``) where a local-SGD round's state
        would not fit the rank's memory."""
        if self._working is None:
            self._check_memory(local_sgd=True)
            self._working = self._build()  # this rank's part, as the replica's: the same rows, or the same stage
            self._loaded = {}
        sharded = self.placement.sharded
        with torch.no_grad():
            for (name, p), w in zip(self.replica.params.items(), self._working.parameters()):
                source, target = (p.to_local(), w.to_local()) if sharded else (p, w)
                if not carry_on or self._loaded.get(name) != source._version:  # torch counts in-place writes
                    target.copy_(source)
                    self._loaded[name] = source._version
        self._working.train()
        return self._working

    def own_model(self) -> torch.nn.Module:
        """Gossip rounds: the model this worker trains as its own (``worker.gossip``), the working model,
        built from the replica on first use and never reloaded from it."""
        if self._working is None:
            return self.working_model()
        self._working.train()
        return self._working

    def inner_optimizer(self, config: InnerOptimizerConfig) -> InnerOptimizer:
        """The run's inner optimizer over the working model; a change of settings starts it afresh. (On a
        sharded node Muon's Newton-Schulz runs on the DTensor shards, whose matrix products are the whole
        matrices': torch gathers what each needs.)"""
        if self._inner is not None and self._inner_config == config:
            return self._inner
        if self._inner is not None:
            log.info(
                "run %r: inner optimizer settings changed (%s -> %s); its state starts afresh",
                self.run_id,
                self._inner_config,
                config,
            )
        working = self._working if self._working is not None else self.working_model()
        partitioned = self.placement.partitioned_optimizer  # ZeRO-1: this rank keeps its partition's state
        self._inner, self._inner_config = InnerOptimizer(working, config, partitioned=partitioned), config
        if self._inner_restore:
            try:
                self._inner.load_state_tensors(_as_shards(self._inner_restore, working))
            except ValueError as e:
                log.warning(
                    "run %r: saved inner optimizer state does not fit %s (%s); starting afresh",
                    self.run_id,
                    config.name,
                    e,
                )
            self._inner_restore = {}
        return self._inner

    def inner_state(self) -> dict[str, torch.Tensor]:
        """The inner optimizer's state as named tensors (what is waiting to be loaded, before the first round);
        a rank of a sharded node: its rows."""
        if self._inner is not None:
            return {k: v.to_local() if is_dtensor(v) else v for k, v in self._inner.state_tensors().items()}
        return dict(self._inner_restore)

    def committed_inner_state(self) -> dict[str, torch.Tensor]:
        """``inner_state`` as of the last round asked for: a look-ahead's inner steps are not in it."""
        if self.lookahead is not None and self.lookahead.inner_before is not None:
            return dict(self.lookahead.inner_before)
        return self.inner_state()

    def restore_inner(self, state: dict[str, torch.Tensor]) -> None:
        """Put back the inner optimizer's state as ``inner_state`` returned it (a look-ahead's undone): it
        is loaded when the optimizer is next asked for."""
        self._inner = self._inner_config = None
        self._inner_restore = dict(state)


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Token ids must be below this; None if the model does not say."""
    get = getattr(model, "get_input_embeddings", None)  # transformers models
    emb = get() if callable(get) else getattr(model, "tok_emb", None)  # the built-in GPT
    return emb.num_embeddings if isinstance(emb, torch.nn.Embedding) else None


def _numeric_suffix(key: str) -> int:
    """The index in "momentum.<index>" (outer momentum travels under its parameter's index)."""
    head, _, index = key.rpartition(".")
    if not head or not index.isdigit():
        raise ValueError(f"optimizer state tensor {key!r} is not named momentum.<index>")
    return int(index)


def _as_shards(state: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Saved inner state (``"<parameter>/<key>"``) with each tensor of a sharded parameter's rows made a
    shard of that parameter again; everything else as it is."""
    params = dict(model.named_parameters())
    out = {}
    for key, t in state.items():
        p = params.get(key.rpartition("/")[0])
        if is_dtensor(p) and t.dim() and tuple(t.shape) == tuple(p.to_local().shape):
            from torch.distributed.tensor import DTensor

            t = DTensor.from_local(
                t.to(p.to_local().device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        out[key] = t
    return out


def host_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in tensors.items()}
