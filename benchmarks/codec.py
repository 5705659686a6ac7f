"""What does the gradient codec cost and lose on one real gradient of a named model?

    python -m benchmarks.codec --model gpt-10m --json
    python -m benchmarks.codec --model opt-125m --json --repeats 3
    python -m benchmarks.codec --model gpt-10m --json --bins 4      # 2-bit values
    python -m benchmarks.codec --model gpt-10m --json --values sign # 1-bit values
    python -m benchmarks.codec --model gpt-10m --json --bins 4 --index-coding elias-fano

Builds the model from the registry, takes ONE gradient of the language-model loss on the start of the
shipped corpus, and measures on it:
  size      dense fp32 bytes vs payload bytes (serialized proto if serde is importable), and how much of the
            payload is metadata rather than indices and values;
  fidelity  relative L2 error and cosine of decompress(compress(g)) vs g, single shot, no error feedback
            (and the error with a float32 transform, where the default is bfloat16);
  time      compress (and with a float32 transform, side by side), decompress, and aggregation of 1, 8 and
            64 payloads (median over --repeats, after one warm-up call);
  top-k     the codec's per-chunk selection (``compression.select``) against torch.topk on the same
            coefficient stacks, side by side;
  DCT rate  achieved GFLOP/s of the forward chunk DCT over every chunk group of the model, next to plain
            2-D matmuls with the same FLOPs, timed by the same harness in the same run.
Prints one JSON object (``--json``: on one line).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the registry builds HF models from configs; never look online

import torch

from gradwire.assets import corpus_path
from gradwire.compression import CodecConfig, CompressedGradient, Encoding, GradientCodec
from gradwire.compression.config import INDEX_CODINGS, VALUE_CODINGS
from gradwire.compression.dct import dct_chunks
from gradwire.compression.packing import ef_chunk_bits
from gradwire.compression.select import topk_indices
from gradwire.memory import keep_freed_memory
from gradwire.models import build_model, lm_loss, model_names, tokenizer_for

AGGREGATE_COUNTS = (1, 8, 64)
DISTINCT_PAYLOADS = 4  # aggregation cost does not depend on content: 64 payloads reuse these in rotation
INDEX_BYTES = 1.5  # one 12-bit index per kept coefficient


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median wall time of fn() in milliseconds, after one untimed warm-up call (caches, allocator)."""
    return median_ms_each([fn], repeats, device)[0]


