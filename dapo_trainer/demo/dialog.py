"""The dialogue demo: an order-status desk that needs its turns (``python -m dapo_trainer.demo --task dialog``).

The system message is the desk's table of orders, one line per order: ``#``, the order
number, then its status (``"#1late #2held #3gone #4sent"``); the user asks ``"status?"``
without saying which order is theirs. The right dialogue asks for the number (``"id?"``), gets
it from the environment (``"3"``) and answers with that order's line (``"#3gone"``). Answering
at once (quoting any line) is a guess. Every answer starts with ``#`` and every question with
``i``, so the first token is the choice between asking and guessing, and greedy decoding makes
it the way the model leans (were answers to start with their digit, the guess's probability
would split over the digits and the one ``i`` would win greedily: the warm start would ask).

:class:`OrderDeskEnv` plays the user: it replies with the order number to the question ``"id?"``
as a first turn, ends the dialogue at any other turn (or the second assistant turn), and scores
``correct`` (the answer is the order's line). The reward is ``correct`` plus small weighted
``coherence`` / ``relevance`` components (``configs/dialog_demo.yaml``).

Warm start, as the single-turn demo: a short supervised phase on *mixed* transcripts, a
fraction ``guess_fraction`` of them guessing a random line at once, the rest asking first and
answering right. The warm-started model looks an order up correctly once its number is in the
context, yet greedily guesses (right one time in ``rows``), and samples the asking dialogue
often enough for DAPO to find it; what RL learns from the reward alone is that asking pays.

Why this layout: matching an id by content anywhere in the table needs an induction circuit
that a 2-layer model does not form in a short warm start, and a lookup answered at chance
makes asking pay nothing. Order numbers that are the line numbers, fixed-width lines and an
answer that quotes the line (so the number sits right before the status to copy) make the
lookup a position the number selects, which the same model learns within the warm start
(figures: benchmarks/RESULTS.md, "Design figures moved from code comments"). The transcripts
are learned whole (``transcript_loss``), table and user turns too.

The tokenizer is character-level with role tokens ``<s>``, ``<u>``, ``<a>`` and a chat
template in ``tokenizer_config.json``, so the trainer renders the dialogues through its
ordinary chat-template path.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import List

import torch

from .assets import DemoConfig, _model_config

__all__ = ["DialogDemoConfig", "OrderDeskEnv", "build_dialog_demo", "TEMPLATE", "STATUSES"]

# Four letters each (every line of a table has the same width) with distinct first letters.
STATUSES = ("late", "held", "sent", "gone", "paid", "open")
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz :?#"
SPECIALS = ["<pad>", "<eos>", "<s>", "<u>", "<a>"]
# Role markers <s>/<u>/<a>; an assistant turn ends with the eos token the sampler stops on.
TEMPLATE = ("{% for m in messages %}{{ '<' + m['role'][0] + '>' + m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<a>' }}{% endif %}")
REQUEST, ASK, DATA_SOURCE = "status?", "id?", "order_desk"
ASSETS_VERSION = 4


@dataclass(frozen=True)
class DialogDemoConfig(DemoConfig):
    """The single-turn demo's model and warm-start settings, with the desk's own (``task`` and
    ``warm_start_descending`` are unused here)."""

    rows: int = 4  # orders per table (<= len(STATUSES), <= 9)
    num_val: int = 100
    warm_start_steps: int = 500
    # Fraction of the warm start's dialogues that guess at once instead of asking for the id.
    guess_fraction: float = 0.6
    # Learn the whole transcript (system table and user turns too), not only the assistant's turns.
    transcript_loss: bool = True

    def key(self) -> str:
        blob = json.dumps({"dialog_version": ASSETS_VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sample_row(rng: random.Random, rows: int) -> dict:
    """One desk: ``rows`` orders numbered 1.. in table order with distinct statuses (a guess is
    right one time in ``rows``), the user's order among them; the answer is its line."""
    lines = [f"#{i + 1}{s}" for i, s in enumerate(rng.sample(STATUSES, rows))]
    mine = rng.randrange(rows)
    text = " ".join(lines)
    return {"prompt": [{"role": "system", "content": text}, {"role": "user", "content": REQUEST}],
            "answer": lines[mine], "data_source": DATA_SOURCE, "extra_info": {"order_id": str(mine + 1), "table": text}}


