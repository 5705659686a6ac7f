"""A worker's encodes transform in the dtype it is built with: ``WorkerEngine(transform_dtype=...)`` reaches
every codec a session makes (the replica's, a fragment's, a split node's shard, a streamed round's buckets),
and its payloads are those of a codec built with that dtype. ``benchmarks.quality`` pins float32 with it, so
a run's bits do not depend on whether the CPU multiplies bfloat16 natively."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import quality
from gradwire import hardware
from gradwire.compression import CodecConfig, GradientCodec
from gradwire.compression.fragment import Fragment
from gradwire.compression.serde import gradient_to_proto
from gradwire.models import build_from_spec, model_spec
from gradwire.statestream import StateHeader
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.session import Session

RULE = '{"optimizer": "sgd"}'
SPEC = model_spec("gpt-tiny")


def _session(engine: WorkerEngine) -> Session:
    session = engine._new_session(StateHeader("tiny", 0, json.dumps(SPEC), RULE), b"")
    for name, p in build_from_spec(SPEC, seed=1).named_parameters():
        session.load("parameters", name, p.detach())
    session.loaded()
    return session


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU that multiplies bfloat16 natively, where the default transform is bfloat16."""
    monkeypatch.setattr(hardware, "cpu_multiplies_bf16", lambda: True)


@pytest.mark.usefixtures("bf16_cpu")
def test_every_codec_of_a_session_transforms_in_the_engines_dtype() -> None:
    config = CodecConfig()
    default, pinned = _session(WorkerEngine("cpu")), _session(quality._engine("cpu"))
    assert default.replica.codec(config).transform_dtype == torch.bfloat16
    names = list(pinned.replica.shapes)
    codecs = [
        pinned.replica.codec(config),
        pinned.replica.codec(config, Fragment(0, 2)),
        pinned.shard_codec(config, names[: len(names) // 2]),
        *pinned.stream_plan(config, 2).codecs,
    ]
    assert len(codecs) >= 5 and all(c.transform_dtype == torch.float32 for c in codecs)


@pytest.mark.usefixtures("bf16_cpu")
def test_a_pinned_sessions_payload_is_a_float32_codecs_and_not_a_bfloat16_ones() -> None:
    session = _session(WorkerEngine("cpu", transform_dtype=torch.float32))
    config = CodecConfig(topk=8)
    shapes = dict(session.replica.shapes)
    g = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(s, generator=g) for n, s in shapes.items()}

    def payload(codec: GradientCodec) -> bytes:
        return gradient_to_proto(codec.compress({n: t.clone() for n, t in grads.items()})).SerializeToString()

    pinned = payload(session.replica.codec(config))
    assert pinned == payload(GradientCodec(shapes, config, transform_dtype=torch.float32))
    assert pinned != payload(GradientCodec(shapes, config, transform_dtype=torch.bfloat16))