def median_ms_each(fns: Sequence[Callable[[], Any]], repeats: int, device: torch.device) -> list[float]:
    """Like ``median_ms`` for several functions, interleaved: a slow spell of the machine hits all alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1e3 for ts in times]


def max_seq_len(model: torch.nn.Module) -> int:
    cfg = model.config
    return getattr(cfg, "max_seq_len", None) or cfg.max_position_embeddings


def corpus_batch(model_name: str, batch: int, seq: int) -> torch.Tensor:
    """(batch, seq + 1) token ids: consecutive pieces of the start of the corpus, one row each."""
    text = corpus_path().read_text()
    need = batch * (seq + 1)
    # Tokenize only as much text as needed (a few chars per token), growing if a tokenizer packs denser.
    chars = 6 * need
    while True:
        ids = tokenizer_for(model_name).encode(text[:chars]).ids
        if len(ids) >= need or chars >= len(text):
            break
        chars *= 2
    if len(ids) < need:
        raise ValueError(f"the corpus has only {len(ids)} tokens; lower --batch-size or --seq-len")
    return torch.tensor(ids[:need]).view(batch, seq + 1)


def real_gradient(model: torch.nn.Module, tokens: torch.Tensor, seed: int) -> tuple[dict[str, torch.Tensor], float]:
    """One forward/backward in train mode (dropout included, as a worker computes it)."""
    torch.manual_seed(seed)  # dropout masks
    model.train()
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, tokens)
    loss.backward()
    # Tied weights appear once in named_parameters(); frozen or unused parameters have no gradient to send.
    grads = {name: p.grad.detach() for name, p in model.named_parameters() if p.grad is not None}
    return grads, loss.item()


def flat(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1).double() for n in names])  # float64: sums over 1e8 elements


def distinct_payloads(
    codec: GradientCodec, grads: dict[str, torch.Tensor], count: int, seed: int
) -> list[CompressedGradient]:
    """Payloads of ``count`` noisy copies of the gradient, as if from different workers.

    The noise (half of each tensor's std) changes which coefficients win top-k, so the payloads really
    differ in their indices, not only in their values.
    """
    gen = torch.Generator(device=next(iter(grads.values())).device).manual_seed(seed)
    out = []
    for _ in range(count):
        noisy = {}
        for name, g in grads.items():
            noise = torch.randn(g.shape, generator=gen, device=g.device, dtype=g.dtype)
            noisy[name] = g + 0.5 * g.std(correction=0) * noise
        out.append(codec.compress(noisy))
    return out


def dct_rates(codec: GradientCodec, repeats: int, device: torch.device) -> dict[str, float]:
    """GFLOP/s of the forward chunk DCT over all groups, and of plain matmuls with the same FLOPs.

    A stack of B chunks (r, c) costs 2*B*r*c*(r+c) FLOPs: a (B*r, c) @ (c, c) matmul for the rows and a
    batched (r, r) @ (r, c) for the columns. The reference does the same FLOPs as two plain 2-D matmuls,
    (B*r, c) @ (c, c) and (B*c, r) @ (r, r), which BLAS runs at its best for these sizes; 1-D stacks of B
    chunks of n are one (B, n) @ (n, n) matmul in both.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    stacks, flops = [], 0
    for g in codec.plan.groups:
        stacks.append(torch.randn((g.num_chunks, *g.chunk_shape), generator=gen, device=device))
        if len(g.chunk_shape) == 2:
            r, c = g.chunk_shape
            flops += 2 * g.num_chunks * r * c * (r + c)
        else:
            (n,) = g.chunk_shape
            flops += 2 * g.num_chunks * n * n
    mats = []
    for x in stacks:
        b = x.shape[0]
        if x.dim() == 3:
            r, c = x.shape[1:]
            # Views of the same storage: same data volume, no extra memory.
            mats.append((x.view(b * r, c), torch.randn(c, c, device=device)))
            mats.append((x.view(b * c, r), torch.randn(r, r, device=device)))
        else:
            mats.append((x, torch.randn(x.shape[1], x.shape[1], device=device)))

    def run_dct() -> None:
        for x in stacks:
            dct_chunks(x)

    def run_matmul() -> None:
        for a, b in mats:
            torch.matmul(a, b)

    dct_ms, mm_ms = median_ms_each([run_dct, run_matmul], repeats, device)
    dct_gflops = flops / (dct_ms * 1e-3) / 1e9
    mm_gflops = flops / (mm_ms * 1e-3) / 1e9
    return {
        "dct_gflop": flops / 1e9,
        "dct_ms": dct_ms,
        "dct_gflops": dct_gflops,
        "matmul_peak_gflops": mm_gflops,
        "dct_fraction_of_peak": dct_gflops / mm_gflops,
    }


def select_times(
    codec: GradientCodec, grads: dict[str, torch.Tensor], repeats: int, device: torch.device
) -> dict[str, float]:
    """The per-chunk top-k of every chunk group: ``compression.select`` against ``torch.topk``, interleaved."""
    scores = [codec._coefficients(g, grads).float().abs() for g in codec.plan.groups]

    def ours() -> None:
        for s, g in zip(scores, codec.plan.groups):
            topk_indices(s, g.k)

    def torchs() -> None:
        for s, g in zip(scores, codec.plan.groups):
            s.topk(g.k, dim=1, sorted=False)

    ours_ms, torch_ms = median_ms_each([ours, torchs], repeats, device)
    return {"select_ms": ours_ms, "select_torch_topk_ms": torch_ms, "select_speedup": torch_ms / ours_ms}


def payload_size(payload: CompressedGradient) -> tuple[int, str]:
    try:
        from gradwire.compression.serde import gradient_to_bytes
    except ImportError:  # serde lands separately from the codec; fall back to the data bytes
        return payload.nbytes, "nbytes"
    return len(gradient_to_bytes(payload)), "proto"


def essential_bytes(payload: CompressedGradient, codec: GradientCodec) -> float:
    """Bytes that carry the gradient itself: the kept indices' bits plus the value bytes.

    Sparse tensors: 1.5 bytes of index per kept coefficient (Elias-Fano: each chunk's code, unpadded) plus
    its packed value (ceil(log2(bins)) bits
    as a LUT code, 1 bit as a sign, 4 bytes as float32). Dense tensors: their value bytes. Everything else
    (lookup tables, shift/scale, index and bit padding, names, shapes, settings, protobuf framing) is
    metadata.
    """
    total = 0.0
    for plan, t in zip(codec.plan.tensors, payload.tensors):
        if t.encoding == Encoding.SPARSE and codec.config.indices == "elias-fano":
            total += plan.num_chunks * ef_chunk_bits(plan.k, plan.chunk_numel) / 8
        elif t.encoding == Encoding.SPARSE:
            total += plan.num_values * INDEX_BYTES
        total += len(t.values)
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    model = build_model(args.model, seed=args.seed).to(device)
    seq = args.seq_len or min(256, max_seq_len(model))
    if seq > max_seq_len(model):
        raise ValueError(f"--seq-len {seq} exceeds the model's maximum of {max_seq_len(model)}")
    tokens = corpus_batch(args.model, args.batch_size, seq).to(device)

    t0 = time.perf_counter()
    grads, loss = real_gradient(model, tokens, args.seed)
    backward_s = time.perf_counter() - t0
    del model  # the gradients are all we need; free the weights and activations' allocator slack
    names = list(grads)

    config = CodecConfig(
        topk=args.topk, chunk=args.chunk, bins=args.bins, values=args.values, indices=args.index_coding
    )
    codec = GradientCodec({n: tuple(g.shape) for n, g in grads.items()}, config, device=device)
    # The same codec with a float32 transform, beside the default one (bfloat16 on CPUs that multiply it).
    exact = GradientCodec(
        {n: tuple(g.shape) for n, g in grads.items()}, config, device=device, transform_dtype=torch.float32
    )

    payload = codec.compress(grads)
    restored = codec.decompress(payload)
    g, r = flat(grads, names), flat(restored, names)
    rel_error = ((g - r).norm() / g.norm()).item()
    cosine = (g @ r / (g.norm() * r.norm())).item()
    r32 = flat(exact.decompress(exact.compress(grads)), names)
    rel_error_float32 = ((g - r32).norm() / g.norm()).item()
    del g, r, r32, restored

    compress_ms, compress_float32_ms = median_ms_each(
        [lambda: codec.compress(grads), lambda: exact.compress(grads)], args.repeats, device
    )
    decompress_ms = median_ms(lambda: codec.decompress(payload), args.repeats, device)
    distinct = distinct_payloads(codec, grads, DISTINCT_PAYLOADS, args.seed)
    aggregate_ms = {
        str(n): median_ms(
            lambda n=n: codec.aggregate([distinct[i % len(distinct)] for i in range(n)]), args.repeats, device
        )
        for n in AGGREGATE_COUNTS
    }
    aggregate_float64_ms = {  # --replay-precision float64: what CUDA workers under a CPU coordinator pay
        str(n): median_ms(
            lambda n=n: codec.aggregate([distinct[i % len(distinct)] for i in range(n)], dtype=torch.float64),
            args.repeats,
            device,
        )
        for n in AGGREGATE_COUNTS
    }
    distinct.clear()  # free the payloads

    payload_bytes, measure = payload_size(payload)
    dense_bytes = 4 * sum(t.numel() for t in grads.values())
    metadata = payload_bytes - essential_bytes(payload, codec)
    rates = dct_rates(codec, args.repeats, device)
    selection = select_times(codec, grads, args.repeats, device)
    sparse = [t for t in codec.plan.tensors if t.encoding == Encoding.SPARSE]
    return {
        "model": args.model,
        "params": sum(t.numel() for t in grads.values()),
        "tensors": len(names),
        "sparse_tensors": len(sparse),
        "chunk_groups": [[list(gr.chunk_shape), gr.num_chunks] for gr in codec.plan.groups],
        "codec": {"topk": config.topk, "chunk": config.chunk, "bins": config.bins, "values": config.values},
        "value_formats": dict(collections.Counter(t.value_format.name for t in codec.plan.tensors)),
        "batch_size": args.batch_size,
        "seq_len": seq,
        "loss": loss,
        "backward_s": backward_s,
        "dense_bytes": dense_bytes,
        "payload_bytes": payload_bytes,
        "payload_measure": measure,
        "ratio": dense_bytes / payload_bytes,
        "bits_per_param": 8 * payload_bytes / (dense_bytes / 4),
        "payload_metadata_bytes": round(metadata),
        "metadata_fraction": metadata / payload_bytes,
        "rel_error": rel_error,
        "cosine": cosine,
        "transform_dtype": str(codec.transform_dtype).removeprefix("torch."),
        "rel_error_float32_transform": rel_error_float32,
        "compress_ms": compress_ms,
        "compress_float32_transform_ms": compress_float32_ms,
        "decompress_ms": decompress_ms,
        "aggregate_ms": aggregate_ms,
        "aggregate_float64_ms": aggregate_float64_ms,
        **selection,
        **rates,
        "repeats": args.repeats,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-10m", choices=model_names(), help="registry name")
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
    parser.add_argument(
        "--topk", type=int, default=CodecConfig.topk, help="coefficients kept per full chunk x chunk chunk"
    )
    parser.add_argument("--chunk", type=int, default=CodecConfig.chunk, help="chunk edge (<= 64)")
    parser.add_argument(
        "--bins", type=int, default=CodecConfig.bins, help="quantization bins (4: 2-bit codes); 0 sends float32"
    )
    parser.add_argument(
        "--values", default=CodecConfig.values, choices=VALUE_CODINGS, help="value coding: LUT codes or sign bits"
    )
    parser.add_argument(
        "--index-coding", default=CodecConfig.indices, choices=INDEX_CODINGS, help="index coding: 12 bits or Elias-Fano"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default min(256, model max))")
    parser.add_argument("--batch-size", type=int, default=4, help="rows of the gradient batch")
    parser.add_argument("--seed", type=int, default=0, help="model init, dropout and noise seed")
    args = parser.parse_args()
    keep_freed_memory()  # as the worker and coordinator processes do
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.batch_size < 1 or (args.seq_len is not None and args.seq_len < 1):
        parser.error("--batch-size and --seq-len must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    try:
        CodecConfig(topk=args.topk, chunk=args.chunk, bins=args.bins, values=args.values, indices=args.index_coding)
    except ValueError as e:
        parser.error(f"--topk/--chunk/--bins/--values/--index-coding: {e}")

    result = run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
