"""The built-in Llama family: ``llama-1b`` counted without building it (on the meta device), and
``llama-tiny``, the same architecture at a test's size, built and trained."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from gradwire.models import build_from_spec, lm_loss, model_spec, resolve_model, tokenizer_for, vocab_size_of
from gradwire.models.hf import tokenizer_vocab_size
from gradwire.models.registry import spec_elements

SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def test_llama_1b_has_a_billion_parameters_as_its_config_says() -> None:
    spec = model_spec("llama-1b")
    c = spec["config"]
    h, layers, ff, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    # per block: q, k, v, o (h x h each), gate, up, down (h x ff each), two RMSNorms; then the final norm and
    # the untied input and output embeddings
    expected = layers * (4 * h * h + 3 * h * ff + 2 * h) + h + 2 * vocab * h
    with torch.device("meta"):  # shapes only: no memory, no initialization
        model = build_from_spec(spec)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == expected
    assert 1.0e9 < expected < 1.05e9
    assert spec_elements(spec) >= expected  # what the workers' size guard counts (parameters and buffers)


def test_llama_tiny_is_llama_1b_at_another_size() -> None:
    big, tiny = model_spec("llama-1b"), model_spec("llama-tiny")
    assert big["tokenizer"] == tiny["tokenizer"] == "gpt2"
    assert {k: v for k, v in big["config"].items() if k not in SIZES} == {
        k: v for k, v in tiny["config"].items() if k not in SIZES
    }
    # the shipped GPT-2 tokenizer's ids fit the vocabulary
    assert tokenizer_vocab_size(tokenizer_for("llama-1b")) <= vocab_size_of(big)


def test_llama_tiny_trains() -> None:
    resolved = resolve_model("llama-tiny", seed=0)
    assert resolved.default_tokenizer == "gpt2"
    model = resolved.model
    tokens = torch.randint(0, vocab_size_of(resolved.spec), (2, 33), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = lm_loss(model, tokens)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
