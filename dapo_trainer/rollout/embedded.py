"""Embedded sampler: batched KV-cache generation on the training model itself (torch only).

Prefill runs the ``B`` distinct prompts once, packed, through the model's own layers
(``dk.varlen_attention``); their K/V are copied to the ``n`` samples of each prompt. Decode
then advances all ``N = B * n`` live sequences together, one token per step, attending a
per-layer cache ``[N, kv_heads, S, head_dim]`` with a length mask. Nothing loops over
sequences in Python; finished sequences are dropped from the batch (cache compacted) once
they are a quarter of it.

Randomness is counter-based: the uniform that draws the token of response ``k`` at step
``t`` is a hash of ``(seed, k, t)``, so a response depends on its seed and index only,
not on batch composition or thread count, and a run is reproducible bit for bit. ``k``
counts in the whole generation batch (``prompt_offset``), so data-parallel ranks that each
sample a share draw what one process sampling the batch draws.
Tokens are drawn by Gumbel-max from the temperature-scaled (and top-p filtered)
distribution, with one hashed uniform per (response, step, vocabulary id); see :mod:`.base`
for the log-prob convention.

Parallel models are sampled as they are, no replica: under tensor parallelism each rank
runs its heads / ffn units / vocabulary rows (the model's own collectives) and draws the
candidate of its vocabulary shard, and one all-gather of per-shard candidates picks the
token (:func:`sample_tokens`), so a TP group samples what the unsharded model samples.
Under FSDP2 the sampler gathers one decoder layer's weights at a time (``unshard`` /
``reshard``), plus the root's (embeddings, final norm, lm_head) for the whole call; the
data-parallel ranks then step in lockstep (the gathers are collectives): each runs until
every rank's responses have finished, and a rank without prompts joins with an empty batch.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dapo_kernels as dk

from ..model import Transformer, layer_ropes
from ..parallel.collectives import collective_device, gather_from_tp
from ..parallel.tensor import tensor_parallel_group
from .base import (FINISH_LENGTH, FINISH_STOP, RolloutConfig, RolloutEngine, RolloutOutput,
                   check_generate_args)

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2^32).

    Products wrap in int64 but their low 32 bits, all we keep, are exact.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def request_keys(seed: int, num: int, start: int = 0) -> torch.Tensor:
    """Per-response random keys ``[num]`` int64 for responses ``start..start+num-1`` under ``seed``."""
    s = _mix32(torch.tensor([seed & _MASK32, (seed >> 32) & _MASK32], dtype=torch.int64))
    k = torch.arange(start, start + num, dtype=torch.int64)
    return _mix32(_mix32(k ^ s[0]) ^ s[1])


def vocab_uniforms(keys: torch.Tensor, step: int, start: int, count: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64 ``[len(keys), count]``, for decode step ``step`` and vocabulary
    ids ``start .. start + count - 1`` (53 random bits each): a hash of (key, step, id), so a
    tensor-parallel rank draws the noise of its vocabulary shard alone."""
    ka = _mix32(keys ^ ((2 * step * 0x9E3779B9) & _MASK32))[:, None]
    kb = _mix32(keys ^ (((2 * step + 1) * 0x9E3779B9) & _MASK32))[:, None]
    v = torch.arange(start, start + count, dtype=torch.int64, device=keys.device)[None, :]
    a = _mix32(_mix32(v ^ ka) ^ kb)
    b = _mix32(a ^ ka)
    bits = (a >> 6) * (1 << 27) + (b >> 5)
    return (bits.double() + 0.5) * 2.0 ** -53


