"""transformers integration: the ``"dapo_varlen"`` attention implementation and
:func:`apply_dapo_kernels` (lm_head + loss on dapo_kernels' fused ops, Liger-style).

Importing this module registers the attention implementation in transformers'
``AttentionInterface`` (and its mask function in ``AttentionMaskInterface``: flash-attn's, a 2-D
padding mask or None), so that::

    import dapo_kernels.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dapo_varlen")

runs :func:`dapo_kernels.varlen_attention` in every attention layer:

* padded batches (an ``attention_mask`` with zeros): the tokens are gathered with the indices of
  :func:`dapo_kernels.unpad_input`, computed once per mask (not per layer), and scattered back with
  :func:`dapo_kernels.pad_input`; padded positions get zeros (sdpa leaves values there that no real
  token sees);
* packed batches (no padding): a sequence starts at each row's first token and wherever
  ``position_ids`` is 0 (flash-attn's packed-sequence rule in transformers; transformers' sdpa mask
  starts one wherever the position does not go up by 1, the same for well-formed packing). The
  ``cu_seqlens`` are built on the device without a host sync, once per ``position_ids`` tensor: one
  boundary per token (``T + 1`` entries, most of them empty sequences), so that no count is read.

Keyword arguments of the attention call: ``scaling``, ``is_causal``, ``sliding_window`` (flash-attn's
meaning: a query sees ``sliding_window - 1`` keys back) and ``softcap`` map to the op's;
``dropout > 0``, ``s_aux`` (attention sinks) and a KV cache longer than the query (decoding) raise
``NotImplementedError``: this is for training and scoring passes over whole sequences.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .._cache import per_tensor_cache
from .._validation import check_tensor
from ..flash_attn_compat.bert_padding import index_first_axis
from ..ops.fused_linear_policy_loss import fused_linear_policy_loss
from ..ops.linear_log_probs import linear_log_probs
from ..ops.packing import pad_input, unpad_input
from ..ops.varlen_attention import varlen_attention

__all__ = ["ATTN_IMPLEMENTATION", "register", "dapo_varlen_attention", "apply_dapo_kernels", "DapoCausalLMOutput"]

ATTN_IMPLEMENTATION = "dapo_varlen"
IGNORE_INDEX = -100


# --------------------------------------------------------------------------- sequence boundaries
def _cu_seqlens_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """int32 ``[T+1]`` boundaries of the sequences that begin where the bool ``starts [T]`` is True
    (``starts[0]`` must be): entry ``i`` is the latest start at or before token ``i``, then ``T``. Every
    token adds a boundary (an empty sequence unless it is a start): no count to read to the host."""
    t = starts.numel()
    idx = torch.arange(t, device=starts.device)
    latest = torch.where(starts, idx, 0).cummax(0).values
    return torch.cat([latest, latest.new_full((1,), t)]).to(torch.int32)


def _row_starts(position_ids: Optional[torch.Tensor], batch: int, seqlen: int, device) -> torch.Tensor:
    """bool ``[B, S]``: each row's first token, and tokens whose position is 0 (packed sequences)."""
    starts = torch.zeros(batch, seqlen, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if position_ids is not None:
        starts |= (position_ids == 0).expand(batch, seqlen)
    return starts


@per_tensor_cache  # every layer passes the same position_ids tensor: one cu_seqlens per batch
def _packed_plan(position_ids: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    return _cu_seqlens_from_starts(_row_starts(position_ids, batch, seqlen, position_ids.device).reshape(-1))


@per_tensor_cache  # and the same attention mask: one unpad plan per batch
def _padded_plan(mask: torch.Tensor):
    """(indices, cu_seqlens, max_seqlen) of the tokens the 2-D ``mask`` selects (one host sync)."""
    _, indices, cu_seqlens, max_seqlen, _ = unpad_input(mask[..., None], mask)
    return indices, cu_seqlens, max_seqlen


@functools.lru_cache(maxsize=64)  # every layer of a batch of whole rows: one tensor per shape and device
def _uniform_plan(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """int32 ``[B+1]`` boundaries of ``batch`` rows of ``seqlen`` tokens each (no mask, no position_ids).
    The same tensor every call, so the op's own per-``cu_seqlens`` metadata is built once too; a normal
    tensor even when first asked for under ``inference_mode`` (training saves it for the backward)."""
    with torch.inference_mode(False):
        return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


# --------------------------------------------------------------------------- attention
def dapo_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                          sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                          s_aux: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                          **kwargs):
    """transformers attention function (``AttentionInterface``): ``query [B, Hq, S, D]``, ``key`` /
    ``value [B, Hkv, S, D]`` -> ``(out [B, S, Hq, D], None)``."""
    if dropout:
        raise NotImplementedError("attn_implementation='dapo_varlen' has no attention dropout "
                                  "(set attention_dropout=0)")
    if s_aux is not None:
        raise NotImplementedError("attn_implementation='dapo_varlen' does not support attention sinks (s_aux)")
    batch, _, seqlen, _ = query.shape
    if key.shape[2] != seqlen:
        raise NotImplementedError(f"attn_implementation='dapo_varlen' attends within whole sequences: {key.shape[2]} "
                                  f"keys for {seqlen} queries (a KV cache) is not supported; use sdpa for decoding")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    opts = dict(causal=causal, softmax_scale=scaling, window_size=window, softcap=float(softcap or 0.0))
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, H, D]
    if attention_mask is not None and attention_mask.dim() == 2:
        check_tensor("attention_mask", attention_mask, shape=(batch, seqlen))
        indices, cu, max_seqlen = _padded_plan(attention_mask)
        q, k, v = (index_first_axis(x.reshape(batch * seqlen, *x.shape[2:]), indices) for x in (q, k, v))
        out = varlen_attention(q, k, v, cu, max_seqlen, **opts)
        return pad_input(out, indices, batch, seqlen), None
    if attention_mask is not None:
        raise NotImplementedError("attn_implementation='dapo_varlen' takes a 2-D padding mask, got a "
                                  f"{attention_mask.dim()}-D one (its mask function is flash-attn's)")
    if position_ids is not None:
        check_tensor("position_ids", position_ids, ndim=2)
        if position_ids.shape[1] != seqlen or position_ids.shape[0] not in (1, batch):
            raise ValueError(f"position_ids must be [B, S] or [1, S] = [{batch}, {seqlen}], "
                             f"got {list(position_ids.shape)}")
        cu = _packed_plan(position_ids, batch, seqlen)
    else:
        cu = _uniform_plan(batch, seqlen, query.device)
    out = varlen_attention(*(x.reshape(batch * seqlen, *x.shape[2:]) for x in (q, k, v)), cu, seqlen, **opts)
    return out.reshape(batch, seqlen, *out.shape[1:]), None


def register() -> None:
    """Register ``"dapo_varlen"`` with transformers (done on import; calling it again is harmless)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, dapo_varlen_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attention_mask)


register()


# --------------------------------------------------------------------------- lm_head + loss
try:
    from transformers.modeling_outputs import CausalLMOutputWithPast as _Output
except ImportError:  # pragma: no cover - transformers is this module's dependency
    _Output = object


@dataclass
class DapoCausalLMOutput(_Output):
    """``CausalLMOutputWithPast`` (``logits`` None: never materialised) plus ``log_probs [B, S]`` of each
    token given the ones before it (0 at sequence starts and ignored labels; detached when a loss is
    returned) and the fused loss's ``metrics``."""
    log_probs: Optional[torch.Tensor] = None
    metrics: Optional[Dict[str, torch.Tensor]] = None


_POLICY_KWARGS = ("temperature", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "num_tokens",
                  "num_seqs", "loss_scale_factor", "entropy_coeff", "kl_coef", "kl_type", "calculate_entropy")


def _next_token(x: torch.Tensor, fill, starts: torch.Tensor) -> torch.Tensor:
    """``x [B, S]`` shifted left by one (entry ``t`` = token ``t + 1``, the one position ``t`` predicts),
    ``fill`` where ``t + 1`` is past the row or starts a new sequence (nothing predicts it)."""
    nxt = torch.cat([x[:, 1:], x.new_full((x.shape[0], 1), fill)], dim=1)
    return nxt.masked_fill(torch.cat([starts[:, 1:], starts.new_ones((x.shape[0], 1))], dim=1), fill)


def _dapo_forward(self, input_ids=None, attention_mask=None, position_ids=None, *, labels=None, advantages=None,
                  old_log_prob=None, response_mask=None, ref_log_prob=None, rollout_is_weights=None, logits_to_keep=0,
                  **kwargs):
    policy = {k: kwargs.pop(k) for k in _POLICY_KWARGS if k in kwargs}
    if rollout_is_weights is not None:  # per token like advantages, but only the policy loss takes it
        policy["rollout_is_weights"] = rollout_is_weights
    if labels is None:
        if advantages is not None or policy:
            raise ValueError("the policy loss needs labels (the tokens scored, aligned with input_ids)")
        return self._dapo_original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                           position_ids=position_ids, logits_to_keep=logits_to_keep, **kwargs)
    check_tensor("labels", labels, ndim=2)
    # Checked before the model runs: one token each.
    for name, t in (("advantages", advantages), ("old_log_prob", old_log_prob), ("response_mask", response_mask),
                    ("ref_log_prob", ref_log_prob), ("rollout_is_weights", rollout_is_weights)):
        if t is not None and check_tensor(name, t).shape != labels.shape:
            raise ValueError(f"{name} must have shape {list(labels.shape)} (the labels'), got {list(t.shape)}")
    out = getattr(self, self.base_model_prefix)(input_ids=input_ids, attention_mask=attention_mask,
                                                position_ids=position_ids, **kwargs)
    hidden = out.last_hidden_state
    batch, seqlen = hidden.shape[:2]
    check_tensor("labels", labels, shape=(batch, seqlen))
    starts = _row_starts(position_ids, batch, seqlen, hidden.device)
    if attention_mask is not None:  # left padding: a row's first real token starts its sequence
        real = attention_mask.bool()
        starts |= real & ~torch.nn.functional.pad(real[:, :-1], (1, 0), value=False)
        labels = labels.masked_fill(~real, IGNORE_INDEX)
    flat_h = hidden.reshape(batch * seqlen, -1)
    nxt_labels = _next_token(labels, IGNORE_INDEX, starts).reshape(-1)
    weight = self.get_output_embeddings().weight

    def unshift(x):  # per predictor position -> per predicted token
        return torch.nn.functional.pad(x.reshape(batch, seqlen)[:, :-1], (1, 0))

    if advantages is None:  # supervised: mean negative log-likelihood of the labels (HF's causal-LM loss)
        if policy.keys() - {"temperature"}:
            raise ValueError(f"{sorted(policy.keys() - {'temperature'})} need advantages (the policy loss)")
        lp, _ = linear_log_probs(flat_h, weight, nxt_labels, temperature=policy.get("temperature", 1.0))
        loss = -lp.sum() / (nxt_labels != IGNORE_INDEX).sum().clamp(min=1)
        return DapoCausalLMOutput(loss=loss, past_key_values=out.past_key_values, log_probs=unshift(lp))
    mask = labels != IGNORE_INDEX if response_mask is None else response_mask.bool() & (labels != IGNORE_INDEX)
    tokens = {name: _next_token(t, 0, starts).reshape(-1) if t is not None else None
              for name, t in (("advantages", advantages), ("old_log_prob", old_log_prob),
                              ("ref_log_prob", ref_log_prob), ("response_mask", mask))}
    if rollout_is_weights is not None:
        policy["rollout_is_weights"] = _next_token(rollout_is_weights, 0, starts).reshape(-1)
    if policy.get("loss_agg_mode", "token-mean").startswith("seq"):
        policy["cu_seqlens"] = _cu_seqlens_from_starts(starts.reshape(-1))
    loss, metrics = fused_linear_policy_loss(flat_h, weight, nxt_labels, tokens["old_log_prob"], tokens["advantages"],
                                             tokens["response_mask"], ref_log_prob=tokens["ref_log_prob"], **policy)
    metrics["log_prob"] = unshift(metrics["log_prob"])
    if "entropy" in metrics:
        metrics["entropy"] = unshift(metrics["entropy"])
    return DapoCausalLMOutput(loss=loss, past_key_values=out.past_key_values, log_probs=metrics["log_prob"],
                              metrics=metrics)


