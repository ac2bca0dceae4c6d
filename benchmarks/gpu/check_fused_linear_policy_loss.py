"""GPU check of the fused lm_head -> log-prob -> DAPO loss (``dk.linear_log_probs``,
``dk.fused_linear_policy_loss``): correctness against float64, speed against the matmuls.

* Correctness (N=512, H=4096, V=151936, bf16 inputs, temperature 0.7, entropy and kl terms on):
  the Triton kernels and the torch path (on the GPU too) against a float64 full-logits reference
  on the same bf16-rounded inputs; bound: 2x plain bf16 torch's own error (the project rule),
  and the issue's log-prob error < 1e-3 nats.
* Speed (N=16384, H=4096, V=151936 bf16, token-mean DAPO loss, forward + backward):
  the three bf16 matmuls alone (logits, dH, dW: 6*N*H*V FLOPs, the physical limit) vs dk
  Triton (the same three GEMM units per row chunk, fp32 logits, two elementwise kernels; goal
  <= 1.15x the matmuls), Liger-Kernel's fused linear cross entropy
  (``LigerFusedLinearCrossEntropyLoss``: three GEMM passes around a token-mean cross entropy
  instead of the DAPO loss, the lm_head peer of issue 32), Liger's chunked
  ``LigerFusedLinearGRPOLoss`` and naive full fp32 logits + log_softmax + autograd; TFLOP/s and
  peak extra memory for each (a peer that is not importable gets a "not installed" row); for dk,
  the peak beyond the returned dH / dW (the workspace; goal < 1 GB) beside ``workspace_bytes``'
  model, and a predicted time: the matmuls as measured plus dk's extra bytes at the HBM rate
  (``_extra_bytes``).

Budget: ~90 s (Triton compilation and the naive 10 GB logits included).
"""
import torch

import dapo_kernels as dk
from dapo_kernels.ops.linear_log_probs import workspace_bytes
from dapo_kernels.reference import fused_linear_policy_loss_ref, linear_log_probs_ref
from gpu.common import cuda_time_ms, peak_mem_mb

N, H, V = 16384, 4096, 151936
N_CHECK = 512
B = 16  # Liger: [B, T, H] with one advantage per sequence
TEMP = 0.7
DEVICE = "cuda"  # a CPU smoke run (interpreted Triton, small sizes) sets it to "cpu"


