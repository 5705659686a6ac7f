"""The coordinator's settings: one dataclass, from which the CLI is built and which checkpoints record.

Two modes share it. Gradient mode (``inner_steps`` 1) sends one compressed gradient per worker and step.
Local-SGD rounds (``inner_steps`` H > 1: DiLoCo / SparseLoCo) take H inner optimizer steps on each worker
and send one compressed pseudo-gradient per round. Settings whose good values depend on the mode (the
outer optimizer, its learning rate and momentum, the feedback decay, the quantization bins) default to
``None`` = "auto": ``__post_init__`` fills them from ``mode_defaults``, so ``--inner-steps 30`` alone
trains well and anything typed explicitly wins. (``dataclasses.replace`` on a config copies the filled
values; build a new one to get another mode's defaults.)
"""

from __future__ import annotations

import dataclasses
import math

from gradwire.compression import CodecConfig
from gradwire.compression.robust import AggregationRule
from gradwire.coordinator.decisions import REPLAY_PRECISIONS, Grace
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.optim.schedule import Schedule, lr_at

# --no-compression: every tensor dense, raw float32 - the codec's exact path, no special case elsewhere.
DENSE_CODEC = CodecConfig(min_sparse_numel=2**62, bins=0)

# The settings ``mode_defaults`` fills when their flag is not given.
AUTO_FIELDS = (
    "outer_optimizer",
    "learning_rate",
    "momentum",
    "feedback_beta",
    "bins",
    "target_chunk",
    "topk",
    "inner_momentum",
)


