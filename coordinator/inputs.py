"""What a run trains and on what: the model, its tokenizer and the data, checked against each other.

``load_inputs`` resolves ``--model`` (built-in, hub id or directory), ``--tokenizer`` (default: the
model's own) and ``--data`` (default: the embedded corpus), and refuses combinations that cannot train:
a tokenizer with more tokens than the model embeds, sequences longer than the model's positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.data import TokenSource, batch_dtype, open_data
from gradwire.coordinator.rundir import checkpoint_root, resume_source
from gradwire.models import load_tokenizer_arg, resolve_model, tokenizer_vocab_size, vocab_size_of


def max_sequence_length(spec: dict) -> int | None:
    """The longest sequence a model spec can take, when its config says."""
    config = spec.get("config", {})
    for key in ("max_seq_len", "max_position_embeddings", "n_positions"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


@dataclasses.dataclass
class RunInputs:
    model: torch.nn.Module
    spec: dict
    tokenizer: Any
    data: TokenSource
    batch_dtype: np.dtype  # the narrowest dtype that holds the model's token ids


def load_inputs(config: TrainConfig, n_slots: int) -> RunInputs:
    """The model, tokenizer and data of ``config`` for ``n_slots`` workers; ``ValueError`` naming the flag."""
    # A resumed run takes its weights from the checkpoint: no need to load (or have) pretrained ones.
    resumed = resume_source(config.resume_from, checkpoint_root(config.output_dir, config.checkpoint_dir))
    from_scratch = config.from_scratch or resumed is not None
    resolved = resolve_model(config.model, from_scratch=from_scratch, seed=config.seed)
    spec = resolved.spec
    tokenizer_name = config.tokenizer or resolved.default_tokenizer
    if tokenizer_name is None:
        raise ValueError(
            f"--model {config.model} has no tokenizer of its own: pass --tokenizer "
            "(e.g. gpt2 for GPT-2-vocabulary models)"
        )
    tokenizer = load_tokenizer_arg(tokenizer_name)
    if tokenizer_vocab_size(tokenizer) > vocab_size_of(spec):
        raise ValueError(
            f"--tokenizer {tokenizer_name} has {tokenizer_vocab_size(tokenizer)} tokens; "
            f"--model {config.model} embeds only {vocab_size_of(spec)}"
        )
    data = open_data(
        paths=config.data,
        tokenizer=tokenizer,
        seq_len=config.sequence_length,
        seed=config.seed,
        data_config=config.data_config,
        text_field=config.text_field,
        streaming=config.streaming,
        n_slots=n_slots,
        val_rows=config.eval_batches * config.batch_size,
    )
    limit = max_sequence_length(spec)
    if limit is not None and config.sequence_length > limit:
        raise ValueError(
            f"--sequence-length {config.sequence_length} exceeds the {limit} positions of --model {config.model}"
        )
    return RunInputs(resolved.model, spec, tokenizer, data, batch_dtype(vocab_size_of(spec)))
