"""Gradient mode's codec and sign step against other selections and steps (a simulation).

    python -m benchmarks.gradsim --json                                  # dense, codec
    python -m benchmarks.gradsim --json --variants codec,select:chunk,select:tensor
    python -m benchmarks.gradsim --json --variants codec --step rms      # another step on the same codec
    python -m benchmarks.gradsim --json --variants codec --precond adam --learning-rate 7e-4

A single process plays gradient mode: each step, ``--workers`` workers take one gradient each at the shared
model on their own rows; what they send is decoded, averaged, and turned into the shared model's step. The
data is ``benchmarks.lowrank``'s (the shipped complete works in stream order, no token twice, the held-out
batches cut from the end), and every variant has the same seed, rows and learning-rate schedule (a 5% linear
warm-up, then cosine to ``--min-lr`` of the peak), so the variants differ only in what crosses the link and
what step is taken of it:

  dense           AdamW at ``--dense-learning-rate`` on the workers' mean gradient (DDP's math): the bar;
  exact           the workers' exact gradients, through the step below (sign-SGD: uncompressed DeMo);
  codec           gradwire's codec at gradient mode's defaults, the service's own code: DCT of 64 x 64 chunks,
                  Elias-Fano top-k with its warm-up plan (``compression.schedule``), 4-bit values, each worker's
                  error feedback at ``--feedback-beta``;
  select:chunk    the codec's selection done here: each chunk's top-k of the error-feedback buffer's
                  coefficients, values in the codec's 4-bit format a tensor at a time (the few tensors the
                  codec sends whole, in float32);
                  decodes as ``codec`` does (the test checks it), so that ``select:tensor`` has its control;
  select:tensor   as many coefficients as ``select:chunk`` keeps, chosen over each tensor's coefficients at
                  once: a chunk keeps as many as its share of the buffer's energy earns.

The step (``--step``) of the aggregate ``g``: ``sign`` (sign-SGD, DeMo's and the service's), ``vote`` (the
sign of the workers' signs averaged: signSGD with majority vote, no step where they split evenly), ``rms`` (``g``
over its root mean square, a tensor at a time: the sign's step length in ``g``'s own shape) or ``clipC``
(``rms`` clipped to +-C and scaled back to unit RMS). ``--momentum B`` takes the step of ``m = B m + g``
instead of ``g`` (coordinator-side momentum). ``--precond adam`` makes each worker send its own AdamW step
(its moments of its own gradients, at ``--learning-rate``) instead of its gradient, and the shared model
takes the aggregate whole (outer SGD at lr 1).

This is not the service: nothing is framed, validated or replayed. Bytes: a codec payload's, or for
``select`` what the same payload would cost (Elias-Fano indices over a chunk, or over a tensor's
coefficients, at about ``2 + floor(log2(universe / count))`` bits each, and the value codes); ``dense`` and
``exact`` count 4 bytes a parameter. Reports per variant the held-out loss at ten points and at the end,
the bytes per worker and step, and the gap to ``dense`` (relative). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from benchmarks.lowrank import EVAL_BATCHES, tokens
from gradwire.compression.codec import GradientCodec
from gradwire.compression.config import CodecConfig
from gradwire.compression.dct import idct_chunks
from gradwire.compression.feedback import ErrorFeedback
from gradwire.compression.plan import TensorPlan
from gradwire.compression.quant import quantize
from gradwire.compression.schedule import TopkWarmup
from gradwire.compression.select import topk_indices
from gradwire.coordinator.config import TOPK_WARMUP_FACTOR, TOPK_WARMUP_STEPS, TrainConfig
from gradwire.models.registry import build_model, lm_loss
from gradwire.optim.schedule import Schedule, lr_at

DEFAULT_VARIANTS = "dense,codec"
VARIANTS = ("dense", "exact", "codec", "select:chunk", "select:tensor")
WARMUP_FRACTION = 0.05  # benchmarks.quality's
EVAL_POINTS = 10
ADAM_BETAS = (0.9, 0.95)  # the outer AdamW's defaults (optim.outer.UpdateRule)


def gradient_codec_config(**changes: Any) -> CodecConfig:
    """The codec settings of ``coordinator train``'s gradient mode, with ``changes`` (fields of CodecConfig)."""
    return dataclasses.replace(TrainConfig(inner_steps=1).codec_config(), **changes)


