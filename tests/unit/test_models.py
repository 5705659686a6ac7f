"""The built-in GPT, the model registry and the shipped tokenizers: shapes, causality, init, determinism."""

from __future__ import annotations

import json
import math
import os

# Set before transformers is imported anywhere: without them a hub look-up retries for ~50 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from gradwire.assets import corpus_path, default_tokenizer, gpt2_tokenizer
from gradwire.models import (
    GPT,
    GPTConfig,
    build_from_spec,
    build_model,
    lm_loss,
    model_names,
    model_spec,
    token_embedding_names,
    tokenizer_for,
)

VOCAB = 8192


@pytest.fixture(scope="module")
def tiny() -> GPT:
    model = build_model("gpt-tiny", seed=0)
    assert isinstance(model, GPT)
    return model


def corpus_tokens(batch: int, seq: int) -> torch.Tensor:
    """(batch, seq) ids of the start of the shipped corpus, under the default tokenizer."""
    text = corpus_path().read_text()[: 8 * batch * seq]  # ~3.5 chars per token: comfortably enough
    ids = default_tokenizer().encode(text).ids[: batch * seq]
    return torch.tensor(ids).view(batch, seq)


def test_forward_shapes(tiny: GPT) -> None:
    idx = torch.randint(0, VOCAB, (2, 16))
    logits, loss = tiny(idx)
    assert logits.shape == (2, 16, VOCAB)
    assert loss is None
    logits, loss = tiny(idx, targets=idx)
    assert logits.shape == (2, 16, VOCAB)
    assert loss is not None and loss.shape == ()


def test_sequence_longer_than_max_seq_len_is_refused(tiny: GPT) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny(torch.zeros(1, tiny.config.max_seq_len + 1, dtype=torch.long))


def test_initial_loss_is_near_uniform(tiny: GPT) -> None:
    # Small init means near-uniform predictions: the loss of a fresh model is ~ln(vocab).
    with torch.no_grad():
        loss = lm_loss(tiny, torch.randint(0, VOCAB, (4, 65)))
    assert abs(loss.item() - math.log(VOCAB)) < 0.1


def test_attention_is_causal(tiny: GPT) -> None:
    idx = torch.randint(0, VOCAB, (2, 24))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB
    with torch.no_grad():
        a, _ = tiny(idx)
        b, _ = tiny(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])  # ...while the change itself does reach later logits


def test_config_json_round_trip_builds_identical_model() -> None:
    spec = model_spec("gpt-tiny")
    wire = json.loads(json.dumps(spec))  # exactly what a worker receives
    assert GPTConfig.from_dict(wire["config"]) == GPTConfig.from_dict(spec["config"])
    a = build_from_spec(spec, seed=3).state_dict()
    b = build_from_spec(wire, seed=3).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    c = build_from_spec(spec, seed=4).state_dict()
    assert not torch.equal(a["tok_emb.weight"], c["tok_emb.weight"])


def test_building_a_model_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    build_model("gpt-tiny", seed=123)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"d_model": 63}, "divisible by n_head"),
        ({"d_model": 12, "n_head": 4}, "even for RoPE"),
        ({"n_layer": 0}, "n_layer"),
        ({"vocab_size": True}, "vocab_size"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope_theta": float("nan")}, "rope_theta"),
    ],
)
def test_bad_config_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)


def test_unknown_config_field_is_refused() -> None:
    d = GPTConfig().to_dict() | {"n_embd": 64}
    with pytest.raises(ValueError, match="n_embd"):
        GPTConfig.from_dict(d)


def test_embeddings_are_tied(tiny: GPT) -> None:
    assert tiny.lm_head.weight is tiny.tok_emb.weight
    assert tiny.lm_head.weight.data_ptr() == tiny.tok_emb.weight.data_ptr()
    names = [name for name, _ in tiny.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # one tensor, one gradient
    assert all(p.dim() != 1 or "norm" in name for name, p in tiny.named_parameters())  # no biases


def test_adamw_on_a_repeated_batch_reduces_the_loss() -> None:
    model = build_model("gpt-tiny", seed=0)
    tokens = corpus_tokens(4, 65)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(8):
        loss = lm_loss(model, tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_the_token_embedding_is_named_by_the_model_itself(tiny: GPT) -> None:
    """``token_embedding_names``: the tied GPT's one matrix; a Llama's input embedding (``get_input_embeddings``)
    and not its separate output layer; a module with no embedding, nothing."""
    assert token_embedding_names(tiny) == ["tok_emb.weight"]
    llama = build_model("llama-tiny", seed=0)
    assert token_embedding_names(llama) == ["model.embed_tokens.weight"]
    assert token_embedding_names(torch.nn.Linear(3, 2)) == []


def test_lm_loss_of_hf_model_matches_its_own_shifted_loss() -> None:
    # A toy OPT: the same code path as opt-125m without the seconds of building it.
    spec = {
        "arch": "hf",
        "tokenizer": "gpt2",
        "config": {
            "model_type": "opt",
            "vocab_size": 512,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "ffn_dim": 64,
            "max_position_embeddings": 64,
            "word_embed_proj_dim": 32,
            "use_cache": False,
        },
    }
    model = build_from_spec(spec, seed=0).eval()  # eval: no dropout, so both calls see the same network
    tokens = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        ours = lm_loss(model, tokens)
        theirs = model(input_ids=tokens, labels=tokens).loss  # HF shifts labels internally
    torch.testing.assert_close(ours, theirs)


def test_registry() -> None:
    assert {"gpt-tiny", "gpt-10m", "opt-125m"} <= set(model_names())
    for name in model_names():
        spec = model_spec(name)
        assert json.loads(json.dumps(spec)) == spec
    assert model_spec("opt-125m")["config"]["vocab_size"] == 50272
    with pytest.raises(ValueError, match="known models"):
        model_spec("gpt-nope")


def test_default_tokenizer_round_trips_text() -> None:
    tok = tokenizer_for("gpt-tiny")
    assert tok.get_vocab_size() == VOCAB
    assert tok.token_to_id("<|endoftext|>") == 0
    text = corpus_path().read_text()[:3000] + "\nZounds! café 🙂 <|endoftext|>"
    ids = tok.encode(text).ids
    assert max(ids) < VOCAB
    assert len(ids) < len(text) / 2  # it did learn word pieces, not just bytes
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_gpt2_tokenizer_is_the_real_one() -> None:
    tok = gpt2_tokenizer()
    assert tok.encode("Hello world").ids == [15496, 995]
    assert tok.encode("<|endoftext|>").ids == [50256]
    assert tok.get_vocab_size() == 50257
    assert type(tokenizer_for("opt-125m")) is type(tok)
