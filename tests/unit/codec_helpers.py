"""What several codec test files share: the codec settings a payload is assembled under, error feedback's
transmission, and byte corruption."""

from __future__ import annotations

import torch

from gradwire.compression import CodecConfig, CompressedGradient, ErrorFeedback, GradientCodec, PayloadError, serde

# Settings a payload assembled from parts (streamed buckets, ranks' shards) must match the single codec under.
ASSEMBLY_CONFIGS = {
    "lut8": CodecConfig(),
    "lut2-top90": CodecConfig(bins=4, topk=90),
    "sign": CodecConfig(values="sign"),
    "no-dct": CodecConfig(use_dct=False),
    "elias-fano": CodecConfig(bins=4, topk=143, indices="elias-fano"),
    "low-rank": CodecConfig(bins=4, topk=143, indices="elias-fano", rank=2),
    "low-rank-fit": CodecConfig(bins=4, topk=143, indices="elias-fano", rank_fits_topk=True),
}


def rounds_to_send(
    codec: GradientCodec, grads: dict[str, torch.Tensor], max_rounds: int, cosine: float = 0.95
) -> tuple[int, float]:
    """Compress the same gradient every round with error feedback (beta 0.999) until what was sent, summed,
    points the way the gradient does (``cosine``); returns (rounds, the cosine reached)."""
    feedback = ErrorFeedback(beta=0.999)
    flat = torch.cat([g.reshape(-1).float() for g in grads.values()])
    sent = torch.zeros_like(flat)
    cos = 0.0
    for rounds in range(1, max_rounds + 1):
        decoded = codec.decompress(codec.compress(grads, feedback))
        sent += torch.cat([decoded[n].reshape(-1) for n in grads])
        cos = float(torch.nn.functional.cosine_similarity(sent, flat, dim=0))
        if cos >= cosine:
            return rounds, cos
    return max_rounds, cos


def check_corrupted_byte(codec: GradientCodec, good: CompressedGradient, position: int, flip: int) -> None:
    """One flipped byte anywhere in a serialized payload: a ``PayloadError`` naming tensor and field, or a
    payload that still decodes to finite values - never another exception."""
    data = bytearray(serde.gradient_to_bytes(good))
    data[position % len(data)] ^= flip
    try:
        decoded = codec.decode(serde.gradient_from_bytes(bytes(data)))
    except PayloadError as e:
        assert isinstance(e.tensor, str) and isinstance(e.field, str)
        return
    assert len(decoded.indices) == len(codec.plan.groups)
    assert all(torch.isfinite(v).all() for v in decoded.values)
