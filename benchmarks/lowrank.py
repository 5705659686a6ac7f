"""Low-rank factors against the DCT codec, on the pseudo-gradients of local-SGD rounds (a simulation).

    python -m benchmarks.lowrank --json                                   # codec, low-rank 8, averaging
    python -m benchmarks.lowrank --json --variants codec,lowrank:4:fp16,lowrank:8:int8,lowrank:8:int8:power
    python -m benchmarks.lowrank --json --encode --model gpt-80m --threads 2   # what a round's encode costs

A single process plays SparseLoCo's rounds: ``--workers`` workers each take ``--inner-steps`` AdamW steps
from the shared model (warmup, then cosine to 0.1), the pseudo-gradients go through a compressor with error
feedback 0.95, and the shared model takes outer SGD at lr 1 on the mean of what was decoded. The data is the
shipped complete works in stream order (``benchmarks.quality``'s corpus), no token trained twice, the
held-out loss taken on batches cut from the end. The same seed, data and schedule for every variant, so the
variants differ only in what crosses the link:

  averaging          the exact pseudo-gradients (uncompressed local SGD: the floor of the others);
  codec              gradwire's codec at the local-SGD defaults of ``coordinator train`` (DCT of 64 x 64
                     chunks, top-k, 2-bit values, Elias-Fano indices), its own error feedback;
  codec:K            the same at top-K;
  codec:fit          the codec as ``coordinator train``'s local-SGD rounds run it: int4 factors of every matrix at
                     the rank that fits its top-k's bytes (``--rank fit``), vectors dense;
  codec:rankR[:auto|:svd|:randomized]
                     the same with ``--rank R``: the service's low-rank factors (``compression.lowrank``) for
                     every matrix, vectors dense in 2-bit values; factored as the service does (one power
                     iteration a round from the subspace carried in the error feedback), or from scratch
                     every round: ``auto`` as before 2026-11-27 (an exact SVD for gpt-5m's matrices), or
                     forced to an SVD or to the randomized range finder;
  lowrank:R:F[:powerN] each matrix's error-feedback buffer sent as rank-R factors ``A (rows x R) @ B (R x cols)``
                     in F = fp16, or int8 with one float16 scale per factor column (of A) and row (of B);
                     vectors travel as float32. The factors come from a truncated SVD, or with ``powerN``
                     from N power iterations (``power``: one) warm-started at the last round's (PowerSGD's way, cheap on
                     large matrices).

This is not the service: no payload is framed, validated or replayed. Bytes count what would carry the
information: a codec payload's indices, values and tables; the factors and their scales. Reports per variant
the held-out loss after every round, the bytes per worker and round, and the gap to ``averaging``
(``gap_vs_averaging``, relative). Prints one JSON object (``--json``: on one line).

``--encode`` trains nothing: it times the service's encode of one local-SGD round's payload (``compress``
with error feedback, the codec at ``coordinator train``'s local-SGD defaults, ``--rank fit``) on the shapes
of ``--model``, on ``--device``, for ``--rounds`` rounds of synthetic pseudo-gradients (each matrix rank 32
plus 10% noise), per way of factoring: ``power`` (the service's), ``auto`` (from scratch, as before), and
``topk`` (``--rank 0``) for scale. Reports the first round (which seeds the carried subspaces) and the
median of the later ones, in seconds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.quality import CORPUS
from gradwire.compression import Encoding
from gradwire.compression.codec import GradientCodec
from gradwire.compression.feedback import ErrorFeedback
from gradwire.coordinator.config import TrainConfig
from gradwire.models.registry import build_model, lm_loss, tokenizer_for

DEFAULT_VARIANTS = "averaging,codec,lowrank:8:int8"
BETA = 0.95  # error feedback, SparseLoCo's
EVAL_BATCHES = 16


def tokens(model: str, needed: int, corpus: Path = CORPUS) -> torch.Tensor:
    """At least ``needed`` tokens of the corpus, in order (the text read as far as it takes)."""
    tokenizer = tokenizer_for(model)
    with gzip.open(corpus, "rt", encoding="utf-8") if corpus.suffix == ".gz" else open(corpus) as f:
        text = f.read()
    chars = max(4 * needed, 100_000)
    while True:
        encoded = tokenizer.encode(text[:chars])
        ids = torch.tensor(getattr(encoded, "ids", encoded), dtype=torch.long)
        if len(ids) >= needed or chars >= len(text):
            break
        chars *= 2
    if len(ids) < needed:
        raise SystemExit(f"the corpus holds {len(ids)} tokens; this run needs {needed}")
    return ids


class LowRank:
    """Rank-``rank`` factors of each matrix's error-feedback buffer (vectors go whole, in float32)."""

    def __init__(self, rank: int, fmt: str, power: int = 0) -> None:
        """``power``: power iterations a round, warm-started at the last round's factors (0: a truncated SVD)."""
        if rank < 1 or fmt not in ("fp16", "int8") or power < 0:
            raise ValueError(f"lowrank:R:F needs R >= 1 and F in fp16, int8; got {rank}, {fmt}")
        self.rank, self.fmt, self.power = rank, fmt, power
        self.buffers: dict[str, torch.Tensor] = {}
        self.bases: dict[str, torch.Tensor] = {}  # the power iteration's warm start, (cols, rank)

    def send(self, delta: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """What the receiver decodes of ``delta`` (the buffer keeps the rest), and its bytes."""
        out, nbytes = {}, 0
        for name, d in delta.items():
            if d.dim() != 2:
                out[name], nbytes = d.clone(), nbytes + 4 * d.numel()
                continue
            m = self.buffers.get(name)
            m = d.clone() if m is None else m.mul_(BETA).add_(d)
            self.buffers[name] = m
            a, b = self._factors(name, m)
            if self.fmt == "int8":
                a = _int8(a, dim=0)
                b = _int8(b, dim=1)
                nbytes += a.numel() + b.numel() + 2 * 2 * a.shape[1]
            else:
                a, b = a.half().float(), b.half().float()
                nbytes += 2 * (a.numel() + b.numel())
            sent = a @ b
            m.sub_(sent)
            out[name] = sent
        return out, nbytes

    def _factors(self, name: str, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rank = min(self.rank, *m.shape)
        if not self.power:
            u, s, vh = torch.linalg.svd(m, full_matrices=False)
            return u[:, :rank] * s[:rank], vh[:rank]
        q = self.bases.get(name)
        if q is None:
            q = torch.randn(m.shape[1], rank, generator=torch.Generator().manual_seed(len(self.bases)))
        for _ in range(self.power):
            p, _ = torch.linalg.qr(m @ q)  # (rows, rank), orthonormal
            q = m.T @ p  # (cols, rank): m ~ p @ q.T
        self.bases[name] = q
        return p, q.T


def _int8(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` rounded to int8 codes with one float16 scale per slice along ``dim``, decoded."""
    scale = (x.abs().amax(dim=dim, keepdim=True) / 127).half().float().clamp_min(1e-30)
    return (x / scale).round().clamp(-127, 127) * scale


class Codec:
    """gradwire's codec at ``coordinator train``'s local-SGD defaults (or at top-``topk``, or ``--rank``)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        inner_steps: int,
        topk: int | None,
        rank: int | None = 0,
        factorization: str = "power",
    ) -> None:
        config = TrainConfig(inner_steps=inner_steps, topk=topk, rank=rank).codec_config()
        self.codec = GradientCodec(shapes, config, factorization=factorization)  # type: ignore[arg-type]
        self.feedback = ErrorFeedback(BETA)
        self.topk = config.topk

    def send(self, delta: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        payload = self.codec.compress(delta, self.feedback)
        return self.codec.decompress(payload), payload.nbytes


def compressor(spec: str, shapes: dict[str, tuple[int, ...]], inner_steps: int) -> Codec | LowRank | None:
    """The variant named ``spec`` (see the module's list); ``None`` for averaging."""
    name, *fields = spec.split(":")
    if name == "averaging" and not fields:
        return None
    if spec == "codec:fit":
        return Codec(shapes, inner_steps, None, None)  # the mode's own rank (fit) and factor bits
    rank = re.fullmatch(r"rank(\d+)", fields[0]) if name == "codec" and fields else None
    if rank and (len(fields) == 1 or fields[1:] in (["auto"], ["svd"], ["randomized"])):
        return Codec(shapes, inner_steps, None, int(rank.group(1)), fields[1] if len(fields) == 2 else "power")
    if name == "codec" and len(fields) <= 1:
        return Codec(shapes, inner_steps, int(fields[0]) if fields else None)
    iterations = re.fullmatch(r"power(\d*)", fields[2]) if len(fields) == 3 else None
    if name == "lowrank" and (len(fields) == 2 or iterations):
        return LowRank(int(fields[0]), fields[1], power=int(iterations.group(1) or 1) if iterations else 0)
    variants = "averaging, codec[:K|:fit|:rankR[:auto|:svd|:randomized]], lowrank:R:fp16|int8[:powerN]"
    raise SystemExit(f"unknown variant {spec!r}: {variants}")


def run_variant(spec: str, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    h, rounds, workers, batch, seq = args.inner_steps, args.rounds, args.workers, args.batch_size, args.sequence_length
    row = seq + 1
    held = ids[-EVAL_BATCHES * batch * row :].reshape(EVAL_BATCHES, batch, row)
    train = ids[: rounds * workers * h * batch * row].reshape(rounds, workers, h, batch, row)
    shared = build_model(args.model, seed=args.seed)
    shapes = {n: tuple(p.shape) for n, p in shared.named_parameters()}
    copies = [build_model(args.model, seed=args.seed) for _ in range(workers)]
    inner = [torch.optim.AdamW(c.parameters(), lr=args.inner_learning_rate) for c in copies]
    codecs = [compressor(spec, shapes, h) for _ in range(workers)]
    total, warmup = rounds * h, max(1, int(0.05 * rounds * h))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.inner_learning_rate * (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return args.inner_learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    def held_out() -> float:
        with torch.no_grad():
            return float(np.mean([float(lm_loss(shared, held[i])) for i in range(EVAL_BATCHES)]))

    losses, sent_bytes, t0 = [], 0, time.perf_counter()
    for r in range(rounds):
        start = {n: p.detach().clone() for n, p in shared.named_parameters()}
        decoded = []
        for w in range(workers):
            with torch.no_grad():
                for n, p in copies[w].named_parameters():
                    p.copy_(start[n])
            for step in range(h):
                for group in inner[w].param_groups:
                    group["lr"] = lr_at(r * h + step)
                loss = lm_loss(copies[w], train[r, w, step])
                inner[w].zero_grad()
                loss.backward()
                inner[w].step()
            delta = {n: start[n] - p.detach() for n, p in copies[w].named_parameters()}
            if codecs[w] is None:
                decoded.append(delta)
                continue
            out, nbytes = codecs[w].send(delta)
            decoded.append(out)
            sent_bytes += nbytes
        with torch.no_grad():
            for n, p in shared.named_parameters():
                p.sub_(sum(d[n] for d in decoded) / workers)
        losses.append(round(held_out(), 4))
    params = sum(math.prod(s) for s in shapes.values())
    per_round = sent_bytes / (rounds * workers) if sent_bytes else 4.0 * params
    result = {
        "held_out_loss": losses[-1],
        "held_out_by_round": losses,
        "bytes_per_worker_round": round(per_round),
        "x_fewer_than_fp32_gradients": round(4.0 * params * h / per_round, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if isinstance(codecs[0], Codec):
        result["topk"] = codecs[0].topk
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    row = args.sequence_length + 1
    needed = (args.rounds * args.workers * args.inner_steps + EVAL_BATCHES) * args.batch_size * row
    variants = [v for v in args.variants.split(",") if v]
    for spec in variants:  # every name checked before anything is read or trained
        compressor(spec, {"w": (64, 64)}, args.inner_steps)
    ids = tokens(args.model, needed)
    results = {spec: run_variant(spec, args, ids) for spec in variants}
    floor = results.get("averaging", {}).get("held_out_loss")
    for r in results.values():
        if floor is not None:
            r["gap_vs_averaging"] = round(r["held_out_loss"] / floor - 1, 5)
    settings = {k: getattr(args, k) for k in ("model", "workers", "inner_steps", "rounds", "batch_size", "seed")}
    return {**settings, "sequence_length": args.sequence_length, "tokens_per_variant": needed, "variants": results}


ENCODINGS = ("power", "auto", "topk")
SYNTHETIC_RANK = 32


def _pseudo_gradient(shapes: dict[str, tuple[int, ...]], seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Every matrix of rank ``SYNTHETIC_RANK`` plus 10% noise (in norm, about), every vector noise."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 2 and min(shape) > SYNTHETIC_RANK:
            rows, cols = shape
            x = torch.randn(rows, SYNTHETIC_RANK, generator=gen) @ torch.randn(SYNTHETIC_RANK, cols, generator=gen)
            x = x / SYNTHETIC_RANK**0.5 + 0.1 * torch.randn(shape, generator=gen)
        else:
            x = torch.randn(shape, generator=gen)
        out[name] = (1e-3 * x).to(device)
    return out


def time_encode(args: argparse.Namespace) -> dict[str, Any]:
    """``--encode``: seconds of one round's ``compress`` with error feedback, per way of factoring (module)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = {n: tuple(p.shape) for n, p in build_model(args.model, seed=args.seed).named_parameters()}
    config = TrainConfig(model=args.model, inner_steps=args.inner_steps).codec_config()
    ranks = sorted({t.k for t in GradientCodec(shapes, config).plan.dense if t.encoding == Encoding.LOW_RANK})
    topk = TrainConfig(model=args.model, inner_steps=args.inner_steps, rank=0).codec_config()
    codecs = {
        way: GradientCodec(shapes, topk, device)
        if way == "topk"
        else GradientCodec(shapes, config, device, factorization=way)  # type: ignore[arg-type]
        for way in ENCODINGS
    }
    feedback = {way: ErrorFeedback(BETA) for way in ENCODINGS}
    seconds: dict[str, list[float]] = {way: [] for way in ENCODINGS}
    nbytes = {}
    for r in range(args.rounds):  # the ways take turns within each round: the same load on the machine for each
        delta = _pseudo_gradient(shapes, args.seed + r, device)
        for way, codec in codecs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            nbytes[way] = codec.compress(delta, feedback[way]).nbytes
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[way].append(time.perf_counter() - t0)
    results = {
        way: {
            "first_round_s": round(s[0], 4),
            "later_rounds_s": round(statistics.median(s[1:]), 4) if len(s) > 1 else None,
            "payload_bytes": nbytes[way],
        }
        for way, s in seconds.items()
    }
    return {
        "model": args.model,
        "device": str(device),
        "threads": args.threads,
        "rounds": args.rounds,
        "fit_ranks": ranks,
        "factored_matrices": sum(t.encoding == Encoding.LOW_RANK for t in GradientCodec(shapes, config).plan.dense),
        "encode": results,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated (default: {DEFAULT_VARIANTS})")
    parser.add_argument("--model", default="gpt-5m")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--inner-learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    parser.add_argument("--encode", action="store_true", help="time a round's encode instead (see the module)")
    parser.add_argument("--device", default="cpu", help="--encode's device (cpu, cuda, cuda:1, ...)")
    args = parser.parse_args(argv)
    result = time_encode(args) if args.encode else run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
