"""GPU check of varlen_attention: correctness vs SDPA, TFLOP/s vs torch's varlen_attn and
padded SDPA.

bf16, causal, D=128, Hq=32, Hkv=8, one packed micro-batch of 65,536 tokens: an RL length
mix (log-uniform 64..16,384) and fixed lengths 1k / 4k / 16k. FLOPs = 2*sum(L^2)*Hq*D
forward, 2.5x that backward (3.5x for forward+backward). Peers: torch's
``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside torch) where this
torch has it, and ``scaled_dot_product_attention`` restricted to the flash backend on
the padded [B, H, S, D] view (fixed lengths only: the RL mix padded to 16k would be ~9x
the work). Also the work-list order on the RL mix: the Triton launchers called directly with
``longest_first`` True and False (same path, no NaN bookkeeping), so the two rows differ only
in the order.
Budget: under 3 minutes (first call autotunes 4 configs x 3 kernels); cases past the
budget are reported as skipped.
"""
import inspect
import math
import time

import torch
import torch.nn.functional as F

import dapo_kernels as dk
from dapo_kernels.ops.varlen_attention import launch
from gpu.common import cuda_time_ms

T_TOTAL, HQ, HKV, D = 65536, 32, 8, 128
BUDGET_S = 170


def _rl_mix(g):
    """Lengths log-uniform in [64, 16384] until 65,536 tokens (the last one trimmed)."""
    lengths, total = [], 0
    while total < T_TOTAL:
        u = torch.rand((), generator=g).item()
        L = min(int(math.exp(math.log(64) + u * (math.log(16384) - math.log(64)))), T_TOTAL - total)
        lengths.append(L)
        total += L
    return lengths


def _torch_varlen():
    """(callable(q, k, v, cu, max_len) or None, note) for torch's varlen_attn."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params
    if gqa:
        kw["enable_gqa"] = True

    def call(q, k, v, cu, max_len):
        if not gqa:  # older signature: expand KV heads (extra memory traffic, noted)
            k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)

    return call, "" if gqa else "KV heads expanded (no enable_gqa)"


def _padded_sdpa(B, S):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v, cu, max_len):
        qp, kp, vp = (t.view(B, S, t.shape[1], D).transpose(1, 2) for t in (q, k, v))
        kp, vp = (t.repeat_interleave(HQ // HKV, dim=1) for t in (kp, vp))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # error rather than a math fallback
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True).transpose(1, 2).reshape(B * S, HQ, D)

    return call


def _dk(q, k, v, cu, max_len):
    with dk.use_backend("triton"):
        return dk.varlen_attention(q, k, v, cu, max_len)


class _Launchers(torch.autograd.Function):
    """The Triton launchers with an explicit work-list order (causal, default scale, dQ by atomics
    where offered, as the public default ``deterministic=False``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, longest_first):
        out, lse = launch.fwd_triton(q, k, v, cu, max_len, True, D ** -0.5, -1, -1, 0.0, longest_first)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_len, ctx.longest_first = max_len, longest_first
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        grads = launch.bwd_triton(dout.contiguous(), q, k, v, out, lse, cu, ctx.max_len, True, D ** -0.5, -1, -1,
                                  0.0, False, ctx.longest_first)
        return (*grads, None, None, None)


def _launchers(longest_first: bool):
    return lambda q, k, v, cu, max_len: _Launchers.apply(q, k, v, cu, max_len, longest_first)


def _time(fn, q, k, v, cu, max_len, flops_fwd):
    """(fwd ms, fwd TFLOP/s, fwd+bwd ms, fwd+bwd TFLOP/s)."""
    with torch.no_grad():
        ms_f = cuda_time_ms(lambda: fn(q, k, v, cu, max_len), warmup=2, iters=5)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)

    def step():
        fn(*leaves, cu, max_len).backward(dout)

    ms_fb = cuda_time_ms(step, warmup=2, iters=5)
    return ms_f, flops_fwd / ms_f / 1e9, ms_fb, 3.5 * flops_fwd / ms_fb / 1e9


