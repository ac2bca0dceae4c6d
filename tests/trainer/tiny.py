"""A tiny random Llama and a character-level tokenizer in a HF-format directory, for trainer tests."""
from __future__ import annotations

import json
import os
from dataclasses import fields

import torch

from dapo_trainer.hf_io import save_hf_model
from dapo_trainer.model import ModelConfig, Transformer
from dapo_trainer.records import TrainBatch

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


def write_tiny_model(path: str, *, hidden: int = 32, layers: int = 1, heads: int = 2, kv_heads: int = 2,
                     seed: int = 0, **family) -> str:
    """A random tiny Llama (vocab padded to a multiple of 4 so TP=2 divides it) + the char tokenizer;
    ``family``: ModelConfig switches of another family (``model_type``, ``qk_norm``, ...)."""
    v = write_char_tokenizer(path)
    cfg = ModelConfig(vocab_size=(v + 3) // 4 * 4, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=256, **family)
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


# A reward whose value varies within groups (so dynamic sampling keeps some and drops
# others) and that is cheap: parity of the response's digit sum.
PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    s = sum(int(c) for c in solution_str if c.isdigit())
    return {"score": float(s % 2), "acc": float(s % 2)}
"""
# Rewards 1, 0, 1, 0, ... in call order: every group of two or more responses is mixed, so always kept.
ALTERNATING_REWARD = """
_calls = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    return float(_calls[0] % 2)
"""
ZERO_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
"""


def micro_setup(root: str, reward_src: str = PARITY_REWARD, *, n_train: int = 24, n_val: int = 4) -> list:
    """Model, data and reward under ``root``; returns the config overrides of a micro run."""
    write_tiny_model(os.path.join(root, "model"))
    write_arithmetic_rows(os.path.join(root, "train.jsonl"), n_train, seed=0)
    write_arithmetic_rows(os.path.join(root, "val.jsonl"), n_val, seed=1)
    with open(os.path.join(root, "reward.py"), "w") as f:
        f.write(reward_src)
    return [
        f"actor_rollout_ref.model.path={root}/model", f"data.train_files={root}/train.jsonl",
        f"data.val_files={root}/val.jsonl", f"custom_reward_function.path={root}/reward.py",
        f"trainer.default_local_dir={root}/run", "trainer.device=cpu", "trainer.progress_bar=false",
        "data.train_batch_size=2", "data.gen_batch_size=3", "data.max_prompt_length=6",
        "data.max_response_length=5", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=2",
    ]


def train_batch(**given) -> TrainBatch:
    """A :class:`TrainBatch` of the ``given`` fields (``prompt_ids`` and ``response_ids`` among
    them), every other field zeros of its dtype and width."""
    (n, p), r = given["prompt_ids"].shape, given["response_ids"].shape[1]
    width = {"prompt": (p,), "response": (r,), "routing": (0,), None: ()}
    return TrainBatch(**{f.name: given[f.name] if f.name in given else
                         torch.zeros(n, *width[f.metadata["width"]], dtype=f.metadata["dtype"])
                         for f in fields(TrainBatch)})
