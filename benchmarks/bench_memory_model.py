"""dapo-tune's memory model (dapo_trainer.memory_model.train_memory) against the peak measured on the CPU.

Run: ``PYTHONPATH=. python benchmarks/bench_memory_model.py`` (prints the table of RESULTS.md; about
a minute) or through pytest (the within-15% check).

Each case runs in a fresh process (one thread, glibc's mmap threshold pinned so that freed tensors
leave the resident set): after a warm-up step of a tiny model (kernels, thread pools: fixed costs),
the peak resident set is reset (``/proc/self/clear_refs``), then the model is built (float32,
Llama-shaped), AdamW's states are created by a step on zero gradients, and one update step runs as
the trainer's does: a packed micro-batch (sequences of 256 tokens) through the model,
``dk.fused_linear_policy_loss`` (on-policy, token mean, entropy computed), backward, gradient
clipping, AdamW step. Measured: peak resident set minus the resident set before the model was built.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# (name, hidden, intermediate, layers, heads, kv heads, vocab): 4 sizes, 8M to 90M parameters.
SIZES = [("8M", 256, 768, 4, 4, 2, 8192), ("25M", 512, 1536, 4, 8, 4, 8192),
         ("50M", 640, 1792, 6, 10, 5, 16384), ("90M", 768, 2048, 8, 12, 4, 16384)]
TOKENS = (512, 2048)
TOLERANCE = 0.15


def _model_config(name, H, I, L, nh, nkv, V):
    from dapo_trainer.model import ModelConfig

    return ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=L, num_heads=nh,
                       num_kv_heads=nkv, head_dim=H // nh, max_position_embeddings=4096)


def _rss(field):
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith(field + ":"))


def _step(model, opt, tokens, seq=256):
    import torch

    import dapo_kernels as dk

    n = max(1, tokens // seq)
    cu = torch.tensor([i * tokens // n for i in range(n + 1)], dtype=torch.int32)
    ids = torch.randint(0, model.config.vocab_size, (tokens,))
    hidden = model(ids, cu, int((cu[1:] - cu[:-1]).max()))
    mask = torch.ones(tokens, dtype=torch.bool)
    loss, _ = dk.fused_linear_policy_loss(hidden, model.lm_head.weight, torch.roll(ids, -1), None,
                                          torch.randn(tokens), mask, num_tokens=tokens, calculate_entropy=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(size, tokens) -> int:
    """In this process: the peak bytes above the resident set before the model was built."""
    import torch

    from dapo_trainer.model import Transformer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    warm = Transformer(_model_config("w", 64, 128, 1, 2, 1, 256)).init_weights()
    _step(warm, torch.optim.AdamW(warm.parameters()), 64)
    del warm
    base = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    model = Transformer(_model_config(*size)).init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the moments, as every step after the first has them
    opt.zero_grad(set_to_none=True)
    _step(model, opt, tokens)
    return _rss("VmHWM") - base


def run_case(size, tokens) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps([size, tokens])], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return int(out.stdout.strip().splitlines()[-1])


def table():
    from dapo_trainer.memory_model import train_memory

    rows = []
    for size in SIZES:
        for tokens in TOKENS:
            pred = train_memory(_model_config(*size), tokens, foreach=False)  # torch's AdamW loops on the CPU
            rows.append((size[0], _model_config(*size).num_params(), tokens, pred, run_case(size, tokens)))
    return rows


def format_table(rows) -> str:
    mib = 1 << 20
    lines = ["| model | params | tokens | params+grads+Adam MiB | activations MiB | loss MiB | predicted peak MiB "
             "| measured peak MiB | error |", "|---|---|---|---|---|---|---|---|---|"]
    for name, n, tokens, p, m in rows:
        states = (p["params"] + p["grads"] + p["optimizer"]) / mib
        lines.append(f"| {name} | {n / 1e6:.1f}M | {tokens} | {states:.0f} | "
                     f"{(p['activations'] + p['backward']) / mib:.0f} | {p['loss'] / mib:.0f} | "
                     f"{p['peak'] / mib:.0f} | "
                     f"{m / mib:.0f} | {100 * (p['peak'] - m) / m:+.1f}% |")
    return "\n".join(lines)


@pytest.mark.slow
def test_memory_model_within_15_percent():
    rows = table()
    print("\n" + format_table(rows))
    for name, _, tokens, pred, measured in rows:
        assert abs(pred["peak"] - measured) <= TOLERANCE * measured, (name, tokens, pred["peak"], measured)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        size, tokens = json.loads(sys.argv[2])
        print(measure(tuple(size), tokens))
    else:
        print(format_table(table()))
