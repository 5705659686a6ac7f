"""The worker protocol as plain data, and its one serde boundary with ``gradwire.v1.worker_pb2``.

Coordinator and worker speak in these dataclasses; only this module (and ``compression.serde`` for the
codec's messages) touches protobuf types. Large messages travel framed: ``to_parts`` serializes a message
and cuts it into ``Part`` messages; ``join_parts`` checks the total size and SHA-256 before anything is
parsed. Everything from the network is checked; problems raise ``ProtocolError`` (or the codec's
``PayloadError``), both ``ValueError``s, which servers answer with INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from gradwire.compression import CodecConfig, CompressedGradient, PayloadError
from gradwire.compression import serde as codec_serde
from gradwire.compression.fragment import Fragment
from gradwire.compression.robust import MEAN, AggregationRule
from gradwire.compression.stream import MAX_BUCKETS
from gradwire.fingerprint import MAX_FINGERPRINT_EVERY
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.lr_scales import MAX_LR_SCALES
from gradwire.relay import PieceRef
from gradwire.replica import Fingerprint, StateUpdate
from gradwire.v1 import codec_pb2 as codec_pb
from gradwire.v1 import worker_pb2 as pb

# Bump when a message's meaning changes; both sides refuse to talk across versions.
# 5: work orders ask for a gradient fingerprint, and results carry it (spot checks); 6: local-SGD orders announce
# the next round (next_batch, next_local_steps), results say how long the worker waited, and local-SGD rounds
# and replays may be of one fragment of the model (--fragments); 7: gossip rounds (WorkOrder.gossip), whose
# results report the worker's gossip residual; 8: peer-to-peer gossip (GossipLinks.pulls, Worker.PullGossip,
# RoundResult.gossip_digest and sketches); 9: the relay fallback (GossipLinks.upload, STATUS_UNREACHABLE);
# 10: codec settings name their index coding (CodecSettings.indices: 12-bit or Elias-Fano); 11: relayed star
# rounds (Replay.relayed, WorkOrder.peer_key, Worker.PullPiece); 12: replica fingerprints hold their moments only
# at the versions WorkOrder.fingerprint_every divides
PROTOCOL_VERSION = 12
MAX_INNER_STEPS = 100_000  # H beyond this is a mistake, not a schedule (the field syncs every 30-500 steps)
MAX_LEARNING_RATE = 1e6  # learning rates crossing the wire are finite, non-negative and below this
MAX_PIECE_BYTES = 1 << 34  # a relayed payload's declared size: no payload of a model a worker takes is larger
MAX_CATCH_UP = 1024  # missed updates one order may carry (--replay-window is far smaller)
MAX_NEIGHBOURS = 4096  # a gossip worker's neighbours (a complete graph of this many workers is already slow)
MAX_WEIGHT = 1e12  # a sender's weight is its token count (or a clip-scaled share of it)
PART_BYTES = 2 << 20  # well under gRPC's default 4 MB message limit


class ProtocolError(ValueError):
    """A message that is malformed or not what this side expects."""


MAX_RUN_ID = 128  # a run id names a run in logs and errors: short, printable


def check_run_id(run_id: str, where: str) -> str:
    """``run_id`` if it is 1-128 printable ASCII characters; ``ProtocolError`` otherwise (without echoing it)."""
    if not run_id:
        raise ProtocolError(f"{where} has no run_id")
    if len(run_id) > MAX_RUN_ID or not all(" " <= c <= "~" for c in run_id):
        raise ProtocolError(
            f"{where}: run_id must be 1-{MAX_RUN_ID} printable ASCII characters (got {len(run_id)} characters)"
        )
    return run_id


# ------------------------------------------------------------------------------------------- framing


def to_parts(message: Message, part_bytes: int = PART_BYTES) -> Iterator[pb.Part]:
    """``message`` serialized and cut into parts; every part declares the total, the last adds the hash."""
    return frame([message.SerializeToString()], part_bytes)


def frame(pieces: Iterable[bytes], part_bytes: int = PART_BYTES, total: int | None = None) -> Iterator[pb.Part]:
    """The concatenation of ``pieces`` as parts, without ever joining them: at most a part and a piece are
    held at a time. ``total`` (the pieces' byte count, which every part declares) is needed up front when
    ``pieces`` is a generator; the hash is taken as the bytes go by."""
    if total is None:
        pieces = list(pieces)
        total = sum(map(len, pieces))
    digest = hashlib.sha256()
    held, sent = bytearray(), 0  # held: at most a part, kept back until more comes (the last carries the hash)

    def part(data: bytes) -> pb.Part:
        nonlocal sent
        digest.update(data)
        sent += len(data)
        return pb.Part(data=data, last=False, total_bytes=total)

    for piece in pieces:
        view = memoryview(piece)
        if held:  # top the held bytes up to a part first
            take = part_bytes - len(held)
            held += view[:take]
            view = view[take:]
            if not view:
                continue
            yield part(bytes(held))
            held = bytearray()
        while len(view) > part_bytes:  # straight from the piece, one copy per part
            yield part(bytes(view[:part_bytes]))
            view = view[part_bytes:]
        held += view
    if sent + len(held) != total:
        raise RuntimeError(f"framed {sent + len(held)} bytes, declared {total}")  # a bug on this side
    digest.update(held)
    yield pb.Part(data=bytes(held), last=True, total_bytes=total, sha256=digest.digest())


class Unframer:
    """The receiving side of ``frame``, a part at a time: refuses a message whose first part declares more
    than ``max_bytes`` before holding any of it, a part that disagrees with the declared size or runs past
    it, and, on the last part, a short message or a wrong hash. ``limit_reason`` says where the limit comes
    from, for the error."""

    def __init__(self, max_bytes: int, limit_reason: str = "--max-message-mb") -> None:
        self.max_bytes, self.limit_reason = max_bytes, limit_reason
        self.declared = -1
        self.received = 0
        self.done = False
        self._digest = hashlib.sha256()

    def take(self, part: pb.Part) -> bytes:
        """``part``'s bytes once checked; after the last part, ``done`` is set."""
        if self.done:
            raise ProtocolError("framed message runs on after its last part")
        if self.declared < 0:  # the first part: refuse an oversized message before holding any of it
            self.declared = part.total_bytes
            if self.declared > self.max_bytes:
                raise ProtocolError(
                    f"message declares {self.declared} bytes, over the {_size(self.max_bytes)} limit "
                    f"({self.limit_reason})"
                )
        elif part.total_bytes != self.declared:
            raise ProtocolError(f"a part declares {part.total_bytes} bytes in all, the first part {self.declared}")
        if self.received + len(part.data) > self.declared:
            raise ProtocolError(f"framed message runs past the {self.declared} bytes its parts declare")
        self.received += len(part.data)
        self._digest.update(part.data)
        if part.last:
            if self.received != self.declared:
                raise ProtocolError(f"framed message is {self.received} bytes, its parts declare {self.declared}")
            if self._digest.digest() != part.sha256:
                raise ProtocolError("framed message failed its SHA-256 check")
            self.done = True
        return part.data

    def check_complete(self) -> None:
        if not self.done:
            raise ProtocolError("framed message ended before its last part")


def join_parts(parts: Iterable[pb.Part], max_bytes: int, limit_reason: str = "--max-message-mb") -> bytes:
    """Concatenate a framed message, checked as ``Unframer`` checks it, before anything is parsed."""
    unframe = Unframer(max_bytes, limit_reason)
    buf = bytearray()
    for part in parts:
        buf += unframe.take(part)
        if unframe.done:
            break
    unframe.check_complete()
    return bytes(buf)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def parse(cls: type[Message], data: bytes) -> Message:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise ProtocolError(f"not a {cls.__name__} message: {e}") from None
    return msg


# ------------------------------------------------------------------------------------------- tensors

_DTYPES: dict[torch.dtype, tuple[int, np.dtype]] = {
    torch.float32: (pb.DTYPE_FLOAT32, np.dtype("<f4")),
    torch.bfloat16: (pb.DTYPE_BFLOAT16, np.dtype("<i2")),  # numpy has no bf16: travel as raw 16-bit words
    torch.float16: (pb.DTYPE_FLOAT16, np.dtype("<f2")),
    torch.int32: (pb.DTYPE_INT32, np.dtype("<i4")),
    torch.int64: (pb.DTYPE_INT64, np.dtype("<i8")),
    torch.uint8: (pb.DTYPE_UINT8, np.dtype("u1")),
}
_BY_CODE = {code: (dtype, np_dtype) for dtype, (code, np_dtype) in _DTYPES.items()}


def dtype_code(name: str, dtype: torch.dtype) -> tuple[int, np.dtype]:
    """How tensor ``name`` of ``dtype`` travels: its DType code and the numpy dtype of its bytes."""
    if dtype not in _DTYPES:
        raise ProtocolError(f"tensor {name!r}: dtype {dtype} cannot travel")
    return _DTYPES[dtype]


def tensor_to_proto(name: str, t: torch.Tensor) -> pb.Tensor:
    code, np_dtype = dtype_code(name, t.dtype)
    host = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        host = host.view(torch.int16)
    return pb.Tensor(
        name=name, shape=list(t.shape), dtype=code, data=host.numpy().astype(np_dtype, copy=False).tobytes()
    )


def tensor_from_proto(msg: pb.Tensor) -> torch.Tensor:
    if msg.dtype not in _BY_CODE:
        raise ProtocolError(f"tensor {msg.name!r}: unknown dtype {msg.dtype}")
    dtype, np_dtype = _BY_CODE[msg.dtype]
    shape = tuple(msg.shape)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(msg.data) != numel * np_dtype.itemsize:
        raise ProtocolError(f"tensor {msg.name!r}: {len(msg.data)} bytes for shape {shape} of {dtype}")
    t = torch.from_numpy(np.frombuffer(msg.data, np_dtype).copy()).reshape(shape)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def tensors_to_proto(tensors: Mapping[str, torch.Tensor]) -> list[pb.Tensor]:
    return [tensor_to_proto(n, t) for n, t in tensors.items()]


def tensors_from_proto(msgs: Iterable[pb.Tensor], field: str = "tensors") -> dict[str, torch.Tensor]:
    """Named tensors; every floating-point one must be finite (``field`` names them in the error)."""
    out: dict[str, torch.Tensor] = {}
    for m in msgs:
        if m.name in out:
            raise ProtocolError(f"tensor {m.name!r} appears twice")
        t = tensor_from_proto(m)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ProtocolError(f"{field}: tensor {m.name!r} has non-finite values")
        out[m.name] = t
    return out


def _finite(value: float, field: str, low: float = -math.inf, high: float = math.inf) -> float:
    if not (math.isfinite(value) and low <= value <= high):
        raise ProtocolError(f"{field} must be finite and in [{low:g}, {high:g}], got {value}")
    return value


# ------------------------------------------------------------------------------------------- messages


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    protocol_version: int
    gradwire_version: str
    torch_version: str
    device: str
    device_name: str = ""
    local_devices: int = 1
    replicas: Mapping[str, int] = dataclasses.field(default_factory=dict)
    ranks: int = 1
    rank_devices: tuple[str, ...] = ()
    node_mode: str = ""
    precision: str = "fp32"  # its forward/backward: "fp32" or "bf16" (autocast)


def info_to_proto(info: WorkerInfo) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        **{**dataclasses.asdict(info), "replicas": dict(info.replicas), "rank_devices": list(info.rank_devices)}
    )


