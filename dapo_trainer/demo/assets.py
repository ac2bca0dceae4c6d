"""Everything the demo trains on, built once and cached on disk.

:func:`build_demo` writes, under ``cache_dir/<hash of the settings>/``:

- ``model/``: an ordinary Hugging Face model directory: ``config.json`` + safetensors
  (:func:`dapo_trainer.hf_io.save_hf_model`) of a tiny Llama (``DemoConfig.family``: or Qwen3, or
  Qwen3-MoE), ``tokenizer.json`` (a
  character-level ``tokenizers`` tokenizer) and ``tokenizer_config.json`` with the
  eos / pad tokens, so the trainer (and vLLM) load it like any other checkpoint;
- ``train.jsonl`` / ``val.jsonl``: the task's rows (:mod:`.arithmetic`);
- ``warm_start.json``: the supervised warm-start's settings and loss curve.

The model is warm-started by a short supervised phase on *mixed-convention* data: a
fraction ``warm_start_descending`` of the sorting demonstrations list the digits in
descending order, the rest ascending, while the task's checker (the reward) accepts
ascending only. Supervised data that mixes conventions or quality is the ordinary case;
the warm-started model can sort both ways but greedily answers in the majority
(descending) convention, so its held-out accuracy starts low, and its samples contain
the rewarded convention often enough for RL to find it. What DAPO has to learn, from
the reward alone, is which of the model's own behaviours the verifier wants. (Measured:
on correct-only data the same model needs 400 supervised steps to reach 100% held-out;
from a 50-step, 34% warm start, RL at these budgets moved greedy accuracy by < 5 points,
while sampled answers sharpened onto the greedy ones.) The directory name is a hash of every setting (and :data:`ASSETS_VERSION`),
so a second run with the same settings skips the build and a changed setting rebuilds.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import List

import torch

from ..hf_io import save_hf_model
from ..model import ModelConfig, Transformer
from .arithmetic import CHARSET, TaskConfig, make_split, write_jsonl

__all__ = ["DemoConfig", "DemoAssets", "build_demo", "build_tokenizer", "PAD", "EOS"]

# Bump when the build changes in a way the settings do not capture.
ASSETS_VERSION = 3
PAD, EOS = "<pad>", "<eos>"
# DemoConfig.family -> the ModelConfig switches of its tiny model. qwen3_moe: 8 experts of a quarter of the
# dense MLP's width, 2 active per token, so half the dense MLP's work per token.
FAMILIES = {
    "llama": {},
    "qwen3": dict(model_type="qwen3", qk_norm=True),
    "qwen3_moe": dict(model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=96, norm_topk_prob=True),
}


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the demo's task, model and warm start (all part of the cache key)."""

    seed: int = 0
    task: TaskConfig = field(default_factory=TaskConfig)
    num_train: int = 20000
    num_val: int = 200
    # A tiny Llama: head_dim 64 so that vLLM's attention backends accept it.
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 64
    # Supervised warm start (teacher forcing on the answer tokens only).
    warm_start_steps: int = 300
    warm_start_batch_size: int = 64
    warm_start_lr: float = 3e-3
    # Fraction of the warm start's sorting demonstrations written in descending order
    # (the checker wants ascending): the behaviour RL has to unlearn. 0 = correct data only.
    warm_start_descending: float = 0.6
    # Fraction of the sorting demonstrations that show their work first: the input digits, ":",
    # then the sorted digits ("52817:12578"), a response twice as long (the ablation's
    # truncation task, demo/ablation.py; the demo's checker accepts digits only).
    warm_start_verbose: float = 0.0
    family: str = "llama"  # the tiny model's family: a key of FAMILIES

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"DemoConfig.family must be one of {sorted(FAMILIES)}, got {self.family!r}")
        for name in ("warm_start_descending", "warm_start_verbose"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"DemoConfig.{name} must be in [0, 1], got {v!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["task"] = self.task.to_dict()
        if not self.warm_start_verbose:  # keeps the cache key of the settings from before the field
            del d["warm_start_verbose"]
        if self.family == "llama":  # likewise
            del d["family"]
        return d

    def key(self) -> str:
        blob = json.dumps({"version": ASSETS_VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DemoAssets:
    root: str
    model_dir: str
    train_file: str
    val_file: str
    built: bool  # False when found in the cache

    def warm_start_info(self) -> dict:
        with open(os.path.join(self.root, "warm_start.json")) as f:
            return json.load(f)


# --------------------------------------------------------------------------- tokenizer
def build_tokenizer():
    """A character-level ``tokenizers.Tokenizer``: ``<pad>`` = 0, ``<eos>`` = 1, then one id
    per character of :data:`~.arithmetic.CHARSET`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {PAD: 0, EOS: 1}
    for ch in CHARSET:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters concatenate back without spaces
    tok.add_special_tokens([PAD, EOS])
    return tok


def _write_tokenizer(tok, model_dir: str) -> None:
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
                   "model_max_length": 64, "clean_up_tokenization_spaces": False}, f, indent=2)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tok.token_to_id(EOS), "pad_token_id": tok.token_to_id(PAD)}, f, indent=2)


# --------------------------------------------------------------------------- warm start
def warm_start_targets(problems, cfg: DemoConfig) -> List[str]:
    """The supervised target of each problem: its answer, or for a seeded fraction
    ``cfg.warm_start_descending`` of the sorting problems the digits in descending order;
    a seeded fraction ``cfg.warm_start_verbose`` of those is prefixed with the input digits and ":"."""
    rng = random.Random(cfg.seed * 7919 + 17)
    vrng = random.Random(cfg.seed * 7919 + 29)  # its own stream: the descending draws stay as they were
    out = []
    for p in problems:
        sort = p.prompt.startswith("sort:")
        desc = sort and rng.random() < cfg.warm_start_descending
        target = "".join(sorted(p.answer, reverse=True)) if desc else p.answer
        if sort and cfg.warm_start_verbose and vrng.random() < cfg.warm_start_verbose:
            target = p.prompt[len("sort:"):-1] + ":" + target
        out.append(target)
    return out


def _model_config(cfg: DemoConfig, vocab_size: int, eos_id: int, pad_id: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        hf_config={"eos_token_id": eos_id, "pad_token_id": pad_id, "bos_token_id": None}, **FAMILIES[cfg.family],
    )


def _pack(examples: List[tuple]):
    """Pack ``(prompt_ids, answer_ids)`` pairs; return inputs, cu_seqlens, max_seqlen, and the
    positions whose *next* token is an answer token with those next tokens (the labels)."""
    ids, lens, pos, labels = [], [], [], []
    for p, a, *mask in examples:
        start = len(ids)
        seq = p + a
        ids += seq
        lens.append(len(seq))
        # Token seq[i] is predicted from position i - 1; an optional third item masks answer tokens
        # out (a dialogue's environment turns are context, not targets).
        for i in range(len(p), len(seq)):
            if not mask or mask[0][i - len(p)]:
                pos.append(start + i - 1)
                labels.append(seq[i])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return (torch.tensor(ids), cu, max(lens), torch.tensor(pos), torch.tensor(labels))


def warm_start(model: Transformer, encoded: List[tuple], cfg: DemoConfig, progress: bool = True) -> List[float]:
    """Supervised next-token training on the answers (prompt tokens are context only).

    ``encoded``: ``(prompt_ids, answer_ids + [eos])`` pairs, or triples with a per-answer-token
    bool mask of the tokens to learn. AdamW with a cosine schedule;
    returns the loss per step.
    """
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warm_start_lr, weight_decay=0.0, betas=(0.9, 0.98))
    steps = cfg.warm_start_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / max(1, steps))))
    losses = []
    bar = tqdm(range(steps), desc="warm start (SFT)", disable=not progress, dynamic_ncols=True)
    model.train()
    for _ in bar:
        ids, cu, max_len, pos, labels = _pack(rng.sample(encoded, cfg.warm_start_batch_size))
        hidden = model(ids, cu, max_len)
        logp, _ = model.log_probs(hidden[pos], labels)
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return losses


# --------------------------------------------------------------------------- build
def build_demo(cfg: DemoConfig = DemoConfig(), cache_dir: str = ".cache/dapo_demo", progress: bool = True,
               force: bool = False) -> DemoAssets:
    """Return the demo's model dir and data files, building them unless cached."""
    if not isinstance(cfg, DemoConfig):
        raise TypeError(f"cfg must be a DemoConfig, got {type(cfg).__name__}")
    root = os.path.join(os.path.abspath(cache_dir), cfg.key())
    assets = DemoAssets(root, os.path.join(root, "model"), os.path.join(root, "train.jsonl"),
                        os.path.join(root, "val.jsonl"), built=False)
    if os.path.isfile(os.path.join(root, "warm_start.json")) and not force:
        return assets

    os.makedirs(os.path.dirname(root), exist_ok=True)
    # Build in a sibling temp dir and rename: a killed build leaves nothing that looks cached.
    tmp = tempfile.mkdtemp(prefix=f".{cfg.key()}.", dir=os.path.dirname(root))
    try:
        t0 = time.time()
        train, val = make_split(cfg.task, cfg.seed, cfg.num_train, cfg.num_val)
        write_jsonl(train, os.path.join(tmp, "train.jsonl"))
        write_jsonl(val, os.path.join(tmp, "val.jsonl"))

        tok = build_tokenizer()
        eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
        encoded = [(tok.encode(p.prompt).ids, tok.encode(t).ids + [eos])
                   for p, t in zip(train, warm_start_targets(train, cfg))]
        torch.manual_seed(cfg.seed)
        model = Transformer(_model_config(cfg, tok.get_vocab_size(), eos, pad)).init_weights()
        losses = warm_start(model, encoded, cfg, progress=progress)

        model_dir = os.path.join(tmp, "model")
        save_hf_model(model, model_dir)
        _write_tokenizer(tok, model_dir)
        info = {"settings": cfg.to_dict(), "key": cfg.key(), "losses": losses,
                "seconds": round(time.time() - t0, 1), "num_params": model.config.num_params()}
        with open(os.path.join(tmp, "warm_start.json"), "w") as f:
            json.dump(info, f, indent=1)
        if os.path.exists(root):  # force=True, or a stale half-build
            shutil.rmtree(root)
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return DemoAssets(assets.root, assets.model_dir, assets.train_file, assets.val_file, built=True)
