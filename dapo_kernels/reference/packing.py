"""References for the packing ops: boolean indexing and explicit loops."""
from __future__ import annotations

import torch


def unpad_input_ref(x: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """flash-attn bert_padding semantics, written with nonzero()/boolean indexing."""
    mask = attention_mask != 0
    all_mask = mask if unused_mask is None else mask | (unused_mask != 0)
    B, S = mask.shape
    indices = torch.nonzero(all_mask.reshape(-1), as_tuple=False).reshape(-1)
    x_unpad = x.reshape((B * S,) + tuple(x.shape[2:]))[indices]
    seqlens = all_mask.sum(1).to(torch.int32)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=x.device)
    cu[1:] = torch.cumsum(seqlens, 0)
    max_seqlen = int(seqlens.max()) if B else 0
    return x_unpad, indices, cu, max_seqlen, mask.sum(1).to(torch.int32)


def pad_input_ref(x_unpad: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int):
    out = torch.zeros((batch * seqlen,) + tuple(x_unpad.shape[1:]), dtype=x_unpad.dtype, device=x_unpad.device)
    out[indices.long()] = x_unpad
    return out.reshape((batch, seqlen) + tuple(x_unpad.shape[1:]))


def packed_position_ids_ref(cu_seqlens: torch.Tensor, total_tokens: int):
    pos = []
    cu = cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        pos.extend(range(e - s))
    assert len(pos) == total_tokens
    return torch.tensor(pos, dtype=torch.int64)