def info_from_proto(msg: pb.WorkerInfo) -> WorkerInfo:
    # A worker that does not say is a single device (ranks 0 on the wire).
    return WorkerInfo(
        msg.protocol_version,
        msg.gradwire_version,
        msg.torch_version,
        msg.device,
        msg.device_name,
        msg.local_devices,
        dict(msg.replicas),
        max(1, msg.ranks),
        tuple(msg.rank_devices),
        msg.node_mode,
        _precision(msg.precision),
    )


def _precision(text: str) -> str:
    """A worker's forward/backward precision as its Describe says (empty: an older worker, fp32)."""
    if text in ("", "fp32"):
        return "fp32"
    if text == "bf16":
        return text
    raise ProtocolError(f"worker precision must be fp32 or bf16, got {text[:40]!r}")


@dataclasses.dataclass
class ModelState:
    run_id: str
    version: int
    model_json: str
    parameters: dict[str, torch.Tensor]
    update_rule_json: str
    optimizer_state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    feedback: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    inner_optimizer: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    protocol_version: int = PROTOCOL_VERSION
    # (round, payload): the receiver's own payload in the update in flight, which it keeps as if it had sent
    # it (a resumed --overlap run's push); None: it holds none.
    own: tuple[int, CompressedGradient] | None = None
    gossip_model: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # gossip rounds, resumed
    gossip: bool = False  # the run's rounds are gossip rounds (a node keeps the whole model on every rank)


def state_to_proto(s: ModelState) -> pb.ModelState:
    m = pb.ModelState(
        protocol_version=s.protocol_version,
        run_id=s.run_id,
        version=s.version,
        model_json=s.model_json,
        parameters=tensors_to_proto(s.parameters),
        update_rule_json=s.update_rule_json,
        optimizer_state=tensors_to_proto(s.optimizer_state),
        feedback=tensors_to_proto(s.feedback),
        inner_optimizer=tensors_to_proto(s.inner_optimizer),
        gossip_model=tensors_to_proto(s.gossip_model),
        gossip=s.gossip,
    )
    if s.own is not None:
        m.own_round = s.own[0]
        m.own_payload.CopyFrom(codec_serde.gradient_to_proto(s.own[1]))
    return m


