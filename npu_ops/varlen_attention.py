"""``varlen_attention`` on Ascend: ``torch_npu.npu_fusion_attention`` in ``TND`` layout.

Kernels for the ``privateuseone`` key of ``dapo::varlen_attention_fwd`` and
``dapo::varlen_attention_bwd`` (same signatures as the ops). The ``dapo`` op keeps
owning autograd (``varlen_attention.py`` registers it for every device), so the NPU
backward is ``npu_fusion_attention_grad``, the kernel torch_npu's own autograd of
``npu_fusion_attention`` calls.

How the call is built, from the torch_npu API reference of ``npu_fusion_attention`` /
``npu_fusion_attention_grad`` (hiascend.com, "torch_npu.npu_fusion_attention", PyTorch
6.0.0 / 7.0.0 API lists) and the varlen call in transformers'
``integrations/npu_flash_attention.py``:

* ``input_layout="TND"``: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` as packed; GQA is native
  with ``head_num = Hq`` (the number of *query* heads).
* ``actual_seq_qlen`` / ``actual_seq_kvlen``: host ``int`` lists of cumulative sequence
  ends *without* the leading 0 (``cu_seqlens[1:]``). Empty sequences are dropped (their
  repeated end adds nothing and the docs only describe positive lengths).
* causal: ``sparse_mode=3`` (rightDownCausal; equal q/kv lengths make it the usual causal
  mask) with the compressed ``[2048, 2048]`` bool mask, True above the diagonal
  (= masked). Non-causal: ``sparse_mode=0``, no mask (the TND sequence bounds still apply).
* ``scale`` is passed explicitly: its default is 1, not ``1/sqrt(D)``.
* ``softmax_max`` / ``softmax_sum`` come back *shaped* ``[T, Hq, 8]`` fp32 (8 equal copies
  per row) but, without ``softmax_layout="TND"`` (torch_npu 7.2.0 with CANN 8.3.RC1 only),
  *stored* "NTD": each sequence's ``[Hq, L_b, 8]`` block, the blocks back to back. They are
  read and written through :func:`stat_index`, a per-``cu_seqlens`` map built on the device,
  so every torch_npu version is served the same way. ``lse = max + log(sum)`` is returned in
  the unit the op's other backends use (see :func:`lse_unit`). The backward gets the
  statistics back, in the same layout, as ``max = lse``, ``sum = 1``: the kernel forms
  ``p = exp(s - max) / sum``, which is then ``exp(s - lse)``, the same probabilities
  (MindSpeed's ring attention likewise hands the grad kernel merged statistics that are not
  the forward's own).
* At most :data:`MAX_SEQS_PER_CALL` sequences per call (the API reference: 1K entries of
  ``actual_seq_qlen`` in the varlen case): longer batches, common with dynamic batches of
  short rollouts, are cut into contiguous groups of sequences, one forward / grad call each.
"""
from __future__ import annotations

import functools
import math
from typing import Dict, List, NamedTuple, Tuple

import torch

from dapo_kernels.backend_api import per_tensor_cache, torch_implementation

from ._lazy import torch_npu

# Side of the compressed causal mask sparse_mode 3 expects.
MASK_SIZE = 2048
# Trailing dimension of softmax_max / softmax_sum: the kernel stores each row's value 8 times.
STAT_COPIES = 8
SPARSE_CAUSAL, SPARSE_NONE = 3, 0
# Sequences (entries of actual_seq_qlen) one varlen call accepts.
MAX_SEQS_PER_CALL = 1024

_masks: Dict[torch.device, torch.Tensor] = {}


class _Plan(NamedTuple):
    """What the calls for one ``cu_seqlens`` need: host lists, built once per batch."""

    ends: List[int]  # cu_seqlens[1:] without empty sequences
    groups: List[Tuple[int, int, List[int]]]  # per call: (first row, end row, ends from the first row)


def causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed ``[2048, 2048]`` bool mask (True = masked, above the diagonal), one per device."""
    mask = _masks.get(device)
    if mask is None:
        mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu_(1)
        _masks[device] = mask
    return mask


@per_tensor_cache  # every layer of a forward and backward sees the same cu_seqlens; reading it is a host sync
def _plan(cu_seqlens: torch.Tensor) -> _Plan:
    """The :class:`_Plan` of ``cu_seqlens`` (rebuilt when it changes in place)."""
    ends: List[int] = []
    for e in cu_seqlens[1:].tolist():
        if e > (ends[-1] if ends else 0):
            ends.append(int(e))
    groups = []
    for i in range(0, len(ends), MAX_SEQS_PER_CALL):
        first = ends[i - 1] if i else 0
        chunk = ends[i:i + MAX_SEQS_PER_CALL]
        groups.append((first, chunk[-1], [e - first for e in chunk]))
    return _Plan(ends, groups)


def seq_ends(cu_seqlens: torch.Tensor) -> List[int]:
    """``cu_seqlens[1:]`` as a host list without empty sequences, cached for the same tensor."""
    return _plan(cu_seqlens).ends


def stat_index(cu_seqlens: torch.Tensor, total_tokens: int, heads: int) -> torch.Tensor:
    """int64 ``[heads, T]``: the row of ``softmax_max`` / ``softmax_sum`` (viewed ``[T * heads,
    8]``) that holds head ``h`` of token ``t``.

    The NTD layout puts sequence ``b`` (rows ``s_b:e_b``, length ``L_b``) at rows
    ``s_b * heads ...``, head-major: ``s_b * heads + h * L_b + (t - s_b)``. Built on the device
    from ``cu_seqlens`` (no host sync); groups of calls concatenate to the same layout, as each
    sequence's block starts at ``s_b * heads`` either way.
    """
    cu = cu_seqlens.long()
    t = torch.arange(total_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:].contiguous(), t, right=True)  # empty sequences own no token
    start = cu[seq]
    h = torch.arange(heads, device=cu.device)[:, None]
    return start * heads + h * (cu[seq + 1] - start) + (t - start)


# The statistics map, once per batch and head count (every layer reuses it).
_stat_index = per_tensor_cache(stat_index)


@functools.lru_cache(maxsize=None)
def lse_unit() -> float:
    """The op's lse per natural-log unit: 1.0, or 1/ln 2 if the op carries lse in base 2.

    That unit is a private contract between ``varlen_attention``'s forward, backward and
    public wrapper, so it is measured once from the torch path rather than hard-coded:
    zero q, k, v over two keys give ``lse = ln 2`` in natural units.
    """
    z = torch.zeros(2, 1, 16)
    _, lse = torch_implementation("varlen_attention_fwd")(z, z, z, torch.tensor([0, 2], dtype=torch.int32), 2,
                                                          False, 1.0)
    return float(lse[0, 0]) / math.log(2)


def _call_args(ends: List[int], causal: bool, device: torch.device) -> dict:
    return dict(
        atten_mask=causal_mask(device) if causal else None,
        keep_prob=1.0,
        actual_seq_qlen=ends,
        actual_seq_kvlen=ends,
        sparse_mode=SPARSE_CAUSAL if causal else SPARSE_NONE,
    )


def _cat(parts: List[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _check_plain(window_left: int, window_right: int, softcap: float, causal: bool) -> None:
    """Sliding window and soft-capping are not wired to ``npu_fusion_attention`` yet."""
    if window_left >= 0 or (window_right >= 0 and not causal) or softcap:
        raise NotImplementedError("varlen_attention on NPU: window_size and softcap are not supported yet")


def varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, window_left=-1, window_right=-1,
                         softcap=0.0, deterministic=True):
    """``(out [T, Hq, D], lse fp32 [Hq, T] in the op's unit)`` via ``npu_fusion_attention``."""
    _check_plain(window_left, window_right, softcap, causal)
    T, Hq, _ = q.shape
    if T == 0:
        return torch.empty_like(q), q.new_empty((Hq, 0), dtype=torch.float32)
    plan = _plan(cu_seqlens)
    outs, stats = [], []
    for lo, hi, ends in plan.groups:
        out, s_max, s_sum = torch_npu().npu_fusion_attention(
            q[lo:hi], k[lo:hi], v[lo:hi], Hq, "TND", scale=softmax_scale, **_call_args(ends, causal, q.device),
        )[:3]
        outs.append(out)
        stats.append(s_max[..., 0] + torch.log(s_sum[..., 0]))  # [rows, Hq] in storage (NTD) order
    lse = _cat(stats).reshape(-1)[_stat_index(cu_seqlens, T, Hq)]
    return _cat(outs), lse * lse_unit()


def varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale, window_left=-1,
                         window_right=-1, softcap=0.0, deterministic=True):
    """``(dq, dk, dv)`` via ``npu_fusion_attention_grad``; dK/dV summed over each KV group by the kernel.
    ``deterministic`` (the Triton backward's choice of dQ path) has no NPU counterpart here."""
    _check_plain(window_left, window_right, softcap, causal)
    T, Hq, _ = q.shape
    if T == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    plan = _plan(cu_seqlens)
    # lse back into the NTD layout the forward's statistics had.
    flat = lse.new_empty(T * Hq).index_copy_(0, _stat_index(cu_seqlens, T, Hq).reshape(-1),
                                              (lse / lse_unit()).reshape(-1))
    s_max = flat.view(T, Hq, 1).expand(T, Hq, STAT_COPIES).contiguous()
    s_sum = torch.ones_like(s_max)
    grads = []
    for lo, hi, ends in plan.groups:
        grads.append(torch_npu().npu_fusion_attention_grad(
            q[lo:hi], k[lo:hi], v[lo:hi], dout[lo:hi], Hq, "TND", softmax_max=s_max[lo:hi],
            softmax_sum=s_sum[lo:hi], attention_in=out[lo:hi], scale_value=softmax_scale,
            **_call_args(ends, causal, q.device),
        )[:3])
    dq, dk, dv = (_cat(list(g)) for g in zip(*grads))
    return dq, dk, dv
