"""Do the CUDA paths compute what the CPU paths compute? One command a GPU user can run.

    python -m benchmarks.gpu --json                       # gpt-tiny, every check once (~1 min on a GPU)
    python -m benchmarks.gpu --model gpt-10m --json       # a larger model
    python -m benchmarks.gpu --model llama-1b --checks autocast --json   # the 1B Llama's bf16 (~1 min)

Each check runs once on ``--device`` (default cuda:0) against the CPU and reports what it found:

  codec     a worker on the GPU compresses a real gradient; the payload decoded on the CPU against the
            same payload decoded on the GPU (max abs difference), and against the CPU worker's gradient
            (cosine): the codec's plan and bytes are device-independent
  autocast  bf16 autocast gradients against float32 ones on the GPU (cosine, relative L2 error)
  muon      torch's Muon step (Newton-Schulz in bfloat16) against gradwire's float32 iteration, same state
  stream    a worker's gradient-mode round sent whole and streamed as the backward produces it
            (``--stream-buckets 4``), in float32 and bf16: compute, encode after it, round (ms), and how
            far the streamed payloads decode from the whole ones
  drift     a CPU replica and a GPU replica replay the same ``--updates`` sign-SGD updates: the largest
            parameter difference at the end, with float32 replays and with float64 ones (which round
            once and should agree bit for bit)
  codec_low_rank, drift_low_rank
            the codec and float32 drift checks with local-SGD rounds' default codec (``--rank fit``: every
            matrix as int8 factors, factored by an SVD on the GPU; decoded in float64, so the replays
            should agree bit for bit)
  fingerprint
            the model's fingerprint on the GPU planned (a few launches a slab) and a tensor at a time: time and
            kernels of each, and the planned one against the CPU's
  refine    a local-SGD round's ``--rank fit`` refinement of the model's matrices, stack by stack, with
            Householder QR (torch's, which on a GPU factors one matrix at a time) and the batched Cholesky-QR a
            GPU takes: time and kernels of each, and how far what they send differs
  node      with two GPUs, a 2-rank NCCL node (``worker serve --nproc-per-node 2``) in each mode (ddp,
            fsdp, pipeline) against one GPU on the whole batch (max abs difference of the gradient)
  memory    with two GPUs, what each rank of a ddp, fsdp and pipeline node holds of a local-SGD run's
            state and its peak allocation (``benchmarks.shard`` on CUDA)

The two-GPU checks are skipped with one GPU. Without CUDA it says so and exits 0. Every check is a
function of the devices it compares, so the tests run them CPU against CPU. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from gradwire.compression import CodecConfig, ErrorFeedback, lowrank
from gradwire.compression.payload import Encoding
from gradwire.compression.plan import ModelPlan, matrix_view
from gradwire.compression.robust import AggregationRule
from gradwire.coordinator.config import DENSE_CODEC, TrainConfig
from gradwire.fingerprint import FingerprintPlan, fingerprint, sample_positions
from gradwire.models import build_from_spec, lm_loss, model_names, model_spec
from gradwire.optim.muon import Muon, orthogonalize
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, ModelState, WorkOrder
from gradwire.replica import Replica, StateUpdate
from gradwire.worker.compute import Placement
from gradwire.worker.engine import WorkerEngine


def _state(spec: dict) -> tuple[Replica, ModelState]:
    replica = Replica(build_from_spec(spec, seed=0), UpdateRule(optimizer="sgd"))
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    return replica, ModelState("gpu-check", 0, json.dumps(spec), params, replica.rule.to_json())


def _batch(spec: dict, rows: int = 4, columns: int = 65, seed: int = 0) -> np.ndarray:
    vocab = spec["config"].get("vocab_size", 8192)
    return np.random.default_rng(seed).integers(0, vocab, (rows, columns)).astype(np.uint16)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().float().cpu().flatten() for t in tensors.values()])


TOP_K = CodecConfig()  # gradient mode's default codec
# Centralized local-SGD rounds' default codec: every matrix as int8 factors at the rank that fits its top-k's
# bytes, vectors dense.
LOW_RANK = CodecConfig(bins=4, topk=143, indices="elias-fano", rank_fits_topk=True)


def check_codec(spec: dict, device: str, config: CodecConfig = TOP_K) -> dict[str, Any]:
    """A worker on ``device`` and one on the CPU compute and compress the same round."""
    replica, state = _state(spec)
    order = WorkOrder("gpu-check", 0, 0, _batch(spec), config, replica.fingerprint())
    payloads = {}
    for where in ("cpu", device):
        engine = WorkerEngine(where)
        engine.push_state(state)
        result = engine.run_round(order)
        assert result.status == OK, result.reason
        payloads[where] = result.gradient
    on_cpu = replica.codec(config).decompress(payloads[device])
    on_device = Replica(build_from_spec(spec, seed=0).to(device), replica.rule).codec(config)
    decoded_there = on_device.decompress(payloads[device])
    reference = replica.codec(config).decompress(payloads["cpu"])
    return {
        "payload_bytes": payloads[device].nbytes,
        "decode_cpu_vs_device_max_abs": float((_flat(on_cpu) - _flat(decoded_there)).abs().max()),
        "device_vs_cpu_worker_cosine": _cosine(_flat(on_cpu), _flat(reference)),
    }


def check_autocast(spec: dict, device: str) -> dict[str, Any]:
    """bf16 autocast gradients against float32 ones, both on ``device``."""
    tokens = torch.from_numpy(_batch(spec).astype(np.int64)).to(device)
    grads = {}
    for precision in ("fp32", "bf16"):
        model = build_from_spec(spec, seed=0).to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_loss(model, tokens)
        loss.backward()
        grads[precision] = _flat({n: p.grad for n, p in model.named_parameters()})
    error = float(torch.linalg.vector_norm(grads["bf16"] - grads["fp32"]) / torch.linalg.vector_norm(grads["fp32"]))
    return {"cosine": _cosine(grads["bf16"], grads["fp32"]), "relative_l2_error": error}


def check_muon(device: str, shape: tuple[int, int] = (256, 768)) -> dict[str, Any]:
    """One Muon step with Newton-Schulz in bfloat16 (torch's) against the float32 iteration, same state."""
    gen = torch.Generator().manual_seed(0)
    start, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    steps = {}
    for dtype in (torch.bfloat16, torch.float32):
        p = torch.nn.Parameter(start.clone().to(device))
        p.grad = grad.clone().to(device)
        optimizer = Muon([p], lr=0.02, weight_decay=0.0)
        if dtype == torch.float32:  # the float32 path, whatever the device multiplies natively
            update = orthogonalize(grad.to(device), optimizer.defaults["ns_coefficients"], 5, 1e-7, torch.float32)
            steps[dtype] = update.float().cpu()
            continue
        optimizer.step()
        steps[dtype] = (start.to(device) - p.detach()).float().cpu()
    a, b = steps[torch.bfloat16], steps[torch.float32]
    return {"cosine": _cosine(a, b), "shape": list(shape)}


def check_drift(
    spec: dict, device_a: str, device_b: str, updates: int, exact: bool, config: CodecConfig = TOP_K
) -> dict[str, Any]:
    """Two replicas, on ``device_a`` and ``device_b``, replay the same ``updates`` sign-SGD updates."""
    rule = UpdateRule(optimizer="signsgd")
    replicas = [Replica(build_from_spec(spec, seed=0).to(d), rule) for d in (device_a, device_b)]
    sender = Replica(build_from_spec(spec, seed=0), rule)  # where the payloads come from, on the CPU
    codec = sender.codec(config)
    feedback = [ErrorFeedback(beta=0.999) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(updates):
        payloads = tuple(
            codec.compress({n: torch.randn(p.shape, generator=gen) for n, p in sender.params.items()}, f)
            for f in feedback
        )
        update = StateUpdate(1e-3, payloads, (1.0, 1.0), rule=AggregationRule(mode="mean", exact=exact))
        for replica in replicas:
            replica.apply(update)
    a, b = (_flat(r.params) for r in replicas)
    return {"updates": updates, "max_abs_difference": float((a - b).abs().max()), "equal": bool(torch.equal(a, b))}


def check_node(
    spec: dict, device: str = "cuda", modes: tuple[str, ...] = ("ddp", "fsdp", "pipeline")
) -> dict[str, Any]:
    """A 2-rank NCCL node in each mode against one GPU on the whole batch (needs two GPUs)."""
    from benchmarks.node import worker  # the same launcher as the node benchmark

    replica, state = _state(spec)
    order = WorkOrder("gpu-check", 0, 0, _batch(spec), DENSE_CODEC, replica.fingerprint())
    single = WorkerEngine(f"{device}:0")
    single.push_state(state)
    reference = replica.codec(DENSE_CODEC).decompress(single.run_round(order).gradient)
    out = {}
    for mode in modes:
        with worker(2, device, None, 4, mode) as (client, _):
            client.push_state(state)
            result, _ = client.run_round(order)
        got = replica.codec(DENSE_CODEC).decompress(result.gradient)
        out[f"{mode}_max_abs_difference"] = float((_flat(got) - _flat(reference)).abs().max())
    return out


def check_memory(model: str, device: str = "cuda", modes: str = "ddp,fsdp,pipeline") -> dict[str, Any]:
    """What each rank of a 2-GPU node holds of a local-SGD run's state and its peak allocation, per node
    mode, beside DDP's (``benchmarks.shard``; needs two GPUs)."""
    from benchmarks import shard

    args = shard.main_args(["--model", model, "--device", device, "--rounds", "1", "--modes", modes])
    modes = shard.run(args)["modes"]
    keys = ("state_bytes_per_parameter_per_rank", "state_vs_ddp", "peak_vs_ddp", "round_time_vs_ddp")
    return {mode: {k: m.get(k) for k in keys} for mode, m in modes.items()}


def check_stream(spec: dict, device: str, rounds: int = 12, buckets: int = 4, rows: int = 8) -> dict[str, Any]:
    """A worker's gradient-mode round on ``device``, sent whole and streamed in ``buckets`` pieces as the
    backward produces them (``--stream-buckets``; on a GPU each bucket is compressed on the encode's own
    CUDA stream), in float32 and under bf16 autocast: the medians over the rounds after the first quarter,
    in milliseconds, of the compute, of the encode left after it (``compress``) and of the whole round, and
    how far the streamed payloads decode from the whole ones (max abs), beside how far a second whole run
    decodes from the first: a GPU's backward is not bit-deterministic, and top-k turns its noise into
    whole coefficients chosen or not. On a CPU float32 alone: bf16 autocast there is seconds a round and
    says nothing of a GPU."""
    replica, state = _state(spec)
    codec = replica.codec(CodecConfig())
    out: dict[str, Any] = {"rounds": rounds, "rows": rows, "buckets": buckets}
    for precision in ("fp32", "bf16") if torch.device(device).type == "cuda" else ("fp32",):
        decoded: dict[str, list[dict[str, torch.Tensor]]] = {}
        # "whole_again": the whole rounds a second time, the device's noise floor
        for name, b in (("whole", 0), ("streamed", buckets), ("whole_again", 0)):
            engine = WorkerEngine(device, placement=Placement(precision=precision))
            engine.push_state(state)
            timings, decoded[name] = [], []
            for r in range(rounds):
                batch = _batch(spec, rows=rows, columns=257, seed=r)
                order = WorkOrder("gpu-check", r, 0, batch, CodecConfig(), replica.fingerprint(), stream_buckets=b)
                result = engine.run_round(order, emit=(lambda piece: None) if b else None)
                assert result.status == OK, result.reason
                timings.append(result.timings)
                decoded[name].append(codec.decompress(result.gradient))
            if name != "whole_again":
                kept = timings[rounds // 4 :]
                out[f"{precision}_{name}_ms"] = {
                    k: round(statistics.median(t[k] for t in kept) * 1000, 2) for k in ("compute", "compress", "total")
                }
        for name in ("streamed", "whole_again"):
            out[f"{precision}_{name}_vs_whole_max_abs"] = max(
                float((s[n] - w[n]).abs().max()) for s, w in zip(decoded[name], decoded["whole"]) for n in w
            )
    return out


def check_fingerprint(spec: dict, device: str, repeats: int = 10) -> dict[str, Any]:
    """The model's fingerprint on ``device`` planned (``FingerprintPlan``: a few launches a slab), a tensor
    at a time, and its samples alone (what the versions between two ``--fingerprint-every`` take), each timed
    (median of ``repeats``) with the work it issues (kernels on a GPU, top-level ops on a CPU); and the planned
    one against the CPU's (the largest relative difference of a sum or a sum of squares, and whether the
    samples are the same bits, the samples alone included)."""
    model = build_from_spec(spec, seed=0).to(device)
    named = list(model.named_parameters())
    tensors = [p.detach() for _, p in named]
    positions = sample_positions([(n, p.shape) for n, p in named])
    plan = FingerprintPlan([t.numel() for t in tensors], positions, torch.device(device))
    out: dict[str, Any] = {"tensors": len(tensors), "slabs": len(plan.slabs)}
    ways = {
        "planned": lambda: plan(tensors),
        "per_tensor": lambda: fingerprint(tensors, positions),
        "samples_only": lambda: plan(tensors, with_moments=False),
    }
    for name, way in ways.items():
        way()  # warm: a first call allocates
        out[f"{name}_ms"] = statistics.median(_timed(way, device) for _ in range(repeats)) * 1e3
        out[f"{name}_launches"] = launches(way, device)
    got, cpu = plan(tensors), fingerprint([t.cpu() for t in tensors], positions)
    stats = zip(got.sums + got.sumsqs, cpu.sums + cpu.sumsqs)
    out["max_rel_diff_vs_cpu"] = max((abs(a - b) / max(abs(b), 1e-300) for a, b in stats), default=0.0)
    out["samples_equal"] = got.samples == cpu.samples == plan(tensors, with_moments=False).samples
    return out


def check_refine(model: str, device: str, repeats: int = 5) -> dict[str, Any]:
    """A local-SGD round's refinement of ``model``'s matrices under ``--rank fit`` (the defaults at H 30): each
    stack of same-shape matrices, as the codec stacks them, refined from a carried subspace (``lowrank.refine``)
    with Householder QR (``torch.linalg.qr``) and with the batched Cholesky-QR (``lowrank.cholesky_qr``), each
    timed (median of ``repeats``) with the work it issues, and how far the factors they send differ."""
    config = TrainConfig(model=model, inner_steps=30).codec_config()
    shapes = {n: tuple(p.shape) for n, p in build_from_spec(model_spec(model), seed=0).named_parameters()}
    stacks: dict[tuple[int, int, int], int] = {}
    for t in ModelPlan.build(shapes, config).dense:
        if t.encoding == Encoding.LOW_RANK:
            key = (*matrix_view(t.shape), t.k)
            stacks[key] = stacks.get(key, 0) + 1
    g = torch.Generator().manual_seed(0)
    work = []
    for (rows, cols, k), count in stacks.items():
        # A pseudo-gradient's spectrum, roughly: 64 directions falling as 1 / (i + 1), and a little noise.
        decay = 1.0 / torch.arange(1, 65)
        m = (torch.randn(count, rows, 64, generator=g) * decay) @ torch.randn(count, 64, cols, generator=g)
        m += 1e-3 * torch.randn(count, rows, cols, generator=g)
        q, _ = torch.linalg.qr(torch.randn(count, cols, lowrank.carried_width(k, rows, cols), generator=g))
        work.append((m.to(device), q.to(device), k))
    ways = {"householder": torch.linalg.qr, "cholesky": lowrank.cholesky_qr}
    out: dict[str, Any] = {
        "stacks": len(work),
        "matrices": sum(stacks.values()),
        "default": next(name for name, qr in ways.items() if lowrank.thin_qr(torch.device(device)) is qr),
    }
    sent = {}
    for name, qr in ways.items():
        refine_all = functools.partial(_refine_all, work, qr)
        sent[name] = [a @ b for a, b, _ in refine_all()]  # warm, and what each sends
        out[f"{name}_ms"] = statistics.median(_timed(refine_all, device) for _ in range(repeats)) * 1e3
        out[f"{name}_launches"] = launches(refine_all, device)
    out["max_rel_diff"] = max(
        float(torch.linalg.matrix_norm(a - b).max() / torch.linalg.matrix_norm(a).min())
        for a, b in zip(sent["householder"], sent["cholesky"])
    )
    return out


def _refine_all(work: Sequence[tuple[torch.Tensor, torch.Tensor, int]], qr: lowrank.QR) -> list[tuple]:
    """``lowrank.refine`` of every (stack, carried subspace, rank) of ``work`` with the thin QR ``qr``."""
    return [lowrank.refine(m, q, k, qr=qr) for m, q, k in work]


def _timed(call: Any, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    call()
    _sync(device)
    return time.perf_counter() - t0


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def launches(call: Any, device: str) -> int:
    """The kernels ``call`` launches on a GPU; on a CPU, the top-level operators it dispatches."""
    on_gpu = torch.device(device).type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        call()
        _sync(device)
    if on_gpu:
        return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))


# Every check, in the order it runs; --checks picks some.
CHECKS = (
    "codec",
    "autocast",
    "muon",
    "drift_float32",
    "drift_float64",
    "codec_low_rank",
    "drift_low_rank",
    "stream",
    "fingerprint",
    "refine",
    "node",
    "memory",
)


def run(model: str, device: str, updates: int, only: Sequence[str] = CHECKS) -> dict[str, Any]:
    """The checks named in ``only`` (all by default) on ``model``, each reported with its seconds."""
    spec = model_spec(model)
    out: dict[str, Any] = {"model": model, "device": device, "torch": torch.__version__}
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        out["device_name"] = torch.cuda.get_device_name(torch.device(device))
    checks = {
        "codec": lambda: check_codec(spec, device),
        "autocast": lambda: check_autocast(spec, device),
        "muon": lambda: check_muon(device),
        "drift_float32": lambda: check_drift(spec, "cpu", device, updates, exact=False),
        "drift_float64": lambda: check_drift(spec, "cpu", device, updates, exact=True),
        "codec_low_rank": lambda: check_codec(spec, device, LOW_RANK),
        "drift_low_rank": lambda: check_drift(spec, "cpu", device, updates, exact=False, config=LOW_RANK),
        "stream": lambda: check_stream(spec, device, *((12, 4, 8) if on_gpu else (2, 4, 2))),
        "fingerprint": lambda: check_fingerprint(spec, device),
        "refine": lambda: check_refine(model, device),
    }
    if torch.cuda.device_count() >= 2:
        checks["node"] = lambda: check_node(spec)
        checks["memory"] = lambda: check_memory(model)
    else:
        out.update({name: {"skipped": "needs two GPUs"} for name in ("node", "memory") if name in only})
    for name, check in checks.items():
        if name not in only:
            continue
        t0 = time.perf_counter()
        try:
            out[name] = {**check(), "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as e:  # noqa: BLE001 - a failed check is a finding, reported with the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _checks(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check(s) {unknown or [text]}; the checks are {','.join(CHECKS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny", choices=model_names())
    parser.add_argument("--device", default="cuda:0", help="the CUDA device to check (default: cuda:0)")
    parser.add_argument("--updates", type=int, default=100, help="replayed updates of the drift check")
    parser.add_argument(
        "--checks",
        type=_checks,
        default=CHECKS,
        help=f"a comma-separated subset of the checks to run (default: all: {','.join(CHECKS)}); on llama-1b the "
        "codec and drift checks compute a billion parameters' rounds and replays on the CPU too",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "reason": "no CUDA device: nothing to check"}))
        return 0
    result = {"cuda": True, **run(args.model, args.device, args.updates, args.checks)}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