def own_from_proto(m: pb.ModelState) -> tuple[int, CompressedGradient] | None:
    """A pushed state's ``own`` payload, its bytes checked as any payload's (``ModelState.own``)."""
    if not m.HasField("own_payload"):
        if m.own_round:
            raise ProtocolError(f"model state names own_round {m.own_round} but carries no own_payload")
        return None
    return m.own_round, codec_serde.gradient_from_proto(m.own_payload)


def state_from_proto(m: pb.ModelState) -> ModelState:
    check_version(m.protocol_version)
    check_run_id(m.run_id, "model state")
    return ModelState(
        m.run_id,
        m.version,
        m.model_json,
        tensors_from_proto(m.parameters, "parameters"),
        m.update_rule_json,
        tensors_from_proto(m.optimizer_state, "optimizer_state"),
        tensors_from_proto(m.feedback, "feedback"),
        tensors_from_proto(m.inner_optimizer, "inner_optimizer"),
        m.protocol_version,
        own_from_proto(m),
        tensors_from_proto(m.gossip_model, "gossip_model"),
        m.gossip,
    )


def fingerprint_to_proto(f: Fingerprint) -> pb.Fingerprint:
    return pb.Fingerprint(sums=f.sums, sumsqs=f.sumsqs, samples=f.samples)


def fingerprint_from_proto(m: pb.Fingerprint) -> Fingerprint:
    if not all(map(math.isfinite, (*m.sums, *m.sumsqs, *m.samples))):
        raise ProtocolError("fingerprint has non-finite values")
    return Fingerprint(tuple(m.sums), tuple(m.sumsqs), tuple(m.samples))


def update_to_proto(u: StateUpdate) -> pb.StateUpdate:
    if u.relayed_delta:
        (r,) = u.relayed
        piece = pb.PieceRef(position=r.position, digest=r.digest, size=r.size, sources=list(r.sources))
        return pb.StateUpdate(delta_piece=piece, learning_rate=u.learning_rate)
    if u.delta is not None:
        return pb.StateUpdate(delta=codec_serde.gradient_to_proto(u.delta), learning_rate=u.learning_rate)
    # No weights means equal weights (as in Replica.apply); the wire always carries one per sender.
    weights = u.weights or [1.0] * (len(u.payloads) + (u.own is not None))
    replay = pb.Replay(
        payloads=[codec_serde.gradient_to_proto(p) for p in u.payloads],
        weights=weights,
        scales=u.scales,
        aggregation="" if u.rule.mode == MEAN.mode else u.rule.mode,
        trim=u.rule.trim if u.rule.mode != MEAN.mode else 0.0,
        exact=u.rule.exact,
        own_position=u.own[0] + 1 if u.own is not None else 0,
        own_round=u.own[1] if u.own is not None else 0,
        fragment=u.fragment.index if u.fragment is not None else 0,
        fragments=u.fragment.count if u.fragment is not None else 0,
        relayed=[
            pb.PieceRef(position=r.position, digest=r.digest, size=r.size, sources=list(r.sources)) for r in u.relayed
        ],
    )
    return pb.StateUpdate(replay=replay, learning_rate=u.learning_rate)


def update_from_proto(m: pb.StateUpdate) -> StateUpdate:
    kind = m.WhichOneof("kind")
    _finite(m.learning_rate, "update learning_rate", 0.0, MAX_LEARNING_RATE)
    if kind == "delta":
        return StateUpdate(m.learning_rate, delta=codec_serde.gradient_from_proto(m.delta))
    if kind == "delta_piece":
        relayed = _relayed_from_proto([m.delta_piece], 1, None)
        return StateUpdate(m.learning_rate, relayed=relayed, relayed_delta=True)
    if kind == "replay":
        own = m.replay.own_position > 0  # the receiver's own payload is left out: one sender more than payloads
        senders = len(m.replay.payloads) + own + len(m.replay.relayed)
        if len(m.replay.weights) != senders or not senders:
            kept = " and leaves out the receiver's own" if own else ""
            raise ProtocolError(
                f"replay has {len(m.replay.payloads)} payloads{kept} and {len(m.replay.weights)} weights"
            )
        if own and m.replay.own_position > senders:
            raise ProtocolError(f"replay own_position {m.replay.own_position} is beyond its {senders} senders")
        relayed = _relayed_from_proto(m.replay.relayed, senders, m.replay.own_position - 1 if own else None)
        for w in m.replay.weights:
            _finite(w, "replay weights", 0.0, MAX_WEIGHT)
        if not sum(m.replay.weights) > 0:
            raise ProtocolError("replay weights must not all be zero")
        if m.replay.scales and len(m.replay.scales) != senders:
            raise ProtocolError(f"replay has {senders} senders and {len(m.replay.scales)} clip scales")
        for scale in m.replay.scales:
            _finite(scale, "replay scales", 0.0, 1.0)
        try:
            rule = AggregationRule(
                mode=m.replay.aggregation or MEAN.mode,
                trim=m.replay.trim if m.replay.aggregation else MEAN.trim,
                exact=m.replay.exact,
            )
        except ValueError as e:
            raise ProtocolError(f"replay aggregation: {e}") from None
        fragment = fragment_from_proto(m.replay.fragment, m.replay.fragments, "replay")
        payloads = tuple(codec_serde.gradient_from_proto(p) for p in m.replay.payloads)
        own_payload = (m.replay.own_position - 1, m.replay.own_round) if own else None
        return StateUpdate(
            m.learning_rate,
            payloads,
            tuple(m.replay.weights),
            scales=tuple(m.replay.scales),
            rule=rule,
            own=own_payload,
            fragment=fragment,
            relayed=relayed,
        )
    raise ProtocolError("state update carries neither a replay nor a delta")


def _relayed_from_proto(refs: Sequence[pb.PieceRef], senders: int, own: int | None) -> tuple[PieceRef, ...]:
    """A replay's relayed payloads (``gradwire.relay``): each at a distinct position among the senders, not
    the receiver's own, with a digest, a size within a message's and at most ``relay.MAX_SOURCES`` sources."""
    out = []
    for r in refs:
        if r.position >= senders or r.position == own:
            raise ProtocolError(f"replay: relayed position {r.position} is not another sender's of {senders}")
        if r.size > MAX_PIECE_BYTES:
            raise ProtocolError(f"replay: a relayed payload of {r.size} bytes is over {MAX_PIECE_BYTES}")
        try:
            out.append(PieceRef(r.position, r.digest, r.size, tuple(r.sources)))
        except ValueError as e:
            raise ProtocolError(f"replay: {e}") from None
    if len({r.position for r in out}) != len(out):
        raise ProtocolError("replay: two relayed payloads at one position")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class PieceRequest:
    """A ``PullPiece`` call: the payload of ``run_id`` with SHA-256 ``digest``, asked with the run's peer key."""

    run_id: str
    peer_key: bytes
    digest: bytes


