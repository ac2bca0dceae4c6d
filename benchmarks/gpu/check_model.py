"""GPU check of dapo_trainer.model: MFU of a training step of a 0.5B-shaped model, parity.

* MFU: Qwen2.5-0.5B shapes (hidden 896, 24 layers, 14/2 heads of 64, ffn 4864, tied
  vocab 151936), random weights in bf16, a packed batch of 16 sequences (lengths
  uniform in [256, 2048], ~18k tokens); one step = forward, fused log-probs
  (``dk.linear_log_probs``), masked mean, backward. FLOPs counted as
  ``6 * params * tokens`` (the tied embedding counted once, as the lm_head matmul) plus
  causal attention ``6 * layers * heads * head_dim * sum(L^2)`` (QK^T and PV, forward +
  2x backward, half the square). Peak: the GPU's dense bf16 rate from its name.
* Parity: a 2-layer fp32 model on the GPU (Triton kernels) against the same weights on
  the CPU (torch paths); logits max relative error. The GPU kernels may use TF32 dots,
  so the bound is TF32's (~1e-3 relative per dot), not fp32's.

Budget: ~40 s (Triton compilation included).
"""
import dataclasses

import torch

from dapo_trainer import ModelConfig, Transformer
from gpu.common import cuda_time_ms, peak_mem_mb

QWEN25_05B = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                         num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, qkv_bias=True,
                         tie_word_embeddings=True, model_type="qwen2")
# Dense bf16 matmul ceilings, by substring of the device name. H200 / H100: what an 8192^3 bf16
# torch.mm reaches on random data on this workplace's H200 (769-798 TFLOP/s, device notes of
# 2026-10-28 / 11-04), not the 989 of the datasheet: MFU against what the chip delivers. The
# others are datasheet dense peaks (not measured here).
PEAK_BF16 = {"H200": 790e12, "H100": 790e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12,
             "L40S": 362e12, "4090": 165e12}
PARITY_BOUND = 1e-2


def _batch(lengths, vocab, device):
    lens = torch.tensor(lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    ids = torch.randint(0, vocab, (int(cu[-1]),))
    valid = torch.ones(ids.shape[0], dtype=torch.bool)
    valid[cu[1:].long() - 1] = False
    return ids.to(device), cu.to(device), max(lengths), valid.to(device)


def _train_step(model, ids, cu, max_seqlen, valid):
    hidden = model(ids, cu, max_seqlen)
    log_prob, _ = model.log_probs(hidden, torch.roll(ids, -1))
    loss = -(log_prob * valid).sum() / valid.sum()
    loss.backward()
    return loss


def _mfu(report):
    cfg = QWEN25_05B
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(cfg).to(torch.bfloat16).init_weights()
    lengths = torch.randint(256, 2049, (16,)).tolist()
    ids, cu, max_seqlen, valid = _batch(lengths, cfg.vocab_size, "cuda")
    tokens = ids.shape[0]
    loss = _train_step(model, ids, cu, max_seqlen, valid)  # compiles the Triton kernels
    ok = bool(torch.isfinite(loss))
    flops = 6 * cfg.num_params() * tokens + 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum(
        L * L for L in lengths)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    case = f"0.5B bf16 T{tokens}"
    for ckpt in (False, True):
        with report.section("model", case + (" ckpt" if ckpt else ""), impl="fwd+bwd+log_probs"):
            _time_step(report, model, (ids, cu, max_seqlen, valid), ckpt, flops, peak, case, ok, loss)


def _time_step(report, model, batch, ckpt, flops, peak, case, ok, loss):
    model.activation_checkpointing = ckpt

    def step():
        _train_step(model, *batch)
        model.zero_grad(set_to_none=True)

    ms = cuda_time_ms(step, warmup=1, iters=5)
    mem = peak_mem_mb(step)
    tflops = flops / ms / 1e9
    mfu = f", MFU {100 * tflops * 1e12 / peak:.1f}%" if peak else ""
    tok_s = batch[0].shape[0] / ms * 1e3
    report.add("model", case + (" ckpt" if ckpt else ""), impl="fwd+bwd+log_probs", ms=ms,
               metric=f"{tok_s:,.0f} tok/s, {tflops:.0f} TFLOP/s{mfu}, peak {mem / 1024:.1f} GiB",
               status="ok" if ok else "FAIL", note="" if ok else f"loss {loss.item()}", tflops=tflops)


def _parity(report):
    cfg = dataclasses.replace(QWEN25_05B, num_layers=2, vocab_size=4096)
    torch.manual_seed(1)
    cpu_model = Transformer(cfg).init_weights()
    gpu_model = Transformer(cfg).to("cuda")
    gpu_model.load_state_dict(cpu_model.state_dict())
    ids, cu, max_seqlen, _ = _batch([300, 17, 1024, 1], cfg.vocab_size, "cpu")
    with torch.no_grad():
        ref = cpu_model.logits(cpu_model(ids, cu, max_seqlen)).double()
        out = gpu_model.logits(gpu_model(ids.cuda(), cu.cuda(), max_seqlen)).double().cpu()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    report.add("model", "2-layer fp32 GPU vs CPU", impl="logits", metric=f"max rel err {err:.1e}",
               status="ok" if err < PARITY_BOUND else "FAIL", note=f"bound {PARITY_BOUND:g} (TF32 dots)")


def run(report):
    with report.section("model", "2-layer fp32 GPU vs CPU", impl="logits"):
        _parity(report)
    with report.section("model", "0.5B bf16", impl="fwd+bwd+log_probs"):
        _mfu(report)  # its 0.5B model is freed on return
    torch.cuda.empty_cache()
