"""Models for gradwire: plain ``nn.Module``s and the builders that make them from a JSON spec.

``gpt`` holds the built-in GPT (RoPE, RMSNorm, SwiGLU, tied embeddings); ``registry`` names the sizes
(``gpt-tiny``, ``gpt-10m``, ``gpt-80m``, ``opt-125m``), builds any of them from a JSON-able spec with a
seed, picks the matching tokenizer, and defines the one language-model loss used everywhere; ``hf``
resolves what ``--model`` and ``--tokenizer`` name (built-ins, Hugging Face hub ids, local directories).

Nothing here knows about networking, compression or distribution: a worker builds a model from a spec
and hands it to the engine like any other module.
"""

from gradwire.models.gpt import GPT, GPTConfig
from gradwire.models.hf import ResolvedModel, load_tokenizer_arg, resolve_model, tokenizer_vocab_size, vocab_size_of
from gradwire.models.registry import (
    build_from_spec,
    build_model,
    lm_loss,
    load_tokenizer,
    model_names,
    model_spec,
    spec_elements,
    token_embedding_names,
    tokenizer_for,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "ResolvedModel",
    "build_from_spec",
    "build_model",
    "lm_loss",
    "load_tokenizer",
    "load_tokenizer_arg",
    "model_names",
    "model_spec",
    "resolve_model",
    "spec_elements",
    "token_embedding_names",
    "tokenizer_for",
    "tokenizer_vocab_size",
    "vocab_size_of",
]