def _inputs(n, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    kw = dict(device=DEVICE, generator=g)
    hidden = torch.randn(n, H, **kw).bfloat16()
    weight = (torch.randn(V, H, **kw) * 2.0 / H ** 0.5).bfloat16()  # logits of std ~2
    labels = torch.randint(0, V, (n,), **kw)
    old = -3 * torch.rand(n, **kw)
    adv = torch.randn(B, **kw).repeat_interleave(n // B)
    mask = torch.rand(n, **kw) > 0.1
    ref = old + 0.3 * torch.randn(n, **kw)
    return hidden, weight, labels, old, adv, mask, ref


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _grads(fn, hidden, weight, dtype):
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    outs = fn(h, w)
    dh, dw = torch.autograd.grad(outs[0], [h, w])
    return [o.detach() for o in outs] + [dh, dw]


def _correctness(report):
    hidden, weight, labels, old, adv, mask, ref = _inputs(N_CHECK, seed=1)
    cot = torch.randn(N_CHECK, device=DEVICE)
    kw = dict(temperature=TEMP, entropy_coeff=0.01, kl_coef=0.1, ref_log_prob=ref)

    def lin_dk(h, w):
        lp, ent = dk.linear_log_probs(h, w, labels, temperature=TEMP, return_entropy=True)
        return (lp * cot).sum() + (ent * cot.flip(0)).sum(), lp, ent

    def lin_ref(h, w):
        lp, ent = linear_log_probs_ref(h, w, labels, TEMP)
        return (lp * cot.to(lp.dtype)).sum() + (ent * cot.flip(0).to(ent.dtype)).sum(), lp, ent

    def fused_dk(h, w):
        loss, m = dk.fused_linear_policy_loss(h, w, labels, old, adv, mask, **kw)
        return loss, m["log_prob"], m["entropy"]

    def fused_ref(h, w):
        f = {k: (v.to(h.dtype) if torch.is_tensor(v) else v) for k, v in kw.items()}
        loss, _, lp, ent = fused_linear_policy_loss_ref(h, w, labels, old.to(h.dtype), adv.to(h.dtype), mask, **f)
        return loss, lp, ent

    names = ("value", "log_prob", "entropy", "dhidden", "dweight")
    case = f"N{N_CHECK}-H{H}-V{V}-bf16 vs fp64"
    for op, ours, theirs in (("linear_log_probs", lin_dk, lin_ref), ("fused_loss", fused_dk, fused_ref)):
        with report.section(op, case, impl="references (fp64, bf16)"):  # each op and backend: one row, even failing
            r64 = _grads(theirs, hidden, weight, torch.float64)
            plain = _grads(theirs, hidden, weight, torch.bfloat16)
            for be in ("triton", "torch"):
                with report.section(op, case, impl=f"dk {be}"):
                    _compare(report, op, case, be, _grads_in(be, ours, hidden, weight), r64, plain, names)
            del r64, plain


def _grads_in(be, fn, hidden, weight):
    with dk.use_backend(be):
        return _grads(fn, hidden, weight, torch.bfloat16)


def _compare(report, op, case, be, out, r64, plain, names):
    """One row: every output within 2x plain bf16 torch's error against fp64, log-prob error < 1e-3."""
    bad, worst = [], 0.0
    for name, o, r, p in zip(names, out, r64, plain):
        floor = torch.finfo(o.dtype if o.dtype != torch.float64 else torch.float32).eps * r.abs().max().item()
        bound = 2 * max(_err(p, r), floor)
        worst = max(worst, _err(o, r) / bound)
        if _err(o, r) > bound:
            bad.append(f"{name} {_err(o, r):.2e}>{bound:.2e}")
    lp_err = _err(out[1], r64[1])
    if lp_err >= 1e-3:
        bad.append(f"log_prob err {lp_err:.2e} >= 1e-3")
    report.add(op, case, impl=f"dk {be}", metric=f"lp err {lp_err:.1e}, worst err/bound {worst:.2f}",
               status="FAIL" if bad else "ok", note="; ".join(bad)[:120])


def _step_dk(hidden, weight, labels, old, adv, mask):
    loss, _ = dk.fused_linear_policy_loss(hidden, weight, labels, old, adv, mask)
    loss.backward()


def _step_naive(hidden, weight, labels, old, adv, mask):
    logits = (hidden @ weight.t()).float()
    log_prob = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
    ratio = torch.exp(torch.clamp(log_prob - old, -20, 20))
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28))
    pg = torch.where(adv < 0, torch.minimum(-adv * 3.0, pg), pg)
    ((pg * mask).sum() / mask.sum()).backward()


def _liger_flce_step():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    fn = LigerFusedLinearCrossEntropyLoss(reduction="mean")

    def step(hidden, weight, labels, old, adv, mask):
        out = fn(weight, hidden, labels.masked_fill(~mask, -100))  # masked tokens: ignore_index
        (out[0] if isinstance(out, tuple) else out).backward()

    return step


