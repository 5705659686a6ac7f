"""What ``--model`` and ``--tokenizer`` name: built-in models, Hugging Face hub ids and local directories.

``resolve_model(name)`` turns a ``--model`` value into the JSON spec the workers build from and the
coordinator's model with its starting weights:

  built-in name (``gpt-tiny``, ``opt-125m``, ...)  its registry spec, fresh weights from the seed
  local directory with ``config.json``            ``{"arch": "hf", "config": {...}}``; the directory's
                                                  weights when it has any (and not ``--from-scratch``)
  hub id (``facebook/opt-125m``)                  the same, from the local Hugging Face cache when offline

Any ``AutoModelForCausalLM`` architecture works. The spec carries the whole transformers config as plain
JSON, so a worker builds the same architecture with ``build_from_spec`` -- no code, no pickles, no weight
files: the coordinator pushes the weights as tensors. ``resolve_model`` checks that the worker's build has
exactly the coordinator's parameter names and shapes before anything is sent.

``load_tokenizer_arg(arg)`` turns a ``--tokenizer`` value into a tokenizer for the coordinator's data.
The shipped tokenizers (``bpe-8k``, ``gpt2``) need no download; ``gpt2`` is the GPT-2 BPE, whose ids fit
every model with the GPT-2 vocabulary (OPT, GPT-2). The result is one of two kinds:

  * ``tokenizers.Tokenizer`` (``bpe-8k``): ``.encode(text).ids``, ``.encode_batch(texts)``,
    ``.get_vocab_size()``, ``.token_to_id("<|endoftext|>")``.
  * ``transformers.PreTrainedTokenizerBase`` (``gpt2`` and everything from ``AutoTokenizer``):
    ``.encode(text, add_special_tokens=False) -> list[int]``, ``tok(texts, add_special_tokens=False)
    ["input_ids"] -> list[list[int]]``, ``len(tok)`` (the vocabulary including added tokens),
    ``.eos_token_id`` (may be None). ``add_special_tokens=False`` matters: LLaMA-style tokenizers would
    otherwise put a BOS token in front of every piece of text encoded.

``tokenizer_vocab_size`` gives the vocabulary of either kind; it must not exceed ``vocab_size_of(spec)``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from gradwire.assets import END_OF_TEXT, gpt2_tokenizer
from gradwire.models.registry import (
    TOKENIZERS,
    AnyTokenizer,
    _build_hf,
    build_from_spec,
    load_tokenizer,
    model_names,
    model_spec,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = ["ResolvedModel", "hf_spec", "load_tokenizer_arg", "resolve_model", "tokenizer_vocab_size", "vocab_size_of"]

log = logging.getLogger("gradwire.models")

# Any one of these in a model directory means it has weights (sharded checkpoints come with an index).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Any one of these means a tokenizer can be loaded; tokenizer_config.json alone does not (see _checked).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)
# Config entries about where and how a config was saved, not about the architecture. dtype goes too: a
# spec always builds in fp32 (the weights are pushed in fp32 whatever the checkpoint stored).
_BOOKKEEPING = (
    "_name_or_path",
    "_commit_hash",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_attn_implementation_autoset",
)

_HUB_NOTE = (
    "hub ids load from the local Hugging Face cache when offline (HF_HUB_OFFLINE=1): "
    "download them once with network access"
)


@dataclasses.dataclass
class ResolvedModel:
    """A ``--model`` value, resolved.

    Attributes:
        spec: JSON-able; ``build_from_spec(spec)`` gives a model with ``model``'s parameter names and shapes.
        model: the coordinator's model, fp32, on the CPU, in train mode, with its starting weights.
        default_tokenizer: a ``--tokenizer`` value for the model's own tokenizer, or None when it has none
            (the user must then pass ``--tokenizer``).
    """

    spec: dict[str, Any]
    model: nn.Module
    default_tokenizer: str | None


def resolve_model(name: str, *, from_scratch: bool = False, seed: int = 0) -> ResolvedModel:
    """Resolve a ``--model`` value: a built-in name, a local model directory, or a hub id (see the module).

    Pretrained weights are loaded unless ``from_scratch`` or the directory holds none; fresh weights come
    from ``build_from_spec(spec, seed)``, exactly as a worker would build them. Built-in models always
    start fresh. Raises ValueError naming ``--model`` when the name resolves to nothing loadable.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"--model must be a model name, directory or hub id, got {name!r}")
    if name in model_names():
        spec = model_spec(name)
        return ResolvedModel(spec, build_from_spec(spec, seed), spec.get("tokenizer"))
    source, is_dir = _locate(name, "--model")
    spec = hf_spec(_load_config(source, name))
    pretrained = not from_scratch and (not is_dir or _has_any(Path(source), WEIGHT_FILES))
    if pretrained:
        model = _load_pretrained(source, name)
        _check_worker_build(spec, model, name)
    else:
        if not from_scratch:
            log.warning("--model %s has no weights (%s): training from fresh weights", name, " / ".join(WEIGHT_FILES))
        model = build_from_spec(spec, seed)  # the worker's own build: identical by construction
    return ResolvedModel(spec, model, source if _has_tokenizer(source, is_dir) else None)