def _check_correct(report, g):
    """1k case: dk bf16 error <= 2x flash SDPA's bf16 error, both against fp32 SDPA."""
    B, S = 16, 1024
    q, k, v = (torch.randn(B * S, h, D, device="cuda", generator=g) for h in (HQ, HKV, HKV))
    cu = torch.arange(0, B * S + 1, S, device="cuda", dtype=torch.int32)
    dout = torch.randn_like(q)

    def fwd_bwd(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]  # .to(fp32) would alias q
        out = fn(*leaves, cu, S)
        out.backward(dout.to(dtype))
        return [out.float()] + [t.grad.float() for t in leaves]

    ref = fwd_bwd(_padded_sdpa_fp32(B, S), torch.float32)
    peer = fwd_bwd(_padded_sdpa(B, S), torch.bfloat16)
    ours = fwd_bwd(_dk, torch.bfloat16)
    for name, o, p, r in zip(("out", "dq", "dk", "dv"), ours, peer, ref):
        err, bound = (o - r).abs().max().item(), 2 * (p - r).abs().max().item()
        report.add("varlen_attn", f"correct B{B}-S{S} {name}", impl="dk triton bf16",
                   metric=f"err {err:.2e} <= 2x sdpa {bound:.2e}", status="ok" if err <= bound else "FAIL")


def _padded_sdpa_fp32(B, S):
    def call(q, k, v, cu, max_len):
        qp, kp, vp = (t.view(B, S, t.shape[1], D).transpose(1, 2) for t in (q, k, v))
        kp, vp = (t.repeat_interleave(HQ // HKV, dim=1) for t in (kp, vp))
        return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True).transpose(1, 2).reshape(B * S, HQ, D)

    return call


def run(report):
    t0 = time.time()
    g = torch.Generator(device="cpu").manual_seed(0)
    gc = torch.Generator(device="cuda").manual_seed(0)
    _check_correct(report, gc)
    varlen_peer, varlen_note = _torch_varlen()
    if varlen_peer is None:
        report.add("varlen_attn", "peer", impl="torch varlen_attn", status="skipped", note=varlen_note)
    mixes = [("RL-mix", _rl_mix(g))] + [(f"fixed-{n // 1024}k", [n] * (T_TOTAL // n)) for n in (1024, 4096, 16384)]
    for name, lengths in mixes:
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(T_TOTAL, h, D, device="cuda", dtype=torch.bfloat16, generator=gc)
                   for h in (HQ, HKV, HKV))
        flops = 2 * sum(L * L for L in lengths) * HQ * D
        impls = [("dk triton LPT", _dk, "")]
        if name == "RL-mix":
            impls.append(("dk launchers longest-first", _launchers(True), "launchers only"))
            impls.append(("dk launchers seq-order", _launchers(False), "launchers only, work list not sorted"))
        if varlen_peer is not None:
            impls.append(("torch varlen_attn", varlen_peer, varlen_note))
        if name != "RL-mix":
            impls.append(("padded SDPA flash", _padded_sdpa(len(lengths), lengths[0]), "KV expanded"))
        case = f"{name} B{len(lengths)} T{T_TOTAL}"
        for impl, fn, note in impls:
            if time.time() - t0 > BUDGET_S:
                report.add("varlen_attn", case, impl=impl, status="skipped", note="time budget")
                continue
            try:
                ms_f, tf_f, ms_fb, tf_fb = _time(fn, q, k, v, cu, max(lengths), flops)
                report.add("varlen_attn", case + " fwd", impl=impl, ms=ms_f, metric=f"{tf_f:.0f} TFLOP/s", note=note)
                report.add("varlen_attn", case + " fwd+bwd", impl=impl, ms=ms_fb, metric=f"{tf_fb:.0f} TFLOP/s",
                           note=note)
            except Exception as e:  # a peer missing a backend must not hide the rest
                report.add("varlen_attn", case, impl=impl, status="FAIL" if impl.startswith("dk") else "skipped",
                           note=f"{type(e).__name__}: {e}"[:100])
        del q, k, v
        torch.cuda.empty_cache()