def _liger_step():
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # compiled=False: torch.compile of Liger's chunk function would not fit this check's budget.
    fn = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, epsilon_low=0.2,
                                  epsilon_high=0.28, loss_type="dapo")

    def step(hidden, weight, labels, old, adv, mask):
        out = fn(hidden.view(B, N // B, H), weight, labels.view(B, N // B), mask.view(B, N // B).long(),
                 adv.view(B, N // B)[:, 0], old_per_token_logps=old.view(B, N // B))
        (out[0] if isinstance(out, tuple) else out).backward()

    return step


def _matmuls_ms(hidden, weight):
    """logits = h W^T, dH = G W, dW = G^T h in bf16: what any exact method must at least do."""
    g = torch.empty(N, V, device=DEVICE, dtype=torch.bfloat16)
    d_w = torch.empty_like(weight)

    def matmuls():
        torch.mm(hidden, weight.t(), out=g)
        torch.mm(g, weight)
        torch.mm(g.t(), hidden, out=d_w)

    return cuda_time_ms(matmuls, warmup=1, iters=3)


HBM_BYTES_PER_S = 4.8e12  # H200


def _extra_bytes(n, h, v, item):
    """HBM bytes dk moves beyond the three bare matmuls' own traffic: the logits written in fp32
    rather than 16-bit, read by the statistics kernel and by the dz kernel, dz written (the GEMMs
    read it as the bare dH / dW do), and exact_logits' two gathered [N, H] weight rows in fp64."""
    return n * v * ((4 - item) + 4 + 4 + item) + 2 * n * h * (item + 3 * 8)


def _speed(report):
    hidden, weight, labels, old, adv, mask, _ = _inputs(N)
    flops = 6 * N * H * V
    case = f"N{N}-H{H}-V{V}-bf16 fwd+bwd"

    base_ms = None  # (the rows below leave out their ratio to it if it failed)
    with report.section("fused_loss", case, impl="3 bf16 matmuls"):
        base_ms = _matmuls_ms(hidden, weight)
        report.add("fused_loss", case, impl="3 bf16 matmuls", ms=base_ms, metric=f"{flops / base_ms / 1e9:.0f} TFLOP/s",
                   tflops=flops / base_ms / 1e9)
    torch.cuda.empty_cache()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    args = (h, w, labels, old, adv, mask)
    steps = [("dk triton", _step_dk)]
    for impl, make in (("liger fused linear CE", _liger_flce_step), ("liger GRPO chunked (eager)", _liger_step)):
        try:
            steps.append((impl, make()))
        except ImportError as e:  # a peer, not a dependency: its row says so
            report.add("fused_loss", case, impl=impl, status="skip", note=f"liger-kernel not installed ({e})"[:120])
        except Exception as e:
            report.add("fused_loss", case, impl=impl, status="skip", note=f"{type(e).__name__}: {e}"[:120])
    steps.append(("naive fp32 logits", _step_naive))
    for impl, step in steps:
        try:
            with dk.use_backend("triton"):
                def run():
                    h.grad = w.grad = None
                    step(*args)

                ms = cuda_time_ms(run, warmup=1, iters=3)
                h.grad = w.grad = None
                mem = peak_mem_mb(run)
            ratio = f", {ms / base_ms:.2f}x matmuls" if base_ms else ""
            metric = f"{flops / ms / 1e9:.0f} TFLOP/s{ratio}, peak +{mem:.0f} MiB"
            if impl.startswith("dk"):
                grads_mib = (h.numel() * h.element_size() + w.numel() * w.element_size()) / 2**20
                model_mib = workspace_bytes(N, H, V, h.dtype) / 2**20
                metric += f" = grads {grads_mib:.0f} + workspace {mem - grads_mib:.0f} (model {model_mib:.0f})"
                if base_ms:
                    pred = base_ms + _extra_bytes(N, H, V, h.element_size()) / HBM_BYTES_PER_S * 1e3
                    metric += f"; predicted {pred:.1f} ms ({pred / base_ms:.2f}x) from bytes"
            report.add("fused_loss", case, impl=impl, ms=ms, metric=metric, tflops=flops / ms / 1e9)
        except Exception as e:  # Liger / naive out of memory or broken: a row, not a crash
            report.add("fused_loss", case, impl=impl, status="skip" if impl != "dk triton" else "FAIL",
                       note=f"{type(e).__name__}: {e}"[:120])
        h.grad = w.grad = None
        torch.cuda.empty_cache()


def run(report):
    with report.section("fused_loss", "correctness"):
        _correctness(report)
    torch.cuda.empty_cache()
    with report.section("fused_loss", "speed"):
        _speed(report)