def apply_dapo_kernels(model: torch.nn.Module, *, attention: bool = True) -> torch.nn.Module:
    """Patch a transformers causal LM in place for RL training (Liger's ``apply_liger_kernel_to_*`` idea).

    ``model(input_ids, ..., labels=...)`` then never materialises ``[B, S, V]`` logits:

    * ``labels`` ``[B, S]`` aligned with ``input_ids`` (as transformers: position ``t`` predicts token
      ``t + 1``; ``-100`` = not scored): ``loss`` = mean negative log-likelihood of the scored tokens and
      ``log_probs [B, S]`` (differentiable), through :func:`dapo_kernels.linear_log_probs`;
    * plus ``advantages`` ``[B, S]`` (and optional ``old_log_prob`` - None: on-policy -, ``response_mask``,
      ``ref_log_prob``, ``rollout_is_weights``, all ``[B, S]`` aligned with ``labels``, and the keyword arguments of
      :func:`dapo_kernels.fused_linear_policy_loss`: ``clip_ratio_*``, ``loss_agg_mode``, ``entropy_coeff``,
      ``kl_coef``, ``temperature``, ...): the DAPO loss of that op, its ``metrics`` and detached
      ``log_probs`` (feed them back as ``old_log_prob``).

    A token that starts a sequence (a row's first real token, or ``position_ids`` 0 in a packed row)
    is never scored: nothing before it in its sequence predicts it. Without ``labels`` the model's
    own forward runs (logits, generation). ``attention``: also switch the model to
    ``attn_implementation="dapo_varlen"``. Returns the model. An lm_head with a bias, or final-logit
    soft-capping (Gemma 2), raises ``NotImplementedError``; a ``model`` that is not a transformers causal
    LM a ``TypeError``; per-token tensors not shaped like ``labels`` a ``ValueError`` naming them.
    """
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "get_output_embeddings", None)) \
            or not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        raise TypeError("apply_dapo_kernels: model must be a transformers causal LM (a PreTrainedModel with an "
                        f"lm_head, e.g. from AutoModelForCausalLM), got {type(model).__name__}")
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise NotImplementedError("apply_dapo_kernels needs an lm_head without bias")
    if getattr(model.config, "final_logit_softcapping", None):
        raise NotImplementedError("apply_dapo_kernels: final_logit_softcapping is not supported")
    if attention:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if not hasattr(model, "_dapo_original_forward"):
        model._dapo_original_forward = model.forward
        model.forward = types.MethodType(_dapo_forward, model)
    return model
