"""A stand-in for ``torch_npu`` on CPU tensors, for testing how npu_ops calls it.

Each function checks its arguments the way the torch_npu API reference documents them
(hiascend.com, "torch_npu.npu_fusion_attention", "npu_fusion_attention_grad",
"npu_rms_norm", "npu_rotary_mul", "npu_swiglu"; PyTorch 6.0.0 / 7.0.0 API lists) and
then computes what the documentation says the op computes, in float64. A test passing
against it shows that our call would give the right answer if the real op does what
its documentation says; it says nothing about the real kernels (tests/npu does).

The attention pair deliberately checks our usage, which is narrower than what the op
accepts: TND layout only, causal only via sparse_mode 3 + the compressed mask, no
dropout, no pse / padding_mask / prefix. It keeps the documented limits and layouts that
a wrong call would silently violate: at most 1,024 sequences per varlen call, and
``softmax_max`` / ``softmax_sum`` shaped ``[T, N1, 8]`` but stored "NTD", each sequence's
``[N1, L, 8]`` block back to back (the default without ``softmax_layout="TND"``); the grad
reads them in that layout.

``npu.set_compile_mode(jit_compile=...)`` / ``npu.is_jit_compile_false()`` model the
operator compile mode (binary, ``jit_compile=False``, by default as on Atlas A2/A3), which
changes ``npu_rotary_mul``'s limits.

``install(monkeypatch)`` puts it in ``sys.modules['torch_npu']``; ``calls`` records every
call by op name.
"""
from __future__ import annotations

import sys
import types
from collections import defaultdict

import torch
import torch.nn.functional as F

MASK_SIZE = 2048
# Entries of actual_seq_qlen a varlen (TND) call accepts.
MAX_VARLEN_SEQS = 1024
_UNSET = object()
calls = defaultdict(list)
_compile_mode = {"jit_compile": False}


class FakeNPUArgumentError(ValueError):
    """Our call broke a documented rule of the op."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise FakeNPUArgumentError(msg)


def _check_seq_lens(name, lens, T):
    _require(isinstance(lens, (list, tuple)), f"{name} must be a host list of ints, got {type(lens).__name__}")
    _require(all(type(x) is int for x in lens), f"{name} must hold Python ints, got {[type(x).__name__ for x in lens]}")
    _require(len(lens) > 0 and lens[0] > 0, f"{name} are cumulative ends without the leading 0, got {lens}")
    _require(len(lens) <= MAX_VARLEN_SEQS, f"{name}: at most {MAX_VARLEN_SEQS} sequences per call, got {len(lens)}")
    _require(all(b > a for a, b in zip(lens, lens[1:])), f"{name} must increase (each sequence non-empty), got {lens}")
    _require(lens[-1] == T, f"{name}[-1] must equal T = {T}, got {lens[-1]}")


def _check_attention(query, key, value, head_num, input_layout, *, pse, padding_mask, atten_mask, scale, keep_prob,
                     prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode):
    _require(input_layout == "TND", f"input_layout: we call with 'TND', got {input_layout!r}")
    _require(query.dim() == 3 and key.dim() == 3 and value.shape == key.shape, "TND: q [T, N1, D], k = v [T, N2, D]")
    T, n1, D = query.shape
    _require(key.shape[0] == T and key.shape[2] == D, f"k must be [T={T}, N2, D={D}], got {list(key.shape)}")
    _require(query.dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {query.dtype} unsupported")
    _require(key.dtype == query.dtype == value.dtype, "q, k, v must share a dtype")
    _require(type(head_num) is int and head_num == n1, f"head_num must be the query heads N1 = {n1}, got {head_num!r}")
    _require(n1 % key.shape[1] == 0, f"N1 ({n1}) must be a multiple of N2 ({key.shape[1]})")
    _require(pse is None and padding_mask is None and prefix is None, "pse / padding_mask / prefix unused by us")
    _require(scale is not _UNSET and type(scale) is float, "scale must be passed explicitly (default 1.0)")
    _require(keep_prob == 1.0, f"keep_prob must be 1.0 (no dropout), got {keep_prob}")
    _check_seq_lens("actual_seq_qlen", actual_seq_qlen, T)
    _require(list(actual_seq_kvlen) == list(actual_seq_qlen), "self-attention: kv lengths equal q lengths")
    _require(sparse_mode in (0, 3), f"sparse_mode: 0 (none) or 3 (causal), got {sparse_mode}")
    if sparse_mode == 3:
        _require(isinstance(atten_mask, torch.Tensor) and atten_mask.dtype == torch.bool
                 and tuple(atten_mask.shape) == (MASK_SIZE, MASK_SIZE),
                 "sparse_mode=3 needs the compressed [2048, 2048] bool atten_mask")
        _require(atten_mask.device == query.device, "atten_mask must be on the query's device")
        _require(torch.equal(atten_mask, torch.ones_like(atten_mask).triu_(1)),
                 "atten_mask must be True strictly above the diagonal (True = masked)")
    else:
        _require(atten_mask is None, "sparse_mode=0: no mask expected")
    return T, n1, key.shape[1], D


def _sequences(actual_seq_qlen):
    return zip([0] + list(actual_seq_qlen[:-1]), actual_seq_qlen)


def _to_ntd(per_sequence, T, n1):
    """``[N1, L]`` statistics of each sequence -> fp32 ``[T, N1, 8]`` stored NTD (blocks back to back)."""
    flat = torch.cat([x.reshape(-1) for x in per_sequence])
    return flat.float().view(T, n1, 1).expand(T, n1, 8).contiguous()


def _from_ntd(stat, s, e, n1):
    """Sequence ``[s, e)``'s ``[N1, L]`` block of an NTD-stored ``[T, N1, 8]`` statistic."""
    return stat[..., 0].reshape(-1)[s * n1:e * n1].view(n1, e - s)


