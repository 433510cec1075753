"""Builds the tiny model the real-vLLM harness serves, the same bytes on every run.

No model can be downloaded here, so one is made: a Llama with random weights (2 layers,
hidden 128, 4 attention heads, 2 KV heads, vocabulary 4,096, fixed seed) saved with
`save_pretrained`, and a byte-level BPE `tokenizer.json` trained with the `tokenizers`
package on a fixed generated corpus, with a `tokenizer_config.json` carrying a chat template.
vLLM loads the directory as an ordinary model (about 1.6 MB). Answers of a random-weight
model are noise; what the harness measures is how the engine serves and caches prompts.

Usage: python build_model.py OUT_DIR   (OUT_DIR is replaced if it holds an older build)
"""

import hashlib
import json
import os
import random
import shutil
import sys

VOCAB = 4096
# Bump when anything below changes what is written (the directory is rebuilt).
BUILD = "kvc-tiny-llama-1"

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] is not none %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for call in m['tool_calls'] %}"
    "\n[{{ call['function']['name'] }}({{ call['function']['arguments'] }})]"
    "{% endfor %}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(lines=4000, seed=11):
    """Deterministic English-like text: words from a fixed stock, code-ish punctuation."""
    stock = (
        "the a of to and in is it that for on with as was this by be are from at or an "
        "file line code test function return value error result request session worker "
        "token cache block prefix decode prefill router turn agent tool call output input "
        "python rust import def class self true false none null print open read write path "
        "list dict string number index count time seconds model engine server client http "
        "json yaml config build run fix bug patch diff commit branch merge repo issue step "
        "if else for while try except raise assert yield async await let mut fn impl pub "
        "struct enum match use mod crate trait where type const static loop break continue"
    ).split()
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 18)
        words = [rng.choice(stock) for _ in range(n)]
        sep = rng.choice([" ", " ", " ", ", ", "_", ".", "(", ") ", ": ", " = ", "\n    "])
        out.append(sep.join(words) + rng.choice([".", ";", ":", "", " {", " }", "()"]))
        out.append(str(rng.randint(0, 99999)))
    return out


def build(out_dir):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    specials = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|tool|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|bos|>",
            "eos_token": "<|eos|>",
            "pad_token": "<|pad|>",
            "add_bos_token": False,
            "model_max_length": 32768,
            "chat_template": CHAT_TEMPLATE,
        }, f, indent=2, sort_keys=True)
    with open(os.path.join(tmp, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"},
                  f, indent=2, sort_keys=True)

    vocab = tok.get_vocab_size()
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        bos_token_id=tok.token_to_id("<|bos|>"),
        eos_token_id=tok.token_to_id("<|eos|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    assert vocab <= VOCAB, f"tokenizer has {vocab} tokens, over {VOCAB}"
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(tmp, safe_serialization=True)
    # Generation defaults: no stop before max_tokens on a random model's stray end token.
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": False, "do_sample": False}, f, indent=2, sort_keys=True)
    with open(os.path.join(tmp, "BUILD"), "w") as f:
        f.write(BUILD + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)


def digest(out_dir):
    h = hashlib.sha256()
    for name in sorted(os.listdir(out_dir)):
        h.update(name.encode())
        with open(os.path.join(out_dir, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: build_model.py OUT_DIR")
    out_dir = os.path.abspath(sys.argv[1])
    stamp = os.path.join(out_dir, "BUILD")
    if os.path.exists(stamp) and open(stamp).read().strip() == BUILD:
        print(f"model: {out_dir} (built before, {BUILD})", file=sys.stderr)
    else:
        build(out_dir)
        print(f"model: built {out_dir} ({BUILD})", file=sys.stderr)
    print(f"model: sha256 of its files {digest(out_dir)}", file=sys.stderr)
    print(out_dir)


if __name__ == "__main__":
    main()