def relayed_payload(data: bytes) -> CompressedGradient:
    """A pulled payload's bytes (``relay.payload_bytes``) as the payload; ``ProtocolError`` if they are none."""
    try:
        return codec_serde.gradient_from_proto(parse(codec_pb.CompressedGradient, data))
    except PayloadError as e:
        raise ProtocolError(f"relayed payload: {e.reason}") from None


def piece_pull_to_proto(r: PieceRequest) -> pb.PullPieceRequest:
    return pb.PullPieceRequest(run_id=r.run_id, peer_key=r.peer_key, digest=r.digest)


def piece_pull_from_proto(m: pb.PullPieceRequest) -> PieceRequest:
    if not PEER_KEY_BYTES[0] <= len(m.peer_key) <= PEER_KEY_BYTES[1]:
        raise ProtocolError("PullPiece: the request carries no peer key of the right size")
    if len(m.digest) != DIGEST_BYTES:
        raise ProtocolError(f"PullPiece: a digest is {DIGEST_BYTES} bytes, got {len(m.digest)}")
    return PieceRequest(check_run_id(m.run_id, "PullPiece"), m.peer_key, m.digest)


def update_to_bytes(u: StateUpdate) -> bytes:
    """``u`` as its StateUpdate message's bytes (an --overlap checkpoint keeps the update in flight so)."""
    return update_to_proto(u).SerializeToString()


def update_from_bytes(data: bytes) -> StateUpdate:
    """The inverse of ``update_to_bytes``, validated as an update off the wire is."""
    return update_from_proto(parse(pb.StateUpdate, data))


def fragment_from_proto(index: int, count: int, what: str) -> Fragment | None:
    """The fragment a message names (``fragments`` 0 or 1: none, the whole model)."""
    if count <= 1:
        if index:
            raise ProtocolError(f"{what}: fragment {index} of a whole model")
        return None
    try:
        return Fragment(index, count)
    except ValueError as e:
        raise ProtocolError(f"{what}: {e}") from None


@dataclasses.dataclass(frozen=True)
class LocalSteps:
    """A local-SGD round: ``steps`` inner steps of ``optimizer``, one learning rate each."""

    steps: int
    optimizer: InnerOptimizerConfig
    learning_rates: tuple[float, ...]
    clip_grad_norm: float = 0.0
    fragment: Fragment | None = None  # --fragments: the working model carries on; send this fragment alone
    eager_lr: float = 0.0  # --overlap-update eager: start from the replica moved by the own last payload

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= MAX_INNER_STEPS:
            raise ProtocolError(f"local steps: steps must be in [1, {MAX_INNER_STEPS}], got {self.steps}")
        if len(self.learning_rates) != self.steps:
            raise ProtocolError(f"local steps: {len(self.learning_rates)} learning rates for {self.steps} steps")
        for lr in self.learning_rates:
            if not (math.isfinite(lr) and 0 <= lr <= MAX_LEARNING_RATE):
                raise ProtocolError(
                    f"local steps: learning_rates must be finite and in [0, {MAX_LEARNING_RATE:g}], got {lr}"
                )
        if not (math.isfinite(self.clip_grad_norm) and self.clip_grad_norm >= 0):
            raise ProtocolError(f"local steps: clip_grad_norm must be finite and >= 0, got {self.clip_grad_norm}")
        if not (math.isfinite(self.eager_lr) and 0 <= self.eager_lr <= MAX_LEARNING_RATE):
            raise ProtocolError(f"local steps: eager_lr must be finite and in [0, {MAX_LEARNING_RATE:g}]")
        if self.eager_lr and self.fragment is not None:
            raise ProtocolError("local steps: a fragment's working model carries on; it takes no eager start")


def inner_optimizer_to_proto(c: InnerOptimizerConfig) -> pb.InnerOptimizer:
    return pb.InnerOptimizer(
        name=c.name,
        weight_decay=c.weight_decay,
        beta1=c.betas[0],
        beta2=c.betas[1],
        eps=c.eps,
        momentum=c.momentum,
        nesterov=c.nesterov,
        ns_steps=c.ns_steps,
        msgn=c.msgn,
        lr_scales=[pb.LrScale(name=name, factor=factor) for name, factor in c.lr_scales],
    )


def inner_optimizer_from_proto(m: pb.InnerOptimizer) -> InnerOptimizerConfig:
    if len(m.lr_scales) > MAX_LR_SCALES:  # before a tuple of them is built
        raise ProtocolError(f"local steps: inner optimizer: more than {MAX_LR_SCALES} lr_scales")
    try:
        return InnerOptimizerConfig(
            name=m.name,
            weight_decay=m.weight_decay,
            betas=(m.beta1, m.beta2),
            eps=m.eps,
            momentum=m.momentum,
            nesterov=m.nesterov,
            ns_steps=m.ns_steps,
            msgn=m.msgn or "newton-schulz",
            lr_scales=tuple((x.name, x.factor) for x in m.lr_scales),
        )
    except ValueError as e:  # the config names the setting; say where it came from
        raise ProtocolError(f"local steps: inner optimizer: {e}") from None


def local_steps_to_proto(ls: LocalSteps) -> pb.LocalSteps:
    return pb.LocalSteps(
        steps=ls.steps,
        optimizer=inner_optimizer_to_proto(ls.optimizer),
        learning_rates=ls.learning_rates,
        clip_grad_norm=ls.clip_grad_norm,
        fragment=ls.fragment.index if ls.fragment is not None else 0,
        fragments=ls.fragment.count if ls.fragment is not None else 0,
        eager_lr=ls.eager_lr,
    )


def local_steps_from_proto(m: pb.LocalSteps) -> LocalSteps:
    if not m.HasField("optimizer"):
        raise ProtocolError("local steps: optimizer missing")
    fragment = fragment_from_proto(m.fragment, m.fragments, "local steps")
    return LocalSteps(
        m.steps,
        inner_optimizer_from_proto(m.optimizer),
        tuple(m.learning_rates),
        m.clip_grad_norm,
        fragment,
        m.eager_lr,
    )


DIGEST_BYTES = 32  # SHA-256
PEER_KEY_BYTES = (16, 64)


