"""Fused Ascend kernels of ``dapo_trainer.model``: RMSNorm, rotary embedding, SwiGLU.

Each function returns the fused result for a tensor on an NPU, or ``None`` when the
tensor is elsewhere or outside the kernel's documented limits; the model then runs its
own torch code, so CPU / CUDA behaviour is unchanged. The torch_npu ops carry their own
autograd. Signatures and semantics from the torch_npu API reference (hiascend.com,
PyTorch 6.0.0 / 7.0.0 API lists):

* ``npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd)``: ``y = x * rsqrt(mean(x^2) + eps) * gamma``,
  ``gamma`` of ``self``'s dtype.
* ``npu_rotary_mul(input, r1, r2, rotary_mode='half')``: ``r1 * x + r2 * cat(-x2, x1)``
  (the rotate-half layout of HF checkpoints); 4-D, BSND input with ``1S1D`` cos/sin;
  ``D`` even and < 896, ``B``, ``N`` < 1000 (A2/A3) in the binary operator mode
  (``jit_compile=False``, A2/A3's default); ``D = 128`` only with ``jit_compile=True``.
* ``npu_swiglu(self, dim=-1)``: ``silu(a) * b`` with ``a, b = self.chunk(2, dim)``.
"""
from __future__ import annotations

from typing import Optional

import torch

from npu_ops import is_npu, torch_npu

# npu_rotary_mul limits (half mode, A2/A3): heads < 1000, head dim even and < 896; with
# jit_compile=True (online-compiled operators) the head dim must be 128.
_ROPE_MAX_HEADS = 1000
_ROPE_MAX_DIM = 896
_ROPE_JIT_DIM = 128


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """``npu_rms_norm(x, weight, eps)``, or None (not on NPU, or weight in another dtype:
    the kernel wants equal dtypes and the torch path's promotion rules would differ)."""
    if not is_npu(x) or weight.dtype != x.dtype:
        return None
    return torch_npu().npu_rms_norm(x, weight, epsilon=eps)[0]


def _binary_operators() -> bool:
    """True if torch_npu runs prebuilt (binary, ``jit_compile=False``) operators; False when
    they are compiled online or the mode cannot be read (``torch_npu.npu.is_jit_compile_false``
    is missing in older torch_npu), i.e. when only the narrower jit limits are safe."""
    probe = getattr(getattr(torch_npu(), "npu", None), "is_jit_compile_false", None)
    return bool(probe()) if probe is not None else False


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[torch.Tensor]:
    """Rotate-half RoPE of packed ``x [T, heads, D]`` with ``cos``/``sin [T, D]``, or None."""
    if not is_npu(x) or cos.dtype != x.dtype:
        return None
    T, N, D = x.shape
    if N >= _ROPE_MAX_HEADS or D % 2 or D >= _ROPE_MAX_DIM:
        return None
    if D != _ROPE_JIT_DIM and not _binary_operators():
        return None
    # Packed tokens as one BSND batch (B = 1, S = T); cos/sin broadcast over heads (1S1D).
    out = torch_npu().npu_rotary_mul(x.unsqueeze(0), cos[None, :, None, :], sin[None, :, None, :])
    return out.squeeze(0)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> Optional[torch.Tensor]:
    """``silu(gate) * up`` through ``npu_swiglu``, or None.

    The kernel reads one ``[..., 2I]`` tensor, so gate and up are concatenated (one extra
    copy; the fused backward saves the activation's intermediates in exchange).
    """
    if not is_npu(gate) or up.dtype != gate.dtype or up.shape != gate.shape:
        return None
    return torch_npu().npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)
