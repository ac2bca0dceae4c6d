"""GPU check of varlen_attention: correctness vs SDPA (and of the descriptor forward on ragged
lengths), and forward / backward times vs torch's varlen_attn and flash-attn.

Correctness rows first (each section isolated: a failure is one FAIL row with its error). Then bf16,
causal, D=128, Hq=32, Hkv=8: aot_model's reference problem (one 16k sequence, ``MODEL_PROBLEM``: the
device run sets the predictions beside it), and one packed micro-batch of 65,536 tokens: an RL length
mix (log-uniform 64..16,384) and fixed lengths 8k / 16k (``FIXED``). FLOPs = 2*sum(L^2)*Hq*D forward
(causal), 2.5x that backward. Forward and backward are timed separately (the backward alone on a
retained graph, ``torch.autograd.grad``), ours at ``deterministic`` False and True (the forward is the
same kernel: timed once), plus the forward's load paths forced (``launch.fwd_triton``'s ``variant``:
"pointer", today's kernel autotuned alone, and "tma", the descriptor kernel at its first tile; the op's
default "auto" autotunes both, and its row notes the config it picked). Peers: torch's
``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside torch) where this torch has it,
flash-attn's ``flash_attn_varlen_func`` where importable, and ``scaled_dot_product_attention``
restricted to the flash backend on the padded [B, H, S, D] view (fixed lengths only: the RL mix
padded to 16k would be ~9x the work). Also the work-list order on the RL mix: the Triton launchers
called directly with ``longest_first`` True and False (same path, no NaN bookkeeping), so the two
rows differ only in the order.
Budget: under 3 minutes (the first calls autotune and compile); cases past the budget are reported
as skipped.
"""
import inspect
import math
import time

import torch
import torch.nn.functional as F

import dapo_kernels as dk
from dapo_kernels.ops.varlen_attention import launch, nan, triton_fwd_tma
from gpu.common import cuda_time_ms

T_TOTAL, HQ, HKV, D = 65536, 32, 8, 128
FIXED = (8192, 16384)  # uniform sequence lengths timed beside the RL mix
# aot_model's reference problem (one causal 16k sequence, 32 / 8 heads, D=128, bf16): timed first, so that
# benchmarks/gpu/device_run.py sets its predictions beside measurements of the same problem.
MODEL_PROBLEM = [16384]
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


def _flash_attn():
    """(callable or None, note) for flash-attn's varlen function (GQA native)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        return None, f"flash-attn not importable ({type(e).__name__})"

    def call(q, k, v, cu, max_len):
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)

    return call, ""


def _padded_sdpa(B, S):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v, cu, max_len):
        qp, kp, vp = (t.view(B, S, t.shape[1], D).transpose(1, 2) for t in (q, k, v))
        kp, vp = (t.repeat_interleave(HQ // HKV, dim=1) for t in (kp, vp))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # error rather than a math fallback
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True).transpose(1, 2).reshape(B * S, HQ, D)

    return call


def _dk(deterministic: bool):
    def call(q, k, v, cu, max_len):
        with dk.use_backend("triton"):
            return dk.varlen_attention(q, k, v, cu, max_len, deterministic=deterministic)

    return call


def _fwd_variant(variant: str):
    """The Triton forward alone with its load path forced (no autograd: forward rows only)."""
    return lambda q, k, v, cu, max_len: launch.fwd_triton(q, k, v, cu, max_len, True, D ** -0.5, -1, -1, 0.0,
                                                          True, variant)[0]


def _picked_config() -> str:
    """The config the op's autotuner picked last for the Hopper forward (pointer or TMA), if it ran."""
    kernel = triton_fwd_tma._varlen_attention_fwd_hopper_kernel
    cfg = getattr(kernel, "best_config", None)
    return "" if cfg is None else f"picked {cfg}"[:100]


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