@dataclasses.dataclass(frozen=True)
class GossipPull:
    """A neighbour's accepted message to pull from the neighbour itself (worker.proto's ``GossipPull``)."""

    member: str
    address: str
    round: int
    digest: bytes

    def __post_init__(self) -> None:
        _member(self.member)
        if not self.address or len(self.address) > 256 or not self.address.isprintable():
            raise ProtocolError(f"gossip: the address of {self.member!r} is 1-256 printable characters")
        if len(self.digest) != DIGEST_BYTES:
            raise ProtocolError(f"gossip: the digest of {self.member!r}'s message is {len(self.digest)} bytes, not 32")


@dataclasses.dataclass(frozen=True)
class GossipLinks:
    """One worker's part of a gossip round (``WorkOrder.gossip``; its meaning is in worker.proto).
    ``fresh`` maps a member to its whole public copy, or to ``None``: the run's starting state. With
    ``peer_key`` (peer-to-peer), ``pulls`` names the messages to pull from the neighbours themselves."""

    member: str
    weights: Mapping[str, float]  # neighbour -> W_ij
    gamma: float
    own_accepted: bool = False
    relays: Mapping[str, CompressedGradient] = dataclasses.field(default_factory=dict)
    fresh: Mapping[str, Mapping[str, torch.Tensor] | None] = dataclasses.field(default_factory=dict)
    drop: tuple[str, ...] = ()
    peer_key: bytes = b""
    pulls: Mapping[str, GossipPull] = dataclasses.field(default_factory=dict)
    own_round: int = 0  # peer-to-peer, with own_accepted: the round its accepted message was sent in
    upload: bool = False  # peer-to-peer: send this round's message to the coordinator too, to relay

    def __post_init__(self) -> None:
        _member(self.member)
        if self.peer_key and not PEER_KEY_BYTES[0] <= len(self.peer_key) <= PEER_KEY_BYTES[1]:
            raise ProtocolError(f"gossip: the peer key is {len(self.peer_key)} bytes, not {PEER_KEY_BYTES}")
        if (self.pulls or self.upload) and not self.peer_key:
            raise ProtocolError("gossip: messages to pull from neighbours or to upload, and no peer key")
        if stray := [j for j, pull in self.pulls.items() if j not in self.weights or pull.member != j]:
            raise ProtocolError(f"gossip: messages to pull from non-neighbours {stray}")
        if both := [j for j in self.pulls if j in self.relays or j in self.fresh]:
            raise ProtocolError(f"gossip: {both} come pulled and also relayed or whole")
        if not (math.isfinite(self.gamma) and 0 < self.gamma <= 1):
            raise ProtocolError(f"gossip: gamma must be in (0, 1], got {self.gamma}")
        if len(self.weights) > MAX_NEIGHBOURS:
            raise ProtocolError(f"gossip: {len(self.weights)} neighbours, more than {MAX_NEIGHBOURS}")
        for j, w in self.weights.items():
            _member(j)
            if j == self.member:
                raise ProtocolError("gossip: a worker is not its own neighbour")
            if not (math.isfinite(w) and 0 < w <= 1):
                raise ProtocolError(f"gossip: the weight of neighbour {j!r} must be in (0, 1], got {w}")
        if sum(self.weights.values()) > 1 + 1e-9:
            raise ProtocolError(f"gossip: the neighbours' weights sum to {sum(self.weights.values()):g}, above 1")
        if stray := [j for j in self.relays if j not in self.weights]:
            raise ProtocolError(f"gossip: messages relayed from non-neighbours {stray}")
        if stray := [j for j in self.fresh if j not in self.weights and j != self.member]:
            raise ProtocolError(f"gossip: public copies sent of non-neighbours {stray}")
        if both := [j for j in self.relays if j in self.fresh]:
            raise ProtocolError(f"gossip: {both} come both whole and as a message")
        if len(set(self.drop)) != len(self.drop) or [j for j in self.drop if j in self.weights]:
            raise ProtocolError("gossip: drop names each former neighbour once, and no present one")


MAX_MEMBER = 128  # a member's name on a gossip graph: short, printable


def _member(name: str) -> str:
    if not name or len(name) > MAX_MEMBER or not name.isprintable():
        raise ProtocolError(f"gossip: a member name is 1-{MAX_MEMBER} printable characters, got {name[:40]!r}")
    return name


def gossip_to_proto(g: GossipLinks) -> pb.GossipLinks:
    return pb.GossipLinks(
        member=g.member,
        neighbours=[pb.GossipNeighbour(member=j, weight=w) for j, w in g.weights.items()],
        gamma=g.gamma,
        own_accepted=g.own_accepted,
        relays=[pb.GossipRelay(member=j, message=codec_serde.gradient_to_proto(q)) for j, q in g.relays.items()],
        fresh=[
            pb.PublicCopy(member=j, start=True) if c is None else pb.PublicCopy(member=j, tensors=tensors_to_proto(c))
            for j, c in g.fresh.items()
        ],
        drop=list(g.drop),
        peer_key=g.peer_key,
        pulls=[pb.GossipPull(member=j, address=p.address, round=p.round, digest=p.digest) for j, p in g.pulls.items()],
        own_round=g.own_round,
        upload=g.upload,
    )


def gossip_from_proto(m: pb.GossipLinks) -> GossipLinks:
    def unique(names: list[str], what: str) -> None:
        if len(set(names)) != len(names):
            raise ProtocolError(f"gossip: a member appears twice among the {what}")

    if len(m.neighbours) > MAX_NEIGHBOURS or len(m.drop) > MAX_NEIGHBOURS:
        raise ProtocolError(f"gossip: more than {MAX_NEIGHBOURS} neighbours")
    unique([n.member for n in m.neighbours], "neighbours")
    unique([r.member for r in m.relays], "relays")
    unique([c.member for c in m.fresh], "public copies")
    unique([p.member for p in m.pulls], "pulls")
    fresh: dict[str, Mapping[str, torch.Tensor] | None] = {}
    for c in m.fresh:
        if c.start and c.tensors:
            raise ProtocolError(f"gossip: the public copy of {c.member!r} is the start and carries tensors")
        fresh[c.member] = None if c.start else tensors_from_proto(c.tensors, f"public copy of {c.member!r}")
    try:
        relays = {r.member: codec_serde.gradient_from_proto(r.message) for r in m.relays}
    except PayloadError as e:
        raise ProtocolError(f"gossip: a relayed message: {e.reason}") from None
    pulls = {p.member: GossipPull(p.member, p.address, p.round, p.digest) for p in m.pulls}
    return GossipLinks(
        m.member,
        {n.member: n.weight for n in m.neighbours},
        m.gamma,
        m.own_accepted,
        relays,
        fresh,
        tuple(m.drop),
        m.peer_key,
        pulls,
        m.own_round,
        m.upload,
    )


# ------------------------------------------------------------------------------- peer-to-peer gossip

MAX_SKETCH = 1 << 16  # floats in a count sketch of a public copy (gradwire/gossip/sketch.py)


