"""Training Hugging Face architectures through the service: tiny OPT and LLaMA directories, two live workers.

The coordinator resolves ``--model <directory>`` (config.json + safetensors weights) and ``--tokenizer
gpt2`` (the shipped GPT-2 BPE); workers build the architecture from the JSON spec alone and receive the
pretrained weights as pushed tensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.metrics import read_metrics
from gradwire.coordinator.trainer import Trainer
from gradwire.models import lm_loss, resolve_model

from .conftest import live_workers

# Vocabularies that hold every GPT-2 id (50257): OPT's own padded size, and LLaMA padded to a multiple of 64.
# No dropout, so a worker's first loss can be recomputed here exactly.
CONFIGS = {
    "opt": lambda: OPTConfig(
        vocab_size=50272,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=64,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        dropout=0.0,
    ),
    "llama": lambda: LlamaConfig(
        vocab_size=50304,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    ),
}


@pytest.fixture(params=sorted(CONFIGS))
def model_dir(request, tmp_path) -> Path:
    directory = tmp_path / request.param
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        AutoModelForCausalLM.from_config(CONFIGS[request.param]()).save_pretrained(directory)
    return directory


def test_a_model_directory_trains_from_its_weights(model_dir, tmp_path) -> None:
    config = TrainConfig(
        model=str(model_dir),
        tokenizer="gpt2",
        steps=4,
        batch_size=2,
        sequence_length=16,
        output_dir=str(tmp_path / "run"),
        round_timeout=60.0,
    )
    with live_workers(2) as workers:
        trainer = Trainer(config, [w.client() for w in workers], progress=False)
        try:
            trainer.run()
        finally:
            trainer.close()
        sessions = [next(iter(w.engine.sessions.values())) for w in workers]

    pretrained = resolve_model(str(model_dir)).model.eval()
    # The workers got a JSON spec naming no file, and built the coordinator's parameters from it.
    assert trainer.spec == resolve_model(str(model_dir)).spec
    assert str(model_dir) not in json.dumps(trainer.spec)
    shapes = {n: p.shape for n, p in trainer.model.named_parameters()}
    for session in sessions:
        assert {n: p.shape for n, p in session.replica.model.named_parameters()} == shapes
        assert session.replica.version == trainer.replica.version - 1  # one update behind, by design

    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["successful_workers"] == 2 and math.isfinite(r["loss"]) for r in records)
    # Round 1 ran on the pretrained weights (not fresh ones): its loss is theirs on the same rows.
    with torch.no_grad():
        rows = [torch.from_numpy(trainer.data.batch(0, slot, 2, 16).astype(np.int64)) for slot in (0, 1)]
        expected = sum(lm_loss(pretrained, r).item() for r in rows) / 2
    assert records[0]["loss"] == pytest.approx(expected, abs=1e-4)
    # ...and training moved them.
    moved = dict(trainer.model.named_parameters())
    assert any(not torch.equal(moved[n], p) for n, p in pretrained.named_parameters())
    # final/ is a Hugging Face model directory: from_pretrained loads exactly the trained weights.
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    for name, p in final.named_parameters():
        assert torch.equal(p, moved[name]), name
