"""Named models, the JSON specs they are built from, their tokenizers, and one loss for all of them.

A model travels to a worker as a *spec*, a JSON-able dict, never as code or pickles:

    {"arch": "gpt", "tokenizer": "bpe-8k", "config": {...GPTConfig fields...}}
    {"arch": "hf",  "tokenizer": "gpt2",   "config": {"model_type": "opt", ...transformers config...}}

``build_from_spec(spec, seed)`` turns it into an ``nn.Module`` with fresh weights; the same spec and seed
give the same weights on every machine. HF architectures are built offline with
``AutoModelForCausalLM.from_config``: nothing is downloaded. ``"tokenizer"`` is optional: it records the
built-in models' tokenizer for the coordinator; a worker never tokenizes, so it never reads it. Specs of
hub models and model directories (``gradwire.models.hf``) carry none.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import ByteLevelBPETokenizer, Tokenizer

from gradwire.assets import default_tokenizer, gpt2_tokenizer
from gradwire.models.gpt import GPT, GPTConfig
from gradwire.models.meta import no_meta_writes

AnyTokenizer = Tokenizer | ByteLevelBPETokenizer  # both offer .encode(text).ids and .decode(ids)

TOKENIZERS: dict[str, Callable[[], AnyTokenizer]] = {
    "bpe-8k": default_tokenizer,  # 8192 tokens, trained on the shipped Shakespeare corpus
    "gpt2": gpt2_tokenizer,  # 50257 tokens, GPT-2/OPT vocabulary
}


def _gpt(**fields: Any) -> dict[str, Any]:
    # Through GPTConfig so a bad entry fails at import, and the spec lists every field explicitly.
    return {"arch": "gpt", "tokenizer": "bpe-8k", "config": GPTConfig(**fields).to_dict()}


def _llama(**fields: Any) -> dict[str, Any]:
    # A Llama decoder (RMSNorm, rotary positions, SwiGLU, no biases, untied output layer) in the GPT-2
    # vocabulary, so the shipped gpt2 tokenizer feeds it: the vocabulary rounded up to a multiple of 128,
    # which the GPU's matmuls prefer. Every other transformers default (rotary base, RMSNorm epsilon) stays.
    config = {
        "model_type": "llama",
        "vocab_size": 50304,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        # Training never reuses keys/values across calls; the cache would only cost memory.
        "use_cache": False,
        **fields,
    }
    return {"arch": "hf", "tokenizer": "gpt2", "config": config}


_SPECS: dict[str, dict[str, Any]] = {
    # For tests: builds and runs a step in milliseconds.
    "gpt-tiny": _gpt(vocab_size=8192, n_layer=2, n_head=4, d_model=64, d_ff=128, max_seq_len=256),
    # benchmarks.quality's model: 5.5M parameters, 3.4M in the blocks and 2.1M in the (tied) embedding;
    # small enough to train every method to a comparable loss on a CPU.
    "gpt-5m": _gpt(vocab_size=8192, n_layer=4, n_head=4, d_model=256, d_ff=768, max_seq_len=256),
    # The decentralized seed experiment's shape (configs/gossip-ring.yaml): 2 layers of d_model 256, 4.2M
    # parameters, 2.1M in the blocks and 2.1M in the (tied) embedding.
    "gpt-2x256": _gpt(vocab_size=8192, n_layer=2, n_head=4, d_model=256, d_ff=1024, max_seq_len=256),
    # Default model for CPU runs and benchmarks. 29.4M parameters in all: 25.2M in the blocks and 4.2M in
    # the (tied) embedding.
    "gpt-10m": _gpt(vocab_size=8192, n_layer=6, n_head=8, d_model=512, d_ff=2048, max_seq_len=512),
    # 81.8M parameters: 75.5M in the blocks, 6.3M in the embedding. A GPU-sized built-in model.
    "gpt-80m": _gpt(vocab_size=8192, n_layer=8, n_head=12, d_model=768, d_ff=3072, max_seq_len=1024),
    # The shape of facebook/opt-125m (its config.json, field for field, minus hub bookkeeping), fresh weights.
    "opt-125m": {
        "arch": "hf",
        "tokenizer": "gpt2",
        "config": {
            "model_type": "opt",
            "vocab_size": 50272,
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "ffn_dim": 3072,
            "max_position_embeddings": 2048,
            "word_embed_proj_dim": 768,
            "do_layer_norm_before": True,
            "activation_function": "relu",
            "dropout": 0.1,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
            "layerdrop": 0.0,
            "init_std": 0.02,
            "enable_bias": True,
            "layer_norm_elementwise_affine": True,
            "tie_word_embeddings": True,
            "pad_token_id": 1,
            "bos_token_id": 2,
            "eos_token_id": 2,
            # Training never reuses keys/values across calls; the cache would only cost memory.
            "use_cache": False,
        },
    },
    # For tests: the llama-1b family at a size that builds and steps in milliseconds (6.5M parameters, nearly
    # all of them in the two 50304 x 64 embeddings). Width 64, as gpt-tiny's: at 32, local-SGD rounds' default
    # codec would factor some matrices for the downlink and not for the workers, and refuse the model.
    "llama-tiny": _llama(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=176),
    # A model that needs a GPU: 1.016B parameters, 810M in 16 blocks of width 2048 (32 heads of 64; the MLP
    # 5504 wide, Llama's 8/3 x 2048 rounded up to a multiple of 128) and 206M in the input and output
    # embeddings. Fresh weights; about 16 GB with float32 AdamW state, so it trains on one GPU.
    "llama-1b": _llama(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, intermediate_size=5504),
}


def model_names() -> list[str]:
    return list(_SPECS)


def model_spec(name: str) -> dict[str, Any]:
    """The JSON-able spec of a named model (a copy: callers may edit it)."""
    if name not in _SPECS:
        raise ValueError(f"unknown model {name!r}; known models are {model_names()}")
    return copy.deepcopy(_SPECS[name])


_BUILD_LOCK = threading.RLock()  # build_from_spec: the global RNG is forked by one build at a time


def build_from_spec(spec: dict[str, Any], seed: int = 0) -> nn.Module:
    """A freshly initialized model in float32 on the CPU, in train mode."""
    arch = spec.get("arch")
    if arch not in ("gpt", "hf"):
        raise ValueError(f"spec 'arch' must be 'gpt' or 'hf', got {arch!r}")
    tokenizer = spec.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise ValueError(f"spec 'tokenizer' must be a tokenizer name when present, got {tokenizer!r}")
    if not isinstance(spec.get("config"), dict):
        raise ValueError(f"spec 'config' must be a dict, got {type(spec.get('config')).__name__}")
    config = dict(spec["config"])
    # Initialization draws from the global RNG (HF offers no other way); fork it so building a model
    # neither depends on nor disturbs the caller's random state. One build at a time: builds on several
    # threads (in-process workers taking their pushes) would seed and restore the one generator under each
    # other, and were seen to deadlock inside torch.
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "gpt":
            model = GPT(GPTConfig.from_dict(config))
        else:
            model = _build_hf(config)
    return model.train()


# What a spec may ask for before it is even counted: building millions of layers is itself the attack.
MAX_LAYERS = 1024
MAX_DIMENSION = 2**31 - 1  # any integer setting (a width, a vocabulary, a context length)
_LAYER_KEYS = (
    "n_layer",
    "num_hidden_layers",
    "num_layers",
    "n_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)


def spec_elements(spec: dict[str, Any]) -> int:
    """How many tensor elements (parameters and buffers) ``spec`` builds, counted without allocating them:
    the model is built on torch's meta device, after a check of its layer counts and integer settings.
    ``ValueError`` naming the setting if the spec is malformed or absurd."""
    config = spec.get("config") if isinstance(spec, dict) else None
    if not isinstance(config, dict):
        raise ValueError("spec 'config' must be a dict")
    for key, value in config.items():
        if isinstance(value, int) and not isinstance(value, bool):
            if key in _LAYER_KEYS and value > MAX_LAYERS:
                raise ValueError(f"spec config[{key!r}] = {value} layers, more than {MAX_LAYERS}")
            if abs(value) > MAX_DIMENSION:
                raise ValueError(f"spec config[{key!r}] = {value} is beyond any model's size")
    with torch.device("meta"), no_meta_writes():
        model = build_from_spec(spec)
    return sum(t.numel() for t in model.parameters()) + sum(b.numel() for b in model.buffers())


def _build_hf(config: dict[str, Any]) -> nn.Module:
    # Imported here: transformers takes seconds to import and the built-in GPT does not need it.
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = config.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError("an 'hf' spec needs config['model_type'], e.g. 'opt'")
    # from_config builds in the config's dtype when it names one (a bf16 checkpoint's config does); without
    # it, the torch default: fp32, which the replicas and the codec need. (Not a dtype argument: it is named
    # torch_dtype before transformers 4.56.)
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    try:
        hf_config = AutoConfig.for_model(model_type, **config)
    except ValueError as e:  # an unknown model_type: the list of known ones is hundreds of names long
        raise ValueError(
            f"spec config['model_type'] {model_type!r} is not a transformers architecture: {str(e)[:200]}"
        ) from None
    return AutoModelForCausalLM.from_config(hf_config)


def build_model(name: str, seed: int = 0) -> nn.Module:
    return build_from_spec(model_spec(name), seed)


def load_tokenizer(tokenizer: str) -> AnyTokenizer:
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; known tokenizers are {sorted(TOKENIZERS)}")
    return TOKENIZERS[tokenizer]()


def tokenizer_for(name: str) -> AnyTokenizer:
    """The tokenizer whose ids the named model was sized for."""
    return load_tokenizer(model_spec(name)["tokenizer"])


def token_embedding_names(model: nn.Module) -> list[str]:
    """The names of the parameters that embed tokens (with a tied output layer, that layer's too): the module
    ``get_input_embeddings`` returns, as Hugging Face models have, else every ``nn.Embedding``. A model's own
    fact, nothing of training: ``--embedding-lr-scale`` gives these their own outer learning rate."""
    modules: list[nn.Module] = []
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            found = get()
        except NotImplementedError:  # an HF model that does not say
            found = None
        modules = [found] if isinstance(found, nn.Module) else []
    if not modules:
        modules = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    weights = {id(p) for m in modules for p in m.parameters(recurse=False)}
    return [name for name, p in model.named_parameters() if id(p) in weights]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of tokens (B, T+1): predict tokens[:, 1:] from tokens[:, :-1].

    One definition for every model: the built-in GPT computes it itself; for HF models it is computed here
    from the logits, not through ``labels=``, whose internal shift and loss averaging vary across versions.
    """
    if tokens.dim() != 2 or tokens.size(1) < 2:
        raise ValueError(f"tokens must be (B, T+1) with T >= 1, got shape {tuple(tokens.shape)}")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    # A wrapper that forwards to its ``module`` (DDP on a multi-GPU worker) runs the same way as the model.
    if isinstance(getattr(model, "module", model), GPT):
        _, loss = model(inputs, targets)
        assert loss is not None
        return loss
    logits = model(input_ids=inputs).logits  # (B, T, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