@dataclasses.dataclass(frozen=True)
class GossipSent:
    """What a peer-to-peer gossip round's result says of the message the worker keeps for its neighbours:
    the digest and size of its serialized ``GossipPiece``, and count sketches of the worker's public copy
    before the message and of the decoded message."""

    digest: bytes
    nbytes: int
    sketch: tuple[float, ...] = ()
    message_sketch: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.digest) != DIGEST_BYTES:
            raise ProtocolError(f"gossip: a message digest is {DIGEST_BYTES} bytes, got {len(self.digest)}")
        if len(self.sketch) != len(self.message_sketch) or len(self.sketch) > MAX_SKETCH:
            raise ProtocolError(f"gossip: the two sketches must be as long as each other and at most {MAX_SKETCH}")
        if not all(math.isfinite(v) for v in (*self.sketch, *self.message_sketch)):
            raise ProtocolError("gossip: a sketch has non-finite values")


@dataclasses.dataclass(frozen=True)
class GossipPieceRequest:
    """A ``PullGossip`` call: a worker's message of ``round``, or (``copy``) its public copy as it stands when
    it takes that round's links: with every message of its the coordinator accepted, the last of them sent in
    round ``last`` (``None``: none yet)."""

    run_id: str
    peer_key: bytes
    round: int
    copy: bool = False
    last: int | None = None


def piece_request_to_proto(r: GossipPieceRequest) -> pb.PullGossipRequest:
    return pb.PullGossipRequest(
        run_id=r.run_id,
        peer_key=r.peer_key,
        round=r.round,
        copy=r.copy,
        with_last=r.last is not None,
        last=r.last if r.last is not None else 0,
    )


def piece_request_from_proto(m: pb.PullGossipRequest) -> GossipPieceRequest:
    if not PEER_KEY_BYTES[0] <= len(m.peer_key) <= PEER_KEY_BYTES[1]:
        raise ProtocolError("PullGossip: the request carries no peer key of the right size")
    if m.with_last and not m.copy:
        raise ProtocolError("PullGossip: with_last asks about a copy, not a message")
    last = m.last if m.with_last else None
    return GossipPieceRequest(check_run_id(m.run_id, "PullGossip"), m.peer_key, m.round, m.copy, last)


def message_piece_to_bytes(member: str, round_: int, message: CompressedGradient) -> bytes:
    """A message as a worker keeps it for its neighbours: the serialized ``GossipPiece`` whose digest it reports."""
    return pb.GossipPiece(
        member=member, round=round_, message=codec_serde.gradient_to_proto(message)
    ).SerializeToString(deterministic=True)


def copy_piece_to_proto(member: str, round_: int, copy: Mapping[str, torch.Tensor]) -> pb.GossipPiece:
    return pb.GossipPiece(
        member=member, round=round_, copy=pb.PublicCopy(member=member, tensors=tensors_to_proto(copy))
    )


def message_from_piece(data: bytes, member: str, round_: int) -> CompressedGradient:
    """The message in a pulled ``GossipPiece``; ``ProtocolError`` unless it is ``member``'s of ``round_``."""
    m = parse(pb.GossipPiece, data)
    if m.member != member or m.round != round_ or not m.HasField("message") or m.HasField("copy"):
        raise ProtocolError(f"gossip: the piece pulled is not {member!r}'s message of round {round_}")
    try:
        return codec_serde.gradient_from_proto(m.message)
    except PayloadError as e:
        raise ProtocolError(f"gossip: the message of {member!r}: {e.reason}") from None


def copy_from_piece(m: pb.GossipPiece, member: str, round_: int) -> dict[str, torch.Tensor]:
    """The public copy in a pulled ``GossipPiece``; ``ProtocolError`` unless it is ``member``'s at ``round_``."""
    if m.member != member or m.round != round_ or not m.HasField("copy") or m.HasField("message"):
        raise ProtocolError(f"gossip: the piece pulled is not {member!r}'s public copy at round {round_}")
    return tensors_from_proto(m.copy.tensors, f"public copy of {member!r}")


_BATCH_DTYPES = {pb.DTYPE_UINT16: np.dtype("<u2"), pb.DTYPE_INT32: np.dtype("<i4")}


@dataclasses.dataclass
class WorkOrder:
    run_id: str
    round: int
    base_version: int
    batch: np.ndarray  # (rows, sequence_length + 1) token ids, uint16 or int32
    codec: CodecConfig
    fingerprint: Fingerprint
    update: StateUpdate | None = None
    feedback_beta: float = 0.999
    micro_batch_size: int = 0
    sync_tolerance: float = 1e-4
    local_steps: LocalSteps | None = None  # None: gradient mode
    protocol_version: int = PROTOCOL_VERSION
    catch_up: tuple[StateUpdate, ...] = ()  # missed updates, oldest first, applied before ``update``
    compute_before_update: bool = False  # --overlap: the contribution is computed before ``update`` is applied
    next_batch: np.ndarray | None = None  # --overlap: the next round's likely batch (look-ahead)
    clip_grad_norm: float = 0.0  # gradient mode: the gradient's global L2 norm is clipped to this; 0 = off
    fingerprint_gradient: bool = False  # spot checks: return the round's first gradient's fingerprint
    next_local_steps: LocalSteps | None = None  # --overlap, local-SGD rounds: the next round's inner steps
    stream_buckets: int = 0  # gradient mode: stream the gradient in this many pieces (compression.stream)
    gossip: GossipLinks | None = None  # a gossip round (--topology): the worker's links this round
    peer_key: bytes = b""  # --relay peers: what pulls of relayed payloads present, and what pullers must
    seed: bool = False  # --relay peers: keep the update's payloads carried here for the peers to pull
    fingerprint_every: int = 1  # fingerprints hold their moments at the versions this divides (takes_moments)

    @property
    def inner_steps(self) -> int:
        return self.local_steps.steps if self.local_steps is not None else 1


def batch_to_proto(batch: np.ndarray) -> pb.TokenBatch:
    code = {v: k for k, v in _BATCH_DTYPES.items()}.get(batch.dtype.newbyteorder("<"))
    if code is None or batch.ndim != 2:
        raise ProtocolError(f"token batch must be a 2-D uint16 or int32 array, got {batch.dtype} {batch.shape}")
    return pb.TokenBatch(
        rows=batch.shape[0],
        columns=batch.shape[1],
        dtype=code,
        data=np.ascontiguousarray(batch).astype(_BATCH_DTYPES[code]).tobytes(),
    )