def hf_spec(config: PretrainedConfig) -> dict[str, Any]:
    """The JSON-able spec of a transformers config: every field (not just those differing from the
    defaults, which may change between the coordinator's and a worker's transformers), minus bookkeeping,
    with the KV cache off (training never reuses keys/values across calls)."""
    # to_json_string turns dtypes, sets and other non-JSON values into JSON; to_dict would not.
    fields = json.loads(config.to_json_string(use_diff=False))
    for key in _BOOKKEEPING:
        fields.pop(key, None)
    fields["use_cache"] = False
    for sub in fields.values():  # composite configs (e.g. a text_config) carry their own flag
        if isinstance(sub, dict) and "use_cache" in sub:
            sub["use_cache"] = False
    return {"arch": "hf", "config": fields}


def vocab_size_of(spec: dict[str, Any]) -> int:
    """Token ids fed to the spec's model must be below this."""
    config = spec.get("config")
    if not isinstance(config, dict):
        raise ValueError("spec has no 'config' dict")
    vocab = config.get("vocab_size")
    if vocab is None and isinstance(config.get("text_config"), dict):  # composite configs nest it
        vocab = config["text_config"].get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ValueError(f"spec config has no positive integer vocab_size (got {vocab!r})")
    return vocab


def load_tokenizer_arg(arg: str) -> AnyTokenizer | PreTrainedTokenizerBase:
    """The tokenizer a ``--tokenizer`` value names: ``bpe-8k``, ``gpt2``, a tokenizer directory or a hub id.

    See the module docstring for the two kinds of object this returns. Raises ValueError naming
    ``--tokenizer`` when nothing loadable is found.
    """
    if not isinstance(arg, str) or not arg.strip():
        raise ValueError(f"--tokenizer must be a tokenizer name, directory or hub id, got {arg!r}")
    if arg == "gpt2":
        return gpt2_hf_tokenizer()
    if arg in TOKENIZERS:
        return load_tokenizer(arg)
    source, is_dir = _locate(arg, "--tokenizer")
    if is_dir and not _has_any(Path(source), TOKENIZER_FILES):
        raise ValueError(
            f"--tokenizer directory {arg!r} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--tokenizer {arg!r} is neither {' nor '.join(sorted(TOKENIZERS))}, a tokenizer directory, nor a hub "
            f"id with a tokenizer in the local cache; {_HUB_NOTE} ({_first_line(e)})"
        ) from None
    return _checked(tok, arg)


