"""--model / --tokenizer resolution: tiny OPT and LLaMA directories, a fake hub cache, the worker's build."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

# Set before transformers is imported anywhere: without them a hub look-up retries for ~50 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig, PretrainedConfig

import gradwire.models.hf as hf
from gradwire.models import (
    build_from_spec,
    lm_loss,
    load_tokenizer_arg,
    model_spec,
    resolve_model,
    tokenizer_vocab_size,
    vocab_size_of,
)

VOCAB = 1000
CONFIGS = {
    "opt": lambda: OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=64,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
    ),
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    ),
}
# The LLaMA checkpoint is stored in bf16, like most released checkpoints: it must still load (and build) in fp32.
SAVE_DTYPE = {"opt": torch.float32, "llama": torch.bfloat16}


def _save_tiny(arch: str, directory: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """A tiny model of ``arch`` saved with save_pretrained (safetensors); returns its state in fp32."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(CONFIGS[arch]()).to(SAVE_DTYPE[arch])
    model.save_pretrained(directory)
    return {k: v.float() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory) -> tuple[str, Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, _save_tiny(request.param, directory)


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_directory_loads_its_weights_in_fp32(saved) -> None:
    arch, directory, state = saved
    resolved = resolve_model(str(directory))
    assert resolved.spec["arch"] == "hf" and resolved.spec["config"]["model_type"] == arch
    assert "tokenizer" not in resolved.spec
    assert resolved.spec["config"]["use_cache"] is False and resolved.model.config.use_cache is False
    assert resolved.default_tokenizer is None  # save_pretrained of a model writes no tokenizer files
    assert resolved.model.training
    loaded = resolved.model.state_dict()
    assert loaded.keys() == state.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, state[name]), name


def test_worker_builds_the_same_parameters_from_the_wire_spec(saved) -> None:
    _, directory, _ = saved
    resolved = resolve_model(str(directory))
    wire = json.loads(json.dumps(resolved.spec))  # exactly what a worker receives
    assert wire == resolved.spec
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        assert key not in wire["config"], key
    worker = build_from_spec(wire)
    assert _shapes(worker) == _shapes(resolved.model)
    assert all(p.dtype == torch.float32 for p in worker.parameters())
    # What a push does: the coordinator's tensors, by name, into the worker's model.
    worker.load_state_dict(dict(resolved.model.named_parameters()), strict=False)
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(lm_loss(worker.eval(), tokens), lm_loss(resolved.model.eval(), tokens))


def test_from_scratch_gives_fresh_weights_of_the_same_shapes(saved) -> None:
    _, directory, state = saved
    pretrained = resolve_model(str(directory))
    fresh = resolve_model(str(directory), from_scratch=True, seed=3)
    assert fresh.spec == pretrained.spec
    assert _shapes(fresh.model) == _shapes(pretrained.model)
    fresh_state = fresh.model.state_dict()
    assert any(not torch.equal(fresh_state[k], state[k]) for k in state)
    # Exactly what a worker builds from the same spec and seed; another seed gives other weights.
    same = build_from_spec(fresh.spec, seed=3).state_dict()
    assert all(torch.equal(fresh_state[k], same[k]) for k in same)
    other = resolve_model(str(directory), from_scratch=True, seed=4).model.state_dict()
    assert any(not torch.equal(fresh_state[k], other[k]) for k in other)


def test_a_directory_with_only_config_json_trains_from_fresh_weights(tmp_path, caplog) -> None:
    CONFIGS["llama"]().save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    with caplog.at_level(logging.WARNING, logger="gradwire.models"):
        resolved = resolve_model(str(tmp_path), seed=5)
    assert "no weights" in caplog.text
    reference = build_from_spec(resolved.spec, seed=5).state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in resolved.model.state_dict().items())


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_lm_loss_trains_both_architectures(arch) -> None:
    spec = hf.hf_spec(CONFIGS[arch]())
    model = build_from_spec(spec, seed=0)
    loss = lm_loss(model, torch.randint(0, VOCAB, (2, 17)))
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(VOCAB)) < 1.0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_builtin_names_resolve_to_their_registry_specs() -> None:
    resolved = resolve_model("gpt-tiny", seed=2)
    assert resolved.spec == model_spec("gpt-tiny")
    assert resolved.default_tokenizer == "bpe-8k"
    reference = build_from_spec(model_spec("gpt-tiny"), seed=2).state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in resolved.model.state_dict().items())
    assert vocab_size_of(resolved.spec) == 8192
    assert vocab_size_of(model_spec("opt-125m")) == 50272
    assert vocab_size_of(hf.hf_spec(CONFIGS["llama"]())) == VOCAB


