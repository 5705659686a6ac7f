"""The coordinator's settings: one dataclass, from which the CLI is built and which checkpoints record."""

from __future__ import annotations

import dataclasses
import math

from gradwire.compression import CodecConfig
from gradwire.replica import UpdateRule

# --no-compression: every tensor dense, raw float32 - the codec's exact path, no special case elsewhere.
DENSE_CODEC = CodecConfig(min_sparse_numel=2**62, bins=0)


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """What to train, on what, and how rounds run. Field names match the ``coordinator train`` flags."""

    model: str = "gpt-10m"  # a built-in name, a Hugging Face hub id, or a local model directory
    from_scratch: bool = False  # HF models: fresh weights from the config instead of the pretrained ones
    tokenizer: str | None = None  # default: the model's own
    data: tuple[str, ...] = ()  # files, directories or a hub dataset; empty = the embedded Shakespeare corpus
    data_config: str | None = None  # a hub dataset's configuration, e.g. wikitext-103-raw-v1
    text_field: str = "text"  # the column holding the text in jsonl/json/csv/parquet/hub data
    streaming: bool = False  # read the data as a stream (corpora larger than memory)
    eval_every: int = 0  # held-out loss every N steps (0: never)
    eval_batches: int = 4
    steps: int = 100
    batch_size: int = 8  # sequences per worker per round
    sequence_length: int = 256
    micro_batch_size: int = 0  # rows per forward/backward on a worker; 0 = the whole batch
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    outer_optimizer: str = "signsgd"
    weight_decay: float = 0.0
    momentum: float = 0.0
    # Codec
    topk: int = 32
    target_chunk: int = 64
    use_dct: bool = True
    bins: int = 256
    no_compression: bool = False
    feedback_beta: float = 0.999
    # Runs, checkpoints
    output_dir: str = "runs/gradwire"
    checkpoint_dir: str | None = None  # default: <output_dir>/checkpoints
    checkpoint_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 0  # keep the newest N checkpoints; 0 = keep all
    resume_from: str | None = None
    seed: int = 0
    # Rounds
    round_timeout: float = 600.0  # seconds; the deadline of every round RPC
    connect_timeout: float = 60.0
    sync_tolerance: float = 1e-4
    max_failed_rounds: int = 3  # consecutive rounds with no usable worker before giving up
    # Tracking
    wandb_project: str | None = None  # log to Weights & Biases (offline without an API key)
    wandb_run_name: str | None = None

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "sequence_length", "topk", "target_chunk", "max_failed_rounds", "eval_batches")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("micro_batch_size", "warmup_steps", "checkpoint_every", "eval_every", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"--learning-rate must be positive, got {self.learning_rate}")
        if not 0 <= self.feedback_beta <= 1:
            raise ValueError(f"--feedback-beta must be in [0, 1], got {self.feedback_beta}")
        if not 0 <= self.sync_tolerance < 1:
            raise ValueError(f"--sync-tolerance must be in [0, 1), got {self.sync_tolerance}")
        if self.round_timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError("--round-timeout and --connect-timeout must be positive")
        self.data = tuple(self.data)
        self.update_rule()  # UpdateRule validates --outer-optimizer, --weight-decay, --momentum
        self.codec_config()  # CodecConfig validates --topk, --target-chunk, --bins

    def codec_config(self) -> CodecConfig:
        if self.no_compression:
            return DENSE_CODEC
        try:
            return CodecConfig(chunk=self.target_chunk, topk=self.topk, use_dct=self.use_dct, bins=self.bins)
        except ValueError as e:
            raise ValueError(f"codec flags (--topk, --target-chunk, --bins): {e}") from None

    def update_rule(self) -> UpdateRule:
        return UpdateRule(optimizer=self.outer_optimizer, weight_decay=self.weight_decay, momentum=self.momentum)  # type: ignore[arg-type]

    def lr_at(self, step: int) -> float:
        """Linear warmup over ``warmup_steps``, then constant."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        return self.learning_rate

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["data"] = list(self.data)
        return d
