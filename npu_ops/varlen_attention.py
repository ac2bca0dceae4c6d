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
* ``softmax_max`` / ``softmax_sum`` come back as ``[T, Hq, 8]`` fp32 (8 equal copies per
  row; shape as documented for ``npu_ring_attention_update``'s TND inputs), from which
  ``lse = max + log(sum)``, returned in the unit the op's other backends use (see
  :func:`lse_unit`). The backward gets the statistics back as ``max = lse``, ``sum = 1``: the kernel forms ``p = exp(s - max) / sum``, which is then
  ``exp(s - lse)``, the same probabilities (MindSpeed's ring attention likewise hands the
  grad kernel merged statistics that are not the forward's own).
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from dapo_kernels.backend_api import torch_implementation

from ._lazy import torch_npu

# Side of the compressed causal mask sparse_mode 3 expects.
MASK_SIZE = 2048
# Trailing dimension of softmax_max / softmax_sum: the kernel stores each row's value 8 times.
STAT_COPIES = 8
SPARSE_CAUSAL, SPARSE_NONE = 3, 0

_masks: Dict[torch.device, torch.Tensor] = {}
# (weak ref to the cu_seqlens tensor, its version counter, the host list): every layer of a
# forward and backward sees the same cu_seqlens object, and reading it is a host sync.
_ends_cache: Optional[Tuple[weakref.ref, int, List[int]]] = None


def causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed ``[2048, 2048]`` bool mask (True = masked, above the diagonal), one per device."""
    mask = _masks.get(device)
    if mask is None:
        mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu_(1)
        _masks[device] = mask
    return mask


def seq_ends(cu_seqlens: torch.Tensor) -> List[int]:
    """``cu_seqlens[1:]`` as a host list without empty sequences, cached for the same tensor."""
    global _ends_cache
    cached = _ends_cache
    if cached is not None and cached[0]() is cu_seqlens and cached[1] == cu_seqlens._version:
        return cached[2]
    ends: List[int] = []
    for e in cu_seqlens[1:].tolist():
        if e > (ends[-1] if ends else 0):
            ends.append(int(e))
    _ends_cache = (weakref.ref(cu_seqlens), cu_seqlens._version, ends)
    return ends


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


def _call_args(cu_seqlens: torch.Tensor, causal: bool, device: torch.device) -> dict:
    ends = seq_ends(cu_seqlens)
    return dict(
        atten_mask=causal_mask(device) if causal else None,
        keep_prob=1.0,
        actual_seq_qlen=ends,
        actual_seq_kvlen=ends,
        sparse_mode=SPARSE_CAUSAL if causal else SPARSE_NONE,
    )


def varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale):
    """``(out [T, Hq, D], lse fp32 [Hq, T] in the op's unit)`` via ``npu_fusion_attention``."""
    T, Hq, _ = q.shape
    if T == 0:
        return torch.empty_like(q), q.new_empty((Hq, 0), dtype=torch.float32)
    out, s_max, s_sum = torch_npu().npu_fusion_attention(
        q, k, v, Hq, "TND", scale=softmax_scale, **_call_args(cu_seqlens, causal, q.device),
    )[:3]
    lse = s_max[..., 0] + torch.log(s_sum[..., 0])
    return out, (lse.t() * lse_unit()).contiguous()


def varlen_attention_bwd(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale):
    """``(dq, dk, dv)`` via ``npu_fusion_attention_grad``; dK/dV summed over each KV group by the kernel."""
    T, Hq, _ = q.shape
    if T == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    s_max = (lse.t() / lse_unit()).unsqueeze(-1).expand(T, Hq, STAT_COPIES).contiguous()
    dq, dk, dv = torch_npu().npu_fusion_attention_grad(
        q, k, v, dout, Hq, "TND", softmax_max=s_max, softmax_sum=torch.ones_like(s_max), attention_in=out,
        scale_value=softmax_scale, **_call_args(cu_seqlens, causal, q.device),
    )[:3]
    return dq, dk, dv