def make_split(cfg: DialogDemoConfig):
    rng = random.Random(cfg.seed * 2 + 1)
    val, seen = [], set()
    while len(val) < cfg.num_val:
        r = sample_row(rng, cfg.rows)
        key = (r["prompt"][0]["content"], r["extra_info"]["order_id"])
        if key not in seen:
            seen.add(key)
            val.append(r)
    rng = random.Random(cfg.seed * 2)
    train = []
    while len(train) < cfg.num_train:
        r = sample_row(rng, cfg.rows)
        if (r["prompt"][0]["content"], r["extra_info"]["order_id"]) not in seen:
            train.append(r)
    return train, val


class OrderDeskEnv:
    """The user side of the desk (module docstring)."""

    name = "order-desk"

    def reset(self, row: dict) -> List[dict]:
        return [dict(m) for m in row["prompt"]]

    def step(self, history: List[dict], row: dict):
        turns = sum(m["role"] == "assistant" for m in history)
        last = history[-1]["content"].strip()
        if last == ASK and turns < 2:
            return {"role": "user", "content": row["extra_info"]["order_id"]}, {"correct": 0.0}
        ok = float(last == row["ground_truth"])  # any other turn is the answer
        return None, {"correct": ok, "acc": ok}


def _write_jsonl(rows, path):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _tokenizer(model_dir: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
                   "chat_template": TEMPLATE, "clean_up_tokenization_spaces": False}, f, indent=1)
    return tok


def demonstration(row: dict, guess: bool, rng: random.Random) -> List[dict]:
    """The supervised dialogue after the opening: a guess (a random line), or ask + answer."""
    if guess:
        return [{"role": "assistant", "content": rng.choice(row["extra_info"]["table"].split())}]
    return [{"role": "assistant", "content": ASK}, {"role": "user", "content": row["extra_info"]["order_id"]},
            {"role": "assistant", "content": row["answer"]}]


def encode_dialogue(tok, eos: int, row: dict, turns: List[dict]):
    """``(prompt ids, continuation ids, mask)``: the mask marks assistant tokens (and their eos)."""
    def ids(text):
        return tok.encode(text, add_special_tokens=False).ids

    prompt = ids("".join(f"<{m['role'][0]}>{m['content']}" for m in row["prompt"]) + "<a>")
    cont, mask = [], []
    for i, m in enumerate(turns):
        if m["role"] == "assistant":
            t = ids(m["content"]) + [eos]
            cont, mask = cont + t, mask + [True] * len(t)
        else:  # the environment's turn and the next generation prompt: context only
            t = ids(f"<u>{m['content']}<a>")
            cont, mask = cont + t, mask + [False] * len(t)
    return prompt, cont, mask


def build_dialog_demo(cfg: DialogDemoConfig, cache_dir: str = ".cache/dapo_demo_dialog", progress: bool = True):
    """The dialogue demo's model dir and data files (cached by a hash of ``cfg``)."""
    from ..hf_io import save_hf_model
    from ..model import Transformer
    from .assets import DemoAssets, warm_start

    root = os.path.join(os.path.abspath(cache_dir), cfg.key())
    paths = (os.path.join(root, "model"), os.path.join(root, "train.jsonl"), os.path.join(root, "val.jsonl"))
    if os.path.isfile(os.path.join(root, "warm_start.json")):
        return DemoAssets(root, *paths, built=False)
    os.makedirs(os.path.dirname(root), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{cfg.key()}.", dir=os.path.dirname(root))
    try:
        t0 = time.time()
        train, val = make_split(cfg)
        _write_jsonl(train, os.path.join(tmp, "train.jsonl"))
        _write_jsonl(val, os.path.join(tmp, "val.jsonl"))
        model_dir = os.path.join(tmp, "model")
        os.makedirs(model_dir)
        tok = _tokenizer(model_dir)
        eos, pad = tok.token_to_id("<eos>"), tok.token_to_id("<pad>")
        rng = random.Random(cfg.seed * 7919 + 17)
        encoded = [encode_dialogue(tok, eos, r, demonstration(r, rng.random() < cfg.guess_fraction, rng))
                   for r in train]
        if cfg.transcript_loss:  # every token after the first is a target
            encoded = [(p[:1], p[1:] + c, [True] * (len(p) - 1 + len(c))) for p, c, _ in encoded]
        torch.manual_seed(cfg.seed)
        model = Transformer(_model_config(cfg, tok.get_vocab_size(), eos, pad)).init_weights()
        losses = warm_start(model, encoded, cfg, progress=progress)
        save_hf_model(model, model_dir)
        with open(os.path.join(tmp, "warm_start.json"), "w") as f:
            json.dump({"settings": cfg.to_dict(), "losses": losses, "seconds": round(time.time() - t0, 1)}, f)
        if os.path.exists(root):
            shutil.rmtree(root)
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return DemoAssets(root, *paths, built=True)
