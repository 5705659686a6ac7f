from gradwire.v1 import codec_pb2 as _codec_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_UINT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_INT32: DType
DTYPE_UINT16: DType
DTYPE_INT64: DType
DTYPE_UINT8: DType

class PullPieceRequest(_message.Message):
    __slots__ = ("run_id", "peer_key", "digest")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_KEY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peer_key: bytes
    digest: bytes
    def __init__(self, run_id: _Optional[str] = ..., peer_key: _Optional[bytes] = ..., digest: _Optional[bytes] = ...) -> None: ...

class PieceRef(_message.Message):
    __slots__ = ("position", "digest", "size", "sources")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    position: int
    digest: bytes
    size: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, position: _Optional[int] = ..., digest: _Optional[bytes] = ..., size: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class PullGossipRequest(_message.Message):
    __slots__ = ("run_id", "peer_key", "round", "copy", "with_last", "last")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_KEY_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    WITH_LAST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peer_key: bytes
    round: int
    copy: bool
    with_last: bool
    last: int
    def __init__(self, run_id: _Optional[str] = ..., peer_key: _Optional[bytes] = ..., round: _Optional[int] = ..., copy: _Optional[bool] = ..., with_last: _Optional[bool] = ..., last: _Optional[int] = ...) -> None: ...

class GossipPiece(_message.Message):
    __slots__ = ("member", "round", "message", "copy")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    member: str
    round: int
    message: _codec_pb2.CompressedGradient
    copy: PublicCopy
    def __init__(self, member: _Optional[str] = ..., round: _Optional[int] = ..., message: _Optional[_Union[_codec_pb2.CompressedGradient, _Mapping]] = ..., copy: _Optional[_Union[PublicCopy, _Mapping]] = ...) -> None: ...

class CloseRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CloseRunReply(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class FetchWorkerStateRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("run_id", "version", "feedback", "inner_optimizer", "gossip_model")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    INNER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_MODEL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    feedback: _containers.RepeatedCompositeFieldContainer[Tensor]
    inner_optimizer: _containers.RepeatedCompositeFieldContainer[Tensor]
    gossip_model: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., feedback: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., inner_optimizer: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., gossip_model: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("data", "last", "total_bytes", "sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    last: bool
    total_bytes: int
    sha256: bytes
    def __init__(self, data: _Optional[bytes] = ..., last: _Optional[bool] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("protocol_version", "gradwire_version", "torch_version", "device", "device_name", "local_devices", "replicas", "ranks", "rank_devices", "node_mode", "precision")
    class ReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    GRADWIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DEVICES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RANK_DEVICES_FIELD_NUMBER: _ClassVar[int]
    NODE_MODE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    gradwire_version: str
    torch_version: str
    device: str
    device_name: str
    local_devices: int
    replicas: _containers.ScalarMap[str, int]
    ranks: int
    rank_devices: _containers.RepeatedScalarFieldContainer[str]
    node_mode: str
    precision: str
    def __init__(self, protocol_version: _Optional[int] = ..., gradwire_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., device: _Optional[str] = ..., device_name: _Optional[str] = ..., local_devices: _Optional[int] = ..., replicas: _Optional[_Mapping[str, int]] = ..., ranks: _Optional[int] = ..., rank_devices: _Optional[_Iterable[str]] = ..., node_mode: _Optional[str] = ..., precision: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    data: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ModelState(_message.Message):
    __slots__ = ("protocol_version", "run_id", "version", "model_json", "parameters", "update_rule_json", "optimizer_state", "feedback", "inner_optimizer", "own_payload", "own_round", "gossip_model", "gossip")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_JSON_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RULE_JSON_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    INNER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OWN_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    OWN_ROUND_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_MODEL_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    version: int
    model_json: str
    parameters: _containers.RepeatedCompositeFieldContainer[Tensor]
    update_rule_json: str
    optimizer_state: _containers.RepeatedCompositeFieldContainer[Tensor]
    feedback: _containers.RepeatedCompositeFieldContainer[Tensor]
    inner_optimizer: _containers.RepeatedCompositeFieldContainer[Tensor]
    own_payload: _codec_pb2.CompressedGradient
    own_round: int
    gossip_model: _containers.RepeatedCompositeFieldContainer[Tensor]
    gossip: bool
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., version: _Optional[int] = ..., model_json: _Optional[str] = ..., parameters: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., update_rule_json: _Optional[str] = ..., optimizer_state: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., feedback: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., inner_optimizer: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., own_payload: _Optional[_Union[_codec_pb2.CompressedGradient, _Mapping]] = ..., own_round: _Optional[int] = ..., gossip_model: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., gossip: _Optional[bool] = ...) -> None: ...

class PushStateReply(_message.Message):
    __slots__ = ("version", "fingerprint")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    version: int
    fingerprint: Fingerprint
    def __init__(self, version: _Optional[int] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("sums", "sumsqs", "samples")
    SUMS_FIELD_NUMBER: _ClassVar[int]
    SUMSQS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    sums: _containers.RepeatedScalarFieldContainer[float]
    sumsqs: _containers.RepeatedScalarFieldContainer[float]
    samples: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sums: _Optional[_Iterable[float]] = ..., sumsqs: _Optional[_Iterable[float]] = ..., samples: _Optional[_Iterable[float]] = ...) -> None: ...

class StateUpdate(_message.Message):
    __slots__ = ("replay", "delta", "delta_piece", "learning_rate")
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTA_PIECE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    replay: Replay
    delta: _codec_pb2.CompressedGradient
    delta_piece: PieceRef
    learning_rate: float
    def __init__(self, replay: _Optional[_Union[Replay, _Mapping]] = ..., delta: _Optional[_Union[_codec_pb2.CompressedGradient, _Mapping]] = ..., delta_piece: _Optional[_Union[PieceRef, _Mapping]] = ..., learning_rate: _Optional[float] = ...) -> None: ...

class Replay(_message.Message):
    __slots__ = ("payloads", "weights", "scales", "aggregation", "trim", "exact", "own_position", "own_round", "fragment", "fragments", "relayed")
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    TRIM_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    OWN_POSITION_FIELD_NUMBER: _ClassVar[int]
    OWN_ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    payloads: _containers.RepeatedCompositeFieldContainer[_codec_pb2.CompressedGradient]
    weights: _containers.RepeatedScalarFieldContainer[float]
    scales: _containers.RepeatedScalarFieldContainer[float]
    aggregation: str
    trim: float
    exact: bool
    own_position: int
    own_round: int
    fragment: int
    fragments: int
    relayed: _containers.RepeatedCompositeFieldContainer[PieceRef]
    def __init__(self, payloads: _Optional[_Iterable[_Union[_codec_pb2.CompressedGradient, _Mapping]]] = ..., weights: _Optional[_Iterable[float]] = ..., scales: _Optional[_Iterable[float]] = ..., aggregation: _Optional[str] = ..., trim: _Optional[float] = ..., exact: _Optional[bool] = ..., own_position: _Optional[int] = ..., own_round: _Optional[int] = ..., fragment: _Optional[int] = ..., fragments: _Optional[int] = ..., relayed: _Optional[_Iterable[_Union[PieceRef, _Mapping]]] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("rows", "columns", "dtype", "data")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rows: int
    columns: int
    dtype: DType
    data: bytes
    def __init__(self, rows: _Optional[int] = ..., columns: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WorkOrder(_message.Message):
    __slots__ = ("protocol_version", "run_id", "round", "base_version", "update", "fingerprint", "batch", "codec", "feedback_beta", "micro_batch_size", "sync_tolerance", "local_steps", "catch_up", "compute_before_update", "next_batch", "clip_grad_norm", "fingerprint_gradient", "next_local_steps", "stream_buckets", "gossip", "peer_key", "seed", "fingerprint_every")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_BETA_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SYNC_TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_BEFORE_UPDATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_BATCH_FIELD_NUMBER: _ClassVar[int]
    CLIP_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    NEXT_LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    STREAM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_FIELD_NUMBER: _ClassVar[int]
    PEER_KEY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    round: int
    base_version: int
    update: StateUpdate
    fingerprint: Fingerprint
    batch: TokenBatch
    codec: _codec_pb2.CodecSettings
    feedback_beta: float
    micro_batch_size: int
    sync_tolerance: float
    local_steps: LocalSteps
    catch_up: _containers.RepeatedCompositeFieldContainer[StateUpdate]
    compute_before_update: bool
    next_batch: TokenBatch
    clip_grad_norm: float
    fingerprint_gradient: bool
    next_local_steps: LocalSteps
    stream_buckets: int
    gossip: GossipLinks
    peer_key: bytes
    seed: bool
    fingerprint_every: int
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., base_version: _Optional[int] = ..., update: _Optional[_Union[StateUpdate, _Mapping]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., batch: _Optional[_Union[TokenBatch, _Mapping]] = ..., codec: _Optional[_Union[_codec_pb2.CodecSettings, _Mapping]] = ..., feedback_beta: _Optional[float] = ..., micro_batch_size: _Optional[int] = ..., sync_tolerance: _Optional[float] = ..., local_steps: _Optional[_Union[LocalSteps, _Mapping]] = ..., catch_up: _Optional[_Iterable[_Union[StateUpdate, _Mapping]]] = ..., compute_before_update: _Optional[bool] = ..., next_batch: _Optional[_Union[TokenBatch, _Mapping]] = ..., clip_grad_norm: _Optional[float] = ..., fingerprint_gradient: _Optional[bool] = ..., next_local_steps: _Optional[_Union[LocalSteps, _Mapping]] = ..., stream_buckets: _Optional[int] = ..., gossip: _Optional[_Union[GossipLinks, _Mapping]] = ..., peer_key: _Optional[bytes] = ..., seed: _Optional[bool] = ..., fingerprint_every: _Optional[int] = ...) -> None: ...

class GossipLinks(_message.Message):
    __slots__ = ("member", "neighbours", "gamma", "own_accepted", "relays", "fresh", "drop", "peer_key", "pulls", "own_round", "upload")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    OWN_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    PEER_KEY_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    OWN_ROUND_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    member: str
    neighbours: _containers.RepeatedCompositeFieldContainer[GossipNeighbour]
    gamma: float
    own_accepted: bool
    relays: _containers.RepeatedCompositeFieldContainer[GossipRelay]
    fresh: _containers.RepeatedCompositeFieldContainer[PublicCopy]
    drop: _containers.RepeatedScalarFieldContainer[str]
    peer_key: bytes
    pulls: _containers.RepeatedCompositeFieldContainer[GossipPull]
    own_round: int
    upload: bool
    def __init__(self, member: _Optional[str] = ..., neighbours: _Optional[_Iterable[_Union[GossipNeighbour, _Mapping]]] = ..., gamma: _Optional[float] = ..., own_accepted: _Optional[bool] = ..., relays: _Optional[_Iterable[_Union[GossipRelay, _Mapping]]] = ..., fresh: _Optional[_Iterable[_Union[PublicCopy, _Mapping]]] = ..., drop: _Optional[_Iterable[str]] = ..., peer_key: _Optional[bytes] = ..., pulls: _Optional[_Iterable[_Union[GossipPull, _Mapping]]] = ..., own_round: _Optional[int] = ..., upload: _Optional[bool] = ...) -> None: ...

class GossipPull(_message.Message):
    __slots__ = ("member", "address", "round", "digest")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    member: str
    address: str
    round: int
    digest: bytes
    def __init__(self, member: _Optional[str] = ..., address: _Optional[str] = ..., round: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class GossipNeighbour(_message.Message):
    __slots__ = ("member", "weight")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    member: str
    weight: float
    def __init__(self, member: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class GossipRelay(_message.Message):
    __slots__ = ("member", "message")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    member: str
    message: _codec_pb2.CompressedGradient
    def __init__(self, member: _Optional[str] = ..., message: _Optional[_Union[_codec_pb2.CompressedGradient, _Mapping]] = ...) -> None: ...

class PublicCopy(_message.Message):
    __slots__ = ("member", "tensors", "start")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    member: str
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    start: bool
    def __init__(self, member: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., start: _Optional[bool] = ...) -> None: ...

class LocalSteps(_message.Message):
    __slots__ = ("steps", "optimizer", "learning_rates", "clip_grad_norm", "fragment", "fragments", "eager_lr")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATES_FIELD_NUMBER: _ClassVar[int]
    CLIP_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    EAGER_LR_FIELD_NUMBER: _ClassVar[int]
    steps: int
    optimizer: InnerOptimizer
    learning_rates: _containers.RepeatedScalarFieldContainer[float]
    clip_grad_norm: float
    fragment: int
    fragments: int
    eager_lr: float
    def __init__(self, steps: _Optional[int] = ..., optimizer: _Optional[_Union[InnerOptimizer, _Mapping]] = ..., learning_rates: _Optional[_Iterable[float]] = ..., clip_grad_norm: _Optional[float] = ..., fragment: _Optional[int] = ..., fragments: _Optional[int] = ..., eager_lr: _Optional[float] = ...) -> None: ...

class InnerOptimizer(_message.Message):
    __slots__ = ("name", "weight_decay", "beta1", "beta2", "eps", "momentum", "nesterov", "ns_steps", "msgn", "lr_scales")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    NS_STEPS_FIELD_NUMBER: _ClassVar[int]
    MSGN_FIELD_NUMBER: _ClassVar[int]
    LR_SCALES_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    momentum: float
    nesterov: bool
    ns_steps: int
    msgn: str
    lr_scales: _containers.RepeatedCompositeFieldContainer[LrScale]
    def __init__(self, name: _Optional[str] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., ns_steps: _Optional[int] = ..., msgn: _Optional[str] = ..., lr_scales: _Optional[_Iterable[_Union[LrScale, _Mapping]]] = ...) -> None: ...

class LrScale(_message.Message):
    __slots__ = ("name", "factor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    factor: float
    def __init__(self, name: _Optional[str] = ..., factor: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("update_seconds", "compute_seconds", "compress_seconds", "total_seconds", "wait_seconds", "wall_seconds")
    UPDATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    update_seconds: float
    compute_seconds: float
    compress_seconds: float
    total_seconds: float
    wait_seconds: float
    wall_seconds: float
    def __init__(self, update_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., compress_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., wall_seconds: _Optional[float] = ...) -> None: ...

class RoundResult(_message.Message):
    __slots__ = ("status", "reason", "round", "gradient", "loss", "tokens", "timings", "version", "node_bytes", "grad_norm", "gradient_fingerprint", "piece", "gossip_residual", "gossip_digest", "gossip_bytes", "gossip_sketch", "gossip_message_sketch", "unreachable_peers")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[RoundResult.Status]
        STATUS_OK: _ClassVar[RoundResult.Status]
        STATUS_NEEDS_STATE: _ClassVar[RoundResult.Status]
        STATUS_BEHIND: _ClassVar[RoundResult.Status]
        STATUS_UNREACHABLE: _ClassVar[RoundResult.Status]
    STATUS_UNSPECIFIED: RoundResult.Status
    STATUS_OK: RoundResult.Status
    STATUS_NEEDS_STATE: RoundResult.Status
    STATUS_BEHIND: RoundResult.Status
    STATUS_UNREACHABLE: RoundResult.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_BYTES_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_SKETCH_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_MESSAGE_SKETCH_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_PEERS_FIELD_NUMBER: _ClassVar[int]
    status: RoundResult.Status
    reason: str
    round: int
    gradient: _codec_pb2.CompressedGradient
    loss: float
    tokens: int
    timings: Timings
    version: int
    node_bytes: int
    grad_norm: float
    gradient_fingerprint: Fingerprint
    piece: bool
    gossip_residual: float
    gossip_digest: bytes
    gossip_bytes: int
    gossip_sketch: _containers.RepeatedScalarFieldContainer[float]
    gossip_message_sketch: _containers.RepeatedScalarFieldContainer[float]
    unreachable_peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[RoundResult.Status, str]] = ..., reason: _Optional[str] = ..., round: _Optional[int] = ..., gradient: _Optional[_Union[_codec_pb2.CompressedGradient, _Mapping]] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., version: _Optional[int] = ..., node_bytes: _Optional[int] = ..., grad_norm: _Optional[float] = ..., gradient_fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., piece: _Optional[bool] = ..., gossip_residual: _Optional[float] = ..., gossip_digest: _Optional[bytes] = ..., gossip_bytes: _Optional[int] = ..., gossip_sketch: _Optional[_Iterable[float]] = ..., gossip_message_sketch: _Optional[_Iterable[float]] = ..., unreachable_peers: _Optional[_Iterable[str]] = ...) -> None: ...
