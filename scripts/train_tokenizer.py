"""Reproduce gradwire/assets/tokenizer-8k.json: the default tokenizer of the built-in GPT models.

A byte-level BPE (the GPT-2 scheme: any byte string encodes, nothing is ever unknown) with 8192 tokens,
trained on the shipped Shakespeare corpus. 8192 instead of GPT-2's 50257 keeps the embedding of a small
model small: at d_model 512 it is 4.2M parameters instead of 25.7M.

    python scripts/train_tokenizer.py            # overwrites gradwire/assets/tokenizer-8k.json

Training is deterministic for a given `tokenizers` version and takes a second or two.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import ByteLevelBPETokenizer

ASSETS = Path(__file__).resolve().parent.parent / "gradwire" / "assets"
END_OF_TEXT = "<|endoftext|>"


def train(corpus: Path, vocab_size: int, out: Path) -> ByteLevelBPETokenizer:
    tok = ByteLevelBPETokenizer()
    # min_frequency=2: a pair seen once is noise, not a word piece worth a vocabulary slot.
    tok.train(
        files=[str(corpus)],
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))  # one tokenizer.json: model, pre-tokenizer, decoder and special tokens together
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=ASSETS / "shakespeare.txt", help="training text")
    parser.add_argument("--vocab-size", type=int, default=8192, help="tokens, including the special token")
    parser.add_argument("--out", type=Path, default=ASSETS / "tokenizer-8k.json", help="tokenizer.json to write")
    args = parser.parse_args()
    if args.vocab_size < 257:
        parser.error(f"--vocab-size must be at least 257 (256 bytes + {END_OF_TEXT}), got {args.vocab_size}")
    tok = train(args.corpus, args.vocab_size, args.out)
    print(f"wrote {args.out} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
