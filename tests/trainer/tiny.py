"""A tiny random Llama and a character-level tokenizer in a HF-format directory, for trainer tests."""
from __future__ import annotations

import json
import os

import torch

from dapo_trainer.hf_io import save_hf_model
from dapo_trainer.model import ModelConfig, Transformer

CHARS = list("0123456789+-=*/ #:?\nabcdefghijklmnopqrstuvwxyz")
SPECIALS = ["<pad>", "<eos>"]


def write_char_tokenizer(path: str) -> int:
    """``tokenizer.json`` + ``tokenizer_config.json`` for a char-level vocabulary; returns the vocab size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "pad_token": "<pad>"}, f)
    return len(vocab)


def write_tiny_model(path: str, *, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     seed: int = 0) -> str:
    """A random tiny Llama (vocab padded to a multiple of 4 so TP=2 divides it) + the char tokenizer."""
    v = write_char_tokenizer(path)
    cfg = ModelConfig(vocab_size=(v + 3) // 4 * 4, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=256)
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        model = Transformer(cfg).init_weights(std=0.1)
    save_hf_model(model, path)
    return path


def write_arithmetic_rows(path: str, n: int, seed: int = 0) -> str:
    """``n`` jsonl rows "a+b=" -> "a+b" with data_source "arithmetic"."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = torch.randint(0, 10, (2,), generator=g).tolist()
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "data_source": "arithmetic"}) + "\n")
    return path
