#!/usr/bin/env python3
"""Writes a small Hugging Face tokenizer into DIR for aiperf, with no hub download.

Usage: tokenizer.py CORPUS DIR

A word-level tokenizer: one token per whitespace-separated word of CORPUS (aiperf's own prompt
corpus), plus `tok` (the simulated workers' output word) and `[UNK]`. It counts tokens the way
kvc-router's default tokenizer and the standalone simulated workers do (one per word), so
aiperf's input and output lengths are the workers' `usage` counts.
"""
import json
import os
import sys

from tokenizers import Tokenizer, models, pre_tokenizers


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[2])
    corpus, out = sys.argv[1], sys.argv[2]
    with open(corpus, encoding="utf-8") as f:
        words = sorted(set(f.read().split()) | {"tok"})
    vocab = {"[UNK]": 0}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
                   "model_max_length": 1_000_000}, f)
    print(f"tokenizer.py: {len(vocab)} words into {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
