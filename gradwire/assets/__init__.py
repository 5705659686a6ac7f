"""Files shipped inside the package so that a fresh install trains and benchmarks offline.

  shakespeare.txt          ~1 MB of Shakespeare (8 whole plays, Project Gutenberg via the OKFN `shakespeare`
                           package, CC BY 2.5; see LICENSE-shakespeare.txt): the default corpus.
  tokenizer-8k.json        byte-level BPE, 8192 tokens, trained on shakespeare.txt by
                           scripts/train_tokenizer.py: the tokenizer of the built-in GPT models.
  gpt2-bpe/encoder.json,   the GPT-2 vocabulary and merges (MIT, see gpt2-bpe/LICENSE): the tokenizer of
  gpt2-bpe/vocab.bpe       OPT and GPT-2 shaped models, without a hub download.

Every function returns a fresh object: tokenizers carry mutable padding/truncation settings, so a shared
cached instance would let one caller change another's encoding.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import ByteLevelBPETokenizer, Tokenizer

__all__ = ["END_OF_TEXT", "assets_dir", "corpus_path", "default_tokenizer", "gpt2_tokenizer"]

END_OF_TEXT = "<|endoftext|>"

# The package is installed as plain files (never zipped), so the files sit next to this module.
_DIR = Path(__file__).resolve().parent


def assets_dir() -> Path:
    return _DIR


def corpus_path() -> Path:
    """The default training text: plain ASCII, plays separated by blank lines."""
    return _DIR / "shakespeare.txt"


def default_tokenizer() -> Tokenizer:
    """The 8192-token byte-level BPE of the built-in GPT models; ``<|endoftext|>`` is id 0."""
    return Tokenizer.from_file(str(_DIR / "tokenizer-8k.json"))


def gpt2_tokenizer() -> ByteLevelBPETokenizer:
    """The GPT-2 byte-level BPE (50257 tokens; ``"Hello world"`` -> ``[15496, 995]``).

    Built from encoder.json/vocab.bpe directly: in transformers 5, ``GPT2TokenizerFast(vocab_file=...,
    merges_file=...)`` silently builds a one-token tokenizer. Wrap the result with
    ``transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer)`` if an HF tokenizer is needed.
    """
    tok = ByteLevelBPETokenizer(str(_DIR / "gpt2-bpe" / "encoder.json"), str(_DIR / "gpt2-bpe" / "vocab.bpe"))
    # Already in the vocabulary as id 50256; registering it keeps the text "<|endoftext|>" from being split.
    tok.add_special_tokens([END_OF_TEXT])
    return tok