def _time(fn, q, k, v, cu, max_len, flops_fwd, backward=True):
    """(fwd ms, bwd ms or None): the forward without autograd, the backward alone on a retained graph."""
    with torch.no_grad():
        ms_f = cuda_time_ms(lambda: fn(q, k, v, cu, max_len), warmup=2, iters=5)
    if not backward:
        return ms_f, None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, cu, max_len)
    dout = torch.randn_like(out)
    ms_b = cuda_time_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), warmup=2, iters=5)
    return ms_f, ms_b


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
    ours = fwd_bwd(_dk(False), torch.bfloat16)
    for name, o, p, r in zip(("out", "dq", "dk", "dv"), ours, peer, ref):
        err, bound = (o - r).abs().max().item(), 2 * (p - r).abs().max().item()
        report.add("varlen_attn", f"correct B{B}-S{S} {name}", impl="dk triton bf16",
                   metric=f"err {err:.2e} <= 2x sdpa {bound:.2e}", status="ok" if err <= bound else "FAIL")


def _check_forward_variants(report, g):
    """Ragged lengths (partial blocks, a 1-token sequence): each forced forward's out against fp32 SDPA
    per sequence, within 2x the pointer forward's error (the descriptor's out-of-bounds rows read 0)."""
    lengths = [1000, 37, 1, 520, 77, 129]
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(T, h, D, device="cuda", generator=g, dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
    ref = torch.cat([F.scaled_dot_product_attention(
        *(t[s:e].float().transpose(0, 1) for t in (q, k, v)), is_causal=True, enable_gqa=True).transpose(0, 1)
        for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:])])
    errs = {}
    for variant in ("pointer", "tma", "auto"):
        if variant == "tma" and not (triton_fwd_tma.INTERPRET or triton_fwd_tma.tma_offered(q, k, v, 90)):
            report.add("varlen_attn", "correct ragged out", impl="dk fwd tma", status="skipped",
                       note="no descriptor tile for these inputs on this GPU")
            continue
        errs[variant] = (_fwd_variant(variant)(q, k, v, cu, max(lengths)).float() - ref).abs().max().item()
    for variant, err in errs.items():
        bound = 2 * errs["pointer"]
        report.add("varlen_attn", "correct ragged out", impl=f"dk fwd {variant}",
                   metric=f"err {err:.2e} <= 2x pointer {bound:.2e}", status="ok" if err <= bound else "FAIL")


