"""The coordinator's settings: one dataclass, from which the CLI is built and which checkpoints record.

Every field is a setting: its name is the ``coordinator train`` flag without dashes and the ``--config``
YAML key; its metadata (``setting``) holds its help text, its section of ``--help`` and its choices, from
which ``coordinator.cli`` generates the flag - a setting is added here and nowhere else.

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
import re
from collections.abc import Sequence
from typing import Any

from gradwire.compression import CodecConfig
from gradwire.compression.config import INDEX_CODINGS, MAX_RANK, VALUE_CODINGS
from gradwire.compression.fragment import MAX_FRAGMENTS
from gradwire.compression.packing import ef_topk_in_bits_of
from gradwire.compression.robust import AGGREGATIONS, AggregationRule
from gradwire.compression.schedule import TopkWarmup
from gradwire.compression.stream import MAX_BUCKETS
from gradwire.coordinator.balance import BALANCE_MODES
from gradwire.coordinator.decisions import (
    AGREEMENT_FLOOR,
    DOWNLINK_TOPK_FACTOR,
    DOWNLINKS,
    REPLAY_PRECISIONS,
    SPOT_CHECK_METHODS,
    SPOT_TOLERANCE,
    Grace,
)
from gradwire.fingerprint import MAX_FINGERPRINT_EVERY
from gradwire.gossip.topology import TOPOLOGIES
from gradwire.models import model_names
from gradwire.optim.demuon import MSGN
from gradwire.optim.inner import INNER_OPTIMIZERS, InnerOptimizerConfig
from gradwire.optim.lr_scales import MAX_LR_SCALE
from gradwire.optim.outer import OUTER_OPTIMIZERS, UpdateRule
from gradwire.optim.schedule import SCHEDULES, Schedule, lr_at

OVERLAP_UPDATES = ("auto", "eager", "delayed")
RELAYS = ("direct", "peers", "auto")
MAX_RELAY_FANOUT = 64  # --relay: how workers get a replayed update's payloads (coordinator.relay)

# --no-compression: every tensor dense, raw float32 - the codec's exact path, no special case elsewhere.
DENSE_CODEC = CodecConfig(min_sparse_numel=2**62, bins=0)

# --rank's word for "each matrix at the rank that fits its top-k's bytes" (CodecConfig.rank_fits_topk).
FIT = "fit"
# The top-k whose bytes fitted factors fill, as a fraction of the mode's top-k (mode_defaults).
FIT_DENSITY = 0.62
# Gradient mode's top-k of a 64 x 64 chunk in 12-bit indices at its 4-bit values (mode_defaults): 464 bits a
# chunk, which Elias-Fano indices fill with top-36.
GRADIENT_TOPK = 29

# Gradient mode's top-k warm-up (``compression.schedule``): its first steps send this multiple of the top-k.
TOPK_WARMUP_STEPS = 20
TOPK_WARMUP_FACTOR = 6.0
# Gradient mode's sign step moves the token embedding at twice the learning rate (mode_defaults).
EMBEDDING_LR_SCALE = 2.0
# So does the workers' inner AdamW in local-SGD rounds (mode_defaults).
INNER_EMBEDDING_LR_SCALE = 2.0

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
    "index_coding",
    "rank",
    "factor_bits",
    "topk_warmup_steps",
    "aggregate",
    "embedding_lr_scale",
    "inner_embedding_lr_scale",
)

# Settings whose flag also takes ``auto`` but that are filled later, by the check of the mode they belong to.
AUTO_LATER = ("gossip_gamma",)  # _check_gossip
# Every setting whose flag and YAML key take ``auto`` (None: the mode's default).
AUTO_SETTINGS = (*AUTO_FIELDS, *AUTO_LATER)

# The sections of the settings, in the order of ``--help``: title -> what the section holds.
MODEL_AND_DATA = "model and data"
OUTER = "outer optimizer"
INNER = "inner steps"
CODEC = "codec"
ROUND_POLICY = "round policy"
RUN = "run directory"
TRACKING = "tracking"
SECTIONS: dict[str, str] = {
    MODEL_AND_DATA: "What to train, on what text, for how long.",
    OUTER: "The coordinator's step with the workers' aggregated contributions.",
    INNER: "Local-SGD rounds: optimizer steps every worker takes between syncs (--inner-steps > 1).",
    CODEC: "How the workers' gradients or pseudo-gradients are compressed: DCT, top-k, quantized values.",
    ROUND_POLICY: "Deadlines, quorum and stragglers, replays, and what to do with workers that send bad results.",
    RUN: "Where outputs and checkpoints go, resuming, seeding, progress.",
    TRACKING: "Weights & Biases.",
}


def setting(
    default: Any,
    *,
    help: str,
    section: str,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    negative: tuple[str, str] | None = None,
) -> Any:
    """A ``TrainConfig`` field with what its flag needs in its metadata.

    ``help`` is its ``--help`` text (the default is appended there); ``section`` one of ``SECTIONS``;
    ``choices`` the values its flag and YAML key accept (plus ``auto`` for ``AUTO_FIELDS``); ``metavar``
    the name of its value in ``--help``; ``negative`` a boolean's ``(flag, help)`` that sets it false.
    A tuple default makes a flag taking one or more values.
    """
    if section not in SECTIONS:
        raise ValueError(f"unknown settings section {section!r}; one of {', '.join(SECTIONS)}")
    metadata: dict[str, Any] = {"help": help, "section": section}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if metavar is not None:
        metadata["metavar"] = metavar
    if negative is not None:
        metadata["negative"] = negative
    return dataclasses.field(default=default, metadata=metadata)


def mode_defaults(
    *,
    inner_steps: int,
    no_compression: bool,
    outer_optimizer: str | None,
    inner_optimizer: str,
    target_chunk: int | None = None,
    gossip: bool = False,
    index_coding: str | None = None,
    top_k_given: bool = False,
    rank: str | int | None = None,
) -> dict[str, object]:
    """The defaults of the mode-dependent settings, with the outer optimizer already chosen or not.

    Gradient mode keeps DeMo's recipe, sign-SGD at 1e-3 on gradients that error feedback (beta 0.999)
    accumulates, in fewer bytes: Elias-Fano indices and 4-bit values (bins 16), top-36 of 4096, 272x fewer
    bytes per token than dense against DeMo's 12-bit indices and 8-bit values at top-32 (182x). In
    benchmarks.quality (gpt-5m, 300 steps) it ended lower at both learning rates tried (1e-3: 5.6045 against
    5.6630; 1.5e-3: 5.5869 against 5.6157); 2-bit values (5.9473) or signs (5.9957) at as many bytes trained
    far worse: the sign step needs the senders' magnitudes to sum them. At 1,200 steps it ended 0.84% below dense
    AdamW over two seeds (DeMo's settings 0.20% below). Its first 20 steps (``topk_warmup_steps``, at most a
    tenth of the run) send 6x the top-k and the rest fewer, the run's bytes the same (``compression.schedule``):
    at 300 steps (two seeds) that ended +0.75% over dense against +2.23% with the top-k every step. Its
    aggregate averages each kept coefficient over the workers that sent it (``aggregate`` kept-mean, templar's
    rule): at 300 steps over four seeds +0.37% over dense against the mean's +0.61%, lower or level at every
    seed (+0.27% since it sums on the sparse path, the same aggregate to rounding; +0.56% over six seeds);
    local-SGD rounds keep the mean, which their codec gap preferred. Its sign step moves the token embedding (and
    so a tied output layer) at twice the rate (``embedding_lr_scale``): at 300 steps over eight seeds that ended
    0.92% below dense against 0.92% above at one rate, lower at seven seeds of eight; a slower embedding fell
    furthest behind dense in the first 30 steps, where the runs that ended worst had lost their ground.
    Local-SGD rounds' inner AdamW moves the token embedding at twice the rate as well
    (``inner_embedding_lr_scale``): at 1,200 steps, H 240, it ended +1.79% over dense over five seeds against
    +2.41% at one rate, lower at every seed, and level at 300 steps, H 60 (+1.87% against +1.79% over six seeds,
    paired +0.004 in held-out loss, standard error 0.009). Other inner optimizers and gossip rounds keep one rate
    (unmeasured).
    Local-SGD rounds follow what the field measured (and benchmarks.quality confirmed here): compressed
    pseudo-gradients go through error feedback with beta 0.95 and 2-bit values (bins 4) and are applied by plain
    outer SGD at lr 1 (SparseLoCo); uncompressed ones by Nesterov SGD at lr 0.7, momentum 0.9 (DiLoCo). A local-SGD
    round can afford more coefficients: top-90 of 4096 (2.2%) trained best of 32/64/90 in benchmarks.quality and
    still sends 3000x less than DDP per token at H 30; past H 30 the top-k grows with H (3 H of 4096), which keeps
    the bytes per trained token where they are and trained better at every H tried (1200 steps: H 30 / top-90 +7.2%
    over dense, H 60 / 180 +6.6%, H 120 / 360 +5.9%, H 240 / 720 +6.2%).
    Both modes cut 64 x 64 chunks. ``topk`` follows the chunk edge (``target_chunk``) so the density stays
    the mode's: ``--target-chunk 16`` alone keeps top-2 of 256 in gradient mode, a quarter of the transform
    FLOPs; in benchmarks.quality it trained better at 600 steps but clearly worse at 1200, so 64 stays.
    Gossip rounds (``gossip``) send model differences that must keep up with the models: top-512 of 4096
    with 16 levels. On a ring of 4 gpt-tiny workers (DeMuon, H 3) a worker's residual ``|x - x^|^2`` levelled
    off by round 12 with it, and grew without end over 40 rounds with local SGD's top-90 and 4 levels.
    With ``index_coding`` elias-fano the top-k is the most that costs a chunk the bits of that top-k in
    12-bit indices (``packing.ef_topk_in_bits_of``: 90 -> 143 at 2-bit values): more values, the same bytes.
    Every mode takes it by default. Gossip rounds (512 -> 1024 of 4096): at 8 workers in
    benchmarks.quality the complete graph ended 0.17% above the centralized round with it against 0.51% with
    12-bit indices, at the same bytes. Local-SGD rounds (90 -> 143 at H 30): the codec gap fell from 3.22 to
    2.57 points. Gradient mode (29 -> 36 at 4-bit values) pays for it on a CPU coordinator, which decodes
    every step: its aggregation took 34 ms a step against 23 ms with 12-bit indices in that benchmark.
    Centralized local-SGD rounds send every matrix as int8 factors of its error-feedback buffer instead, at
    the rank that fits the bytes its top-k would cost (``rank`` ``fit``), vectors dense: a pseudo-gradient
    after tens of inner steps is close to low-rank. In benchmarks.quality (gpt-5m, H 30) that cut the codec
    gap from 2.58 to 1.30 points at 300 steps and from 3.39 to 2.08 at 600, in 0.95x the bytes
    (docs/benchmarks.md); a fixed rank 8 did as well at 300 steps and worse at 600. Unless a top-k
    setting is given (``top_k_given``: ``--topk``, ``--target-chunk``, ``--no-dct``, ``--index-coding``),
    which asks for the DCT top-k. Gossip rounds (model differences) and gradient mode keep the top-k.
    Fitted factors travel in int4 codes (``factor_bits`` 4) and fit the bytes of a smaller top-k, ``FIT_DENSITY``
    of the mode's (at H 30 top-56 of 4096, 82 with Elias-Fano): ranks 6-11 at gpt-5m, about 1.3x int8's at
    0.64x the bytes, 5,100x fewer bytes per trained token than dense instead of 3,250x. In benchmarks.quality
    (gpt-5m, H 30, 300 steps, seeds 0 and 1) that ended no worse than int8 factors at top-143's bytes
    (docs/benchmarks.md).
    Gossip rounds with DeMuon inside send twice the coefficients (top-2048 of 4096, 1.75x the bytes): an
    orthogonalized step moves every direction of a matrix alike, so a round's change is harder to compress
    (top-1024 of a gpt-5m worker's 30 steps leaves 30% of its energy behind, against 23% under AdamW), and
    the difference the messages leave behind keeps the workers apart. In benchmarks.quality (8 workers,
    H 30) the complete graph ended 0.39% above the centralized round with it, against 0.53% at top-1536 and
    0.81% at top-1024; 2-bit values at top-2048 (1.25x the bytes) trained worse than top-1024 at 4-bit
    (docs/benchmarks.md).
    """
    local = inner_steps > 1
    fitted = rank == FIT or (rank is None and local and not gossip and not no_compression and not top_k_given)
    if index_coding is None:
        index_coding = "elias-fano"
    if outer_optimizer is None:
        outer_optimizer = ("nesterov" if no_compression else "sgd") if local else "signsgd"
    if local:
        learning_rate = {"sgd": 1.0, "nesterov": 0.7}.get(outer_optimizer, 1e-3)
    else:
        learning_rate = 1e-3
    chunk = target_chunk or 64
    density = min(max(90, 3 * inner_steps), 4096) / 4096 if local else GRADIENT_TOPK / 4096
    if gossip:
        density = 512 / 4096
    if fitted and not top_k_given:  # the top-k only sets the bytes the factors fit
        density *= FIT_DENSITY
    bins = 16 if gossip or not local else 4
    topk = max(1, round(density * chunk * chunk))
    if index_coding == "elias-fano":
        topk = ef_topk_in_bits_of(topk, chunk * chunk, math.ceil(math.log2(bins)))
    if gossip and inner_optimizer == "demuon":
        topk = min(chunk * chunk, 2 * topk)
    return {
        "outer_optimizer": outer_optimizer,
        "learning_rate": learning_rate,
        "momentum": 0.9 if outer_optimizer == "nesterov" else 0.0,
        "feedback_beta": 0.95 if local else 0.999,
        "bins": bins,
        "target_chunk": chunk,
        "topk": topk,
        "inner_momentum": {"muon": 0.95, "demuon": 0.8}.get(inner_optimizer, 0.0),
        "index_coding": index_coding,
        "rank": FIT if fitted else 0,
        "factor_bits": 4 if fitted else 8,
        "topk_warmup_steps": TOPK_WARMUP_STEPS if not (local or gossip or no_compression or rank) else 0,
        "aggregate": "mean" if local or gossip or no_compression else "kept-mean",
        "embedding_lr_scale": EMBEDDING_LR_SCALE if outer_optimizer == "signsgd" and not local and not gossip else 1.0,
        "inner_embedding_lr_scale": (
            INNER_EMBEDDING_LR_SCALE if local and not gossip and inner_optimizer == "adamw" else 1.0
        ),
    }


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """What to train, on what, and how rounds run. Field names match the ``coordinator train`` flags; each
    field's help, section and choices are in its metadata (``setting``)."""

    # Model and data
    model: str = setting(
        "gpt-10m",
        help=f"a built-in model ({', '.join(model_names())}), a Hugging Face hub id (e.g. facebook/opt-125m) "
        "or a local model directory",
        section=MODEL_AND_DATA,
    )
    from_scratch: bool = setting(
        False,
        help="for Hugging Face models: fresh weights built from the config, not the pretrained ones",
        section=MODEL_AND_DATA,
    )
    tokenizer: str | None = setting(
        None,
        help="a Hugging Face tokenizer name or directory, or gpt2 / bpe-8k (default: the model's own)",
        section=MODEL_AND_DATA,
    )
    data: tuple[str, ...] = setting(
        (),
        help="text/jsonl/json/csv/parquet files or directories, or a hub dataset name "
        "(default: the embedded Shakespeare corpus)",
        section=MODEL_AND_DATA,
        metavar="PATH",
    )
    data_config: str | None = setting(
        None, help="the configuration of a hub dataset, e.g. wikitext-103-raw-v1", section=MODEL_AND_DATA
    )
    text_field: str = setting(
        "text", help="the column holding the text in jsonl/json/csv/parquet or hub data", section=MODEL_AND_DATA
    )
    streaming: bool = setting(
        False, help="stream the data instead of loading it (corpora larger than memory)", section=MODEL_AND_DATA
    )
    steps: int = setting(
        100,
        help="outer steps (rounds) to train for, in all (a resumed run continues to this step)",
        section=MODEL_AND_DATA,
    )
    batch_size: int = setting(
        8,
        help="sequences per worker per step (per inner step in local-SGD rounds)",
        section=MODEL_AND_DATA,
    )
    sequence_length: int = setting(256, help="tokens per sequence", section=MODEL_AND_DATA)
    micro_batch_size: int = setting(
        0,
        help="sequences per forward/backward on a worker (0: the whole batch at once)",
        section=MODEL_AND_DATA,
    )
    eval_every: int = setting(0, help="report held-out loss every N steps (0: never)", section=MODEL_AND_DATA)
    eval_batches: int = setting(4, help="batches of held-out data per evaluation", section=MODEL_AND_DATA)

    # Outer optimizer (the coordinator's step); None = the mode's default (mode_defaults)
    outer_optimizer: str | None = setting(
        None,
        help="outer optimizer: sgd, nesterov (DiLoCo), signsgd (DeMo-style, decoupled weight decay) or adamw "
        "(auto: signsgd in gradient mode; with --inner-steps > 1 sgd, or nesterov with --no-compression)",
        section=OUTER,
        choices=OUTER_OPTIMIZERS,
    )
    learning_rate: float | None = setting(
        None,
        help="outer learning rate (auto: 1e-3 in gradient mode; with --inner-steps > 1, 1.0 for sgd, "
        "0.7 for nesterov, else 1e-3)",
        section=OUTER,
    )
    momentum: float | None = setting(
        None,
        help="momentum of the sgd and nesterov outer optimizers (auto: 0.9 for nesterov, else 0)",
        section=OUTER,
    )
    weight_decay: float = setting(0.0, help="decoupled weight decay of the outer optimizer", section=OUTER)
    embedding_lr_scale: float | None = setting(
        None,
        help="the token embedding's outer learning rate (a tied output layer's too) as a multiple of --learning-rate; "
        f"replayed outer optimizers (auto: {EMBEDDING_LR_SCALE:g} for gradient mode's signsgd, else 1)",
        section=OUTER,
    )
    lr_schedule: str = setting(
        "constant",
        help="outer learning-rate schedule after warmup: constant, cosine (optionally with restarts, "
        "--lr-cycles), linear (decay to --min-lr-ratio at --steps) or inverse-sqrt",
        section=OUTER,
        choices=SCHEDULES,
    )
    warmup_steps: int = setting(0, help="linear outer learning-rate warmup steps", section=OUTER)
    min_lr_ratio: float = setting(
        0.0, help="cosine/linear schedules end at this fraction of the learning rate", section=OUTER
    )
    lr_cycles: int = setting(1, help="cosine schedule: restarts, as this many equal cycles after warmup", section=OUTER)
    topology: str = setting(
        "star",
        help="star: centralized rounds, the coordinator aggregates every contribution and takes the outer step; "
        "ring, exponential or complete: gossip rounds, every worker trains a model of its own with the inner "
        "optimizer and mixes it with its neighbours' on that graph by compressed gossip (CHOCO), the coordinator "
        "relaying each message only to the sender's neighbours and keeping the consensus (the mean of the public "
        "copies) for evaluation and export; the outer optimizer and spot checks are not used",
        section=OUTER,
        choices=TOPOLOGIES,
    )
    gossip_gamma: float | None = setting(
        None,
        help="gossip rounds: the consensus step size in (0, 1] (auto: 1 with --no-compression, else 0.7 with "
        "--inner-optimizer demuon and 0.5 with any other)",
        section=OUTER,
    )
    peer_to_peer: bool = setting(
        False,
        help="gossip rounds: workers pull their neighbours' messages from each other (Worker.PullGossip, the same "
        "token and TLS) and the coordinator sees only each message's digest, size and sketch; it pulls whole public "
        "copies from the workers only to link workers anew and to show, checkpoint or export the consensus. A "
        "worker pulls from its neighbours at the addresses the coordinator reaches them at; a --tunnel worker's "
        "messages, and those of a neighbour a worker could not pull from, go through the coordinator instead",
        section=OUTER,
    )

    # Inner steps: local-SGD rounds of H steps on every worker between syncs
    inner_steps: int = setting(
        1,
        help="local-SGD rounds: inner optimizer steps on every worker between syncs "
        "(1: gradient mode, one compressed gradient per step)",
        section=INNER,
    )
    fragments: int = setting(
        1,
        help="streamed fragments (Streaming DiLoCo): split the model's tensors into F groups of about equal size; "
        "a round is H/F inner steps and syncs one group, in turn, so every tensor syncs once every H inner steps "
        "and the link carries 1/F of the payload at a time (1: the whole model every H steps)",
        section=INNER,
    )
    stream_buckets: int = setting(
        0,
        help="gradient mode: send each worker's gradient in B pieces of about equal size, each as soon as the "
        "backward has produced it, so that the link works while the backward does (the payload is the same, "
        f"byte for byte; at most {MAX_BUCKETS}; 0 or 1: in one message after the backward)",
        section=INNER,
    )
    inner_optimizer: str = setting(
        "adamw",
        help="the workers' inner optimizer in local-SGD rounds: adamw, sgd, muon "
        "(Newton-Schulz orthogonalised momentum for hidden matrices, AdamW for the rest) or demuon "
        "(the matrix sign of the momentum for every matrix, by --msgn; the momentum for vectors)",
        section=INNER,
        choices=INNER_OPTIMIZERS,
    )
    inner_learning_rate: float = setting(1e-3, help="inner learning rate", section=INNER)
    inner_weight_decay: float = setting(0.0, help="decoupled weight decay of the inner optimizer", section=INNER)
    inner_beta1: float = setting(0.9, help="inner AdamW beta1 (muon: for its AdamW part)", section=INNER)
    inner_beta2: float = setting(0.95, help="inner AdamW beta2 (muon: for its AdamW part)", section=INNER)
    inner_momentum: float | None = setting(
        None,
        help="momentum of the inner sgd, muon or demuon (auto: 0.95 for muon, 0.8 for demuon, else 0)",
        section=INNER,
    )
    inner_nesterov: bool = setting(False, help="Nesterov momentum for the inner sgd", section=INNER)
    inner_embedding_lr_scale: float | None = setting(
        None,
        help="the token embedding's inner learning rate (a tied output layer's too) as a multiple of "
        f"--inner-learning-rate (auto: {INNER_EMBEDDING_LR_SCALE:g} for local-SGD rounds' adamw, else 1)",
        section=INNER,
    )
    msgn: str = setting(
        "newton-schulz",
        help="demuon: the matrix sign of the matrices' momentum by newton-schulz (Muon's iteration), "
        "svd (exact, slower) or none (momentum SGD)",
        section=INNER,
        choices=MSGN,
    )
    clip_grad_norm: float = setting(
        0.0,
        help="clip each worker's gradient to this global L2 norm before it is compressed (gradient mode), "
        "or every inner step's gradient (local-SGD rounds) (0: no clipping)",
        section=INNER,
    )
    inner_lr_schedule: str = setting(
        "constant",
        help="inner learning-rate schedule over all inner steps (--steps x --inner-steps): constant, cosine, "
        "linear or inverse-sqrt",
        section=INNER,
        choices=SCHEDULES,
    )
    inner_warmup_steps: int = setting(0, help="linear inner learning-rate warmup, in inner steps", section=INNER)
    inner_min_lr_ratio: float = setting(
        0.0, help="inner cosine/linear schedules end at this fraction of the inner learning rate", section=INNER
    )
    inner_lr_cycles: int = setting(
        1, help="inner cosine schedule: restarts, as this many equal cycles after warmup", section=INNER
    )

    # Codec
    topk: int | None = setting(
        None,
        help="coefficients kept per full --target-chunk x --target-chunk chunk (scaled by area for smaller "
        "chunks) (auto: the mode's density at that chunk in 12-bit indices, 29 of 64x64 = 0.71% in gradient "
        "mode and 90 of 64x64 = 2.2% with --inner-steps > 1; with Elias-Fano indices, the default, as many "
        "as fit the same bytes: 36 and 143; gossip rounds: 1024, 2048 with DeMuon inside)",
        section=CODEC,
    )
    topk_warmup_steps: int | None = setting(
        None,
        help="gradient mode: the first N steps (at most a tenth of the run) send --topk-warmup-factor times the "
        "top-k, and the steps after fewer, so that the run sends the bytes of --topk every step "
        f"(auto: {TOPK_WARMUP_STEPS} in gradient mode, 0 otherwise)",
        section=CODEC,
    )
    topk_warmup_factor: float = setting(
        TOPK_WARMUP_FACTOR, help="the top-k's multiple in the first --topk-warmup-steps steps", section=CODEC
    )
    target_chunk: int | None = setting(
        None,
        help="chunk edge: each dimension is cut into its largest divisor <= this (max 64) "
        "(auto: 64; 16 costs a quarter of the transform FLOPs)",
        section=CODEC,
    )
    use_dct: bool = setting(
        True,
        help="DCT-transform chunks before top-k",
        section=CODEC,
        negative=("--no-dct", "select raw values, no DCT"),
    )
    bins: int | None = setting(
        None,
        help="quantization bins for kept values, packed in ceil(log2(bins)) bits: 4 = 2 bits, 16 = 4 bits, "
        "256 = 8 bits (0: raw float32; auto: 16 in gradient mode and gossip rounds, 4 in local-SGD rounds)",
        section=CODEC,
    )
    values: str = setting(
        "lut",
        help="how kept values travel: lut (quantized through --bins) or sign "
        "(1 bit each plus one scale per tensor, as DisTrO)",
        section=CODEC,
        choices=VALUE_CODINGS,
    )
    index_coding: str | None = setting(
        None,
        help="how each chunk's kept indices travel: packed12 (12 bits each) or elias-fano (in increasing "
        "order, about 2 + log2(chunk area / topk) bits each: 668 bits for 90 of 4096, against 1080) "
        "(auto: elias-fano)",
        section=CODEC,
        choices=INDEX_CODINGS,
    )
    rank: str | int | None = setting(
        None,
        help="send every matrix as factors A @ B of its error-feedback buffer (found by one power iteration "
        "a round from the subspace of the round before; a truncated SVD the first round) and every vector "
        "dense, instead of DCT top-k: R > 0 at "
        "rank R (matrices whose smaller side exceeds R); fit at the rank whose bytes fit the matrix's top-k's "
        "(gpt-5m at H 30: 6-11, the top-k's bytes then 0.62x the mode's); "
        "0: top-k for every tensor (auto: fit in centralized local-SGD rounds unless --topk, --target-chunk, "
        "--no-dct or --index-coding is given; 0 in gradient mode and gossip rounds)",
        section=CODEC,
        metavar="R|fit",
    )
    factor_bits: int | None = setting(
        None,
        help="bits of a factor's codes under --rank: 8 (int8) or 4 (int4, two a byte; a rank fitted to the "
        "same bytes is about twice int8's) (auto: 4 with --rank fit, else 8)",
        section=CODEC,
    )
    no_compression: bool = setting(False, help="send exact dense float32 gradients (a baseline)", section=CODEC)
    feedback_beta: float | None = setting(
        None,
        help="decay of the workers' error-feedback buffers (auto: 0.999 in gradient mode, 0.95 with --inner-steps > 1)",
        section=CODEC,
    )

    # Round policy: deadlines, quorum and stragglers, replays, overlap, robust aggregation and benching
    round_timeout: float = setting(
        600.0, help="deadline in seconds of every round and state-push call", section=ROUND_POLICY
    )
    connect_timeout: float = setting(60.0, help="seconds to wait for workers to come up", section=ROUND_POLICY)
    sync_tolerance: float = setting(
        1e-4, help="relative tolerance of the replica fingerprint check", section=ROUND_POLICY
    )
    fingerprint_every: int = setting(
        10,
        help="the replica fingerprints of every N-th version hold each tensor's sum and sum of squares (a pass "
        "over the model on each side); the others hold their sampled values alone (1: every version's)",
        section=ROUND_POLICY,
    )
    max_failed_rounds: int = setting(
        3,
        help="give up after this many rounds in a row with no usable worker, once they also span --max-failed-seconds",
        section=ROUND_POLICY,
    )
    max_failed_seconds: float = setting(
        60.0,
        help="seconds of failed rounds in a row before giving up (failed rounds back off: 0.5 s, doubling to 30 s)",
        section=ROUND_POLICY,
    )
    min_workers: int = setting(
        0,
        help="quorum: once this many workers' results are in, wait --straggler-grace for the rest, then cut "
        "them off (0: wait for every worker)",
        section=ROUND_POLICY,
    )
    straggler_grace: str = setting(
        "1.0x",
        help="how long a round with its quorum waits for stragglers: seconds (10) or a factor of the "
        "quorum's median time (1.5x)",
        section=ROUND_POLICY,
    )
    replay_window: int = setting(
        8,
        help="updates the coordinator keeps for workers that missed rounds: one behind by fewer replays them "
        "instead of receiving the state (0: always push)",
        section=ROUND_POLICY,
    )
    overlap: bool = setting(
        False,
        help="one-step-delayed rounds: every worker computes round r's contribution before applying round "
        "r-1's update, so in gradient mode it computes the next gradient while its last result travels and "
        "is aggregated (hides the link's time at the cost of one step of staleness)",
        section=ROUND_POLICY,
    )
    overlap_update: str = setting(
        "auto",
        help="with --overlap in local-SGD rounds, where each round's inner steps start: eager (from each worker's "
        "guess at the update in flight, its own last payload taken as the aggregate: Streaming DiLoCo's eager "
        "update), delayed (from the replica before that update, DiLoCoX), or auto: eager where it can be (a "
        "replayed outer optimizer, no --fragments), else delayed",
        section=ROUND_POLICY,
        choices=OVERLAP_UPDATES,
    )
    balance: str = setting(
        "rows",
        help="size each worker's work to its measured throughput so that all finish together, the global batch "
        "unchanged: rows moves rows per step (per inner step in local-SGD rounds) between the workers, steps "
        "(local-SGD rounds only) moves inner steps; off gives every worker --batch-size rows per GPU",
        section=ROUND_POLICY,
        choices=BALANCE_MODES,
    )
    aggregate: str | None = setting(
        None,
        help="how the workers' contributions combine, in the DCT-coefficient domain: mean (weighted by "
        "tokens), kept-mean (the same, per coefficient over the workers that sent it, as templar), or per "
        "coefficient trimmed-mean or median (auto: kept-mean in compressed gradient mode, mean otherwise)",
        section=ROUND_POLICY,
        choices=AGGREGATIONS,
    )
    device: str = setting(
        "auto",
        help="where the coordinator keeps its replica and does its dense work (the replica's apply, held-out "
        "evaluation, spot-check recomputes, a compressed downlink's encode): auto (a GPU when there is one), "
        "cpu, cuda or cuda:INDEX",
        section=ROUND_POLICY,
    )
    replay_precision: str = setting(
        "auto",
        help="how replicas combine a replayed update: float64 (rounded once to float32) computes the same "
        "bits on every device kind, so sign steps cannot drift apart; auto (the default) uses it only across "
        "device kinds whose float32 replays are not measured to agree (CPUs and CUDA GPUs are)",
        section=ROUND_POLICY,
        choices=REPLAY_PRECISIONS,
    )
    downlink: str = setting(
        "auto",
        help="what each worker receives of a round's update: replay (every other sender's payload: exact, but "
        "it grows with the number of workers), compressed (one payload, the aggregate re-compressed by the "
        "coordinator with its own error feedback: the same size however many workers) or auto (compressed "
        "once a replay would carry twice the bytes of one compressed aggregate). adamw always sends one "
        "compressed delta",
        section=ROUND_POLICY,
        choices=DOWNLINKS,
    )
    downlink_topk: int = setting(
        0,
        help="coefficients per chunk the compressed downlink keeps of the aggregate (0: 4 x --topk, at most a "
        "whole chunk): the aggregate of many senders holds more than one sender's top-k",
        section=ROUND_POLICY,
    )
    relay: str = setting(
        "direct",
        help="how the workers get a replayed update's payloads: direct (in each work order, from the "
        "coordinator: its egress grows with the number of workers) or peers (each order names the payloads, "
        "their SHA-256 and the workers that hold them, and each worker pulls them from their senders with the "
        "run's peer key, refusing any other bytes; a compressed aggregate or an adamw delta goes to "
        "--relay-fanout workers and the others pull it from those that have it; the coordinator sends a "
        "payload in the order only where a pull failed, and names that source again only after a while; a "
        "catch-up's missed payloads come from their senders too, while they keep them), or auto (peers, with "
        "each pair of workers judged apart: a source known by a loopback address serves only workers on its "
        "machine, a pull that failed keeps that pair apart for 10 rounds and twice as long after each further "
        "failure, a worker two others failed to reach serves nobody, and one that reached none of two gets its "
        "payloads in its orders, until a pull works again). A --tunnel worker's payloads still go through the "
        "coordinator",
        section=ROUND_POLICY,
        choices=RELAYS,
    )
    relay_fanout: int = setting(
        2,
        help="--relay peers with a compressed aggregate: the workers the coordinator sends it to; every other "
        "worker pulls it from one that has it, and each serves it to at most this many (a tree)",
        section=ROUND_POLICY,
    )
    clip_factor: float = setting(
        2.0,
        help="clip each worker's contribution to this many times the round's median norm (templar's rule; 0: off)",
        section=ROUND_POLICY,
    )
    bench_after: int = setting(
        3,
        help="bench a worker after this many bad rounds in a row (payload rejected, false token count, or "
        "clipped below a quarter) (0: never)",
        section=ROUND_POLICY,
    )
    bench_rounds: int = setting(
        20, help="rounds a benched worker sits out before it is tried again", section=ROUND_POLICY
    )
    agreement_floor: float = setting(
        AGREEMENT_FLOOR,
        help="leave out, with a strike, a worker whose agreement score (its payloads' cosine with the other "
        "senders', averaged over rounds; measured with 3 or more senders) falls below this: it points away "
        "from the others round after round, as a sign flipper does (below -1: off)",
        section=ROUND_POLICY,
    )
    spot_check_every: int = setting(
        10,
        help="spot checks: in about one round in N one sender's first gradient is recomputed from the rows "
        "it was sent and fingerprints are compared; a sender whose gradient was not computed on its rows is "
        "left out and benched at once (0: off; off by itself for models that draw dropout)",
        section=ROUND_POLICY,
    )
    spot_check_by: str = setting(
        "auto",
        help="who recomputes: recompute (the coordinator, on its own copy of the replica: one worker's share "
        "of a step per check), redundancy (the same rows go to up to 3 workers, whose fingerprints must agree: "
        "their duplicated work is the cost) or auto (recompute when the coordinator's model is on a GPU or "
        "has at most 50M parameters, else redundancy)",
        section=ROUND_POLICY,
        choices=SPOT_CHECK_METHODS,
    )
    spot_check_tolerance: float = setting(
        SPOT_TOLERANCE,
        help="relative difference allowed between a recomputed gradient's fingerprint and the sender's, each "
        "tensor weighed against the whole gradient (a bf16 worker is recomputed in bf16; float noise across "
        "device kinds ~1e-3)",
        section=ROUND_POLICY,
    )

    # Run directory: outputs, checkpoints, resuming, seed, progress
    output_dir: str = setting("runs/gradwire", help="where metrics.jsonl, checkpoints/ and final/ go", section=RUN)
    overwrite: bool = setting(
        False,
        help="replace the run already in --output-dir (its metrics and checkpoints are deleted); "
        "without it a new run there is refused",
        section=RUN,
    )
    checkpoint_dir: str | None = setting(
        None, help="checkpoint directory (default: OUTPUT_DIR/checkpoints)", section=RUN
    )
    checkpoint_every: int = setting(
        100,
        help="save a checkpoint every N steps, and at the end (0: only at the end); SIGINT/SIGTERM also save one",
        section=RUN,
    )
    keep_checkpoints: int = setting(3, help="keep only the newest N checkpoints (0: keep all)", section=RUN)
    resume_from: str | None = setting(
        None,
        help="checkpoint directory (or checkpoint root) to continue from, then the rounds its update log holds "
        "after it; auto: the run in --output-dir if there is one (its newest checkpoint and log), else a new "
        "run, so that a supervisor re-running the same command is the whole recovery",
        section=RUN,
    )
    seed: int = setting(0, help="seed for model initialization and data order", section=RUN)
    log_every: float = setting(
        30.0,
        help="when stderr is not a terminal (nohup, a CI log, docker logs): one progress line every N seconds "
        "and at the end: step, loss, tokens/s, bytes up/down, ETA (0: only at the end)",
        section=RUN,
    )

    # Tracking
    wandb_project: str | None = setting(
        None,
        help="log metrics and config to this Weights & Biases project (offline when no API key is set)",
        section=TRACKING,
    )
    wandb_run_name: str | None = setting(None, help="the Weights & Biases run name", section=TRACKING)

    def __post_init__(self) -> None:
        positive = (
            "steps",
            "batch_size",
            "sequence_length",
            "max_failed_rounds",
            "eval_batches",
            "inner_steps",
            "fragments",
        )
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
            "topk_warmup_steps",
        ):
            if (getattr(self, name) or 0) < 0:  # None: the mode's default
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.target_chunk is not None and self.target_chunk < 1:
            raise ValueError(f"--target-chunk must be >= 1, got {self.target_chunk}")
        defaults = mode_defaults(
            inner_steps=self.inner_steps,
            no_compression=self.no_compression,
            outer_optimizer=self.outer_optimizer,
            inner_optimizer=self.inner_optimizer,
            target_chunk=self.target_chunk,
            gossip=self.topology != "star",
            index_coding=self.index_coding,
            top_k_given=any(v is not None for v in (self.topk, self.target_chunk, self.index_coding))
            or not self.use_dct,
            rank=self.rank,
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
        if not 1 <= self.fingerprint_every <= MAX_FINGERPRINT_EVERY:
            raise ValueError(
                f"--fingerprint-every must be in [1, {MAX_FINGERPRINT_EVERY}], got {self.fingerprint_every}"
            )
        if not (math.isfinite(self.clip_factor) and (self.clip_factor == 0 or self.clip_factor >= 1)):
            raise ValueError(f"--clip-factor must be 0 (off) or >= 1, got {self.clip_factor}")
        for name in ("bench_after", "bench_rounds", "replay_window", "min_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        self.aggregation_rule()  # validates --aggregate
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:INDEX, got {self.device!r}")
        if self.replay_precision not in REPLAY_PRECISIONS:
            raise ValueError(
                f"--replay-precision must be one of {', '.join(REPLAY_PRECISIONS)}, got {self.replay_precision!r}"
            )
        if self.spot_check_by not in SPOT_CHECK_METHODS:
            raise ValueError(
                f"--spot-check-by must be one of {', '.join(SPOT_CHECK_METHODS)}, got {self.spot_check_by!r}"
            )
        if self.spot_check_every < 0:
            raise ValueError(f"--spot-check-every must be >= 0 (0: off), got {self.spot_check_every}")
        if not (math.isfinite(self.spot_check_tolerance) and 0 < self.spot_check_tolerance < 1):
            raise ValueError(f"--spot-check-tolerance must be in (0, 1), got {self.spot_check_tolerance}")
        if not (math.isfinite(self.agreement_floor) and self.agreement_floor < 1):
            raise ValueError(f"--agreement-floor must be below 1 (below -1: off), got {self.agreement_floor}")
        if self.downlink_topk < 0:
            raise ValueError(
                f"--downlink-topk must be >= 0 (0: {DOWNLINK_TOPK_FACTOR} x --topk), got {self.downlink_topk}"
            )
        if self.downlink not in DOWNLINKS:
            raise ValueError(f"--downlink must be one of {', '.join(DOWNLINKS)}, got {self.downlink!r}")
        if self.downlink == "replay" and self.outer_optimizer == "adamw":
            raise ValueError(
                "--downlink replay needs an outer optimizer replicas can replay (sgd, nesterov, signsgd): "
                "with --outer-optimizer adamw the workers follow one compressed delta (--downlink auto or compressed)"
            )
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"--balance must be one of {', '.join(BALANCE_MODES)}, got {self.balance!r}")
        if self.balance == "steps" and not self.local_sgd:
            raise ValueError(
                "--balance steps sizes the inner steps of local-SGD rounds (--inner-steps > 1); "
                "in gradient mode use --balance rows"
            )
        if self.fragments > 1:
            self._check_fragments()
        if self.overlap_update not in OVERLAP_UPDATES:
            raise ValueError(
                f"--overlap-update must be one of {', '.join(OVERLAP_UPDATES)}, got {self.overlap_update!r}"
            )
        if self.overlap_update == "eager" and not self._eager_possible():
            raise ValueError(
                "--overlap-update eager guesses the update in flight with the run's outer step on each worker: it "
                "needs an outer optimizer replicas replay (sgd, nesterov, signsgd) and no --fragments"
            )
        if not 0 <= self.stream_buckets <= MAX_BUCKETS:
            raise ValueError(f"--stream-buckets must be in [0, {MAX_BUCKETS}], got {self.stream_buckets}")
        if self.stream_buckets > 1 and self.local_sgd:
            raise ValueError(
                "--stream-buckets streams gradient mode's gradient as the backward produces it; a local-SGD round "
                "sends one pseudo-gradient after its inner steps (--fragments spreads that one over the round)"
            )
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if self.gossip:
            self._check_gossip()
        elif self.peer_to_peer:
            raise ValueError("--peer-to-peer is for gossip rounds: give --topology ring, exponential or complete")
        if self.relay not in RELAYS:
            raise ValueError(f"--relay must be one of {', '.join(RELAYS)}, got {self.relay!r}")
        if not 1 <= self.relay_fanout <= MAX_RELAY_FANOUT:
            raise ValueError(f"--relay-fanout must be in [1, {MAX_RELAY_FANOUT}], got {self.relay_fanout}")
        if self.relay != "direct" and self.gossip:
            raise ValueError(f"--relay {self.relay} relays star rounds; gossip rounds pull with --peer-to-peer")
        self.grace()  # validates --straggler-grace
        if not (math.isfinite(self.max_failed_seconds) and self.max_failed_seconds >= 0):
            raise ValueError(f"--max-failed-seconds must be >= 0, got {self.max_failed_seconds}")
        if self.round_timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError("--round-timeout and --connect-timeout must be positive")
        if not (math.isfinite(self.log_every) and self.log_every >= 0):
            raise ValueError(f"--log-every must be >= 0 seconds (0: only at the end), got {self.log_every}")
        self.data = tuple(self.data)
        self.update_rule()  # UpdateRule validates --outer-optimizer, --weight-decay, --momentum
        self._check_embedding_lr_scale()
        self._check_inner_embedding_lr_scale()
        if isinstance(self.rank, str):  # typed or from a file: a number, or the word
            if self.rank != FIT and not self.rank.isdigit():
                raise ValueError(f"--rank must be a non-negative integer or {FIT!r}, got {self.rank!r}")
            self.rank = self.rank if self.rank == FIT else int(self.rank)
        if self.rank and self.no_compression:
            raise ValueError(f"--rank {self.rank} factors what the codec sends; --no-compression sends it all")
        self.codec_config()  # CodecConfig validates --topk, --target-chunk, --bins, --values, --rank
        self._check_topk_warmup()
        self.downlink_codec_config()  # and --downlink-topk
        self.inner_optimizer_config()  # validates the --inner-* optimizer flags
        self.outer_schedule()
        self.inner_schedule()

    def _check_topk_warmup(self) -> None:
        if not (math.isfinite(self.topk_warmup_factor) and self.topk_warmup_factor >= 1):
            raise ValueError(f"--topk-warmup-factor must be >= 1, got {self.topk_warmup_factor}")
        if self.topk_warmup_steps and (self.local_sgd or self.gossip or self.no_compression or self.rank):
            raise ValueError(
                "--topk-warmup-steps warms up gradient mode's DCT top-k: not local-SGD rounds, gossip rounds, "
                "--no-compression or --rank (give --topk-warmup-steps 0)"
            )

    def topk_warmup(self) -> TopkWarmup:
        """The top-k of each step (``compression.schedule``): warmed up in gradient mode, else the top-k."""
        return TopkWarmup.plan(self.codec_config(), self.steps, self.topk_warmup_steps or 0, self.topk_warmup_factor)

    def _check_embedding_lr_scale(self) -> None:
        scale = self.embedding_lr_scale
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and 0 < scale <= MAX_LR_SCALE):
            raise ValueError(f"--embedding-lr-scale must be in (0, {MAX_LR_SCALE:g}], got {scale}")
        if scale != 1.0 and not self.update_rule().replayable:
            raise ValueError(
                f"--embedding-lr-scale {scale:g} scales a replayed outer step; --outer-optimizer "
                f"{self.outer_optimizer} is not replayed (use 1)"
            )

    def _check_inner_embedding_lr_scale(self) -> None:
        scale = self.inner_embedding_lr_scale
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and 0 < scale <= MAX_LR_SCALE):
            raise ValueError(f"--inner-embedding-lr-scale must be in (0, {MAX_LR_SCALE:g}], got {scale}")
        if scale != 1.0 and not self.takes_inner_steps:
            raise ValueError(
                f"--inner-embedding-lr-scale {scale:g} scales the workers' inner steps; gradient mode "
                "(--inner-steps 1) takes none (use 1, or --embedding-lr-scale for the outer step)"
            )

    def _check_fragments(self) -> None:
        if not self.local_sgd or self.inner_steps % self.fragments:
            raise ValueError(
                f"--fragments {self.fragments} splits local-SGD rounds: --inner-steps must be a multiple of it "
                f"(a round is H / F inner steps), got {self.inner_steps}"
            )
        if self.outer_optimizer == "adamw" or self.downlink == "compressed":
            raise ValueError(
                "--fragments replays each fragment's payloads: it needs an outer optimizer replicas replay (sgd, "
                "nesterov, signsgd) and --downlink replay or auto"
            )
        if MAX_FRAGMENTS < self.fragments:
            raise ValueError(f"--fragments must be at most {MAX_FRAGMENTS}, got {self.fragments}")

    def _check_gossip(self) -> None:
        """Gossip rounds: the consensus step's default, and the settings of centralized rounds they exclude.
        Spot checks recompute a gradient at the replica, which a gossip worker does not train: they are off."""
        if self.gossip_gamma is None:  # measured: docs/benchmarks-history.md, "DeMuon with Elias-Fano indices, ..."
            self.gossip_gamma = 1.0 if self.no_compression else 0.7 if self.inner_optimizer == "demuon" else 0.5
        if not (math.isfinite(self.gossip_gamma) and 0 < self.gossip_gamma <= 1):
            raise ValueError(f"--gossip-gamma must be in (0, 1], got {self.gossip_gamma}")
        excluded = {
            "--overlap": self.overlap,
            "--fragments": self.fragments > 1,
            "--stream-buckets": self.stream_buckets > 1,
            "--balance steps": self.balance == "steps",
        }
        if given := [flag for flag, on in excluded.items() if on]:
            raise ValueError(f"--topology {self.topology} (gossip rounds) does not go with {', '.join(given)}")
        self.spot_check_every = 0

    @property
    def eager(self) -> bool:
        """Eager overlapped local-SGD rounds (``--overlap``, ``--overlap-update`` eager or auto where it can be)."""
        if not (self.overlap and self.local_sgd) or self.overlap_update == "delayed":
            return False
        return self.overlap_update == "eager" or self._eager_possible()

    def _eager_possible(self) -> bool:
        """Workers can guess the update in flight: they replay the outer step, on the whole model."""
        return self.fragments == 1 and self.update_rule().replayable

    @property
    def gossip(self) -> bool:
        """Gossip rounds (``--topology`` other than star): every worker keeps its own model."""
        return self.topology != "star"

    @property
    def takes_inner_steps(self) -> bool:
        """Orders carry inner steps: local-SGD rounds, and every gossip round (one inner step at H 1)."""
        return self.local_sgd or self.gossip

    @property
    def local_sgd(self) -> bool:
        """Local-SGD rounds (H > 1 inner steps between syncs) rather than one gradient per step."""
        return self.inner_steps > 1

    @property
    def round_steps(self) -> int:
        """Inner steps in a round: H, or H / F with streamed fragments (each fragment syncs every H)."""
        return self.inner_steps // self.fragments

    def codec_config(self) -> CodecConfig:
        if self.no_compression:
            return DENSE_CODEC
        try:
            return CodecConfig(
                chunk=self.target_chunk,
                topk=self.topk,
                use_dct=self.use_dct,
                bins=self.bins,
                values=self.values,
                indices=self.index_coding,
                rank=0 if self.rank == FIT else self.rank,
                rank_fits_topk=self.rank == FIT,
                factor_bits=self.factor_bits,
            )
        except ValueError as e:
            raise ValueError(
                f"codec flags (--topk, --target-chunk, --bins, --values, --index-coding, --rank, --factor-bits): {e}"
            ) from None

    def downlink_codec_config(self) -> CodecConfig:
        """The codec of a compressed downlink: the workers' chunks and value coding, ``--downlink-topk``."""
        codec = self.codec_config()
        if self.no_compression:
            return codec
        topk = self.downlink_topk or min(DOWNLINK_TOPK_FACTOR * codec.topk, codec.chunk * codec.chunk)
        # Factors of the aggregate of several senders: 4x the rank, or what fits 4x the top-k's bytes.
        rank = min(DOWNLINK_TOPK_FACTOR * codec.rank, MAX_RANK)
        try:
            return dataclasses.replace(codec, topk=topk, rank=rank)
        except ValueError as e:
            raise ValueError(f"--downlink-topk: {e}") from None

    def grace(self) -> Grace:
        return Grace.parse(self.straggler_grace)

    def aggregation_rule(self, exact: bool = False) -> AggregationRule:
        return AggregationRule(mode=self.aggregate, exact=exact)

    def update_rule(self, embedding: Sequence[str] = ()) -> UpdateRule:
        """The outer optimizer's rule; ``embedding``: the model's token-embedding parameters
        (``models.token_embedding_names``), which step at ``--embedding-lr-scale`` times the rate."""
        scale = self.embedding_lr_scale if self.embedding_lr_scale is not None else 1.0
        return UpdateRule(
            optimizer=self.outer_optimizer,  # type: ignore[arg-type]
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            lr_scales=tuple((name, scale) for name in embedding) if scale != 1.0 else (),
        )

    def inner_optimizer_config(self, embedding: Sequence[str] = ()) -> InnerOptimizerConfig:
        """The workers' inner optimizer; ``embedding``: the model's token-embedding parameters
        (``models.token_embedding_names``), which step at ``--inner-embedding-lr-scale`` times the rate."""
        scale = self.inner_embedding_lr_scale if self.inner_embedding_lr_scale is not None else 1.0
        return InnerOptimizerConfig(
            name=self.inner_optimizer,
            weight_decay=self.inner_weight_decay,
            betas=(self.inner_beta1, self.inner_beta2),
            momentum=self.inner_momentum,
            nesterov=self.inner_nesterov,
            msgn=self.msgn,
            lr_scales=tuple((name, scale) for name in embedding) if scale != 1.0 else (),
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
        # Inner steps are counted across rounds: round r's step h is inner step r * H + h (H / F with fragments).
        return Schedule(
            kind=self.inner_lr_schedule,
            warmup=self.inner_warmup_steps,
            total=self.steps * self.round_steps,
            min_ratio=self.inner_min_lr_ratio,
            cycles=self.inner_lr_cycles,
            flag_prefix="inner-",
        )

    def lr_at(self, step: int) -> float:
        """The outer learning rate of round ``step`` (0-based)."""
        return lr_at(self.learning_rate, self.outer_schedule(), step)

    def inner_lrs(self, step: int) -> tuple[float, ...]:
        """The inner learning rate of each of round ``step``'s inner steps (H, or H / F with fragments)."""
        schedule, h = self.inner_schedule(), self.round_steps
        return tuple(lr_at(self.inner_learning_rate, schedule, step * h + i) for i in range(h))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["data"] = list(self.data)
        return d