def test_spec_dtype_is_ignored_and_tokenizer_is_optional() -> None:
    spec = hf.hf_spec(CONFIGS["opt"]())
    model = build_from_spec({**spec, "config": {**spec["config"], "dtype": "bfloat16"}})
    assert all(p.dtype == torch.float32 for p in model.parameters())
    build_from_spec({**spec, "tokenizer": "facebook/opt-125m"})  # a record for the coordinator only
    with pytest.raises(ValueError, match="tokenizer"):
        build_from_spec({**spec, "tokenizer": 7})
    with pytest.raises(ValueError, match="not a transformers architecture"):
        build_from_spec({"arch": "hf", "config": {"model_type": "no-such-arch"}})


@pytest.mark.parametrize(
    "name, message",
    [
        ("no-such-org/no-such-model", r"--model .*gpt-tiny.*local Hugging Face cache"),
        ("./no/such/dir", r"--model .*no such directory"),
        ("", r"--model"),
    ],
)
def test_unknown_models_are_refused_naming_the_flag(name, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_model(name)


def test_a_directory_without_config_json_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"--model .*config\.json"):
        resolve_model(str(tmp_path))


def test_a_worker_build_that_differs_is_caught_on_the_coordinator(saved, monkeypatch) -> None:
    _, directory, _ = saved
    real = hf.hf_spec

    def lossy(config: PretrainedConfig) -> dict:
        spec = real(config)
        spec["config"]["num_hidden_layers"] = 1  # as if a field were lost on the way
        return spec

    monkeypatch.setattr(hf, "hf_spec", lossy)
    with pytest.raises(ValueError, match="worker would build different parameters"):
        resolve_model(str(directory))


def test_hub_id_resolves_offline_from_the_local_cache(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants

    # The hub cache's layout: models--org--name/{refs/main, snapshots/<commit>/<files>}.
    repo = tmp_path / "models--tiny-org--tiny-opt"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    state = _save_tiny("opt", repo / "snapshots" / commit)
    hf.gpt2_hf_tokenizer().save_pretrained(repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    resolved = resolve_model("tiny-org/tiny-opt")
    assert resolved.default_tokenizer == "tiny-org/tiny-opt"
    assert all(torch.equal(v, state[k]) for k, v in resolved.model.state_dict().items())
    assert load_tokenizer_arg("tiny-org/tiny-opt").encode("Hello world", add_special_tokens=False) == [15496, 995]


def test_gpt2_tokenizer_is_the_real_one_as_a_transformers_tokenizer() -> None:
    tok = load_tokenizer_arg("gpt2")
    assert tok.encode("Hello world", add_special_tokens=False) == [15496, 995]
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]
    assert tok.eos_token_id == 50256 and tok.eos_token == "<|endoftext|>"
    assert tokenizer_vocab_size(tok) == 50257
    assert tok.decode([15496, 995]) == "Hello world"


def test_bpe_8k_is_the_shipped_tokenizer() -> None:
    tok = load_tokenizer_arg("bpe-8k")
    assert isinstance(tok, Tokenizer)
    assert tokenizer_vocab_size(tok) == 8192


def test_a_saved_tokenizer_loads_by_directory_and_becomes_the_model_default(tmp_path) -> None:
    load_tokenizer_arg("gpt2").save_pretrained(tmp_path)
    tok = load_tokenizer_arg(str(tmp_path))
    assert tok.encode("Hello world", add_special_tokens=False) == [15496, 995]
    assert tok.eos_token_id == 50256
    _save_tiny("opt", tmp_path)  # the same directory now holds a model too
    assert resolve_model(str(tmp_path)).default_tokenizer == str(tmp_path)


def test_missing_tokenizers_are_refused_naming_the_flag(tmp_path) -> None:
    _save_tiny("opt", tmp_path)  # a model directory with no tokenizer files
    with pytest.raises(ValueError, match=r"--tokenizer .*no tokenizer files"):
        load_tokenizer_arg(str(tmp_path))
    with pytest.raises(ValueError, match=r"--tokenizer .*local cache"):
        load_tokenizer_arg("no-such-org/no-such-tokenizer")
    with pytest.raises(ValueError, match=r"--tokenizer .*no such directory"):
        load_tokenizer_arg(str(tmp_path / "missing"))