def batch_from_proto(b: pb.TokenBatch, what: str = "token batch") -> np.ndarray:
    """The (rows, columns) token ids of ``b``, checked against its declared shape and dtype."""
    if b.dtype not in _BATCH_DTYPES:
        raise ProtocolError(f"{what} dtype {b.dtype} is not uint16 or int32")
    np_dtype = _BATCH_DTYPES[b.dtype]
    if b.rows == 0 or b.columns < 2 or len(b.data) != b.rows * b.columns * np_dtype.itemsize:
        raise ProtocolError(f"{what} of {b.rows}x{b.columns} does not match its {len(b.data)} bytes")
    return np.frombuffer(b.data, np_dtype).reshape(b.rows, b.columns)


def order_to_proto(o: WorkOrder) -> pb.WorkOrder:
    return pb.WorkOrder(
        protocol_version=o.protocol_version,
        run_id=o.run_id,
        round=o.round,
        base_version=o.base_version,
        update=update_to_proto(o.update) if o.update is not None else None,
        fingerprint=fingerprint_to_proto(o.fingerprint),
        batch=batch_to_proto(o.batch),
        codec=codec_serde.settings_to_proto(o.codec),
        feedback_beta=o.feedback_beta,
        micro_batch_size=o.micro_batch_size,
        sync_tolerance=o.sync_tolerance,
        local_steps=local_steps_to_proto(o.local_steps) if o.local_steps is not None else None,
        catch_up=[update_to_proto(u) for u in o.catch_up],
        compute_before_update=o.compute_before_update,
        next_batch=batch_to_proto(o.next_batch) if o.next_batch is not None else None,
        clip_grad_norm=o.clip_grad_norm,
        fingerprint_gradient=o.fingerprint_gradient,
        next_local_steps=local_steps_to_proto(o.next_local_steps) if o.next_local_steps is not None else None,
        stream_buckets=o.stream_buckets,
        gossip=gossip_to_proto(o.gossip) if o.gossip is not None else None,
        peer_key=o.peer_key,
        seed=o.seed,
        fingerprint_every=o.fingerprint_every,
    )


def order_from_proto(m: pb.WorkOrder) -> WorkOrder:
    check_version(m.protocol_version)
    check_run_id(m.run_id, "work order")
    batch = batch_from_proto(m.batch)
    next_batch, next_local_steps = None, None
    if m.HasField("next_local_steps") and not (m.HasField("next_batch") and m.HasField("local_steps")):
        raise ProtocolError("next_local_steps comes only with next_batch, in a local-SGD order")
    if m.HasField("next_batch"):
        if not m.compute_before_update:
            raise ProtocolError("next_batch is read only by orders with compute_before_update")
        next_batch = batch_from_proto(m.next_batch, "next token batch")
        if next_batch.shape[1] != batch.shape[1]:
            raise ProtocolError(
                f"next token batch has rows of {next_batch.shape[1]} tokens, the batch {batch.shape[1]}"
            )
        if m.HasField("local_steps"):
            if not m.HasField("next_local_steps"):
                raise ProtocolError("a local-SGD order's next_batch needs next_local_steps")
            next_local_steps = local_steps_from_proto(m.next_local_steps)
            if next_batch.shape[0] % next_local_steps.steps:
                raise ProtocolError(
                    f"next token batch of {next_batch.shape[0]} rows does not split into "
                    f"{next_local_steps.steps} equal inner steps"
                )
    if not 0.0 <= m.feedback_beta <= 1.0:
        raise ProtocolError(f"feedback_beta must be in [0, 1], got {m.feedback_beta}")
    if not 0.0 <= m.sync_tolerance < 1.0:
        raise ProtocolError(f"sync_tolerance must be in [0, 1), got {m.sync_tolerance}")
    if not (math.isfinite(m.clip_grad_norm) and m.clip_grad_norm >= 0):
        raise ProtocolError(f"clip_grad_norm must be finite and >= 0, got {m.clip_grad_norm}")
    if m.clip_grad_norm and m.HasField("local_steps"):
        raise ProtocolError("a local-SGD order clips its inner steps (local_steps.clip_grad_norm), not clip_grad_norm")
    try:
        codec = codec_serde.settings_from_proto(m.codec)
    except PayloadError as e:
        raise ProtocolError(f"work order codec settings: {e.reason}") from None
    local_steps = local_steps_from_proto(m.local_steps) if m.HasField("local_steps") else None
    if local_steps is not None and local_steps.eager_lr and not m.compute_before_update:
        raise ProtocolError("eager_lr guesses the update in flight: it comes only with compute_before_update")
    if local_steps is not None and batch.shape[0] % local_steps.steps:
        raise ProtocolError(
            f"token batch of {batch.shape[0]} rows does not split into {local_steps.steps} equal inner steps"
        )
    if len(m.catch_up) > MAX_CATCH_UP:
        raise ProtocolError(f"work order carries {len(m.catch_up)} catch-up updates, more than {MAX_CATCH_UP}")
    if m.stream_buckets > MAX_BUCKETS:
        raise ProtocolError(f"stream_buckets is at most {MAX_BUCKETS}, got {m.stream_buckets}")
    if m.stream_buckets and local_steps is not None:
        raise ProtocolError("a local-SGD order sends one pseudo-gradient at the end: stream_buckets must be 0")
    if m.peer_key and not PEER_KEY_BYTES[0] <= len(m.peer_key) <= PEER_KEY_BYTES[1]:
        raise ProtocolError(f"work order peer_key is {PEER_KEY_BYTES[0]}-{PEER_KEY_BYTES[1]} bytes")
    if m.fingerprint_every > MAX_FINGERPRINT_EVERY:
        raise ProtocolError(f"fingerprint_every is at most {MAX_FINGERPRINT_EVERY}, got {m.fingerprint_every}")
    relays = any(
        (u.HasField("replay") and u.replay.relayed) or u.HasField("delta_piece") for u in (m.update, *m.catch_up)
    )
    if not m.peer_key and (m.seed or relays):
        raise ProtocolError("work order relays payloads but carries no peer key to pull or serve them with")
    gossip = gossip_from_proto(m.gossip) if m.HasField("gossip") else None
    if gossip is not None and (
        local_steps is None or m.HasField("update") or m.catch_up or m.compute_before_update or m.stream_buckets
    ):
        raise ProtocolError(
            "a gossip order takes inner steps (local_steps) and carries no update, catch-up, overlap or stream"
        )
    return WorkOrder(
        m.run_id,
        m.round,
        m.base_version,
        batch,
        codec,
        fingerprint_from_proto(m.fingerprint),
        update_from_proto(m.update) if m.HasField("update") else None,
        m.feedback_beta,
        m.micro_batch_size,
        m.sync_tolerance,
        local_steps,
        m.protocol_version,
        tuple(update_from_proto(u) for u in m.catch_up),
        m.compute_before_update,
        next_batch,
        m.clip_grad_norm,
        m.fingerprint_gradient,
        next_local_steps,
        m.stream_buckets,
        gossip,
        m.peer_key,
        m.seed,
        max(1, m.fingerprint_every),
    )


