"""The trained model as a self-contained directory that loads without gradwire's training code.

Two layouts, one per kind of spec (see ``gradwire.models.registry``):

    Hugging Face (spec "arch": "hf")        built-in GPT (spec "arch": "gpt")
      config.json, model.safetensors          config.json        the spec: {"arch", "tokenizer", "config"}
      generation_config.json (if any)         model.safetensors  tied weights stored once
      tokenizer.json, tokenizer_config.json   tokenizer.json     a tokenizers.Tokenizer file

The first is what ``save_pretrained`` writes, so ``AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)`` load it. The second needs gradwire's GPT class but nothing else:
``load_exported(dir)`` reads either kind back. Safetensors only, so loading never unpickles.

A directory is written in full under a temporary name next to its destination and renamed into place, so
a crash leaves either the previous export or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch.nn as nn
from safetensors.torch import load_model, save_model
from tokenizers import Tokenizer

from gradwire.assets import END_OF_TEXT
from gradwire.models import build_from_spec, load_tokenizer
from gradwire.models.gpt import GPT
from gradwire.models.registry import TOKENIZERS

__all__ = ["export_model", "load_exported"]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"


def export_model(model: nn.Module, spec: dict[str, Any], out_dir: Path | str, tokenizer: Any = None) -> Path:
    """Write ``model`` (built from ``spec``) and its tokenizer to ``out_dir``, replacing what is there.

    ``tokenizer`` may be a transformers tokenizer, a ``tokenizers.Tokenizer`` or a ``ByteLevelBPETokenizer``;
    when it is None and the spec names a shipped tokenizer ("bpe-8k", "gpt2"), that one is written, so the
    directory is self-contained. Returns ``out_dir``.
    """
    arch = spec.get("arch")
    if arch not in ("gpt", "hf"):
        raise ValueError(f"spec 'arch' must be 'gpt' or 'hf', got {arch!r}")
    if tokenizer is None and spec.get("tokenizer") in TOKENIZERS:
        tokenizer = load_tokenizer(spec["tokenizer"])
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"cannot export to {out_dir}: it exists and is not a directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; an export is meant to be read by others
        if arch == "hf":
            _write_hf(model, tmp, tokenizer)
        else:
            _write_gpt(model, spec, tmp, tokenizer)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_exported(path: Path | str) -> tuple[nn.Module, Any]:
    """The model (in eval mode, on the CPU) and tokenizer (None if the directory has none) in ``path``.

    A built-in GPT comes back with a ``tokenizers.Tokenizer``; a Hugging Face model with the
    ``AutoTokenizer`` of the directory.
    """
    path = Path(path)
    config_path = path / CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not an exported model: it has no {CONFIG}")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("arch") == "gpt":
        return _read_gpt(path, config)
    if "model_type" in config:
        return _read_hf(path)
    raise ValueError(
        f"{config_path} is neither a gradwire GPT spec ('arch': 'gpt') nor a transformers config ('model_type')"
    )


# ------------------------------------------------------------------------------------------- built-in GPT


def _write_gpt(model: nn.Module, spec: dict[str, Any], out: Path, tokenizer: Any) -> None:
    if not isinstance(model, GPT):
        raise TypeError(f"spec 'arch' is 'gpt' but the model is a {type(model).__name__}, not the built-in GPT")
    # save_model, not save_file: it stores the tied lm_head/tok_emb matrix once and load_model re-ties it.
    save_model(model, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")
    if tokenizer is not None:
        _backend(tokenizer).save(str(out / TOKENIZER))


def _read_gpt(path: Path, spec: dict[str, Any]) -> tuple[nn.Module, Tokenizer | None]:
    model = build_from_spec(spec)  # validates the spec; the fresh weights are overwritten next
    # strict: a missing or extra tensor means the file and the spec disagree; refuse rather than half-load.
    load_model(model, str(path / WEIGHTS), strict=True)
    tokenizer_path = path / TOKENIZER
    tokenizer = Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path.is_file() else None
    return model.eval(), tokenizer


def _backend(tokenizer: Any) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` inside any of the tokenizer kinds we meet."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    # transformers' fast tokenizers expose it as backend_tokenizer; tokenizers' BaseTokenizer as _tokenizer.
    for attr in ("backend_tokenizer", "_tokenizer"):
        inner = getattr(tokenizer, attr, None)
        if isinstance(inner, Tokenizer):
            return inner
    raise TypeError(
        f"cannot export a tokenizer of type {type(tokenizer).__name__}: expected a tokenizers.Tokenizer or a fast "
        "tokenizer"
    )


# ------------------------------------------------------------------------------------------- Hugging Face


def _write_hf(model: nn.Module, out: Path, tokenizer: Any) -> None:
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"spec 'arch' is 'hf' but the model is a {type(model).__name__}, not a transformers PreTrainedModel"
        )
    # Safetensors is save_pretrained's only format in transformers 5 and its default since 4.35; the
    # safe_serialization argument is gone in 5, so it is not passed.
    model.save_pretrained(out)
    if tokenizer is None:
        return
    if not hasattr(tokenizer, "save_pretrained"):
        tokenizer = _as_transformers(tokenizer)
    tokenizer.save_pretrained(out)


def _as_transformers(tokenizer: Any) -> Any:
    """Wrap a plain tokenizers object so that ``AutoTokenizer.from_pretrained`` can load what it saves."""
    from transformers import PreTrainedTokenizerFast

    backend = _backend(tokenizer)
    special: dict[str, str] = {}
    if backend.token_to_id(END_OF_TEXT) is not None:  # the GPT-2 vocabulary's one special token
        special = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def _read_hf(path: Path) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    has_tokenizer = (path / "tokenizer_config.json").is_file() or (path / TOKENIZER).is_file()
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return model.eval(), tokenizer


# ------------------------------------------------------------------------------------------- files


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    # A directory cannot be renamed over a non-empty one: move the old export aside first, then delete it.
    # Between the two renames out_dir is briefly absent, but never half-written.
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
    out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except BaseException:
        old.rename(out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)
