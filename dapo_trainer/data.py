"""Prompts, answers and tokens: local jsonl / parquet rows, a tokenizer, a resumable cursor.

Rows are plain dicts ``{"prompt": str, "ground_truth": str, "data_source": str}``, read
from GSM8K / DAPO-Math style files: a ``prompt`` column (text, or a chat-style list of
``{"role", "content"}`` messages) and the answer in ``answer`` or verl's
``reward_model.ground_truth``. The tokenizer is the model directory's ``tokenizer.json``
through the ``tokenizers`` library (no ``transformers`` needed).
"""
from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import readers
from .rewards.verifiers import answer_text

DEFAULT_DATA_SOURCE = "unknown"


# --------------------------------------------------------------------------- rows
def _read_records(path: str) -> List[Tuple[str, object]]:
    """``[(where, row)]`` of a .jsonl / .json / .parquet file, ``where`` naming the file, row (and
    line); a ValueError naming the file (and line) when it cannot be read."""
    if os.path.isdir(path):
        raise ValueError(f"data file {path!r} is a directory; data.train_files / data.val_files name "
                         ".jsonl, .json or .parquet files")
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist")
    if path.endswith(".jsonl"):
        return [(f"{path}:{n} (row {i})", rec) for i, (n, rec) in enumerate(readers.read_jsonl(path))]
    if path.endswith(".json"):
        data = readers.read_json(path)
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json data file must hold a list of rows")
        return [(f"{path} row {i}", rec) for i, rec in enumerate(data)]
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ModuleNotFoundError(f"data file {path!r}: reading .parquet files needs pyarrow: pip install "
                                      "pyarrow (or pip install 'dapo-kernels[trainer]')", name="pyarrow") from None

        try:
            data = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError, ...) need not name the file
            raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        return [(f"{path} row {i}", rec) for i, rec in enumerate(data)]
    raise ValueError(f"data file {path!r}: expected a .jsonl, .json or .parquet file")


def _prompt(prompt, where: str):
    """A str prompt as is; a chat-style prompt as a list of ``{"role", "content"}`` dicts
    (:func:`dapo_trainer.chat.check_messages`; a message without a role is a user message)."""
    from .chat import check_messages

    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"{where}: prompt must be a str or a list of {{'role', 'content'}} messages, "
                         f"got {type(prompt).__name__}")
    msgs = [{"role": "user", **m} if isinstance(m, dict) and "role" not in m else m for m in prompt]
    return [{"role": m["role"], "content": m["content"]} for m in check_messages(msgs, f"{where}: prompt")]


def _ground_truth(rec: dict, where: str) -> str:
    rm = rec.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        gt = rm["ground_truth"]
    elif rec.get("reward_model.ground_truth") is not None:
        gt = rec["reward_model.ground_truth"]
    elif rec.get("answer") is not None:
        gt = rec["answer"]
    elif rec.get("ground_truth") is not None:
        gt = rec["ground_truth"]
    else:
        raise ValueError(f"{where}: no answer; expected an 'answer' or 'reward_model.ground_truth' column "
                         f"(columns: {sorted(rec)})")
    gt = answer_text(gt)  # a float column's 3.0 is "3", as an int column's 3
    # GSM8K's answer column is a worked solution ending in "#### 42": keep the final answer.
    if "####" in gt:
        gt = gt.rsplit("####", 1)[1].strip()
    return gt


def load_rows(files: Union[str, Sequence[str]], prompt_key: str = "prompt") -> List[Dict[str, str]]:
    """Rows ``{"prompt", "ground_truth", "data_source", "extra_info"}`` from local jsonl / parquet
    files. ``prompt`` is a str, or a list of ``{"role", "content"}`` messages for chat-style
    rows; ``extra_info`` is the row's verl-style ``extra_info`` mapping (``{}`` when absent),
    which multi-turn environments read.

    Raises ValueError naming the file (and line) on a missing file, column or bad row.
    """
    return load_rows_located(files, prompt_key)[0]


def load_rows_located(files: Union[str, Sequence[str]], prompt_key: str = "prompt") -> Tuple[List[dict], List[str]]:
    """:func:`load_rows` and, per row, where it was read (file, line / row), for later errors."""
    if isinstance(files, str):
        files = [files]
    if not isinstance(files, (list, tuple)) or not files:
        raise ValueError(f"files must name at least one .jsonl / .parquet file, got {files!r}")
    rows, wheres = [], []
    for path in files:
        for where, rec in _read_records(path):
            wheres.append(where)
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected an object, got {type(rec).__name__}")
            if prompt_key not in rec:
                raise ValueError(f"{where}: no {prompt_key!r} column (data.prompt_key); columns: {sorted(rec)}")
            extra = rec.get("extra_info")
            rows.append({
                "prompt": _prompt(rec[prompt_key], where),
                "ground_truth": _ground_truth(rec, where),
                "data_source": str(rec.get("data_source") or DEFAULT_DATA_SOURCE),
                "extra_info": dict(extra) if isinstance(extra, dict) else {},
            })
    if not rows:
        raise ValueError(f"no rows in {list(files)}")
    return rows, wheres


