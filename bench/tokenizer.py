"""A synthetic byte-level BPE tokenizer of a real model's vocabulary size, for benchmarks that need one
(constrained decoding: llguidance's masks walk the tokenizer's trie, so their cost depends on the
vocabulary's size and shape) on random checkpoints that ship none.

    python bench/tokenizer.py /tmp/gpt-oss-20b            # vocab from its config.json: 201088, EOS 200002

The merges are drawn, not learnt: starting from the 256 byte symbols, each new token joins two
existing ones, mostly a letter run with a letter run (a leading space often), sometimes digits or
punctuation, so token lengths and the trie's fan-out resemble a trained BPE's (most tokens 2-10 bytes,
words with and without a leading space). It is not o200k or DeepSeek's vocabulary: a mask's cost on it
approximates, not reproduces, the real tokenizer's. Deterministic for a seed; about 20 s for 200K tokens.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

EOS = "<|endoftext|>"


def build(vocab_size: int, eos_id: int, seed: int = 0):
    """A tokenizers.Tokenizer with BPE tokens at ids [0, eos_id) and EOS at eos_id (ids above it unused)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    alphabet = sorted(byte_chars, key=lambda c: ord(c))
    space = "Ġ"  # byte-level's space
    letters = [c for c in alphabet if c.isalpha() and c.isascii()]
    rng = random.Random(seed)
    vocab = {c: i for i, c in enumerate(alphabet)}
    tokens = list(alphabet)
    words = [c for c in letters]
    merges = []
    target = min(eos_id, vocab_size)
    while len(tokens) < target:
        roll = rng.random()
        if roll < 0.75:  # extend a word piece by a letter or a short piece
            left = rng.choice(words if rng.random() < 0.8 else tokens[:len(alphabet)])
            right = rng.choice(letters) if rng.random() < 0.6 else rng.choice(words)
            if rng.random() < 0.3 and not left.startswith(space):
                left, right = space, left
        elif roll < 0.85:
            left, right = rng.choice("0123456789"), rng.choice("0123456789")
        else:
            left, right = rng.choice(tokens), rng.choice(alphabet)
        token = left + right
        if token in vocab or len(token) > 16 or left not in vocab or right not in vocab:
            continue
        vocab[token] = len(tokens)
        tokens.append(token)
        merges.append((left, right))
        if token.strip(space).isalpha():
            words.append(token)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    return tok


def write(path: Path, seed: int = 0) -> None:
    """tokenizer.json and tokenizer_config.json for the checkpoint at path (its config.json's vocab and EOS)."""
    config = json.loads((path / "config.json").read_text())
    vocab_size = config["vocab_size"]
    eos = config.get("eos_token_id", vocab_size - 1)
    eos_id = eos[0] if isinstance(eos, list) else eos
    tok = build(vocab_size, eos_id, seed)
    if tok.token_to_id(EOS) != eos_id:
        raise RuntimeError(f"EOS landed at {tok.token_to_id(EOS)}, not {eos_id}")
    (path / "tokenizer.json").write_text(tok.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "model_max_length": 1 << 20}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="a checkpoint directory (its config.json gives vocab_size, eos_token_id)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write(args.path, args.seed)
    print(f"wrote {args.path}/tokenizer.json")


if __name__ == "__main__":
    main()
