"""A pipelined node (``worker serve --nproc-per-node N --node-mode pipeline``, real processes, gloo on CPU):
rounds computed as a DDP node computes them, each stage replaying its own tensors, and a coordinator that
trains with it."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.shard import Job, measure
from gradwire.coordinator.client import WorkerClient
from gradwire.coordinator.metrics import read_metrics
from gradwire.models import build_from_spec, model_spec
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import ModelState
from gradwire.replica import Replica

from .conftest import run_trainer
from .test_node import TIMEOUT, assert_close, node, node_config, nodes_rounds, resume_against_straight


def _gpt(layers: int) -> dict:
    spec = model_spec("gpt-tiny")
    return {**spec, "config": {**spec["config"], "n_layer": layers}}


LLAMA = {  # a tiny Llama-family HF model with its own output head
    "arch": "hf",
    "config": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8192,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    },
}


def _state(spec: dict) -> tuple[Replica, ModelState]:
    replica = Replica(build_from_spec(spec, seed=0), UpdateRule(optimizer="sgd", momentum=0.9))
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    return replica, ModelState("run", 0, json.dumps(spec), params, replica.rule.to_json())


def _versus_ddp(tmp_path, *flags: str, spec: dict | None = None, ranks: int = 2, **kwargs) -> list[list]:
    """``node_rounds`` of a node of ``flags`` and of a DDP node, each from its own ``_state(spec)`` (the
    nodes started together: ``nodes_rounds``)."""
    spec = spec or _gpt(ranks)
    return nodes_rounds(
        tmp_path, flags, ("--node-mode", "ddp"), ranks=ranks, starts=[_state(spec), _state(spec)], **kwargs
    )


def _same_direction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    # Compressed: each stage encoded its own tensors; the payload decodes to what the DDP node's does (a
    # coefficient on the edge of a top-k may tip the other way under float noise - the stages sum their
    # micro-batches in another order than DDP's ranks, and AdamW's inner steps magnify that noise where a
    # gradient is near zero: compare directions, of the whole payload and of each tensor).
    whole = torch.nn.functional.cosine_similarity(
        torch.cat([a[n].flatten() for n in b]), torch.cat([g.flatten() for g in b.values()]), dim=0
    )
    assert whole > 0.99
    for name, g in b.items():
        cos = torch.nn.functional.cosine_similarity(a[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.95 or g.abs().max() < 1e-7, name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("local", "ranks", "flags"),
    [
        (False, 2, ()),
        (True, 2, ("--pipeline-schedule", "gpipe", "--pipeline-microbatches", "4")),
        (True, 4, ()),
    ],
    ids=["gradient-1f1b", "local-sgd-gpipe", "local-sgd-4-stages"],
)
def test_a_pipelined_node_computes_what_a_ddp_node_computes(tmp_path, local: bool, ranks: int, flags: tuple):
    # Gradient mode clips the first round's gradient: by the whole model's norm, over every stage's
    # tensors (the tied embedding once).
    clip = 0.0 if local else 0.05
    pipe, ddp = _versus_ddp(tmp_path, "--node-mode", "pipeline", *flags, local=local, ranks=ranks, clip=clip)
    if clip:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in pipe[0].values()]))
        assert norm == pytest.approx(clip, rel=1e-4)
    for a, b in zip(pipe[:2], ddp[:2]):
        assert_close(a, b, atol=1e-4)
    _same_direction(pipe[2], ddp[2])


@pytest.mark.slow
def test_a_pipelined_node_runs_a_llama_family_hf_model(tmp_path):
    pipe, ddp = _versus_ddp(tmp_path, "--node-mode", "pipeline", local=False, spec=LLAMA)
    for a, b in zip(pipe[:2], ddp[:2]):
        assert_close(a, b, atol=1e-4)
    _same_direction(pipe[2], ddp[2])


@pytest.mark.slow
def test_a_coordinator_trains_with_a_pipelined_node(tmp_path):
    with node(tmp_path, "--node-mode", "pipeline") as (address, _):
        client = WorkerClient(address, timeout=TIMEOUT)
        assert client.describe().node_mode == "pipeline"
        run_trainer(node_config(tmp_path / "run", 6, checkpoint_every=0), [client])
    records = read_metrics(tmp_path / "run")
    assert all(r["ranks"] == 2 and r["successful_workers"] == 1 and r["pushes"] == 0 for r in records[1:])
    assert records[-1]["total_tokens"] == 6 * 2 * (2 * 2) * 32  # rounds x H x (ranks x batch) x T
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["node_bus_bytes"] > 0 for r in records)  # torch's own collectives, counted (worker.bus)


@pytest.mark.slow
def test_a_pipelined_node_resumes_every_stages_feedback_and_inner_state(tmp_path):
    """Each stage's error feedback and inner AdamW state is checkpointed and restored: a fresh pipelined
    node resumed after 2 rounds ends bit for bit where 4 straight rounds end."""
    saved = resume_against_straight(tmp_path, "--node-mode", "pipeline")
    for kind in ("feedback", "inner"):
        (group,) = [g for name, g in saved.items() if name.startswith(f"{kind}-")]
        assert {n.split(".", 2)[1] for n in group} == {"0", "1"} and all(n.startswith("pipeline2.") for n in group)


@pytest.mark.slow
def test_each_stage_holds_its_blocks_share_of_a_runs_state(tmp_path):
    """Replica (and outer momentum), working copy, inner AdamW moments and error feedback after a local-SGD
    round: the stages of a 2-stage node together hold what one DDP rank holds, plus a second copy of the
    tied embedding (on the last stage too), and the error feedback exactly once."""
    held = {}
    for mode in ("ddp", "pipeline"):
        job = Job("gpt-tiny", mode, 2, 1, 2, 4, 16, "cpu", str(tmp_path / f"store-{mode}"), str(tmp_path / mode))
        held[mode] = measure(job)["state_bytes_by_part"]  # the benchmark's own measurement (benchmarks.shard)
    ddp, stages = held["ddp"][0], held["pipeline"]
    model = build_from_spec(model_spec("gpt-tiny"))
    embedding = model.tok_emb.weight.numel() / sum(p.numel() for p in model.parameters())
    for part in ("replica", "working", "inner"):
        shares = [stage[part] for stage in stages]
        assert all(0 < share < ddp[part] for share in shares), (part, shares, ddp[part])
        assert sum(shares) <= ddp[part] * (1 + embedding) + 64, (part, shares, ddp[part])
    assert sum(stage["feedback"] for stage in stages) == ddp["feedback"]