def apply_template(prompt: str, template: str = "{prompt}") -> str:
    """``template`` with its ``{prompt}`` slot filled (other braces are left alone)."""
    if "{prompt}" not in template:
        raise ValueError(f"prompt_template must contain '{{prompt}}', got {template!r}")
    return template.replace("{prompt}", prompt)


# --------------------------------------------------------------------------- tokenizer
def _read_json(path: str) -> dict:
    return readers.read_json(path) if os.path.isfile(path) else {}


class Tokenizer:
    """``tokenizers.Tokenizer`` plus the special token ids a trainer needs.

    Attributes: ``eos_token_id`` (int), ``eos_token_ids`` (tuple: every stop token),
    ``pad_token_id`` (int; falls back to eos), ``bos_token_id`` (int or None),
    ``vocab_size``, ``chat_template`` (the model's Jinja template or None) and
    ``special_tokens`` (``{"bos_token": str, ...}``, the strings the template sees).
    """

    def __init__(self, tok, eos_token_ids: Sequence[int], pad_token_id: Optional[int], bos_token_id: Optional[int],
                 chat_template: Optional[str] = None, special_tokens: Optional[Dict[str, str]] = None):
        self.tok = tok
        if not eos_token_ids:
            raise ValueError("tokenizer: no eos token found in tokenizer_config.json, generation_config.json "
                             "or config.json")
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0]
        self.pad_token_id = self.eos_token_id if pad_token_id is None else int(pad_token_id)
        self.bos_token_id = bos_token_id
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids; ``add_special_tokens``: with those the tokenizer's post-processor adds
        (e.g. BOS), which text rendered from a chat template already holds."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """``messages`` rendered with the model's chat template (:mod:`dapo_trainer.chat`)."""
        from .chat import render_chat

        if self.chat_template is None:
            raise ValueError("the model directory has no chat_template in tokenizer_config.json")
        return render_chat(self.chat_template, messages, add_generation_prompt, self.special_tokens)

    def prompt_text(self, prompt, template: str = "{prompt}", use_chat_template: bool = True) -> str:
        """The text a prompt row is encoded from.

        With a chat template (and ``use_chat_template``): message lists are rendered with it
        (generation prompt added); a str prompt is ``template``-filled and rendered as one user
        message. Without one: a str prompt is ``template``-filled, a message list's contents are
        joined by newlines first (the plain behaviour).
        """
        if self.uses_chat(use_chat_template):
            msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": apply_template(prompt, template)}]
            return self.render_chat(msgs, add_generation_prompt=True)
        if isinstance(prompt, list):
            prompt = "\n".join(str(m["content"]) for m in prompt)
        return apply_template(prompt, template)

    @property
    def templated(self) -> bool:
        """True when the model directory has a chat template."""
        return self.chat_template is not None

    def uses_chat(self, use_chat_template: bool = True) -> bool:
        """True when prompts go through the chat template (a template exists and is asked for): its
        text then holds the special tokens, so encoding adds none."""
        return self.templated and bool(use_chat_template)

    @property
    def max_token_chars(self) -> int:
        """The longest token string of the vocabulary (at least 1): a text of ``k`` tokens spans at most
        about ``k * max_token_chars`` characters (byte-level BPE, WordPiece, SentencePiece alike)."""
        if getattr(self, "_max_token_chars", None) is None:
            self._max_token_chars = max([len(t) for t in self.tok.get_vocab(with_added_tokens=True)] + [1])
        return self._max_token_chars

    def decode(self, ids: Iterable[int]) -> str:
        """Text with special tokens skipped."""
        return self.tok.decode(list(ids), skip_special_tokens=True)


