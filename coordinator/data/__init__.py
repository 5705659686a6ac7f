"""Training data: token ids from text files, structured files or a hub dataset, and deterministic batches.

``open_data`` is the one entry point; it resolves ``--data`` and returns a ``TokenSource`` of one of two kinds:

* ``TokenStream`` (in ``corpus``) holds the whole tokenized corpus in memory (cached on disk as .npy). A
  training batch is a function of ``(seed, step, slot)`` alone -- its window offsets come from
  ``np.random.default_rng([seed, step, slot])`` -- so resuming needs only the step, and worker slot ``i`` at
  step ``t`` gets the same rows on every run, whichever worker holds the slot. The last ``val_fraction`` of
  tokens (or the dataset's validation split) is held out.
* ``StreamingTokenSource`` (``--streaming``, in ``streaming``) reads the corpus in order and tokenizes it
  on the fly, for corpora larger than memory; its rows too are the same on every run.

Documents: each text file is one, and so is each row's ``--text-field`` of jsonl/json/csv/parquet files (read
through ``datasets``) or of a hub dataset. Every document ends with the end-of-text token, so a window
spanning two documents shows the model where one ended. Rows are ``seq_len + 1`` tokens long: inputs are
``row[:-1]``, targets ``row[1:]``. Resolving ``--data`` to a source and reading its documents is in
``sources``; the tokenizer adapter both kinds share is in ``tokens``.
"""

from gradwire.coordinator.data.corpus import (
    DataConfig,
    TokenizerLike,
    TokenSource,
    TokenStream,
    cache_dir,
    open_data,
    read_texts,
    tokenize_corpus,
)
from gradwire.coordinator.data.streaming import StreamingTokenSource
from gradwire.coordinator.data.tokens import batch_dtype

__all__ = [
    "DataConfig",
    "StreamingTokenSource",
    "TokenSource",
    "TokenStream",
    "TokenizerLike",
    "batch_dtype",
    "cache_dir",
    "open_data",
    "read_texts",
    "tokenize_corpus",
]