def gpt2_hf_tokenizer() -> PreTrainedTokenizerBase:
    """The shipped GPT-2 BPE as a transformers tokenizer, with GPT-2's special tokens (all ``<|endoftext|>``)."""
    from transformers import PreTrainedTokenizerFast

    # Not GPT2TokenizerFast(vocab_file=..., merges_file=...): in transformers 5 it silently builds a
    # one-token tokenizer. model_max_length stays "unlimited": documents are longer than any context.
    bpe = gpt2_tokenizer()
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, unk_token=END_OF_TEXT
    )


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Ids from ``tokenizer`` are below this: ``get_vocab_size()`` (tokenizers) or ``len`` (transformers,
    which counts added tokens; ``.vocab_size`` does not)."""
    get = getattr(tokenizer, "get_vocab_size", None)
    return int(get()) if callable(get) else len(tokenizer)


# ------------------------------------------------------------------------------------------ internals


def _locate(name: str, flag: str) -> tuple[str, bool]:
    """``(source, is_dir)``: an existing directory (expanded), or ``name`` itself as a hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        if flag == "--model" and not (path / "config.json").is_file():
            raise ValueError(f"--model directory {name!r} has no config.json")
        return str(path), True
    # A hub id is "name" or "org/name"; anything else can only have been meant as a path.
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name:
        raise ValueError(f"{flag} {name!r}: no such directory")
    return name, False


def _load_config(source: str, name: str) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        # trust_remote_code=False: a spec carries configs, never code (and no interactive prompt).
        return AutoConfig.from_pretrained(source, trust_remote_code=False)
    except OSError as e:  # not found: neither in the cache nor (when online) on the hub
        raise ValueError(
            f"--model {name!r} is neither a built-in model ({', '.join(model_names())}), a local directory "
            f"with config.json, nor a hub id in the local Hugging Face cache; {_HUB_NOTE} ({_first_line(e)})"
        ) from None
    except ValueError as e:  # e.g. an architecture transformers does not know (remote code)
        raise ValueError(f"--model {name!r}: {_first_line(e)}") from None


def _load_pretrained(source: str, name: str) -> nn.Module:
    import transformers
    from transformers import AutoModelForCausalLM

    # fp32 whatever the checkpoint stores: since transformers 5 the default is the checkpoint's dtype.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, use_cache=False, trust_remote_code=False, **{dtype_kw: torch.float32}
        )
    except OSError as e:  # weights missing from the cache, or unreadable
        raise ValueError(
            f"--model {name!r}: cannot load its weights ({_first_line(e)}); {_HUB_NOTE}, "
            "or pass --from-scratch for fresh weights"
        ) from None
    except ValueError as e:  # e.g. the config is not a causal language model
        raise ValueError(f"--model {name!r}: {_first_line(e)}") from None
    return model.train()


def _check_worker_build(spec: dict[str, Any], model: nn.Module, name: str) -> None:
    """Build the spec as a worker will, on the meta device (no memory, no init), and compare parameters:
    a config that does not survive the JSON round trip fails here, not on every worker."""
    with torch.device("meta"):
        worker = _build_hf(dict(spec["config"]))
    theirs = {n: tuple(p.shape) for n, p in worker.named_parameters()}
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if theirs != ours:
        diff = sorted(set(theirs.items()) ^ set(ours.items()))[:5]
        raise ValueError(f"--model {name!r}: a worker would build different parameters from its config: {diff}")


def _has_tokenizer(source: str, is_dir: bool) -> bool:
    if is_dir:
        return _has_any(Path(source), TOKENIZER_FILES)
    from huggingface_hub import constants, try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(source, f), str) for f in TOKENIZER_FILES):
        return True
    # Online, an uncached tokenizer is downloaded with it; offline, nothing can be.
    return not constants.HF_HUB_OFFLINE


def _has_any(directory: Path, names: tuple[str, ...]) -> bool:
    return any((directory / n).is_file() for n in names)


def _checked(tok: PreTrainedTokenizerBase, arg: str) -> PreTrainedTokenizerBase:
    # With its vocabulary files missing, AutoTokenizer may build a tokenizer of one token instead of failing.
    if len(tok) < 2:
        raise ValueError(
            f"--tokenizer {arg!r}: the tokenizer loaded with {len(tok)} token(s); its vocabulary files are missing"
        )
    return tok


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