def _scores(q, k, s, e, group, scale, mask):
    """Scaled scores [N1, L, L] of one sequence in float64; with the (validated, compressed)
    causal mask, its top-left [L, L] corner is masked (-inf): equal q / kv lengths."""
    qs = q[s:e].double().transpose(0, 1)
    ks = k[s:e].double().transpose(0, 1).repeat_interleave(group, 0)
    sc = scale * qs @ ks.transpose(1, 2)
    if mask is not None:
        sc = sc.masked_fill(mask[:e - s, :e - s], float("-inf"))
    return sc


def npu_fusion_attention(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                         atten_mask=None, scale=_UNSET, keep_prob=1.0, pre_tockens=2147483647,
                         next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    """(attention_out, softmax_max [T, N1, 8] fp32, softmax_sum [T, N1, 8] fp32, softmax_out, seed, offset, numels)."""
    T, n1, n2, D = _check_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale, keep_prob=keep_prob, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode)
    calls["npu_fusion_attention"].append(dict(sparse_mode=sparse_mode, scale=scale, lens=list(actual_seq_qlen)))
    out = torch.zeros(T, n1, D, dtype=torch.float64)
    s_max, s_sum = [], []
    for s, e in _sequences(actual_seq_qlen):
        sc = _scores(query, key, s, e, n1 // n2, scale, atten_mask)
        m = sc.amax(-1, keepdim=True)
        p = torch.exp(sc - m)
        sm = p.sum(-1, keepdim=True)
        vs = value[s:e].double().transpose(0, 1).repeat_interleave(n1 // n2, 0)
        out[s:e] = ((p / sm) @ vs).transpose(0, 1)
        s_max.append(m[..., 0])
        s_sum.append(sm[..., 0])
    return (out.to(query.dtype), _to_ntd(s_max, T, n1), _to_ntd(s_sum, T, n1), query.new_empty(0), 0, 0, 0)


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=_UNSET, keep_prob=1.0, pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False):
    """(dq, dk, dv, dpse): the flash-attention backward from the given softmax statistics,
    ``p = exp(s - softmax_max) / softmax_sum`` and ``delta = rowsum(dy * attention_in)``."""
    T, n1, n2, D = _check_attention(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale_value, keep_prob=keep_prob, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode)
    _require(dy.shape == query.shape and dy.dtype == query.dtype, "dy must match the query")
    _require(attention_in is not None and attention_in.shape == query.shape, "attention_in: the forward output")
    for name, st in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        _require(isinstance(st, torch.Tensor) and st.dtype == torch.float32 and tuple(st.shape) == (T, n1, 8),
                 f"{name} must be fp32 [T, N1, 8] = [{T}, {n1}, 8]")
        _require(torch.equal(st, st[..., :1].expand_as(st)), f"{name}: the 8 copies of a row must be equal")
    calls["npu_fusion_attention_grad"].append(dict(sparse_mode=sparse_mode, scale=scale_value))
    group = n1 // n2
    dq = torch.zeros(T, n1, D, dtype=torch.float64)
    dk = torch.zeros(T, n2, D, dtype=torch.float64)
    dv = torch.zeros(T, n2, D, dtype=torch.float64)
    for s, e in _sequences(actual_seq_qlen):
        sc = _scores(query, key, s, e, group, scale_value, atten_mask)
        m = _from_ntd(softmax_max, s, e, n1).double()[..., None]
        sm = _from_ntd(softmax_sum, s, e, n1).double()[..., None]
        p = torch.exp(sc - m) / sm                                            # [N1, L, L]
        do = dy[s:e].double().transpose(0, 1)
        o = attention_in[s:e].double().transpose(0, 1)
        qs = query[s:e].double().transpose(0, 1)
        ks = key[s:e].double().transpose(0, 1).repeat_interleave(group, 0)
        vs = value[s:e].double().transpose(0, 1).repeat_interleave(group, 0)
        dp = do @ vs.transpose(1, 2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq[s:e] = (scale_value * ds @ ks).transpose(0, 1)
        L = e - s
        dk[s:e] = (scale_value * ds.transpose(1, 2) @ qs).view(n2, group, L, D).sum(1).transpose(0, 1)
        dv[s:e] = (p.transpose(1, 2) @ do).view(n2, group, L, D).sum(1).transpose(0, 1)
    dt = query.dtype
    return dq.to(dt), dk.to(dt), dv.to(dt), query.new_empty(0)


def npu_rms_norm(self, gamma, epsilon=1e-6):
    """(y, rstd): ``x * rsqrt(mean(x^2) + eps) * gamma``; gamma in x's dtype, shaped like x's last dims."""
    _require(self.dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {self.dtype} unsupported")
    _require(gamma.dtype == self.dtype, f"gamma dtype {gamma.dtype} must equal the input's {self.dtype}")
    _require(tuple(gamma.shape) == tuple(self.shape[-gamma.dim():]), "gamma must match the input's last dims")
    calls["npu_rms_norm"].append(dict(epsilon=epsilon))
    x = self.double()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x * rstd * gamma.double()).to(self.dtype), rstd.float()


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """``r1 * x + r2 * cat(-x2, x1)``; 4-D input with cos/sin in one of the documented broadcast shapes."""
    _require(rotary_mode == "half", f"rotary_mode: 'half' (rotate-half layout), got {rotary_mode!r}")
    _require(input.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape, "input, r1, r2 must be 4-D")
    a, b, c, D = input.shape
    allowed = {  # BNSD: 11SD / B1SD; BSND: 1S1D / BS1D; SBND: S11D / SB1D
        (1, 1, c, D), (a, 1, c, D), (1, b, 1, D), (a, b, 1, D), (a, 1, 1, D),
    }
    _require(tuple(r1.shape) in allowed, f"r1/r2 shape {list(r1.shape)} not a documented broadcast of {list(input.shape)}")
    _require(D % 2 == 0 and D < 896, f"head dim must be even and < 896, got {D}")
    if _compile_mode["jit_compile"]:  # the online-compiled (non-binary) kernel
        _require(D == 128, f"jit_compile=True: head dim must be 128, got {D}")
    _require(r1.dtype == input.dtype, "r1/r2 must share the input's dtype")
    calls["npu_rotary_mul"].append(dict(shape=tuple(input.shape), r_shape=tuple(r1.shape)))
    x1, x2 = input.chunk(2, dim=-1)
    return r1 * input + r2 * torch.cat((-x2, x1), dim=-1)


def npu_swiglu(self, dim=-1):
    """``silu(a) * b`` with ``a, b = self.chunk(2, dim)``."""
    _require(self.shape[dim] % 2 == 0, f"dim {dim} must have even size, got {self.shape[dim]}")
    calls["npu_swiglu"].append(dict(shape=tuple(self.shape), dim=dim))
    a, b = self.chunk(2, dim=dim)
    return F.silu(a) * b


def set_compile_mode(jit_compile=False):
    _compile_mode["jit_compile"] = bool(jit_compile)


def is_jit_compile_false():
    return not _compile_mode["jit_compile"]


def module() -> types.ModuleType:
    """This file as a module named ``torch_npu`` (with the ``torch_npu.npu`` compile-mode functions)."""
    mod = types.ModuleType("torch_npu")
    for name in ("npu_fusion_attention", "npu_fusion_attention_grad", "npu_rms_norm", "npu_rotary_mul",
                 "npu_swiglu"):
        setattr(mod, name, globals()[name])
    mod.npu = types.SimpleNamespace(set_compile_mode=set_compile_mode, is_jit_compile_false=is_jit_compile_false)
    mod.calls = calls
    return mod


def install(monkeypatch) -> types.ModuleType:
    """Put the fake in ``sys.modules['torch_npu']`` for one test; clears the call log and
    restores the default (binary) compile mode."""
    calls.clear()
    set_compile_mode(jit_compile=False)
    mod = module()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    return mod