class CodecSender:
    """A worker's sends through gradwire's codec, with its error feedback; one codec per top-k it is asked for."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], config: CodecConfig, beta: float) -> None:
        self.shapes, self.config = shapes, config
        self.feedback = ErrorFeedback(beta)
        self._codecs: dict[int, GradientCodec] = {}

    def send(self, grads: Mapping[str, torch.Tensor], topk: int) -> tuple[dict[str, torch.Tensor], int]:
        codec = self._codecs.get(topk)
        if codec is None:
            codec = self._codecs[topk] = GradientCodec(self.shapes, dataclasses.replace(self.config, topk=topk))
        payload = codec.compress(grads, self.feedback)
        return codec.decompress(payload), payload.nbytes


class SelectSender:
    """The codec's chunks, transform and error feedback, with the kept coefficients chosen here: the top-k
    of each chunk (``per`` ``chunk``, as the codec does) or as many over each tensor at once (``tensor``)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], config: CodecConfig, beta: float, per: str) -> None:
        if per not in ("chunk", "tensor"):
            raise ValueError(f"select per chunk or tensor, got {per!r}")
        self.codec = GradientCodec(shapes, config)
        self.config, self.per = config, per
        self.feedback = ErrorFeedback(beta)

    def send(self, grads: Mapping[str, torch.Tensor], topk: int) -> tuple[dict[str, torch.Tensor], int]:
        codec, out, bits = self.codec, {}, 0
        for gi, group in enumerate(codec.plan.groups):
            buf = self.feedback.accumulate(f"group{gi}", codec._coefficients(group, grads))
            quantized = codec._layouts[gi].quantized
            for mi, (t, off) in enumerate(zip(group.members, group.offsets)):
                rows = buf[off : off + t.num_chunks]  # a view: what is sent leaves the buffer
                kept = self._kept(rows, min(topk, rows.shape[1]))
                values = rows[kept]
                if quantized[mi]:
                    segment = torch.zeros(values.numel(), dtype=torch.long)
                    values = quantize(values, segment, 1, self.config.bins, self.config.range_sigmas).dequantized
                sent = torch.zeros_like(rows)
                sent[kept] = values
                rows.sub_(sent)
                out[t.name] = decode_chunks(codec, sent, t)
                bits += self._bits(kept, math.ceil(math.log2(self.config.bins)) if quantized[mi] else 32)
        for t in codec.plan.dense:  # what the codec sends whole (the smallest tensors): here in float32
            out[t.name] = grads[t.name].detach().float().clone()
            bits += 32 * t.numel
        return out, math.ceil(bits / 8)

    def _kept(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        kept = torch.zeros(rows.shape, dtype=torch.bool)
        if self.per == "chunk":
            kept.scatter_(1, topk_indices(rows, k, magnitude=True), True)  # the codec's own choice among ties
        else:
            kept.view(-1)[rows.abs().reshape(-1).topk(k * rows.shape[0]).indices] = True
        return kept

    def _bits(self, kept: torch.Tensor, value_bits: int) -> int:
        """Elias-Fano indices (over a chunk, or over the tensor) and value codes of ``kept``."""
        count = int(kept.sum())
        universe = kept.shape[1] if self.per == "chunk" else kept.numel()
        per_set = count // kept.shape[0] if self.per == "chunk" else count
        return count * (2 + max(0, int(math.log2(universe / max(1, per_set)))) + value_bits)


def decode_chunks(codec: GradientCodec, coefficients: torch.Tensor, t: TensorPlan) -> torch.Tensor:
    """Tensor ``t`` from its chunks' (chunks, chunk_numel) DCT coefficients."""
    if len(t.chunk_shape) == 2:
        return codec._unchunk(idct_chunks(coefficients.view(-1, *t.chunk_shape)), t)
    return codec._unchunk(idct_chunks(coefficients), t)


def combine(values: list[torch.Tensor], step: str) -> torch.Tensor:
    """The workers' decoded values of one tensor, averaged (for ``vote``, their signs)."""
    return sum(torch.sign(v) if step == "vote" else v for v in values) / len(values)


def step_of(g: torch.Tensor, step: str) -> torch.Tensor:
    """The shared model's step direction from the aggregate ``g`` (see the module)."""
    if step in ("sign", "vote"):
        return torch.sign(g)
    unit = g / g.pow(2).mean().sqrt().clamp_min(1e-30)
    if step == "rms":
        return unit
    clip = float(step[len("clip") :])
    unit = unit.clamp(-clip, clip)
    return unit / unit.pow(2).mean().sqrt().clamp_min(1e-30)


def check_step(step: str) -> None:
    if step not in ("sign", "vote", "rms") and not (re.fullmatch(r"clip\d+(\.\d+)?", step) and float(step[4:]) > 0):
        raise SystemExit(f"unknown step {step!r}: sign, vote, rms or clipC (C > 0)")


def sender_config(args: argparse.Namespace) -> CodecConfig:
    """Gradient mode's codec settings with ``--topk`` and ``--bins`` where given."""
    changes = {k: v for k, v in (("topk", args.topk), ("bins", args.bins)) if v}
    return gradient_codec_config(**changes)


def sender(spec: str, shapes: Mapping[str, tuple[int, ...]], args: argparse.Namespace) -> Any:
    """The variant ``spec``'s sender for one worker (``None``: the exact gradient)."""
    if spec not in VARIANTS:
        raise SystemExit(f"unknown variant {spec!r}: {', '.join(VARIANTS)}")
    config = sender_config(args)
    if spec == "codec":
        return CodecSender(shapes, config, args.feedback_beta)
    if spec.startswith("select:"):
        return SelectSender(shapes, config, args.feedback_beta, spec.split(":")[1])
    return None


class AdamPreconditioner:
    """A worker's own AdamW step of its own gradients (``--precond adam``): torch's AdamW on tensors that start
    each step at zero, so that after it they hold minus the step."""

    def __init__(self) -> None:
        self.steps: dict[str, torch.Tensor] = {}
        self.optimizer: torch.optim.AdamW | None = None

    def __call__(self, grads: Mapping[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
        if self.optimizer is None:
            self.steps = {n: torch.zeros_like(g) for n, g in grads.items()}
            self.optimizer = torch.optim.AdamW(list(self.steps.values()), betas=ADAM_BETAS, weight_decay=0.0)
        for name, t in self.steps.items():
            t.grad = grads[name]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        out = {name: -t for name, t in self.steps.items()}
        for t in self.steps.values():
            t.zero_()
        return out


def run_variant(spec: str, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    steps, workers, batch, row = args.steps, args.workers, args.batch_size, args.sequence_length + 1
    held = ids[-EVAL_BATCHES * batch * row :].reshape(EVAL_BATCHES, batch, row)
    train = ids[: steps * workers * batch * row].reshape(steps, workers, batch, row)
    model = build_model(args.model, seed=args.seed)
    params = dict(model.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    dense = spec == "dense"
    peak = args.dense_learning_rate if dense else args.learning_rate
    schedule = Schedule(kind="cosine", warmup=max(1, int(WARMUP_FRACTION * steps)), total=steps, min_ratio=args.min_lr)
    plan = TopkWarmup.plan(sender_config(args), steps, args.topk_warmup_steps, args.topk_warmup_factor)

    def held_out() -> float:
        with torch.no_grad():
            return float(np.mean([float(lm_loss(model, held[i])) for i in range(EVAL_BATCHES)]))

    optimizer = torch.optim.AdamW(model.parameters(), lr=peak, betas=ADAM_BETAS, weight_decay=0.0) if dense else None
    senders = [sender(spec, shapes, args) for _ in range(workers)] if not dense else []
    precond = [AdamPreconditioner() for _ in range(workers)] if args.precond == "adam" and not dense else []
    momentum: dict[str, torch.Tensor] = {}
    curve, sent_bytes, t0 = [], 0, time.perf_counter()
    every = max(1, steps // EVAL_POINTS)
    for step in range(steps):
        lr = lr_at(peak, schedule, step)
        grads = []
        for w in range(workers):
            model.zero_grad(set_to_none=True)
            lm_loss(model, train[step, w]).backward()
            grads.append({n: p.grad.detach().clone() for n, p in params.items()})
        if dense:
            for n, p in params.items():
                p.grad = sum(g[n] for g in grads) / workers
            for group in optimizer.param_groups:  # type: ignore[union-attr]
                group["lr"] = lr
            optimizer.step()  # type: ignore[union-attr]
        else:
            decoded = []
            for w in range(workers):
                g = precond[w](grads[w], lr) if precond else grads[w]
                if senders[w] is None:
                    decoded.append(g)
                    sent_bytes += 4 * sum(x.numel() for x in g.values())
                    continue
                out, nbytes = senders[w].send(g, plan.topk_at(step))
                decoded.append(out)
                sent_bytes += nbytes
            with torch.no_grad():
                for n, p in params.items():
                    agg = combine([d[n] for d in decoded], args.step)
                    if args.momentum:
                        agg = momentum[n] = momentum[n].mul_(args.momentum).add_(agg) if n in momentum else agg
                    if precond:
                        p.sub_(agg)  # the workers' own steps, averaged: outer SGD at lr 1
                    else:
                        p.sub_(step_of(agg, args.step), alpha=lr)
        if (step + 1) % every == 0 or step + 1 == steps:
            curve.append(round(held_out(), 4))
    params_count = sum(p.numel() for p in params.values())
    per_step = sent_bytes / (steps * workers) if sent_bytes else 4.0 * params_count
    return {
        "held_out_loss": curve[-1],
        "held_out_curve": curve,
        "bytes_per_worker_step": round(per_step),
        "x_fewer_than_fp32_gradients": round(4.0 * params_count / per_step, 1),
        "topk_plan": plan.why if spec in ("codec", "select:chunk", "select:tensor") else None,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    check_step(args.step)
    variants = [v for v in args.variants.split(",") if v]
    for spec in variants:  # every name checked before anything is read or trained
        sender(spec, {"w": (64, 64)}, args)
    if args.precond not in ("none", "adam"):
        raise SystemExit(f"unknown --precond {args.precond!r}: none or adam")
    row = args.sequence_length + 1
    ids = tokens(args.model, (args.steps * args.workers + EVAL_BATCHES) * args.batch_size * row)
    results = {spec: run_variant(spec, args, ids) for spec in variants}
    bar = results.get("dense", {}).get("held_out_loss")
    for r in results.values():
        if bar is not None:
            r["gap_vs_dense"] = round(r["held_out_loss"] / bar - 1, 5)
    keys = ("model", "workers", "steps", "batch_size", "sequence_length", "seed", "step", "momentum", "precond")
    return {**{k: getattr(args, k) for k in keys}, "variants": results}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated (default: {DEFAULT_VARIANTS})")
    p.add_argument("--model", default="gpt-5m")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=1e-3, help="the sign step's, or --precond's AdamW")
    p.add_argument("--dense-learning-rate", type=float, default=7e-4)
    p.add_argument("--min-lr", type=float, default=0.1, help="the cosine's end, a share of the peak")
    p.add_argument("--feedback-beta", type=float, default=0.999)
    p.add_argument("--topk", type=int, default=None, help="default: gradient mode's")
    p.add_argument("--bins", type=int, default=None, help="value levels (default: gradient mode's 16)")
    p.add_argument("--topk-warmup-steps", type=int, default=TOPK_WARMUP_STEPS)
    p.add_argument("--topk-warmup-factor", type=float, default=TOPK_WARMUP_FACTOR)
    p.add_argument("--step", default="sign", help="sign, vote, rms or clipC")
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--precond", default="none", help="none or adam")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one line of JSON")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    result = run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
