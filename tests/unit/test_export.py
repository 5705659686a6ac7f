"""The exported model directory: Hugging Face models load with from_pretrained, the built-in GPT with
load_exported; same logits after the round trip, tied weights stay tied, the tokenizer travels along."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Set before transformers is imported anywhere: without them a hub look-up retries for ~50 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from gradwire.coordinator.export import export_model, load_exported
from gradwire.models import GPT, build_model, model_spec

TEXT = "To be, or not to be, that is the question."


def tiny_opt() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, OPTConfig

    config = OPTConfig(
        vocab_size=1000,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=64,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


def fixed_input(vocab: int) -> torch.Tensor:
    return torch.arange(24).reshape(2, 12) * 37 % vocab  # (B, T), deterministic, spread over the vocabulary


def test_hf_model_reloads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_opt()
    spec = {"arch": "hf", "tokenizer": "gpt2", "config": model.config.to_dict()}
    out = export_model(model, spec, tmp_path / "final")
    assert out == tmp_path / "final"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not list(out.glob("*.bin"))  # safetensors only: loading never unpickles

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    x = fixed_input(1000)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, reloaded(input_ids=x).logits)

    # The spec's shipped GPT-2 tokenizer was written in transformers' format.
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("Hello world").input_ids == [15496, 995]
    model_back, tokenizer_back = load_exported(out)
    assert tokenizer_back.decode(tokenizer_back(TEXT).input_ids) == TEXT
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, model_back(input_ids=x).logits)


def test_gpt_round_trip_logits_tokenizer_and_tied_weights(tmp_path: Path) -> None:
    model = build_model("gpt-tiny", seed=3).eval()
    spec = model_spec("gpt-tiny")
    out = export_model(model, spec, tmp_path / "final")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((out / "config.json").read_text()) == spec

    reloaded, tokenizer = load_exported(out)
    assert isinstance(reloaded, GPT) and not reloaded.training
    x = fixed_input(8192)
    with torch.no_grad():
        assert torch.equal(model(x)[0], reloaded(x)[0])
    # One matrix both embeds and scores tokens, after the reload as before it.
    assert reloaded.lm_head.weight is reloaded.tok_emb.weight
    with torch.no_grad():
        reloaded.tok_emb.weight[0, 0] += 1.0
    assert reloaded.lm_head.weight[0, 0] == reloaded.tok_emb.weight[0, 0]

    assert tokenizer is not None
    ids = tokenizer.encode(TEXT).ids
    assert max(ids) < 8192 and tokenizer.decode(ids) == TEXT


def test_export_replaces_the_previous_one_and_leaves_no_temporaries(tmp_path: Path) -> None:
    spec = model_spec("gpt-tiny")
    out = tmp_path / "final"
    export_model(build_model("gpt-tiny", seed=0), spec, out)
    (out / "stale.txt").write_text("from an older export")
    newer = build_model("gpt-tiny", seed=1).eval()
    export_model(newer, spec, out)
    assert not (out / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    reloaded, _ = load_exported(out)
    assert torch.equal(reloaded.tok_emb.weight, newer.tok_emb.weight)


def test_a_failed_export_keeps_the_previous_one(tmp_path: Path) -> None:
    out = tmp_path / "final"
    export_model(build_model("gpt-tiny"), model_spec("gpt-tiny"), out)
    with pytest.raises(TypeError, match="GPT"):
        export_model(torch.nn.Linear(2, 2), model_spec("gpt-tiny"), out)  # spec and model disagree
    assert (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        export_model(build_model("gpt-tiny"), {"arch": "rnn"}, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_exported(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        load_exported(tmp_path)