def _padded_sdpa_fp32(B, S):
    def call(q, k, v, cu, max_len):
        qp, kp, vp = (t.view(B, S, t.shape[1], D).transpose(1, 2) for t in (q, k, v))
        kp, vp = (t.repeat_interleave(HQ // HKV, dim=1) for t in (kp, vp))
        return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True).transpose(1, 2).reshape(B * S, HQ, D)

    return call


def _impls(name, lengths):
    """(impl, fn, note, timed: "fwd+bwd" / "fwd" / "bwd") of one length mix, ours first."""
    impls = [("dk det=False", _dk(False), "", "fwd+bwd"), ("dk det=True", _dk(True), "forward as det=False", "bwd"),
             ("dk fwd pointer", _fwd_variant("pointer"), "today's kernel alone", "fwd"),
             ("dk fwd tma", _fwd_variant("tma"), "descriptor kernel, first tile", "fwd")]
    if name == "RL-mix":
        impls.append(("dk launchers longest-first", _launchers(True), "launchers only", "fwd+bwd"))
        impls.append(("dk launchers seq-order", _launchers(False), "launchers only, work list not sorted", "fwd+bwd"))
    for impl, (fn, note) in (("torch varlen_attn", _torch_varlen()), ("flash-attn", _flash_attn())):
        impls.append((impl, fn, note, "fwd+bwd"))
    if name != "RL-mix":
        impls.append(("padded SDPA flash", _padded_sdpa(len(lengths), lengths[0]), "KV expanded", "fwd+bwd"))
    return impls


def run(report):
    t0 = time.time()
    g = torch.Generator(device="cpu").manual_seed(0)
    gc = torch.Generator(device="cuda").manual_seed(0)
    # Correctness first (short rows; the autotuners key on length buckets, so these small batches pick
    # their own configs and leave the timed buckets' picks alone), then the model's problem, then the mixes.
    with report.section("varlen_attn", "correct B16-S1024", impl="dk triton bf16"):
        _check_correct(report, gc)
    with report.section("varlen_attn", "correct ragged out", impl="dk fwd"):
        _check_forward_variants(report, gc)
    mixes = [("model", MODEL_PROBLEM), ("RL-mix", _rl_mix(g))] + [(f"fixed-{n}", [n] * (T_TOTAL // n)) for n in FIXED]
    for name, lengths in mixes:
        with report.section("varlen_attn", f"{name} B{len(lengths)} T{sum(lengths)}", impl="inputs"):
            _time_mix(report, name, lengths, gc, t0)
            torch.cuda.empty_cache()


def _time_mix(report, name, lengths, gc, t0):
    """Forward and backward rows of every implementation on one length mix, each failure one row."""
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16, generator=gc) for h in (HQ, HKV, HKV))
    flops = 2 * sum(L * L for L in lengths) * HQ * D
    case = f"{name} B{len(lengths)} T{T}"
    for impl, fn, note, timed in _impls(name, lengths):
        if fn is None:
            report.add("varlen_attn", case, impl=impl, status="skipped", note=note)
            continue
        if impl == "dk fwd tma" and not (triton_fwd_tma.INTERPRET or triton_fwd_tma.tma_offered(q, k, v, 90)):
            report.add("varlen_attn", case, impl=impl, status="skipped", note="no descriptor tile here")
            continue
        if time.time() - t0 > BUDGET_S:
            report.add("varlen_attn", case, impl=impl, status="skipped", note="time budget")
            continue
        try:
            ms_f, ms_b = _time(fn, q, k, v, cu, max(lengths), flops, backward=timed != "fwd")
            if "fwd" in timed:
                picked = _picked_config() if impl == "dk det=False" else ""
                report.add("varlen_attn", case + " fwd", impl=impl, ms=ms_f, metric=f"{flops / ms_f / 1e9:.0f} "
                           "TFLOP/s", note=" ".join(x for x in (note, picked) if x), tflops=flops / ms_f / 1e9)
            if ms_b is not None:
                report.add("varlen_attn", case + " bwd", impl=impl, ms=ms_b,
                           metric=f"{2.5 * flops / ms_b / 1e9:.0f} TFLOP/s", note=note, tflops=2.5 * flops / ms_b / 1e9)
        except Exception as e:  # a peer missing a backend must not hide the rest
            report.add("varlen_attn", case, impl=impl, status="FAIL" if impl.startswith("dk") else "skipped",
                       note=f"{type(e).__name__}: {e}"[:100])
    _time_nan_marks(report, case, q, k, v, cu)


def _time_nan_marks(report, case, q, k, v, cu):
    """The public op's NaN marks alone (its time beside the launchers'), forward and backward, by the
    Triton kernels the op runs and by torch ops (the torch path's way)."""
    out, dout = torch.empty_like(q), torch.randn_like(q)
    dk_, dv_ = torch.empty_like(k), torch.empty_like(v)
    lse = torch.zeros(HQ, q.shape[0], device="cuda")
    for triton, impl in ((True, "dk NaN marks (triton)"), (False, "dk NaN marks (torch ops)")):
        def fwd():
            nan.mark_rows_nan_(out, nan.poisoned_queries(q, k, v, cu, True, -1, -1, triton), triton)

        def bwd():
            bad, keys = nan.poisoned_grads(dout, lse, HKV, cu, True, -1, -1, triton)
            for t, rows in ((out, bad), (dk_, keys), (dv_, keys)):
                nan.mark_rows_nan_(t, rows, triton)

        with report.section("varlen_attn", case + " NaN marks", impl=impl):
            for pass_, fn in (("fwd", fwd), ("bwd", bwd)):
                report.add("varlen_attn", f"{case} {pass_}", impl=impl, ms=cuda_time_ms(fn, warmup=2, iters=5),
                           note="marks alone, no attention")
