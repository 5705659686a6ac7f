"""The CUDA path, where a GPU is present (CI has none; the device machine runs these): the worker on a
GPU, bf16 autocast, the codec on the device, and a node of NCCL ranks when the box has two GPUs.

    HF_HUB_OFFLINE=1 python -m pytest -q -m cuda tests/integration/test_cuda.py
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from gradwire.compression import CodecConfig
from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.config import DENSE_CODEC
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, ModelState, WorkOrder
from gradwire.replica import Replica
from gradwire.worker.compute import Placement
from gradwire.worker.engine import WorkerEngine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SPEC = model_spec("gpt-tiny")


def _state() -> tuple[Replica, ModelState]:
    replica = Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"))
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    return replica, ModelState("run", 0, json.dumps(SPEC), params, replica.rule.to_json())


def _order(replica: Replica, codec: CodecConfig, rows: int = 4) -> WorkOrder:
    batch = np.random.default_rng(0).integers(0, 8192, (rows, 65)).astype(np.uint16)
    return WorkOrder("run", 0, 0, batch, codec, replica.fingerprint())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gpu_worker_computes_the_cpu_gradient(precision):
    replica, state = _state()
    order = _order(replica, DENSE_CODEC)
    results = {}
    for device, p in (("cpu", "fp32"), ("cuda:0", precision)):
        engine = WorkerEngine(device, placement=Placement(precision=p))
        engine.push_state(state)
        result = engine.run_round(order)
        assert result.status == OK
        results[device] = replica.codec(DENSE_CODEC).decompress(result.gradient)
    for name, g in results["cpu"].items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), results["cuda:0"][name].flatten(), dim=0)
        assert cos > (0.999 if precision == "fp32" else 0.95) or g.abs().max() < 1e-6, name


def test_the_codec_on_the_gpu_sends_what_the_cpu_decodes():
    replica, state = _state()
    engine = WorkerEngine("cuda:0")
    engine.push_state(state)
    payload = engine.run_round(_order(replica, CodecConfig())).gradient
    decoded = replica.codec(CodecConfig()).decompress(payload)  # on the CPU
    assert all(torch.isfinite(t).all() for t in decoded.values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_two_gpu_nccl_node_computes_what_one_gpu_computes(tmp_path):
    from .test_node import node  # the same launcher, on GPUs

    replica, state = _state()
    order = _order(replica, DENSE_CODEC)
    single = WorkerEngine("cuda:0")
    single.push_state(state)
    reference = replica.codec(DENSE_CODEC).decompress(single.run_round(order).gradient)
    with node(tmp_path, "--device", "cuda") as (address, _), WorkerClient(address, timeout=120) as client:
        assert client.describe().rank_devices == ("cuda:0", "cuda:1")
        client.push_state(state)
        result, _ = client.run_round(order)
        got = replica.codec(DENSE_CODEC).decompress(result.gradient)
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], atol=1e-4, rtol=1e-3)


def test_a_gradient_streamed_on_the_gpu_is_the_payload_sent_whole():
    """Streamed on a GPU, each bucket is compressed on the encode's own CUDA stream while the backward goes
    on (worker.streaming): put together, the pieces are the payload one message carries, round after round
    (the error feedback moved alike), to the GPU's own noise. A GPU's backward is not bit-deterministic (the
    embedding's gradient sums with atomics): on an H200 two whole-payload runs differ by ~5e-9 after
    decoding, and so does the streamed one; on a CPU the pieces are the payload byte for byte
    (tests/integration/test_streaming.py)."""
    replica, state = _state()
    codec = replica.codec(CodecConfig())
    sent: dict[int, list] = {}
    for buckets in (0, 4):
        engine = WorkerEngine("cuda:0")
        engine.push_state(state)
        pieces: list = []
        sent[buckets] = []
        for r in range(3):
            order = dataclasses.replace(_order(replica, CodecConfig()), round=r, stream_buckets=buckets)
            result = engine.run_round(order, emit=pieces.append if buckets else None)
            assert result.status == OK
            sent[buckets].append(codec.decompress(result.gradient))
        assert len(pieces) >= 6 if buckets else not pieces  # several pieces a round (gpt-tiny's embedding is most)
    for streamed, whole in zip(sent[4], sent[0]):
        for name in whole:
            torch.testing.assert_close(streamed[name], whole[name], atol=1e-6, rtol=0)


def test_the_carried_subspace_refined_on_the_gpu_sends_what_the_cpu_sends():
    """``--rank fit`` on a GPU refines each stack of matrices with the batched Cholesky-QR (``lowrank.cholesky_qr``,
    not ``torch.linalg.qr``'s loop over the batch); what a sender sends from it is the CPU's Householder
    refinement's, to float32's noise, round after round with the error feedback."""
    from gradwire.compression import lowrank
    from gradwire.compression.codec import GradientCodec
    from gradwire.compression.feedback import ErrorFeedback

    shapes = {"q": (256, 128), "k": (256, 128), "out": (128, 384)}
    config = CodecConfig(bins=4, topk=512, indices="elias-fano", rank_fits_topk=True)
    assert lowrank.thin_qr(torch.device("cuda", 0)) is lowrank.cholesky_qr
    g = torch.Generator().manual_seed(0)
    # Decaying spectra, so that each matrix's top directions are well apart and both devices find the same.
    rounds = [
        {n: torch.randn(s, generator=g) @ torch.diag(1.0 / torch.arange(1, s[1] + 1)) for n, s in shapes.items()}
        for _ in range(3)
    ]
    sent = {}
    for device in ("cpu", "cuda:0"):
        codec, feedback = GradientCodec(shapes, config, device=device), ErrorFeedback(beta=0.95)
        payloads = [codec.compress({n: x.to(device) for n, x in r.items()}, feedback) for r in rounds]
        sent[device] = [codec.decompress(p) for p in payloads]
        assert all(q.device.type == torch.device(device).type for q in feedback.subspaces.values())
    for cpu, gpu in zip(sent["cpu"], sent["cuda:0"]):
        for name in shapes:
            rel = float((cpu[name] - gpu[name].cpu()).norm() / cpu[name].norm())
            assert rel < 2e-2, (name, rel)  # int4 codes: a code's rounding may flip between the two


def test_gossip_rounds_with_demuon_train_on_the_gpu(tmp_path):
    """The quality benchmark's gossip rows with the workers on the GPU (its ``--device``): each worker's
    DeMuon steps, its mix and its codec on the device, the coordinator's consensus on the CPU; what the
    DeMuon rows of docs/benchmarks.md ran."""
    from benchmarks import quality

    args = ["--device", "cuda", "--model", "gpt-tiny", "--steps-total", "4", "--inner-steps", "2", "--workers", "4"]
    methods = "gossip-ring-demuon,averaging-demuon"
    result = quality.main([*args, "--methods", methods, "--output-dir", str(tmp_path), "--json"])
    assert result["device"] == "cuda"
    for name, r in result["methods"].items():
        assert r["rounds"] == 2 and np.isfinite(r["eval_loss"]), name
    ring = result["methods"]["gossip-ring-demuon"]
    assert ring["relayed_payloads_max"] == 2 and ring["consensus_distance"] > 0


def test_a_coordinator_on_the_gpu_keeps_gpu_workers_in_step(tmp_path):
    """``coordinator train --device cuda``: the replica, its background apply, evaluation and spot checks on
    the GPU; the workers follow by replay with no push after the first, and their replicas are its bits."""
    from gradwire.coordinator.config import TrainConfig
    from gradwire.coordinator.trainer import Trainer
    from gradwire.worker.inprocess import in_process_clients

    config = TrainConfig(
        model="gpt-tiny",
        steps=4,
        batch_size=2,
        sequence_length=32,
        device="cuda",
        eval_every=2,
        spot_check_every=1,
        spot_check_by="recompute",
        output_dir=str(tmp_path),
    )
    clients = in_process_clients(2, device="cuda:0")
    trainer = Trainer(config, clients, progress=False)
    try:
        records = trainer.run()
    finally:
        trainer.close()
    assert trainer.device.type == "cuda" and next(trainer.model.parameters()).is_cuda
    assert [r["pushes"] for r in records] == [2, 0, 0, 0]
    assert all(r["spot_check"]["passed"] for r in records if "spot_check" in r)
    assert all(np.isfinite(r["eval_loss"]) for r in records if "eval_loss" in r)
    for client in clients:
        (session,) = client.engine.sessions.values()
        session.replica.apply(trainer.pending)
        for name, p in trainer.replica.params.items():
            assert torch.equal(session.replica.params[name], p), name