def _token_id(tok, value) -> Optional[int]:
    """An id from a token string, ``{"content": str}`` (HF AddedToken) or an int."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, int):
        return value
    return tok.token_to_id(value) if isinstance(value, str) else None


def _ids(value) -> List[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def load_tokenizer(model_path: str) -> Tokenizer:
    """The tokenizer of a HF model directory (``tokenizer.json``).

    Special ids: ``tokenizer_config.json`` (token strings), else ``generation_config.json``,
    else ``config.json``. Every eos id found in any of them is a stop token.
    """
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.join(model_path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"actor_rollout_ref.model.path: no tokenizer.json in {model_path!r}")
    tok = HFTokenizer.from_file(path)
    tc = _read_json(os.path.join(model_path, "tokenizer_config.json"))
    gc = _read_json(os.path.join(model_path, "generation_config.json"))
    mc = _read_json(os.path.join(model_path, "config.json"))
    eos = []
    for ids in ([_token_id(tok, tc.get("eos_token"))], _ids(gc.get("eos_token_id")), _ids(mc.get("eos_token_id"))):
        eos += [i for i in ids if i is not None and i not in eos]
    named = tc.get("eos_token")
    named = named.get("content") if isinstance(named, dict) else named
    if not eos and isinstance(named, str):  # named, but not a token: "no eos token found" would mislead
        raise ValueError(f"{os.path.join(model_path, 'tokenizer_config.json')}: eos_token {named!r} is not in the "
                         f"vocabulary of tokenizer.json, and neither generation_config.json nor config.json gives "
                         f"an eos_token_id; name a token of the vocabulary")
    pad = _token_id(tok, tc.get("pad_token"))
    if pad is None:
        pad = gc.get("pad_token_id", mc.get("pad_token_id"))
    bos = _token_id(tok, tc.get("bos_token"))
    if bos is None:
        bos = gc.get("bos_token_id", mc.get("bos_token_id"))
    from .chat import load_chat_template

    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        v = tc.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            special[key] = v
    return Tokenizer(tok, eos, pad, bos, chat_template=load_chat_template(model_path, tc), special_tokens=special)


# Tokens past max_len that a bounded encoding must reach: the tokens near a cut may differ from the whole text's.
_CUT_MARGIN = 16


def encode_prompt(tokenizer: Tokenizer, text: str, max_len: int, truncation: str = "error",
                  add_special_tokens: bool = True) -> List[int]:
    """Token ids of ``text`` within ``max_len`` (``truncation``: "error", "left" or "right").

    A text longer than ``(max_len + 16) * tokenizer.max_token_chars`` characters is tokenised by
    that many characters only (its end for "left", its start otherwise), so a huge line costs what
    the limit does; only when that part yields too few tokens is the whole text tokenised."""
    budget = (max_len + _CUT_MARGIN) * tokenizer.max_token_chars
    if len(text) > budget:
        part = text[-budget:] if truncation == "left" else text[:budget]
        ids = tokenizer.encode(part, add_special_tokens=add_special_tokens)
        if len(ids) >= max_len + _CUT_MARGIN:  # the whole text is over the limit too, and cut the same way
            if truncation == "left":
                return ids[-max_len:]
            if truncation == "right":
                return ids[:max_len]
            raise ValueError(f"a prompt of {len(text)} characters has over {max_len} tokens ({len(ids)} in its "
                             f"first {budget} characters), over data.max_prompt_length={max_len} (set "
                             f"data.truncation=left or right, or raise the limit): {text[:80]!r}")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if len(ids) <= max_len:
        return ids
    if truncation == "left":
        return ids[-max_len:]
    if truncation == "right":
        return ids[:max_len]
    raise ValueError(f"a prompt has {len(ids)} tokens, over data.max_prompt_length={max_len} "
                     f"(set data.truncation=left or right, or raise the limit): {text[:80]!r}")


def row_prompt_ids(tokenizer: Tokenizer, prompt, data_cfg) -> List[int]:
    """A row's prompt templated, tokenised and held within ``data.max_prompt_length`` (``data_cfg``: the
    config's ``data`` section; :meth:`Tokenizer.prompt_text`, :func:`encode_prompt`)."""
    text = tokenizer.prompt_text(prompt, data_cfg.prompt_template, data_cfg.apply_chat_template)
    return encode_prompt(tokenizer, text, data_cfg.max_prompt_length, data_cfg.truncation,
                         add_special_tokens=not tokenizer.uses_chat(data_cfg.apply_chat_template))


def encode_rows(tokenizer: Tokenizer, rows: List[dict], where: List[str], data_cfg) -> Dict[int, List[int]]:
    """``{i: prompt ids}`` of every row (:func:`row_prompt_ids`), checked once on load: an over-long prompt
    under ``truncation=error`` is a ValueError naming ``where[i]`` (file and row)."""
    out = {}
    for i, row in enumerate(rows):
        try:
            out[i] = row_prompt_ids(tokenizer, row["prompt"], data_cfg)
        except ValueError as e:
            raise ValueError(f"{where[i]}: {e}") from None
    return out


# --------------------------------------------------------------------------- cursor
class BatchCursor:
    """Deterministic stream of row indices, ``batch_size`` at a time, across epochs.

    Epoch ``e`` visits the rows in the permutation drawn from ``seed + e`` (or in order
    when ``shuffle`` is False); a batch that runs past an epoch's end continues into
    the next. ``state_dict()`` / ``load_state_dict()`` resume the stream exactly.
    """

    def __init__(self, n_rows: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if n_rows < 1 or batch_size < 1:
            raise ValueError(f"BatchCursor needs n_rows >= 1 and batch_size >= 1, got {n_rows}, {batch_size}")
        self.n_rows, self.batch_size, self.seed, self.shuffle = n_rows, batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_rows)
        return np.random.default_rng(self.seed + epoch).permutation(self.n_rows)

    def next_batch(self) -> List[int]:
        out = []
        while len(out) < self.batch_size:
            take = self._order(self.epoch)[self.pos:self.pos + self.batch_size - len(out)]
            out += take.tolist()
            self.pos += len(take)
            if self.pos >= self.n_rows:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "n_rows": self.n_rows, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["n_rows"] != self.n_rows:
            raise ValueError(f"checkpoint's data cursor covers {state['n_rows']} rows, the data has {self.n_rows}; "
                             "resume with the same data.train_files")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