OK = "ok"
NEEDS_STATE = "needs_state"  # no replica, or a suspect one: push the state
BEHIND = "behind"  # a sound replica at another version (``RoundResult.version``): catch up or push
UNREACHABLE = "unreachable"  # peer-to-peer gossip: neighbours' messages did not come (``unreachable_peers``)
_STATUS = {
    OK: pb.RoundResult.STATUS_OK,
    NEEDS_STATE: pb.RoundResult.STATUS_NEEDS_STATE,
    BEHIND: pb.RoundResult.STATUS_BEHIND,
    UNREACHABLE: pb.RoundResult.STATUS_UNREACHABLE,
}


@dataclasses.dataclass
class RoundResult:
    status: str
    round: int
    reason: str = ""
    gradient: CompressedGradient | None = None
    loss: float = float("nan")
    tokens: int = 0
    version: int = 0
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    node_bytes: int = 0
    grad_norm: float = 0.0  # the gradient's L2 norm before clipping (local-SGD rounds: its mean over the inner steps)
    gradient_fingerprint: Fingerprint | None = None  # what WorkOrder.fingerprint_gradient asked for
    gossip_residual: float = 0.0  # a gossip round: |x - x^_own|^2 after the worker's message
    gossip_sent: GossipSent | None = None  # a peer-to-peer gossip round: the message kept for the neighbours
    # UNREACHABLE: the neighbours whose messages did not come; OK, relayed: sources that failed before another served
    unreachable_peers: tuple[str, ...] = ()


def result_to_proto(r: RoundResult) -> pb.RoundResult:
    sent = r.gossip_sent
    return pb.RoundResult(
        status=_STATUS[r.status],
        reason=r.reason,
        round=r.round,
        gradient=codec_serde.gradient_to_proto(r.gradient) if r.gradient is not None else None,
        loss=r.loss,
        tokens=r.tokens,
        version=r.version,
        timings=pb.Timings(**{f"{k}_seconds": v for k, v in r.timings.items()}),
        node_bytes=r.node_bytes,
        grad_norm=r.grad_norm,
        gradient_fingerprint=fingerprint_to_proto(r.gradient_fingerprint) if r.gradient_fingerprint else None,
        gossip_residual=r.gossip_residual,
        gossip_digest=sent.digest if sent else b"",
        gossip_bytes=sent.nbytes if sent else 0,
        gossip_sketch=sent.sketch if sent else (),
        gossip_message_sketch=sent.message_sketch if sent else (),
        unreachable_peers=list(r.unreachable_peers),
    )


def piece_to_proto(round_: int, piece: CompressedGradient) -> pb.RoundResult:
    """One bucket of a streamed gradient (``WorkOrder.stream_buckets``), framed on its own before the result."""
    return pb.RoundResult(round=round_, gradient=codec_serde.gradient_to_proto(piece), piece=True)


def piece_from_proto(m: pb.RoundResult) -> CompressedGradient:
    """A piece's gradient; ``ProtocolError`` for a piece that carries more than a round and a gradient."""
    if not m.HasField("gradient") or m.status or m.HasField("timings") or m.tokens or m.reason:
        raise ProtocolError("a streamed piece carries its round and a gradient, nothing else")
    return codec_serde.gradient_from_proto(m.gradient)


def result_from_proto(m: pb.RoundResult) -> RoundResult:
    if m.piece:
        raise ProtocolError("a streamed piece where the round's result was expected")
    status = {v: k for k, v in _STATUS.items()}.get(m.status)
    if status is None:
        raise ProtocolError(f"unknown round status {m.status}")
    sent = (
        GossipSent(m.gossip_digest, m.gossip_bytes, tuple(m.gossip_sketch), tuple(m.gossip_message_sketch))
        if m.gossip_digest
        else None
    )
    if status == OK and not m.HasField("gradient") and sent is None:
        raise ProtocolError("an OK round result must carry a gradient (or, peer-to-peer, its message's digest)")
    # UNREACHABLE names the neighbours (or relay sources) that failed; an OK result of a relayed star round may
    # name the sources that failed before another served; no other result names any.
    relayed_ok = status == OK and sent is None
    if (status == UNREACHABLE) != bool(m.unreachable_peers) and not (relayed_ok and m.unreachable_peers):
        raise ProtocolError("an unreachable result names the peers that failed; only a relayed round's OK may too")
    if len(m.unreachable_peers) > MAX_NEIGHBOURS:
        raise ProtocolError(f"a result names at most {MAX_NEIGHBOURS} peers that failed")
    unreachable = tuple(_member(j) for j in m.unreachable_peers)
    timings = {f.name.removesuffix("_seconds"): v for f, v in m.timings.ListFields()}
    if not (math.isfinite(m.grad_norm) and m.grad_norm >= 0):
        raise ProtocolError(f"grad_norm must be finite and >= 0, got {m.grad_norm}")
    if not (math.isfinite(m.gossip_residual) and m.gossip_residual >= 0):
        raise ProtocolError(f"gossip_residual must be finite and >= 0, got {m.gossip_residual}")
    gradient = codec_serde.gradient_from_proto(m.gradient) if m.HasField("gradient") else None
    fingerprint = fingerprint_from_proto(m.gradient_fingerprint) if m.HasField("gradient_fingerprint") else None
    return RoundResult(
        status,
        m.round,
        m.reason,
        gradient,
        m.loss,
        m.tokens,
        m.version,
        timings,
        m.node_bytes,
        m.grad_norm,
        fingerprint,
        m.gossip_residual,
        sent,
        unreachable,
    )


@dataclasses.dataclass
class WorkerState:
    """What a worker's session keeps between rounds besides the replica (checkpoints save it)."""

    run_id: str
    version: int
    feedback: dict[str, torch.Tensor]
    inner_optimizer: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    gossip_model: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # gossip rounds: its own x


def worker_state_to_proto(w: WorkerState) -> pb.WorkerState:
    return pb.WorkerState(
        run_id=w.run_id,
        version=w.version,
        feedback=tensors_to_proto(w.feedback),
        inner_optimizer=tensors_to_proto(w.inner_optimizer),
        gossip_model=tensors_to_proto(w.gossip_model),
    )


def worker_state_from_proto(m: pb.WorkerState) -> WorkerState:
    return WorkerState(
        m.run_id,
        m.version,
        tensors_from_proto(m.feedback, "feedback"),
        tensors_from_proto(m.inner_optimizer, "inner_optimizer"),
        tensors_from_proto(m.gossip_model, "gossip_model"),
    )


def check_version(v: int) -> None:
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {v} is not this side's {PROTOCOL_VERSION}: upgrade the older of coordinator and worker"
        )