def _nucleus(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool ``[N, V]``: the most probable tokens whose mass before them is < ``top_p`` (at least one)."""
    probs, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
    keep = (probs.cumsum(-1) - probs) < top_p
    return torch.zeros_like(keep).scatter_(1, order, keep)


def sample_tokens(logits: torch.Tensor, keys: torch.Tensor, step: int, temperature: float, top_p: float,
                  group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by Gumbel-max; return ``(tokens [N] int64, log_probs [N] float32)``.

    The token is ``argmax_v(logits_v / temperature + g_v)`` over the top-p nucleus, with
    ``g_v = -log(-log(u_v))`` from :func:`vocab_uniforms`: a draw from the nucleus renormalised.

    Args:
        logits: ``[N, V]`` float32 raw logits; under ``group``, this rank's vocabulary shard
            ``[N, V / tp]`` (rows ``rank * V / tp ..`` of the lm_head, as ``parallelize`` shards it).
        keys: ``[N]`` int64 per-response keys (:func:`request_keys`), on the logits' device.
        temperature: 0 is greedy (argmax, log-probs at temperature 1).
        top_p: keep the most probable tokens whose mass before them is < ``top_p``
            (at least one), renormalised for drawing only.
        group: the tensor-parallel group the vocabulary is sharded over. Each rank draws the
            candidate of its shard and the softmax statistics of it; one all-gather of these
            ``[N, 5]`` rows (not of the logits) picks the winner and the log-prob on every rank.
            With ``top_p < 1`` the nucleus needs the whole distribution: the logits are gathered.
    """
    tp = 1 if group is None else dist.get_world_size(group)
    if tp > 1 and top_p < 1.0 and temperature > 0:
        logits, tp = gather_from_tp(logits, group), 1
    scaled = logits / temperature if temperature > 0 else logits
    score = scaled.double()
    start = dist.get_rank(group) * logits.shape[1] if tp > 1 else 0  # this shard's first vocabulary id
    if temperature > 0:
        score = score - torch.log(-torch.log(vocab_uniforms(keys, step, start, logits.shape[1])))
        if top_p < 1.0:
            score = score.masked_fill(~_nucleus(scaled, top_p), -float("inf"))
    idx = score.argmax(-1)
    if tp == 1:
        return idx, torch.log_softmax(scaled, dim=-1).gather(1, idx[:, None]).squeeze(1)
    # The winner over the shards (the first on ties, as argmax over the whole vocabulary) and the
    # log-sum-exp from each shard's max and sum of exponentials.
    m = scaled.max(-1).values
    stats = torch.stack([score.gather(1, idx[:, None]).squeeze(1), (idx + start).double(),
                         scaled.gather(1, idx[:, None]).squeeze(1).double(), m.double(),
                         (scaled - m[:, None]).exp().sum(-1).double()])
    parts = [torch.empty_like(stats) for _ in range(tp)]
    dist.all_gather(parts, stats, group=group)
    best, tok, picked, m, z = torch.stack(parts).unbind(1)          # each [tp, N]
    win = best.argmax(0)[None, :]
    top = m.max(0).values
    lse = top + (z * (m - top).exp()).sum(0).log()
    return tok.gather(0, win)[0].long(), (picked.gather(0, win)[0] - lse).float()


def _resolve_seed(seed: Optional[int]) -> int:
    if seed is None:
        # From torch's global generator, so torch.manual_seed makes unseeded runs repeat too.
        return int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    return seed & ((1 << 64) - 1)


class _Recorder:
    """Fills ``[N, max_new]`` token / log-prob tables and tracks which rows are done."""

    def __init__(self, num: int, max_new: int, stop_ids: Sequence[int]):
        self.tokens = torch.zeros(num, max_new, dtype=torch.int64)
        self.log_probs = torch.zeros(num, max_new, dtype=torch.float32)
        self.lengths = torch.full((num,), max_new, dtype=torch.int64)
        self.stopped = torch.zeros(num, dtype=torch.bool)
        self.stop_ids = torch.tensor(list(stop_ids), dtype=torch.int64)

    def record(self, rows: torch.Tensor, step: int, tok: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """Store step ``step`` of ``rows``; return the bool ``[len(rows)]`` of rows now finished.

        Rows that finished earlier may still be passed (the batch is compacted lazily);
        what they sample is ignored.
        """
        self.tokens[rows, step] = tok
        self.log_probs[rows, step] = lp
        done = self.stopped[rows]
        hit = torch.isin(tok, self.stop_ids) & ~done
        self.stopped[rows[hit]] = True
        self.lengths[rows[hit]] = step + 1
        return done | hit

    def output(self, prompts: List[List[int]], n: int) -> RolloutOutput:
        keep = torch.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]
        cu = torch.zeros(len(self.lengths) + 1, dtype=torch.int32)
        cu[1:] = self.lengths.cumsum(0)
        return RolloutOutput(
            prompt_ids=prompts,
            response_ids=self.tokens[keep],
            cu_seqlens=cu,
            lengths=self.lengths.clone(),
            log_probs=self.log_probs[keep],
            finish_reasons=[FINISH_STOP if s else FINISH_LENGTH for s in self.stopped.tolist()],
            group_index=torch.arange(len(prompts), dtype=torch.int64).repeat_interleave(n),
            n=n,
        )


class _RouteRecorder:
    """The sparse layers' expert choices of a generate call: the packed prompts' at prefill, each
    response token's at the decode step that ran it; -1 for each response's last token (sampled, run
    only when its batch row ran on: its routing reaches no trained log-prob, so none is kept)."""

    def __init__(self, model: Transformer, num: int, max_new: int):
        self.model = model
        L, k = len(model.sparse_blocks()), model.config.num_experts_per_tok
        self.responses = torch.full((num, max_new, L, k), -1, dtype=torch.int64)
        self.prompts = torch.zeros(0, L, k, dtype=torch.int64)

    @staticmethod
    def _stacked(traces) -> torch.Tensor:
        return torch.stack([t.topk_ids for t in traces], 1).cpu()  # [T, L, k]

    @contextmanager
    def prefill(self):
        with self.model.trace_routing() as traces:
            yield
        if traces:
            self.prompts = self._stacked(traces)

    @contextmanager
    def decode(self, rows: torch.Tensor, step: int):
        """The step that runs response token ``step`` of ``rows``."""
        with self.model.trace_routing() as traces:
            yield
        if traces:
            self.responses[rows, step] = self._stacked(traces)

    def output(self, out: RolloutOutput) -> torch.Tensor:
        """``[T', L, k]`` in ``out.sequences()``' order."""
        starts = [0]
        for p in out.prompt_ids:
            starts.append(starts[-1] + len(p))
        parts = []
        for r, g in enumerate(out.group_index.tolist()):
            n = int(out.lengths[r])
            self.responses[r, n - 1] = -1
            parts += [self.prompts[starts[g]:starts[g + 1]], self.responses[r, :n]]
        return torch.cat(parts)


def _packed(prompts: List[List[int]], device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [T], cu_seqlens [B+1] int32, lengths [B] int64)`` of lists laid end to end."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    cu = torch.zeros(len(prompts) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    return ids, cu.to(device), lengths.to(device)


# Prompts sharing a prefix shorter than this run it each (the extra pass costs more than it saves).
_MIN_SHARED = 16


def shared_prefixes(prompts: List[List[int]]) -> Optional[List[Tuple[List[int], int]]]:
    """Clusters ``(members, prefix length)`` of prompts sharing a prefix of at least ``_MIN_SHARED``
    tokens, each member keeping at least one token after it (its last hidden state); a prompt in no
    such cluster is one of its own (prefix: all but its last token). None when sharing would save
    under a quarter of the prefill's tokens."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    clusters: List[Tuple[List[int], int]] = []
    for i in order:
        p = prompts[i]
        if clusters:
            members, plen = clusters[-1]
            prev, common = prompts[members[-1]], 0
            limit = min(plen, len(p) - 1)
            while common < limit and prev[common] == p[common]:
                common += 1
            if common >= _MIN_SHARED:  # (sorted: the cluster's common prefix is its neighbours' shortest)
                clusters[-1] = (members + [i], common)
                continue
        clusters.append(([i], max(len(p) - 1, 0)))
    saved = sum((len(m) - 1) * plen for m, plen in clusters)
    return clusters if 4 * saved >= sum(len(p) for p in prompts) else None


def _cache_bias(pos: torch.Tensor, width: int, left: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[..., width]`` of queries at positions ``pos`` over cache columns: keys after the
    query, or before its window (varlen_attention's causal window, ``left`` >= 0), are hidden."""
    col = torch.arange(width, device=pos.device)
    hidden = col > pos[..., None]
    if left >= 0:
        hidden |= col < pos[..., None] - left
    return torch.zeros(hidden.shape, dtype=dtype, device=pos.device).masked_fill_(hidden, float("-inf"))


def _cache_attention(inner, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, width: int,
                     bias: torch.Tensor) -> torch.Tensor:
    """``[B, L, Hq * D]``: queries ``q [B, L, Hq, D]`` of cache row ``b`` over its first ``width`` columns
    (``ck`` / ``cv`` ``[B, Hkv, S, D]``), ``bias [B, L, width]`` added to the (scaled, capped) scores.
    GQA without repeating K/V: the query heads that share a KV head are grouped."""
    B, L, Hq, D = q.shape
    hkv = ck.shape[1]
    qg = q.reshape(B, L, hkv, Hq // hkv, D).permute(0, 2, 3, 1, 4).reshape(B, hkv, Hq // hkv * L, D)
    scores = torch.matmul(qg, ck[:, :, :width].transpose(-1, -2)) * inner.softmax_scale
    if inner.softcap:
        scores = inner.softcap * torch.tanh(scores / inner.softcap)
    probs = torch.softmax(scores.view(B, hkv, Hq // hkv, L, width) + bias[:, None, None], dim=-1)
    o = torch.matmul(probs.view(B, hkv, Hq // hkv * L, width), cv[:, :, :width])
    return o.view(B, hkv, Hq // hkv, L, D).permute(0, 3, 1, 2, 4).reshape(B, L, Hq * D)


def _fsdp_group(model: Transformer):
    """The data-parallel group of an FSDP2-sharded model (its layers' mesh); None if not sharded."""
    from torch.distributed.tensor import DTensor

    w = next(next(iter(model.layers.values())).parameters(), None) if len(model.layers) else None
    return w.device_mesh.get_group() if isinstance(w, DTensor) else None


@contextmanager
def _gathered(module):
    """``module``'s own FSDP2 parameters unsharded inside the block (not its sub-units')."""
    fsdp = callable(getattr(module, "unshard", None))
    if fsdp:
        module.unshard()
    try:
        yield
    finally:
        if fsdp:
            module.reshard()


class EmbeddedRollout(RolloutEngine):
    """KV-cache sampler on a :class:`~dapo_trainer.model.Transformer` (shares its weights).

    ``update_weights(model)`` only rebinds the model: the engine reads the live
    parameters, so after an optimiser step it already samples from the new policy.
    The model may be tensor parallel and / or FSDP2-sharded (module docstring): then every
    rank of its groups calls ``generate`` together (under FSDP2, ``lockstep_group``: with an
    empty ``prompt_ids`` on a rank that has nothing to sample).
    """

    def __init__(self, model: Transformer, config: Optional[RolloutConfig] = None):
        self.config = config or RolloutConfig()
        # Partial rollout (async_training.partial_rollout, a rollout worker's): called between two decode
        # steps; True when it has just loaded new weights into the model in place. The live responses then
        # continue under them (their caches recomputed: _replay); earlier tokens keep the
        # log-probs of the weights that sampled them. None: never interrupted.
        self.interrupt: Optional[Callable[[], bool]] = None
        # Mixture-of-experts models: record each token's experts (RolloutOutput.routed_experts), for
        # router replay of the rollout's routing (verl's R3).
        self.record_routing = False
        self.update_weights(model)

    def update_weights(self, model: Transformer) -> None:
        if not isinstance(model, Transformer):
            raise TypeError(f"model must be a dapo_trainer Transformer, got {type(model).__name__}")
        self.model = model
        # Determined while the layers are sharded (between forwards, as here after a step).
        self.lockstep_group = _fsdp_group(model)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len or self.model.config.max_position_embeddings

    @torch.no_grad()  # not inference_mode: FSDP2 would keep its gathered buffers as inference tensors
    def generate(self, prompt_ids: List[List[int]], n: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = None, stop_token_ids: Sequence[int] = (),
                 prompt_offset: int = 0) -> RolloutOutput:
        """Sample ``n`` responses per prompt (see :mod:`.base` for the output and log-probs).

        Args:
            prompt_ids: ``B`` non-empty lists of token ids (``B = 0`` only with a ``lockstep_group``).
            n: responses per prompt; response ``k`` answers prompt ``k // n``.
            max_new_tokens: length cap per response (``finish_reason`` "length").
            temperature: > 0 samples from ``softmax(logits / temperature)``; 0 is greedy.
            top_p: nucleus sampling mass in (0, 1].
            seed: int for a reproducible run; None draws one from torch's global generator.
            stop_token_ids: a response ends after sampling any of these (kept in it).
            prompt_offset: index of ``prompt_ids[0]`` in the whole generation batch when this
                call samples a share of it (data-parallel rollout): response ``k`` draws the
                random stream of response ``prompt_offset * n + k`` of that batch, so shares
                sampled apart equal the batch sampled at once.
        """
        model = self.model
        cfg = model.config
        prompts, stops = check_generate_args(prompt_ids, n, max_new_tokens, temperature, top_p, stop_token_ids,
                                             self.max_model_len, cfg.vocab_size, prompt_offset,
                                             allow_empty=self.lockstep_group is not None)
        with _gathered(model):
            return self._generate(prompts, n, max_new_tokens, temperature, top_p, seed, stops, prompt_offset)

    def _generate(self, prompts, n, max_new_tokens, temperature, top_p, seed, stops, prompt_offset):
        model = self.model
        dev = model.lm_head.weight.device
        keys = request_keys(_resolve_seed(seed), len(prompts) * n, start=prompt_offset * n).to(dev)
        w_out = model.lm_head.weight.float()
        tp_group = tensor_parallel_group(model)
        rec = _Recorder(len(keys), max_new_tokens, stops)
        routes = _RouteRecorder(model, len(keys), max_new_tokens) if self.record_routing else None

        with routes.prefill() if routes else nullcontext():
            last_hidden, caches, lengths = self._prefill(prompts, max_new_tokens)
        rows = torch.arange(len(keys))                  # output row of each live batch row
        # The n samples of a prompt share its prefill: expand prompt-level state to responses.
        h = last_hidden.repeat_interleave(n, 0)
        caches = [(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)) for k, v in caches]
        pos = lengths.repeat_interleave(n)              # position of the token to sample next
        width = int(lengths.max()) if len(prompts) else 0  # cache columns in use
        tok = torch.zeros(0, dtype=torch.int64, device=dev)
        for step in range(max_new_tokens):
            n_live = 0
            if len(rows):  # none only in lockstep, once this rank's responses have finished
                logits = F.linear(h.float(), w_out)
                tok, lp = sample_tokens(logits, keys[rows.to(dev)], step, temperature, top_p, tp_group)
                live = ~rec.record(rows, step, tok.cpu(), lp.cpu())
                n_live = int(live.sum())
            if step + 1 == max_new_tokens or self._all_done(n_live, dev):
                break
            if len(rows) and n_live <= 3 * len(rows) // 4:
                keep = live.nonzero().squeeze(1)
                rows, tok, pos = rows[keep], tok[keep.to(dev)], pos[keep.to(dev)]
                caches = [(k[keep], v[keep]) for k, v in caches]
            if len(rows) and self.interrupt is not None and self.interrupt():  # new weights: stale KV cache
                w_out = model.lm_head.weight.float()
                h, caches, pos, width = self._replay(prompts, n, rows, rec.tokens, step + 1, max_new_tokens)
                continue
            width += 1
            with routes.decode(rows, step) if routes else nullcontext():
                h = self._decode_step(tok, pos, caches, width)
            pos = pos + 1
        out = rec.output(prompts, n)
        if routes:
            out.routed_experts = routes.output(out)
        return out

    def _replay(self, prompts, n: int, rows: torch.Tensor, tokens: torch.Tensor, upto: int, max_new_tokens: int):
        """``(h, caches, pos, width)`` of the live ``rows`` after their first ``upto`` response tokens,
        recomputed under the current weights: each prompt with a live row prefilled once (its responses
        share it, as at the start), then the tokens appended, teacher-forced (:meth:`_extend`). The same
        keys and values as a prefill of every prompt + response, at a prefill's cost per prompt instead of
        per response."""
        dev = self.model.lm_head.weight.device
        which, inverse = torch.unique(torch.div(rows, n, rounding_mode="floor"), return_inverse=True)
        _, caches, lengths = self._prefill([prompts[i] for i in which.tolist()], max_new_tokens)
        inverse = inverse.to(dev)
        caches = [(k[inverse], v[inverse]) for k, v in caches]
        start, r = lengths[inverse], len(rows)
        row_of = torch.arange(r, device=dev).repeat_interleave(upto)
        pos = start[row_of] + torch.arange(upto, device=dev).repeat(r)
        cu = torch.arange(r + 1, device=dev) * upto
        width = int(lengths.max()) + upto
        h = self._extend(tokens[rows, :upto].reshape(-1).to(dev), row_of, pos, cu, caches, width)
        return h[cu[1:] - 1], caches, start + upto, width

    def _prefill(self, prompts: List[List[int]], max_new_tokens: int):
        """Run the distinct prompts packed; return the last hidden state per prompt
        ``[B, H]``, per-layer caches ``(k, v)`` of shape ``[B, kv_heads, S, D]`` holding
        the prompt keys / values in columns ``0..len-1``, and the lengths ``[B]``.

        Prompts sharing a long prefix (a multi-turn rollout's later turns: a row's ``n`` dialogues
        open with its prompt) run it once (:func:`shared_prefixes`, :meth:`_prefill_shared`); not
        under FSDP lockstep (every rank must run the same layer passes) nor while recording routing
        (its prompt order)."""
        model = self.model
        cfg = model.config
        dev = model.lm_head.weight.device
        if not prompts:  # lockstep with ranks that have prompts: join their layer gathers
            self._join_layer_gathers()
            empty = torch.zeros(0, device=dev)
            return empty.new_zeros(0, cfg.hidden_size), [(empty, empty)] * len(model.layers), empty.long()
        S = max(len(p) for p in prompts) + max_new_tokens
        clusters = None if self.record_routing or self.lockstep_group is not None else shared_prefixes(prompts)
        if clusters is not None:
            return self._prefill_shared(prompts, clusters, S)
        return self._prefill_packed(prompts, S)

    def _prefill_packed(self, prompts: List[List[int]], S: int):
        """:meth:`_prefill` of every prompt whole, packed, into caches of ``S`` columns."""
        model = self.model
        cfg = model.config
        dev = model.lm_head.weight.device
        ids, cu, lengths = _packed(prompts, dev)
        max_len = int(lengths.max())
        pos_ids = dk.packed_position_ids(cu, ids.shape[0])
        seq_of = torch.arange(len(prompts), device=dev).repeat_interleave(lengths)
        h = model.embed(ids)
        caches = []
        ropes = layer_ropes(cfg, pos_ids, h.dtype, [int(i) for i in model.layers])
        for layer, (cos, sin) in zip(model.layers.values(), ropes):
            with _gathered(layer):
                attn, D = layer.self_attn, layer.self_attn.head_dim
                q, k, v = attn.project(layer.input_layernorm(h))
                q, k = attn.inner_attention.rotate(q, k, cos, sin)
                o = attn.inner_attention.attend(q, k, v, cu, max_len)
                h = layer.feed_forward(layer.add_attention(h, attn.o_proj(o.reshape(h.shape[0], -1))))
            ck = k.new_zeros(len(prompts), k.shape[1], S, D)
            cv = torch.zeros_like(ck)
            ck[seq_of, :, pos_ids] = k
            cv[seq_of, :, pos_ids] = v
            caches.append((ck, cv))
        last = cu[1:].long() - 1
        return model.norm(h[last]), caches, lengths

    def _prefill_shared(self, prompts: List[List[int]], clusters, S: int):
        """:meth:`_prefill` with each cluster's shared prefix run once: the prefixes packed, their caches
        copied to the members, then each member's remaining tokens appended (:meth:`_extend`)."""
        dev = self.model.lm_head.weight.device
        _, caches, _ = self._prefill_packed([prompts[m[0]][:plen] for m, plen in clusters], S)
        cluster_of = torch.empty(len(prompts), dtype=torch.int64)
        start = torch.empty(len(prompts), dtype=torch.int64)
        for c, (members, plen) in enumerate(clusters):
            cluster_of[members], start[members] = c, plen
        cluster_of = cluster_of.to(dev)
        caches = [(k[cluster_of], v[cluster_of]) for k, v in caches]
        ids, cu, counts = _packed([p[int(a):] for p, a in zip(prompts, start)], dev)
        rows = torch.arange(len(prompts), device=dev).repeat_interleave(counts)
        pos = start.to(dev)[rows] + dk.packed_position_ids(cu, ids.shape[0])
        h = self._extend(ids, rows, pos, cu, caches, S)
        return h[cu[1:].long() - 1], caches, start.to(dev) + counts

    def _extend(self, ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, caches,
                width: int) -> torch.Tensor:
        """Normed hidden ``[T, H]`` of the packed tokens ``ids`` appended to the cache rows: token ``t``
        belongs to row ``rows[t]`` at position ``pos[t]``; each row's tokens are consecutive and in order,
        ``cu`` ``[B+1]`` their offsets (every row of the caches has at least one). Writes their keys /
        values at ``(row, pos)``; each token attends its row's first ``width`` columns up to its own
        (within the window)."""
        model = self.model
        B = cu.shape[0] - 1
        one = ids.shape[0] == B  # one token per row (a decode step): rows is 0..B-1, nothing to pad
        if one:
            pos_pad = pos[:, None]
        else:
            L = int((cu[1:] - cu[:-1]).max())
            slot = torch.arange(ids.shape[0], device=ids.device) - cu[:-1].long()[rows]
            pos_pad = torch.zeros(B, L, dtype=torch.int64, device=ids.device)  # a pad slot sees column 0
            pos_pad[rows, slot] = pos
        h = model.embed(ids)
        ropes = layer_ropes(model.config, pos, h.dtype, [int(i) for i in model.layers])
        biases = {}  # per window (layers share one mask unless their windows differ)
        for layer, (ck, cv), (cos, sin) in zip(model.layers.values(), caches, ropes):
            with _gathered(layer):
                attn = layer.self_attn
                inner = attn.inner_attention
                q, k, v = attn.project(layer.input_layernorm(h))
                q, k = inner.rotate(q, k, cos, sin)
                ck[rows, :, pos], cv[rows, :, pos] = k, v
                if one:
                    q_pad = q[:, None]
                else:
                    q_pad = q.new_zeros(B, L, *q.shape[1:])
                    q_pad[rows, slot] = q
                left = inner.window_size[0]
                if left not in biases:
                    biases[left] = _cache_bias(pos_pad, width, left, h.dtype)
                o = _cache_attention(inner, q_pad, ck, cv, width, biases[left])
                h = layer.feed_forward(layer.add_attention(h, attn.o_proj(o[:, 0] if one else o[rows, slot])))
        return model.norm(h)

    def _decode_step(self, tok: torch.Tensor, pos: torch.Tensor, caches, width: int) -> torch.Tensor:
        """One token per live sequence at position ``pos``; return hidden ``[N, H]``.

        Writes the new keys / values into column ``pos`` of each cache and attends the
        first ``width`` columns, masked to ``<= pos``.
        """
        N = tok.shape[0]
        if N == 0:  # lockstep: this rank's responses have finished, its peers' have not
            self._join_layer_gathers()
            return torch.zeros(0, self.model.config.hidden_size, device=tok.device)
        rows = torch.arange(N, device=tok.device)
        return self._extend(tok, rows, pos, torch.arange(N + 1, device=tok.device), caches, width)

    def _join_layer_gathers(self) -> None:
        for layer in self.model.layers.values():
            with _gathered(layer):
                pass

    def _all_done(self, n_live: int, device) -> bool:
        """No live response left here, or under FSDP2 lockstep on any rank (one all-reduce)."""
        if self.lockstep_group is None:
            return n_live == 0
        t = torch.tensor([n_live], device=collective_device(self.lockstep_group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.lockstep_group)
        return int(t.item()) == 0


@torch.inference_mode()
def naive_generate(model: Transformer, prompt_ids: List[List[int]], n: int, max_new_tokens: int,
                   temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None,
                   stop_token_ids: Sequence[int] = (), max_model_len: Optional[int] = None,
                   prompt_offset: int = 0, interrupt: Optional[Callable[[], bool]] = None) -> RolloutOutput:
    """Reference sampler: every step re-runs the full packed forward of all live sequences.

    Same randomness and sampling rule as :class:`EmbeddedRollout`, so with the same seed
    both return the same tokens (up to float ties); O(length^2) and for tests / benchmarks.
    ``interrupt``: :attr:`EmbeddedRollout.interrupt`, called at the same points (the next full
    forward reads whatever weights it loaded).
    """
    cfg = model.config
    prompts, stops = check_generate_args(prompt_ids, n, max_new_tokens, temperature, top_p, stop_token_ids,
                                         max_model_len or cfg.max_position_embeddings, cfg.vocab_size, prompt_offset)
    keys = request_keys(_resolve_seed(seed), len(prompts) * n, start=prompt_offset * n).to(model.lm_head.weight.device)
    rec = _Recorder(len(keys), max_new_tokens, stops)
    seqs = [list(prompts[k // n]) for k in range(len(keys))]
    rows = torch.arange(len(keys))
    w_out = model.lm_head.weight.float()
    for step in range(max_new_tokens):
        live = [seqs[r] for r in rows.tolist()]
        ids, cu, lengths = _packed(live, model.lm_head.weight.device)
        hidden = model(ids, cu, int(lengths.max()))[cu[1:].long() - 1]
        tok, lp = sample_tokens(F.linear(hidden.float(), w_out), keys[rows.to(keys.device)], step, temperature, top_p)
        hit = rec.record(rows, step, tok.cpu(), lp.cpu())
        for r, t in zip(rows.tolist(), tok.tolist()):
            seqs[r].append(t)
        rows = rows[~hit]
        if len(rows) == 0 or step + 1 == max_new_tokens:
            break
        if interrupt is not None and interrupt():
            w_out = model.lm_head.weight.float()
    return rec.output(prompts, n)
