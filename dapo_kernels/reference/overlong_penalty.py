"""Reference for ``overlong_penalty``: DAPO's soft overlong punishment written plainly (a Python loop)."""
from __future__ import annotations

import torch


def overlong_penalty_ref(response_lengths, max_response_length: int, overlong_buffer_len: int,
                         penalty_factor: float = 1.0):
    """DAPO reward manager's soft overlong punishment, one Python float per response (float64); a
    negative (impossible) length gives NaN."""
    expected = max_response_length - overlong_buffer_len
    out = [float("nan") if L < 0 else min(-(float(L) - expected) / overlong_buffer_len * penalty_factor, 0.0)
           for L in response_lengths.reshape(-1).tolist()]
    return torch.tensor(out, dtype=torch.float64).reshape(response_lengths.shape)