def mode_defaults(
    *,
    inner_steps: int,
    no_compression: bool,
    outer_optimizer: str | None,
    inner_optimizer: str,
    target_chunk: int | None = None,
) -> dict[str, object]:
    """The defaults of the mode-dependent settings, with the outer optimizer already chosen or not.

    Gradient mode keeps DeMo's recipe: sign-SGD at 1e-3 on gradients that error feedback (beta 0.999)
    accumulates, 8-bit values. Local-SGD rounds follow what the field measured (and benchmarks.quality
    confirmed here): compressed pseudo-gradients go through error feedback with beta 0.95 and 2-bit values
    (bins 4) and are applied by plain outer SGD at lr 1 (SparseLoCo); uncompressed ones by Nesterov SGD at
    lr 0.7, momentum 0.9 (DiLoCo). A local-SGD round can afford more coefficients: top-90 of 4096 (2.2%)
    trained best of 32/64/90 in benchmarks.quality and still sends 3000x less than DDP per token at H 30;
    past H 30 the top-k grows with H (3 H of 4096), which keeps the bytes per trained token where they are
    and trained better at every H tried (1200 steps: H 30 / top-90 +7.2% over dense, H 60 / 180 +6.6%,
    H 120 / 360 +5.9%, H 240 / 720 +6.2%).
    Both modes cut 64 x 64 chunks. ``topk`` follows the chunk edge (``target_chunk``) so the density stays
    the mode's: ``--target-chunk 16`` alone keeps top-2 of 256 in gradient mode, a quarter of the transform
    FLOPs; in benchmarks.quality it trained better at 600 steps but clearly worse at 1200, so 64 stays.
    """
    local = inner_steps > 1
    if outer_optimizer is None:
        outer_optimizer = ("nesterov" if no_compression else "sgd") if local else "signsgd"
    if local:
        learning_rate = {"sgd": 1.0, "nesterov": 0.7}.get(outer_optimizer, 1e-3)
    else:
        learning_rate = 1e-3
    chunk = target_chunk or 64
    density = min(max(90, 3 * inner_steps), 4096) / 4096 if local else 32 / 4096
    return {
        "outer_optimizer": outer_optimizer,
        "learning_rate": learning_rate,
        "momentum": 0.9 if outer_optimizer == "nesterov" else 0.0,
        "feedback_beta": 0.95 if local else 0.999,
        "bins": 4 if local else 256,
        "target_chunk": chunk,
        "topk": max(1, round(density * chunk * chunk)),
        "inner_momentum": 0.95 if inner_optimizer == "muon" else 0.0,
    }


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
    steps: int = 100  # outer steps (rounds)
    batch_size: int = 8  # sequences per worker per inner step
    sequence_length: int = 256
    micro_batch_size: int = 0  # rows per forward/backward on a worker; 0 = the whole batch
    # Outer optimizer (the coordinator's step); None = the mode's default (mode_defaults)
    outer_optimizer: str | None = None
    learning_rate: float | None = None
    momentum: float | None = None
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    lr_cycles: int = 1
    # Local-SGD rounds: H inner steps on every worker between syncs
    inner_steps: int = 1
    inner_optimizer: str = "adamw"
    inner_learning_rate: float = 1e-3
    inner_weight_decay: float = 0.0
    inner_beta1: float = 0.9
    inner_beta2: float = 0.95
    inner_momentum: float | None = None
    inner_nesterov: bool = False
    clip_grad_norm: float = 0.0  # on every inner step; 0 = no clipping
    inner_lr_schedule: str = "constant"
    inner_warmup_steps: int = 0
    inner_min_lr_ratio: float = 0.0
    inner_lr_cycles: int = 1
    # Codec
    topk: int | None = None
    target_chunk: int | None = None
    use_dct: bool = True
    bins: int | None = None
    values: str = "lut"  # lut: quantized through bins; sign: 1 bit per value and one scale per tensor
    no_compression: bool = False
    feedback_beta: float | None = None
    # Runs, checkpoints
    output_dir: str = "runs/gradwire"
    checkpoint_dir: str | None = None  # default: <output_dir>/checkpoints
    checkpoint_every: int = 100  # a checkpoint every N steps, and at the end; 0 = only at the end
    keep_checkpoints: int = 3  # keep the newest N checkpoints; 0 = keep all
    resume_from: str | None = None
    seed: int = 0
    # Rounds
    round_timeout: float = 600.0  # seconds; the deadline of every round RPC
    connect_timeout: float = 60.0
    sync_tolerance: float = 1e-4
    max_failed_rounds: int = 3  # consecutive rounds with no usable worker before giving up ...
    max_failed_seconds: float = (
        60.0  # ... once they also span this long (failed rounds back off, 0.5 s doubling to 30 s)
    )
    min_workers: int = 0  # quorum: once this many results are in, stragglers get --straggler-grace; 0 = wait for all
    straggler_grace: str = "1.0x"  # seconds ("10") or a factor of the quorum's median time ("1.5x")
    replay_window: int = 8  # updates kept for workers that missed rounds (catch-up by replay instead of a push)
    overlap: bool = False  # one-step-delayed rounds: compute round r before round r-1's update (hides the link)
    overwrite: bool = False  # replace the run already in output_dir (without it, a new run there is refused)
    # Robust aggregation (compression.robust) and benching (decisions.judge)
    aggregate: str = "mean"  # mean | trimmed-mean | median, in the coefficient domain
    replay_precision: str = "auto"  # auto | float32 | float64: how replays combine (decisions.replay_precision)
    clip_factor: float = 2.0  # each sender clipped to this x the round's median norm; 0 = off
    bench_after: int = 3  # bad rounds in a row (rejected, or clipped hard) before a worker is benched; 0 = never
    bench_rounds: int = 20  # rounds a benched worker sits out
    # Tracking
    wandb_project: str | None = None  # log to Weights & Biases (offline without an API key)
    wandb_run_name: str | None = None

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "sequence_length", "max_failed_rounds", "eval_batches", "inner_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in (
            "micro_batch_size",
            "warmup_steps",
            "checkpoint_every",
            "eval_every",
            "keep_checkpoints",
            "inner_warmup_steps",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.target_chunk is not None and self.target_chunk < 1:
            raise ValueError(f"--target-chunk must be >= 1, got {self.target_chunk}")
        defaults = mode_defaults(
            inner_steps=self.inner_steps,
            no_compression=self.no_compression,
            outer_optimizer=self.outer_optimizer,
            inner_optimizer=self.inner_optimizer,
            target_chunk=self.target_chunk,
        )
        for name in AUTO_FIELDS:
            if getattr(self, name) is None:
                setattr(self, name, defaults[name])
        if self.topk < 1:
            raise ValueError(f"--topk must be >= 1, got {self.topk}")
        for name in ("learning_rate", "inner_learning_rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not 0 <= self.feedback_beta <= 1:
            raise ValueError(f"--feedback-beta must be in [0, 1], got {self.feedback_beta}")
        if not (math.isfinite(self.clip_grad_norm) and self.clip_grad_norm >= 0):
            raise ValueError(f"--clip-grad-norm must be >= 0 (0: no clipping), got {self.clip_grad_norm}")
        if not 0 <= self.sync_tolerance < 1:
            raise ValueError(f"--sync-tolerance must be in [0, 1), got {self.sync_tolerance}")
        if not (math.isfinite(self.clip_factor) and (self.clip_factor == 0 or self.clip_factor >= 1)):
            raise ValueError(f"--clip-factor must be 0 (off) or >= 1, got {self.clip_factor}")
        for name in ("bench_after", "bench_rounds", "replay_window", "min_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        self.aggregation_rule()  # validates --aggregate
        if self.replay_precision not in REPLAY_PRECISIONS:
            raise ValueError(
                f"--replay-precision must be one of {', '.join(REPLAY_PRECISIONS)}, got {self.replay_precision!r}"
            )
        self.grace()  # validates --straggler-grace
        if not (math.isfinite(self.max_failed_seconds) and self.max_failed_seconds >= 0):
            raise ValueError(f"--max-failed-seconds must be >= 0, got {self.max_failed_seconds}")
        if self.round_timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError("--round-timeout and --connect-timeout must be positive")
        self.data = tuple(self.data)
        self.update_rule()  # UpdateRule validates --outer-optimizer, --weight-decay, --momentum
        self.codec_config()  # CodecConfig validates --topk, --target-chunk, --bins, --values
        self.inner_optimizer_config()  # validates the --inner-* optimizer flags
        self.outer_schedule()
        self.inner_schedule()

    @property
    def local_sgd(self) -> bool:
        """Local-SGD rounds (H > 1 inner steps between syncs) rather than one gradient per step."""
        return self.inner_steps > 1

    def codec_config(self) -> CodecConfig:
        if self.no_compression:
            return DENSE_CODEC
        try:
            return CodecConfig(
                chunk=self.target_chunk, topk=self.topk, use_dct=self.use_dct, bins=self.bins, values=self.values
            )
        except ValueError as e:
            raise ValueError(f"codec flags (--topk, --target-chunk, --bins, --values): {e}") from None

    def grace(self) -> Grace:
        return Grace.parse(self.straggler_grace)

    def aggregation_rule(self, exact: bool = False) -> AggregationRule:
        return AggregationRule(mode=self.aggregate, exact=exact)

    def update_rule(self) -> UpdateRule:
        return UpdateRule(optimizer=self.outer_optimizer, weight_decay=self.weight_decay, momentum=self.momentum)  # type: ignore[arg-type]

    def inner_optimizer_config(self) -> InnerOptimizerConfig:
        return InnerOptimizerConfig(
            name=self.inner_optimizer,
            weight_decay=self.inner_weight_decay,
            betas=(self.inner_beta1, self.inner_beta2),
            momentum=self.inner_momentum,
            nesterov=self.inner_nesterov,
        )

    def outer_schedule(self) -> Schedule:
        return Schedule(
            kind=self.lr_schedule,
            warmup=self.warmup_steps,
            total=self.steps,
            min_ratio=self.min_lr_ratio,
            cycles=self.lr_cycles,
        )

    def inner_schedule(self) -> Schedule:
        # Inner steps are counted across rounds: round r's step h is inner step r * H + h.
        return Schedule(
            kind=self.inner_lr_schedule,
            warmup=self.inner_warmup_steps,
            total=self.steps * self.inner_steps,
            min_ratio=self.inner_min_lr_ratio,
            cycles=self.inner_lr_cycles,
            flag_prefix="inner-",
        )

    def lr_at(self, step: int) -> float:
        """The outer learning rate of round ``step`` (0-based)."""
        return lr_at(self.learning_rate, self.outer_schedule(), step)

    def inner_lrs(self, step: int) -> tuple[float, ...]:
        """The inner learning rate of each of round ``step``'s H inner steps."""
        schedule, h = self.inner_schedule(), self.inner_steps
        return tuple(lr_at(self.inner_learning_rate, schedule, step * h + i) for i in range(h))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["data"] = list(self.data)
        return d
