"""Reference for ``varlen_attention``: plain softmax attention, one sequence at a time."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def varlen_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float64,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, Hq, D], lse [Hq, T])`` computed in ``compute_dtype`` (differentiable).

    ``window_size = (left, right)``: query ``i`` sees keys ``i - left .. i + right`` (-1: unbounded;
    causal: right = 0). ``softcap > 0``: scores ``softcap * tanh(scores / softcap)``.

    With the default float64 it is the accuracy reference; with the inputs' own dtype it
    is "plain torch in that dtype", whose error sets the tests' tolerance.
    """
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    outs, lses = [q.new_zeros((0, Hq, D))], [q.new_zeros((Hq, 0))]
    cu = cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        if e == s:
            continue
        qs = q[s:e].transpose(0, 1)                                   # [Hq, L, D]
        ks = k[s:e].transpose(0, 1).repeat_interleave(group, dim=0)   # [Hq, L, D]
        vs = v[s:e].transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(e - s, device=q.device)[:, None]
        j = torch.arange(e - s, device=q.device)[None, :]
        hidden = j > i if causal else torch.zeros_like(j > i)
        if window_size[0] >= 0:
            hidden = hidden | (j < i - window_size[0])
        if window_size[1] >= 0:
            hidden = hidden | (j > i + window_size[1])
        scores = scores.masked_fill(hidden, float("-inf"))
        lses.append(torch.logsumexp(scores, dim=-1))
        outs.append((torch.softmax(scores, dim=-1) @ vs).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses, dim=1)
